// DurableSeriesStore's write path: appending points and events (one write
// per batch, a commit record after it), rolling and sealing segments, write
// failures and their recovery, and group-commit fsync (docs/DESIGN.md §4).
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
using durable_internal::kMaxPointsPerRecord;
using durable_internal::SteadyMillis;

int DurableSeriesStore::InjectedFault(StoreFileOp op) const {
  return options_.inject_fault ? options_.inject_fault(op) : 0;
}

absl::Status DurableSeriesStore::WriteFailed(int error, const std::string& what) {
  if (error == 0) error = EIO;
  write_errors_.fetch_add(1);
  const bool disk_full = error == ENOSPC || error == EDQUOT;
  if (disk_full) disk_full_errors_.fetch_add(1);
  const std::string message = what + ": " + std::strerror(error);
  {
    std::lock_guard<std::mutex> lock(write_error_mu_);
    write_error_ = message;
  }
  write_error_at_ms_ = SteadyMillis();
  // Reported when writing starts failing, not for every refused append.
  if (write_errno_.exchange(error) == 0) Report(message + "; refusing appends until writes succeed");
  return disk_full ? absl::ResourceExhaustedError(message) : absl::UnavailableError(message);
}

void DurableSeriesStore::WriteSucceeded() {
  if (write_errno_.load(std::memory_order_relaxed) != 0 && write_errno_.exchange(0) != 0) {
    Report("writes succeed again");
  }
}

absl::Status DurableSeriesStore::WriteHealth() const {
  const int error = write_errno_.load();
  if (error == 0) return absl::OkStatus();
  // After the retry interval the next append may try again (and clear it).
  if (SteadyMillis() - write_error_at_ms_.load() >= options_.write_retry_interval.count()) {
    return absl::OkStatus();
  }
  std::string message;
  {
    std::lock_guard<std::mutex> lock(write_error_mu_);
    message = write_error_;
  }
  return error == ENOSPC || error == EDQUOT ? absl::ResourceExhaustedError(message)
                                            : absl::UnavailableError(message);
}

absl::Status DurableSeriesStore::EnsureWritableLocked() {
  if (abandoned_) return absl::UnavailableError("the store is closed");
  if (active_ && !abandon_pending_ && !roll_pending_ &&
      active_->segment->valid_bytes < options_.segment_bytes) {
    return absl::OkStatus();
  }
  absl::Status status = RollSegmentLocked();
  // A full segment can take more while no new one can be made.
  if (!status.ok() && active_ && !abandon_pending_) return absl::OkStatus();
  return status;
}

absl::Status DurableSeriesStore::RollSegmentLocked() {
  // The new segment first: while it cannot be created, the active one stays
  // open (and unsealed).
  const uint64_t sequence = next_sequence_;
  const std::string path = SegmentPath(sequence);
  if (int error = InjectedFault(StoreFileOp::kCreate); error != 0) {
    return WriteFailed(error, "cannot create segment " + path);
  }
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) return WriteFailed(errno, "cannot create segment " + path);
  ++next_sequence_;
  auto file = std::make_shared<FileHandle>(fd);
  const int64_t now = Now();
  std::string bytes(kSegmentMagic);
  AppendRecord(&bytes, RecordType::kSegmentHeader,
               EncodeSegmentHeader(SegmentHeader{kSegmentFormatVersion, sequence, now}));
  const uint64_t block_offset = bytes.size();
  AppendRecord(&bytes, RecordType::kBlockStart, {});
  AppendRecord(&bytes, RecordType::kCommit, {});
  std::string error;
  int error_number = InjectedFault(StoreFileOp::kWrite);
  // With any fsync policy but none, the new directory entry must be durable
  // before points acknowledged in it are.
  if (error_number != 0 || !WriteAllAt(fd, bytes, 0, &error, &error_number) ||
      (options_.fsync != FsyncPolicy::kNone && !SyncDirectory(segments_dir_, &error))) {
    if (error_number == 0) error_number = errno;
    file.reset();
    ::unlink(path.c_str());
    return WriteFailed(error_number, "cannot start segment " + path);
  }

  if (active_) {
    if (abandon_pending_) {
      active_.reset();  // left unsealed: what reached its disk is unknown
    } else {
      SealActiveLocked();
    }
  }
  Segment segment;
  segment.sequence = sequence;
  segment.path = path;
  segment.file_bytes = segment.valid_bytes = bytes.size();
  segment.first_ordinal = segment.end_ordinal = next_ordinal_;
  segment.newest_wall_time_ms = now;
  segment.blocks.push_back(Block{block_offset, next_ordinal_, bytes.size()});
  Segment& stored = segments_.emplace(sequence, std::move(segment)).first->second;
  total_segment_bytes_ += bytes.size();
  stats_.bytes_written += bytes.size();
  ++stats_.segments_created;

  active_.emplace();
  active_->segment = &stored;
  active_->file = std::move(file);
  active_->block_offset = block_offset;
  roll_pending_ = abandon_pending_ = restart_block_ = false;
  EnforceRetentionLocked();
  return absl::OkStatus();
}

