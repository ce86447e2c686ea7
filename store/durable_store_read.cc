// DurableSeriesStore's read path: a series' points by step range (the cache
// first, then the segments' blocks on disk), the runs, series and events.
#include "store/durable_store.h"
#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <cerrno>

#include "store/checkpoint.h"
#include "store/durable_store_internal.h"
#include "store/record_format.h"
#include "store/varint.h"

namespace foreshock::store {
using durable_internal::kUnknownSeries;
using durable_internal::Overlaps;

std::vector<std::string> DurableSeriesStore::Events(std::string_view kind) const {
  std::shared_lock lock(mu_);
  std::vector<std::string> out;
  auto it = events_.find(kind);
  if (it != events_.end()) it->second.ForEach([&](const std::string& e) { out.push_back(e); });
  return out;
}

std::vector<Point> DurableSeriesStore::Range(const SeriesKey& key, int64_t from_step,
                                             int64_t to_step) const {
  std::vector<Point> out;
  if (from_step > to_step) return out;
  std::vector<SegmentRead> reads;
  std::vector<Point> cached;
  uint64_t cache_start = std::numeric_limits<uint64_t>::max();
  {
    std::shared_lock lock(mu_);
    auto found = series_index_.find(key);
    if (found == series_index_.end()) return out;
    const SeriesState& s = series_[found->second];
    if (!s.cache.empty()) cache_start = s.cache.front().ordinal;
    // Plan the disk reads: blocks of this series' segments that hold steps
    // in range and points older than the cache.
    for (const SeriesSpan& span : s.spans) {
      if (!Overlaps(span.min_step, span.max_step, from_step, to_step)) continue;
      const Segment& segment = segments_.at(span.segment);
      if (segment.first_ordinal >= cache_start) break;
      SegmentRead read{segment.path, span.local_id,
                       static_cast<uint32_t>(segment.series_ids.size()), {}};
      for (uint32_t b = span.first_block; b <= span.last_block; ++b) {
        const Block& block = segment.blocks[b];
        if (block.first_ordinal >= cache_start) break;
        if (!Overlaps(block.min_step, block.max_step, from_step, to_step)) continue;
        const uint64_t end = block.end;
        if (!read.ranges.empty() && read.ranges.back().end == block.offset) {
          read.ranges.back().end = end;  // adjacent blocks: one read
          read.ranges.back().skips_damage |= block.skips_damage;
        } else {
          read.ranges.push_back(ByteRange{block.offset, end, block.first_ordinal, block.skips_damage});
        }
      }
      if (!read.ranges.empty()) reads.push_back(std::move(read));
    }
    s.cache.ForEach([&](const CachedPoint& c) {
      if (c.point.step >= from_step && c.point.step <= to_step) cached.push_back(c.point);
    });
  }
  for (const SegmentRead& read : reads) ReadFromSegment(read, from_step, to_step, cache_start, &out);
  // Disk points are all older than cached ones: arrival order is preserved
  // and the stable sort keeps it among equal steps.
  out.insert(out.end(), cached.begin(), cached.end());
  std::stable_sort(out.begin(), out.end(),
                   [](const Point& a, const Point& b) { return a.step < b.step; });
  return out;
}

void DurableSeriesStore::ReadFromSegment(const SegmentRead& read, int64_t from_step,
                                         int64_t to_step, uint64_t cache_start,
                                         std::vector<Point>* out) const {
  std::string open_error;
  const int fd = OpenRegularFile(read.path, O_RDONLY, &open_error);
  if (fd < 0) {
    if (errno != ENOENT) {  // ENOENT: retention deleted it since we planned
      ++read_errors_;
      Report("reading: " + open_error);
    }
    return;
  }
  FileHandle file(fd);
  std::string bytes, error;
  PointBlockCodec codec;
  std::vector<LocalPoint> points;
  for (const ByteRange& range : read.ranges) {
    if (!ReadExactlyAt(fd, range.begin, range.end - range.begin, &bytes, &error)) {
      ++read_errors_;
      Report("reading " + read.path + ": " + error);
      continue;
    }
    disk_bytes_read_ += bytes.size();
    uint64_t ordinal = range.first_ordinal;
    size_t offset = 0;
    Record record;
    ParseResult result;
    while (true) {
      result = ParseRecord(bytes, offset, &record);
      if (result != ParseResult::kOk && result != ParseResult::kEnd && range.skips_damage) {
        // A damaged series definition that recovery found safe to step over.
        const size_t next = FindNextRecord(bytes, offset + 1);
        if (next != std::string_view::npos) {
          offset = next;
          continue;
        }
      }
      if (result != ParseResult::kOk) break;
      offset += record.size;
      if (record.type == RecordType::kBlockStart) {
        codec.Reset();
      } else if (record.type == RecordType::kPoints) {
        if (!codec.Decode(record.payload, read.series_defined, &points)) {
          result = ParseResult::kCorrupt;
          break;
        }
        for (const LocalPoint& lp : points) {
          if (ordinal++ >= cache_start) return;  // the rest is in the cache
          if (lp.local_id == read.local_id && lp.point.step >= from_step &&
              lp.point.step <= to_step) {
            out->push_back(lp.point);
          }
        }
      }
    }
    if (result != ParseResult::kEnd) {
      ++read_errors_;
      Report("reading " + read.path + ": a record that was valid at open no longer is");
    }
  }
}

std::vector<RunInfo> DurableSeriesStore::ListRuns() const {
  std::shared_lock lock(mu_);
  std::map<std::string, RunInfo> runs;
  for (const SeriesState& s : series_) {
    if (s.points == 0) continue;
    auto [it, inserted] = runs.try_emplace(s.key.run);
    RunInfo& run = it->second;
    if (inserted) run = RunInfo{s.key.run, s.min_step, s.max_step, 0, s.last_wall_time_ms};
    run.first_step = std::min(run.first_step, s.min_step);
    run.last_step = std::max(run.last_step, s.max_step);
    run.last_wall_time_ms = std::max(run.last_wall_time_ms, s.last_wall_time_ms);
    ++run.series;
  }
  std::vector<RunInfo> out;
  for (auto& [name, info] : runs) out.push_back(std::move(info));
  return out;
}

std::vector<SeriesInfo> DurableSeriesStore::ListSeries(const std::string& run) const {
  std::vector<SeriesInfo> out;
  {
    std::shared_lock lock(mu_);
    for (const SeriesState& s : series_) {
      if (s.points > 0 && s.key.run == run) {
        out.push_back(SeriesInfo{s.key, s.min_step, s.max_step, s.points});
      }
    }
  }
  std::sort(out.begin(), out.end(), [](const SeriesInfo& a, const SeriesInfo& b) {
    return SeriesKeyLess(a.key, b.key);
  });
  return out;
}

}  // namespace foreshock::store
