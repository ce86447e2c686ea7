// Per-(run, signal, layer, head) time series. Prometheus sees only the latest
// value per scrape; the store keeps every step. Two implementations:
// InMemorySeriesStore (a bounded ring per series, for tests and for running
// without a data directory) and DurableSeriesStore (store/durable_store.h, an
// append-only log on disk).
//
// Pure storage: no gRPC, no Prometheus, no math beyond downsampling.
#pragma once

#include "absl/status/status.h"

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "store/bounded_ring.h"
#include "store/checkpoint.h"

namespace foreshock::store {

struct SeriesKey {
  std::string run;
  std::string signal;  // metric name without the foreshock_ prefix (docs/DESIGN.md §4.3)
  int layer = -1;      // -1: run-level signal
  int head = -1;       // -1: aggregated over heads

  bool operator==(const SeriesKey&) const = default;
};

struct SeriesKeyHash {
  size_t operator()(const SeriesKey& key) const;
};

// Orders by (run, signal, layer, head).
bool SeriesKeyLess(const SeriesKey& a, const SeriesKey& b);

struct Point {
  int64_t step = 0;
  double value = 0;
  int64_t wall_time_ms = 0;  // Unix epoch milliseconds at ingest processing
};

using KeyedPoint = std::pair<SeriesKey, Point>;

// One downsampled bucket. Non-finite values (NaN, ±inf) are counted in both
// `count` and `nonfinite` but excluded from min/max/mean, which are NaN when
// the bucket holds no finite value. `last_value` is the value of the bucket's
// last point as stored, finite or not: a series that ends in NaN shows it.
struct Bucket {
  int64_t first_step = 0;  // step of the bucket's first point
  int64_t last_step = 0;   // step of the bucket's last point
  double min = std::numeric_limits<double>::quiet_NaN();
  double max = std::numeric_limits<double>::quiet_NaN();
  double mean = std::numeric_limits<double>::quiet_NaN();
  uint64_t count = 0;      // every point, finite or not
  uint64_t nonfinite = 0;  // points whose value is NaN or ±inf
  double last_value = std::numeric_limits<double>::quiet_NaN();
};

struct RunInfo {
  std::string run;
  int64_t first_step = 0;  // smallest step of any of its series
  int64_t last_step = 0;   // largest step of any of its series
  size_t series = 0;
  int64_t last_wall_time_ms = 0;  // newest wall time of any point
};

struct SeriesInfo {
  SeriesKey key;
  int64_t first_step = 0;  // smallest stored step
  int64_t last_step = 0;   // largest stored step
  uint64_t points = 0;
};

// Buckets `points`, which must be sorted by step (as Range returns them).
// With at most `max_points` points: one bucket per point. Otherwise the step
// range [first point's step, last point's step] is split into at most
// `max_points` buckets of equal step width, and empty buckets are skipped.
// max_points == 0 yields no buckets.
std::vector<Bucket> DownsamplePoints(const std::vector<Point>& points, size_t max_points);

// The buckets DownsamplePoints makes of more than `max_points` points, fed
// one at a time in step order: the range's first and last points' steps fix
// the buckets, so a long range can be read and downsampled window by window
// without holding its points (server/query/query_backend.cc).
class StepDownsampler {
 public:
  StepDownsampler(int64_t first_step, int64_t last_step, size_t max_points);
  // Steps must not decrease and must lie in [first_step, last_step].
  void Add(const Point& point);
  std::vector<Bucket> Finish();

  // One bucket's running sums; the mean is sum / finite count.
  struct Accumulator {
    Bucket bucket;
    double sum = 0;
    uint64_t finite = 0;
    void Add(const Point& point);
    Bucket Finish() const;
  };

 private:
  using u128 = unsigned __int128;  // the step span can be as wide as int64 itself

  uint64_t first_step_;
  u128 width_;
  u128 current_ = 0;
  Accumulator open_;
  std::vector<Bucket> out_;
};

class SeriesStore {
 public:
  virtual ~SeriesStore() = default;

  // Appends all observations of one processed sample at once; a durable store
  // writes them as one log record. A non-OK status means the points are not
  // stored (a durable store: RESOURCE_EXHAUSTED when the disk is full,
  // UNAVAILABLE on another I/O error); whoever acknowledges data must not
  // acknowledge them.
  virtual absl::Status AppendBatch(const std::vector<KeyedPoint>& points) = 0;
  absl::Status Append(const SeriesKey& key, const Point& point) {
    return AppendBatch({{key, point}});
  }

  // OK while appends are expected to succeed. After a failed write a durable
  // store answers with that failure for a short while (then lets the next
  // append try again), so that callers can refuse work up front instead of
  // processing it and failing to store it.
  virtual absl::Status WriteHealth() const { return absl::OkStatus(); }

