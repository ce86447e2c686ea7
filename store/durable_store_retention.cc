// DurableSeriesStore's retention: the maintenance thread, whole old
// segments dropped past the age or size bound, and the series statistics
// recomputed after a drop.
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

void DurableSeriesStore::MaintenanceLoop() {
  using Clock = std::chrono::steady_clock;
  const bool periodic_sync = options_.fsync == FsyncPolicy::kInterval;
  Clock::time_point next_sync = Clock::now() + options_.fsync_interval;
  Clock::time_point next_retention = Clock::now() + options_.retention_check_interval;
  std::unique_lock lock(maintenance_mu_);
  while (!stopping_) {
    const Clock::time_point wake = periodic_sync ? std::min(next_sync, next_retention) : next_retention;
    maintenance_cv_.wait_until(lock, wake, [this] { return stopping_; });
    if (stopping_) break;
    lock.unlock();
    const Clock::time_point now = Clock::now();
    if (periodic_sync && now >= next_sync) {
      Sync();
      next_sync = now + options_.fsync_interval;
    }
    if (now >= next_retention) {
      EnforceRetention();
      next_retention = now + options_.retention_check_interval;
    }
    lock.lock();
  }
}

size_t DurableSeriesStore::EnforceRetention() {
  std::unique_lock lock(mu_);
  return EnforceRetentionLocked();
}

size_t DurableSeriesStore::EnforceRetentionLocked() {
  size_t deleted = 0;
  const int64_t now = Now();
  const int64_t max_age_ms = options_.retention_max_age.count();
  // The newest segment (the active one, while writing) is never deleted, and
  // only the oldest is: what remains is always a suffix of the log.
  while (segments_.size() > 1) {
    const Segment& oldest = segments_.begin()->second;
    const bool over_size =
        options_.retention_max_bytes > 0 && total_segment_bytes_ > options_.retention_max_bytes;
    const bool too_old = max_age_ms > 0 && oldest.newest_wall_time_ms < now - max_age_ms;
    if (!over_size && !too_old) break;
    DropOldestSegmentLocked();
    ++deleted;
  }
  return deleted;
}

void DurableSeriesStore::DropOldestSegmentLocked() {
  auto it = segments_.begin();
  const Segment& segment = it->second;
  if (::unlink(segment.path.c_str()) != 0 && errno != ENOENT) {
    Report(ErrnoMessage("retention: cannot delete", segment.path) +
           "; forgetting it anyway (it will be read again on the next open)");
  }
  for (uint32_t id : segment.series_ids) {
    if (id == kUnknownSeries) continue;
    SeriesState& s = series_[id];
    if (!s.spans.empty() && s.spans.front().segment == segment.sequence) {
      s.spans.erase(s.spans.begin());
    }
    while (!s.cache.empty() && s.cache.front().ordinal < segment.end_ordinal) s.cache.pop_front();
    RecomputeSeriesStatsLocked(s);
  }
  ++stats_.retention_deleted_segments;
  stats_.retention_deleted_bytes += segment.file_bytes;
  total_segment_bytes_ -= segment.file_bytes;
  segments_.erase(it);
}

void DurableSeriesStore::RecomputeSeriesStatsLocked(SeriesState& s) {
  s.points = 0;
  for (const SeriesSpan& span : s.spans) {
    if (s.points == 0) {
      s.min_step = span.min_step;
      s.max_step = span.max_step;
    } else {
      s.min_step = std::min(s.min_step, span.min_step);
      s.max_step = std::max(s.max_step, span.max_step);
    }
    s.points += span.points;
  }
}

}  // namespace foreshock::store
