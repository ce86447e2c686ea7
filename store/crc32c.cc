#include "store/crc32c.h"

#include <array>

namespace foreshock::store {
namespace {

constexpr uint32_t kPolynomial = 0x82F63B78;  // 0x1EDC6F41 bit-reversed

// tables[k][b]: the CRC of byte b followed by k zero bytes, so eight bytes can
// be folded in with eight independent lookups.
using Tables = std::array<std::array<uint32_t, 256>, 8>;

constexpr Tables MakeTables() {
  Tables t{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t crc = b;
    for (int i = 0; i < 8; ++i) crc = (crc >> 1) ^ ((crc & 1) ? kPolynomial : 0);
    t[0][b] = crc;
  }
  for (int k = 1; k < 8; ++k) {
    for (uint32_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFF];
  }
  return t;
}

constexpr Tables kTables = MakeTables();

inline uint32_t LoadLittleEndian32(const uint8_t* p) {
  return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
}

}  // namespace

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  while (size >= 8) {
    const uint32_t lo = crc ^ LoadLittleEndian32(p);
    const uint32_t hi = LoadLittleEndian32(p + 4);
    crc = kTables[7][lo & 0xFF] ^ kTables[6][(lo >> 8) & 0xFF] ^ kTables[5][(lo >> 16) & 0xFF] ^
          kTables[4][lo >> 24] ^ kTables[3][hi & 0xFF] ^ kTables[2][(hi >> 8) & 0xFF] ^
          kTables[1][(hi >> 16) & 0xFF] ^ kTables[0][hi >> 24];
    p += 8;
    size -= 8;
  }
  while (size-- > 0) crc = (crc >> 8) ^ kTables[0][(crc ^ *p++) & 0xFF];
  return ~crc;
}

namespace {

// Multiplies the 32x32 bit matrix `matrix` (GF(2), one column per word) by `vector`.
uint32_t Gf2Times(const std::array<uint32_t, 32>& matrix, uint32_t vector) {
  uint32_t sum = 0;
  for (size_t i = 0; vector != 0; ++i, vector >>= 1) {
    if (vector & 1) sum ^= matrix[i];
  }
  return sum;
}

std::array<uint32_t, 32> Gf2Square(const std::array<uint32_t, 32>& matrix) {
  std::array<uint32_t, 32> square{};
  for (size_t i = 0; i < 32; ++i) square[i] = Gf2Times(matrix, matrix[i]);
  return square;
}

}  // namespace

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  if (len_b == 0) return crc_a;
  // The operator that appends one zero bit to the CRC register ...
  std::array<uint32_t, 32> odd{};
  odd[0] = kPolynomial;
  for (size_t i = 1; i < 32; ++i) odd[i] = uint32_t{1} << (i - 1);
  // ... squared twice: four zero bits; the loop squares on to one zero byte,
  // then applies the operator for each set bit of len_b (in bytes).
  std::array<uint32_t, 32> even = Gf2Square(odd);
  odd = Gf2Square(even);
  do {
    even = Gf2Square(odd);
    if (len_b & 1) crc_a = Gf2Times(even, crc_a);
    len_b >>= 1;
    if (len_b == 0) break;
    odd = Gf2Square(even);
    if (len_b & 1) crc_a = Gf2Times(odd, crc_a);
    len_b >>= 1;
  } while (len_b != 0);
  return crc_a ^ crc_b;
}

}  // namespace foreshock::store
