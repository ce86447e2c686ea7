// Recovery of one segment file when the store opens
// (DurableSeriesStore::RecoverSegmentLocked), in passes: framing (the valid
// records and the damaged regions between them), the cut of a write the
// process did not finish, series definitions, contents, and what is
// reported and repaired. Damage is skipped, never followed; the newest
// segment's torn tail is cut and the segment sealed; an older segment is
// never modified. Format: store/record_format.h; guarantees: docs/DESIGN.md §4.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "store/durable_store.h"
#include "store/durable_store_internal.h"
#include "store/record_format.h"
#include "store/varint.h"

namespace foreshock::store {
namespace {

using durable_internal::kUnknownSeries;

// Damage between two records leaves the block's encoding state unknown,
// unless the damaged bytes are one series definition: the next one the
// segment's series table lists, framed as such, its payload within a few
// bytes of that definition's encoding. (A points record read as one would
// decode points against the wrong state: never guess.) Advances
// `next_local_id` past the definition when it is one.
bool OnlyAKnownDefinition(std::string_view bytes, size_t begin, size_t end,
                          const std::vector<SeriesDef>& table, uint32_t& next_local_id) {
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
}

// The points a damaged region held: its records' frames are still walked
// (a flipped byte in a record's contents leaves its length, type and point
// count readable), so that the report says what was lost, not "at least 0".
// Adds them to `damaged_points`; false when a frame in the region is
// unreadable: the count is a floor then.
bool CountDamagedPoints(std::string_view bytes, size_t begin, size_t end,
                        uint64_t& damaged_points) {
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
}

}  // namespace

// What recovery learns about one segment file, pass by pass.
struct DurableSeriesStore::SegmentScan {
  struct Found {
    size_t offset;
    Record record;
    bool after_damage;        // a damaged region lies just before it
    size_t damage_begin = 0;  // where that region begins
  };
  std::string path;
  std::string where;  // "segment <name>: ", for reports
  std::string data;   // the whole file; records point into it
  std::string_view bytes;

  // Pass 1, framing.
  std::vector<Found> records;
  uint64_t damaged_regions = 0, damaged_bytes = 0;
  size_t first_damage = std::string_view::npos;
  size_t valid_end = 0;  // end of the last valid record

  Segment segment;
  uint64_t bad_records = 0;  // valid framing, undecodable or misplaced contents
  std::vector<SeriesDef> table;  // the sealed segment's series table (pass 2)

  // Pass 3, contents.
  bool have_header = false;
  std::optional<uint64_t> end_count;
  uint64_t skipped_points = 0;  // in points records that could not be decoded
  uint64_t orphan_points = 0;   // decoded, of a series whose definition was lost
  uint64_t records_read = 0;
  uint64_t damaged_points = 0;  // counted in damaged points records
  bool damage_uncounted = false;
};

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
  SegmentScan scan;
  scan.path = path;
  scan.where = "segment " + path.substr(path.rfind('/') + 1) + ": ";
  std::string error;
  if (!ReadWholeFile(path, &scan.data, &error)) {
    ++stats_.corrupt_segments;
    Report("cannot read segment: " + error + "; left in place");
    return;
  }
  if (scan.data.empty()) {
    // Created but never written (a crash right after the create): nothing in it.
    ::unlink(path.c_str());
    Report(scan.where + "empty (an interrupted creation); removed it");
    return;
  }
  scan.bytes = scan.data;
  FrameRecords(scan);
  if (scan.records.empty()) {
    ++stats_.corrupt_segments;
    stats_.skipped_bytes += scan.data.size();
    QuarantineLocked(path, "no valid record in " + std::to_string(scan.data.size()) + " bytes");
    return;
  }
  CutUnfinishedWrite(scan);

  scan.segment.sequence = sequence;
  scan.segment.path = path;
  scan.segment.file_bytes = scan.data.size();
  scan.segment.first_ordinal = scan.segment.end_ordinal = next_ordinal_;
  DefineSeriesLocked(scan);
  ReadContentsLocked(scan);
  FinishRecoveryLocked(scan, newest);
  ++stats_.recovered_segments;
  total_segment_bytes_ += scan.segment.file_bytes;
  segments_.emplace(sequence, std::move(scan.segment));
}

