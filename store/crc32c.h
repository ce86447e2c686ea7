// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of
// iSCSI, ext4 metadata and LevelDB logs. Table-driven, slicing-by-8 in
// software: no dependency on SSE4.2. Check value: Crc32c("123456789") ==
// 0xE3069283.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace foreshock::store {

// Continues a CRC over more bytes: Crc32cExtend(Crc32c(a), b) == Crc32c(a + b).
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size);

inline uint32_t Crc32c(const void* data, size_t size) { return Crc32cExtend(0, data, size); }
inline uint32_t Crc32c(std::string_view bytes) { return Crc32c(bytes.data(), bytes.size()); }

// The CRC of a + b from the CRCs of a and of b and b's length, without the
// bytes: Crc32cCombine(Crc32c(a), Crc32c(b), b.size()) == Crc32c(a + b).
// O(log len_b) (zlib's crc32_combine, with the Castagnoli polynomial). Lets
// a writer checksum pieces whose order in the file differs from the order it
// produces them in (a length field filled in after its contents).
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

}  // namespace foreshock::store
