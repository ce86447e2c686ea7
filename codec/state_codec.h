// A tiny binary codec for checkpointed state (detector series, alert engine,
// the server's run state), in a module of its own so that detectors/, alerts/,
// server/ and store/ share it without depending on one another.
//
// Pure and header-only: no protobuf, no I/O. The store adds the file framing
// and checksum (store/checkpoint.h); this is what goes inside.
//
// Encoding, all integers little-endian and fixed width:
//   U8/Bool 1 byte (a bool is 0 or 1), U32/I32 4 bytes, U64/I64 8 bytes,
//   Float/Double as the IEEE-754 bits (4/8 bytes: NaN payloads, -0 and
//   infinities round-trip exactly), String/Bytes as U64 length + bytes,
//   Vector<T> (T arithmetic) as U64 count + the elements.
//   Header: the magic bytes as they are (no length) + U32 version.
// There is no self-description: a blob is read back by the code that wrote
// it, in the same order. Every blob starts with a format version (a Header,
// or a U32 that the owner checks), so a reader can refuse a blob it does not
// understand instead of misreading it.
//
// StateReader never trusts its input: every Get returns false on truncation
// or nonsense (a length or count larger than the bytes left, a bool that is
// not 0 or 1), sets error() and stays failed (every later Get fails too).
// Because every length is checked against the bytes left before anything is
// allocated, corrupt input can never make it allocate more than its own size.
//
// A StateWriter collects the bytes in a string, or streams them to a
// StateSink (a checkpoint file) in pieces of about a chunk, so that a state
// of gigabytes is written without a copy of it. BeginBytes/EndBytes write a
// Bytes field in place (the same bytes as PutBytes of a blob written by a
// second writer, without that blob): how a container nests its parts' state.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace foreshock::codec {

// Where a streaming StateWriter's bytes go: the store's checkpoint file
// (store::CheckpointFileWriter, SeriesStore::WriteCheckpointStreamed) or a string.
class StateSink {
 public:
  virtual ~StateSink() = default;
  virtual void Append(std::string_view bytes) = 0;
  // A field of U64 length + bytes whose length is known at its end (the
  // sink leaves the length's place and fills it in). Nests.
  virtual void BeginLengthPrefixed() = 0;
  virtual void EndLengthPrefixed() = 0;
};

class StateWriter {
 public:
  StateWriter() = default;
  // Streams to `sink`: data() holds only what was not handed over yet (at
  // most about `chunk` bytes); Flush() hands it over. Pieces of `chunk`
  // bytes or more (a tensor) go to the sink directly, not through data().
  explicit StateWriter(StateSink* sink, size_t chunk = size_t{1} << 20)
      : sink_(sink), chunk_(chunk) {}

  void PutU8(uint8_t v) {
    out_.push_back(static_cast<char>(v));
    MaybeFlush();
  }
  void PutBool(bool v) { PutU8(v ? 1 : 0); }
  void PutU32(uint32_t v) { PutFixed(v); }
  void PutI32(int32_t v) { PutFixed(static_cast<uint32_t>(v)); }
  void PutU64(uint64_t v) { PutFixed(v); }
  void PutI64(int64_t v) { PutFixed(static_cast<uint64_t>(v)); }
  void PutFloat(float v) { PutFixed(std::bit_cast<uint32_t>(v)); }
  void PutDouble(double v) { PutFixed(std::bit_cast<uint64_t>(v)); }
  void PutString(std::string_view s) {
    PutU64(s.size());
    PutRaw(s);
  }
  void PutBytes(std::string_view bytes) { PutString(bytes); }
  // U64 count, then the elements (arithmetic types only).
  template <typename T>
  void PutVector(std::span<const T> values) {
    static_assert(std::is_arithmetic_v<T> && !std::is_same_v<T, bool>);
    PutU64(values.size());
    if constexpr (sizeof(T) == 1 || std::endian::native == std::endian::little) {
      PutRaw(std::string_view(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T)));
    } else {
      for (const T& v : values) PutElement(v);
    }
  }
  template <typename T, typename Allocator>
  void PutVector(const std::vector<T, Allocator>& values) {
    PutVector(std::span<const T>(values.data(), values.size()));
  }
  // Fixed magic bytes (a format tag, e.g. "FSAE") and the format version.
  void PutHeader(std::string_view magic, uint32_t version) {
    PutRaw(magic);
    PutU32(version);
  }
  // A Bytes field whose contents are what is put until the matching
  // EndBytes (nests): PutBytes without building the blob first.
  void BeginBytes() {
    if (sink_ != nullptr) {
      Flush();
      sink_->BeginLengthPrefixed();
    } else {
      open_.push_back(out_.size());
      PutU64(0);  // the length, filled in by EndBytes
    }
  }
  void EndBytes() {
    if (sink_ != nullptr) {
      Flush();
      sink_->EndLengthPrefixed();
    } else if (!open_.empty()) {
      const size_t at = open_.back();
      open_.pop_back();
      uint64_t length = out_.size() - at - 8;
      for (size_t i = 0; i < 8; ++i, length >>= 8) out_[at + i] = static_cast<char>(length & 0xff);
    }
  }
  // Hands what is buffered to the sink (no-op without one).
  void Flush() {
    if (sink_ == nullptr || out_.empty()) return;
    sink_->Append(out_);
    out_.clear();
  }

  const std::string& data() const { return out_; }
  std::string Take() { return std::move(out_); }
  size_t size() const { return out_.size(); }

 private:
  void MaybeFlush() {
    if (sink_ != nullptr && out_.size() >= chunk_) Flush();
  }
  void PutRaw(std::string_view bytes) {
    if (sink_ != nullptr && bytes.size() >= chunk_) {
      Flush();
      sink_->Append(bytes);
      return;
    }
    out_.append(bytes.data(), bytes.size());
    MaybeFlush();
  }
  template <typename U>
  void PutFixed(U v) {
    static_assert(std::is_unsigned_v<U>);
    for (size_t i = 0; i < sizeof(U); ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
    MaybeFlush();
  }
  template <typename T>
  void PutElement(T v) {
    if constexpr (std::is_floating_point_v<T>) {
      using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
      PutFixed(std::bit_cast<U>(v));
    } else {
      PutFixed(static_cast<std::make_unsigned_t<T>>(v));
    }
  }

  std::string out_;
  StateSink* sink_ = nullptr;
  size_t chunk_ = 0;
  std::vector<size_t> open_;  // without a sink: where open BeginBytes lengths go
};

