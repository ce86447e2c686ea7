// lr_over_held_max (detectors/lr_schedule_detector.cc): schedules read at or
// below 2 (a batch-size doubling; the default alert bound is 3), faults above
// it, at the step they begin.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>
#include <vector>

#include "tests/detectors/detector_test_support.h"

namespace foreshock::detectors {
namespace {

using testing::MakeDetector;
using testing::RecordingEmitter;

constexpr double kPeak = 3e-4;

Sample Lr(int64_t step, double lr, std::string run = "r") {
  ScalarsSample s;
  s.has_lr = true;
  s.lr = lr;
  s.has_loss = true;
  s.loss = 2.0;
  Sample sample;
  sample.run = std::move(run);
  sample.step = step;
  sample.payload = s;
  return sample;
}

double Warmup(int64_t step, int64_t warmup) {
  return kPeak * std::min(1.0, static_cast<double>(step + 1) / static_cast<double>(warmup));
}

// Feeds the schedule over [0, steps) and returns the emitted ratio per step
// (nullopt where nothing was emitted).
std::vector<std::optional<double>> Feed(Detector& detector,
                                        const std::function<double(int64_t)>& schedule,
                                        int64_t steps, int64_t stride = 1) {
  std::vector<std::optional<double>> out;
  for (int64_t step = 0; step < steps; step += stride) {
    RecordingEmitter emitter;
    detector.Process(Lr(step, schedule(step)), emitter);
    out.push_back(emitter.Has("lr_over_held_max")
                      ? std::optional<double>(emitter.Value("lr_over_held_max"))
                      : std::nullopt);
  }
  return out;
}

double Highest(const std::vector<std::optional<double>>& ratios) {
  double highest = 0;
  for (const auto& r : ratios) highest = std::max(highest, r.value_or(0.0));
  return highest;
}

// The first sample index whose ratio exceeds `bound`, or -1.
int64_t FirstAbove(const std::vector<std::optional<double>>& ratios, double bound) {
  for (size_t i = 0; i < ratios.size(); ++i) {
    if (ratios[i] && *ratios[i] > bound) return static_cast<int64_t>(i);
  }
  return -1;
}

TEST(LrScheduleTest, SchedulesStayAtOrBelowTwice) {
  const int64_t warmup = 200;
  struct Case {
    const char* name;
    std::function<double(int64_t)> schedule;
    int64_t stride;
  };
  const std::vector<Case> cases = {
      {"linear warm-up, constant", [&](int64_t s) { return Warmup(s, warmup); }, 1},
      {"warm-up from 0", [&](int64_t s) { return kPeak * std::min(1.0, s / 200.0); }, 1},
      {"warm-up, cosine",
       [&](int64_t s) {
         if (s < warmup) return Warmup(s, warmup);
         return kPeak * 0.5 * (1 + std::cos(M_PI * static_cast<double>(s - warmup) / 3000.0));
       },
       1},
      {"warm-up, decay x0.1, warm restart to the peak",
       [&](int64_t s) {
         if (s < 1000) return Warmup(s, warmup);
         if (s < 1500) return kPeak * 0.1;
         return Warmup(s - 1500, 100);
       },
       1},
      {"stepwise warm-up, levels held 50 steps",
       [&](int64_t s) { return kPeak * std::min<int64_t>(4, 1 + s / 50) / 4.0; }, 1},
      {"batch-size doubling with the linear scaling rule (2x, exactly)",
       [&](int64_t s) { return s < 1000 ? Warmup(s, warmup) : 2 * kPeak; }, 1},
      {"warm-up reported every 50 steps", [&](int64_t s) { return Warmup(s, 2000); }, 50},
  };
  for (const Case& c : cases) {
    auto detector = MakeDetector("lr_schedule");
    const auto ratios = Feed(*detector, c.schedule, 4000, c.stride);
    EXPECT_LE(Highest(ratios), 2.0) << c.name;
  }
}

TEST(LrScheduleTest, AJumpAfterWarmupReadsItsFactorAtOnce) {
  auto detector = MakeDetector("lr_schedule");
  const auto ratios = Feed(*detector, [](int64_t s) { return Warmup(s, 100) * (s >= 800 ? 15 : 1); }, 1000);
  EXPECT_EQ(FirstAbove(ratios, 2.0), 800);
  EXPECT_DOUBLE_EQ(*ratios[800], 15.0);
  // A surge is measured against the LR held before it for as long as it
  // lasts (issue 26: held for 20 samples it used to become the reference,
  // and the alert resolved while the run diverged).
  for (int64_t s = 800; s < 1000; ++s) ASSERT_DOUBLE_EQ(*ratios[s], 15.0) << s;
}

TEST(LrScheduleTest, ASurgeEndsWhenTheLrComesBackAndAKeptModestRaiseIsAdopted) {
  auto detector = MakeDetector("lr_schedule");
  auto schedule = [](int64_t s) {
    const double base = Warmup(s, 100);
    if (s >= 800 && s < 900) return 30 * base;  // a surge, undone at 900
    if (s >= 1000) return 2 * base;             // a kept, deliberate doubling
    return base;
  };
  const auto ratios = Feed(*detector, schedule, 1200);
  EXPECT_DOUBLE_EQ(*ratios[899], 30.0);
  EXPECT_DOUBLE_EQ(*ratios[900], 1.0);
  EXPECT_DOUBLE_EQ(*ratios[1000], 2.0);
  // Held for 20 samples, a raise below the surge factor is the new reference.
  EXPECT_DOUBLE_EQ(*ratios[1019], 2.0);
  EXPECT_DOUBLE_EQ(*ratios[1021], 1.0);
}

TEST(LrScheduleTest, AJumpDuringWarmupReadsAgainstThePreviousHigh) {
  auto detector = MakeDetector("lr_schedule");
  const auto ratios = Feed(*detector, [](int64_t s) { return Warmup(s, 500) * (s >= 300 ? 20 : 1); }, 400);
  EXPECT_EQ(FirstAbove(ratios, 2.0), 300);
  EXPECT_NEAR(*ratios[300], 20.0 * 301.0 / 300.0, 1e-9);
}

TEST(LrScheduleTest, ARampIsMeasuredFromWhereItBegan) {
  // 300x over 500 steps from step 800, as the evaluation's "lr" fault: twice
  // the held peak 500 * ln 2 / ln 300 = 60.7 steps in.
  auto detector = MakeDetector("lr_schedule");
  auto schedule = [](int64_t s) {
    const double base = Warmup(s, 200);
    return s < 800 ? base : base * std::pow(300.0, std::min<double>(s - 799, 500) / 500.0);
  };
  const auto ratios = Feed(*detector, schedule, 1300);
  EXPECT_EQ(FirstAbove(ratios, 2.0), 860);
  for (int64_t s = 800; s < 1300; ++s) {
    ASSERT_NEAR(*ratios[s], schedule(s) / kPeak, 1e-9 * schedule(s) / kPeak) << s;
  }
}

TEST(LrScheduleTest, NothingWhileTheReferenceIsZeroAndNoStepTwice) {
  auto detector = MakeDetector("lr_schedule");
  RecordingEmitter emitter;
  detector->Process(Lr(0, 0.0), emitter);
  detector->Process(Lr(1, 0.0), emitter);
  detector->Process(Lr(2, 0.0), emitter);
  detector->Process(Lr(3, 0.0), emitter);
  detector->Process(Lr(4, 1e-4), emitter);  // the fifth sample, against 0: nothing
  EXPECT_FALSE(emitter.Has("lr_over_held_max"));
  detector->Process(Lr(5, 2e-4), emitter);
  EXPECT_DOUBLE_EQ(emitter.Value("lr_over_held_max"), 2.0);
  emitter.Clear();
  detector->Process(Lr(5, 1.0), emitter);  // another rank's copy of step 5
  detector->Process(Lr(4, 1.0), emitter);
  EXPECT_TRUE(emitter.observations.empty());
  // Runs are independent, and a forgotten run starts over: nothing for its
  // first four samples.
  for (int64_t step = 0; step < 5; ++step) {
    EXPECT_FALSE(emitter.Has("lr_over_held_max")) << step;
    detector->Process(Lr(step, 5e-4, "other"), emitter);
  }
  EXPECT_DOUBLE_EQ(emitter.Value("lr_over_held_max"), 1.0);
  detector->ForgetRun("r");
  emitter.Clear();
  detector->Process(Lr(0, 1.0), emitter);
  detector->Process(Lr(1, 100.0), emitter);
  EXPECT_TRUE(emitter.observations.empty());
}

TEST(LrScheduleTest, ARestoredDetectorContinuesExactly) {
  auto schedule = [](int64_t s) {
    const double base = Warmup(s, 100);
    return s < 300 ? base : base * std::pow(50.0, std::min<double>(s - 299, 200) / 200.0);
  };
  auto original = MakeDetector("lr_schedule");
  Feed(*original, schedule, 250);  // warm-up over, the ramp not begun
  codec::StateWriter writer;
  original->SaveState(writer);
  auto restored = MakeDetector("lr_schedule");
  codec::StateReader reader(writer.data());
  ASSERT_TRUE(restored->RestoreState(reader));
  ASSERT_TRUE(reader.ExpectEnd());
  for (int64_t step = 250; step < 600; ++step) {
    RecordingEmitter a, b;
    original->Process(Lr(step, schedule(step)), a);
    restored->Process(Lr(step, schedule(step)), b);
    ASSERT_EQ(a.Value("lr_over_held_max"), b.Value("lr_over_held_max")) << step;
  }
  // Truncated state is refused and leaves the detector empty.
  const std::string bytes = writer.data();
  codec::StateReader truncated(std::string_view(bytes).substr(0, bytes.size() - 3));
  EXPECT_FALSE(restored->RestoreState(truncated));
}

}  // namespace
}  // namespace foreshock::detectors
