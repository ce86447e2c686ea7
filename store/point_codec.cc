#include "store/point_codec.h"

#include <bit>

#include "store/bit_stream.h"
#include "store/varint.h"

namespace foreshock::store {

void PointBlockCodec::Reset() {
  series_.clear();
  series_started_ = 0;
  wall_time_ms_ = 0;
}

PointBlockCodec::SeriesState& PointBlockCodec::StateFor(uint32_t local_id) {
  if (local_id >= series_.size()) series_.resize(size_t{local_id} + 1);
  return series_[local_id];
}

void PointBlockCodec::Encode(std::span<const LocalPoint> points, std::string* payload) {
  PutVarint64(payload, points.size());
  BitWriter bits(payload);
  uint32_t expected_id = 0;
  for (const LocalPoint& lp : points) {
    if (lp.local_id == expected_id) {
      bits.WriteBit(false);
    } else {
      bits.WriteBit(true);
      bits.WriteVarint(lp.local_id);
    }
    expected_id = lp.local_id + 1;

    SeriesState& s = StateFor(lp.local_id);
    const Point& p = lp.point;
    const uint64_t value_bits = std::bit_cast<uint64_t>(p.value);
    if (!s.started) {
      bits.WriteVarint(ZigZagEncode(p.step));
      bits.Write(value_bits, 64);
      s.started = true;
      ++series_started_;
      s.step_delta = 0;
      s.window_meaningful = 0;
    } else {
      const uint64_t delta = static_cast<uint64_t>(p.step) - static_cast<uint64_t>(s.step);
      const int64_t delta_of_delta = static_cast<int64_t>(delta - s.step_delta);
      if (delta_of_delta == 0) {
        bits.WriteBit(false);
      } else {
        bits.WriteBit(true);
        bits.WriteVarint(ZigZagEncode(delta_of_delta));
      }
      s.step_delta = delta;

      const uint64_t x = value_bits ^ s.value_bits;
      if (x == 0) {
        bits.WriteBit(false);
      } else {
        bits.WriteBit(true);
        const int leading = std::countl_zero(x);
        const int trailing = std::countr_zero(x);
        const int meaningful = 64 - leading - trailing;
        const int window_trailing = 64 - s.window_leading - s.window_meaningful;
        // Reuse the previous window when the XOR fits in it, unless a fresh,
        // narrower window pays for its 12-bit description: Gorilla's window
        // otherwise never shrinks after one large change.
        if (s.window_meaningful > 0 && leading >= s.window_leading && trailing >= window_trailing &&
            s.window_meaningful <= meaningful + 12) {
          bits.WriteBit(false);
          bits.Write(x >> window_trailing, s.window_meaningful);
        } else {
          bits.WriteBit(true);
          bits.Write(static_cast<uint64_t>(leading), 6);
          bits.Write(static_cast<uint64_t>(meaningful - 1), 6);
          bits.Write(x >> trailing, meaningful);
          s.window_leading = static_cast<uint8_t>(leading);
          s.window_meaningful = static_cast<uint8_t>(meaningful);
        }
      }
    }
    s.step = p.step;
    s.value_bits = value_bits;

    if (p.wall_time_ms == wall_time_ms_) {
      bits.WriteBit(false);
    } else {
      bits.WriteBit(true);
      bits.WriteVarint(ZigZagEncode(static_cast<int64_t>(static_cast<uint64_t>(p.wall_time_ms) -
                                                         static_cast<uint64_t>(wall_time_ms_))));
      wall_time_ms_ = p.wall_time_ms;
    }
  }
  bits.Finish();
}

bool PointBlockCodec::Decode(std::string_view payload, uint32_t series_defined,
                             std::vector<LocalPoint>* out) {
  out->clear();
  uint64_t count;
  if (!GetVarint64(&payload, &count)) return false;
  // Every point takes at least four bits: refuse counts the bytes cannot hold
  // before reserving memory for them.
  if (count > payload.size() * 2) return false;
  out->reserve(count);
  BitReader bits(payload);
  uint32_t expected_id = 0;
  for (uint64_t i = 0; i < count; ++i) {
    LocalPoint lp;
    bool flag;
    if (!bits.ReadBit(&flag)) return false;
    if (!flag) {
      lp.local_id = expected_id;
    } else {
      uint64_t id;
      if (!bits.ReadVarint(&id) || id >= series_defined) return false;
      lp.local_id = static_cast<uint32_t>(id);
    }
    if (lp.local_id >= series_defined) return false;
    expected_id = lp.local_id + 1;

    SeriesState& s = StateFor(lp.local_id);
    Point& p = lp.point;
    uint64_t value_bits;
    if (!s.started) {
      uint64_t zigzag_step;
      if (!bits.ReadVarint(&zigzag_step) || !bits.Read(64, &value_bits)) return false;
      p.step = ZigZagDecode(zigzag_step);
      s.started = true;
      ++series_started_;
      s.step_delta = 0;
      s.window_meaningful = 0;
    } else {
      if (!bits.ReadBit(&flag)) return false;
      uint64_t delta = s.step_delta;
      if (flag) {
        uint64_t zigzag_dod;
        if (!bits.ReadVarint(&zigzag_dod)) return false;
        delta += static_cast<uint64_t>(ZigZagDecode(zigzag_dod));
      }
      p.step = static_cast<int64_t>(static_cast<uint64_t>(s.step) + delta);
      s.step_delta = delta;

      if (!bits.ReadBit(&flag)) return false;
      uint64_t x = 0;
      if (flag) {
        if (!bits.ReadBit(&flag)) return false;
        if (!flag) {
          if (s.window_meaningful == 0) return false;  // no window to reuse
          uint64_t meaningful_bits;
          if (!bits.Read(s.window_meaningful, &meaningful_bits)) return false;
          x = meaningful_bits << (64 - s.window_leading - s.window_meaningful);
        } else {
          uint64_t leading, meaningful_minus_one, meaningful_bits;
          if (!bits.Read(6, &leading) || !bits.Read(6, &meaningful_minus_one)) return false;
          const uint64_t meaningful = meaningful_minus_one + 1;
          if (leading + meaningful > 64) return false;
          if (!bits.Read(static_cast<int>(meaningful), &meaningful_bits)) return false;
          x = meaningful_bits << (64 - leading - meaningful);
          s.window_leading = static_cast<uint8_t>(leading);
          s.window_meaningful = static_cast<uint8_t>(meaningful);
        }
      }
      value_bits = s.value_bits ^ x;
    }
    p.value = std::bit_cast<double>(value_bits);
    s.step = p.step;
    s.value_bits = value_bits;

    if (!bits.ReadBit(&flag)) return false;
    if (flag) {
      uint64_t zigzag_wall;
      if (!bits.ReadVarint(&zigzag_wall)) return false;
      wall_time_ms_ = static_cast<int64_t>(static_cast<uint64_t>(wall_time_ms_) +
                                           static_cast<uint64_t>(ZigZagDecode(zigzag_wall)));
    }
    p.wall_time_ms = wall_time_ms_;
    out->push_back(lp);
  }
  return true;
}

}  // namespace foreshock::store
