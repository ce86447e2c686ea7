#include "server/series_store.h"

#include <algorithm>
#include <functional>
#include <set>

namespace foreshock::server {

size_t SeriesKeyHash::operator()(const SeriesKey& key) const {
  size_t h = std::hash<std::string>()(key.run);
  h = h * 31 + std::hash<std::string>()(key.signal);
  h = h * 31 + std::hash<int>()(key.layer);
  h = h * 31 + std::hash<int>()(key.head);
  return h;
}

InMemorySeriesStore::InMemorySeriesStore(size_t capacity_per_series)
    : capacity_(std::max<size_t>(1, capacity_per_series)) {}

InMemorySeriesStore::Stripe& InMemorySeriesStore::StripeFor(const SeriesKey& key) const {
  return stripes_[SeriesKeyHash()(key) % kStripes];
}

void InMemorySeriesStore::Append(const SeriesKey& key, const Point& point) {
  Stripe& stripe = StripeFor(key);
  std::lock_guard<std::mutex> lock(stripe.mu);
  Ring& ring = stripe.series[key];
  if (ring.points.size() < capacity_) {
    ring.points.push_back(point);
  } else {
    ring.points[ring.next] = point;
    ring.next = (ring.next + 1) % capacity_;
  }
}

std::vector<Point> InMemorySeriesStore::Range(const SeriesKey& key, int64_t from_step,
                                              int64_t to_step) const {
  std::vector<Point> out;
  Stripe& stripe = StripeFor(key);
  std::lock_guard<std::mutex> lock(stripe.mu);
  auto it = stripe.series.find(key);
  if (it == stripe.series.end()) return out;
  const Ring& ring = it->second;
  const size_t n = ring.points.size();
  for (size_t i = 0; i < n; ++i) {
    const Point& p = ring.points[(ring.next + i) % n];
    if (p.step >= from_step && p.step <= to_step) out.push_back(p);
  }
  return out;
}

std::vector<std::string> InMemorySeriesStore::ListRuns() const {
  std::set<std::string> runs;
  for (const Stripe& stripe : stripes_) {
    std::lock_guard<std::mutex> lock(stripe.mu);
    for (const auto& [key, ring] : stripe.series) runs.insert(key.run);
  }
  return {runs.begin(), runs.end()};
}

std::vector<SeriesKey> InMemorySeriesStore::ListSeries(const std::string& run) const {
  std::vector<SeriesKey> keys;
  for (const Stripe& stripe : stripes_) {
    std::lock_guard<std::mutex> lock(stripe.mu);
    for (const auto& [key, ring] : stripe.series) {
      if (key.run == run) keys.push_back(key);
    }
  }
  std::sort(keys.begin(), keys.end(), [](const SeriesKey& a, const SeriesKey& b) {
    return std::tie(a.signal, a.layer, a.head) < std::tie(b.signal, b.layer, b.head);
  });
  return keys;
}

}  // namespace foreshock::server
