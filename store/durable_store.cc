// DurableSeriesStore: opening the data directory (lock, recovery of every
// segment, the active segment), the series and event index, checkpoints,
// statistics and memory accounting. The write path, the read path,
// retention and segment recovery live in durable_store_write.cc,
// durable_store_read.cc, durable_store_retention.cc and segment_recovery.cc.
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
using durable_internal::HeapBytes;
using durable_internal::kMaxProblems;
using durable_internal::ParseSegmentFileName;

std::optional<FsyncPolicy> ParseFsyncPolicy(std::string_view name) {
  if (name == "every") return FsyncPolicy::kEvery;
  if (name == "interval") return FsyncPolicy::kInterval;
  if (name == "none") return FsyncPolicy::kNone;
  return std::nullopt;
}

std::string_view FsyncPolicyName(FsyncPolicy policy) {
  switch (policy) {
    case FsyncPolicy::kEvery: return "every";
    case FsyncPolicy::kInterval: return "interval";
    case FsyncPolicy::kNone: return "none";
  }
  return "?";
}

DurableSeriesStore::DurableSeriesStore(DurableStoreOptions options)
    : options_(std::move(options)),
      segments_dir_(options_.data_dir + "/segments"),
      checkpoints_dir_(options_.data_dir + "/checkpoints") {}

absl::StatusOr<std::unique_ptr<DurableSeriesStore>> DurableSeriesStore::Open(
    DurableStoreOptions options) {
  if (options.data_dir.empty()) return absl::InvalidArgumentError("empty data directory");
  if (options.segment_bytes == 0 || options.block_bytes == 0) {
    return absl::InvalidArgumentError("segment_bytes and block_bytes must be positive");
  }
  if (options.fsync_interval.count() <= 0 || options.retention_check_interval.count() <= 0) {
    return absl::InvalidArgumentError("fsync and retention intervals must be positive");
  }
  std::unique_ptr<DurableSeriesStore> store(new DurableSeriesStore(std::move(options)));
  if (absl::Status status = store->OpenImpl(); !status.ok()) return status;
  return store;
}

absl::Status DurableSeriesStore::OpenImpl() {
  std::string error;
  if (!MakeDirectories(segments_dir_, &error) || !MakeDirectories(checkpoints_dir_, &error)) {
    return absl::InternalError(error);
  }
  const std::string lock_path = options_.data_dir + "/LOCK";
  const int lock_fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
  if (lock_fd < 0) return absl::InternalError(ErrnoMessage("cannot open", lock_path));
  lock_file_ = std::make_unique<FileHandle>(lock_fd);
  if (!IsRegularFile(lock_path)) {
    return absl::FailedPreconditionError("not a regular file: " + lock_path);
  }
  if (::flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
    return absl::FailedPreconditionError(
        ErrnoMessage("data directory in use (another foreshockd?): cannot lock", lock_path));
  }

  DIR* dir = ::opendir(segments_dir_.c_str());
  if (dir == nullptr) return absl::InternalError(ErrnoMessage("cannot list", segments_dir_));
  std::vector<std::pair<uint64_t, std::string>> found;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string_view name = entry->d_name;
    if (name == "." || name == "..") continue;
    const std::string path = segments_dir_ + "/" + std::string(name);
    std::optional<uint64_t> sequence = ParseSegmentFileName(name);
    if (!sequence) {
      Report("ignoring unexpected file " + path);
    } else if (!IsRegularFile(path)) {
      // A FIFO would hang the read, a link could point out of the directory.
      Report("ignoring " + path + ": not a regular file");
      next_sequence_ = std::max(next_sequence_, *sequence + 1);
    } else {
      found.emplace_back(*sequence, path);
    }
  }
  ::closedir(dir);
  std::sort(found.begin(), found.end());

  std::unique_lock lock(mu_);
  for (size_t i = 0; i < found.size(); ++i) {
    if (i > 0 && found[i].first == found[i - 1].first) {  // "1.seg" next to "00000001.seg"
      Report("ignoring " + found[i].second + ": same sequence number as " + found[i - 1].second);
      continue;
    }
    RecoverSegmentLocked(found[i].first, found[i].second, i + 1 == found.size());
    next_sequence_ = std::max(next_sequence_, found[i].first + 1);
  }
  // Rolling also applies retention. A store that cannot write yet (a full
  // disk) still opens: it serves what it holds, refuses appends with the
  // reason, and starts a segment at the first append that can.
  if (absl::Status status = RollSegmentLocked(); !status.ok()) {
    Report("cannot start a segment yet (" + std::string(status.message()) +
           "); serving what is stored, refusing appends until the disk takes writes again");
  }
  lock.unlock();
  maintenance_ = std::thread([this] { MaintenanceLoop(); });
  return absl::OkStatus();
}