class StateReader {
 public:
  explicit StateReader(std::string_view data) : data_(data) {}

  bool GetU8(uint8_t& v) { return GetFixed(v); }
  bool GetBool(bool& v) {
    uint8_t b = 0;
    if (!GetU8(b)) return false;
    if (b > 1) return Fail("bool byte is not 0 or 1");
    v = b == 1;
    return true;
  }
  bool GetU32(uint32_t& v) { return GetFixed(v); }
  bool GetI32(int32_t& v) {
    uint32_t u = 0;
    if (!GetFixed(u)) return false;
    v = static_cast<int32_t>(u);
    return true;
  }
  bool GetU64(uint64_t& v) { return GetFixed(v); }
  bool GetI64(int64_t& v) {
    uint64_t u = 0;
    if (!GetFixed(u)) return false;
    v = static_cast<int64_t>(u);
    return true;
  }
  bool GetFloat(float& v) {
    uint32_t u = 0;
    if (!GetFixed(u)) return false;
    v = std::bit_cast<float>(u);
    return true;
  }
  bool GetDouble(double& v) {
    uint64_t u = 0;
    if (!GetFixed(u)) return false;
    v = std::bit_cast<double>(u);
    return true;
  }
  // A String/Bytes field as a view into the input (valid as long as it is).
  bool GetStringView(std::string_view& s) {
    uint64_t n = 0;
    if (!GetCount(n, 1)) return false;
    s = data_.substr(pos_, static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return true;
  }
  bool GetString(std::string& s) {
    std::string_view view;
    if (!GetStringView(view)) return false;
    s.assign(view.data(), view.size());
    return true;
  }
  bool GetBytes(std::string& bytes) { return GetString(bytes); }
  template <typename T, typename Allocator>
  bool GetVector(std::vector<T, Allocator>& values) {
    static_assert(std::is_arithmetic_v<T> && !std::is_same_v<T, bool>);
    uint64_t n = 0;
    if (!GetCount(n, sizeof(T))) return false;
    values.resize(static_cast<size_t>(n));
    if (n == 0) return true;
    if constexpr (sizeof(T) == 1 || std::endian::native == std::endian::little) {
      std::memcpy(values.data(), data_.data() + pos_, static_cast<size_t>(n) * sizeof(T));
      pos_ += static_cast<size_t>(n) * sizeof(T);
    } else {
      for (T& v : values) GetElement(v);
    }
    return true;
  }
  // A U64 count of items that each take at least `min_bytes_each` (>= 1)
  // bytes of what is left: a count no input could back is an error, so a
  // caller may reserve() it.
  bool GetCount(uint64_t& n, size_t min_bytes_each = 1) {
    if (!GetU64(n)) return false;
    if (min_bytes_each == 0) min_bytes_each = 1;
    if (n > remaining() / min_bytes_each) {
      return Fail("count " + std::to_string(n) + " exceeds the " + std::to_string(remaining()) +
                  " bytes left");
    }
    return true;
  }
  // Reads a header written by PutHeader(magic, v) and checks the magic and
  // min_version <= v <= max_version.
  bool GetHeader(std::string_view magic, uint32_t min_version, uint32_t max_version,
                 uint32_t& version) {
    if (!ok()) return false;
    if (remaining() < magic.size() || data_.substr(pos_, magic.size()) != magic) {
      return Fail("not a " + std::string(magic) + " blob");
    }
    pos_ += magic.size();
    if (!GetU32(version)) return false;
    if (version < min_version || version > max_version) {
      return Fail(std::string(magic) + " format version " + std::to_string(version) +
                  " not supported (this build reads " + std::to_string(min_version) + ".." +
                  std::to_string(max_version) + ")");
    }
    return true;
  }
  // Reads a U32 version and checks it lies in [min_version, max_version].
  bool GetVersion(std::string_view what, uint32_t min_version, uint32_t max_version,
                  uint32_t& version) {
    if (!GetU32(version)) return false;
    if (version < min_version || version > max_version) {
      return Fail(std::string(what) + " state version " + std::to_string(version) +
                  " not supported");
    }
    return true;
  }
  // Fails unless every byte was consumed.
  bool ExpectEnd() {
    if (!ok()) return false;
    if (remaining() != 0) return Fail(std::to_string(remaining()) + " trailing bytes");
    return true;
  }

  // Marks the input as invalid (the first error is kept) and returns false,
  // so that validation code can `return reader.Fail("why")`.
  bool Fail(std::string_view why) {
    if (error_.empty()) {
      error_ = std::string(why) + " (at byte " + std::to_string(pos_) + ")";
    }
    failed_ = true;
    return false;
  }

  bool ok() const { return !failed_; }
  const std::string& error() const { return error_; }
  size_t remaining() const { return data_.size() - pos_; }
  size_t position() const { return pos_; }

 private:
  template <typename U>
  bool GetFixed(U& v) {
    static_assert(std::is_unsigned_v<U>);
    if (failed_) return false;
    if (remaining() < sizeof(U)) return Fail("truncated");
    U result = 0;
    for (size_t i = 0; i < sizeof(U); ++i) {
      result |= static_cast<U>(static_cast<unsigned char>(data_[pos_ + i])) << (8 * i);
    }
    pos_ += sizeof(U);
    v = result;
    return true;
  }
  template <typename T>
  void GetElement(T& v) {
    if constexpr (std::is_floating_point_v<T>) {
      using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
      U u = 0;
      GetFixed(u);
      v = std::bit_cast<T>(u);
    } else {
      std::make_unsigned_t<T> u = 0;
      GetFixed(u);
      v = static_cast<T>(u);
    }
  }

  std::string_view data_;
  size_t pos_ = 0;
  bool failed_ = false;
  std::string error_;
};

// A record's fields listed once, for both directions: the owner writes one
// function template over an `io`,
//   template <typename Io, typename E> bool EventFields(Io& io, E& e) {
//     return io(e.seq) && io(e.run) && io(e.step);
//   }
// and encodes with FieldWriter (E const, every call true) or decodes with
// FieldReader (false at the first field that does not read). Each call is
// typed by its field (uint8_t, bool, int32_t, uint32_t, int64_t, uint64_t,
// float, double, std::string, a vector of numbers), so encode and decode
// cannot drift apart; the
// bytes are those of the matching Put/Get calls.
class FieldWriter {
 public:
  explicit FieldWriter(StateWriter& writer) : w_(writer) {}
  bool operator()(uint8_t v) { return w_.PutU8(v), true; }
  bool operator()(bool v) { return w_.PutBool(v), true; }
  bool operator()(int32_t v) { return w_.PutI32(v), true; }
  bool operator()(uint32_t v) { return w_.PutU32(v), true; }
  bool operator()(int64_t v) { return w_.PutI64(v), true; }
  bool operator()(uint64_t v) { return w_.PutU64(v), true; }
  bool operator()(float v) { return w_.PutFloat(v), true; }
  bool operator()(double v) { return w_.PutDouble(v), true; }
  bool operator()(const std::string& v) { return w_.PutString(v), true; }
  template <typename T, typename Allocator>
  bool operator()(const std::vector<T, Allocator>& v) {
    return w_.PutVector(v), true;
  }

 private:
  StateWriter& w_;
};

class FieldReader {
 public:
  explicit FieldReader(StateReader& reader) : r_(reader) {}
  bool operator()(uint8_t& v) { return r_.GetU8(v); }
  bool operator()(bool& v) { return r_.GetBool(v); }
  bool operator()(int32_t& v) { return r_.GetI32(v); }
  bool operator()(uint32_t& v) { return r_.GetU32(v); }
  bool operator()(int64_t& v) { return r_.GetI64(v); }
  bool operator()(uint64_t& v) { return r_.GetU64(v); }
  bool operator()(float& v) { return r_.GetFloat(v); }
  bool operator()(double& v) { return r_.GetDouble(v); }
  bool operator()(std::string& v) { return r_.GetString(v); }
  template <typename T, typename Allocator>
  bool operator()(std::vector<T, Allocator>& v) {
    return r_.GetVector(v);
  }

 private:
  StateReader& r_;
};

}  // namespace foreshock::codec
