#include "server/pipeline/series_limit.h"

#include <gtest/gtest.h>
#include <prometheus/registry.h>

#include <set>
#include <string>
#include <tuple>

namespace foreshock::server {
namespace {

struct RecordingSink : ObservationSink {
  std::multiset<std::tuple<std::string, std::string, int, int>> seen;
  int done = 0;
  void OnObservation(const detectors::Sample& sample,
                     const detectors::Observation& observation) override {
    seen.emplace(sample.run, std::string(observation.signal), observation.layer, observation.head);
  }
  void OnNonFinite(const detectors::Sample&, detectors::SampleKind, int64_t) override {}
  void OnSampleDone(const detectors::Sample&) override { ++done; }
};

TEST(SeriesLimitSinkTest, DropsNewSeriesBeyondTheLimitPerRunAndCountsThem) {
  prometheus::Registry registry;
  DaemonMetrics metrics(registry, false);
  RecordingSink inner;
  SeriesLimitSink sink(inner, 3, metrics);
  detectors::Sample a, b;
  a.run = "a";
  b.run = "b";
  for (int round = 0; round < 2; ++round) {  // known series keep flowing
    for (int layer = 0; layer < 5; ++layer) sink.OnObservation(a, {"x", layer, -1, 1.0});
  }
  for (int layer = 0; layer < 3; ++layer) sink.OnObservation(b, {"x", layer, -1, 1.0});
  sink.OnObservation(a, {"x", 0, 2, 1.0});  // another head: another series
  sink.OnSampleDone(a);

  EXPECT_EQ(inner.seen.size(), 2u * 3 + 3);
  EXPECT_EQ(inner.seen.count({"a", "x", 2, -1}), 2u);
  EXPECT_EQ(inner.seen.count({"a", "x", 3, -1}), 0u);
  EXPECT_EQ(inner.seen.count({"b", "x", 2, -1}), 1u);
  EXPECT_EQ(inner.done, 1);
  EXPECT_EQ(metrics.series_limited_total.Add({}).Value(), 2.0 * 2 + 1);
}

TEST(SeriesLimitSinkTest, ZeroMeansNoLimit) {
  prometheus::Registry registry;
  DaemonMetrics metrics(registry, false);
  RecordingSink inner;
  SeriesLimitSink sink(inner, 0, metrics);
  detectors::Sample a;
  a.run = "a";
  for (int layer = 0; layer < 100; ++layer) sink.OnObservation(a, {"x", layer, -1, 1.0});
  EXPECT_EQ(inner.seen.size(), 100u);
  EXPECT_EQ(metrics.series_limited_total.Add({}).Value(), 0.0);
}

// A forgotten run's series are no longer counted: when it comes back, it
// has its whole --max_series_per_run again (its stored series were kept by
// the store, not here).
TEST(SeriesLimitSinkTest, AForgottenRunIsNoLongerCounted) {
  prometheus::Registry registry;
  DaemonMetrics metrics(registry, false);
  RecordingSink inner;
  SeriesLimitSink sink(inner, 2, metrics);
  detectors::Sample a;
  a.run = "a";
  for (int layer = 0; layer < 3; ++layer) sink.OnObservation(a, {"x", layer, -1, 1.0});
  EXPECT_EQ(inner.seen.size(), 2u);
  EXPECT_EQ(sink.RunsCounted(), 1u);
  sink.OnRunForgotten("a");
  EXPECT_EQ(sink.RunsCounted(), 0u);
  sink.OnObservation(a, {"x", 2, -1, 1.0});
  EXPECT_EQ(inner.seen.count({"a", "x", 2, -1}), 1u);
}

}  // namespace
}  // namespace foreshock::server
