#include "record/recording.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>

#include "store/crc32c.h"

namespace foreshock::record {
namespace {

void PutU32(char* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xFF);
}
void PutU64(char* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xFF);
}
uint32_t GetU32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t{static_cast<uint8_t>(p[i])} << (8 * i);
  return v;
}
uint64_t GetU64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t{static_cast<uint8_t>(p[i])} << (8 * i);
  return v;
}

void FillFrameHeader(char* out, uint32_t length, uint32_t crc, int64_t recv_unix_us) {
  PutU32(out, length);
  PutU32(out + 4, crc);
  PutU64(out + 8, static_cast<uint64_t>(recv_unix_us));
}

std::string Errno(std::string_view what, const std::string& path) {
  return std::string(what) + " " + path + ": " + std::strerror(errno);
}

std::string Hex32(uint32_t v) {
  char text[16];
  std::snprintf(text, sizeof(text), "0x%08x", v);
  return text;
}

}  // namespace

std::string FileHeader() {
  std::string header(kFileHeaderBytes, '\0');
  std::memcpy(header.data(), kRecordingMagic.data(), kRecordingMagic.size());
  PutU32(header.data() + 8, kRecordingVersion);
  PutU32(header.data() + 12, 0);
  return header;
}

std::string FrameHeader(std::string_view payload, int64_t recv_unix_us) {
  std::string header(kFrameHeaderBytes, '\0');
  FillFrameHeader(header.data(), static_cast<uint32_t>(payload.size()),
                  store::Crc32c(payload), recv_unix_us);
  return header;
}

// ---------------------------------------------------------------- writer

RecordingWriter::RecordingWriter(size_t buffer_bytes)
    : buffer_bytes_(std::max<size_t>(buffer_bytes, kFrameHeaderBytes)) {}

RecordingWriter::~RecordingWriter() {
  std::string ignored;
  Close(&ignored);
}

bool RecordingWriter::Fail(std::string message, std::string* error) {
  if (failed_.empty()) failed_ = std::move(message);
  if (error) *error = failed_;
  return false;
}

bool RecordingWriter::OpenFd(const std::string& path, int flags, std::string* error) {
  if (fd_ >= 0) {
    if (error) *error = "recording " + path_ + " is already open";
    return false;
  }
  const int fd = ::open(path.c_str(), flags | O_WRONLY | O_CLOEXEC, 0644);
  if (fd < 0) {
    if (error) *error = Errno("cannot open recording", path);
    return false;
  }
  fd_ = fd;
  path_ = path;
  failed_.clear();
  buffer_.clear();
  buffer_.reserve(std::min<size_t>(buffer_bytes_, size_t{1} << 20));
  frames_ = 0;
  file_bytes_ = 0;
  return true;
}

bool RecordingWriter::Create(const std::string& path, std::string* error) {
  if (!OpenFd(path, O_CREAT | O_EXCL, error)) return false;
  const std::string header = FileHeader();
  if (!WriteOut(header, error)) return false;
  file_bytes_ = header.size();
  return true;
}

bool RecordingWriter::Open(const std::string& path, std::string* error) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return Create(path, error);
    if (error) *error = Errno("cannot stat recording", path);
    return false;
  }
  uint64_t keep = 0;
  const std::string header = FileHeader();
  if (static_cast<uint64_t>(st.st_size) < kFileHeaderBytes) {
    // A header torn by a crash right after creation: start it again, but
    // only if what is there is the start of our header.
    std::string head;
    if (std::FILE* f = std::fopen(path.c_str(), "rb")) {
      head.resize(static_cast<size_t>(st.st_size));
      head.resize(std::fread(head.data(), 1, head.size(), f));
      std::fclose(f);
    }
    if (head.size() != static_cast<size_t>(st.st_size) || header.compare(0, head.size(), head) != 0) {
      if (error) *error = "recording " + path + ": not a Foreshock recording (short file, bad magic)";
      return false;
    }
  } else {
    RecordingReader reader;
    if (!reader.Open(path)) {
      if (error) *error = reader.error();
      return false;
    }
    Frame frame;
    ReadStatus status;
    while ((status = reader.Next(&frame)) == ReadStatus::kFrame) {
    }
    if (status == ReadStatus::kError) {
      if (error) *error = reader.error();
      return false;
    }
    keep = reader.valid_bytes();
  }
  if (!OpenFd(path, 0, error)) return false;
  if (::ftruncate(fd_, static_cast<off_t>(keep)) != 0 ||
      ::lseek(fd_, static_cast<off_t>(keep), SEEK_SET) < 0) {
    Fail(Errno("cannot cut the torn tail of recording", path), error);
    ::close(fd_);
    fd_ = -1;
    return false;
  }
  if (keep == 0) {
    if (!WriteOut(header, error)) return false;
    keep = header.size();
  }
  file_bytes_ = keep;
  return true;
}