DurableSeriesStore::~DurableSeriesStore() {
  StopMaintenance();
  std::unique_lock lock(mu_);
  if (active_) SealActiveLocked();  // clean close: the end record, then fsync
}

void DurableSeriesStore::AbandonForTesting() {
  StopMaintenance();
  std::unique_lock lock(mu_);
  abandoned_ = true;
  active_.reset();     // closes without fsync
  lock_file_.reset();  // a killed process releases its flock too
}

void DurableSeriesStore::StopMaintenance() {
  {
    std::lock_guard<std::mutex> lock(maintenance_mu_);
    stopping_ = true;
  }
  maintenance_cv_.notify_all();
  if (maintenance_.joinable()) maintenance_.join();
}

int64_t DurableSeriesStore::Now() const {
  if (options_.clock) return options_.clock();
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string DurableSeriesStore::SegmentPath(uint64_t sequence) const {
  char name[32];
  std::snprintf(name, sizeof(name), "%08" PRIu64 ".seg", sequence);
  return segments_dir_ + "/" + name;
}

void DurableSeriesStore::Report(std::string problem) const {
  std::lock_guard<std::mutex> lock(problems_mu_);
  if (problems_.size() >= kMaxProblems) problems_.erase(problems_.begin());
  problems_.push_back(std::move(problem));
}

std::vector<std::string> DurableSeriesStore::Problems() const {
  std::lock_guard<std::mutex> lock(problems_mu_);
  return problems_;
}

uint32_t DurableSeriesStore::InternSeriesLocked(const SeriesKey& key) {
  auto [it, inserted] = series_index_.try_emplace(key, static_cast<uint32_t>(series_.size()));
  if (inserted) series_.emplace_back(key, options_.cache_points_per_series);
  return it->second;
}

void DurableSeriesStore::IndexPointLocked(Segment& segment, uint32_t series, uint32_t local_id,
                                          const Point& point) {
  const uint32_t block_index = static_cast<uint32_t>(segment.blocks.size() - 1);
  Block& block = segment.blocks.back();
  block.min_step = std::min(block.min_step, point.step);
  block.max_step = std::max(block.max_step, point.step);

  SeriesState& s = series_[series];
  if (s.spans.empty() || s.spans.back().segment != segment.sequence) {
    s.spans.push_back(
        SeriesSpan{segment.sequence, local_id, block_index, block_index, 0, point.step, point.step});
  }
  SeriesSpan& span = s.spans.back();
  span.last_block = block_index;
  ++span.points;
  span.min_step = std::min(span.min_step, point.step);
  span.max_step = std::max(span.max_step, point.step);

  if (s.points == 0) {
    s.min_step = s.max_step = point.step;
    s.last_wall_time_ms = point.wall_time_ms;
  } else {
    s.min_step = std::min(s.min_step, point.step);
    s.max_step = std::max(s.max_step, point.step);
    s.last_wall_time_ms = std::max(s.last_wall_time_ms, point.wall_time_ms);
  }
  ++s.points;
  s.cache.push_back(CachedPoint{point, next_ordinal_++});
  segment.end_ordinal = next_ordinal_;
  segment.newest_wall_time_ms = std::max(segment.newest_wall_time_ms, point.wall_time_ms);
}

void DurableSeriesStore::IndexEventLocked(std::string_view kind, std::string_view bytes) {
  auto it = events_.find(kind);
  if (it == events_.end()) {
    it = events_.emplace(std::string(kind), BoundedRing<std::string>(options_.events_per_kind))
             .first;
  }
  BoundedRing<std::string>& ring = it->second;
  size_t& held = event_bytes_[it->first];
  if (ring.size() == ring.capacity()) held -= ring.front().size();  // overwritten
  ring.push_back(std::string(bytes));
  held += bytes.size();
  while (held > options_.event_bytes_per_kind && ring.size() > 1) {
    held -= ring.front().size();
    ring.pop_front();
  }
}

bool DurableSeriesStore::WriteCheckpoint(std::string_view name, std::string_view bytes) {
  if (!IsValidCheckpointName(name)) {
    Report("refused checkpoint with invalid name '" + std::string(name) + "'");
    return false;
  }
  std::lock_guard<std::mutex> lock(checkpoint_mu_);
  std::string error;
  if (!WriteCheckpointFile(checkpoints_dir_, name, bytes, &error)) {
    Report("checkpoint " + std::string(name) + " not written: " + error);
    return false;
  }
  ++checkpoints_written_;
  return true;
}

bool DurableSeriesStore::WriteCheckpointStreamed(
    std::string_view name, const std::function<bool(codec::StateSink&)>& fill) {
  if (!IsValidCheckpointName(name)) {
    Report("refused checkpoint with invalid name '" + std::string(name) + "'");
    return false;
  }
  std::lock_guard<std::mutex> lock(checkpoint_mu_);
  CheckpointFileWriter writer(checkpoints_dir_, name);
  const bool filled = fill(writer);
  std::string error;
  if (!filled) error = writer.ok() ? "its producer gave up" : writer.error();
  if (!filled || !writer.Commit(&error)) {
    Report("checkpoint " + std::string(name) + " not written: " + error);
    return false;
  }
  ++checkpoints_written_;
  return true;
}

std::optional<std::string> DurableSeriesStore::ReadCheckpoint(std::string_view name) const {
  if (!IsValidCheckpointName(name)) return std::nullopt;
  std::string bytes, error;
  if (!CheckpointUsable(ReadCheckpointFile(checkpoints_dir_, name, &bytes, &error), error)) {
    return std::nullopt;
  }
  return bytes;
}

std::optional<CheckpointBytes> DurableSeriesStore::ReadLargeCheckpoint(
    std::string_view name) const {
  if (!IsValidCheckpointName(name)) return std::nullopt;
  CheckpointBytes bytes;
  std::string error;
  if (!CheckpointUsable(MapCheckpointFile(checkpoints_dir_, name, &bytes, &error), error)) {
    return std::nullopt;
  }
  return bytes;
}

bool DurableSeriesStore::CheckpointUsable(CheckpointStatus status, const std::string& error) const {
  switch (status) {
    case CheckpointStatus::kOk:
      return true;
    case CheckpointStatus::kMissing:
      return false;
    case CheckpointStatus::kCorrupt:
      ++corrupt_checkpoints_;
      Report(error + "; ignoring it");
      return false;
    case CheckpointStatus::kIoError:
      Report(error);
      return false;
  }
  return false;
}

DurableStoreStats DurableSeriesStore::Stats() const {
  std::shared_lock lock(mu_);
  DurableStoreStats stats = stats_;
  stats.fsyncs = fsyncs_.load();
  stats.read_errors = read_errors_.load();
  stats.disk_bytes_read = disk_bytes_read_.load();
  stats.checkpoints_written = checkpoints_written_.load();
  stats.write_errors += write_errors_.load();
  stats.disk_full_errors = disk_full_errors_.load();
  stats.corrupt_checkpoints = corrupt_checkpoints_.load();
  stats.segments = segments_.size();
  stats.segment_bytes_on_disk = total_segment_bytes_;
  stats.series = static_cast<uint64_t>(
      std::count_if(series_.begin(), series_.end(), [](const SeriesState& s) { return s.points > 0; }));
  return stats;
}

size_t DurableSeriesStore::ApproxMemoryBytes() const {
  std::shared_lock lock(mu_);
  // Hash map nodes: the key, the value, the next pointer and the cached hash.
  constexpr size_t kHashNodeBytes = sizeof(SeriesKey) + sizeof(uint32_t) + 2 * sizeof(void*);
  size_t bytes = sizeof(*this);
  bytes += series_index_.bucket_count() * sizeof(void*);
  bytes += series_.capacity() * sizeof(SeriesState);
  for (const SeriesState& s : series_) {
    // The key is held twice: in the index and in the state.
    bytes += kHashNodeBytes + 2 * (HeapBytes(s.key.run) + HeapBytes(s.key.signal));
    bytes += s.spans.capacity() * sizeof(SeriesSpan);
    bytes += s.cache.allocated() * sizeof(CachedPoint);
  }
  constexpr size_t kMapNodeBytes = 4 * sizeof(void*);  // red-black tree links and color
  for (const auto& [sequence, segment] : segments_) {
    bytes += kMapNodeBytes + sizeof(Segment) + HeapBytes(segment.path);
    bytes += segment.blocks.capacity() * sizeof(Block);
    bytes += segment.series_ids.capacity() * sizeof(uint32_t);
  }
  if (active_) bytes += active_->local_ids.capacity() * sizeof(uint32_t) + active_->codec.ApproxMemoryBytes();
  for (const auto& [kind, ring] : events_) {
    bytes += kMapNodeBytes + sizeof(kind) + sizeof(ring) + HeapBytes(kind) +
             ring.allocated() * sizeof(std::string);
    ring.ForEach([&](const std::string& e) { bytes += HeapBytes(e); });
  }
  bytes += scratch_.capacity() + payload_scratch_.capacity() +
           points_scratch_.capacity() * sizeof(LocalPoint) +
           (series_scratch_.capacity() + new_series_scratch_.capacity()) * sizeof(uint32_t);
  return bytes;
}

}  // namespace foreshock::store
