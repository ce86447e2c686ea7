// --alertmanager_url: checked at start (a daemon that cannot deliver its
// alerts must not look healthy) and never logged or shown with the
// user:password@ it may carry for basic auth.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace foreshock::server {

struct AlertmanagerUrl {
  // As given, without trailing '/': alerts go to url + "/api/v2/alerts".
  std::string url;
  // The URL with its userinfo (user:password@) replaced by "***@": the only
  // form that may appear in a log line, a status page or an error.
  std::string redacted;
};

// http:// or https://, a host (name, IPv4 or [IPv6]), an optional port
// 1-65535, optionally user:password@ before the host and a path after it; no
// query or fragment, whitespace, control or non-ASCII bytes, and '@' '/' '?'
// '#' in the userinfo only percent-encoded. INVALID_ARGUMENT otherwise, with
// a reason that quotes no part of the URL (it may hold a password).
absl::StatusOr<AlertmanagerUrl> ParseAlertmanagerUrl(std::string_view url);

// Replaces what may be userinfo in any string shaped like a URL (everything
// between "://" and the last '@' before a '?' or '#') by "***"; strings
// without "://" or '@' are returned unchanged. Errs on the side of hiding.
std::string RedactUrlUserinfo(std::string_view url);

}  // namespace foreshock::server
