// Per-(run, signal, layer, head) time series. Prometheus sees only the latest
// value per scrape; the store keeps every step. This is the interface the
// durable store will implement; InMemorySeriesStore keeps a bounded ring per
// series.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace foreshock::server {

struct SeriesKey {
  std::string run;
  std::string signal;
  int layer = -1;  // -1: run-level signal
  int head = -1;   // -1: aggregated over heads

  bool operator==(const SeriesKey&) const = default;
};

struct SeriesKeyHash {
  size_t operator()(const SeriesKey& key) const;
};

struct Point {
  int64_t step = 0;
  double value = 0;
  int64_t wall_time_ms = 0;  // Unix epoch milliseconds at ingest processing
};

class SeriesStore {
 public:
  virtual ~SeriesStore() = default;
  virtual void Append(const SeriesKey& key, const Point& point) = 0;
  // Points with from_step <= step <= to_step, in arrival order.
  virtual std::vector<Point> Range(const SeriesKey& key, int64_t from_step,
                                   int64_t to_step) const = 0;
  virtual std::vector<std::string> ListRuns() const = 0;
  virtual std::vector<SeriesKey> ListSeries(const std::string& run) const = 0;
};

// Keeps the most recent `capacity` points of every series. Thread-safe; lock
// striping keeps workers appending to different series from contending.
class InMemorySeriesStore final : public SeriesStore {
 public:
  explicit InMemorySeriesStore(size_t capacity_per_series);
  void Append(const SeriesKey& key, const Point& point) override;
  std::vector<Point> Range(const SeriesKey& key, int64_t from_step,
                           int64_t to_step) const override;
  std::vector<std::string> ListRuns() const override;
  std::vector<SeriesKey> ListSeries(const std::string& run) const override;

 private:
  struct Ring {
    std::vector<Point> points;  // grows to capacity, then wraps
    size_t next = 0;            // index of the oldest point once full
  };
  struct Stripe {
    mutable std::mutex mu;
    std::unordered_map<SeriesKey, Ring, SeriesKeyHash> series;
  };
  static constexpr size_t kStripes = 16;

  Stripe& StripeFor(const SeriesKey& key) const;

  const size_t capacity_;
  mutable Stripe stripes_[kStripes];
};

}  // namespace foreshock::server
