#include "store/series_store.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <tuple>

namespace foreshock::store {

size_t SeriesKeyHash::operator()(const SeriesKey& key) const {
  size_t h = std::hash<std::string>()(key.run);
  h = h * 31 + std::hash<std::string>()(key.signal);
  h = h * 31 + std::hash<int>()(key.layer);
  h = h * 31 + std::hash<int>()(key.head);
  return h;
}

bool SeriesKeyLess(const SeriesKey& a, const SeriesKey& b) {
  return std::tie(a.run, a.signal, a.layer, a.head) < std::tie(b.run, b.signal, b.layer, b.head);
}

std::vector<Bucket> DownsamplePoints(const std::vector<Point>& points, size_t max_points) {
  std::vector<Bucket> out;
  if (points.empty() || max_points == 0) return out;
  if (points.size() <= max_points) {
    out.reserve(points.size());
    for (const Point& p : points) {
      StepDownsampler::Accumulator one;
      one.Add(p);
      out.push_back(one.Finish());
    }
    return out;
  }
  StepDownsampler downsampler(points.front().step, points.back().step, max_points);
  for (const Point& p : points) downsampler.Add(p);
  return downsampler.Finish();
}

StepDownsampler::StepDownsampler(int64_t first_step, int64_t last_step, size_t max_points)
    : first_step_(static_cast<uint64_t>(first_step)) {
  const u128 span = static_cast<u128>(static_cast<uint64_t>(last_step) - first_step_) + 1;
  const u128 buckets = std::max<size_t>(max_points, 1);
  width_ = (span + buckets - 1) / buckets;
}

void StepDownsampler::Accumulator::Add(const Point& p) {
  if (bucket.count == 0) bucket.first_step = p.step;
  bucket.last_step = p.step;
  bucket.last_value = p.value;
  ++bucket.count;
  if (!std::isfinite(p.value)) {
    ++bucket.nonfinite;
    return;
  }
  if (finite == 0) {
    bucket.min = bucket.max = p.value;
  } else {
    bucket.min = std::min(bucket.min, p.value);
    bucket.max = std::max(bucket.max, p.value);
  }
  sum += p.value;
  ++finite;
}

Bucket StepDownsampler::Accumulator::Finish() const {
  Bucket out = bucket;
  if (finite > 0) out.mean = sum / static_cast<double>(finite);
  return out;
}

void StepDownsampler::Add(const Point& point) {
  const u128 index = static_cast<u128>(static_cast<uint64_t>(point.step) - first_step_) / width_;
  if (open_.bucket.count > 0 && index != current_) {
    out_.push_back(open_.Finish());
    open_ = Accumulator();
  }
  current_ = index;
  open_.Add(point);
}

std::vector<Bucket> StepDownsampler::Finish() {
  if (open_.bucket.count > 0) out_.push_back(open_.Finish());
  open_ = Accumulator();
  return std::move(out_);
}

std::vector<Bucket> SeriesStore::Downsample(const SeriesKey& key, int64_t from_step,
                                            int64_t to_step, size_t max_points) const {
  return DownsamplePoints(Range(key, from_step, to_step), max_points);
}

bool IsValidCheckpointName(std::string_view name) {
  if (name.empty() || name.size() > 128 || name.front() == '.') return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '.' || c == '_' || c == '-';
  });
}

InMemorySeriesStore::InMemorySeriesStore(size_t capacity_per_series, size_t events_per_kind)
    : capacity_(std::max<size_t>(1, capacity_per_series)),
      events_per_kind_(std::max<size_t>(1, events_per_kind)) {}

InMemorySeriesStore::Stripe& InMemorySeriesStore::StripeFor(const SeriesKey& key) const {
  return stripes_[SeriesKeyHash()(key) % kStripes];
}

absl::Status InMemorySeriesStore::AppendBatch(const std::vector<KeyedPoint>& points) {
  for (const auto& [key, point] : points) {
    Stripe& stripe = StripeFor(key);
    std::lock_guard<std::mutex> lock(stripe.mu);
    auto it = stripe.series.find(key);
    if (it == stripe.series.end()) {
      it = stripe.series.emplace(key, BoundedRing<Point>(capacity_)).first;
    }
    it->second.push_back(point);
  }
  return absl::OkStatus();
}

std::vector<Point> InMemorySeriesStore::Range(const SeriesKey& key, int64_t from_step,
                                              int64_t to_step) const {
  std::vector<Point> out;
  {
    Stripe& stripe = StripeFor(key);
    std::lock_guard<std::mutex> lock(stripe.mu);
    auto it = stripe.series.find(key);
    if (it == stripe.series.end()) return out;
    it->second.ForEach([&](const Point& p) {
      if (p.step >= from_step && p.step <= to_step) out.push_back(p);
    });
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const Point& a, const Point& b) { return a.step < b.step; });
  return out;
}

