#include "store/checkpoint.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <utility>

#include "store/crc32c.h"
#include "store/file_util.h"
#include "store/varint.h"

namespace foreshock::store {
namespace {

constexpr std::string_view kCheckpointMagic = "FSHKCKP1";
constexpr size_t kCheckpointHeaderBytes = 8 + 4 + 8;

uint32_t CheckpointCrc(std::string_view encoded_length, std::string_view bytes) {
  return Crc32cExtend(Crc32c(encoded_length), bytes.data(), bytes.size());
}

}  // namespace

std::string CheckpointPath(const std::string& dir, std::string_view name) {
  return dir + "/" + std::string(name) + ".ckpt";
}

bool WriteCheckpointFile(const std::string& dir, std::string_view name, std::string_view bytes,
                         std::string* error) {
  std::string length;
  PutFixed64(&length, bytes.size());
  std::string contents(kCheckpointMagic);
  PutFixed32(&contents, CheckpointCrc(length, bytes));
  contents += length;
  contents.append(bytes);

  const std::string path = CheckpointPath(dir, name);
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    *error = ErrnoMessage("cannot create", tmp);
    return false;
  }
  bool ok = WriteAllAt(fd, contents, 0, error);
  if (ok && ::fsync(fd) != 0) {
    *error = ErrnoMessage("cannot fsync", tmp);
    ok = false;
  }
  ::close(fd);
  if (ok && ::rename(tmp.c_str(), path.c_str()) != 0) {
    *error = ErrnoMessage("cannot rename to", path);
    ok = false;
  }
  if (!ok) {
    ::unlink(tmp.c_str());
    return false;
  }
  return SyncDirectory(dir, error);
}

namespace {
// The header, length and checksum of a checkpoint file's `contents`.
CheckpointStatus CheckContents(const std::string& path, std::string_view contents,
                               std::string* error) {
  if (contents.size() < kCheckpointHeaderBytes || contents.substr(0, 8) != kCheckpointMagic) {
    *error = "checkpoint " + path + ": bad header";
    return CheckpointStatus::kCorrupt;
  }
  const uint32_t crc = DecodeFixed32(contents.data() + 8);
  const uint64_t length = DecodeFixed64(contents.data() + 12);
  static_assert(kCheckpointHeaderBytes == CheckpointFileWriter::kHeaderBytes);
  if (length != contents.size() - kCheckpointHeaderBytes) {
    *error = "checkpoint " + path + ": length " + std::to_string(length) + " but " +
             std::to_string(contents.size() - kCheckpointHeaderBytes) + " bytes follow";
    return CheckpointStatus::kCorrupt;
  }
  if (CheckpointCrc(contents.substr(12, 8), contents.substr(kCheckpointHeaderBytes)) != crc) {
    *error = "checkpoint " + path + ": checksum mismatch";
    return CheckpointStatus::kCorrupt;
  }
  return CheckpointStatus::kOk;
}
}  // namespace

CheckpointStatus ReadCheckpointFile(const std::string& dir, std::string_view name,
                                    std::string* bytes, std::string* error) {
  const std::string path = CheckpointPath(dir, name);
  if (::access(path.c_str(), F_OK) != 0 && errno == ENOENT) return CheckpointStatus::kMissing;
  std::string contents;
  if (!ReadWholeFile(path, &contents, error)) return CheckpointStatus::kIoError;
  if (CheckpointStatus status = CheckContents(path, contents, error);
      status != CheckpointStatus::kOk) {
    return status;
  }
  // In place, not a second copy: a detector checkpoint can be as large as
  // the daemon's detector state.
  contents.erase(0, kCheckpointHeaderBytes);
  *bytes = std::move(contents);
  return CheckpointStatus::kOk;
}

CheckpointStatus MapCheckpointFile(const std::string& dir, std::string_view name,
                                   CheckpointBytes* bytes, std::string* error) {
  const std::string path = CheckpointPath(dir, name);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return CheckpointStatus::kMissing;
    *error = ErrnoMessage("cannot open", path);
    return CheckpointStatus::kIoError;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    *error = ErrnoMessage("cannot stat", path);
    ::close(fd);
    return CheckpointStatus::kIoError;
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < kCheckpointHeaderBytes) {
    ::close(fd);
    *error = "checkpoint " + path + ": bad header";
    return CheckpointStatus::kCorrupt;
  }
  void* mapping = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);  // the mapping keeps the file
  if (mapping == MAP_FAILED) {
    *error = ErrnoMessage("cannot map", path);
    return CheckpointStatus::kIoError;
  }
  ::madvise(mapping, size, MADV_SEQUENTIAL);  // read once in order: pages may go behind
  CheckpointBytes mapped;
  mapped.mapping_ = mapping;
  mapped.mapping_bytes_ = size;
  const std::string_view contents(static_cast<const char*>(mapping), size);
  if (CheckpointStatus status = CheckContents(path, contents, error);
      status != CheckpointStatus::kOk) {
    return status;  // `mapped` unmaps it
  }
  mapped.payload_ = contents.substr(kCheckpointHeaderBytes);
  *bytes = std::move(mapped);
  return CheckpointStatus::kOk;
}

