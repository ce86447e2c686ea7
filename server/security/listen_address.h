// The listen addresses of foreshockd (--listen for gRPC, --metrics_listen for
// HTTP), parsed once, and the rule that decides, per address, whether the
// daemon may serve on it. The servers bind exactly the parsed addresses, so
// what the rule judged is what gets served: no element of a comma list can
// escape the check or the TLS that covers the others (issue 34).
//
// Syntax, one or more comma-separated elements:
//   HOST:PORT      HOST an IPv4 address (a.b.c.d) or a host name
//   [IPV6]:PORT    IPv6 addresses only in brackets
//   unix:PATH      gRPC only: a Unix domain socket (local by construction)
// PORT is 0-65535 (0: the OS picks a free one). Anything else (an empty
// element, a missing or bad port, a suffix such as civetweb's "s"/"r",
// whitespace) is refused with the element named.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace foreshock::server {

struct ListenAddress {
  enum class Kind { kIpv4, kIpv6, kHostName, kUnix };
  Kind kind = Kind::kIpv4;
  std::string host;  // without brackets; for kUnix the socket path
  int port = 0;
  // Whether this address is served with TLS; set by PlanListeners.
  bool tls = false;

  // "a.b.c.d:PORT", "[v6]:PORT", "name:PORT" or "unix:PATH": what gRPC binds.
  std::string ToString() const;
  // Only reachable from this machine: 127.0.0.0/8, [::1], localhost, unix:.
  // Everything else (0.0.0.0, [::], other names) counts as reachable from
  // the network.
  bool loopback() const;
};

// Parses one flag's value. `flag` ("--listen") names it in errors.
absl::StatusOr<std::vector<ListenAddress>> ParseListenList(std::string_view flag,
                                                           std::string_view value,
                                                           bool allow_unix);

// What the daemon serves with: TLS (--tls_cert/--tls_key), tokens
// (--token_file) and whether --insecure was given.
struct ListenSecurity {
  bool tls = false;
  bool tokens = false;
  bool insecure = false;
};

struct ListenPlan {
  std::vector<ListenAddress> grpc;  // --listen
  std::vector<ListenAddress> http;  // --metrics_listen
  // One line per address served without TLS and tokens on a non-loopback
  // address under --insecure, to be logged at start.
  std::vector<std::string> warnings;
};

// The startup rule, per address of both flags: every address gets TLS when
// TLS is configured; an address that is not loopback needs TLS and tokens,
// unless `insecure`. INVALID_ARGUMENT for a malformed list, FAILED_PRECONDITION
// naming the first refused address; the daemon must then not start.
absl::StatusOr<ListenPlan> PlanListeners(std::string_view listen, std::string_view metrics_listen,
                                         const ListenSecurity& security);

// "127.0.0.1:9464,[::1]:9465": the addresses, as ToString writes them.
std::string JoinAddresses(const std::vector<ListenAddress>& addresses);

}  // namespace foreshock::server
