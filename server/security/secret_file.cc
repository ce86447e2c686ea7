#include "server/security/secret_file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace foreshock::server {
namespace {

bool IsOwnGroup(gid_t gid) {
  if (gid == ::getegid()) return true;
  const int count = ::getgroups(0, nullptr);
  if (count <= 0) return false;
  std::vector<gid_t> groups(static_cast<size_t>(count));
  const int got = ::getgroups(count, groups.data());
  return got > 0 && std::find(groups.begin(), groups.begin() + got, gid) != groups.begin() + got;
}

}  // namespace

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
  // Group read is the daemon's own business when the group is one of its own
  // (a Kubernetes Secret is mode 0440, group = the pod's fsGroup); any other
  // group, group write and any access by others expose the tokens.
  mode_t exposed = info.st_mode & (S_IWGRP | S_IROTH | S_IWOTH);
  if ((info.st_mode & S_IRGRP) != 0 && !IsOwnGroup(info.st_gid)) exposed |= S_IRGRP;
  if (exposed != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: %s is mode %04o: readable or writable by %s, who could read or add bearer "
        "tokens. Make it the daemon user's alone (chmod 600 %s), or pass %s to accept it.",
        flag, path, info.st_mode & 07777,
        (exposed & (S_IROTH | S_IWOTH)) != 0 ? "every user" : "its group", path,
        override_flag));
  }
  return absl::OkStatus();
}

}  // namespace foreshock::server
