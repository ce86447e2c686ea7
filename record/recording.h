// Recordings of the raw ingest stream: every foreshock.v1.StreamRequest a
// stream received, byte for byte, with the time it arrived. foreshockd
// writes them with --record_dir; `foreshockctl replay` streams them back into
// a daemon. Pure C++: no gRPC here (the payload is opaque bytes).
//
// Layout (all integers little-endian):
//
//   file header, 16 bytes:
//     magic    8 bytes  "FSHKREC1"
//     version  u32      kRecordingVersion (1)
//     reserved u32      0
//   frame*, until the end of the file:
//     length   u32      payload bytes
//     crc      u32      CRC-32C (store/crc32c.h) of the payload
//     recv_us  i64      receive time, Unix microseconds
//     payload  length bytes: the serialized StreamRequest exactly as received
//
// The CRC covers the payload only, not the length or the time. A length that
// runs past the end of the file reads as a torn tail (the writer stopped in
// the middle of a frame); a length above kMaxFramePayloadBytes or a CRC
// mismatch reads as corruption.
#pragma once

#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <string>
#include <string_view>

namespace foreshock::record {

inline constexpr std::string_view kRecordingMagic = "FSHKREC1";
inline constexpr uint32_t kRecordingVersion = 1;
inline constexpr size_t kFileHeaderBytes = 16;
inline constexpr size_t kFrameHeaderBytes = 16;
// gRPC's largest message (foreshockd --max_message_mb is at most 2047 MiB).
inline constexpr uint32_t kMaxFramePayloadBytes = 2047u << 20;

// The file extension foreshockd uses.
inline constexpr std::string_view kRecordingExtension = ".fsrec";

// The file header bytes for kRecordingVersion.
std::string FileHeader();
// The 16 header bytes of a frame carrying `payload`.
std::string FrameHeader(std::string_view payload, int64_t recv_unix_us);

// Appends frames to a recording. Frames are assembled in a buffer of at most
// `buffer_bytes` and written with write(2) when it would overflow (a larger
// frame is written straight through), on Flush and on Close. Not thread-safe.
//
// Errors are sticky: after a failed write nothing more is written, so the
// file stays a valid recording, at worst with a torn last frame, and every
// later call returns false with the first error.
class RecordingWriter {
 public:
  explicit RecordingWriter(size_t buffer_bytes = size_t{1} << 20);
  ~RecordingWriter();  // Closes (errors are lost: call Close to see them).
  RecordingWriter(const RecordingWriter&) = delete;
  RecordingWriter& operator=(const RecordingWriter&) = delete;

  // Creates a new recording at `path` (fails if the file exists) and writes
  // its header.
  bool Create(const std::string& path, std::string* error);
  // Opens an existing recording to append to it: checks the header, reads
  // every frame, and cuts off a torn last frame. Fails on a corrupt frame.
  // Creates the file when it does not exist.
  bool Open(const std::string& path, std::string* error);

  // Appends one frame whose payload is the concatenation of `parts` (e.g.
  // the slices of a gRPC ByteBuffer, without joining them first).
  bool Append(std::initializer_list<std::string_view> parts, int64_t recv_unix_us,
              std::string* error);
  bool Append(const std::string_view* parts, size_t n_parts, int64_t recv_unix_us,
              std::string* error);
  bool Append(std::string_view payload, int64_t recv_unix_us, std::string* error) {
    return Append(&payload, 1, recv_unix_us, error);
  }

  // Writes out the buffer (to the kernel; see Sync for the disk).
  bool Flush(std::string* error);
  // Flush, then fdatasync.
  bool Sync(std::string* error);
  // Flush and close. Safe to call twice and on a writer that never opened.
  bool Close(std::string* error);

  bool is_open() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }
  uint64_t frames() const { return frames_; }          // appended since Create/Open
  uint64_t file_bytes() const { return file_bytes_; }  // header + frames, buffered or not

 private:
  bool OpenFd(const std::string& path, int flags, std::string* error);
  bool WriteOut(std::string_view bytes, std::string* error);
  bool Fail(std::string message, std::string* error);

  const size_t buffer_bytes_;
  int fd_ = -1;
  std::string path_;
  std::string buffer_;
  std::string failed_;  // the sticky error, empty while healthy
  uint64_t frames_ = 0;
  uint64_t file_bytes_ = 0;
};

struct Frame {
  int64_t recv_unix_us = 0;
  std::string payload;
  uint64_t offset = 0;  // of the frame header in the file
  uint64_t index = 0;   // 0 for the first frame
};

enum class ReadStatus {
  kFrame,      // *frame holds the next frame
  kEnd,        // clean end of the file, after a whole frame (or the header)
  kTruncated,  // the file ends inside a frame: a torn tail; frames before it are good
  kError,      // bad magic or version, corruption, or an I/O error; see error()
};

// Reads a recording frame by frame through a FILE*, holding one frame in
// memory at a time. After anything but kFrame, Next keeps returning the same
// status.
class RecordingReader {
 public:
  RecordingReader() = default;
  ~RecordingReader();
  RecordingReader(const RecordingReader&) = delete;
  RecordingReader& operator=(const RecordingReader&) = delete;

  // Opens `path` and checks the header. On failure, error() says why.
  bool Open(const std::string& path);
  ReadStatus Next(Frame* frame);

  // For kTruncated and kError: what went wrong and where, with the path.
  const std::string& error() const { return error_; }
  uint32_t version() const { return version_; }
  // Bytes of the file consumed by whole frames (and the header): where a
  // torn tail starts.
  uint64_t valid_bytes() const { return offset_; }

 private:
  ReadStatus Stop(ReadStatus status, std::string message);
  // Reads up to n bytes; returns how many (short only at end of file or on error).
  size_t ReadUpTo(char* out, size_t n);

  std::FILE* file_ = nullptr;
  std::string path_;
  std::string error_;
  uint32_t version_ = 0;
  uint64_t offset_ = 0;
  uint64_t frames_ = 0;
  bool done_ = false;
  ReadStatus final_ = ReadStatus::kEnd;
};

const char* ReadStatusName(ReadStatus status);

// Unix microseconds as UTC "yyyymmddThhmmss", e.g. "20240501T120000" (for file names).
std::string CompactUtcTime(int64_t unix_us);
// Replaces every character outside [A-Za-z0-9._-] with '_' and caps the
// length (for run ids in file names); "unknown" for an empty id.
std::string SanitizeForFileName(std::string_view text, size_t max_length = 64);

}  // namespace foreshock::record
