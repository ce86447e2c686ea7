#include "detectors/dtype.h"

#include <bit>
#include <cassert>
#include <cstring>
#include <type_traits>

namespace foreshock::detectors {
namespace {

// Assembling from bytes keeps decoding correct on any host byte order; the
// compiler turns it into a plain load on little-endian machines.
inline uint16_t LoadLE16(const unsigned char* p) {
  return static_cast<uint16_t>(p[0] | (p[1] << 8));
}
inline uint32_t LoadLE32(const unsigned char* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

template <typename Scalar, typename Convert>
void DecodeWith(const unsigned char* bytes, size_t element_size, std::span<Scalar> out,
                Convert convert) {
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<Scalar>(convert(bytes + i * element_size));
  }
}

}  // namespace

float BFloat16BitsToFloat(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

float Float16BitsToFloat(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits >> 15) << 31;
  const uint32_t exponent = (bits >> 10) & 0x1Fu;
  const uint32_t mantissa = bits & 0x3FFu;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in float32.
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 0x1F) {
    // Inf (mantissa 0) or NaN; the payload (and so the quiet bit) is kept.
    return std::bit_cast<float>(sign | 0x7F800000u | (mantissa << 13));
  }
  // Normal: rebias the exponent from 15 to 127.
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

template <typename Scalar>
void DecodeTensor(const RawTensor& tensor, std::span<Scalar> out) {
  assert(static_cast<int64_t>(out.size()) == tensor.num_elements());
  assert(tensor.data.size() == out.size() * DTypeSize(tensor.dtype));
  const auto* bytes = reinterpret_cast<const unsigned char*>(tensor.data.data());
  switch (tensor.dtype) {
    case DType::kFloat32:
      if constexpr (std::is_same_v<Scalar, float> && std::endian::native == std::endian::little) {
        std::memcpy(out.data(), bytes, out.size() * sizeof(float));
      } else {
        DecodeWith(bytes, 4, out,
                   [](const unsigned char* p) { return std::bit_cast<float>(LoadLE32(p)); });
      }
      return;
    case DType::kBFloat16:
      DecodeWith(bytes, 2, out,
                 [](const unsigned char* p) { return BFloat16BitsToFloat(LoadLE16(p)); });
      return;
    case DType::kFloat16:
      DecodeWith(bytes, 2, out,
                 [](const unsigned char* p) { return Float16BitsToFloat(LoadLE16(p)); });
      return;
  }
}

template <typename Scalar>
void DecodeTensor(const RawTensor& tensor, std::vector<Scalar>& out) {
  out.resize(static_cast<size_t>(tensor.num_elements()));
  DecodeTensor(tensor, std::span<Scalar>(out));
}

int64_t CountNonFinite(const RawTensor& tensor) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(tensor.data.data());
  const size_t count = tensor.data.size() / DTypeSize(tensor.dtype);
  int64_t non_finite = 0;
  // A value is inf or NaN exactly when all its exponent bits are set.
  switch (tensor.dtype) {
    case DType::kFloat32:
      for (size_t i = 0; i < count; ++i) {
        non_finite += (LoadLE32(bytes + 4 * i) & 0x7F800000u) == 0x7F800000u;
      }
      break;
    case DType::kBFloat16:
      for (size_t i = 0; i < count; ++i) non_finite += (LoadLE16(bytes + 2 * i) & 0x7F80u) == 0x7F80u;
      break;
    case DType::kFloat16:
      for (size_t i = 0; i < count; ++i) non_finite += (LoadLE16(bytes + 2 * i) & 0x7C00u) == 0x7C00u;
      break;
  }
  return non_finite;
}

template void DecodeTensor<float>(const RawTensor&, std::span<float>);
template void DecodeTensor<double>(const RawTensor&, std::span<double>);
template void DecodeTensor<float>(const RawTensor&, std::vector<float>&);
template void DecodeTensor<double>(const RawTensor&, std::vector<double>&);

}  // namespace foreshock::detectors
