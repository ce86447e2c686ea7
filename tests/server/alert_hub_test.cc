// The daemon's AlertHub hands the alert engine what it judges: layer
// aggregates and, for the signals judged per head (issue 25), every head's
// value, so that the daemon alerts as `foreshockctl backtest` does.
#include "server/alerting/alert_hub.h"

#include <gtest/gtest.h>
#include <prometheus/registry.h>

#include <algorithm>
#include <random>

#include "server/metrics.h"

namespace foreshock::server {
namespace {

// One layer of four heads: head 0 drops from 0.90 to 0.75 at step 1000, above
// the noisy low head 3 that the layer minimum follows, so only a per-head
// judgement sees it. Returns the hub's alerts of run "r".
std::vector<foreshock::v1::Alert> OneHeadDrops(const alerts::AlertConfig& config) {
  prometheus::Registry registry;
  DaemonMetrics metrics(registry, false);
  AlertHub hub(config, metrics, nullptr);
  std::mt19937_64 rng(7);
  std::normal_distribution<double> unit(0.0, 1.0);
  const double level[4] = {0.90, 0.85, 0.80, 0.60};
  const double noise[4] = {0.005, 0.005, 0.005, 0.03};
  for (int64_t step = 0; step <= 1300; step += 10) {
    detectors::Sample sample;
    sample.run = "r";
    sample.step = step;
    double minimum = 1;
    for (int head = 0; head < 4; ++head) {
      double value = level[head] * (1 + noise[head] * unit(rng));
      if (head == 0 && step >= 1000) value = 0.75 * (1 + noise[0] * unit(rng));
      minimum = std::min(minimum, value);
      hub.OnObservation(sample, detectors::Observation{"qk_increment_entropy", 2, head, value});
    }
    hub.OnObservation(sample,
                      detectors::Observation{"qk_increment_entropy", 2, detectors::kAllHeads, minimum});
  }
  return hub.Alerts("r", /*include_resolved=*/true);
}

bool QKFired(const std::vector<foreshock::v1::Alert>& alerts) {
  return std::any_of(alerts.begin(), alerts.end(), [](const foreshock::v1::Alert& a) {
    return a.alertname() == "ForeshockQKIncrementCollapse" && a.state() == "firing";
  });
}

TEST(AlertHubTest, PerHeadValuesReachTheEngineForSignalsJudgedPerHead) {
  EXPECT_TRUE(QKFired(OneHeadDrops(alerts::DefaultAlertConfig())));
  alerts::AlertConfig per_layer = alerts::DefaultAlertConfig();
  per_layer.signals.at("qk_increment_entropy").per_head = false;
  EXPECT_FALSE(QKFired(OneHeadDrops(per_layer)));
}

}  // namespace
}  // namespace foreshock::server