void DurableSeriesStore::SealActiveLocked() {
  // An abandoned store acts as a killed process.
  if (abandoned_) {
    active_.reset();
    return;
  }
  Segment& segment = *active_->segment;
  // The series table repeats every definition, so that a damaged kSeriesDef
  // earlier in the segment orphans none of its points.
  std::vector<SeriesDef> defs;
  defs.reserve(segment.series_ids.size());
  for (uint32_t local_id = 0; local_id < segment.series_ids.size(); ++local_id) {
    defs.push_back(SeriesDef{local_id, series_[segment.series_ids[local_id]].key});
  }
  std::string seal, error;
  AppendRecord(&seal, RecordType::kSeriesTable, EncodeSeriesTable(defs));
  AppendRecord(&seal, RecordType::kSegmentEnd,
               EncodeSegmentEnd(segment.end_ordinal - segment.first_ordinal));
  int error_number = InjectedFault(StoreFileOp::kWrite);
  if (error_number == 0 &&
      WriteAllAt(active_->file->fd(), seal, segment.valid_bytes, &error, &error_number)) {
    segment.valid_bytes = segment.file_bytes = segment.valid_bytes + seal.size();
    total_segment_bytes_ += seal.size();
    stats_.bytes_written += seal.size();
  } else {
    // Left unsealed: the next open reports it and keeps what is there.
    ::ftruncate(active_->file->fd(), static_cast<off_t>(segment.valid_bytes));
    (void)WriteFailed(error_number, "cannot seal segment " + segment.path);
  }
  // Sealed segments are on disk whatever the policy, so SyncTo only ever
  // has the active segment to flush.
  error_number = InjectedFault(StoreFileOp::kSync);
  if (error_number == 0 && ::fdatasync(active_->file->fd()) != 0) error_number = errno;
  ++fsyncs_;
  if (error_number != 0) {
    {
      std::lock_guard<std::mutex> sync_lock(sync_mu_);
      MarkUnsyncedLocked(stats_.bytes_written);
    }
    (void)WriteFailed(error_number, "fsync failed for segment " + segment.path);
  }
  active_.reset();
}

void DurableSeriesStore::MarkUnsyncedLocked(uint64_t written) {
  if (written <= synced_bytes_) return;
  constexpr size_t kMaxUnsyncedRanges = 16;
  if (unsynced_ranges_.size() >= kMaxUnsyncedRanges) unsynced_ranges_.erase(unsynced_ranges_.begin());
  unsynced_ranges_.emplace_back(synced_bytes_, written);
}

absl::Status DurableSeriesStore::WriteLocked(const std::string& bytes) {
  Segment& segment = *active_->segment;
  std::string error;
  int error_number = InjectedFault(StoreFileOp::kWrite);
  if (error_number == 0 &&
      WriteAllAt(active_->file->fd(), bytes, segment.valid_bytes, &error, &error_number)) {
    segment.valid_bytes += bytes.size();
    segment.file_bytes = segment.valid_bytes;
    total_segment_bytes_ += bytes.size();
    stats_.bytes_written += bytes.size();
    return absl::OkStatus();
  }
  // Cut the partial record so that the segment stays readable to its end
  // (should this fail, the next write overwrites it from the same offset),
  // and restart point encoding: the encoder state includes this write.
  ::ftruncate(active_->file->fd(), static_cast<off_t>(segment.valid_bytes));
  restart_block_ = true;
  return WriteFailed(error_number, "segment " + segment.path + ": cannot write " +
                                       std::to_string(bytes.size()) + " bytes");
}

