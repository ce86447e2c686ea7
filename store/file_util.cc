#include "store/file_util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace foreshock::store {

std::string ErrnoMessage(std::string_view what, const std::string& path) {
  return std::string(what) + " " + path + ": " + std::strerror(errno);
}

bool MakeDirectories(const std::string& path, std::string* error) {
  for (size_t slash = path.find('/', 1);; slash = path.find('/', slash + 1)) {
    const std::string prefix = path.substr(0, slash);
    if (!prefix.empty() && ::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      *error = ErrnoMessage("cannot create directory", prefix);
      return false;
    }
    if (slash == std::string::npos) break;
  }
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    *error = "not a directory: " + path;
    return false;
  }
  return true;
}

bool SyncDirectory(const std::string& path, std::string* error) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    *error = ErrnoMessage("cannot open directory", path);
    return false;
  }
  const bool ok = ::fsync(fd) == 0;
  if (!ok) *error = ErrnoMessage("cannot fsync directory", path);
  ::close(fd);
  return ok;
}

bool WriteAllAt(int fd, std::string_view bytes, uint64_t offset, std::string* error,
                int* error_number) {
  while (!bytes.empty()) {
    const ssize_t n = ::pwrite(fd, bytes.data(), bytes.size(), static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      if (error_number != nullptr) *error_number = errno;
      *error = std::string("write failed: ") + std::strerror(errno);
      return false;
    }
    bytes.remove_prefix(static_cast<size_t>(n));
    offset += static_cast<uint64_t>(n);
  }
  return true;
}

bool ReadExactlyAt(int fd, uint64_t offset, size_t size, std::string* out, std::string* error) {
  out->resize(size);
  size_t done = 0;
  while (done < size) {
    const ssize_t n =
        ::pread(fd, out->data() + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      *error = std::string("read failed: ") + std::strerror(errno);
      return false;
    }
    if (n == 0) {
      *error = "short read";
      return false;
    }
    done += static_cast<size_t>(n);
  }
  return true;
}

int OpenRegularFile(const std::string& path, int flags, std::string* error) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer.
  const int fd = ::open(path.c_str(), flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    *error = errno == ELOOP ? "not a regular file (a symbolic link): " + path
                            : ErrnoMessage("cannot open", path);
    return -1;
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    *error = ErrnoMessage("cannot stat", path);
    ::close(fd);
    return -1;
  }
  if (!S_ISREG(st.st_mode)) {
    *error = "not a regular file: " + path;
    ::close(fd);
    return -1;
  }
  // Regular files ignore O_NONBLOCK for reads and writes; clear it anyway.
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

bool IsRegularFile(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool ReadWholeFile(const std::string& path, std::string* out, std::string* error) {
  const int fd = OpenRegularFile(path, O_RDONLY, error);
  if (fd < 0) return false;
  struct stat st;
  bool ok = ::fstat(fd, &st) == 0;
  if (!ok) {
    *error = ErrnoMessage("cannot stat", path);
  } else {
    ok = ReadExactlyAt(fd, 0, static_cast<size_t>(st.st_size), out, error);
    if (!ok) *error += " in " + path;
  }
  ::close(fd);
  return ok;
}

FileHandle::~FileHandle() {
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace foreshock::store
