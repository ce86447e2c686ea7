// The on-disk layout of a segment file (segments/NNNNNNNN.seg):
//
//   "FSHKSEG1"                          8-byte magic
//   record*                             until the end of the file
//
//   record = crc32c   u32 little-endian, over the length, type and payload
//            length   u32 little-endian, payload bytes
//            type     u8 (RecordType)
//            payload
//
// The first record is a kSegmentHeader, the second a kBlockStart; a sealed
// segment ends with a kSeriesTable and a kSegmentEnd, so an older segment cut
// at a record boundary is still recognised as truncated.
//
// Every write (the segment's creation, each append) ends with a kCommit
// (version 2): a write is whole only up to its kCommit. A process killed in
// the middle of a write() can leave a prefix of it on disk (the kernel copies
// a write page by page and stops at a fatal signal), whole records included;
// recovery cuts the newest segment after its last kCommit, so an append is in
// the log whole or not at all, and a batch is never kept without the
// delivery mark written with it (server/ingest/delivery.h). Version 1
// segments (no kCommit) are read as before: cut after the last whole record. A series
// is introduced in each segment by a kSeriesDef before its first point there,
// so every segment decodes on its own: deleting older segments orphans
// nothing. Points (kPoints, store/point_codec.h) refer to series by their
// local id within the segment; their encoding state restarts at each
// kBlockStart.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "store/series_store.h"

namespace foreshock::store {

inline constexpr std::string_view kSegmentMagic = "FSHKSEG1";
inline constexpr uint32_t kSegmentFormatVersion = 2;
// The oldest segment format still read (without kCommit records).
inline constexpr uint32_t kOldestSegmentFormatVersion = 1;
inline constexpr size_t kRecordHeaderBytes = 9;
// Larger lengths are corruption; the writer splits batches well below this.
inline constexpr uint32_t kMaxRecordPayloadBytes = 64u << 20;

enum class RecordType : uint8_t {
  kSegmentHeader = 1,  // version, segment sequence number, creation wall time
  kBlockStart = 2,     // empty: point encoding state restarts here
  kSeriesDef = 3,      // local id, run, signal, layer, head
  kPoints = 4,         // one AppendBatch (or a part of a very large one)
  kEvent = 5,          // kind, wall time, opaque bytes
  kSegmentEnd = 6,     // number of points in the segment; nothing follows
  kSeriesTable = 7,    // every series definition of the segment again, written
                       // just before kSegmentEnd: a damaged kSeriesDef does not
                       // orphan the series' points in a sealed segment
  kCommit = 8,         // empty: ends one write; the records of an unfinished
                       // write (no kCommit after them) are cut at recovery
};

void AppendRecord(std::string* out, RecordType type, std::string_view payload);

enum class ParseResult {
  kOk,
  kEnd,        // no bytes left: a clean end
  kTruncated,  // the record runs past the end of the data (a torn write)
  kCorrupt,    // checksum mismatch, impossible length or unknown type
};

struct Record {
  RecordType type = RecordType::kPoints;
  std::string_view payload;
  size_t size = 0;  // header + payload
};

// Parses the record starting at `data[offset]`.
ParseResult ParseRecord(std::string_view data, size_t offset, Record* record);

// The offset of the first valid record (ParseRecord == kOk) at or after
// `from`, or std::string_view::npos. Used to resynchronise after damage: a
// record that checks out there is real with odds of 2^-32 against.
size_t FindNextRecord(std::string_view data, size_t from);

struct SegmentHeader {
  uint32_t version = kSegmentFormatVersion;
  uint64_t sequence = 0;
  int64_t created_wall_time_ms = 0;
};
std::string EncodeSegmentHeader(const SegmentHeader& header);
bool DecodeSegmentHeader(std::string_view payload, SegmentHeader* header);

std::string EncodeSegmentEnd(uint64_t points);
bool DecodeSegmentEnd(std::string_view payload, uint64_t* points);

struct SeriesDef {
  uint32_t local_id = 0;
  SeriesKey key;
};
std::string EncodeSeriesDef(const SeriesDef& def);
bool DecodeSeriesDef(std::string_view payload, SeriesDef* def);

// kSeriesTable: varint count, then count length-prefixed EncodeSeriesDef's.
std::string EncodeSeriesTable(const std::vector<SeriesDef>& defs);
bool DecodeSeriesTable(std::string_view payload, std::vector<SeriesDef>* defs);

struct EventRecord {
  std::string_view kind;
  int64_t wall_time_ms = 0;
  std::string_view bytes;
};
std::string EncodeEvent(const EventRecord& event);
// The decoded views point into `payload`.
bool DecodeEvent(std::string_view payload, EventRecord* event);

}  // namespace foreshock::store
