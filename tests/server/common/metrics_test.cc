// Known label values exported at 0 from the start (server/common/metrics.h), and the
// rejection-reason table checked against the codes ingest declares.
#include "server/common/metrics.h"

#include <gtest/gtest.h>
#include <prometheus/registry.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "alerts/config.h"
#include "server/alerting/alert_hub.h"
#include "server/ingest/validation.h"
#include "server/pipeline/run_tracker.h"
#include "server/security/auth.h"
#include "tests/server/metric_reader.h"

namespace foreshock::server {
namespace {

using testing::MetricValue;

std::string ReadSource(const std::string& path) {
  std::ifstream in(std::string(FORESHOCK_SOURCE_DIR) + "/" + path);
  EXPECT_TRUE(in) << path;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Whether a series of family `name` with exactly `labels` exists (any type).
bool Has(prometheus::Registry& registry, const std::string& name,
         const std::map<std::string, std::string>& labels) {
  for (const auto& family : registry.Collect()) {
    if (family.name != name) continue;
    for (const auto& metric : family.metric) {
      std::map<std::string, std::string> got;
      for (const auto& label : metric.label) got[label.name] = label.value;
      if (got == labels) return true;
    }
  }
  return false;
}

std::set<std::string> Table() {
  std::set<std::string> out;
  for (std::string_view code : RejectionReasons()) out.emplace(code);
  return out;
}

// Every code in `namespace reason { ... }` of wire/validation.h, and
// every code constant of ingest_service.cc that it counts as a rejection.
std::set<std::string> DeclaredCodes() {
  std::set<std::string> out;
  const std::string validation = ReadSource("wire/validation.h");
  const size_t begin = validation.find("namespace reason {");
  const size_t end = validation.find("}  // namespace reason");
  EXPECT_NE(begin, std::string::npos);
  EXPECT_NE(end, std::string::npos);
  const std::string block = validation.substr(begin, end - begin);
  const std::regex constant(R"re(constexpr char k\w+\[\] = "([a-z0-9_]+)";)re");
  for (auto it = std::sregex_iterator(block.begin(), block.end(), constant);
       it != std::sregex_iterator(); ++it) {
    out.insert((*it)[1]);
  }
  const std::string service = ReadSource("server/ingest/ingest_service.cc");
  const std::regex local(R"re(constexpr char (k\w+)\[\] = "([a-z0-9_]+)";)re");
  for (auto it = std::sregex_iterator(service.begin(), service.end(), local);
       it != std::sregex_iterator(); ++it) {
    const std::regex used("(FailStream|RefuseStream|CountRejection)\\((context, )?" +
                          (*it)[1].str() + "\\b");
    if (std::regex_search(service, used)) out.insert((*it)[2]);
  }
  return out;
}

TEST(RejectionReasonsTest, TableHoldsExactlyTheCodesIngestDeclares) {
  const std::set<std::string> declared = DeclaredCodes();
  ASSERT_GE(declared.size(), 30u) << "the source scan found too few codes";
  EXPECT_TRUE(declared.count("malformed_request")) << "ingest_service.cc's own code";
  const std::set<std::string> table = Table();
  EXPECT_EQ(table.size(), RejectionReasons().size()) << "a code is listed twice";
  for (const std::string& code : declared) {
    EXPECT_TRUE(table.count(code)) << code << " is missing from RejectionReasons() (server/ingest/validation.cc)";
  }
  for (const std::string& code : table) {
    EXPECT_TRUE(declared.count(code)) << code << " is in RejectionReasons() but declared nowhere";
  }
}

TEST(RejectionReasonsTest, EveryCodeIsDocumented) {
  const std::string design = ReadSource("docs/DESIGN.md");
  for (std::string_view code : RejectionReasons()) {
    EXPECT_NE(design.find("`" + std::string(code) + "`"), std::string::npos)
        << code << " is not in docs/DESIGN.md §3.2";
  }
}

TEST(DaemonMetricsTest, KnownLabelValuesExistAtZeroFromTheStart) {
  prometheus::Registry registry;
  DaemonMetrics metrics(registry, false);
  // As the ingest service does at construction (tests/python/
  // test_metrics_golden.py sees the codes at 0 on a real daemon's /metrics).
  metrics.DeclareRejectionReasons(RejectionReasons());
  for (std::string_view code : RejectionReasons()) {
    EXPECT_EQ(MetricValue(registry, "foreshock_ingest_rejected_total",
                          {{"reason", std::string(code)}}),
              0.0)
        << code;
  }
  for (const auto& detector : detectors::DetectorRegistry::Instance().detectors()) {
    const std::string name(detector.name);
    EXPECT_EQ(MetricValue(registry, "foreshock_detector_errors_total", {{"detector", name}}), 0.0);
    EXPECT_TRUE(Has(registry, "foreshock_detector_seconds", {{"detector", name}})) << name;
  }
  for (std::string_view outcome : kAlertPointOutcomes) {
    EXPECT_EQ(MetricValue(registry, "foreshock_alert_points_total",
                          {{"outcome", std::string(outcome)}}),
              0.0);
  }
  for (const char* name : {"foreshock_ingest_duplicate_batches_total",
                           "foreshock_watch_events_dropped_total", "foreshock_ingest_bytes_total",
                           "foreshock_ingest_streams_total"}) {
    EXPECT_EQ(MetricValue(registry, name), 0.0) << name;
  }
  // Per-run series exist only once the run does.
  EXPECT_FALSE(Has(registry, "foreshock_nonfinite_values_total", {{"run", "r"}, {"kind", "qk"}}));
}

TEST(DaemonMetricsTest, CountRejectionBumpsThePrecreatedSeriesAndStillCountsUnknownCodes) {
  prometheus::Registry registry;
  DaemonMetrics metrics(registry, false);
  metrics.CountRejection("bad_shape", 3);
  metrics.CountRejection("not_a_known_code");
  EXPECT_EQ(MetricValue(registry, "foreshock_ingest_rejected_total", {{"reason", "bad_shape"}}), 3.0);
  EXPECT_EQ(MetricValue(registry, "foreshock_ingest_rejected_total", {{"reason", "not_a_known_code"}}),
            1.0);
}

TEST(DaemonMetricsTest, PerDetectorSeriesAreResolvedOnce) {
  prometheus::Registry registry;
  DaemonMetrics metrics(registry, false);
  ASSERT_NE(metrics.detector_errors("qk"), nullptr);
  metrics.detector_errors("qk")->Increment();
  EXPECT_EQ(MetricValue(registry, "foreshock_detector_errors_total", {{"detector", "qk"}}), 1.0);
  EXPECT_EQ(metrics.detector_time("no_such_detector"), nullptr);
}

// Issue 27: /metrics grew without a per-daemon bound (200 runs of 1,024
// layer_rayleigh values: 13.6 MB, a 2.4 s scrape). --max_metrics_series caps
// the signal series over all runs; the rest are counted, and series already
// exported keep their latest value.
TEST(DaemonMetricsTest, SignalSeriesStopAtMaxMetricsSeriesAndTheRestAreCounted) {
  prometheus::Registry registry;
  DaemonMetrics metrics(registry, false, /*max_signal_series=*/5);
  auto observe = [&](const std::string& run, int layer, double value) {
    return metrics.ExportObservation(run, {"qk_increment_entropy", layer, detectors::kAllHeads, value});
  };
  for (int layer = 0; layer < 4; ++layer) EXPECT_TRUE(observe("a", layer, 1.0)) << layer;
  EXPECT_TRUE(observe("b", 0, 1.0));
  EXPECT_FALSE(observe("b", 1, 1.0)) << "the sixth series";
  EXPECT_FALSE(observe("c", 0, 1.0));
  EXPECT_TRUE(observe("a", 2, 7.0)) << "an exported series keeps updating";
  EXPECT_EQ(MetricValue(registry, "foreshock_qk_increment_entropy", {{"run", "a"}, {"layer", "2"}}), 7.0);
  EXPECT_FALSE(Has(registry, "foreshock_qk_increment_entropy", {{"run", "b"}, {"layer", "1"}}));
  EXPECT_EQ(MetricValue(registry, "foreshock_metrics_series_dropped_total", {}), 2.0);
  EXPECT_EQ(MetricValue(registry, "foreshock_metrics_signal_series", {}), 5.0);

  prometheus::Registry unbounded_registry;
  DaemonMetrics unbounded(unbounded_registry, false, 0);
  for (int layer = 0; layer < 50; ++layer) {
    EXPECT_TRUE(unbounded.ExportObservation("a", {"qk_increment_entropy", layer, detectors::kAllHeads, 1.0}));
  }
  EXPECT_EQ(MetricValue(unbounded_registry, "foreshock_metrics_series_dropped_total", {}), 0.0);
}

TEST(RunTrackerTest, ARunsNonFiniteCountersStartAtZeroForEveryKind) {
  prometheus::Registry registry;
  DaemonMetrics metrics(registry, false);
  RunTracker runs(metrics);
  foreshock::v1::Hello hello;
  hello.set_run_id("r");
  runs.OnHello(hello);
  runs.OnStep("restored", 7);  // a run known from the store only
  for (const char* run : {"r", "restored"}) {
    for (const char* kind : {"scalars", "qk", "router", "curvature"}) {
      EXPECT_EQ(MetricValue(registry, "foreshock_nonfinite_values_total",
                            {{"run", run}, {"kind", kind}}),
                0.0)
          << run << " " << kind;
    }
  }
}

// A forgotten run leaves /metrics: its run_info, last_step, nonfinite and
// signal series go, and their room under --max_metrics_series is another
// run's; other runs' series stay. A Hello of it afterwards brings it back.
TEST(RunTrackerTest, AForgottenRunLeavesMetricsAndFreesItsSignalSeries) {
  prometheus::Registry registry;
  DaemonMetrics metrics(registry, false, /*max_signal_series=*/4);
  RunTracker runs(metrics);
  for (const char* run : {"old", "other"}) {
    foreshock::v1::Hello hello;
    hello.set_run_id(run);
    hello.set_job("job");
    runs.OnHello(hello);
    runs.OnStep(run, 40);
  }
  auto observe = [&](const std::string& run, int layer) {
    return metrics.ExportObservation(run, {"qk_increment_entropy", layer, detectors::kAllHeads, 1.0});
  };
  for (int layer = 0; layer < 3; ++layer) ASSERT_TRUE(observe("old", layer));
  ASSERT_TRUE(metrics.ExportObservation("old", {"loss", detectors::kNoLayer, detectors::kAllHeads, 2.0}));
  ASSERT_FALSE(observe("new", 0)) << "the bound is full";
  EXPECT_EQ(MetricValue(registry, "foreshock_metrics_signal_series", {}), 4.0);

  runs.OnRunForgotten("old");
  EXPECT_FALSE(Has(registry, "foreshock_qk_increment_entropy", {{"run", "old"}, {"layer", "0"}}));
  EXPECT_FALSE(Has(registry, "foreshock_loss", {{"run", "old"}}));
  EXPECT_FALSE(Has(registry, "foreshock_last_step", {{"run", "old"}}));
  EXPECT_FALSE(Has(registry, "foreshock_nonfinite_values_total", {{"run", "old"}, {"kind", "qk"}}));
  EXPECT_EQ(MetricValue(registry, "foreshock_metrics_signal_series", {}), 0.0);
  EXPECT_EQ(MetricValue(registry, "foreshock_last_step", {{"run", "other"}}), 40.0);
  EXPECT_EQ(MetricValue(registry, "foreshock_nonfinite_values_total", {{"run", "other"}, {"kind", "qk"}}), 0.0);
  EXPECT_TRUE(observe("new", 0)) << "the forgotten run's room is free";
  EXPECT_EQ(runs.LastStep("old"), 40);  // its summary stays (ListRuns)
  ASSERT_EQ(runs.Runs().size(), 2u);
  runs.OnRunForgotten("never-seen");  // nothing to do

  foreshock::v1::Hello again;
  again.set_run_id("old");
  again.set_job("job");
  runs.OnHello(again);
  runs.OnStep("old", 41);
  EXPECT_EQ(MetricValue(registry, "foreshock_last_step", {{"run", "old"}}), 41.0);
  EXPECT_EQ(MetricValue(registry, "foreshock_run_info", {{"run", "old"}, {"job_name", "job"}, {"n_layers", "0"}, {"n_heads", "0"}, {"head_dim", "0"}, {"n_experts", "0"}}), 1.0);
  EXPECT_EQ(MetricValue(registry, "foreshock_nonfinite_values_total", {{"run", "old"}, {"kind", "qk"}}), 0.0);
}

TEST(AlertHubTest, TransitionsOfEveryConfiguredAlertExistAtZero) {
  prometheus::Registry registry;
  DaemonMetrics metrics(registry, false);
  alerts::AlertConfig config = alerts::DefaultAlertConfig();
  // Disabling every signal of one alert removes its series.
  for (auto& [signal, signal_config] : config.signals) {
    if (signal_config.alertname == alerts::kRouterImbalance) signal_config.enabled = false;
  }
  AlertHub hub(config, metrics, nullptr);
  // Alerts none of whose signals is enabled (by default the attention
  // entropy's) have no series either.
  std::set<std::string, std::less<>> configured = {std::string(alerts::kNonFinite)};
  for (const auto& [signal, signal_config] : config.signals) {
    if (signal_config.enabled) configured.insert(signal_config.alertname);
  }
  EXPECT_FALSE(configured.contains(alerts::kAttentionEntropyCollapse));
  for (std::string_view alertname : alerts::kAlertNames) {
    for (const char* to : {"inactive", "pending", "firing", "resolved"}) {
      const double value = MetricValue(registry, "foreshock_alert_transitions_total",
                                       {{"alertname", std::string(alertname)}, {"to", to}});
      if (!configured.contains(alertname)) {
        EXPECT_TRUE(std::isnan(value)) << alertname << " " << to;
      } else {
        EXPECT_EQ(value, 0.0) << alertname << " " << to;
      }
    }
  }
  // No --alertmanager_url: no Alertmanager series.
  EXPECT_FALSE(Has(registry, "foreshock_alertmanager_posts_total", {{"result", "ok"}}));
}

TEST(AuthMetricsTest, EveryApiAndReasonExistsAtZero) {
  prometheus::Registry registry;
  AuthMetrics auth(registry);
  for (const char* api : {"grpc_ingest", "grpc_query", "http"}) {
    for (const char* reason : {"unauthenticated", "permission_denied"}) {
      EXPECT_EQ(MetricValue(registry, "foreshock_auth_denied_total", {{"api", api}, {"reason", reason}}),
                0.0);
    }
  }
  auth.Denied("http", true);
  EXPECT_EQ(MetricValue(registry, "foreshock_auth_denied_total",
                        {{"api", "http"}, {"reason", "unauthenticated"}}),
            1.0);
}

}  // namespace
}  // namespace foreshock::server
