#include "server/security/listen_address.h"

#include <arpa/inet.h>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace foreshock::server {
namespace {

// Debian's Abseil has its own string_view type.
absl::string_view A(std::string_view s) { return absl::string_view(s.data(), s.size()); }

bool IsIpv4(const std::string& host) {
  in_addr parsed;
  return inet_pton(AF_INET, host.c_str(), &parsed) == 1;
}

bool IsIpv6(const std::string& host) {
  in6_addr parsed;
  return inet_pton(AF_INET6, host.c_str(), &parsed) == 1;
}

// RFC 1123 host name: dot-separated labels of letters, digits and '-', not
// starting or ending with '-'.
bool IsHostName(absl::string_view host) {
  if (host.empty() || host.size() > 253) return false;
  for (absl::string_view label : absl::StrSplit(host, '.')) {
    if (label.empty() || label.size() > 63 || label.front() == '-' || label.back() == '-') {
      return false;
    }
    for (char c : label) {
      if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-') return false;
    }
  }
  return true;
}

// 0-65535 in decimal digits only (no sign, no suffix such as civetweb's "s").
bool ParsePort(absl::string_view text, int* port) {
  if (text.empty() || text.size() > 5) return false;
  int value = 0;
  for (char c : text) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
    value = value * 10 + (c - '0');
  }
  if (value > 65535) return false;
  *port = value;
  return true;
}

absl::StatusOr<ListenAddress> ParseElement(absl::string_view element, bool allow_unix) {
  ListenAddress address;
  if (element.empty()) return absl::InvalidArgumentError("empty address");
  for (char c : element) {
    if (absl::ascii_isspace(static_cast<unsigned char>(c)) ||
        absl::ascii_iscntrl(static_cast<unsigned char>(c))) {
      return absl::InvalidArgumentError("whitespace or a control character in the address");
    }
  }
  if (absl::StartsWith(element, "unix:")) {
    if (!allow_unix) {
      return absl::InvalidArgumentError("unix: sockets are only supported by --listen (gRPC)");
    }
    address.kind = ListenAddress::Kind::kUnix;
    address.host = std::string(element.substr(5));
    if (address.host.empty()) return absl::InvalidArgumentError("unix: without a path");
    return address;
  }
  absl::string_view host;
  absl::string_view port;
  if (element.front() == '[') {
    const size_t close = element.find(']');
    if (close == absl::string_view::npos) {
      return absl::InvalidArgumentError("'[' without ']' (IPv6 addresses: [ADDRESS]:PORT)");
    }
    host = element.substr(1, close - 1);
    absl::string_view rest = element.substr(close + 1);
    if (rest.empty() || rest.front() != ':') {
      return absl::InvalidArgumentError("no :PORT after the IPv6 address ([ADDRESS]:PORT)");
    }
    port = rest.substr(1);
    address.kind = ListenAddress::Kind::kIpv6;
    address.host = std::string(host);
    if (!IsIpv6(address.host)) {
      return absl::InvalidArgumentError(absl::StrCat("'", host, "' is not an IPv6 address"));
    }
  } else {
    const size_t colon = element.rfind(':');
    if (colon == absl::string_view::npos) {
      return absl::InvalidArgumentError("no :PORT (expected HOST:PORT)");
    }
    host = element.substr(0, colon);
    port = element.substr(colon + 1);
    address.host = std::string(host);
    if (host.empty()) {
      return absl::InvalidArgumentError(
          "no host before :PORT (to listen on every interface, say 0.0.0.0 or [::])");
    }
    if (absl::StrContains(host, ':')) {
      return absl::InvalidArgumentError("IPv6 addresses go in brackets: [ADDRESS]:PORT");
    }
    // All digits and dots: meant as an IPv4 address, so it must be one.
    if (host.find_first_not_of("0123456789.") == absl::string_view::npos) {
      if (!IsIpv4(address.host)) {
        return absl::InvalidArgumentError(absl::StrCat("'", host, "' is not an IPv4 address"));
      }
      address.kind = ListenAddress::Kind::kIpv4;
    } else if (IsHostName(host)) {
      address.kind = ListenAddress::Kind::kHostName;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("'", host, "' is not a host name"));
    }
  }
  if (!ParsePort(port, &address.port)) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad port '", port, "' (a number 0-65535; 0 picks a free port)"));
  }
  return address;
}

}  // namespace