// Pass 1, framing: the valid records in file order and the damaged regions
// between them. After a bad record the scan resumes at the next record that
// checks out; only bytes with no valid record after them form the tail.
void DurableSeriesStore::FrameRecords(SegmentScan& scan) {
  const std::string_view bytes = scan.bytes;
  size_t offset = bytes.substr(0, kSegmentMagic.size()) == kSegmentMagic ? kSegmentMagic.size() : 0;
  bool after_damage = offset == 0;  // a damaged magic
  size_t damage_begin = 0;
  while (offset < bytes.size()) {
    Record record;
    if (ParseRecord(bytes, offset, &record) == ParseResult::kOk) {
      scan.records.push_back(SegmentScan::Found{offset, record, after_damage, damage_begin});
      after_damage = false;
      offset += record.size;
      scan.valid_end = offset;
      continue;
    }
    const size_t next = FindNextRecord(bytes, offset + 1);
    if (next == std::string_view::npos) break;  // the rest is the tail
    ++scan.damaged_regions;
    scan.damaged_bytes += next - offset;
    if (scan.first_damage == std::string_view::npos) scan.first_damage = offset;
    after_damage = true;
    damage_begin = offset;
    offset = next;
  }
}

// An unsealed segment of format 2 or later holds whole writes only up to
// its last kCommit: the records after it are a write the process did not
// finish (killed mid-write()), cut like a torn record so that an append is
// kept whole or not at all (record_format.h).
void DurableSeriesStore::CutUnfinishedWrite(SegmentScan& scan) {
  auto& records = scan.records;
  SegmentHeader format;
  const bool commits_writes =
      records.front().record.type == RecordType::kSegmentHeader &&
      DecodeSegmentHeader(records.front().record.payload, &format) && format.version >= 2;
  const bool sealed = std::any_of(records.begin(), records.end(), [](const SegmentScan::Found& f) {
    return f.record.type == RecordType::kSegmentEnd;
  });
  if (!commits_writes || sealed) return;
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
    --scan.damaged_regions;
    scan.damaged_bytes -= records[i].offset - records[i].damage_begin;
  }
  if (keep < records.size()) {
    records.resize(keep);
    scan.valid_end = records.back().offset + records.back().record.size;
    if (scan.first_damage != std::string_view::npos && scan.first_damage >= scan.valid_end) {
      scan.first_damage = std::string_view::npos;
    }
  }
}

// Pass 2, series definitions: inline ones, and the table a sealed segment
// ends with (it restores definitions lost to damage).
void DurableSeriesStore::DefineSeriesLocked(SegmentScan& scan) {
  std::vector<uint32_t>& ids = scan.segment.series_ids;
  auto define = [&](const SeriesDef& def) {
    if (def.local_id >= scan.data.size()) return false;  // each definition takes bytes
    if (def.local_id >= ids.size()) ids.resize(def.local_id + 1, kUnknownSeries);
    uint32_t& slot = ids[def.local_id];
    if (slot == kUnknownSeries) slot = InternSeriesLocked(def.key);
    return series_[slot].key == def.key;
  };
  for (const SegmentScan::Found& f : scan.records) {
    if (f.record.type == RecordType::kSeriesDef) {
      SeriesDef def;
      if (!DecodeSeriesDef(f.record.payload, &def) || !define(def)) ++scan.bad_records;
    } else if (f.record.type == RecordType::kSeriesTable) {
      if (!DecodeSeriesTable(f.record.payload, &scan.table)) {
        ++scan.bad_records;
        continue;
      }
      for (const SeriesDef& def : scan.table) define(def);
    }
  }
}