absl::Status DurableSeriesStore::AppendBatch(const std::vector<KeyedPoint>& batch) {
  if (batch.empty()) return absl::OkStatus();
  return AppendInternal(batch, std::nullopt);
}

absl::Status DurableSeriesStore::AppendBatchWithEvent(const std::vector<KeyedPoint>& points,
                                                      std::string_view kind,
                                                      std::string_view bytes) {
  if (kind.size() + bytes.size() + 32 > kMaxRecordPayloadBytes) {
    return absl::InvalidArgumentError("event of kind '" + std::string(kind) + "' too large (" +
                                      std::to_string(bytes.size()) + " bytes)");
  }
  return AppendInternal(points, std::make_pair(kind, bytes));
}

absl::Status DurableSeriesStore::AppendInternal(
    const std::vector<KeyedPoint>& batch,
    const std::optional<std::pair<std::string_view, std::string_view>>& event) {
  uint64_t written = 0;
  {
    std::unique_lock lock(mu_);
    auto refuse = [&](absl::Status status) {
      stats_.points_dropped += batch.size();
      if (event) ++stats_.events_dropped;
      ++stats_.appends_refused;
      return status;
    };
    if (absl::Status status = EnsureWritableLocked(); !status.ok()) return refuse(status);
    const int64_t now = Now();
    ActiveSegment& active = *active_;
    Segment& segment = *active.segment;
    scratch_.clear();
    series_scratch_.clear();
    points_scratch_.clear();
    new_series_scratch_.clear();

    const uint64_t block_size = segment.valid_bytes - active.block_offset;
    const bool new_block =
        !batch.empty() &&
        (restart_block_ || (block_size >= options_.block_bytes &&
                            block_size >= options_.block_bytes_per_series * active.codec.series_started()));
    if (new_block) {
      AppendRecord(&scratch_, RecordType::kBlockStart, {});
      active.codec.Reset();
    }
    for (const auto& [key, point] : batch) {
      const uint32_t series = InternSeriesLocked(key);
      if (active.local_ids.size() <= series) active.local_ids.resize(series_.size(), kNoLocalId);
      uint32_t& local_id = active.local_ids[series];
      if (local_id == kNoLocalId) {
        local_id = static_cast<uint32_t>(segment.series_ids.size() + new_series_scratch_.size());
        new_series_scratch_.push_back(series);
        AppendRecord(&scratch_, RecordType::kSeriesDef, EncodeSeriesDef(SeriesDef{local_id, key}));
      }
      series_scratch_.push_back(series);
      points_scratch_.push_back(LocalPoint{local_id, point});
    }
    for (size_t begin = 0; begin < points_scratch_.size(); begin += kMaxPointsPerRecord) {
      const size_t count = std::min(kMaxPointsPerRecord, points_scratch_.size() - begin);
      payload_scratch_.clear();
      active.codec.Encode(std::span<const LocalPoint>(points_scratch_).subspan(begin, count),
                          &payload_scratch_);
      AppendRecord(&scratch_, RecordType::kPoints, payload_scratch_);
    }
    if (event) {
      AppendRecord(&scratch_, RecordType::kEvent,
                   EncodeEvent(EventRecord{event->first, now, event->second}));
    }
    // Last: the write counts only once this record is on disk too.
    AppendRecord(&scratch_, RecordType::kCommit, {});

    const uint64_t block_offset = segment.valid_bytes;
    if (absl::Status status = WriteLocked(scratch_); !status.ok()) {
      // The definitions did not reach the file: the next write repeats them.
      for (uint32_t series : new_series_scratch_) active.local_ids[series] = kNoLocalId;
      return refuse(status);
    }
    if (event) {
      IndexEventLocked(event->first, event->second);
      segment.newest_wall_time_ms = std::max(segment.newest_wall_time_ms, now);
      ++stats_.events_appended;
    }
    // The write succeeded: now the index may refer to it.
    if (new_block) {
      segment.blocks.push_back(Block{block_offset, next_ordinal_, block_offset});
      active.block_offset = block_offset;
      restart_block_ = false;
    }
    segment.series_ids.insert(segment.series_ids.end(), new_series_scratch_.begin(),
                              new_series_scratch_.end());
    for (size_t i = 0; i < points_scratch_.size(); ++i) {
      IndexPointLocked(segment, series_scratch_[i], points_scratch_[i].local_id,
                       points_scratch_[i].point);
    }
    if (!batch.empty()) segment.blocks.back().end = segment.valid_bytes;
    stats_.points_appended += batch.size();
    if (!batch.empty()) ++stats_.batches_appended;
    written = stats_.bytes_written;
  }
  WriteSucceeded();
  if (options_.fsync != FsyncPolicy::kEvery) return absl::OkStatus();
  absl::Status synced = SyncTo(written);
  if (!synced.ok()) {
    std::unique_lock lock(mu_);
    stats_.points_dropped += batch.size();
    if (event) ++stats_.events_dropped;
    ++stats_.appends_refused;
  }
  return synced;
}