CheckpointBytes::~CheckpointBytes() { Unmap(); }

CheckpointBytes::CheckpointBytes(CheckpointBytes&& other) noexcept
    : owned_(std::move(other.owned_)),
      mapping_(std::exchange(other.mapping_, nullptr)),
      mapping_bytes_(std::exchange(other.mapping_bytes_, 0)),
      payload_(std::exchange(other.payload_, {})) {}

CheckpointBytes& CheckpointBytes::operator=(CheckpointBytes&& other) noexcept {
  if (this != &other) {
    Unmap();
    owned_ = std::move(other.owned_);
    mapping_ = std::exchange(other.mapping_, nullptr);
    mapping_bytes_ = std::exchange(other.mapping_bytes_, 0);
    payload_ = std::exchange(other.payload_, {});
  }
  return *this;
}

void CheckpointBytes::Unmap() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_bytes_);
  mapping_ = nullptr;
  mapping_bytes_ = 0;
  payload_ = {};
}

CheckpointFileWriter::CheckpointFileWriter(std::string dir, std::string_view name)
    : dir_(std::move(dir)), path_(CheckpointPath(dir_, name)), tmp_(path_ + ".tmp") {
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) error_ = ErrnoMessage("cannot create", tmp_);
}

CheckpointFileWriter::~CheckpointFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_.c_str());
}

void CheckpointFileWriter::Fail(std::string error) {
  if (error_.empty()) error_ = std::move(error);
}

void CheckpointFileWriter::Append(std::string_view bytes) {
  if (!ok() || bytes.empty()) return;
  std::string error;
  if (!WriteAllAt(fd_, bytes, offset_, &error)) return Fail(std::move(error));
  offset_ += bytes.size();
  crc_ = Crc32cExtend(crc_, bytes.data(), bytes.size());
  region_length_ += bytes.size();
}

void CheckpointFileWriter::BeginLengthPrefixed() {
  if (!ok()) return;
  open_.push_back(OpenField{offset_, crc_, region_length_});
  // The length's place; its bytes enter the CRC at EndLengthPrefixed.
  std::string error;
  if (!WriteAllAt(fd_, std::string(8, '\0'), offset_, &error)) return Fail(std::move(error));
  offset_ += 8;
  crc_ = 0;  // the field's own bytes from here
  region_length_ = 0;
}

void CheckpointFileWriter::EndLengthPrefixed() {
  if (!ok()) return;
  if (open_.empty()) return Fail("checkpoint " + path_ + ": a length field ended twice");
  const OpenField field = open_.back();
  open_.pop_back();
  std::string length;
  PutFixed64(&length, region_length_);
  std::string error;
  if (!WriteAllAt(fd_, length, field.length_offset, &error)) return Fail(std::move(error));
  const uint32_t with_length = Crc32cCombine(field.crc_before, Crc32c(length), length.size());
  crc_ = Crc32cCombine(with_length, crc_, region_length_);
  region_length_ = field.length_before + length.size() + region_length_;
}

bool CheckpointFileWriter::Commit(std::string* error) {
  if (ok() && !open_.empty()) Fail("checkpoint " + path_ + ": a length field was not ended");
  if (ok()) {
    std::string length;
    PutFixed64(&length, region_length_);
    std::string header(kCheckpointMagic);
    PutFixed32(&header, Crc32cCombine(Crc32c(length), crc_, region_length_));
    header += length;
    std::string write_error;
    if (!WriteAllAt(fd_, header, 0, &write_error)) Fail(std::move(write_error));
  }
  if (ok() && ::fsync(fd_) != 0) Fail(ErrnoMessage("cannot fsync", tmp_));
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
  if (ok() && ::rename(tmp_.c_str(), path_.c_str()) != 0) Fail(ErrnoMessage("cannot rename to", path_));
  if (!ok()) {
    *error = error_;
    return false;  // the destructor removes the temporary file
  }
  committed_ = true;
  return SyncDirectory(dir_, error);
}

}  // namespace foreshock::store
