// Files that hold secrets (--token_file): refused at start when other users
// can read or change them, so that a careless chmod never goes unnoticed.
#pragma once

#include <string>

#include "absl/status/status.h"

namespace foreshock::server {

// OK when `path` (after symlinks) is a regular file that others may neither
// read nor write, and its group may not write, nor read unless the group is
// one of the daemon's own (0600, 0400; 0440 with the pod's fsGroup). Otherwise
// FAILED_PRECONDITION naming `flag`, the path, the mode and the fix
// (chmod 600, or `override_flag` to accept it); NOT_FOUND when it cannot be
// examined. The error never contains the file's contents.
absl::Status CheckSecretFileMode(const std::string& flag, const std::string& path,
                                 const std::string& override_flag);

}  // namespace foreshock::server
