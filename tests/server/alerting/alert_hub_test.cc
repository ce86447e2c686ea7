// The daemon's AlertHub hands the alert engine what it judges: layer
// aggregates and, for the signals judged per head (issue 25), every head's
// value, so that the daemon alerts as `foreshockctl backtest` does.
#include "server/alerting/alert_hub.h"

#include <gtest/gtest.h>
#include <prometheus/registry.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <random>

#include "server/common/metrics.h"

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

// Issue 36: every episode is listed with its own wall times, and the times
// of episodes the engine no longer lists (beyond 4,096 per run) are dropped,
// so a flapping alert does not grow the hub's state without bound.
TEST(AlertHubTest, EpisodeTimesAreKeptPerEpisodeAndStayBounded) {
  prometheus::Registry registry;
  DaemonMetrics metrics(registry, false);
  AlertHub hub(alerts::DefaultAlertConfig(), metrics, nullptr);
  spdlog::set_level(spdlog::level::warn);  // 20,000 transition lines otherwise
  int64_t step = 0;
  // One episode of ForeshockNonFinite: fires on a NaN, resolves after 20 clean steps.
  auto flap = [&] {
    detectors::Sample sample;
    sample.run = "flap";
    sample.step = step++;
    hub.OnNonFinite(sample, detectors::SampleKind::kScalars, 1);
    for (int i = 0; i < 20; ++i) {
      sample.step = step++;
      hub.OnObservation(sample, detectors::Observation{"loss", detectors::kNoLayer,
                                                       detectors::kAllHeads, 2.0});
    }
  };
  for (int i = 0; i < 3; ++i) flap();
  std::vector<foreshock::v1::Alert> listed = hub.Alerts("flap", /*include_resolved=*/true);
  ASSERT_EQ(listed.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(listed[i].episode(), i + 1);
    EXPECT_EQ(listed[i].state(), "resolved");
    EXPECT_EQ(listed[i].firing_step(), 21 * i);
    EXPECT_EQ(listed[i].resolved_step(), 21 * i + 20);
    EXPECT_GT(listed[i].starts_at_unix_ms(), 0);
    EXPECT_GE(listed[i].ends_at_unix_ms(), listed[i].starts_at_unix_ms());
  }
  for (int i = 3; i < 5000; ++i) flap();
  const size_t state_at_5000 = hub.SaveState().size();
  for (int i = 5000; i < 20000; ++i) flap();
  listed = hub.Alerts("flap", true);
  EXPECT_EQ(listed.size(), 4097u);  // 4,096 closed and the current one
  EXPECT_EQ(listed.back().episode(), 20000);
  for (const foreshock::v1::Alert& alert : listed) ASSERT_GT(alert.starts_at_unix_ms(), 0);
  // 15,000 more episodes: kept, their times would add ~55 bytes each (825 kB);
  // pruned, times are held for at most twice the listed episodes (< 230 kB more).
  const size_t state_at_20000 = hub.SaveState().size();
  EXPECT_LT(state_at_20000, state_at_5000 + 400'000) << state_at_5000;
  spdlog::set_level(spdlog::level::info);
}

}  // namespace
}  // namespace foreshock::server
