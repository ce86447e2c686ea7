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

#include "store/checkpoint.h"
#include "store/record_format.h"

namespace foreshock::store {
namespace {

// Splits huge batches so that no record comes near kMaxRecordPayloadBytes.
constexpr size_t kMaxPointsPerRecord = 8192;
constexpr size_t kMaxProblems = 256;

std::optional<uint64_t> ParseSegmentFileName(std::string_view name) {
  constexpr std::string_view kSuffix = ".seg";
  if (name.size() <= kSuffix.size() || !name.ends_with(kSuffix)) return std::nullopt;
  const std::string_view digits = name.substr(0, name.size() - kSuffix.size());
  if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return std::nullopt;
  }
  uint64_t sequence = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), sequence);
  if (ec != std::errc() || end != digits.data() + digits.size()) return std::nullopt;
  return sequence;
}

// Heap bytes of a string (short ones live inside the object).
size_t HeapBytes(const std::string& s) { return s.capacity() > 15 ? s.capacity() + 1 : 0; }

bool Overlaps(int64_t min_step, int64_t max_step, int64_t from_step, int64_t to_step) {
  return max_step >= from_step && min_step <= to_step;
}

}  // namespace

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
  const int lock_fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd < 0) return absl::InternalError(ErrnoMessage("cannot open", lock_path));
  lock_file_ = std::make_unique<FileHandle>(lock_fd);
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
    if (std::optional<uint64_t> sequence = ParseSegmentFileName(name)) {
      found.emplace_back(*sequence, segments_dir_ + "/" + std::string(name));
    } else {
      Report("ignoring unexpected file " + segments_dir_ + "/" + std::string(name));
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
  // Rolling also applies retention.
  if (!RollSegmentLocked()) {
    const std::vector<std::string> problems = Problems();
    return absl::InternalError("cannot start a segment in " + segments_dir_ + ": " +
                               (problems.empty() ? "" : problems.back()));
  }
  lock.unlock();
  maintenance_ = std::thread([this] { MaintenanceLoop(); });
  return absl::OkStatus();
}

