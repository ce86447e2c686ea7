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
#include "store/record_format.h"
#include "store/varint.h"

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

// A local id whose series definition was lost to damage.
constexpr uint32_t kUnknownSeries = ~uint32_t{0};

int64_t SteadyMillis() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
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

void DurableSeriesStore::QuarantineLocked(const std::string& path, const std::string& why) {
  const std::string name = path.substr(path.rfind('/') + 1);
  const std::string quarantine = options_.data_dir + "/quarantine";
  std::string error;
  std::string target = quarantine + "/" + name;
  for (int n = 1; ::access(target.c_str(), F_OK) == 0; ++n) {
    target = quarantine + "/" + name + "." + std::to_string(n);
  }
  if (!MakeDirectories(quarantine, &error) || ::rename(path.c_str(), target.c_str()) != 0) {
    if (error.empty()) error = ErrnoMessage("cannot move", path);
    Report("segment " + name + ": " + why + "; could not quarantine it (" + error +
           "), left in place");
    return;
  }
  SyncDirectory(segments_dir_, &error);
  SyncDirectory(quarantine, &error);
  ++stats_.quarantined_segments;
  Report("segment " + name + ": " + why + "; moved to " + target);
}

void DurableSeriesStore::RecoverSegmentLocked(uint64_t sequence, const std::string& path,
                                              bool newest) {
  const std::string name = path.substr(path.rfind('/') + 1);
  const std::string where = "segment " + name + ": ";
  std::string data, error;
  if (!ReadWholeFile(path, &data, &error)) {
    ++stats_.corrupt_segments;
    Report("cannot read segment: " + error + "; left in place");
    return;
  }
  if (data.empty()) {
    // Created but never written (a crash right after the create): nothing in it.
    ::unlink(path.c_str());
    Report(where + "empty (an interrupted creation); removed it");
    return;
  }

  // Pass 1, framing: the valid records in file order and the damaged regions
  // between them. After a bad record the scan resumes at the next record that
  // checks out; only bytes with no valid record after them form the tail.
  struct Found {
    size_t offset;
    Record record;
    bool after_damage;        // a damaged region lies just before it
    size_t damage_begin = 0;  // where that region begins
  };
  std::vector<Found> records;
  uint64_t damaged_regions = 0, damaged_bytes = 0;
  size_t first_damage = std::string_view::npos;
  const std::string_view bytes(data);
  size_t offset = bytes.substr(0, kSegmentMagic.size()) == kSegmentMagic ? kSegmentMagic.size() : 0;
  bool after_damage = offset == 0;  // a damaged magic
  size_t valid_end = 0;  // end of the last valid record
  size_t damage_begin = 0;
  while (offset < bytes.size()) {
    Record record;
    if (ParseRecord(bytes, offset, &record) == ParseResult::kOk) {
      records.push_back(Found{offset, record, after_damage, damage_begin});
      after_damage = false;
      offset += record.size;
      valid_end = offset;
      continue;
    }
    const size_t next = FindNextRecord(bytes, offset + 1);
    if (next == std::string_view::npos) break;  // the rest is the tail
    ++damaged_regions;
    damaged_bytes += next - offset;
    if (first_damage == std::string_view::npos) first_damage = offset;
    after_damage = true;
    damage_begin = offset;
    offset = next;
  }
  if (records.empty()) {
    ++stats_.corrupt_segments;
    stats_.skipped_bytes += data.size();
    QuarantineLocked(path, "no valid record in " + std::to_string(data.size()) + " bytes");
    return;
  }
  // An unsealed segment of format 2 or later holds whole writes only up to
  // its last kCommit: the records after it are a write the process did not
  // finish (killed mid-write()), cut like a torn record so that an append is
  // kept whole or not at all (record_format.h).
  SegmentHeader format;
  const bool commits_writes =
      records.front().record.type == RecordType::kSegmentHeader &&
      DecodeSegmentHeader(records.front().record.payload, &format) && format.version >= 2;
  const bool sealed = std::any_of(records.begin(), records.end(), [](const Found& f) {
    return f.record.type == RecordType::kSegmentEnd;
  });
  if (commits_writes && !sealed) {
    size_t keep = 0;
    for (size_t i = records.size(); i-- > 0;) {
      if (records[i].record.type == RecordType::kCommit) {
        keep = i + 1;
        break;
      }
    }
    if (keep == 0) {
      // Not even the creation finished: nothing was acknowledged in it.
      while (keep < records.size() && (records[keep].record.type == RecordType::kSegmentHeader ||
                                        records[keep].record.type == RecordType::kBlockStart)) {
        ++keep;
      }
    }
    for (size_t i = keep; i < records.size(); ++i) {
      if (!records[i].after_damage) continue;
      --damaged_regions;
      damaged_bytes -= records[i].offset - records[i].damage_begin;
    }
    if (keep < records.size()) {
      records.resize(keep);
      valid_end = records.back().offset + records.back().record.size;
      if (first_damage != std::string_view::npos && first_damage >= valid_end) {
        first_damage = std::string_view::npos;
      }
    }
  }
  const uint64_t tail_bytes = data.size() - valid_end;

  Segment segment;
  segment.sequence = sequence;
  segment.path = path;
  segment.file_bytes = data.size();
  segment.first_ordinal = segment.end_ordinal = next_ordinal_;
  std::vector<uint32_t>& ids = segment.series_ids;
  uint64_t bad_records = 0;  // valid framing, undecodable or misplaced contents

  // Pass 2, series definitions: inline ones, and the table a sealed segment
  // ends with (it restores definitions lost to damage).
  auto define = [&](const SeriesDef& def) {
    if (def.local_id >= data.size()) return false;  // each definition takes bytes
    if (def.local_id >= ids.size()) ids.resize(def.local_id + 1, kUnknownSeries);
    uint32_t& slot = ids[def.local_id];
    if (slot == kUnknownSeries) slot = InternSeriesLocked(def.key);
    return series_[slot].key == def.key;
  };
  std::vector<SeriesDef> table;
  for (const Found& f : records) {
    if (f.record.type == RecordType::kSeriesDef) {
      SeriesDef def;
      if (!DecodeSeriesDef(f.record.payload, &def) || !define(def)) ++bad_records;
    } else if (f.record.type == RecordType::kSeriesTable) {
      if (!DecodeSeriesTable(f.record.payload, &table)) {
        ++bad_records;
        continue;
      }
      for (const SeriesDef& def : table) define(def);
    }
  }

  // Pass 3, contents. Points are decoded against state that runs through a
  // block: after damage, the block's remaining points are skipped (counted)
  // until the next block start.
  PointBlockCodec codec;
  bool block_ok = false, have_header = false;
  std::optional<uint64_t> end_count;
  uint64_t skipped_points = 0;  // in points records that could not be decoded
  uint64_t orphan_points = 0;   // decoded, of a series whose definition was lost
  uint64_t records_read = 0;
  // Damage between two records leaves the block's encoding state unknown,
  // unless the damaged bytes are one series definition: the next one the
  // segment's series table lists, framed as such, its payload within a few
  // bytes of that definition's encoding. (A points record read as one would
  // decode points against the wrong state: never guess.)
  uint32_t next_local_id = 0;  // of the next series definition in the file
  auto only_a_known_definition = [&](size_t begin, size_t end) {
    if (table.empty() || end - begin < kRecordHeaderBytes) return false;
    const uint32_t length = DecodeFixed32(bytes.data() + begin + 4);
    if (static_cast<uint8_t>(bytes[begin + 8]) != static_cast<uint8_t>(RecordType::kSeriesDef) ||
        begin + kRecordHeaderBytes + length != end || next_local_id >= table.size() ||
        table[next_local_id].local_id != next_local_id) {
      return false;
    }
    const std::string expected = EncodeSeriesDef(table[next_local_id]);
    if (expected.size() != length) return false;
    size_t differences = 0;
    for (size_t k = 0; k < length; ++k) {
      differences += expected[k] != bytes[begin + kRecordHeaderBytes + k];
    }
    if (differences > 4) return false;
    ++next_local_id;
    return true;
  };
  // The points a damaged region held: its records' frames are still walked
  // (a flipped byte in a record's contents leaves its length, type and point
  // count readable), so that the report says what was lost, not "at least 0".
  // False when a frame in the region is unreadable: the count is a floor then.
  uint64_t damaged_points = 0;  // counted in damaged points records
  bool damage_uncounted = false;
  auto count_damaged_points = [&](size_t begin, size_t end) {
    while (begin < end) {
      if (end - begin < kRecordHeaderBytes) return false;
      const uint64_t length = DecodeFixed32(bytes.data() + begin + 4);
      if (length > end - begin - kRecordHeaderBytes) return false;
      const auto type = static_cast<uint8_t>(bytes[begin + 8]);
      if (type == static_cast<uint8_t>(RecordType::kPoints)) {
        std::string_view payload(bytes.data() + begin + kRecordHeaderBytes, length);
        uint64_t count = 0;
        // Every point takes at least four bits (point_codec.cc).
        if (!GetVarint64(&payload, &count) || count > 2 * length) return false;
        damaged_points += count;
      } else if (type < static_cast<uint8_t>(RecordType::kSegmentHeader) ||
                 type > static_cast<uint8_t>(RecordType::kCommit)) {
        return false;
      }
      begin += kRecordHeaderBytes + length;
    }
    return true;
  };
  for (size_t i = 0; i < records.size(); ++i) {
    const Found& f = records[i];
    if (f.after_damage) {
      if (!only_a_known_definition(f.damage_begin, f.offset)) {
        if (!count_damaged_points(f.damage_begin, f.offset)) damage_uncounted = true;
        block_ok = false;
      } else if (block_ok) {
        segment.blocks.back().skips_damage = true;
      }
    }
    if (end_count) {  // nothing is written after the end record
      ++bad_records;
      continue;
    }
    ++records_read;
    if (f.record.type == RecordType::kSeriesDef) {
      SeriesDef def;
      if (DecodeSeriesDef(f.record.payload, &def)) next_local_id = def.local_id + 1;
    }
    switch (f.record.type) {
      case RecordType::kSegmentHeader: {
        SegmentHeader header;
        if (i != 0 || !DecodeSegmentHeader(f.record.payload, &header)) {
          ++bad_records;
          break;
        }
        have_header = true;
        segment.newest_wall_time_ms = std::max(segment.newest_wall_time_ms, header.created_wall_time_ms);
        if (header.sequence != sequence) {
          Report(where + "header says sequence " + std::to_string(header.sequence) +
                 "; using the file name");
        }
        break;
      }
      case RecordType::kBlockStart:
        segment.blocks.push_back(Block{f.offset, next_ordinal_, f.offset + f.record.size});
        codec.Reset();
        block_ok = true;
        break;
      case RecordType::kSeriesDef:
      case RecordType::kSeriesTable:
        break;  // pass 2
      case RecordType::kCommit:
        break;  // applied above
      case RecordType::kPoints: {
        // Local ids beyond the known definitions belong to lost ones (the
        // checksum vouches for the record itself).
        const uint32_t series_defined =
            static_cast<uint32_t>(std::max<size_t>(ids.size(), damaged_regions > 0 ? data.size() : 0));
        if (block_ok && codec.Decode(f.record.payload, series_defined, &points_scratch_)) {
          for (const LocalPoint& lp : points_scratch_) {
            if (lp.local_id >= ids.size()) ids.resize(lp.local_id + 1, kUnknownSeries);
            if (ids[lp.local_id] == kUnknownSeries) {
              // Its definition was lost: the point keeps its place in the
              // block (reads count points by position) but belongs to no series.
              ++orphan_points;
              segment.end_ordinal = ++next_ordinal_;
            } else {
              IndexPointLocked(segment, ids[lp.local_id], lp.local_id, lp.point);
              ++stats_.recovered_points;
            }
          }
          segment.blocks.back().end = f.offset + f.record.size;
        } else {
          if (block_ok) ++bad_records;  // well framed, but does not decode
          block_ok = false;
          std::string_view payload = f.record.payload;
          uint64_t count = 0;
          if (GetVarint64(&payload, &count)) skipped_points += count;
        }
        break;
      }
      case RecordType::kEvent: {
        EventRecord event;
        if (!DecodeEvent(f.record.payload, &event)) {
          ++bad_records;
          break;
        }
        IndexEventLocked(event.kind, event.bytes);
        segment.newest_wall_time_ms = std::max(segment.newest_wall_time_ms, event.wall_time_ms);
        ++stats_.recovered_events;
        break;
      }
      case RecordType::kSegmentEnd: {
        uint64_t points;
        if (!DecodeSegmentEnd(f.record.payload, &points)) {
          ++bad_records;
        } else {
          end_count = points;
        }
        break;
      }
    }
  }
  stats_.recovered_records += records_read;
  if (!have_header && segment.newest_wall_time_ms == 0) {
    // No header and no timestamps: date it now rather than let age retention
    // take it for ancient.
    segment.newest_wall_time_ms = Now();
  }
  segment.valid_bytes = valid_end;

  const uint64_t read = segment.end_ordinal - segment.first_ordinal - orphan_points;
  uint64_t lost = skipped_points + orphan_points;
  bool lost_exact = false;
  // Without an end record (the newest segment after a crash) the loss counted
  // for sure is a floor. The damaged records' frames still say how many
  // points they held, but that count is read from damaged bytes (the flipped
  // byte can be the count itself), so it is reported as an estimate beside
  // the floor, never added to foreshock's lost-points figure.
  std::string estimate;
  if (damaged_points > 0) {
    estimate = " (by the damaged records' own counts " + std::to_string(lost + damaged_points) +
               (damage_uncounted ? " or more" : "") +
               ", read from damaged bytes: an estimate)";
  } else if (damage_uncounted) {
    estimate = " (a damaged record's frame is unreadable: its points cannot be counted)";
  }
  if (end_count && *end_count >= read) {
    // The end record counts every point written: the loss is known exactly.
    lost = *end_count - read;
    lost_exact = true;
    estimate.clear();
  }
  const bool damaged = damaged_regions > 0 || bad_records > 0 || lost > 0 || !have_header;
  std::string summary;
  if (damaged) {
    ++stats_.corrupt_segments;
    stats_.corrupt_records += damaged_regions + bad_records;
    stats_.skipped_bytes += damaged_bytes;
    stats_.lost_points += lost;
    summary = std::to_string(damaged_regions + bad_records) + " damaged record(s)" +
              (first_damage != std::string_view::npos
                   ? " (first at offset " + std::to_string(first_damage) + ")"
                   : std::string()) +
              ", " + std::to_string(damaged_bytes) + " bytes skipped, " +
              (lost_exact ? "" : "at least ") + std::to_string(lost) + " point(s) lost" +
              estimate + ", " + std::to_string(read) + " read";
    if (!have_header) summary += "; no valid segment header";
  }

  if (newest && !end_count) {
    // The newest segment is where an interrupted write lands: cut the torn
    // tail (no valid record follows it), then seal the segment so that later
    // opens see a complete one.
    std::vector<SeriesDef> defs;
    for (uint32_t local_id = 0; local_id < ids.size(); ++local_id) {
      if (ids[local_id] != kUnknownSeries) defs.push_back(SeriesDef{local_id, series_[ids[local_id]].key});
    }
    std::string seal;
    AppendRecord(&seal, RecordType::kSeriesTable, EncodeSeriesTable(defs));
    AppendRecord(&seal, RecordType::kSegmentEnd,
                 EncodeSegmentEnd(segment.end_ordinal - segment.first_ordinal));
    std::string write_error;
    const int fd = OpenRegularFile(path, O_WRONLY, &write_error);
    bool repaired = fd >= 0;
    if (repaired && ::ftruncate(fd, static_cast<off_t>(valid_end)) != 0) {
      write_error = ErrnoMessage("cannot truncate", path);
      repaired = false;
    }
    repaired = repaired && WriteAllAt(fd, seal, valid_end, &write_error);
    if (repaired && ::fsync(fd) != 0) {
      write_error = ErrnoMessage("cannot fsync", path);
      repaired = false;
    }
    if (fd >= 0) ::close(fd);
    const std::string tail =
        tail_bytes > 0 ? "truncated a torn tail of " + std::to_string(tail_bytes) +
                             " bytes at offset " + std::to_string(valid_end) +
                             " (an interrupted write)"
                       : std::string("not closed cleanly");
    if (repaired) {
      segment.valid_bytes = segment.file_bytes = valid_end + seal.size();
      stats_.truncated_bytes += tail_bytes;
      Report(where + (summary.empty() ? "" : summary + "; ") + tail + "; sealed it");
    } else {
      ++stats_.write_errors;
      Report(where + (summary.empty() ? "" : summary + "; ") + tail + "; cannot seal it: " +
             write_error);
    }
  } else if (tail_bytes > 0 || !end_count) {
    // An older segment is never modified: what cannot be read is reported.
    if (!damaged) ++stats_.corrupt_segments;
    stats_.skipped_bytes += tail_bytes;
    Report(where + (summary.empty() ? "" : summary + "; ") +
           (end_count ? std::to_string(tail_bytes) + " unreadable bytes after the end record"
                      : "ends at offset " + std::to_string(valid_end) +
                            " without an end record (cut short" +
                            (tail_bytes > 0 ? ", " + std::to_string(tail_bytes) +
                                                  " unreadable bytes after it"
                                            : std::string(" at a record boundary")) +
                            "); kept what is there"));
  } else if (damaged) {
    Report(where + summary + "; kept everything else");
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

std::vector<std::string> DurableSeriesStore::Events(std::string_view kind) const {
  std::shared_lock lock(mu_);
  std::vector<std::string> out;
  auto it = events_.find(kind);
  if (it != events_.end()) it->second.ForEach([&](const std::string& e) { out.push_back(e); });
  return out;
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
    std::string_view name, const std::function<bool(CheckpointOutput&)>& fill) {
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
