// ForeshockCurvatureAboveEdge on healthy, noisy curvature estimates (issue 25
// item 4): a minibatch estimate of lambda_max from a few Hessian-vector
// products on one or two sequences scatters by tens of percent around a level
// that rises slowly as training sharpens; the surge rule must not take that
// for a surge. Counts are in estimates, so the cadence (an estimate every 20
// or every 100 steps) changes nothing but the steps the same series spans.
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <cstdio>
#include <functional>
#include <random>

#include "alerts/alert_engine.h"

namespace foreshock::alerts {
namespace {

// Healthy runs with a firing, out of `runs`: `estimates` per run, the level
// rising from 0.1 to 0.8 of the edge (progressive sharpening), times
// lognormal noise of log-sd `sigma`, AR(1) `rho` between estimates.
int RunsWithAFiring(AlertConfig config, int runs, int estimates, double sigma, double rho,
                    uint64_t seed) {
  // The series rule is what is judged here, not the hold for corroboration
  // (a curvature surge alone waits for another kind: alert_engine_test.cc).
  config.probable_cause.curvature_needs_corroboration = false;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> unit(0.0, 1.0);
  int fired_runs = 0;
  for (int r = 0; r < runs; ++r) {
    AlertEngine engine(config);
    double e = 0;
    bool fired = false;
    for (int i = 0; i < estimates; ++i) {
      e = rho * e + std::sqrt(1 - rho * rho) * unit(rng);
      const double level = 0.1 + 0.7 * i / estimates;
      const double value = level * std::exp(sigma * e - 0.5 * sigma * sigma);
      for (const AlertTransition& t : engine.Observe(
               SignalPoint{"r", 50 * i, "curvature_eos_ratio", detectors::kNoLayer,
                           detectors::kAllHeads, value, true})) {
        fired |= t.to == AlertState::kFiring;
      }
    }
    fired_runs += fired;
  }
  return fired_runs;
}

TEST(CurvatureNoiseTest, HealthySharpeningWithNoisyEstimatesRarelyLooksLikeASurge) {
  // Healthy runs whose ratio sharpens from 0.1 to 0.8 of the edge, with
  // lognormal estimate noise of log-sd 0.4 (what 1-2 sequences x 2-3 HVPs
  // gave on the frozen corpus's healthy run: 0.23 -> 0.58 -> 0.21 within
  // three estimates). A surge must also add half the edge
  // (min_absolute_change 0.5): a tripling from 0.1 to 0.3 is no approach to
  // the edge. Measured, 200 runs each (seeds 1, 2), before -> with it:
  // independent noise, 40 estimates: 7 -> 0 runs fired; AR(1) 0.5, 40: 41 ->
  // 19; AR(1) 0.5, 200 estimates: 15 -> 5. (log-sd 0.6, AR 0.5: 82 -> 55 and
  // 112 -> 71: noisier estimators still need more than this.)
  const AlertConfig shipped = DefaultAlertConfig();
  // Judged on log rho over a window of 24 estimates (below), a drift this fast
  // (8x in 40 estimates) outruns the longer baseline in 3 of the 200 runs.
  EXPECT_LE(RunsWithAFiring(shipped, 200, 40, 0.4, 0.0, 1), 3);
  EXPECT_LE(RunsWithAFiring(shipped, 200, 200, 0.4, 0.5, 2), 5);
  // So that this test can tell: without the absolute change the same runs fire.
  AlertConfig relative_only = DefaultAlertConfig();
  relative_only.signals.at("curvature_eos_ratio").detector.min_absolute_change = 0.0;
  EXPECT_GT(RunsWithAFiring(relative_only, 200, 40, 0.4, 0.0, 1), 0);
  EXPECT_GT(RunsWithAFiring(relative_only, 200, 200, 0.4, 0.5, 2), 5);
}


// The first step at which the alert fires (-1: never) on one run of `steps`
// training steps with a curvature estimate every `cadence` steps: the true
// ratio `level(step)` times lognormal estimate noise of log-sd `sigma`, AR(1)
// `ar` between consecutive estimates.
int64_t FirstFiring(AlertConfig config, int cadence, int steps, double sigma, double ar,
                    const std::function<double(int)>& level, std::mt19937_64& rng) {
  config.probable_cause.curvature_needs_corroboration = false;  // the series rule alone
  std::normal_distribution<double> unit(0.0, 1.0);
  AlertEngine engine(config);
  double e = unit(rng);
  for (int step = 0; step < steps; step += cadence) {
    e = ar * e + std::sqrt(1 - ar * ar) * unit(rng);
    const double value = level(step) * std::exp(sigma * e - 0.5 * sigma * sigma);
    for (const AlertTransition& t : engine.Observe(
             SignalPoint{"r", step, "curvature_eos_ratio", detectors::kNoLayer,
                         detectors::kAllHeads, value, true})) {
      if (t.to == AlertState::kFiring) return step;
    }
  }
  return -1;
}

constexpr int kCadences[] = {10, 25, 50, 100};
constexpr double kSigmas[] = {0.4, 0.6, 0.8};
constexpr double kCorrelations[] = {0.0, 0.5};

// Healthy runs with a firing, out of `runs`, per (sigma, AR, cadence) cell in
// the order of the loops: stationary ratio 0.8 over 4000 steps, so a run has
// 400 estimates at cadence 10 and 40 at cadence 100.
std::vector<int> HealthyFirings(const AlertConfig& config, int runs) {
  std::vector<int> fired;
  for (double sigma : kSigmas) {
    for (double ar : kCorrelations) {
      for (int cadence : kCadences) {
        std::mt19937_64 rng(1000 + cadence + static_cast<int>(100 * sigma + 1000 * ar));
        int n = 0;
        for (int r = 0; r < runs; ++r) {
          n += FirstFiring(config, cadence, 4000, sigma, ar, [](int) { return 0.8; }, rng) >= 0;
        }
        fired.push_back(n);
      }
    }
  }
  return fired;
}

void Print(const char* name, const std::vector<int>& cells) {
  std::printf("%-8s", name);
  for (int c : cells) std::printf(" %3d", c);
  std::printf("\n");
}

TEST(CurvatureNoiseTest, HealthyFalseAlarmsAcrossCadencesAndEstimatorNoise) {
  // Stationary healthy runs, 100 seeds per cell: estimator log-sd 0.4, 0.6,
  // 0.8 (1-2 sequences x 2-3 HVPs scatter 0.4 on the frozen corpus's healthy
  // run), independent or AR(1) 0.5, an estimate every 10, 25, 50, 100 steps.
  // Measured (runs of 100 with a firing; cells sigma x AR x cadence):
  //   linear scale, z 5, window 12 (b673d11):
  //     0.4: 0 0 0 0 | 10 1 0 1   0.6: 4 0 1 2 | 62 30 15 6   0.8: 16 6 2 3 | 80 60 35 24
  //   log scale, z 3, window 24 (now):
  //     0.4: 0 0 0 0 |  1 1 0 0   0.6: 0 0 0 0 | 19 7 3 1     0.8: 3 0 0 0 | 29 11 9 1
  // What is left: strongly correlated noise, at a high cadence over 400 estimates.
  const std::vector<int> now = HealthyFirings(DefaultAlertConfig(), 100);
  AlertConfig before = DefaultAlertConfig();
  ChangeDetectorOptions& o = before.signals.at("curvature_eos_ratio").detector;
  o.log_scale = false;
  o.z_threshold = 5.0;
  o.window = 12;
  const std::vector<int> old = HealthyFirings(before, 100);
  Print("before", old);
  Print("now", now);
  int total_now = 0, total_old = 0;
  for (size_t i = 0; i < now.size(); ++i) {
    total_now += now[i];
    total_old += old[i];
    const bool independent = (i / 4) % 2 == 0;
    const double sigma = kSigmas[i / 8];
    // Independent noise up to log-sd 0.6: no healthy run fires, at any cadence.
    if (independent && sigma <= 0.6) {
      EXPECT_LE(now[i], 1) << "cell " << i;
    }
    // Every cell: at most a third of the runs (before: up to 92).
    EXPECT_LE(now[i], 35) << "cell " << i;
    // Estimates every 50 or 100 steps: at most 1 in 8.
    if (i % 4 >= 2) {
      EXPECT_LE(now[i], 12) << "cell " << i;
    }
  }
  // 2400 runs: 85 fire now, 358 did.
  EXPECT_LE(total_now, 120);
  EXPECT_GE(total_old, 250);  // so the test can tell
}

TEST(CurvatureNoiseTest, AGenuineSurgeStillFiresWithinAFewEstimatesAtEveryCadence) {
  // The ratio at 0.5 of the edge, then an LR fault from step 2500: a
  // geometric ramp to 300x over 500 steps (the corpus's LR fault: the ratio
  // follows the LR and passes 3x at step 2596), or a step of 10x (to 5, far
  // above the edge). Estimator log-sd 0.4, independent, 100 runs per cadence:
  // the ramp fired by step 2800 (the ratio at 30x; 3 estimates at a cadence
  // of 10 after it passed 3x: an estimate is no closer to the next than 10
  // steps of a 500-step ramp) or by the 5th estimate after it passed 3x,
  // whichever is later; the step by its 5th estimate. A 5x step is printed, not asserted: with this noise
  // the new rule catches it within 5 estimates in about 6-7 of 10 runs.
  AlertConfig before = DefaultAlertConfig();
  ChangeDetectorOptions& o = before.signals.at("curvature_eos_ratio").detector;
  o.log_scale = false;
  o.z_threshold = 5.0;
  o.window = 12;
  for (const bool now : {false, true}) {
    const AlertConfig config = now ? DefaultAlertConfig() : before;
    for (int cadence : kCadences) {
      std::mt19937_64 rng(7 + cadence);
      int ramp = 0, jump = 0, jump5 = 0;
      for (int r = 0; r < 100; ++r) {
        ramp += FirstFiring(config, cadence, std::max(2596 + 5 * cadence, 2801), 0.4, 0.0, [](int step) {
          return step < 2500 ? 0.5 : 0.5 * std::pow(300.0, (step - 2500) / 500.0);
        }, rng) >= 2500;
        jump += FirstFiring(config, cadence, 2500 + 5 * cadence, 0.4, 0.0,
                            [](int step) { return step < 2500 ? 0.5 : 5.0; }, rng) >= 2500;
        jump5 += FirstFiring(config, cadence, 2500 + 5 * cadence, 0.4, 0.0,
                             [](int step) { return step < 2500 ? 0.5 : 2.5; }, rng) >= 2500;
      }
      std::printf("%s cadence %3d: ramp %d/100, 10x step %d/100, 5x step %d/100\n",
                  now ? "now   " : "before", cadence, ramp, jump, jump5);
      if (now) {
        EXPECT_GE(ramp, 95) << "cadence " << cadence;
        EXPECT_GE(jump, 95) << "cadence " << cadence;
      }
    }
  }
}

}  // namespace
}  // namespace foreshock::alerts
