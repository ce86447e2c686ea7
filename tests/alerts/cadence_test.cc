// Counts in training steps, not samples (issue 33): a detector calibrated at
// one sample every 10 steps judges a series probed every 5, 25 or 50 steps over
// the same span of training steps.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "alerts/change_detector.h"
#include "alerts/config.h"
#include "codec/state_codec.h"

namespace foreshock::alerts {
namespace {

// The generic defaults (warmup 12, window 40, gap 8, min_baseline 4, 3 of 5,
// clear_after 10), calibrated at a probe every 10 steps.
ChangeDetectorOptions ProbeOptions(Direction direction) {
  ChangeDetectorOptions options;
  options.direction = direction;
  options.reference_interval_steps = 10;
  options.warmup_steps = 200;
  return options;
}

void ExpectCounts(const SampleCounts& c, std::vector<int> expected, const char* what) {
  EXPECT_EQ((std::vector<int>{c.warmup, c.window, c.gap, c.min_baseline, c.persist_m,
                              c.persist_n, c.clear_after}),
            expected)
      << what;
}

TEST(CadenceTest, CountsScaleToTheSameSpanOfStepsWithinTheirFloors) {
  const ChangeDetectorOptions o = ProbeOptions(Direction::kDrop);
  ExpectCounts(CountsForInterval(o, 0), {12, 40, 8, 4, 3, 5, 10}, "interval unknown");
  ExpectCounts(CountsForInterval(o, 10), {12, 40, 8, 4, 3, 5, 10}, "the reference interval");
  ExpectCounts(CountsForInterval(o, 5), {24, 80, 16, 8, 6, 10, 20}, "every 5 steps");
  ExpectCounts(CountsForInterval(o, 20), {6, 20, 4, 3, 2, 3, 5}, "every 20 steps");
  // 2 of 2 is the floor of persistence; the gap stays >= persist_n.
  ExpectCounts(CountsForInterval(o, 50), {3, 8, 2, 3, 2, 2, 2}, "every 50 steps");
  ExpectCounts(CountsForInterval(o, 1000), {3, 8, 2, 3, 2, 2, 2}, "every 1000 steps");
  ExpectCounts(CountsForInterval(o, 1), {48, 160, 32, 16, 12, 20, 40}, "every step: 4x at most");
  // A guard on 1 of 1 stays 1 of 1; 0 stays 0.
  ChangeDetectorOptions guard = o;
  guard.persist_m = guard.persist_n = 1;
  guard.warmup = 0;
  const SampleCounts g = CountsForInterval(guard, 50);
  EXPECT_EQ(g.persist_m, 1);
  EXPECT_EQ(g.persist_n, 1);
  EXPECT_EQ(g.warmup, 0);
  // Without a reference the counts are samples at any cadence.
  ChangeDetectorOptions samples = o;
  samples.reference_interval_steps = 0;
  ExpectCounts(CountsForInterval(samples, 50), {12, 40, 8, 4, 3, 5, 10}, "no reference");
}

struct Outcome {
  int64_t first_scored_step = -1;
  int64_t confirmed_step = -1;  // first kAnomalous
  int episodes = 0;
};

// A drop signal (a QK-increment entropy) at 0.8 with 1% noise from step 0,
// sampled every `every` steps; from `change_step` on, `changed` for
// `change_steps` steps, then back to 0.8 (change_steps < 0: for good).
Outcome RunSeries(const ChangeDetectorOptions& options, int64_t every, int64_t change_step,
            double changed, int64_t change_steps, int64_t end_step, uint64_t seed,
            double sigma = 0.008) {
  ChangeDetector detector(options);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> noise(0.0, sigma);
  Outcome out;
  for (int64_t step = 0; step <= end_step; step += every) {
    const bool in_change =
        step >= change_step && (change_steps < 0 || step < change_step + change_steps);
    const double value = (in_change ? changed : 0.8) + noise(rng);
    const SeriesState before = detector.state();
    const ChangeAssessment a = detector.Update(step, value);
    if (a.disposition == ChangeAssessment::Disposition::kScored && !std::isnan(a.baseline) &&
        out.first_scored_step < 0) {
      out.first_scored_step = step;
    }
    if (a.state == SeriesState::kAnomalous && before != SeriesState::kAnomalous) {
      ++out.episodes;
      if (out.confirmed_step < 0) out.confirmed_step = step;
    }
  }
  return out;
}

// The finding: with counts in samples a probe every 50 steps needed
// 3 of 5 probes (up to 250 steps) to confirm and was first judged against a
// baseline 13 probes after step 200 (step 850+); a probe every 5 steps
// confirmed on 15 steps. In steps, every cadence confirms a lasting collapse
// within the same ~50 steps and judges the series from about the same step.
TEST(CadenceTest, ALastingCollapseConfirmsWithinTheSameStepsAtEveryCadence) {
  for (int64_t every : {5, 10, 20, 25, 50}) {
    SCOPED_TRACE(every);
    const Outcome o =
        RunSeries(ProbeOptions(Direction::kDrop), every, 1500, 0.4, -1, 2500, 7 + every);
    ASSERT_GE(o.confirmed_step, 1500);
    // 6 of 10 at a probe every 5 steps, 3 of 5 at 10, 2 of 2 at 25 and 50.
    EXPECT_LE(o.confirmed_step - 1500, 50);
    EXPECT_GE(o.confirmed_step - 1500, every >= 25 ? every : 20);
    EXPECT_EQ(o.episodes, 1);
    // Judged against a baseline by step 500 at every cadence (in samples:
    // step 850 at a probe every 50).
    EXPECT_GT(o.first_scored_step, 200);
    EXPECT_LE(o.first_scored_step, 500);
  }
  // Counts in samples (the old behaviour): the probe every 50 steps needs 3
  // probes (100 steps) and is first judged after step 800.
  ChangeDetectorOptions samples = ProbeOptions(Direction::kDrop);
  samples.reference_interval_steps = 0;
  const Outcome old = RunSeries(samples, 50, 1500, 0.4, -1, 2500, 57);
  EXPECT_EQ(old.confirmed_step - 1500, 100);
  EXPECT_GE(old.first_scored_step, 800);
}

// At a probe every 5 steps, a 20-step excursion (4 probes) is not confirmed:
// persistence spans 50 steps as at the reference cadence, where 3 of 5 probes
// also cover 20-50 steps. Counted in samples, it confirmed.
TEST(CadenceTest, AShortExcursionAtADenseCadenceIsNotConfirmed) {
  const Outcome steps = RunSeries(ProbeOptions(Direction::kDrop), 5, 1500, 0.4, 20, 2500, 11);
  EXPECT_EQ(steps.episodes, 0);
  ChangeDetectorOptions samples = ProbeOptions(Direction::kDrop);
  samples.reference_interval_steps = 0;
  const Outcome old = RunSeries(samples, 5, 1500, 0.4, 20, 2500, 11);
  EXPECT_EQ(old.episodes, 1);
}

// Noise as large as the 10% gate, alone: at every cadence no episode over the
// same 200,000 training steps (2,000 to 40,000 probes per seed).
TEST(CadenceTest, StationaryNoiseStaysQuietAtEveryCadence) {
  for (int64_t every : {5, 10, 25, 50}) {
    for (uint64_t seed = 0; seed < 5; ++seed) {
      const Outcome o = RunSeries(ProbeOptions(Direction::kDrop), every, int64_t{1} << 40, 0.0, -1,
                            200'000, seed * 131 + every, 0.08);
      EXPECT_EQ(o.episodes, 0) << "every " << every << " seed " << seed;
    }
  }
}

// A state saved at a dense cadence (the largest counts) restores into the
// same options, and the restored detector goes on like the saved one.
TEST(CadenceTest, AStateSavedAtADenseCadenceRestores) {
  const ChangeDetectorOptions options = ProbeOptions(Direction::kDrop);
  ChangeDetector saved(options);
  std::mt19937_64 rng(3);
  std::normal_distribution<double> noise(0.0, 0.008);
  int64_t step = 0;
  for (; step < 2000; step += 2) saved.Update(step, 0.8 + noise(rng));
  EXPECT_EQ(saved.counts().window, 160);  // every 2 steps: 4x at most
  codec::StateWriter writer;
  saved.SaveState(writer);
  const std::string bytes = writer.Take();
  ChangeDetector restored(options);
  codec::StateReader reader(bytes);
  ASSERT_TRUE(restored.RestoreState(reader));
  EXPECT_EQ(restored.counts().window, 160);
  for (; step < 2400; step += 2) {
    const double value = (step >= 2200 ? 0.4 : 0.8) + noise(rng);
    const ChangeAssessment a = saved.Update(step, value);
    const ChangeAssessment b = restored.Update(step, value);
    ASSERT_EQ(a.state, b.state) << step;
    ASSERT_EQ(a.z, b.z) << step;
  }
  EXPECT_EQ(saved.state(), SeriesState::kAnomalous);
}

// The max-logit bound needs no baseline, and its start is a training step:
// a series above the bound from the first probe, and growing (3x per 100
// steps, as an LR too high for the architecture grows it), is judged from
// step 30 and confirmed within about the same steps at every cadence. Its start was the
// run's 4th probe (step 30 at every 10, 150 at every 50, firing at 200 when
// the natural benchmark's runs at every 50 were damaged from step 136).
double Runaway(int64_t step) { return 150.0 * std::pow(3.0, static_cast<double>(step) / 100.0); }

TEST(CadenceTest, TheMaxLogitBoundStartsAtTheSameStepAtEveryCadence) {
  const ChangeDetectorOptions bound =
      DefaultAlertConfig().signals.at("attention_max_logit").detector;
  for (int64_t every : {5, 10, 25, 50}) {
    SCOPED_TRACE(every);
    ChangeDetector detector(bound);
    int64_t first_judged = -1, fired = -1;
    for (int64_t step = 0; step <= 400 && fired < 0; step += every) {
      const ChangeAssessment a = detector.Update(step, step == 0 ? 0.1 : Runaway(step));
      if (a.guard_flag && first_judged < 0) first_judged = step;
      if (a.state == SeriesState::kAnomalous) fired = step;
    }
    EXPECT_EQ(first_judged, (30 + every - 1) / every * every);  // the first probe at or after 30
    EXPECT_LE(fired, 100);
    EXPECT_GE(fired, every == 5 ? 55 : every == 10 ? 50 : every == 25 ? 75 : 100);
  }
  // Counted in probes (the previous default, warm-up 3 samples), a probe every
  // 50 steps is first judged at step 150 and fires at 200.
  ChangeDetectorOptions in_probes = bound;
  in_probes.warmup = 3;
  in_probes.warmup_steps = 0;
  ChangeDetector detector(in_probes);
  int64_t fired = -1;
  for (int64_t step = 0; step <= 400 && fired < 0; step += 50) {
    if (detector.Update(step, step == 0 ? 0.1 : Runaway(step)).state == SeriesState::kAnomalous) {
      fired = step;
    }
  }
  EXPECT_EQ(fired, 200);
}

// The built-in defaults: probe signals are calibrated at a probe every 10
// steps; the curvature, the step scalars and the direct checks stay in samples.
TEST(CadenceTest, DefaultsSayWhichSignalsCountInSteps) {
  const AlertConfig config = DefaultAlertConfig();
  EXPECT_EQ(config.signals.at("qk_increment_entropy").detector.reference_interval_steps, 10);
  EXPECT_EQ(config.signals.at("router_entropy").detector.reference_interval_steps, 10);
  EXPECT_EQ(config.signals.at("attention_max_logit").detector.reference_interval_steps, 10);
  EXPECT_EQ(config.signals.at("curvature_eos_ratio").detector.reference_interval_steps, 0);
  EXPECT_EQ(config.signals.at("loss").detector.reference_interval_steps, 0);
  EXPECT_EQ(config.signals.at("attention_output_bias").detector.reference_interval_steps, 0);
  EXPECT_EQ(config.signals.at("loss_over_running_min").detector.reference_interval_steps, 0);
}

}  // namespace
}  // namespace foreshock::alerts
