// Small POSIX helpers for the store. Each returns false and fills *error
// (with strerror) on failure; none throws.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace foreshock::store {

// Creates `path` and its missing parents.
bool MakeDirectories(const std::string& path, std::string* error);

// fsync on the directory itself, so that created, renamed or deleted entries
// survive a power loss.
bool SyncDirectory(const std::string& path, std::string* error);

// Writes all of `bytes` at `offset`, retrying short writes and EINTR. On
// failure *error_number (if given) gets the errno (ENOSPC, EIO, EROFS, ...).
bool WriteAllAt(int fd, std::string_view bytes, uint64_t offset, std::string* error,
                int* error_number = nullptr);

// Reads `size` bytes at `offset`; fails on a short read.
bool ReadExactlyAt(int fd, uint64_t offset, size_t size, std::string* out, std::string* error);

// Opens `path` only if it is a regular file: never follows a symbolic link,
// never blocks on a FIFO or a device. Returns the descriptor, or -1 with
// *error set.
int OpenRegularFile(const std::string& path, int flags, std::string* error);

// lstat says `path` is a regular file (not a link, FIFO, device or directory).
bool IsRegularFile(const std::string& path);

// Reads a whole regular file (OpenRegularFile).
bool ReadWholeFile(const std::string& path, std::string* out, std::string* error);

std::string ErrnoMessage(std::string_view what, const std::string& path);

// Closes the descriptor when the last owner goes away.
class FileHandle {
 public:
  explicit FileHandle(int fd) : fd_(fd) {}
  ~FileHandle();
  FileHandle(const FileHandle&) = delete;
  FileHandle& operator=(const FileHandle&) = delete;
  int fd() const { return fd_; }

 private:
  int fd_;
};

}  // namespace foreshock::store
