// Checkpoint files: one named blob per file, replaced atomically.
//
//   <dir>/<name>.ckpt = "FSHKCKP1" | crc32c u32 | length u64 | bytes
//
// (integers little-endian; the CRC covers the length and the bytes.) A write
// goes to <name>.ckpt.tmp, is fsynced, renamed over the old file and the
// directory is fsynced: a reader sees the old checkpoint or the new one,
// never a mix, even across a crash.
//
// CheckpointFileWriter writes the same file piece by piece, so that a large
// state goes to disk without a copy of it in memory.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "codec/state_codec.h"

namespace foreshock::store {

bool WriteCheckpointFile(const std::string& dir, std::string_view name, std::string_view bytes,
                         std::string* error);

enum class CheckpointStatus { kOk, kMissing, kCorrupt, kIoError };

// On kCorrupt and kIoError, *error says why.
CheckpointStatus ReadCheckpointFile(const std::string& dir, std::string_view name,
                                    std::string* bytes, std::string* error);

std::string CheckpointPath(const std::string& dir, std::string_view name);

// A checkpoint's bytes: mapped read-only from its file, or owned (a store
// kept in memory). Mapped, restoring a large state holds it once in the
// heap, plus page cache the kernel can reclaim under pressure; read into a
// string, the checkpoint and the state it restores were both anonymous
// memory, about twice the state, at the moment a container can least
// spare it (a restart after the daemon reached its memory bound). Move-only.
class CheckpointBytes {
 public:
  CheckpointBytes() = default;
  explicit CheckpointBytes(std::string owned) : owned_(std::move(owned)) {}
  ~CheckpointBytes();
  CheckpointBytes(CheckpointBytes&& other) noexcept;
  CheckpointBytes& operator=(CheckpointBytes&& other) noexcept;
  CheckpointBytes(const CheckpointBytes&) = delete;
  CheckpointBytes& operator=(const CheckpointBytes&) = delete;

  std::string_view view() const { return mapping_ != nullptr ? payload_ : std::string_view(owned_); }
  size_t size() const { return view().size(); }

 private:
  friend CheckpointStatus MapCheckpointFile(const std::string&, std::string_view,
                                            CheckpointBytes*, std::string*);
  void Unmap();

  std::string owned_;
  void* mapping_ = nullptr;
  size_t mapping_bytes_ = 0;
  std::string_view payload_;  // within the mapping
};

// ReadCheckpointFile's checks, on the file mapped instead of read.
CheckpointStatus MapCheckpointFile(const std::string& dir, std::string_view name,
                                   CheckpointBytes* bytes, std::string* error);

// The file above, written as it is produced: the bytes go straight to
// <name>.ckpt.tmp (the CRC is computed on the way; a length field filled in
// later is folded in with Crc32cCombine), Commit writes the header, fsyncs
// and renames. Destroyed without a successful Commit, it removes the
// temporary file and the previous checkpoint stays. The first failure is
// kept (later calls do nothing) and Commit reports it.
class CheckpointFileWriter final : public codec::StateSink {
 public:
  CheckpointFileWriter(std::string dir, std::string_view name);
  ~CheckpointFileWriter() override;
  CheckpointFileWriter(const CheckpointFileWriter&) = delete;
  CheckpointFileWriter& operator=(const CheckpointFileWriter&) = delete;

  void Append(std::string_view bytes) override;
  void BeginLengthPrefixed() override;
  void EndLengthPrefixed() override;
  bool Commit(std::string* error);
  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }
  uint64_t payload_bytes() const { return offset_ - kHeaderBytes; }

  static constexpr uint64_t kHeaderBytes = 8 + 4 + 8;

 private:
  struct OpenField {
    uint64_t length_offset;  // where its U64 length goes
    uint32_t crc_before;     // CRC of the enclosing region up to the length
    uint64_t length_before;  // the enclosing region's length up to it
  };
  void Fail(std::string error);

  const std::string dir_, path_, tmp_;
  int fd_ = -1;
  std::string error_;
  bool committed_ = false;
  uint64_t offset_ = kHeaderBytes;  // the file offset of the next byte
  uint32_t crc_ = 0;                // CRC of the current region ...
  uint64_t region_length_ = 0;      // ... and its length
  std::vector<OpenField> open_;     // fields begun and not ended
};

}  // namespace foreshock::store
