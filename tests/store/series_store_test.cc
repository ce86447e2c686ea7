// The interface's shared pieces (downsampling, checkpoint names) and the
// in-memory store.
#include "store/series_store.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "tests/store/store_test_support.h"

namespace foreshock::store {
namespace {

using testing::Key;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// Brute force: assign every point to bucket floor((step - lo) * n / span)
// computed without the width shortcut, then aggregate.
std::vector<Bucket> BruteForceDownsample(const std::vector<Point>& points, size_t max_points) {
  std::vector<Bucket> out;
  if (points.empty() || max_points == 0) return out;
  std::vector<std::vector<Point>> groups;
  if (points.size() <= max_points) {
    for (const Point& p : points) groups.push_back({p});
  } else {
    const long double lo = points.front().step, hi = points.back().step;
    const long double span = hi - lo + 1;
    const long double width = std::ceil(span / static_cast<long double>(max_points));
    std::map<long long, std::vector<Point>> by_bucket;
    for (const Point& p : points) {
      by_bucket[static_cast<long long>(std::floor((p.step - lo) / width))].push_back(p);
    }
    EXPECT_LE(by_bucket.size(), max_points);
    for (auto& [index, group] : by_bucket) groups.push_back(group);
  }
  for (const auto& group : groups) {
    Bucket b;
    b.first_step = group.front().step;
    b.last_step = group.back().step;
    b.count = group.size();
    b.last_value = group.back().value;
    double sum = 0;
    uint64_t finite = 0;
    for (const Point& p : group) {
      if (!std::isfinite(p.value)) {
        ++b.nonfinite;
        continue;
      }
      b.min = finite == 0 ? p.value : std::min(b.min, p.value);
      b.max = finite == 0 ? p.value : std::max(b.max, p.value);
      sum += p.value;
      ++finite;
    }
    if (finite > 0) b.mean = sum / static_cast<double>(finite);
    out.push_back(b);
  }
  return out;
}

void ExpectSameDouble(double expected, double actual, const char* what) {
  if (std::isnan(expected)) {
    EXPECT_TRUE(std::isnan(actual)) << what;
  } else {
    EXPECT_DOUBLE_EQ(expected, actual) << what;
  }
}

void ExpectSameBuckets(const std::vector<Bucket>& expected, const std::vector<Bucket>& actual) {
  ASSERT_EQ(expected.size(), actual.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(expected[i].first_step, actual[i].first_step);
    EXPECT_EQ(expected[i].last_step, actual[i].last_step);
    EXPECT_EQ(expected[i].count, actual[i].count);
    EXPECT_EQ(expected[i].nonfinite, actual[i].nonfinite);
    ExpectSameDouble(expected[i].min, actual[i].min, "min");
    ExpectSameDouble(expected[i].max, actual[i].max, "max");
    ExpectSameDouble(expected[i].mean, actual[i].mean, "mean");
    ExpectSameDouble(expected[i].last_value, actual[i].last_value, "last_value");
  }
}

TEST(DownsampleTest, MatchesBruteForceOnRandomSeries) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<Point> points;
    int64_t step = static_cast<int64_t>(rng() % 1000) - 500;
    const size_t n = rng() % 400;
    for (size_t i = 0; i < n; ++i) {
      step += static_cast<int64_t>(rng() % 7);  // gaps and repeated steps
      double value = std::normal_distribution<double>(0, 3)(rng);
      if (rng() % 17 == 0) value = kNaN;
      if (rng() % 29 == 0) value = (rng() % 2) ? kInf : -kInf;
      points.push_back(Point{step, value, 0});
    }
    const size_t max_points = 1 + rng() % 100;
    SCOPED_TRACE(::testing::Message() << "trial " << trial << " n " << n << " max " << max_points);
    ExpectSameBuckets(BruteForceDownsample(points, max_points), DownsamplePoints(points, max_points));
  }
}

TEST(DownsampleTest, OnePointPerBucketWhenFewPoints) {
  const std::vector<Point> points = {{1, 2.0, 0}, {5, kNaN, 0}, {9, -1.0, 0}};
  const auto buckets = DownsamplePoints(points, 3);
  ASSERT_EQ(buckets.size(), 3u);
  EXPECT_EQ(buckets[1].count, 1u);
  EXPECT_EQ(buckets[1].nonfinite, 1u);
  EXPECT_TRUE(std::isnan(buckets[1].mean));
  EXPECT_TRUE(std::isnan(buckets[1].last_value));
  EXPECT_EQ(buckets[2].min, -1.0);
  EXPECT_TRUE(DownsamplePoints(points, 0).empty());
  EXPECT_TRUE(DownsamplePoints({}, 10).empty());
}

