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

}  // namespace foreshock::store
