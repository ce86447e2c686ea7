#include "store/crc32c.h"

#include <gtest/gtest.h>

#include <random>
#include <string>

namespace foreshock::store {
namespace {

// Bit-at-a-time reference, straight from the definition.
uint32_t ReferenceCrc32c(const std::string& bytes) {
  uint32_t crc = 0xFFFFFFFF;
  for (unsigned char c : bytes) {
    crc ^= c;
    for (int i = 0; i < 8; ++i) crc = (crc >> 1) ^ ((crc & 1) ? 0x82F63B78 : 0);
  }
  return ~crc;
}

TEST(Crc32cTest, CheckValue) { EXPECT_EQ(Crc32c("123456789"), 0xE3069283u); }

TEST(Crc32cTest, Rfc3720Vectors) {
  EXPECT_EQ(Crc32c(""), 0u);
  EXPECT_EQ(Crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(std::string(32, '\xFF')), 0x62A8AB43u);
  std::string ascending, descending;
  for (int i = 0; i < 32; ++i) {
    ascending.push_back(static_cast<char>(i));
    descending.push_back(static_cast<char>(31 - i));
  }
  EXPECT_EQ(Crc32c(ascending), 0x46DD794Eu);
  EXPECT_EQ(Crc32c(descending), 0x113FDB5Cu);
}

TEST(Crc32cTest, MatchesBitwiseReferenceAtEveryLengthAndAlignment) {
  std::mt19937 rng(7);
  std::string buffer(300, '\0');
  for (char& c : buffer) c = static_cast<char>(rng());
  for (size_t start = 0; start < 9; ++start) {
    for (size_t length = 0; start + length <= buffer.size(); length += 7) {
      const std::string piece = buffer.substr(start, length);
      ASSERT_EQ(Crc32c(piece), ReferenceCrc32c(piece)) << start << " " << length;
    }
  }
}

TEST(Crc32cTest, ExtendEqualsWhole) {
  const std::string a = "hello, ", b = "world with more than eight bytes";
  EXPECT_EQ(Crc32cExtend(Crc32c(a), b.data(), b.size()), Crc32c(a + b));
}

TEST(Crc32cTest, CombineEqualsWhole) {
  std::mt19937 rng(11);
  std::string buffer(5000, '\0');
  for (char& c : buffer) c = static_cast<char>(rng());
  for (size_t split : {0, 1, 7, 8, 9, 255, 256, 1000, 4999, 5000}) {
    const std::string_view a = std::string_view(buffer).substr(0, split);
    const std::string_view b = std::string_view(buffer).substr(split);
    EXPECT_EQ(Crc32cCombine(Crc32c(a), Crc32c(b), b.size()), Crc32c(buffer)) << split;
  }
  // A long zero run (a length field's placeholder, a big blob) and an empty tail.
  const std::string zeros(1 << 20, '\0');
  EXPECT_EQ(Crc32cCombine(Crc32c("x"), Crc32c(zeros), zeros.size()), Crc32c("x" + zeros));
  EXPECT_EQ(Crc32cCombine(0x12345678u, Crc32c(""), 0), 0x12345678u);
}

}  // namespace
}  // namespace foreshock::store
