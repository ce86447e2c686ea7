#include "server/security/secret_file.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace foreshock::server {

absl::Status CheckSecretFileMode(const std::string& flag, const std::string& path,
                                 const std::string& override_flag) {
  struct stat info;
  // stat, not lstat: a Kubernetes Secret is a symlink to the file that counts.
  if (::stat(path.c_str(), &info) != 0) {
    return absl::NotFoundError(absl::StrCat(flag, ": cannot read ", path, ": ",
                                            std::strerror(errno)));
  }
  if (!S_ISREG(info.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(flag, ": ", path, " is not a regular file"));
  }
  constexpr mode_t kGroupOrOthers = S_IRGRP | S_IWGRP | S_IROTH | S_IWOTH;
  if ((info.st_mode & kGroupOrOthers) != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: %s is mode %04o: readable or writable by %s, who could read or add bearer "
        "tokens. Make it the daemon user's alone (chmod 600 %s), or pass %s to accept it.",
        flag, path, info.st_mode & 07777,
        (info.st_mode & (S_IROTH | S_IWOTH)) != 0 ? "every user" : "its group", path,
        override_flag));
  }
  return absl::OkStatus();
}

}  // namespace foreshock::server
