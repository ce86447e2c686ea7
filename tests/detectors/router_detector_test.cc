// Router statistics on hand-checkable inputs. The same statistics are checked
// against numpy on random and adversarial logits end to end in
// tests/python/test_router_e2e.py.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "detectors/router_stats.h"
#include "tests/detectors/detector_test_support.h"
#include "tests/detectors/sample_builders.h"

namespace foreshock::detectors {
namespace {

using testing::MakeDetector;
using testing::RecordingEmitter;
using testing::RouterSampleOf;

TEST(RouterStatsTest, UniformLogitsAreMaximallyUncertainAndBalanced) {
  // 4 tokens, 4 experts, all logits equal: entropy 1; ties go to the lowest
  // indices, so top-1 always picks expert 0.
  const std::vector<float> z(16, 0.5f);
  RouterDecisions decisions;
  const RouterStats s = ComputeRouterStats(z, 4, 4, RouterOptions{1, 0.5, 1.25}, decisions);
  EXPECT_NEAR(s.entropy_mean, 1.0, 1e-12);
  EXPECT_EQ(s.low_entropy_fraction, 0.0);
  EXPECT_EQ(s.load, (std::vector<double>{1, 0, 0, 0}));
  EXPECT_NEAR(s.max_violation, 3.0, 1e-12);  // (1 - 1/4) / (1/4)
  EXPECT_NEAR(s.load_cv, std::sqrt(3.0), 1e-12);
  EXPECT_EQ(s.load_entropy, 0.0);
  EXPECT_EQ(s.overloaded_experts, 1);
  EXPECT_EQ(s.topk_margin_mean, 0.0);
  const double lse = 0.5 + std::log(4.0);
  EXPECT_NEAR(s.z_loss, lse * lse, 1e-12);
  EXPECT_NEAR(s.cv_noise_floor, std::sqrt(3.0 / 4.0), 1e-12);
  EXPECT_EQ(decisions.topk, (std::vector<int32_t>{0, 0, 0, 0}));
}

TEST(RouterStatsTest, TwoExpertsTopOneMarginAndPercentile) {
  // Margins z0 - z1 of 5 tokens: 1, 2, 3, 4, 5 -> mean 3, p10 = 1 + 0.4 * (2 - 1).
  const std::vector<float> z = {1, 0, 2, 0, 3, 0, 4, 0, 5, 0};
  RouterDecisions decisions;
  const RouterStats s = ComputeRouterStats(z, 5, 2, RouterOptions{1, 0.5, 1.25}, decisions);
  EXPECT_NEAR(s.topk_margin_mean, 3.0, 1e-12);
  EXPECT_NEAR(s.topk_margin_p10, 1.4, 1e-12);
  EXPECT_EQ(s.load, (std::vector<double>{1, 0}));
  EXPECT_EQ(s.max_abs_logit, 5.0);
}

TEST(RouterStatsTest, FlipRateAndJensenShannon) {
  RouterDecisions a, b;
  const std::vector<float> z0 = {3, 0, 0, /**/ 0, 3, 0};
  const std::vector<float> z1 = {3, 0, 0, /**/ 0, 0, 3};
  ComputeRouterStats(z0, 2, 3, RouterOptions{1}, a);
  ComputeRouterStats(z1, 2, 3, RouterOptions{1}, b);
  EXPECT_EQ(FlipRate(a, b), 0.5);
  EXPECT_EQ(FlipRate(a, a), 0.0);
  EXPECT_EQ(MeanJensenShannon(a, a), 0.0);
  const double js = MeanJensenShannon(a, b);
  EXPECT_GT(js, 0.0);
  EXPECT_LT(js, std::log(2.0) / 2 + 1e-12);  // one of two tokens changed; JS <= log 2
  EXPECT_NEAR(js, MeanJensenShannon(b, a), 1e-15);
}

TEST(RouterStatsTest, DeadExpertsUseTheWindowMean) {
  std::deque<std::vector<double>> window = {{0.5, 0.5, 0.0, 0.0}, {0.5, 0.4, 0.1, 0.0}};
  // Means: 0.5, 0.45, 0.05, 0 -> below 0.025: only expert 3.
  EXPECT_EQ(CountDeadExperts(window), 1);
  EXPECT_EQ(CountDeadExperts({}), 0);
}

TEST(RouterDetectorTest, EmitsContractSignalsAndFlipRateFromTheSecondSample) {
  auto detector = MakeDetector("router");
  RecordingEmitter emitter;
  const std::vector<float> z0 = {2, 1, 0, 0, /**/ 0, 2, 1, 0};
  detector->Process(RouterSampleOf(z0, 2, 4, 2), emitter);
  for (const char* s : {"router_entropy", "router_load_cv", "router_max_violation",
                        "router_dead_experts", "router_topk_margin", "router_z_loss"}) {
    EXPECT_TRUE(emitter.Has(s)) << s;
  }
  EXPECT_FALSE(emitter.Has("router_flip_rate"));
  EXPECT_EQ(emitter.Value("router_dead_experts", 1), 1);  // expert 3 never chosen

  emitter.Clear();
  const std::vector<float> z1 = {2, 1, 0, 0, /**/ 0, 0, 1, 2};
  detector->Process(RouterSampleOf(z1, 2, 4, 2, 10), emitter);
  EXPECT_EQ(emitter.Value("router_flip_rate", 1), 0.5);
  // Window mean of expert 3 is now (0 + 0.25) / 2 >= 0.025: alive.
  EXPECT_EQ(emitter.Value("router_dead_experts", 1), 0);

  // A different token count is a different probe shape: no flip rate.
  emitter.Clear();
  detector->Process(RouterSampleOf(std::vector<float>(12, 0.f), 3, 4, 2, 20), emitter);
  EXPECT_FALSE(emitter.Has("router_flip_rate"));
}

TEST(RouterStatsTest, DiedExpertsWereOnceAliveAndAreDeadNow) {
  // 4 experts: dead below 0.025, once alive at 0.125 or more.
  const std::vector<double> now = {0.5, 0.45, 0.01, 0.0};
  EXPECT_EQ(CountDiedExperts(now, {0.5, 0.5, 0.02, 0.3}), 1);  // expert 3 died
  EXPECT_EQ(CountDiedExperts(now, {0.5, 0.5, 0.12, 0.0}), 0);  // never alive: not died
  EXPECT_EQ(CountDiedExperts(now, {0.5, 0.5, 0.125, 0.2}), 2);
}

TEST(RouterDetectorTest, ExpertsDeadFromTheStartAreNotDiedOnesThatDieAre) {
  // Issue 26: 2 of 8 experts dead from initialization are the model's state;
  // an expert that carried tokens and then gets none has died.
  auto detector = MakeDetector("router");
  const int tokens = 16, experts = 8;
  auto logits = [&](bool expert5_dead) {
    std::vector<float> z(tokens * experts, 0.f);
    for (int t = 0; t < tokens; ++t) {
      z[t * experts + t % 6] = 5.f;  // top-2 spread over experts 0..5
      z[t * experts + (t + 1) % 6] = 4.f;
      z[t * experts + 6] = z[t * experts + 7] = -20.f;  // dead from the start
      if (expert5_dead) z[t * experts + 5] = -20.f;
    }
    return z;
  };
  RecordingEmitter emitter;
  for (int i = 0; i < 20; ++i) {
    emitter.Clear();
    detector->Process(RouterSampleOf(logits(false), tokens, experts, 2, 10 * i), emitter);
    ASSERT_EQ(emitter.Value("router_dead_experts", 1), 2) << i;
    ASSERT_EQ(emitter.Value("router_experts_died", 1), 0) << i;
  }
  for (int i = 20; i < 40; ++i) {
    emitter.Clear();
    detector->Process(RouterSampleOf(logits(true), tokens, experts, 2, 10 * i), emitter);
  }
  EXPECT_EQ(emitter.Value("router_dead_experts", 1), 3);
  EXPECT_EQ(emitter.Value("router_experts_died", 1), 1);
}

// The dead-expert window spans training steps, not a sample count: an
// expert a balanced router leaves without tokens for 100 steps is not dead,
// whether the probe comes every 5 steps or every 25; one left without tokens
// for 300 steps has died at either cadence (docs/DESIGN.md §1.2).
TEST(RouterDetectorTest, ExpertsDieOnTheSameStepsAtEveryProbeCadence) {
  const int tokens = 16, experts = 4;
  auto logits = [&](bool expert3_dark) {
    std::vector<float> z(tokens * experts, 0.f);
    for (int t = 0; t < tokens; ++t) {
      z[t * experts + t % (expert3_dark ? 3 : 4)] = 5.f;  // top-1
    }
    return z;
  };
  // Dark from step 400 for `dark_steps`; what router_experts_died reads at
  // its most over the run.
  auto most_died = [&](int cadence, int dark_steps) {
    auto detector = MakeDetector("router");
    RecordingEmitter emitter;
    double most = 0;
    for (int step = 0; step <= 1000; step += cadence) {
      emitter.Clear();
      const bool dark = step >= 400 && step < 400 + dark_steps;
      detector->Process(RouterSampleOf(logits(dark), tokens, experts, 1, step), emitter);
      most = std::max(most, emitter.Value("router_experts_died", 1));
    }
    return most;
  };
  for (int cadence : {5, 10, 25}) {
    EXPECT_EQ(most_died(cadence, 100), 0) << "every " << cadence;
    EXPECT_EQ(most_died(cadence, 300), 1) << "every " << cadence;
  }
}

TEST(RouterDetectorTest, NonFiniteLogitsAreCountedAndNotUsed) {
  auto detector = MakeDetector("router");
  RecordingEmitter emitter;
  std::vector<float> z(8, 0.f);
  z[3] = NAN;
  z[5] = INFINITY;
  detector->Process(RouterSampleOf(z, 2, 4, 1), emitter);
  EXPECT_EQ(emitter.non_finite, 2);
  EXPECT_EQ(emitter.non_finite_kind, SampleKind::kRouter);
  EXPECT_TRUE(emitter.observations.empty());
}

}  // namespace
}  // namespace foreshock::detectors