void DurableSeriesStore::RecoverSegmentLocked(uint64_t sequence, const std::string& path,
                                              bool newest) {
  std::string data, error;
  if (!ReadWholeFile(path, &data, &error)) {
    ++stats_.corrupt_segments;
    Report("cannot read segment: " + error);
    return;
  }
  const std::string name = path.substr(path.rfind('/') + 1);
  Segment segment;
  segment.sequence = sequence;
  segment.path = path;
  segment.file_bytes = data.size();
  segment.first_ordinal = segment.end_ordinal = next_ordinal_;

  Record record;
  SegmentHeader header;
  size_t offset = kSegmentMagic.size();
  const bool header_ok = data.size() >= kSegmentMagic.size() &&
                         std::string_view(data).substr(0, kSegmentMagic.size()) == kSegmentMagic &&
                         ParseRecord(data, offset, &record) == ParseResult::kOk &&
                         record.type == RecordType::kSegmentHeader &&
                         DecodeSegmentHeader(record.payload, &header);
  if (!header_ok) {
    if (newest) {
      // Interrupted while the segment was being created: nothing in it.
      ::unlink(path.c_str());
      stats_.truncated_bytes += data.size();
      Report("segment " + name + ": no valid header in the newest segment (" +
             std::to_string(data.size()) + " bytes); removed it as an interrupted creation");
      return;
    }
    ++stats_.corrupt_segments;
    stats_.skipped_bytes += data.size();
    Report("segment " + name + ": bad magic or header; skipped all " +
           std::to_string(data.size()) + " bytes");
    total_segment_bytes_ += segment.file_bytes;
    segments_.emplace(sequence, std::move(segment));  // kept so retention can delete it
    return;
  }
  if (header.sequence != sequence) {
    Report("segment " + name + ": header says sequence " + std::to_string(header.sequence) +
           "; using the file name");
  }
  offset += record.size;
  segment.newest_wall_time_ms = header.created_wall_time_ms;
  uint64_t records = 1;

  PointBlockCodec codec;
  bool sealed = false;
  std::string problem;  // why the scan stopped early, if it did
  while (true) {
    const ParseResult result = ParseRecord(data, offset, &record);
    if (result == ParseResult::kEnd) break;
    if (sealed) {
      problem = "data after the end record";
    } else if (result == ParseResult::kTruncated) {
      problem = "record runs past the end of the file";
    } else if (result == ParseResult::kCorrupt) {
      problem = "checksum mismatch or bad record header";
    } else {
      switch (record.type) {
        case RecordType::kSegmentHeader:
          problem = "second segment header";
          break;
        case RecordType::kBlockStart:
          segment.blocks.push_back(Block{offset, next_ordinal_});
          codec.Reset();
          break;
        case RecordType::kSeriesDef: {
          SeriesDef def;
          if (!DecodeSeriesDef(record.payload, &def) || def.local_id != segment.series_ids.size()) {
            problem = "bad series definition";
          } else {
            segment.series_ids.push_back(InternSeriesLocked(def.key));
          }
          break;
        }
        case RecordType::kPoints:
          if (segment.blocks.empty()) {
            problem = "points before any block start";
          } else if (!codec.Decode(record.payload, static_cast<uint32_t>(segment.series_ids.size()),
                                   &points_scratch_)) {
            problem = "undecodable points";
          } else {
            for (const LocalPoint& lp : points_scratch_) {
              IndexPointLocked(segment, segment.series_ids[lp.local_id], lp.local_id, lp.point);
            }
            stats_.recovered_points += points_scratch_.size();
          }
          break;
        case RecordType::kEvent: {
          EventRecord event;
          if (!DecodeEvent(record.payload, &event)) {
            problem = "bad event";
          } else {
            IndexEventLocked(event.kind, event.bytes);
            segment.newest_wall_time_ms = std::max(segment.newest_wall_time_ms, event.wall_time_ms);
            ++stats_.recovered_events;
          }
          break;
        }
        case RecordType::kSegmentEnd: {
          uint64_t points;
          const uint64_t found = segment.end_ordinal - segment.first_ordinal;
          if (!DecodeSegmentEnd(record.payload, &points)) {
            problem = "bad end record";
          } else if (points != found) {
            problem = "end record counts " + std::to_string(points) + " points but " +
                      std::to_string(found) + " were read";
          } else {
            sealed = true;
          }
          break;
        }
      }
    }
    if (!problem.empty()) break;
    offset += record.size;
    ++records;
  }
  segment.valid_bytes = offset;
  stats_.recovered_records += records;
  const uint64_t rest = data.size() - offset;
  const std::string where = "segment " + name + ": ";

  if (newest && (!problem.empty() || !sealed)) {
    // The newest segment is where an interrupted write lands: cut the torn
    // tail and seal the segment, so that later opens see a complete one.
    std::string seal;
    AppendRecord(&seal, RecordType::kSegmentEnd,
                 EncodeSegmentEnd(segment.end_ordinal - segment.first_ordinal));
    const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    std::string write_error;
    bool repaired = fd >= 0;
    if (fd < 0) write_error = ErrnoMessage("cannot open", path);
    if (repaired && ::ftruncate(fd, static_cast<off_t>(offset)) != 0) {
      write_error = ErrnoMessage("cannot truncate", path);
      repaired = false;
    }
    repaired = repaired && WriteAllAt(fd, seal, offset, &write_error);
    if (repaired && ::fsync(fd) != 0) {
      write_error = ErrnoMessage("cannot fsync", path);
      repaired = false;
    }
    if (fd >= 0) ::close(fd);
    if (repaired) {
      segment.valid_bytes = segment.file_bytes = offset + seal.size();
      stats_.truncated_bytes += rest;
      Report(where +
             (problem.empty() ? std::string("not closed cleanly")
                              : problem + " at offset " + std::to_string(offset) + "; truncated " +
                                    std::to_string(rest) + " bytes (an interrupted write)") +
             "; sealed it");
    } else {
      ++stats_.corrupt_segments;
      stats_.skipped_bytes += rest;
      Report(where + (problem.empty() ? "not closed cleanly" : problem) + "; cannot repair: " +
             write_error);
    }
  } else if (!problem.empty()) {
    ++stats_.corrupt_records;
    ++stats_.corrupt_segments;
    stats_.skipped_bytes += rest;
    Report(where + problem + " at offset " + std::to_string(offset) + "; skipped the remaining " +
           std::to_string(rest) + " bytes of this segment");
  } else if (!sealed) {
    ++stats_.corrupt_segments;
    Report(where + "ends at offset " + std::to_string(offset) +
           " without an end record: truncated at a record boundary; kept what is there");
  }
  ++stats_.recovered_segments;
  total_segment_bytes_ += segment.file_bytes;
  segments_.emplace(sequence, std::move(segment));
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
  it->second.push_back(std::string(bytes));
}

