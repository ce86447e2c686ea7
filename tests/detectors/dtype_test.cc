#include "detectors/dtype.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

namespace foreshock::detectors {
namespace {

// Little-endian bytes of 16-bit patterns, as they come off the wire.
RawTensor Tensor16(DType dtype, const std::vector<uint16_t>& bits) {
  RawTensor t;
  t.dtype = dtype;
  t.shape = {static_cast<int64_t>(bits.size())};
  for (uint16_t b : bits) {
    t.data.push_back(static_cast<char>(b & 0xFF));
    t.data.push_back(static_cast<char>(b >> 8));
  }
  return t;
}

RawTensor Float32Tensor(const std::vector<float>& values) {
  RawTensor t;
  t.dtype = DType::kFloat32;
  t.shape = {static_cast<int64_t>(values.size())};
  for (float v : values) {
    const uint32_t b = std::bit_cast<uint32_t>(v);
    for (int shift = 0; shift < 32; shift += 8) t.data.push_back(static_cast<char>((b >> shift) & 0xFF));
  }
  return t;
}

TEST(BFloat16, KnownBitPatterns) {
  EXPECT_EQ(BFloat16BitsToFloat(0x3F80), 1.0f);
  EXPECT_EQ(BFloat16BitsToFloat(0xC000), -2.0f);
  EXPECT_EQ(BFloat16BitsToFloat(0x4049), 3.140625f);
  EXPECT_EQ(BFloat16BitsToFloat(0x0001), std::ldexp(1.0f, -133));  // smallest subnormal
  EXPECT_EQ(BFloat16BitsToFloat(0x7F7F), std::ldexp(255.0f, 120));  // largest finite
  EXPECT_EQ(BFloat16BitsToFloat(0x7F80), std::numeric_limits<float>::infinity());
  EXPECT_EQ(BFloat16BitsToFloat(0xFF80), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(BFloat16BitsToFloat(0x7FC0)));
  EXPECT_TRUE(std::signbit(BFloat16BitsToFloat(0x8000)));
}

TEST(Float16, KnownBitPatterns) {
  EXPECT_EQ(Float16BitsToFloat(0x3C00), 1.0f);
  EXPECT_EQ(Float16BitsToFloat(0xC000), -2.0f);
  EXPECT_EQ(Float16BitsToFloat(0x7BFF), 65504.0f);           // largest finite
  EXPECT_EQ(Float16BitsToFloat(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(Float16BitsToFloat(0x03FF), 1023.0f * std::ldexp(1.0f, -24));  // largest subnormal
  EXPECT_EQ(Float16BitsToFloat(0x0400), std::ldexp(1.0f, -14));  // smallest normal
  EXPECT_EQ(Float16BitsToFloat(0x3555), 0.333251953125f);
  EXPECT_EQ(Float16BitsToFloat(0x8001), -std::ldexp(1.0f, -24));
  EXPECT_EQ(Float16BitsToFloat(0x7C00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(Float16BitsToFloat(0xFC00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(Float16BitsToFloat(0x7E00)));
  EXPECT_TRUE(std::isnan(Float16BitsToFloat(0x7C01)));  // signalling NaN stays NaN
  EXPECT_EQ(Float16BitsToFloat(0x8000), 0.0f);
  EXPECT_TRUE(std::signbit(Float16BitsToFloat(0x8000)));
}

// Every one of the 65536 patterns against the textbook definition of binary16.
TEST(Float16, AllPatternsMatchDefinition) {
  for (uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
    const int sign = (bits >> 15) ? -1 : 1;
    const int exponent = static_cast<int>((bits >> 10) & 0x1F);
    const int mantissa = static_cast<int>(bits & 0x3FF);
    const float decoded = Float16BitsToFloat(static_cast<uint16_t>(bits));
    if (exponent == 31) {
      if (mantissa == 0) {
        EXPECT_EQ(decoded, sign * std::numeric_limits<float>::infinity()) << bits;
      } else {
        EXPECT_TRUE(std::isnan(decoded)) << bits;
      }
      continue;
    }
    const double expected = exponent == 0
                                ? sign * std::ldexp(static_cast<double>(mantissa), -24)
                                : sign * std::ldexp(1.0 + mantissa / 1024.0, exponent - 15);
    ASSERT_EQ(static_cast<double>(decoded), expected) << "bits 0x" << std::hex << bits;
  }
}

TEST(DecodeTensor, ReadsLittleEndianBytes) {
  // 1.0 in bf16 is 0x3F80: on the wire the low byte 0x80 comes first.
  RawTensor bf16;
  bf16.dtype = DType::kBFloat16;
  bf16.shape = {1};
  bf16.data = std::string("\x80\x3F", 2);
  std::vector<float> out;
  DecodeTensor(bf16, out);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0], 1.0f);

  RawTensor fp32;
  fp32.dtype = DType::kFloat32;
  fp32.shape = {1};
  fp32.data = std::string("\x00\x00\x00\xC0", 4);  // -2.0f = 0xC0000000
  DecodeTensor(fp32, out);
  EXPECT_EQ(out[0], -2.0f);
}

TEST(DecodeTensor, AllDTypesToFloatAndDouble) {
  const std::vector<float> values = {1.5f, -0.25f, 3.0e-30f, 1.0e30f, 0.0f, -7.0f};
  const RawTensor fp32 = Float32Tensor(values);
  std::vector<float> as_float;
  std::vector<double> as_double;
  DecodeTensor(fp32, as_float);
  DecodeTensor(fp32, as_double);
  for (size_t i = 0; i < values.size(); ++i) {
    EXPECT_EQ(as_float[i], values[i]);
    EXPECT_EQ(as_double[i], static_cast<double>(values[i]));
  }

  const RawTensor bf16 = Tensor16(DType::kBFloat16, {0x3F80, 0xC000, 0x3E80});
  DecodeTensor(bf16, as_double);
  EXPECT_EQ(as_double, (std::vector<double>{1.0, -2.0, 0.25}));

  const RawTensor fp16 = Tensor16(DType::kFloat16, {0x3C00, 0x7BFF, 0x0001});
  DecodeTensor(fp16, as_double);
  EXPECT_EQ(as_double, (std::vector<double>{1.0, 65504.0, std::ldexp(1.0, -24)}));
}

TEST(CountNonFinite, CountsNanAndInfPerDType) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(CountNonFinite(Float32Tensor({1.0f, nan, -inf, inf, 3.4e38f, -0.0f})), 3);
  EXPECT_EQ(CountNonFinite(Float32Tensor({1.0f, 2.0f})), 0);
  // bf16: inf 0x7F80, -inf 0xFF80, NaN 0x7FC0 / 0xFFC1; 0x7F7F is the largest finite.
  EXPECT_EQ(CountNonFinite(Tensor16(DType::kBFloat16, {0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F7F, 0x3F80})), 4);
  // fp16: inf 0x7C00, NaN 0x7E00; 0x7BFF (65504) is finite.
  EXPECT_EQ(CountNonFinite(Tensor16(DType::kFloat16, {0x7C00, 0x7E00, 0x7BFF, 0x0001})), 2);
}

}  // namespace
}  // namespace foreshock::detectors