absl::Status DurableSeriesStore::AppendEvent(std::string_view kind, std::string_view bytes) {
  if (kind.size() + bytes.size() + 32 > kMaxRecordPayloadBytes) {
    {
      std::unique_lock lock(mu_);
      ++stats_.events_dropped;
    }
    Report("event of kind '" + std::string(kind) + "' too large (" +
           std::to_string(bytes.size()) + " bytes); dropped");
    return absl::InvalidArgumentError("event too large");
  }
  return AppendInternal({}, std::make_pair(kind, bytes));
}

bool DurableSeriesStore::InUnsyncedRangeLocked(uint64_t target) const {
  for (const auto& [from, to] : unsynced_ranges_) {
    if (target > from && target <= to) return true;
  }
  return false;
}

absl::Status DurableSeriesStore::SyncTo(uint64_t target) {
  std::unique_lock sync_lock(sync_mu_);
  while (true) {
    if (InUnsyncedRangeLocked(target)) {
      return absl::UnavailableError("fsync failed: the write may not be on disk");
    }
    if (synced_bytes_ >= target) return absl::OkStatus();
    if (abandoned_) return absl::UnavailableError("the store is closed");
    if (sync_running_) {  // someone else's fsync may cover us: wait for it
      sync_cv_.wait(sync_lock);
      continue;
    }
    sync_running_ = true;
    sync_lock.unlock();
    std::shared_ptr<FileHandle> file;
    std::string path;
    uint64_t covered = 0;
    {
      std::shared_lock lock(mu_);
      if (active_) {
        file = active_->file;
        path = active_->segment->path;
      }
      covered = stats_.bytes_written;  // earlier segments were synced when sealed
    }
    int error = 0;
    if (file) {
      error = InjectedFault(StoreFileOp::kSync);
      if (error == 0 && ::fdatasync(file->fd()) != 0) error = errno;
      ++fsyncs_;
    }
    sync_lock.lock();
    sync_running_ = false;
    if (error == 0) {
      synced_bytes_ = std::max(synced_bytes_, covered);
    } else {
      MarkUnsyncedLocked(covered);
    }
    sync_cv_.notify_all();
    if (error != 0) {
      sync_lock.unlock();
      {
        // What reached this segment's disk is unknown: write on in a new one.
        std::unique_lock lock(mu_);
        if (active_ && active_->file == file) abandon_pending_ = true;
      }
      return WriteFailed(error, "fsync failed for segment " + path);
    }
  }
}

bool DurableSeriesStore::Sync() {
  uint64_t written;
  {
    std::shared_lock lock(mu_);
    written = stats_.bytes_written;
  }
  return SyncTo(written).ok();
}

}  // namespace foreshock::store
