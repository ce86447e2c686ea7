#include "store/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>

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

CheckpointStatus ReadCheckpointFile(const std::string& dir, std::string_view name,
                                    std::string* bytes, std::string* error) {
  const std::string path = CheckpointPath(dir, name);
  if (::access(path.c_str(), F_OK) != 0 && errno == ENOENT) return CheckpointStatus::kMissing;
  std::string contents;
  if (!ReadWholeFile(path, &contents, error)) return CheckpointStatus::kIoError;
  if (contents.size() < kCheckpointHeaderBytes ||
      std::string_view(contents).substr(0, 8) != kCheckpointMagic) {
    *error = "checkpoint " + path + ": bad header";
    return CheckpointStatus::kCorrupt;
  }
  const uint32_t crc = DecodeFixed32(contents.data() + 8);
  const uint64_t length = DecodeFixed64(contents.data() + 12);
  if (length != contents.size() - kCheckpointHeaderBytes) {
    *error = "checkpoint " + path + ": length " + std::to_string(length) + " but " +
             std::to_string(contents.size() - kCheckpointHeaderBytes) + " bytes follow";
    return CheckpointStatus::kCorrupt;
  }
  const std::string_view payload = std::string_view(contents).substr(kCheckpointHeaderBytes);
  if (CheckpointCrc(std::string_view(contents).substr(12, 8), payload) != crc) {
    *error = "checkpoint " + path + ": checksum mismatch";
    return CheckpointStatus::kCorrupt;
  }
  bytes->assign(payload);
  return CheckpointStatus::kOk;
}

}  // namespace foreshock::store
