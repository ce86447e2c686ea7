// Varints, the bit stream, the point codec and record framing.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <random>

#include "store/bit_stream.h"
#include "store/point_codec.h"
#include "store/record_format.h"
#include "store/varint.h"
#include "tests/store/store_test_support.h"

namespace foreshock::store {
namespace {

using testing::SamePoint;
constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

TEST(VarintTest, RoundTripsExtremes) {
  for (int64_t v : {int64_t{0}, int64_t{1}, int64_t{-1}, int64_t{63}, int64_t{-64}, int64_t{64},
                    int64_t{1} << 40, kMin, kMax}) {
    std::string bytes;
    PutSignedVarint64(&bytes, v);
    std::string_view in = bytes;
    int64_t out;
    ASSERT_TRUE(GetSignedVarint64(&in, &out));
    EXPECT_EQ(out, v);
    EXPECT_TRUE(in.empty());
    // Every proper prefix is a truncated varint.
    for (size_t n = 0; n < bytes.size(); ++n) {
      std::string_view prefix = std::string_view(bytes).substr(0, n);
      EXPECT_FALSE(GetSignedVarint64(&prefix, &out));
    }
  }
  EXPECT_EQ(ZigZagEncode(-1), 1u);
  EXPECT_EQ(ZigZagEncode(1), 2u);
}

TEST(VarintTest, RejectsOverlongAndOversizedLengths) {
  std::string overlong(11, '\x80');
  std::string_view in = overlong;
  uint64_t v;
  EXPECT_FALSE(GetVarint64(&in, &v));
  std::string prefixed;
  PutVarint64(&prefixed, 100);
  prefixed += "short";
  std::string_view cursor = prefixed, bytes;
  EXPECT_FALSE(GetLengthPrefixed(&cursor, &bytes));
}

TEST(BitStreamTest, RandomWidthsRoundTrip) {
  std::mt19937_64 rng(1);
  std::vector<std::pair<uint64_t, int>> written;
  std::string bytes;
  BitWriter writer(&bytes);
  for (int i = 0; i < 5000; ++i) {
    const int n = 1 + static_cast<int>(rng() % 64);
    const uint64_t value = n == 64 ? rng() : rng() & ((uint64_t{1} << n) - 1);
    written.emplace_back(value, n);
    writer.Write(value, n);
    if (i % 97 == 0) {
      writer.WriteVarint(value);
      written.emplace_back(value, -1);
    }
  }
  writer.Finish();
  BitReader reader(bytes);
  for (const auto& [value, n] : written) {
    uint64_t out;
    if (n < 0) {
      ASSERT_TRUE(reader.ReadVarint(&out));
    } else {
      ASSERT_TRUE(reader.Read(n, &out));
    }
    ASSERT_EQ(out, value);
  }
  uint64_t out;
  EXPECT_FALSE(reader.Read(9, &out));  // at most 7 padding bits remain
}

std::vector<LocalPoint> RandomPoints(std::mt19937_64& rng, size_t n, uint32_t series) {
  static const double kSpecial[] = {0.0,
                                    -0.0,
                                    std::numeric_limits<double>::quiet_NaN(),
                                    std::numeric_limits<double>::infinity(),
                                    -std::numeric_limits<double>::infinity(),
                                    std::numeric_limits<double>::denorm_min(),
                                    std::numeric_limits<double>::max(),
                                    std::bit_cast<double>(uint64_t{0x7FF8DEADBEEF0001})};
  std::vector<LocalPoint> points;
  for (size_t i = 0; i < n; ++i) {
    LocalPoint lp;
    lp.local_id = static_cast<uint32_t>(rng() % series);
    switch (rng() % 4) {
      case 0: lp.point.step = static_cast<int64_t>(i); break;
      case 1: lp.point.step = static_cast<int64_t>(rng()); break;
      case 2: lp.point.step = (rng() % 2) ? kMin : kMax; break;
      default: lp.point.step = static_cast<int64_t>(rng() % 100) - 50; break;
    }
    switch (rng() % 4) {
      case 0: lp.point.value = kSpecial[rng() % std::size(kSpecial)]; break;
      case 1: lp.point.value = std::bit_cast<double>(rng()); break;
      case 2: lp.point.value = static_cast<float>(static_cast<double>(rng() % 1000) / 7.0); break;
      default: lp.point.value = 1.0 + static_cast<double>(i) * 1e-3; break;
    }
    lp.point.wall_time_ms = (rng() % 3) ? 1'700'000'000'000 + static_cast<int64_t>(i / 10)
                                        : static_cast<int64_t>(rng());
    points.push_back(lp);
  }
  return points;
}

TEST(PointCodecTest, RoundTripsAcrossRecordsAndResets) {
  std::mt19937_64 rng(2);
  PointBlockCodec encoder, decoder;
  std::vector<LocalPoint> decoded;
  for (int record = 0; record < 200; ++record) {
    if (record % 50 == 0) {
      encoder.Reset();
      decoder.Reset();
    }
    const auto points = RandomPoints(rng, 1 + rng() % 60, 20);
    std::string payload;
    encoder.Encode(points, &payload);
    ASSERT_TRUE(decoder.Decode(payload, 20, &decoded));
    ASSERT_EQ(decoded.size(), points.size());
    for (size_t i = 0; i < points.size(); ++i) {
      ASSERT_EQ(decoded[i].local_id, points[i].local_id);
      ASSERT_TRUE(SamePoint(decoded[i].point, points[i].point)) << record << " " << i;
    }
  }
}

TEST(PointCodecTest, DaemonLikeBatchesAreSmall) {
  // 50 series in a stable order, one point each per step, shared wall time,
  // float-valued signals drifting slowly.
  PointBlockCodec codec;
  std::mt19937_64 rng(3);
  std::normal_distribution<double> noise(0, 1e-3);
  std::vector<double> level(50, 1.0);
  size_t bytes = 0, points = 0;
  for (int step = 0; step < 1000; ++step) {
    std::vector<LocalPoint> batch;
    for (uint32_t s = 0; s < 50; ++s) {
      level[s] += noise(rng);
      batch.push_back({s, Point{step, static_cast<float>(level[s]), 1'700'000'000'000 + step * 250}});
    }
    std::string payload;
    codec.Encode(batch, &payload);
    bytes += payload.size();
    points += batch.size();
  }
  EXPECT_LT(static_cast<double>(bytes) / points, 4.0);
}

TEST(PointCodecTest, RejectsUnknownSeriesAndTruncation) {
  PointBlockCodec encoder;
  std::string payload;
  std::vector<LocalPoint> points = {{0, {1, 1.0, 5}}, {3, {1, 2.0, 5}}};
  encoder.Encode(points, &payload);
  std::vector<LocalPoint> out;
  PointBlockCodec decoder;
  EXPECT_FALSE(decoder.Decode(payload, 3, &out));  // local id 3 undefined
  for (size_t n = 0; n < payload.size(); ++n) {
    PointBlockCodec fresh;
    EXPECT_FALSE(fresh.Decode(std::string_view(payload).substr(0, n), 4, &out)) << n;
  }
}

TEST(PointCodecTest, GarbageNeverCrashes) {
  std::mt19937_64 rng(4);
  std::vector<LocalPoint> out;
  for (int i = 0; i < 20000; ++i) {
    std::string garbage(rng() % 64, '\0');
    for (char& c : garbage) c = static_cast<char>(rng());
    PointBlockCodec codec;
    codec.Decode(garbage, static_cast<uint32_t>(rng() % 5), &out);
    if (rng() % 2) codec.Decode(garbage, 1000, &out);  // state left by a failed decode
  }
}

TEST(RecordFormatTest, FramingDetectsDamage) {
  std::string log;
  AppendRecord(&log, RecordType::kEvent, "payload bytes");
  AppendRecord(&log, RecordType::kBlockStart, "");
  Record record;
  ASSERT_EQ(ParseRecord(log, 0, &record), ParseResult::kOk);
  EXPECT_EQ(record.type, RecordType::kEvent);
  EXPECT_EQ(record.payload, "payload bytes");
  ASSERT_EQ(ParseRecord(log, record.size, &record), ParseResult::kOk);
  EXPECT_EQ(record.type, RecordType::kBlockStart);
  EXPECT_EQ(ParseRecord(log, log.size(), &record), ParseResult::kEnd);

  const size_t first = kRecordHeaderBytes + 13;
  for (size_t cut = 1; cut < first; ++cut) {
    EXPECT_EQ(ParseRecord(log.substr(0, cut), 0, &record), ParseResult::kTruncated) << cut;
  }
  for (size_t i = 0; i < first; ++i) {
    std::string damaged = log;
    damaged[i] ^= 0x01;
    const ParseResult result = ParseRecord(damaged, 0, &record);
    EXPECT_TRUE(result == ParseResult::kCorrupt || result == ParseResult::kTruncated) << i;
  }
}

TEST(RecordFormatTest, PayloadCodecsRoundTrip) {
  SeriesDef def{7, SeriesKey{"run-a", "qk_increment_entropy", 11, -1}};
  SeriesDef def_out;
  ASSERT_TRUE(DecodeSeriesDef(EncodeSeriesDef(def), &def_out));
  EXPECT_EQ(def_out.local_id, 7u);
  EXPECT_EQ(def_out.key, def.key);
  EXPECT_FALSE(DecodeSeriesDef(EncodeSeriesDef(def) + "x", &def_out));

  const std::string event = EncodeEvent(EventRecord{"alert", -5, std::string("a\0b", 3)});
  EventRecord event_out;
  ASSERT_TRUE(DecodeEvent(event, &event_out));
  EXPECT_EQ(event_out.kind, "alert");
  EXPECT_EQ(event_out.wall_time_ms, -5);
  EXPECT_EQ(event_out.bytes, std::string_view("a\0b", 3));

  SegmentHeader header_out;
  ASSERT_TRUE(DecodeSegmentHeader(EncodeSegmentHeader({kSegmentFormatVersion, 42, 99}), &header_out));
  EXPECT_EQ(header_out.sequence, 42u);
  EXPECT_EQ(header_out.created_wall_time_ms, 99);
  EXPECT_FALSE(DecodeSegmentHeader(EncodeSegmentHeader({99, 42, 99}), &header_out));
}

}  // namespace
}  // namespace foreshock::store
