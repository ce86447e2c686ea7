#include "server/alerting/alertmanager_url.h"

#include <arpa/inet.h>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace foreshock::server {
namespace {

// Debian's Abseil has its own string_view type.
absl::string_view A(std::string_view s) { return absl::string_view(s.data(), s.size()); }

absl::Status Bad(absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("--alertmanager_url: ", why));
}

bool ValidHost(absl::string_view host) {
  if (host.empty() || host.size() > 253) return false;
  if (host.find_first_not_of("0123456789.") == absl::string_view::npos) {
    in_addr parsed;
    return inet_pton(AF_INET, std::string(host).c_str(), &parsed) == 1;
  }
  bool label_start = true;
  for (size_t i = 0; i < host.size(); ++i) {
    const char c = host[i];
    if (c == '.') {
      if (label_start || host[i - 1] == '-') return false;  // empty label or one ending in '-'
      label_start = true;
      continue;
    }
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_') return false;
    if (label_start && c == '-') return false;
    label_start = false;
  }
  return !label_start && host.back() != '-';
}

}  // namespace

absl::StatusOr<AlertmanagerUrl> ParseAlertmanagerUrl(std::string_view url_view) {
  const absl::string_view url = A(url_view);
  for (char c : url) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte <= 0x20 || byte >= 0x7f) {
      return Bad("contains whitespace, a control character or a non-ASCII byte (percent-encode it)");
    }
  }
  size_t scheme_length = 0;
  if (absl::StartsWithIgnoreCase(url, "http://")) {
    scheme_length = 7;
  } else if (absl::StartsWithIgnoreCase(url, "https://")) {
    scheme_length = 8;
  } else {
    return Bad("must start with http:// or https:// (e.g. http://127.0.0.1:9093)");
  }
  const absl::string_view rest = url.substr(scheme_length);
  const size_t authority_end = rest.find_first_of("/?#");
  absl::string_view authority = rest.substr(0, authority_end);
  const absl::string_view path =
      authority_end == absl::string_view::npos ? absl::string_view() : rest.substr(authority_end);
  if (path.find_first_of("?#") != absl::string_view::npos) {
    return Bad("has a query or fragment; give the base URL (the daemon appends /api/v2/alerts)");
  }
  if (absl::StrContains(path, '@') || authority.find('@') != authority.rfind('@')) {
    return Bad(
        "has more than one '@' or an '@' after the host; percent-encode '@' '/' '?' '#' in a "
        "user name or password (%40 %2F %3F %23)");
  }
  if (const size_t at = authority.find('@'); at != absl::string_view::npos) {
    authority.remove_prefix(at + 1);
  }
  absl::string_view host = authority;
  absl::string_view port;
  bool has_port = false;
  if (!authority.empty() && authority.front() == '[') {
    const size_t close = authority.find(']');
    if (close == absl::string_view::npos) return Bad("'[' without ']' around an IPv6 host");
    host = authority.substr(1, close - 1);
    in6_addr parsed;
    if (inet_pton(AF_INET6, std::string(host).c_str(), &parsed) != 1) {
      return Bad("the host in brackets is not an IPv6 address");
    }
    absl::string_view after = authority.substr(close + 1);
    if (!after.empty()) {
      if (after.front() != ':') return Bad("junk after the IPv6 host");
      port = after.substr(1);
      has_port = true;
    }
  } else {
    if (const size_t colon = authority.rfind(':'); colon != absl::string_view::npos) {
      host = authority.substr(0, colon);
      port = authority.substr(colon + 1);
      has_port = true;
    }
    if (host.empty()) return Bad("has no host");
    if (!ValidHost(host)) return Bad("the host is not a host name or an IPv4 address");
  }
  if (has_port) {
    int value = 0;
    bool digits = !port.empty() && port.size() <= 5;
    for (char c : port) {
      digits = digits && absl::ascii_isdigit(static_cast<unsigned char>(c));
      if (digits) value = value * 10 + (c - '0');
    }
    if (!digits || value < 1 || value > 65535) return Bad("the port is not a number 1-65535");
  }
  AlertmanagerUrl parsed;
  parsed.url = std::string(url);
  while (!parsed.url.empty() && parsed.url.back() == '/') parsed.url.pop_back();
  parsed.redacted = RedactUrlUserinfo(parsed.url);
  return parsed;
}

std::string RedactUrlUserinfo(std::string_view url_view) {
  const absl::string_view url = A(url_view);
  const size_t scheme_end = url.find("://");
  if (scheme_end == absl::string_view::npos) return std::string(url);
  const size_t start = scheme_end + 3;
  const size_t query = url.find_first_of("?#", start);
  const size_t at = url.substr(0, query).rfind('@');
  if (at == absl::string_view::npos || at < start) return std::string(url);
  return absl::StrCat(url.substr(0, start), "***", url.substr(at));
}

}  // namespace foreshock::server
