// ForeshockCurvatureAboveEdge on healthy, noisy curvature estimates (issue 25
// item 4): a minibatch estimate of lambda_max from a few Hessian-vector
// products on one or two sequences scatters by tens of percent around a level
// that rises slowly as training sharpens; the surge rule must not take that
// for a surge. Counts are in estimates, so the cadence (an estimate every 20
// or every 100 steps) changes nothing but the steps the same series spans.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "alerts/alert_engine.h"

namespace foreshock::alerts {
namespace {

// Healthy runs with a firing, out of `runs`: `estimates` per run, the level
// rising from 0.1 to 0.8 of the edge (progressive sharpening), times
// lognormal noise of log-sd `sigma`, AR(1) `rho` between estimates.
int RunsWithAFiring(const AlertConfig& config, int runs, int estimates, double sigma, double rho,
                    uint64_t seed) {
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
  EXPECT_EQ(RunsWithAFiring(shipped, 200, 40, 0.4, 0.0, 1), 0);
  EXPECT_LE(RunsWithAFiring(shipped, 200, 200, 0.4, 0.5, 2), 5);
  // So that this test can tell: without the absolute change the same runs fire.
  AlertConfig relative_only = DefaultAlertConfig();
  relative_only.signals.at("curvature_eos_ratio").detector.min_absolute_change = 0.0;
  EXPECT_GT(RunsWithAFiring(relative_only, 200, 40, 0.4, 0.0, 1), 0);
  EXPECT_GT(RunsWithAFiring(relative_only, 200, 200, 0.4, 0.5, 2), 5);
}

}  // namespace
}  // namespace foreshock::alerts
