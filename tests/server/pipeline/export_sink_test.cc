// ExportSink::RestoreGauges: after a restart, the signal gauges of stored runs
// come back with their last stored value (docs/OPERATIONS.md).
#include "server/pipeline/export_sink.h"

#include <gtest/gtest.h>
#include <prometheus/registry.h>

#include <cmath>

#include "tests/server/metric_reader.h"

namespace foreshock::server {
namespace {

using testing::MetricValue;

class RestoreGaugesTest : public ::testing::Test {
 protected:
  void Store(const std::string& run, const std::string& signal, int layer, int head, int64_t step,
             double value) {
    ASSERT_TRUE(store_.Append(SeriesKey{run, signal, layer, head}, Point{step, value, 0}).ok());
  }
  size_t Restore(bool per_head) {
    metrics_ = std::make_unique<DaemonMetrics>(registry_, per_head);
    runs_ = std::make_unique<RunTracker>(*metrics_);
    sink_ = std::make_unique<ExportSink>(*metrics_, store_, *runs_);
    return sink_->RestoreGauges();
  }

  InMemorySeriesStore store_{64};
  prometheus::Registry registry_;
  std::unique_ptr<DaemonMetrics> metrics_;
  std::unique_ptr<RunTracker> runs_;
  std::unique_ptr<ExportSink> sink_;
};

TEST_F(RestoreGaugesTest, EverySeriesGetsItsValueAtTheHighestStoredStep) {
  Store("a", "qk_increment_entropy", 0, -1, 10, 0.5);
  Store("a", "qk_increment_entropy", 0, -1, 20, 0.25);  // the highest step wins
  Store("a", "qk_increment_entropy", 0, -1, 15, 0.75);  // arrived later, older step
  Store("a", "qk_increment_entropy", 1, -1, 20, 0.125);
  Store("a", "loss", -1, -1, 20, 2.5);
  Store("a", "curvature_block_rayleigh", 3, -1, 20, 7.0);
  Store("b", "router_entropy", 2, -1, 5, 0.9);
  Store("b", "router_entropy", 2, -1, 5, 0.8);  // the same step again (a resumed run): the last
  Store("b", "loss", -1, -1, 5, std::nan(""));   // a non-finite value is exported as stored
  Store("b", "qk_increment_entropy", 0, 1, 5, 0.3);  // a head: only with --per_head_metrics
  Store("b", "not_a_signal", -1, -1, 5, 1.0);

  EXPECT_EQ(Restore(/*per_head=*/false), 6u);
  EXPECT_EQ(MetricValue(registry_, "foreshock_qk_increment_entropy", {{"run", "a"}, {"layer", "0"}}),
            0.25);
  EXPECT_EQ(MetricValue(registry_, "foreshock_qk_increment_entropy", {{"run", "a"}, {"layer", "1"}}),
            0.125);
  EXPECT_EQ(MetricValue(registry_, "foreshock_loss", {{"run", "a"}}), 2.5);
  EXPECT_EQ(MetricValue(registry_, "foreshock_curvature_block_rayleigh",
                        {{"run", "a"}, {"block", "3"}}),
            7.0);
  EXPECT_EQ(MetricValue(registry_, "foreshock_router_entropy", {{"run", "b"}, {"layer", "2"}}), 0.8);
  EXPECT_TRUE(std::isnan(MetricValue(registry_, "foreshock_loss", {{"run", "b"}})));
  // Absent, not NaN-valued: MetricValue answers NaN for a missing series, so
  // look for the series itself.
  bool head_exported = false;
  for (const auto& family : registry_.Collect()) {
    if (family.name != "foreshock_qk_increment_entropy") continue;
    for (const auto& metric : family.metric) {
      for (const auto& label : metric.label) head_exported |= label.name == "head";
    }
  }
  EXPECT_FALSE(head_exported);
}

TEST_F(RestoreGaugesTest, PerHeadSeriesComeBackWithTheFlag) {
  Store("b", "qk_increment_entropy", 0, 1, 5, 0.3);
  EXPECT_EQ(Restore(/*per_head=*/true), 1u);
  EXPECT_EQ(MetricValue(registry_, "foreshock_qk_increment_entropy",
                        {{"run", "b"}, {"layer", "0"}, {"head", "1"}}),
            0.3);
}

TEST_F(RestoreGaugesTest, AnEmptyStoreRestoresNothing) { EXPECT_EQ(Restore(false), 0u); }

}  // namespace
}  // namespace foreshock::server