bool DurableSeriesStore::EnsureWritableLocked() {
  if (failed_ || abandoned_) return false;
  if (!active_ || roll_pending_ || active_->segment->valid_bytes >= options_.segment_bytes) {
    return RollSegmentLocked();
  }
  return true;
}

bool DurableSeriesStore::RollSegmentLocked() {
  if (active_) SealActiveLocked();
  if (failed_) return false;
  const uint64_t sequence = next_sequence_++;
  const std::string path = SegmentPath(sequence);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    ++stats_.write_errors;
    Report(ErrnoMessage("cannot create segment", path));
    return false;
  }
  auto file = std::make_shared<FileHandle>(fd);
  const int64_t now = Now();
  std::string bytes(kSegmentMagic);
  AppendRecord(&bytes, RecordType::kSegmentHeader,
               EncodeSegmentHeader(SegmentHeader{kSegmentFormatVersion, sequence, now}));
  const uint64_t block_offset = bytes.size();
  AppendRecord(&bytes, RecordType::kBlockStart, {});
  std::string error;
  // With any fsync policy but none, the new directory entry must be durable
  // before points acknowledged in it are.
  if (!WriteAllAt(fd, bytes, 0, &error) ||
      (options_.fsync != FsyncPolicy::kNone && !SyncDirectory(segments_dir_, &error))) {
    ++stats_.write_errors;
    Report("cannot start segment " + path + ": " + error);
    file.reset();
    ::unlink(path.c_str());
    return false;
  }

  Segment segment;
  segment.sequence = sequence;
  segment.path = path;
  segment.file_bytes = segment.valid_bytes = bytes.size();
  segment.first_ordinal = segment.end_ordinal = next_ordinal_;
  segment.newest_wall_time_ms = now;
  segment.blocks.push_back(Block{block_offset, next_ordinal_});
  Segment& stored = segments_.emplace(sequence, std::move(segment)).first->second;
  total_segment_bytes_ += bytes.size();
  stats_.bytes_written += bytes.size();
  ++stats_.segments_created;

  active_.emplace();
  active_->segment = &stored;
  active_->file = std::move(file);
  active_->block_offset = block_offset;
  roll_pending_ = false;
  EnforceRetentionLocked();
  return true;
}

void DurableSeriesStore::SealActiveLocked() {
  // After an fsync error nothing more is written; an abandoned store acts
  // as a killed process.
  if (abandoned_ || failed_) {
    active_.reset();
    return;
  }
  Segment& segment = *active_->segment;
  std::string seal, error;
  AppendRecord(&seal, RecordType::kSegmentEnd,
               EncodeSegmentEnd(segment.end_ordinal - segment.first_ordinal));
  if (WriteAllAt(active_->file->fd(), seal, segment.valid_bytes, &error)) {
    segment.valid_bytes = segment.file_bytes = segment.valid_bytes + seal.size();
    total_segment_bytes_ += seal.size();
    stats_.bytes_written += seal.size();
  } else {
    ++stats_.write_errors;
    Report("cannot seal segment " + segment.path + ": " + error);
  }
  // Sealed segments are on disk whatever the policy, so Sync() only ever
  // has the active segment to flush.
  if (::fdatasync(active_->file->fd()) == 0) {
    ++fsyncs_;
  } else {
    failed_ = true;
    Report(ErrnoMessage("fsync failed; no longer writing:", segment.path));
  }
  active_.reset();
}

