#include "store/record_format.h"

#include <limits>

#include "store/crc32c.h"
#include "store/varint.h"

namespace foreshock::store {

void AppendRecord(std::string* out, RecordType type, std::string_view payload) {
  std::string length_and_type;
  PutFixed32(&length_and_type, static_cast<uint32_t>(payload.size()));
  length_and_type.push_back(static_cast<char>(type));
  const uint32_t crc = Crc32cExtend(Crc32c(length_and_type), payload.data(), payload.size());
  PutFixed32(out, crc);
  out->append(length_and_type);
  out->append(payload);
}

ParseResult ParseRecord(std::string_view data, size_t offset, Record* record) {
  if (offset >= data.size()) return ParseResult::kEnd;
  const std::string_view rest = data.substr(offset);
  if (rest.size() < kRecordHeaderBytes) return ParseResult::kTruncated;
  const uint32_t crc = DecodeFixed32(rest.data());
  const uint32_t length = DecodeFixed32(rest.data() + 4);
  const uint8_t type = static_cast<uint8_t>(rest[8]);
  if (length > kMaxRecordPayloadBytes) return ParseResult::kCorrupt;
  if (rest.size() - kRecordHeaderBytes < length) return ParseResult::kTruncated;
  const std::string_view payload = rest.substr(kRecordHeaderBytes, length);
  if (Crc32cExtend(Crc32c(rest.data() + 4, 5), payload.data(), payload.size()) != crc) {
    return ParseResult::kCorrupt;
  }
  if (type < static_cast<uint8_t>(RecordType::kSegmentHeader) ||
      type > static_cast<uint8_t>(RecordType::kCommit)) {
    return ParseResult::kCorrupt;
  }
  record->type = static_cast<RecordType>(type);
  record->payload = payload;
  record->size = kRecordHeaderBytes + length;
  return ParseResult::kOk;
}

size_t FindNextRecord(std::string_view data, size_t from) {
  Record record;
  for (size_t offset = from; offset + kRecordHeaderBytes <= data.size(); ++offset) {
    // Cheap tests first: most offsets fail on the type or the length before
    // any checksum is computed.
    const uint8_t type = static_cast<uint8_t>(data[offset + 8]);
    if (type < static_cast<uint8_t>(RecordType::kSegmentHeader) ||
        type > static_cast<uint8_t>(RecordType::kCommit)) {
      continue;
    }
    const uint32_t length = DecodeFixed32(data.data() + offset + 4);
    if (length > data.size() - offset - kRecordHeaderBytes) continue;
    if (ParseRecord(data, offset, &record) == ParseResult::kOk) return offset;
  }
  return std::string_view::npos;
}

std::string EncodeSegmentHeader(const SegmentHeader& header) {
  std::string out;
  PutVarint64(&out, header.version);
  PutVarint64(&out, header.sequence);
  PutSignedVarint64(&out, header.created_wall_time_ms);
  return out;
}

bool DecodeSegmentHeader(std::string_view payload, SegmentHeader* header) {
  uint64_t version, sequence;
  int64_t created;
  if (!GetVarint64(&payload, &version) || !GetVarint64(&payload, &sequence) ||
      !GetSignedVarint64(&payload, &created) || version < kOldestSegmentFormatVersion ||
      version > kSegmentFormatVersion) {
    return false;
  }
  header->version = static_cast<uint32_t>(version);
  header->sequence = sequence;
  header->created_wall_time_ms = created;
  return true;
}

std::string EncodeSegmentEnd(uint64_t points) {
  std::string out;
  PutVarint64(&out, points);
  return out;
}

bool DecodeSegmentEnd(std::string_view payload, uint64_t* points) {
  return GetVarint64(&payload, points) && payload.empty();
}

std::string EncodeSeriesDef(const SeriesDef& def) {
  std::string out;
  PutVarint64(&out, def.local_id);
  PutLengthPrefixed(&out, def.key.run);
  PutLengthPrefixed(&out, def.key.signal);
  PutSignedVarint64(&out, def.key.layer);
  PutSignedVarint64(&out, def.key.head);
  return out;
}

bool DecodeSeriesDef(std::string_view payload, SeriesDef* def) {
  uint64_t local_id;
  std::string_view run, signal;
  int64_t layer, head;
  if (!GetVarint64(&payload, &local_id) || !GetLengthPrefixed(&payload, &run) ||
      !GetLengthPrefixed(&payload, &signal) || !GetSignedVarint64(&payload, &layer) ||
      !GetSignedVarint64(&payload, &head) || !payload.empty()) {
    return false;
  }
  constexpr int64_t kIntMin = std::numeric_limits<int>::min();
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  if (local_id > std::numeric_limits<uint32_t>::max() || layer < kIntMin || layer > kIntMax ||
      head < kIntMin || head > kIntMax) {
    return false;
  }
  def->local_id = static_cast<uint32_t>(local_id);
  def->key = SeriesKey{std::string(run), std::string(signal), static_cast<int>(layer),
                       static_cast<int>(head)};
  return true;
}

std::string EncodeSeriesTable(const std::vector<SeriesDef>& defs) {
  std::string out;
  PutVarint64(&out, defs.size());
  for (const SeriesDef& def : defs) PutLengthPrefixed(&out, EncodeSeriesDef(def));
  return out;
}

bool DecodeSeriesTable(std::string_view payload, std::vector<SeriesDef>* defs) {
  uint64_t count;
  if (!GetVarint64(&payload, &count) || count > payload.size()) return false;
  defs->clear();
  for (uint64_t i = 0; i < count; ++i) {
    std::string_view bytes;
    SeriesDef def;
    if (!GetLengthPrefixed(&payload, &bytes) || !DecodeSeriesDef(bytes, &def)) return false;
    defs->push_back(std::move(def));
  }
  return payload.empty();
}

std::string EncodeEvent(const EventRecord& event) {
  std::string out;
  PutLengthPrefixed(&out, event.kind);
  PutSignedVarint64(&out, event.wall_time_ms);
  out.append(event.bytes);
  return out;
}

bool DecodeEvent(std::string_view payload, EventRecord* event) {
  if (!GetLengthPrefixed(&payload, &event->kind) ||
      !GetSignedVarint64(&payload, &event->wall_time_ms)) {
    return false;
  }
  event->bytes = payload;
  return true;
}

}  // namespace foreshock::store
