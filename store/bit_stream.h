// Bit-granular writer and reader for the point encoding (store/point_codec.h).
// Bits are packed most significant first. The reader is bounds-checked: every
// read past the end fails instead of touching memory it does not own.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace foreshock::store {

class BitWriter {
 public:
  explicit BitWriter(std::string* out) : out_(out) {}

  // Writes the low `n` bits of `value`, 0 <= n <= 64.
  void Write(uint64_t value, int n) {
    if (n == 0) return;
    if (n < 64) value &= (uint64_t{1} << n) - 1;
    const int room = 64 - used_;
    if (n < room) {
      acc_ = (acc_ << n) | value;
      used_ += n;
      return;
    }
    // Fill the word, flush it, keep the remaining n - room bits.
    const int rest = n - room;
    acc_ = room == 64 ? value >> rest : (acc_ << room) | (value >> rest);
    FlushWord();
    acc_ = rest == 0 ? 0 : value & ((uint64_t{1} << rest) - 1);
    used_ = rest;
  }

  void WriteBit(bool bit) { Write(bit ? 1 : 0, 1); }

  // Groups of 7 bits, least significant group first, each behind a
  // continuation bit: small numbers cost 8 bits.
  void WriteVarint(uint64_t v) {
    while (v >= 0x80) {
      Write(0x80 | (v & 0x7F), 8);
      v >>= 7;
    }
    Write(v, 8);
  }

  // Pads the last byte with zero bits and appends it.
  void Finish() {
    if (used_ == 0) return;
    const int bytes = (used_ + 7) / 8;
    const uint64_t aligned = acc_ << (bytes * 8 - used_);
    for (int i = bytes - 1; i >= 0; --i) out_->push_back(static_cast<char>(aligned >> (8 * i)));
    acc_ = 0;
    used_ = 0;
  }

 private:
  void FlushWord() {
    for (int i = 7; i >= 0; --i) out_->push_back(static_cast<char>(acc_ >> (8 * i)));
  }

  std::string* out_;
  uint64_t acc_ = 0;  // the low used_ bits are pending
  int used_ = 0;
};

class BitReader {
 public:
  explicit BitReader(std::string_view bytes)
      : data_(reinterpret_cast<const uint8_t*>(bytes.data())),
        size_(bytes.size()),
        bit_size_(static_cast<uint64_t>(bytes.size()) * 8) {}

  // Reads `n` bits, 1 <= n <= 64, into the low bits of *value.
  bool Read(int n, uint64_t* value) {
    if (bit_pos_ + n > bit_size_) return false;
    const size_t byte = bit_pos_ >> 3;
    const int shift = static_cast<int>(bit_pos_ & 7);
    uint64_t window = Load64(byte) << shift;
    if (shift + n > 64) window |= static_cast<uint64_t>(data_[byte + 8]) >> (8 - shift);
    *value = window >> (64 - n);
    bit_pos_ += n;
    return true;
  }

  bool ReadBit(bool* bit) {
    uint64_t v;
    if (!Read(1, &v)) return false;
    *bit = v != 0;
    return true;
  }

  bool ReadVarint(uint64_t* v) {
    uint64_t result = 0;
    for (int shift = 0; shift <= 63; shift += 7) {
      uint64_t group;
      if (!Read(8, &group)) return false;
      result |= (group & 0x7F) << shift;
      if ((group & 0x80) == 0) {
        *v = result;
        return true;
      }
    }
    return false;
  }

 private:
  // Eight bytes from `byte` on, big-endian, zero past the end.
  uint64_t Load64(size_t byte) const {
    uint64_t v = 0;
    if (byte + 8 <= size_) {
      uint8_t b[8];
      std::memcpy(b, data_ + byte, 8);
      for (int i = 0; i < 8; ++i) v = (v << 8) | b[i];
      return v;
    }
    for (size_t i = 0; i < 8; ++i) v = (v << 8) | (byte + i < size_ ? data_[byte + i] : 0);
    return v;
  }

  const uint8_t* data_;
  size_t size_;
  uint64_t bit_size_;
  uint64_t bit_pos_ = 0;
};

}  // namespace foreshock::store