TEST(DownsampleTest, FullInt64StepRangeDoesNotOverflow) {
  const std::vector<Point> points = {{std::numeric_limits<int64_t>::min(), 1.0, 0},
                                     {-1, 2.0, 0},
                                     {0, 3.0, 0},
                                     {std::numeric_limits<int64_t>::max(), 4.0, 0}};
  const auto buckets = DownsamplePoints(points, 2);
  ASSERT_EQ(buckets.size(), 2u);
  EXPECT_EQ(buckets[0].count, 2u);
  EXPECT_DOUBLE_EQ(buckets[0].mean, 1.5);
  EXPECT_EQ(buckets[1].first_step, 0);
  EXPECT_EQ(buckets[1].last_value, 4.0);
}

TEST(CheckpointNameTest, AcceptsPlainNamesOnly) {
  EXPECT_TRUE(IsValidCheckpointName("alert_engine-v1.state"));
  EXPECT_FALSE(IsValidCheckpointName(""));
  EXPECT_FALSE(IsValidCheckpointName(".hidden"));
  EXPECT_FALSE(IsValidCheckpointName("../etc/passwd"));
  EXPECT_FALSE(IsValidCheckpointName("a/b"));
  EXPECT_FALSE(IsValidCheckpointName(std::string(129, 'a')));
}

TEST(InMemorySeriesStoreTest, RangeIsSortedByStepAndBounded) {
  InMemorySeriesStore store(4);
  const SeriesKey key = Key("r", "loss");
  for (int64_t step : {5, 3, 9, 3, 7, 1}) store.Append(key, Point{step, double(step), 0});
  // Capacity 4 keeps the last four arrivals: 9, 3, 7, 1.
  const auto points = store.Range(key, 0, 100);
  ASSERT_EQ(points.size(), 4u);
  EXPECT_EQ(points[0].step, 1);
  EXPECT_EQ(points[1].step, 3);
  EXPECT_EQ(points[3].step, 9);
  EXPECT_EQ(store.Range(key, 4, 8).size(), 1u);
  EXPECT_TRUE(store.Range(Key("r", "other"), 0, 100).empty());
}

TEST(InMemorySeriesStoreTest, ListsRunsSeriesEventsAndCheckpoints) {
  InMemorySeriesStore store(100, 2);
  store.AppendBatch({{Key("b", "loss"), {10, 1, 1000}},
                     {Key("a", "qk_increment_entropy", 0, -1), {5, 1, 2000}},
                     {Key("a", "qk_increment_entropy", 1, -1), {7, 1, 1500}},
                     {Key("a", "loss"), {6, 1, 1200}}});
  const auto runs = store.ListRuns();
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[0].run, "a");
  EXPECT_EQ(runs[0].first_step, 5);
  EXPECT_EQ(runs[0].last_step, 7);
  EXPECT_EQ(runs[0].series, 3u);
  EXPECT_EQ(runs[0].last_wall_time_ms, 2000);
  const auto series = store.ListSeries("a");
  ASSERT_EQ(series.size(), 3u);
  EXPECT_EQ(series[0].key.signal, "loss");
  EXPECT_EQ(series[2].key.layer, 1);
  EXPECT_EQ(series[2].points, 1u);

  store.AppendEvent("alert", "1");
  store.AppendEvent("alert", "2");
  store.AppendEvent("alert", "3");
  store.AppendEvent("other", "x");
  EXPECT_EQ(store.Events("alert"), (std::vector<std::string>{"2", "3"}));
  EXPECT_TRUE(store.Events("none").empty());

  EXPECT_FALSE(store.ReadCheckpoint("state").has_value());
  EXPECT_TRUE(store.WriteCheckpoint("state", "v1"));
  EXPECT_TRUE(store.WriteCheckpoint("state", "v2"));
  EXPECT_EQ(store.ReadCheckpoint("state"), "v2");
  EXPECT_FALSE(store.WriteCheckpoint("../x", "v"));
}

TEST(InMemorySeriesStoreTest, DownsampleUsesRange) {
  InMemorySeriesStore store(1000);
  const SeriesKey key = Key("r", "grad_norm");
  std::vector<Point> points;
  for (int64_t step = 0; step < 500; ++step) {
    points.push_back(Point{step, std::sin(double(step)), 0});
    store.Append(key, points.back());
  }
  ExpectSameBuckets(BruteForceDownsample(points, 64), store.Downsample(key, 0, 499, 64));
  EXPECT_EQ(store.Downsample(key, 100, 199, 1000).size(), 100u);
}

TEST(BoundedRingTest, KeepsCapacityAfterPops) {
  BoundedRing<int> ring(5);
  for (int i = 0; i < 3; ++i) ring.push_back(i);
  ring.pop_front();
  ring.pop_front();
  for (int i = 3; i < 10; ++i) ring.push_back(i);
  ASSERT_EQ(ring.size(), 5u);
  EXPECT_EQ(ring.front(), 5);
  EXPECT_EQ(ring.back(), 9);
}

}  // namespace
}  // namespace foreshock::store
