// The checkpoint codec: exact round trips, and corrupt input that fails
// cleanly (never crashes, never allocates what the input cannot back).
#include "codec/state_codec.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace foreshock::codec {
namespace {

std::string Sample() {
  StateWriter w;
  w.PutHeader("TEST", 3);
  w.PutU8(200);
  w.PutBool(true);
  w.PutBool(false);
  w.PutU32(0xdeadbeef);
  w.PutI32(-7);
  w.PutU64(std::numeric_limits<uint64_t>::max());
  w.PutI64(std::numeric_limits<int64_t>::min());
  w.PutFloat(-0.0f);
  w.PutDouble(std::numeric_limits<double>::quiet_NaN());
  w.PutDouble(-std::numeric_limits<double>::infinity());
  w.PutDouble(0.1);
  w.PutString("hello");
  w.PutString("");
  w.PutBytes(std::string("a\0b", 3));
  w.PutVector(std::vector<double>{1.5, -2.25, 1e300});
  w.PutVector(std::vector<float>{});
  w.PutVector(std::vector<int32_t>{-1, 0, 1 << 30});
  w.PutVector(std::vector<int64_t>{std::numeric_limits<int64_t>::max()});
  return w.Take();
}

// Reads what Sample() wrote; false at the first failed Get.
bool ReadSample(StateReader& r, bool check_values) {
  uint32_t version = 0;
  uint8_t u8 = 0;
  bool b1 = false, b2 = true;
  uint32_t u32 = 0;
  int32_t i32 = 0;
  uint64_t u64 = 0;
  int64_t i64 = 0;
  float f = 1;
  double nan = 0, inf = 0, tenth = 0;
  std::string hello, empty, bytes;
  std::vector<double> doubles;
  std::vector<float> floats{1.0f};
  std::vector<int32_t> ints;
  std::vector<int64_t> longs;
  if (!r.GetHeader("TEST", 1, 3, version) || !r.GetU8(u8) || !r.GetBool(b1) || !r.GetBool(b2) ||
      !r.GetU32(u32) || !r.GetI32(i32) || !r.GetU64(u64) || !r.GetI64(i64) || !r.GetFloat(f) ||
      !r.GetDouble(nan) || !r.GetDouble(inf) || !r.GetDouble(tenth) || !r.GetString(hello) ||
      !r.GetString(empty) || !r.GetBytes(bytes) || !r.GetVector(doubles) || !r.GetVector(floats) ||
      !r.GetVector(ints) || !r.GetVector(longs) || !r.ExpectEnd()) {
    return false;
  }
  if (check_values) {
    EXPECT_EQ(version, 3u);
    EXPECT_EQ(u8, 200);
    EXPECT_TRUE(b1);
    EXPECT_FALSE(b2);
    EXPECT_EQ(u32, 0xdeadbeef);
    EXPECT_EQ(i32, -7);
    EXPECT_EQ(u64, std::numeric_limits<uint64_t>::max());
    EXPECT_EQ(i64, std::numeric_limits<int64_t>::min());
    EXPECT_EQ(std::bit_cast<uint32_t>(f), std::bit_cast<uint32_t>(-0.0f));
    EXPECT_EQ(std::bit_cast<uint64_t>(nan),
              std::bit_cast<uint64_t>(std::numeric_limits<double>::quiet_NaN()));
    EXPECT_EQ(inf, -std::numeric_limits<double>::infinity());
    EXPECT_EQ(tenth, 0.1);
    EXPECT_EQ(hello, "hello");
    EXPECT_EQ(empty, "");
    EXPECT_EQ(bytes, std::string("a\0b", 3));
    EXPECT_EQ(doubles, (std::vector<double>{1.5, -2.25, 1e300}));
    EXPECT_TRUE(floats.empty());
    EXPECT_EQ(ints, (std::vector<int32_t>{-1, 0, 1 << 30}));
    EXPECT_EQ(longs, (std::vector<int64_t>{std::numeric_limits<int64_t>::max()}));
  }
  return true;
}

TEST(StateCodecTest, RoundTripsEveryTypeExactly) {
  const std::string bytes = Sample();
  StateReader r(bytes);
  EXPECT_TRUE(ReadSample(r, true)) << r.error();
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(r.remaining(), 0u);
}

// A sink that collects what a streaming writer hands over, filling in
// length fields the way a checkpoint file does.
class CollectingSink final : public StateSink {
 public:
  void Append(std::string_view bytes) override {
    bytes_.append(bytes);
    ++appends_;
    largest_ = std::max(largest_, bytes.size());
  }
  void BeginLengthPrefixed() override {
    open_.push_back(bytes_.size());
    bytes_.append(8, '\0');
  }
  void EndLengthPrefixed() override {
    uint64_t length = bytes_.size() - open_.back() - 8;
    for (size_t i = 0; i < 8; ++i, length >>= 8) bytes_[open_.back() + i] = static_cast<char>(length & 0xff);
    open_.pop_back();
  }
  std::string bytes_;
  size_t appends_ = 0, largest_ = 0;
  std::vector<size_t> open_;
};

// Issue 28: the detector checkpoint streams through a sink in chunks, with
// each detector's blob written in place (BeginBytes/EndBytes) instead of
// copied: the bytes are those of the buffered writer and of PutBytes.
TEST(StateCodecTest, StreamingAndInPlaceBytesGiveTheSameBytes) {
  const std::vector<float> big(300000, 1.5f);  // 1.2 MB: goes to the sink directly
  auto write_parts = [&](StateWriter& w) {
    w.PutHeader("TEST", 1);
    w.PutString("name");
    for (int i = 0; i < 5000; ++i) w.PutU64(i);  // 40 KB of small puts
    w.PutVector(big);
  };
  StateWriter inner;
  write_parts(inner);
  StateWriter reference;
  reference.PutU32(7);
  reference.PutBytes(inner.data());
  reference.PutDouble(2.5);

  auto write_nested = [&](StateWriter& w) {
    w.PutU32(7);
    w.BeginBytes();
    write_parts(w);
    w.EndBytes();
    w.PutDouble(2.5);
    w.Flush();
  };
  StateWriter in_place;
  write_nested(in_place);
  EXPECT_EQ(in_place.data(), reference.data());

  CollectingSink sink;
  StateWriter streaming(&sink, /*chunk=*/4096);
  write_nested(streaming);
  EXPECT_EQ(sink.bytes_, reference.data());
  EXPECT_TRUE(streaming.data().empty());
  EXPECT_GT(sink.appends_, 10u);
  EXPECT_EQ(sink.largest_, big.size() * sizeof(float)) << "the vector went straight through";

  StateReader reader(sink.bytes_);
  uint32_t seven = 0;
  std::string_view blob;
  double tail = 0;
  ASSERT_TRUE(reader.GetU32(seven) && reader.GetStringView(blob) && reader.GetDouble(tail) &&
              reader.ExpectEnd());
  EXPECT_EQ(blob, inner.data());
}

TEST(StateCodecTest, EncodingIsLittleEndianAndFixedWidth) {
  StateWriter w;
  w.PutU32(0x01020304);
  w.PutI64(-2);
  w.PutString("ab");
  EXPECT_EQ(w.data(), std::string("\x04\x03\x02\x01"
                                  "\xfe\xff\xff\xff\xff\xff\xff\xff"
                                  "\x02\0\0\0\0\0\0\0ab",
                                  4 + 8 + 8 + 2));
}

TEST(StateCodecTest, EveryTruncationFailsAndTheErrorSticks) {
  const std::string bytes = Sample();
  for (size_t length = 0; length < bytes.size(); ++length) {
    StateReader r(std::string_view(bytes).substr(0, length));
    EXPECT_FALSE(ReadSample(r, false)) << length;
    EXPECT_FALSE(r.ok()) << length;
    EXPECT_FALSE(r.error().empty()) << length;
    uint8_t byte = 0;
    EXPECT_FALSE(r.GetU8(byte)) << "a failed reader stays failed";
  }
}

TEST(StateCodecTest, TrailingBytesFailExpectEnd) {
  const std::string bytes = Sample() + "x";
  StateReader r(bytes);
  EXPECT_FALSE(ReadSample(r, false));
  EXPECT_NE(r.error().find("trailing"), std::string::npos) << r.error();
}

TEST(StateCodecTest, AbsurdLengthsAndCountsFailBeforeAllocating) {
  for (uint64_t claimed : {uint64_t{9}, uint64_t{1} << 40, std::numeric_limits<uint64_t>::max(),
                           std::numeric_limits<uint64_t>::max() / 8 + 1}) {
    StateWriter w;
    w.PutU64(claimed);
    w.PutU64(0);  // 8 bytes follow: fewer than any claimed length needs
    {
      StateReader r(w.data());
      std::string s;
      EXPECT_FALSE(r.GetString(s)) << claimed;
      EXPECT_TRUE(s.empty());
    }
    {
      StateReader r(w.data());
      std::vector<double> v;
      EXPECT_FALSE(r.GetVector(v)) << claimed;
      EXPECT_TRUE(v.empty());
    }
    {
      StateReader r(w.data());
      uint64_t n = 0;
      EXPECT_FALSE(r.GetCount(n, 16)) << claimed;
    }
  }
  // A count that the bytes left can back passes.
  StateWriter w;
  w.PutU64(2);
  w.PutU64(0);
  w.PutU64(0);
  StateReader r(w.data());
  uint64_t n = 0;
  EXPECT_TRUE(r.GetCount(n, 8));
  EXPECT_EQ(n, 2u);
}

TEST(StateCodecTest, RejectsNonsenseBoolsWrongMagicAndVersions) {
  {
    StateReader r(std::string_view("\x02", 1));
    bool b = false;
    EXPECT_FALSE(r.GetBool(b));
  }
  StateWriter w;
  w.PutHeader("FSAE", 2);
  uint32_t version = 0;
  {
    StateReader r(w.data());
    EXPECT_TRUE(r.GetHeader("FSAE", 1, 2, version));
    EXPECT_EQ(version, 2u);
  }
  {
    StateReader r(w.data());
    EXPECT_FALSE(r.GetHeader("FSDP", 1, 2, version));
    EXPECT_NE(r.error().find("not a FSDP blob"), std::string::npos) << r.error();
  }
  {
    StateReader r(w.data());
    EXPECT_FALSE(r.GetHeader("FSAE", 1, 1, version));
    EXPECT_NE(r.error().find("version 2"), std::string::npos) << r.error();
  }
  {
    StateReader r(std::string_view("FS"));
    EXPECT_FALSE(r.GetHeader("FSAE", 1, 1, version));
  }
  {
    StateWriter v;
    v.PutU32(7);
    StateReader r(v.data());
    EXPECT_FALSE(r.GetVersion("qk", 1, 1, version));
    EXPECT_NE(r.error().find("qk state version 7"), std::string::npos) << r.error();
  }
}

TEST(StateCodecTest, FailKeepsTheFirstError) {
  StateReader r(std::string_view(""));
  EXPECT_FALSE(r.Fail("first"));
  EXPECT_FALSE(r.Fail("second"));
  EXPECT_NE(r.error().find("first"), std::string::npos);
  EXPECT_EQ(r.error().find("second"), std::string::npos);
}

// A record with one field of every type FieldWriter/FieldReader take.
struct Every {
  uint8_t u8 = 0;
  bool flag = false;
  int32_t i32 = 0;
  uint32_t u32 = 0;
  int64_t i64 = 0;
  uint64_t u64 = 0;
  float f = 0;
  double d = 0;
  std::string text;
  std::vector<float> values;
};

template <typename Io, typename E>
bool EveryFields(Io& io, E& e) {
  return io(e.u8) && io(e.flag) && io(e.i32) && io(e.u32) && io(e.i64) && io(e.u64) && io(e.f) &&
         io(e.d) && io(e.text) && io(e.values);
}

TEST(StateCodecTest, OneFieldListWritesThePutBytesAndReadsThemBack) {
  const Every in{7,   true,  -3,    4000000000u, -(int64_t{1} << 40), ~uint64_t{0}, -0.0f,
                 1e300, "run", {1.5f, -2.0f}};
  StateWriter listed;
  FieldWriter writer(listed);
  ASSERT_TRUE(EveryFields(writer, in));
  // The bytes of the Put calls, field by field, typed by each field.
  StateWriter by_hand;
  by_hand.PutU8(in.u8);
  by_hand.PutBool(in.flag);
  by_hand.PutI32(in.i32);
  by_hand.PutU32(in.u32);
  by_hand.PutI64(in.i64);
  by_hand.PutU64(in.u64);
  by_hand.PutFloat(in.f);
  by_hand.PutDouble(in.d);
  by_hand.PutString(in.text);
  by_hand.PutVector(in.values);
  const std::string bytes = listed.Take();
  EXPECT_EQ(bytes, by_hand.Take());

  StateReader reader(bytes);
  FieldReader fields(reader);
  Every out;
  ASSERT_TRUE(EveryFields(fields, out));
  EXPECT_TRUE(reader.ExpectEnd());
  EXPECT_EQ(out.u8, in.u8);
  EXPECT_EQ(out.flag, in.flag);
  EXPECT_EQ(out.i32, in.i32);
  EXPECT_EQ(out.u32, in.u32);
  EXPECT_EQ(out.i64, in.i64);
  EXPECT_EQ(out.u64, in.u64);
  EXPECT_TRUE(std::signbit(out.f));
  EXPECT_EQ(out.d, in.d);
  EXPECT_EQ(out.text, in.text);
  EXPECT_EQ(out.values, in.values);

  // A truncated record fails at its first missing field.
  StateReader truncated(std::string_view(bytes).substr(0, bytes.size() - 1));
  FieldReader short_fields(truncated);
  EXPECT_FALSE(EveryFields(short_fields, out));
}

}  // namespace
}  // namespace foreshock::codec