bool RecordingWriter::WriteOut(std::string_view bytes, std::string* error) {
  while (!bytes.empty()) {
    const ssize_t n = ::write(fd_, bytes.data(), bytes.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return Fail(Errno("cannot write recording", path_), error);
    }
    bytes.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

bool RecordingWriter::Append(std::initializer_list<std::string_view> parts, int64_t recv_unix_us,
                             std::string* error) {
  return Append(parts.begin(), parts.size(), recv_unix_us, error);
}

bool RecordingWriter::Append(const std::string_view* parts, size_t n_parts, int64_t recv_unix_us,
                             std::string* error) {
  if (!failed_.empty()) return Fail(failed_, error);
  if (fd_ < 0) {
    if (error) *error = "recording is not open";
    return false;
  }
  uint64_t length = 0;
  uint32_t crc = 0;
  for (size_t i = 0; i < n_parts; ++i) {
    length += parts[i].size();
    crc = store::Crc32cExtend(crc, parts[i].data(), parts[i].size());
  }
  if (length > kMaxFramePayloadBytes) {
    if (error) {
      *error = "recording " + path_ + ": a frame of " + std::to_string(length) +
               " bytes is over the limit of " + std::to_string(kMaxFramePayloadBytes);
    }
    return false;  // the caller's mistake, not the file's: not sticky
  }
  char header[kFrameHeaderBytes];
  FillFrameHeader(header, static_cast<uint32_t>(length), crc, recv_unix_us);
  const size_t frame_bytes = kFrameHeaderBytes + static_cast<size_t>(length);
  if (buffer_.size() + frame_bytes > buffer_bytes_) {
    if (!Flush(error)) return false;
  }
  if (frame_bytes > buffer_bytes_) {  // too large to buffer: straight through
    if (!WriteOut(std::string_view(header, sizeof(header)), error)) return false;
    for (size_t i = 0; i < n_parts; ++i) {
      if (!WriteOut(parts[i], error)) return false;
    }
  } else {
    buffer_.append(header, sizeof(header));
    for (size_t i = 0; i < n_parts; ++i) buffer_.append(parts[i]);
  }
  ++frames_;
  file_bytes_ += frame_bytes;
  return true;
}

bool RecordingWriter::Flush(std::string* error) {
  if (!failed_.empty()) return Fail(failed_, error);
  if (fd_ < 0) return true;
  const bool ok = WriteOut(buffer_, error);
  buffer_.clear();
  return ok;
}

bool RecordingWriter::Sync(std::string* error) {
  if (!Flush(error)) return false;
  if (fd_ >= 0 && ::fdatasync(fd_) != 0) return Fail(Errno("cannot sync recording", path_), error);
  return true;
}

bool RecordingWriter::Close(std::string* error) {
  if (fd_ < 0) return failed_.empty() ? true : Fail(failed_, error);
  bool ok = Flush(error);
  if (::close(fd_) != 0 && ok) ok = Fail(Errno("cannot close recording", path_), error);
  fd_ = -1;
  buffer_.clear();
  buffer_.shrink_to_fit();
  return ok;
}

// ---------------------------------------------------------------- reader

RecordingReader::~RecordingReader() {
  if (file_) std::fclose(file_);
}

bool RecordingReader::Open(const std::string& path) {
  if (file_) std::fclose(file_);
  file_ = nullptr;
  path_ = path;
  error_.clear();
  offset_ = 0;
  frames_ = 0;
  done_ = false;
  file_ = std::fopen(path.c_str(), "rb");
  if (!file_) {
    error_ = Errno("cannot open recording", path);
    done_ = true;
    final_ = ReadStatus::kError;
    return false;
  }
  char header[kFileHeaderBytes];
  const size_t n = ReadUpTo(header, sizeof(header));
  if (!error_.empty()) {
    Stop(ReadStatus::kError, error_);
    return false;
  }
  if (n < kRecordingMagic.size() ||
      std::memcmp(header, kRecordingMagic.data(), kRecordingMagic.size()) != 0) {
    Stop(ReadStatus::kError, "not a Foreshock recording: the file does not start with \"" +
                                 std::string(kRecordingMagic) + "\"");
    return false;
  }
  if (n < kFileHeaderBytes) {
    Stop(ReadStatus::kError, "the file header is cut short (" + std::to_string(n) + " of " +
                                 std::to_string(kFileHeaderBytes) + " bytes)");
    return false;
  }
  version_ = GetU32(header + 8);
  if (version_ != kRecordingVersion) {
    Stop(ReadStatus::kError, "unsupported recording version " + std::to_string(version_) +
                                 " (this build reads version " +
                                 std::to_string(kRecordingVersion) + ")");
    return false;
  }
  offset_ = kFileHeaderBytes;
  return true;
}

size_t RecordingReader::ReadUpTo(char* out, size_t n) {
  size_t got = 0;
  while (got < n) {
    const size_t r = std::fread(out + got, 1, n - got, file_);
    got += r;
    if (r == 0) {
      if (std::ferror(file_)) {
        if (errno == EINTR) {
          std::clearerr(file_);
          continue;
        }
        error_ = Errno("cannot read", path_);
      }
      break;
    }
  }
  return got;
}

ReadStatus RecordingReader::Stop(ReadStatus status, std::string message) {
  done_ = true;
  final_ = status;
  if (status == ReadStatus::kEnd) {
    error_.clear();
  } else {
    error_ = "recording " + path_ + ": " + message;
  }
  return status;
}

ReadStatus RecordingReader::Next(Frame* frame) {
  if (done_) return final_;
  char header[kFrameHeaderBytes];
  const size_t n = ReadUpTo(header, sizeof(header));
  if (!error_.empty()) return Stop(ReadStatus::kError, error_);
  if (n == 0) return Stop(ReadStatus::kEnd, "");
  const std::string where =
      "frame " + std::to_string(frames_) + " at offset " + std::to_string(offset_);
  if (n < kFrameHeaderBytes) {
    return Stop(ReadStatus::kTruncated, "truncated tail: " + where + " has " + std::to_string(n) +
                                            " of its " + std::to_string(kFrameHeaderBytes) +
                                            " header bytes");
  }
  const uint32_t length = GetU32(header);
  const uint32_t stored_crc = GetU32(header + 4);
  const int64_t recv_us = static_cast<int64_t>(GetU64(header + 8));
  if (length > kMaxFramePayloadBytes) {
    return Stop(ReadStatus::kError, "corrupt " + where + ": payload length " +
                                        std::to_string(length) + " is over the limit of " +
                                        std::to_string(kMaxFramePayloadBytes));
  }
  // Do not allocate for a payload the file cannot hold (a torn or corrupt
  // length): compare with the file's size first.
  struct stat st;
  const uint64_t payload_at = offset_ + kFrameHeaderBytes;
  uint64_t available = UINT64_MAX;
  if (::fstat(::fileno(file_), &st) == 0 && S_ISREG(st.st_mode)) {
    available = static_cast<uint64_t>(st.st_size) > payload_at
                    ? static_cast<uint64_t>(st.st_size) - payload_at
                    : 0;
  }
  if (length > available) {
    return Stop(ReadStatus::kTruncated, "truncated tail: " + where + " declares " +
                                            std::to_string(length) + " payload bytes, " +
                                            std::to_string(available) + " remain in the file");
  }
  frame->payload.resize(length);
  const size_t got = ReadUpTo(frame->payload.data(), length);
  if (!error_.empty()) return Stop(ReadStatus::kError, error_);
  if (got < length) {
    return Stop(ReadStatus::kTruncated, "truncated tail: " + where + " has " +
                                            std::to_string(got) + " of its " +
                                            std::to_string(length) + " payload bytes");
  }
  const uint32_t crc = store::Crc32c(frame->payload);
  if (crc != stored_crc) {
    return Stop(ReadStatus::kError, "corrupt " + where + ": CRC-32C of the " +
                                        std::to_string(length) + "-byte payload is " + Hex32(crc) +
                                        ", the frame says " + Hex32(stored_crc));
  }
  frame->recv_unix_us = recv_us;
  frame->offset = offset_;
  frame->index = frames_;
  offset_ = payload_at + length;
  ++frames_;
  return ReadStatus::kFrame;
}

const char* ReadStatusName(ReadStatus status) {
  switch (status) {
    case ReadStatus::kFrame:
      return "frame";
    case ReadStatus::kEnd:
      return "end";
    case ReadStatus::kTruncated:
      return "truncated";
    case ReadStatus::kError:
      return "error";
  }
  return "?";
}

std::string CompactUtcTime(int64_t unix_us) {
  const std::time_t seconds = static_cast<std::time_t>(unix_us / 1000000);
  std::tm tm{};
  gmtime_r(&seconds, &tm);
  char text[32];
  std::strftime(text, sizeof(text), "%Y%m%dT%H%M%S", &tm);
  return text;
}

std::string SanitizeForFileName(std::string_view text, size_t max_length) {
  std::string out;
  for (char c : text.substr(0, max_length)) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    out.push_back(ok ? c : '_');
  }
  // No hidden files and no "." or "..".
  if (!out.empty() && out.front() == '.') out.front() = '_';
  return out.empty() ? "unknown" : out;
}

}  // namespace foreshock::record