std::string ListenAddress::ToString() const {
  switch (kind) {
    case Kind::kUnix:
      return absl::StrCat("unix:", host);
    case Kind::kIpv6:
      return absl::StrCat("[", host, "]:", port);
    default:
      return absl::StrCat(host, ":", port);
  }
}

bool ListenAddress::loopback() const {
  switch (kind) {
    case Kind::kUnix:
      return true;
    case Kind::kIpv6: {
      in6_addr parsed;
      return inet_pton(AF_INET6, host.c_str(), &parsed) == 1 && IN6_IS_ADDR_LOOPBACK(&parsed);
    }
    case Kind::kIpv4:
      return absl::StartsWith(host, "127.");  // parsed: a valid dotted quad
    case Kind::kHostName:
      return absl::AsciiStrToLower(host) == "localhost";
  }
  return false;
}

absl::StatusOr<std::vector<ListenAddress>> ParseListenList(std::string_view flag,
                                                           std::string_view value,
                                                           bool allow_unix) {
  if (value.empty()) return absl::InvalidArgumentError(absl::StrCat(A(flag), " is empty"));
  std::vector<ListenAddress> addresses;
  int index = 0;
  for (absl::string_view element : absl::StrSplit(A(value), ',')) {
    ++index;
    auto address = ParseElement(element, allow_unix);
    if (!address.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(A(flag), "=", A(value), ": address ", index,
                                                     " '", element, "': ",
                                                     address.status().message()));
    }
    addresses.push_back(*std::move(address));
  }
  return addresses;
}

absl::StatusOr<ListenPlan> PlanListeners(std::string_view listen, std::string_view metrics_listen,
                                         const ListenSecurity& security) {
  ListenPlan plan;
  auto grpc = ParseListenList("--listen", listen, /*allow_unix=*/true);
  if (!grpc.ok()) return grpc.status();
  auto http = ParseListenList("--metrics_listen", metrics_listen, /*allow_unix=*/false);
  if (!http.ok()) return http.status();
  plan.grpc = *std::move(grpc);
  plan.http = *std::move(http);
  const bool secured = security.tls && security.tokens;
  const char* missing = security.tls      ? "tokens"
                        : security.tokens ? "TLS"
                                          : "TLS and tokens";
  struct Port {
    const char* flag;
    const char* protocol;  // as served: with TLS, HTTP is HTTPS
    const char* exposes;
    std::vector<ListenAddress>* addresses;
  };
  for (const Port& port :
       {Port{"--listen", "gRPC", "write and read every run", &plan.grpc},
        Port{"--metrics_listen", security.tls ? "HTTPS" : "HTTP",
             "read every run's series and alerts", &plan.http}}) {
    for (ListenAddress& address : *port.addresses) {
      // Every address of both ports, not only the first: TLS is all or nothing.
      address.tls = security.tls;
      if (address.loopback() || secured) continue;
      if (!security.insecure) {
        return absl::FailedPreconditionError(absl::StrCat(
            "refusing ", port.flag, " address ", address.ToString(),
            " (not loopback) without TLS (--tls_cert/--tls_key) and tokens (--token_file): "
            "anyone who can reach the port could ", port.exposes,
            ". Bind to 127.0.0.1, add TLS and tokens, or pass --insecure if the network is "
            "protected otherwise."));
      }
      plan.warnings.push_back(absl::StrCat("--insecure: ", port.protocol, " on ",
                                           address.ToString(), " without ", missing));
    }
  }
  return plan;
}

std::string JoinAddresses(const std::vector<ListenAddress>& addresses) {
  return absl::StrJoin(addresses, ",", [](std::string* out, const ListenAddress& address) {
    out->append(address.ToString());
  });
}

}  // namespace foreshock::server