bool DurableSeriesStore::WriteLocked(const std::string& bytes) {
  Segment& segment = *active_->segment;
  std::string error;
  if (!WriteAllAt(active_->file->fd(), bytes, segment.valid_bytes, &error)) {
    ++stats_.write_errors;
    // Cut the partial record so that the segment stays readable to its end,
    // and continue in a new segment: the encoder state includes this write.
    if (::ftruncate(active_->file->fd(), static_cast<off_t>(segment.valid_bytes)) != 0) {
      Report(ErrnoMessage("cannot truncate after a failed write:", segment.path));
    }
    Report("segment " + segment.path + ": " + error + "; dropped " +
           std::to_string(bytes.size()) + " bytes, continuing in a new segment");
    roll_pending_ = true;
    return false;
  }
  segment.valid_bytes += bytes.size();
  segment.file_bytes = segment.valid_bytes;
  total_segment_bytes_ += bytes.size();
  stats_.bytes_written += bytes.size();
  return true;
}

void DurableSeriesStore::AppendBatch(const std::vector<KeyedPoint>& batch) {
  if (batch.empty()) return;
  AppendInternal(batch, std::nullopt);
}

void DurableSeriesStore::AppendBatchWithEvent(const std::vector<KeyedPoint>& points,
                                              std::string_view kind, std::string_view bytes) {
  if (kind.size() + bytes.size() + 32 > kMaxRecordPayloadBytes) {
    AppendBatch(points);
    AppendEvent(kind, bytes);  // reports and drops it
    return;
  }
  AppendInternal(points, std::make_pair(kind, bytes));
}

void DurableSeriesStore::AppendInternal(
    const std::vector<KeyedPoint>& batch,
    const std::optional<std::pair<std::string_view, std::string_view>>& event) {
  uint64_t written = 0;
  {
    std::unique_lock lock(mu_);
    if (!EnsureWritableLocked()) {
      stats_.points_dropped += batch.size();
      if (event) ++stats_.events_dropped;
      return;
    }
    const int64_t now = Now();
    ActiveSegment& active = *active_;
    Segment& segment = *active.segment;
    scratch_.clear();
    series_scratch_.clear();
    points_scratch_.clear();
    new_series_scratch_.clear();

    const uint64_t block_size = segment.valid_bytes - active.block_offset;
    const bool new_block =
        !batch.empty() && block_size >= options_.block_bytes &&
        block_size >= options_.block_bytes_per_series * active.codec.series_started();
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

    const uint64_t block_offset = segment.valid_bytes;
    if (!WriteLocked(scratch_)) {
      stats_.points_dropped += batch.size();
      if (event) ++stats_.events_dropped;
      return;
    }
    if (event) {
      IndexEventLocked(event->first, event->second);
      segment.newest_wall_time_ms = std::max(segment.newest_wall_time_ms, now);
      ++stats_.events_appended;
    }
    // The write succeeded: now the index may refer to it.
    if (new_block) {
      segment.blocks.push_back(Block{block_offset, next_ordinal_});
      active.block_offset = block_offset;
    }
    segment.series_ids.insert(segment.series_ids.end(), new_series_scratch_.begin(),
                              new_series_scratch_.end());
    for (size_t i = 0; i < points_scratch_.size(); ++i) {
      IndexPointLocked(segment, series_scratch_[i], points_scratch_[i].local_id,
                       points_scratch_[i].point);
    }
    stats_.points_appended += batch.size();
    if (!batch.empty()) ++stats_.batches_appended;
    written = stats_.bytes_written;
  }
  if (options_.fsync == FsyncPolicy::kEvery) SyncTo(written);
}