std::vector<SeriesInfo> InMemorySeriesStore::AllSeries() const {
  std::vector<SeriesInfo> all;
  for (const Stripe& stripe : stripes_) {
    std::lock_guard<std::mutex> lock(stripe.mu);
    for (const auto& [key, ring] : stripe.series) {
      if (ring.empty()) continue;
      SeriesInfo info{key, ring.front().step, ring.front().step, ring.size()};
      ring.ForEach([&](const Point& p) {
        info.first_step = std::min(info.first_step, p.step);
        info.last_step = std::max(info.last_step, p.step);
      });
      all.push_back(std::move(info));
    }
  }
  return all;
}

std::vector<RunInfo> InMemorySeriesStore::ListRuns() const {
  std::map<std::string, RunInfo> runs;
  for (const SeriesInfo& info : AllSeries()) {
    auto [it, inserted] = runs.try_emplace(info.key.run);
    RunInfo& run = it->second;
    if (inserted) {
      run = RunInfo{info.key.run, info.first_step, info.last_step, 0, 0};
    }
    run.first_step = std::min(run.first_step, info.first_step);
    run.last_step = std::max(run.last_step, info.last_step);
    ++run.series;
  }
  // Wall times need the points themselves.
  for (const Stripe& stripe : stripes_) {
    std::lock_guard<std::mutex> lock(stripe.mu);
    for (const auto& [key, ring] : stripe.series) {
      auto it = runs.find(key.run);
      if (it == runs.end()) continue;
      ring.ForEach([&](const Point& p) {
        it->second.last_wall_time_ms = std::max(it->second.last_wall_time_ms, p.wall_time_ms);
      });
    }
  }
  std::vector<RunInfo> out;
  for (auto& [name, info] : runs) out.push_back(std::move(info));
  return out;
}

std::vector<SeriesInfo> InMemorySeriesStore::ListSeries(const std::string& run) const {
  std::vector<SeriesInfo> out;
  for (SeriesInfo& info : AllSeries()) {
    if (info.key.run == run) out.push_back(std::move(info));
  }
  std::sort(out.begin(), out.end(), [](const SeriesInfo& a, const SeriesInfo& b) {
    return SeriesKeyLess(a.key, b.key);
  });
  return out;
}

absl::Status InMemorySeriesStore::AppendEvent(std::string_view kind, std::string_view bytes) {
  std::lock_guard<std::mutex> lock(blobs_mu_);
  auto it = events_.find(kind);
  if (it == events_.end()) {
    it = events_.emplace(std::string(kind), BoundedRing<std::string>(events_per_kind_)).first;
  }
  it->second.push_back(std::string(bytes));
  return absl::OkStatus();
}

std::vector<std::string> InMemorySeriesStore::Events(std::string_view kind) const {
  std::lock_guard<std::mutex> lock(blobs_mu_);
  std::vector<std::string> out;
  auto it = events_.find(kind);
  if (it != events_.end()) it->second.ForEach([&](const std::string& e) { out.push_back(e); });
  return out;
}

namespace {

// A checkpoint sink that collects the bytes in a string.
class StringCheckpointOutput final : public codec::StateSink {
 public:
  void Append(std::string_view bytes) override { bytes_.append(bytes); }
  void BeginLengthPrefixed() override {
    open_.push_back(bytes_.size());
    bytes_.append(8, '\0');
  }
  void EndLengthPrefixed() override {
    if (open_.empty()) return;
    const size_t at = open_.back();
    open_.pop_back();
    uint64_t length = bytes_.size() - at - 8;
    for (size_t i = 0; i < 8; ++i, length >>= 8) bytes_[at + i] = static_cast<char>(length & 0xff);
  }
  bool complete() const { return open_.empty(); }
  const std::string& bytes() const { return bytes_; }

 private:
  std::string bytes_;
  std::vector<size_t> open_;
};

}  // namespace

bool SeriesStore::WriteCheckpointStreamed(std::string_view name,
                                          const std::function<bool(codec::StateSink&)>& fill) {
  if (!IsValidCheckpointName(name)) return false;
  StringCheckpointOutput output;
  if (!fill(output) || !output.complete()) return false;
  return WriteCheckpoint(name, output.bytes());
}

bool InMemorySeriesStore::WriteCheckpoint(std::string_view name, std::string_view bytes) {
  if (!IsValidCheckpointName(name)) return false;
  std::lock_guard<std::mutex> lock(blobs_mu_);
  checkpoints_[std::string(name)] = std::string(bytes);
  return true;
}

std::optional<std::string> InMemorySeriesStore::ReadCheckpoint(std::string_view name) const {
  std::lock_guard<std::mutex> lock(blobs_mu_);
  auto it = checkpoints_.find(name);
  if (it == checkpoints_.end()) return std::nullopt;
  return it->second;
}

}  // namespace foreshock::store
