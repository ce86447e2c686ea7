// The change detector on synthetic series: what must fire (step changes, in
// the right direction, at the right step), and what must not (healthy drift,
// isolated spikes, stationary noise, flapping around a threshold).
#include "alerts/change_detector.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

namespace foreshock::alerts {
namespace {

constexpr int64_t kStepsPerSample = 10;

// Feeds a series one sample per kStepsPerSample steps and records what the
// detector concluded.
struct Trace {
  std::vector<ChangeAssessment> samples;
  int episodes = 0;          // transitions into kAnomalous
  int clears = 0;            // transitions out of kAnomalous
  int pending_samples = 0;   // samples that left the series kPending
  int first_anomalous = -1;  // sample index of the first kAnomalous state
};

Trace Feed(ChangeDetector& detector, const std::vector<double>& values, int first_index = 0) {
  Trace trace;
  for (size_t i = 0; i < values.size(); ++i) {
    const int index = first_index + static_cast<int>(i);
    const SeriesState before = detector.state();
    const ChangeAssessment a = detector.Update(index * kStepsPerSample, values[i]);
    if (a.state == SeriesState::kAnomalous && before != SeriesState::kAnomalous) {
      ++trace.episodes;
      if (trace.first_anomalous < 0) trace.first_anomalous = index;
    }
    if (a.state != SeriesState::kAnomalous && before == SeriesState::kAnomalous) ++trace.clears;
    if (a.state == SeriesState::kPending) ++trace.pending_samples;
    trace.samples.push_back(a);
  }
  return trace;
}

std::vector<double> Noisy(int n, double level, double sigma, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> noise(0.0, sigma);
  std::vector<double> values(static_cast<size_t>(n));
  for (double& v : values) v = level + noise(rng);
  return values;
}

std::vector<double> Concat(std::vector<double> a, const std::vector<double>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

ChangeDetectorOptions Options(Direction direction) {
  ChangeDetectorOptions options;
  options.direction = direction;
  return options;
}

TEST(ChangeDetectorTest, StepDropFiresAtPersistenceWithOnsetAtTheStep) {
  ChangeDetector detector(Options(Direction::kDrop));
  const auto series = Concat(Noisy(200, 1.0, 0.01, 1), Noisy(50, 0.6, 0.01, 2));
  const Trace trace = Feed(detector, series);

  EXPECT_EQ(trace.episodes, 1);
  // persist_m = 3: the third anomalous sample confirms it.
  EXPECT_EQ(trace.first_anomalous, 202);
  const ChangeAssessment& confirming = trace.samples[202];
  EXPECT_EQ(confirming.onset_step, 200 * kStepsPerSample);
  EXPECT_NEAR(confirming.baseline, 1.0, 0.01);
  EXPECT_LT(confirming.z, -5.0);
  EXPECT_NEAR(confirming.relative_change, -0.4, 0.03);
  // Samples 200 and 201 were pending, nothing before.
  EXPECT_EQ(trace.samples[199].state, SeriesState::kNormal);
  EXPECT_EQ(trace.samples[200].state, SeriesState::kPending);
  EXPECT_EQ(trace.samples[201].state, SeriesState::kPending);
}

// Early training's transient (the QK-increment entropy of a head leaving
// random init: 0.8 for a few probes, then a fall to 0.35 that stays) is not a
// collapse once the series starts after it (warmup_steps), whatever the
// cadence; without it, a baseline of the first probes makes it one.
TEST(ChangeDetectorTest, WarmupStepsKeepsTheEarlyTransientOutOfTheBaseline) {
  for (const int64_t every : {5, 10, 25}) {
    std::vector<std::pair<int64_t, double>> series;
    std::mt19937_64 rng(static_cast<uint64_t>(every));
    std::normal_distribution<double> noise(0.0, 0.01);
    for (int64_t step = every; step <= 2000; step += every) {
      const double level = step < 80 ? 0.8 : step < 140 ? 0.8 - 0.45 * (step - 80) / 60.0 : 0.35;
      series.emplace_back(step, level + noise(rng));
    }
    auto episodes = [&](int64_t warmup_steps) {
      ChangeDetectorOptions options = Options(Direction::kDrop);
      options.warmup_steps = warmup_steps;
      ChangeDetector detector(options);
      int count = 0;
      for (const auto& [step, value] : series) {
        const SeriesState before = detector.state();
        const ChangeAssessment a = detector.Update(step, value);
        if (step < warmup_steps) {
          EXPECT_EQ(a.disposition, ChangeAssessment::Disposition::kWarmup);
        }
        count += a.state == SeriesState::kAnomalous && before != SeriesState::kAnomalous;
      }
      return count;
    };
    if (every <= 10) {
      EXPECT_GE(episodes(0), 1) << "every " << every;
    }
    EXPECT_EQ(episodes(300), 0) << "every " << every;
  }
  // After warmup_steps a collapse still fires.
  ChangeDetectorOptions options = Options(Direction::kDrop);
  options.warmup_steps = 300;
  ChangeDetector detector(options);
  const auto values = Concat(Noisy(200, 1.0, 0.01, 11), Noisy(50, 0.6, 0.01, 12));
  int first = -1;
  for (size_t i = 0; i < values.size(); ++i) {
    const ChangeAssessment a = detector.Update(static_cast<int64_t>(i) * 10, values[i]);
    if (first < 0 && a.state == SeriesState::kAnomalous) first = static_cast<int>(i);
  }
  EXPECT_EQ(first, 202);
}

TEST(ChangeDetectorTest, StepRiseFiresOnlyTheRiseDetector) {
  const auto rise = Concat(Noisy(200, 5.0, 0.05, 3), Noisy(50, 8.0, 0.05, 4));
  ChangeDetector rise_detector(Options(Direction::kRise));
  ChangeDetector drop_detector(Options(Direction::kDrop));
  const Trace rise_trace = Feed(rise_detector, rise);
  const Trace drop_trace = Feed(drop_detector, rise);
  EXPECT_EQ(rise_trace.episodes, 1);
  EXPECT_EQ(rise_trace.first_anomalous, 202);
  EXPECT_GT(rise_trace.samples[202].z, 5.0);
  EXPECT_EQ(drop_trace.episodes, 0);
  EXPECT_EQ(drop_trace.pending_samples, 0);
}

TEST(ChangeDetectorTest, HealthyDecayingEntropyDoesNotFire) {
  // Attention entropy falls fast early and slowly later (attention sharpens
  // as it trains): 3.0 -> 1.5 with a 150-sample time constant, 1% noise.
  std::mt19937_64 rng(5);
  std::normal_distribution<double> noise(0.0, 1.0);
  std::vector<double> series;
  for (int t = 0; t < 3000; ++t) {
    const double level = 1.5 + 1.5 * std::exp(-t / 150.0);
    series.push_back(level * (1 + 0.01 * noise(rng)));
  }
  ChangeDetector detector(Options(Direction::kDrop));
  EXPECT_EQ(Feed(detector, series).episodes, 0);
}

TEST(ChangeDetectorTest, HealthyGrowingMaxLogitDoesNotFire) {
  // Max logit grows linearly from 5 to 25 over 2000 samples, 2% noise.
  std::mt19937_64 rng(6);
  std::normal_distribution<double> noise(0.0, 1.0);
  std::vector<double> series;
  for (int t = 0; t < 2000; ++t) series.push_back((5.0 + 0.01 * t) * (1 + 0.02 * noise(rng)));
  ChangeDetectorOptions options = Options(Direction::kRise);
  options.min_relative_change = 0.25;
  ChangeDetector detector(options);
  EXPECT_EQ(Feed(detector, series).episodes, 0);
}

// A steady linear fall of 0.8% of the start level per sample, from 2.0 to 0.4.
std::vector<double> FastLinearDrift() {
  std::vector<double> series;
  for (int t = 0; t < 200; ++t) series.push_back(2.0 - 0.008 * t);
  return series;
}

TEST(ChangeDetectorTest, FollowingTheTrendToleratesADriftThatAFixedLagFlags) {
  ChangeDetectorOptions without_trend = Options(Direction::kDrop);
  without_trend.trend = false;
  ChangeDetector lagging(without_trend);
  // Without the trend, the lagged median trails by ~28 samples: > 10% late in the drift.
  EXPECT_GE(Feed(lagging, FastLinearDrift()).episodes, 1);

  ChangeDetector following(Options(Direction::kDrop));
  EXPECT_EQ(Feed(following, FastLinearDrift()).episodes, 0);
}

TEST(ChangeDetectorTest, ACollapseFasterThanTheTrendStillFires) {
  std::vector<double> series = FastLinearDrift();
  series.resize(120);  // drift down to 1.05 ...
  const double level = series.back();
  for (int t = 0; t < 20; ++t) series.push_back(0.6 * level);  // ... then lose 40% at once
  ChangeDetector detector(Options(Direction::kDrop));
  const Trace trace = Feed(detector, series);
  EXPECT_EQ(trace.episodes, 1);
  EXPECT_EQ(trace.first_anomalous, 122);
  EXPECT_EQ(trace.samples[122].onset_step, 120 * kStepsPerSample);
}

TEST(ChangeDetectorTest, TrendAgainstTheAlertDirectionIsNotExtrapolated) {
  // Entropy rising then flat: extrapolating the rise would make the plateau
  // look like a drop. The drop detector must only follow falling trends.
  std::vector<double> series;
  for (int t = 0; t < 100; ++t) series.push_back(1.0 + 0.01 * t);
  for (int t = 0; t < 200; ++t) series.push_back(2.0);
  ChangeDetectorOptions options = Options(Direction::kDrop);
  options.min_relative_change = 0.02;  // small, so any extrapolation overshoot would show
  ChangeDetector detector(options);
  EXPECT_EQ(Feed(detector, series).episodes, 0);
}

TEST(ChangeDetectorTest, IsolatedSpikesDoNotFire) {
  std::vector<double> series = Noisy(3000, 1.0, 0.01, 7);
  // A 50% dip every 40 samples, and a 2-sample dip every 40 samples in
  // between: both below persist_m = 3 within persist_n = 5.
  for (size_t i = 100; i + 21 < series.size(); i += 40) {
    series[i] = 0.5;
    series[i + 20] = 0.5;
    series[i + 21] = 0.5;
  }
  ChangeDetector detector(Options(Direction::kDrop));
  const Trace trace = Feed(detector, series);
  EXPECT_EQ(trace.episodes, 0);
  EXPECT_GT(trace.pending_samples, 0) << "the spikes were not even seen";
}

// Episodes (entries into kAnomalous) on `samples` of 1 + noise.
template <typename Noise>
int FalsePositiveEpisodes(Direction direction, int samples, uint64_t seed, Noise noise) {
  std::mt19937_64 rng(seed);
  ChangeDetector detector(Options(direction));
  int episodes = 0;
  for (int t = 0; t < samples; ++t) {
    const SeriesState before = detector.state();
    const ChangeAssessment a = detector.Update(t, 1.0 + noise(rng));
    episodes += a.state == SeriesState::kAnomalous && before != SeriesState::kAnomalous;
  }
  return episodes;
}

// Symmetric Laplace noise with the given scale (heavier tails than Gaussian:
// the MAD underestimates its standard deviation by a quarter).
auto Laplace(double scale) {
  return [exponential = std::exponential_distribution<double>(1 / scale),
          sign = std::bernoulli_distribution(0.5)](std::mt19937_64& rng) mutable {
    return (sign(rng) ? 1 : -1) * exponential(rng);
  };
}

TEST(ChangeDetectorTest, StationaryGaussianNoiseRaisesNoFalsePositives) {
  // The noise (sigma 10%) is as large as the effect-size gate (10%), so the
  // robust z, the CUSUM and persistence have to keep it silent on their own.
  for (Direction direction : {Direction::kRise, Direction::kDrop}) {
    const int episodes =
        FalsePositiveEpisodes(direction, 20000, 11,
                              [gaussian = std::normal_distribution<double>(0.0, 0.1)](
                                  std::mt19937_64& rng) mutable { return gaussian(rng); });
    EXPECT_EQ(episodes, 0) << DirectionName(direction);
  }
}

TEST(ChangeDetectorTest, HeavyTailedNoiseRarelyFires) {
  for (Direction direction : {Direction::kRise, Direction::kDrop}) {
    // Noise three times below the gate: never.
    EXPECT_EQ(FalsePositiveEpisodes(direction, 100000, 12, Laplace(0.023)), 0)
        << DirectionName(direction);
    // Noise as large as the gate (std 0.1): at most a couple per 100k samples
    // (measured: about one per 200k).
    EXPECT_LE(FalsePositiveEpisodes(direction, 100000, 13, Laplace(0.07)), 2)
        << DirectionName(direction);
  }
}

TEST(ChangeDetectorTest, HysteresisKeepsAnAlertFromFlappingAroundTheThreshold) {
  ChangeDetector detector(Options(Direction::kDrop));
  std::vector<double> series = Noisy(100, 1.0, 0.005, 8);
  // Collapse, then hover on both sides of the 10% gate for 200 samples.
  for (int t = 0; t < 5; ++t) series.push_back(0.5);
  // (It ends on an anomalous sample.)
  for (int t = 0; t < 200; ++t) series.push_back(t % 2 == 0 ? 0.95 : 0.85);
  const Trace hovering = Feed(detector, series);
  EXPECT_EQ(hovering.episodes, 1);
  EXPECT_EQ(hovering.clears, 0);
  EXPECT_EQ(detector.state(), SeriesState::kAnomalous);

  // Back to normal: it clears at exactly the clear_after-th normal sample.
  const int clear_after = detector.options().clear_after;
  const int first_index = static_cast<int>(series.size());
  const Trace recovering = Feed(detector, std::vector<double>(50, 1.0), first_index);
  EXPECT_EQ(recovering.clears, 1);
  EXPECT_EQ(recovering.episodes, 0);
  EXPECT_EQ(recovering.samples[static_cast<size_t>(clear_after - 2)].state,
            SeriesState::kAnomalous);
  EXPECT_EQ(recovering.samples[static_cast<size_t>(clear_after - 1)].state, SeriesState::kNormal);
}

TEST(ChangeDetectorTest, BaselineIsFrozenWhileAnomalous) {
  // A sustained collapse must not become its own baseline and clear itself.
  ChangeDetector detector(Options(Direction::kDrop));
  const auto series = Concat(Noisy(100, 1.0, 0.01, 9), Noisy(500, 0.5, 0.01, 10));
  const Trace trace = Feed(detector, series);
  EXPECT_EQ(trace.episodes, 1);
  EXPECT_EQ(trace.clears, 0);
  EXPECT_NEAR(trace.samples.back().baseline, 1.0, 0.02);
}

TEST(ChangeDetectorTest, FlatSeriesWithZeroMadUsesTheEffectSizeGate) {
  ChangeDetector detector(Options(Direction::kDrop));
  const std::vector<double> flat(200, 1.0);
  const std::vector<double> small_dip(100, 0.95);  // 5%: below the 10% gate
  const std::vector<double> collapse(20, 0.8);     // 16% below the new level of 0.95
  const Trace before = Feed(detector, Concat(flat, small_dip));
  EXPECT_EQ(before.episodes, 0);
  // The first 0.95 has MAD = 0 behind it: z is huge but finite.
  EXPECT_TRUE(std::isfinite(before.samples[200].z));
  EXPECT_LT(before.samples[200].z, -1000);
  EXPECT_FALSE(before.samples[200].anomalous());

  const Trace after = Feed(detector, collapse, 300);
  EXPECT_EQ(after.episodes, 1);
  EXPECT_EQ(after.first_anomalous, 302);
}

TEST(ChangeDetectorTest, FlatZeroSeriesNeedsTheAbsoluteChange) {
  // A flip rate idling at 0: relative change is meaningless, the absolute gate decides.
  ChangeDetectorOptions options = Options(Direction::kRise);
  options.min_absolute_change = 0.1;
  ChangeDetector detector(options);
  const Trace small =
      Feed(detector, Concat(std::vector<double>(100, 0.0), std::vector<double>(20, 0.05)));
  EXPECT_EQ(small.episodes, 0);
  const Trace large = Feed(detector, std::vector<double>(20, 0.3), 120);
  EXPECT_EQ(large.episodes, 1);
}

TEST(ChangeDetectorTest, WarmupScoresNothing) {
  ChangeDetectorOptions options = Options(Direction::kRise);
  options.bound = 1.0;
  ChangeDetector detector(options);
  for (int t = 0; t < options.warmup; ++t) {
    const ChangeAssessment a = detector.Update(t, 50.0);  // far beyond the bound
    EXPECT_EQ(a.disposition, ChangeAssessment::Disposition::kWarmup);
    EXPECT_FALSE(a.anomalous());
    EXPECT_TRUE(std::isnan(a.baseline));
  }
  EXPECT_EQ(detector.state(), SeriesState::kNormal);
  EXPECT_EQ(detector.Update(options.warmup, 50.0).disposition,
            ChangeAssessment::Disposition::kScored);
}

TEST(ChangeDetectorTest, MinBaselineScoresAYoungSeriesFromAFewSamples) {
  ChangeDetectorOptions options = Options(Direction::kDrop);
  options.warmup = 8;
  options.gap = 5;
  options.min_baseline = 3;
  options.small_sample_inflation = 0;  // min_baseline alone
  options.gate_inflation = 0;
  ChangeDetector detector(options);
  // 8 samples: a window of 3 behind a gap of 5 is ready at the 9th sample.
  const Trace trace = Feed(detector, Concat(Noisy(8, 1.0, 0.01, 7), std::vector<double>(6, 0.5)));
  EXPECT_TRUE(std::isnan(trace.samples[7].baseline));
  EXPECT_FALSE(std::isnan(trace.samples[8].baseline));
  EXPECT_EQ(trace.first_anomalous, 10);  // 3 of 5 from the collapse at sample 8
  // The default (half the 40-sample window) would have waited for 20 + 5 samples.
  ChangeDetectorOptions half = options;
  half.min_baseline = 0;
  ChangeDetector waiting(half);
  const Trace waited = Feed(waiting, Concat(Noisy(8, 1.0, 0.01, 7), std::vector<double>(6, 0.5)));
  EXPECT_EQ(waited.episodes, 0);
}

TEST(ChangeDetectorTest, SmallSampleInflationWidensAYoungBaselineOnly) {
  ChangeDetectorOptions options = Options(Direction::kRise);
  options.warmup = 8;
  options.gap = 2;
  options.min_baseline = 4;
  options.trend = false;
  options.small_sample_inflation = 6.0;
  ChangeDetector inflated(options);
  options.small_sample_inflation = 0.0;
  ChangeDetector plain(options);
  const std::vector<double> values = Noisy(60, 1.0, 0.05, 11);
  const Trace a = Feed(inflated, values);
  const Trace b = Feed(plain, values);
  // Same window, same median; the scale is (1 + 6 / n) times larger: 2.5x at
  // n = 4, 1.15x at the full 40.
  for (size_t i : {8u, 20u, 59u}) {
    ASSERT_FALSE(std::isnan(a.samples[i].scale)) << i;
    EXPECT_DOUBLE_EQ(a.samples[i].baseline, b.samples[i].baseline) << i;
    const double n = std::min<double>(40, static_cast<double>(i) - options.gap);
    EXPECT_NEAR(a.samples[i].scale / b.samples[i].scale, 1 + 6 / n, 1e-12) << i;
  }
}

TEST(ChangeDetectorTest, GateInflationAsksMoreOfAYoungBaselineAndTheGateAsSetOfAFullOne) {
  ChangeDetectorOptions options = Options(Direction::kRise);
  options.warmup = 8;
  options.gap = 2;
  options.min_baseline = 4;
  options.window = 20;
  options.trend = false;
  options.min_relative_change = 0.2;
  options.gate_inflation = 20.0;
  // A rise of 50% after 8 samples: the gate there (n = 6) is
  // 0.2 x (1 + 20/6) / (1 + 20/20) = 43%: it passes; a 30% rise does not.
  for (const auto& [rise, fires] : {std::pair{1.5, true}, std::pair{1.3, false}}) {
    ChangeDetector detector(options);
    const Trace t = Feed(detector, Concat(std::vector<double>(8, 1.0), std::vector<double>(5, rise)));
    EXPECT_EQ(t.episodes, fires ? 1 : 0) << rise;
  }
  // With a full window the gate is min_relative_change itself: 30% passes.
  ChangeDetector full(options);
  const Trace t = Feed(full, Concat(Noisy(30, 1.0, 0.001, 3), std::vector<double>(5, 1.3)));
  EXPECT_EQ(t.episodes, 1);
}

TEST(ChangeDetectorTest, LogScaleFollowsExponentialGrowthAndGatesByFactors) {
  ChangeDetectorOptions options = Options(Direction::kRise);
  options.warmup = 12;
  options.min_relative_change = 0.25;
  // Healthy: logits growing 10% per sample (with 1% noise), from 0.1 to ~300.
  std::vector<double> growth;
  std::mt19937_64 rng(4);
  std::normal_distribution<double> noise(0.0, 0.01);
  for (int i = 0; i < 80; ++i) growth.push_back(0.1 * std::pow(1.1, i) * (1 + noise(rng)));
  options.log_scale = true;
  ChangeDetector logged(options);
  EXPECT_EQ(Feed(logged, growth).episodes, 0);
  options.log_scale = false;
  ChangeDetector linear(options);
  EXPECT_GE(Feed(linear, growth).episodes, 1);  // linear trends lag exponential growth
  // A jump to 2x the trend fires in log scale; the baseline reads in the
  // value's own units and the relative change as a factor.
  options.log_scale = true;
  ChangeDetector jump(options);
  std::vector<double> values(growth.begin(), growth.begin() + 60);
  for (int i = 60; i < 65; ++i) values.push_back(2 * 0.1 * std::pow(1.1, i));
  const Trace t = Feed(jump, values);
  EXPECT_EQ(t.episodes, 1);
  const ChangeAssessment& a = t.samples[60];
  EXPECT_NEAR(a.baseline, 0.1 * std::pow(1.1, 60), 0.1 * 0.1 * std::pow(1.1, 60));
  EXPECT_NEAR(a.relative_change, 1.0, 0.15);
}

TEST(ChangeDetectorTest, RiseGuardFiresAfterMofNWithoutABaseline) {
  ChangeDetectorOptions options = Options(Direction::kRise);
  options.change_detection = false;
  options.bound = 0.0;
  options.warmup = 5;
  ChangeDetector detector(options);
  // After warm-up (samples 0-4): one dead expert at sample 5 that leaves the
  // persistence window, then 2 of 5 at sample 12, then 3 of 5 at sample 13.
  const Trace trace = Feed(detector, {0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 1, 1});
  EXPECT_EQ(trace.samples[12].state, SeriesState::kPending);
  EXPECT_EQ(trace.first_anomalous, 13);
  EXPECT_EQ(trace.samples[13].onset_step, 10 * kStepsPerSample);  // window: samples 9..13
  EXPECT_TRUE(trace.samples[13].guard_flag);
  EXPECT_TRUE(std::isnan(trace.samples[13].baseline));
  // Exactly at the bound is not beyond it.
  ChangeDetector at_bound(options);
  EXPECT_EQ(Feed(at_bound, std::vector<double>(30, 0.0)).episodes, 0);
}

TEST(ChangeDetectorTest, DropGuardFiresBelowTheBound) {
  ChangeDetectorOptions options = Options(Direction::kDrop);
  options.bound = 0.5;
  options.persist_m = options.persist_n = 3;  // "sustained for 3 samples"
  options.change_detection = false;
  // A flat 0.6 series with a 2-sample excursion below the bound (not
  // sustained), then a 3-sample one.
  std::vector<double> series(100, 0.6);
  series[50] = series[51] = 0.45;
  for (int t = 0; t < 3; ++t) series.push_back(0.45);
  ChangeDetector guard_only(options);
  const Trace trace = Feed(guard_only, series);
  EXPECT_EQ(trace.episodes, 1);
  EXPECT_EQ(trace.first_anomalous, 102);
  EXPECT_TRUE(trace.samples[102].guard_flag);
}

// Issue 33: past the bound, a rise guard with bound_growth marks a sample
// only while the value still grows by that factor over bound_growth_steps
// training steps: a level that holds past the bound (a head that
// specialised) is not a runaway.
ChangeDetectorOptions GrowthGuard() {
  ChangeDetectorOptions options = Options(Direction::kRise);
  options.change_detection = false;
  options.log_scale = true;
  options.warmup = 0;
  options.bound = 100.0;
  options.bound_growth = 1.5;
  options.bound_growth_steps = 100;
  return options;
}

TEST(ChangeDetectorTest, GrowthGuardIgnoresALevelThatHoldsPastTheBound) {
  ChangeDetector detector(GrowthGuard());
  // 20 -> 130 over 100 steps, then 130 to 140 for 500 steps.
  std::vector<double> series;
  for (int i = 0; i <= 10; ++i) series.push_back(20.0 * std::pow(6.5, i / 10.0));
  for (int i = 0; i < 50; ++i) series.push_back(130.0 + 10.0 * i / 50.0);
  const Trace trace = Feed(detector, series);
  // Past the bound from sample 9 (about 108): grown by more than half over the
  // 100 steps before it, so samples 9 and 10 are marked; from 100 steps after
  // the rise ends the growth is under the factor, and persistence (3 of 5) is
  // never reached.
  EXPECT_TRUE(trace.samples[9].guard_flag);
  EXPECT_TRUE(trace.samples[10].guard_flag);
  for (size_t i = 21; i < trace.samples.size(); ++i) {
    EXPECT_FALSE(trace.samples[i].guard_flag) << i;
  }
  EXPECT_EQ(trace.episodes, 1);  // the rise itself, 20 -> 130 in 100 steps, is a runaway
  ChangeDetectorOptions plain = GrowthGuard();
  plain.bound_growth = 0;  // the plain bound marks every sample past it
  ChangeDetector plain_detector(plain);
  const Trace plain_trace = Feed(plain_detector, series);
  for (size_t i = 9; i < plain_trace.samples.size(); ++i) {
    EXPECT_TRUE(plain_trace.samples[i].guard_flag) << i;
  }
}

TEST(ChangeDetectorTest, GrowthGuardSeparatesASlowCreepFromARunaway) {
  // Both cross 100 at step 300 with a long history: the creep grows by 1.3x
  // per 100 steps, the runaway by 2x.
  for (const double per_100_steps : {1.3, 2.0}) {
    ChangeDetector detector(GrowthGuard());
    std::vector<double> series;
    for (int i = 0; i < 80; ++i) {
      series.push_back(100.0 * std::pow(per_100_steps, (i * kStepsPerSample - 300) / 100.0));
    }
    const Trace trace = Feed(detector, series);
    EXPECT_EQ(trace.episodes, per_100_steps > 1.5 ? 1 : 0) << per_100_steps;
    if (per_100_steps > 1.5) EXPECT_EQ(trace.first_anomalous, 33);  // 3 of 5 from step 310
  }
}

TEST(ChangeDetectorTest, GrowthGuardJudgesGrowthInStepsAtAnyCadence) {
  // The same 1.3x-per-100-steps creep past the bound at a probe every 5 and
  // every 50 steps never fires; a 3x one does at both.
  for (const int every : {5, 50}) {
    for (const double per_100_steps : {1.3, 3.0}) {
      ChangeDetector detector(GrowthGuard());
      int episodes = 0;
      for (int64_t step = 0; step <= 1500; step += every) {
        const SeriesState before = detector.state();
        const double value = 100.0 * std::pow(per_100_steps, (step - 300) / 100.0);
        const ChangeAssessment a = detector.Update(step, std::min(value, 1e6));
        episodes += a.state == SeriesState::kAnomalous && before != SeriesState::kAnomalous;
      }
      EXPECT_EQ(episodes, per_100_steps > 1.5 ? 1 : 0) << every << " " << per_100_steps;
    }
  }
}

TEST(ChangeDetectorTest, GrowthGuardMarksAFirstSampleAndAnyValuePastTheNoGrowthBound) {
  ChangeDetectorOptions options = GrowthGuard();
  options.bound_without_growth = 1000.0;
  ChangeDetector detector(options);
  // The first sample is already past the bound: there is nothing to compare
  // with, and it rose from a random init within the series' start.
  EXPECT_TRUE(detector.Update(50, 400.0).guard_flag);
  EXPECT_FALSE(detector.Update(100, 420.0).guard_flag);  // held: no growth
  EXPECT_TRUE(detector.Update(150, 900.0).guard_flag);   // grown 2.25x since step 50
  EXPECT_TRUE(detector.Update(300, 1250.0).guard_flag);  // 1.39x since 150, but past 1000
  EXPECT_FALSE(detector.Update(350, 90.0).guard_flag);   // under the bound
}

TEST(ChangeDetectorTest, SameStepFromAnotherSourceCountsOnceAndTheWorstValueWins) {
  ChangeDetector detector(Options(Direction::kDrop));
  Feed(detector, Noisy(100, 1.0, 0.01, 12));
  // Step 1000: one rank reports normal, another collapsed: the worse value counts.
  const ChangeAssessment first = detector.Update(1000, 1.0);
  EXPECT_FALSE(first.anomalous());
  const ChangeAssessment revised = detector.Update(1000, 0.5);
  EXPECT_EQ(revised.disposition, ChangeAssessment::Disposition::kScored);
  EXPECT_TRUE(revised.anomalous());
  EXPECT_EQ(revised.anomalous_in_window, 1);
  // The same collapsed value from a third rank, and a better one: ignored.
  EXPECT_EQ(detector.Update(1000, 0.5).disposition, ChangeAssessment::Disposition::kDuplicate);
  EXPECT_EQ(detector.Update(1000, 0.9).disposition, ChangeAssessment::Disposition::kDuplicate);
  EXPECT_EQ(detector.last().anomalous_in_window, 1);
  EXPECT_EQ(detector.state(), SeriesState::kPending);
  // An older step arriving late is stale.
  EXPECT_EQ(detector.Update(990, 0.1).disposition, ChangeAssessment::Disposition::kStale);
  // Two more collapsed steps confirm it, exactly as with one source.
  detector.Update(1010, 0.5);
  EXPECT_EQ(detector.Update(1020, 0.5).state, SeriesState::kAnomalous);
  EXPECT_EQ(detector.last().onset_step, 1000);
}

}  // namespace
}  // namespace foreshock::alerts