void DurableSeriesStore::AppendEvent(std::string_view kind, std::string_view bytes) {
  uint64_t written = 0;
  {
    std::unique_lock lock(mu_);
    if (kind.size() + bytes.size() + 32 > kMaxRecordPayloadBytes) {
      ++stats_.events_dropped;
      Report("event of kind '" + std::string(kind) + "' too large (" +
             std::to_string(bytes.size()) + " bytes); dropped");
      return;
    }
    if (!EnsureWritableLocked()) {
      ++stats_.events_dropped;
      return;
    }
    const int64_t now = Now();
    scratch_.clear();
    AppendRecord(&scratch_, RecordType::kEvent, EncodeEvent(EventRecord{kind, now, bytes}));
    if (!WriteLocked(scratch_)) {
      ++stats_.events_dropped;
      return;
    }
    IndexEventLocked(kind, bytes);
    Segment& segment = *active_->segment;
    segment.newest_wall_time_ms = std::max(segment.newest_wall_time_ms, now);
    ++stats_.events_appended;
    written = stats_.bytes_written;
  }
  if (options_.fsync == FsyncPolicy::kEvery) SyncTo(written);
}

std::vector<std::string> DurableSeriesStore::Events(std::string_view kind) const {
  std::shared_lock lock(mu_);
  std::vector<std::string> out;
  auto it = events_.find(kind);
  if (it != events_.end()) it->second.ForEach([&](const std::string& e) { out.push_back(e); });
  return out;
}

bool DurableSeriesStore::SyncTo(uint64_t target) {
  std::unique_lock sync_lock(sync_mu_);
  while (synced_bytes_ < target) {
    if (failed_ || abandoned_) return false;
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
    bool ok = true;
    if (file) {
      ok = ::fdatasync(file->fd()) == 0;
      ++fsyncs_;
      if (!ok) {
        failed_ = true;
        Report(ErrnoMessage("fsync failed; no longer writing:", path));
      }
    }
    sync_lock.lock();
    sync_running_ = false;
    if (ok) synced_bytes_ = std::max(synced_bytes_, covered);
    sync_cv_.notify_all();
    if (!ok) return false;
  }
  return true;
}

bool DurableSeriesStore::Sync() {
  uint64_t written;
  {
    std::shared_lock lock(mu_);
    written = stats_.bytes_written;
  }
  return SyncTo(written) && !failed_;
}

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
        const uint64_t end =
            b + 1 < segment.blocks.size() ? segment.blocks[b + 1].offset : segment.valid_bytes;
        if (!read.ranges.empty() && read.ranges.back().end == block.offset) {
          read.ranges.back().end = end;  // adjacent blocks: one read
        } else {
          read.ranges.push_back(ByteRange{block.offset, end, block.first_ordinal});
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
  const int fd = ::open(read.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno != ENOENT) {  // ENOENT: retention deleted it since we planned
      ++read_errors_;
      Report(ErrnoMessage("cannot open for reading", read.path));
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
    while ((result = ParseRecord(bytes, offset, &record)) == ParseResult::kOk) {
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

std::optional<std::string> DurableSeriesStore::ReadCheckpoint(std::string_view name) const {
  if (!IsValidCheckpointName(name)) return std::nullopt;
  std::string bytes, error;
  switch (ReadCheckpointFile(checkpoints_dir_, name, &bytes, &error)) {
    case CheckpointStatus::kOk:
      return bytes;
    case CheckpointStatus::kMissing:
      return std::nullopt;
    case CheckpointStatus::kCorrupt:
      ++corrupt_checkpoints_;
      Report(error + "; ignoring it");
      return std::nullopt;
    case CheckpointStatus::kIoError:
      Report(error);
      return std::nullopt;
  }
  return std::nullopt;
}

DurableStoreStats DurableSeriesStore::Stats() const {
  std::shared_lock lock(mu_);
  DurableStoreStats stats = stats_;
  stats.fsyncs = fsyncs_.load();
  stats.read_errors = read_errors_.load();
  stats.disk_bytes_read = disk_bytes_read_.load();
  stats.checkpoints_written = checkpoints_written_.load();
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
