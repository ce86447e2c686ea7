// Byte-level encodings shared by the log records: LEB128 varints, zigzag for
// signed values, little-endian fixed-width integers, length-prefixed strings.
// Decoders take a cursor (std::string_view*) and consume what they read; they
// return false, never read past the end, on truncated or malformed input.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace foreshock::store {

inline uint64_t ZigZagEncode(int64_t v) {
  return (static_cast<uint64_t>(v) << 1) ^ static_cast<uint64_t>(v >> 63);
}
inline int64_t ZigZagDecode(uint64_t v) {
  return static_cast<int64_t>(v >> 1) ^ -static_cast<int64_t>(v & 1);
}

inline void PutVarint64(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

inline bool GetVarint64(std::string_view* in, uint64_t* v) {
  uint64_t result = 0;
  for (int shift = 0; shift <= 63 && !in->empty(); shift += 7) {
    const uint8_t byte = static_cast<uint8_t>(in->front());
    in->remove_prefix(1);
    result |= static_cast<uint64_t>(byte & 0x7F) << shift;
    if ((byte & 0x80) == 0) {
      *v = result;
      return true;
    }
  }
  return false;  // truncated, or longer than ten bytes
}

inline void PutSignedVarint64(std::string* out, int64_t v) { PutVarint64(out, ZigZagEncode(v)); }
inline bool GetSignedVarint64(std::string_view* in, int64_t* v) {
  uint64_t u;
  if (!GetVarint64(in, &u)) return false;
  *v = ZigZagDecode(u);
  return true;
}

inline void PutFixed32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}
inline uint32_t DecodeFixed32(const char* p) {
  const auto* b = reinterpret_cast<const uint8_t*>(p);
  return uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 | uint32_t{b[3]} << 24;
}
inline void PutFixed64(std::string* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}
inline uint64_t DecodeFixed64(const char* p) {
  return uint64_t{DecodeFixed32(p)} | uint64_t{DecodeFixed32(p + 4)} << 32;
}

inline void PutLengthPrefixed(std::string* out, std::string_view bytes) {
  PutVarint64(out, bytes.size());
  out->append(bytes);
}
inline bool GetLengthPrefixed(std::string_view* in, std::string_view* bytes) {
  uint64_t size;
  if (!GetVarint64(in, &size) || size > in->size()) return false;
  *bytes = in->substr(0, size);
  in->remove_prefix(size);
  return true;
}

}  // namespace foreshock::store