  // Every stored point with from_step <= step <= to_step, in ascending step
  // order; points with equal steps (a run resumed from a checkpoint) keep
  // their arrival order.
  virtual std::vector<Point> Range(const SeriesKey& key, int64_t from_step,
                                   int64_t to_step) const = 0;
  // Range, then DownsamplePoints.
  virtual std::vector<Bucket> Downsample(const SeriesKey& key, int64_t from_step,
                                         int64_t to_step, size_t max_points) const;

  // Sorted by run name.
  virtual std::vector<RunInfo> ListRuns() const = 0;
  // Series of `run` that hold at least one point, sorted by (signal, layer, head).
  virtual std::vector<SeriesInfo> ListSeries(const std::string& run) const = 0;

  // Opaque records (alert transitions, serialized by the caller). The store
  // keeps the most recent N per kind in memory; Events returns them oldest first.
  virtual absl::Status AppendEvent(std::string_view kind, std::string_view bytes) = 0;
  virtual std::vector<std::string> Events(std::string_view kind) const = 0;

  // AppendBatch and AppendEvent together. A durable store writes both in one
  // log write, so that after a crash both are there or neither (the ingest
  // service's dedup marks rely on it). The default appends one after the other.
  virtual absl::Status AppendBatchWithEvent(const std::vector<KeyedPoint>& points,
                                            std::string_view kind, std::string_view bytes) {
    if (!points.empty()) {
      if (absl::Status status = AppendBatch(points); !status.ok()) return status;
    }
    return AppendEvent(kind, bytes);
  }

  // Named blobs that replace each other whole (e.g. alert engine state).
  // Names: 1-128 characters of [A-Za-z0-9._-], not starting with '.'.
  // WriteCheckpoint returns false when the name is invalid or the write failed;
  // ReadCheckpoint returns nullopt when there is none or it is corrupt.
  virtual bool WriteCheckpoint(std::string_view name, std::string_view bytes) = 0;
  virtual std::optional<std::string> ReadCheckpoint(std::string_view name) const = 0;
  // The same, for a checkpoint that may be large (detector state): a
  // durable store maps the file instead of reading it into the heap
  // (CheckpointBytes). This default wraps ReadCheckpoint.
  virtual std::optional<CheckpointBytes> ReadLargeCheckpoint(std::string_view name) const {
    std::optional<std::string> bytes = ReadCheckpoint(name);
    if (!bytes) return std::nullopt;
    return CheckpointBytes(std::move(*bytes));
  }
  // The same checkpoint, produced piece by piece: `fill` appends the bytes
  // to the output it is given (false: abandon it, the previous checkpoint
  // stays). A durable store streams them to the file, so a large state is
  // never copied whole in memory; this default collects them and calls
  // WriteCheckpoint. The bytes read back are the same either way.
  virtual bool WriteCheckpointStreamed(std::string_view name,
                                       const std::function<bool(codec::StateSink&)>& fill);
};

bool IsValidCheckpointName(std::string_view name);

// Keeps the most recent `capacity_per_series` points of every series and the
// last `events_per_kind` events of every kind. Thread-safe; lock striping keeps
// workers appending to different series from contending.
class InMemorySeriesStore final : public SeriesStore {
 public:
  explicit InMemorySeriesStore(size_t capacity_per_series, size_t events_per_kind = 1024);

  absl::Status AppendBatch(const std::vector<KeyedPoint>& points) override;
  std::vector<Point> Range(const SeriesKey& key, int64_t from_step,
                           int64_t to_step) const override;
  std::vector<RunInfo> ListRuns() const override;
  std::vector<SeriesInfo> ListSeries(const std::string& run) const override;
  absl::Status AppendEvent(std::string_view kind, std::string_view bytes) override;
  std::vector<std::string> Events(std::string_view kind) const override;
  bool WriteCheckpoint(std::string_view name, std::string_view bytes) override;
  std::optional<std::string> ReadCheckpoint(std::string_view name) const override;

 private:
  struct Stripe {
    mutable std::mutex mu;
    std::unordered_map<SeriesKey, BoundedRing<Point>, SeriesKeyHash> series;
  };
  static constexpr size_t kStripes = 16;

  Stripe& StripeFor(const SeriesKey& key) const;
  std::vector<SeriesInfo> AllSeries() const;

  const size_t capacity_;
  const size_t events_per_kind_;
  mutable Stripe stripes_[kStripes];

  mutable std::mutex blobs_mu_;  // events and checkpoints
  std::map<std::string, BoundedRing<std::string>, std::less<>> events_;
  std::map<std::string, std::string, std::less<>> checkpoints_;
};

}  // namespace foreshock::store