// Pass 3, contents. Points are decoded against state that runs through a
// block: after damage, the block's remaining points are skipped (counted)
// until the next block start.
void DurableSeriesStore::ReadContentsLocked(SegmentScan& scan) {
  Segment& segment = scan.segment;
  std::vector<uint32_t>& ids = segment.series_ids;
  PointBlockCodec codec;
  bool block_ok = false;
  uint32_t next_local_id = 0;  // of the next series definition in the file
  for (size_t i = 0; i < scan.records.size(); ++i) {
    const SegmentScan::Found& f = scan.records[i];
    if (f.after_damage) {
      if (!OnlyAKnownDefinition(scan.bytes, f.damage_begin, f.offset, scan.table,
                                next_local_id)) {
        if (!CountDamagedPoints(scan.bytes, f.damage_begin, f.offset, scan.damaged_points)) {
          scan.damage_uncounted = true;
        }
        block_ok = false;
      } else if (block_ok) {
        segment.blocks.back().skips_damage = true;
      }
    }
    if (scan.end_count) {  // nothing is written after the end record
      ++scan.bad_records;
      continue;
    }
    ++scan.records_read;
    if (f.record.type == RecordType::kSeriesDef) {
      SeriesDef def;
      if (DecodeSeriesDef(f.record.payload, &def)) next_local_id = def.local_id + 1;
    }
    switch (f.record.type) {
      case RecordType::kSegmentHeader: {
        SegmentHeader header;
        if (i != 0 || !DecodeSegmentHeader(f.record.payload, &header)) {
          ++scan.bad_records;
          break;
        }
        scan.have_header = true;
        segment.newest_wall_time_ms = std::max(segment.newest_wall_time_ms, header.created_wall_time_ms);
        if (header.sequence != segment.sequence) {
          Report(scan.where + "header says sequence " + std::to_string(header.sequence) +
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
        break;  // applied in CutUnfinishedWrite
      case RecordType::kPoints: {
        // Local ids beyond the known definitions belong to lost ones (the
        // checksum vouches for the record itself).
        const uint32_t series_defined = static_cast<uint32_t>(
            std::max<size_t>(ids.size(), scan.damaged_regions > 0 ? scan.data.size() : 0));
        if (block_ok && codec.Decode(f.record.payload, series_defined, &points_scratch_)) {
          for (const LocalPoint& lp : points_scratch_) {
            if (lp.local_id >= ids.size()) ids.resize(lp.local_id + 1, kUnknownSeries);
            if (ids[lp.local_id] == kUnknownSeries) {
              // Its definition was lost: the point keeps its place in the
              // block (reads count points by position) but belongs to no series.
              ++scan.orphan_points;
              segment.end_ordinal = ++next_ordinal_;
            } else {
              IndexPointLocked(segment, ids[lp.local_id], lp.local_id, lp.point);
              ++stats_.recovered_points;
            }
          }
          segment.blocks.back().end = f.offset + f.record.size;
        } else {
          if (block_ok) ++scan.bad_records;  // well framed, but does not decode
          block_ok = false;
          std::string_view payload = f.record.payload;
          uint64_t count = 0;
          if (GetVarint64(&payload, &count)) scan.skipped_points += count;
        }
        break;
      }
      case RecordType::kEvent: {
        EventRecord event;
        if (!DecodeEvent(f.record.payload, &event)) {
          ++scan.bad_records;
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
          ++scan.bad_records;
        } else {
          scan.end_count = points;
        }
        break;
      }
    }
  }
  stats_.recovered_records += scan.records_read;
  if (!scan.have_header && segment.newest_wall_time_ms == 0) {
    // No header and no timestamps: date it now rather than let age retention
    // take it for ancient.
    segment.newest_wall_time_ms = Now();
  }
  segment.valid_bytes = scan.valid_end;
}

// What was lost, counted into stats_; empty when the segment is undamaged.
std::string DurableSeriesStore::CountDamageLocked(const SegmentScan& scan) {
  const Segment& segment = scan.segment;
  const uint64_t read = segment.end_ordinal - segment.first_ordinal - scan.orphan_points;
  uint64_t lost = scan.skipped_points + scan.orphan_points;
  bool lost_exact = false;
  // Without an end record (the newest segment after a crash) the loss counted
  // for sure is a floor. The damaged records' frames still say how many
  // points they held, but that count is read from damaged bytes (the flipped
  // byte can be the count itself), so it is reported as an estimate beside
  // the floor, never added to foreshock's lost-points figure.
  std::string estimate;
  if (scan.damaged_points > 0) {
    estimate = " (by the damaged records' own counts " +
               std::to_string(lost + scan.damaged_points) +
               (scan.damage_uncounted ? " or more" : "") +
               ", read from damaged bytes: an estimate)";
  } else if (scan.damage_uncounted) {
    estimate = " (a damaged record's frame is unreadable: its points cannot be counted)";
  }
  if (scan.end_count && *scan.end_count >= read) {
    // The end record counts every point written: the loss is known exactly.
    lost = *scan.end_count - read;
    lost_exact = true;
    estimate.clear();
  }
  const uint64_t damaged_records = scan.damaged_regions + scan.bad_records;
  if (damaged_records == 0 && lost == 0 && scan.have_header) return "";
  ++stats_.corrupt_segments;
  stats_.corrupt_records += damaged_records;
  stats_.skipped_bytes += scan.damaged_bytes;
  stats_.lost_points += lost;
  std::string summary =
      std::to_string(damaged_records) + " damaged record(s)" +
      (scan.first_damage != std::string_view::npos
           ? " (first at offset " + std::to_string(scan.first_damage) + ")"
           : std::string()) +
      ", " + std::to_string(scan.damaged_bytes) + " bytes skipped, " +
      (lost_exact ? "" : "at least ") + std::to_string(lost) + " point(s) lost" + estimate +
      ", " + std::to_string(read) + " read";
  if (!scan.have_header) summary += "; no valid segment header";
  return summary;
}

// Reports what recovery found and, for the newest segment after a crash,
// cuts its torn tail and seals it.
void DurableSeriesStore::FinishRecoveryLocked(SegmentScan& scan, bool newest) {
  const std::string summary = CountDamageLocked(scan);
  const bool damaged = !summary.empty();
  const std::string& where = scan.where;
  const size_t valid_end = scan.valid_end;
  const uint64_t tail_bytes = scan.data.size() - valid_end;
  if (newest && !scan.end_count) {
    // The newest segment is where an interrupted write lands: cut the torn
    // tail (no valid record follows it), then seal the segment so that later
    // opens see a complete one.
    Segment& segment = scan.segment;
    const std::vector<uint32_t>& ids = segment.series_ids;
    std::vector<SeriesDef> defs;
    for (uint32_t local_id = 0; local_id < ids.size(); ++local_id) {
      if (ids[local_id] != kUnknownSeries) defs.push_back(SeriesDef{local_id, series_[ids[local_id]].key});
    }
    std::string seal;
    AppendRecord(&seal, RecordType::kSeriesTable, EncodeSeriesTable(defs));
    AppendRecord(&seal, RecordType::kSegmentEnd,
                 EncodeSegmentEnd(segment.end_ordinal - segment.first_ordinal));
    std::string write_error;
    const int fd = OpenRegularFile(scan.path, O_WRONLY, &write_error);
    bool repaired = fd >= 0;
    if (repaired && ::ftruncate(fd, static_cast<off_t>(valid_end)) != 0) {
      write_error = ErrnoMessage("cannot truncate", scan.path);
      repaired = false;
    }
    repaired = repaired && WriteAllAt(fd, seal, valid_end, &write_error);
    if (repaired && ::fsync(fd) != 0) {
      write_error = ErrnoMessage("cannot fsync", scan.path);
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
  } else if (tail_bytes > 0 || !scan.end_count) {
    // An older segment is never modified: what cannot be read is reported.
    if (!damaged) ++stats_.corrupt_segments;
    stats_.skipped_bytes += tail_bytes;
    Report(where + (summary.empty() ? "" : summary + "; ") +
           (scan.end_count ? std::to_string(tail_bytes) + " unreadable bytes after the end record"
                           : "ends at offset " + std::to_string(valid_end) +
                                 " without an end record (cut short" +
                                 (tail_bytes > 0 ? ", " + std::to_string(tail_bytes) +
                                                       " unreadable bytes after it"
                                                 : std::string(" at a record boundary")) +
                                 "); kept what is there"));
  } else if (damaged) {
    Report(where + summary + "; kept everything else");
  }
}

}  // namespace foreshock::store
