// The listen address parser and the per-address startup rule (issue 34):
// a table of good and bad --listen/--metrics_listen values, and the rule's
// decision for every element of a list.
#include "server/security/listen_address.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace foreshock::server {
namespace {

using Kind = ListenAddress::Kind;

struct Good {
  const char* value;
  std::vector<std::string> addresses;  // ToString of each
  std::vector<bool> loopback;
};

TEST(ListenAddressTest, ParsesGoodLists) {
  const std::vector<Good> table = {
      {"127.0.0.1:9464", {"127.0.0.1:9464"}, {true}},
      {"127.0.0.1:0", {"127.0.0.1:0"}, {true}},
      {"127.255.0.1:65535", {"127.255.0.1:65535"}, {true}},
      {"0.0.0.0:9464", {"0.0.0.0:9464"}, {false}},
      {"10.1.2.3:50051", {"10.1.2.3:50051"}, {false}},
      {"[::1]:9464", {"[::1]:9464"}, {true}},
      {"[::]:9464", {"[::]:9464"}, {false}},
      {"[fe80::1]:1", {"[fe80::1]:1"}, {false}},
      {"localhost:9464", {"localhost:9464"}, {true}},
      {"LOCALHOST:9464", {"LOCALHOST:9464"}, {true}},
      {"foreshockd.svc.cluster.local:9464", {"foreshockd.svc.cluster.local:9464"}, {false}},
      // Every element is parsed and judged on its own.
      {"127.0.0.1:9649,127.0.0.1:9650", {"127.0.0.1:9649", "127.0.0.1:9650"}, {true, true}},
      {"[::1]:1,0.0.0.0:2", {"[::1]:1", "0.0.0.0:2"}, {true, false}},
      {"127.0.0.1:1,[::]:2,localhost:3", {"127.0.0.1:1", "[::]:2", "localhost:3"},
       {true, false, true}},
  };
  for (const Good& good : table) {
    auto parsed = ParseListenList("--metrics_listen", good.value, /*allow_unix=*/false);
    ASSERT_TRUE(parsed.ok()) << good.value << ": " << parsed.status();
    ASSERT_EQ(parsed->size(), good.addresses.size()) << good.value;
    for (size_t i = 0; i < parsed->size(); ++i) {
      EXPECT_EQ((*parsed)[i].ToString(), good.addresses[i]) << good.value;
      EXPECT_EQ((*parsed)[i].loopback(), good.loopback[i]) << good.value << " #" << i;
    }
  }
}

TEST(ListenAddressTest, UnixSocketsOnlyForGrpc) {
  auto grpc = ParseListenList("--listen", "unix:/run/foreshock.sock", /*allow_unix=*/true);
  ASSERT_TRUE(grpc.ok()) << grpc.status();
  EXPECT_EQ((*grpc)[0].kind, Kind::kUnix);
  EXPECT_TRUE((*grpc)[0].loopback());
  EXPECT_EQ((*grpc)[0].ToString(), "unix:/run/foreshock.sock");
  auto http = ParseListenList("--metrics_listen", "unix:/run/foreshock.sock", false);
  ASSERT_FALSE(http.ok());
  EXPECT_NE(http.status().message().find("only supported by --listen"), std::string::npos);
}

struct Bad {
  const char* value;
  const char* reason;  // a piece of the error
};

TEST(ListenAddressTest, RefusesMalformedListsNamingTheElement) {
  const std::vector<Bad> table = {
      {"", "is empty"},
      {",", "address 1 '': empty address"},
      {"127.0.0.1:9464,", "address 2 '': empty address"},
      {"127.0.0.1:9464,,127.0.0.1:9465", "address 2"},
      {"127.0.0.1", "no :PORT"},
      {"9464", "no :PORT"},
      {"not an address", "whitespace"},
      {"127.0.0.1:9464, 127.0.0.1:9465", "whitespace"},
      {"junk", "no :PORT"},
      {":9464", "no host"},
      {"127.0.0.1:", "bad port ''"},
      {"127.0.0.1:http", "bad port 'http'"},
      {"127.0.0.1:65536", "bad port '65536'"},
      {"127.0.0.1:-1", "bad port '-1'"},
      {"127.0.0.1:+80", "bad port '+80'"},
      {"127.0.0.1:123456", "bad port"},
      {"127.0.0.1:9464s", "bad port '9464s'"},  // civetweb's TLS suffix is ours to add
      {"127.0.0.1:9464r", "bad port '9464r'"},  // nor a plain redirect port
      {"127.0.0.1:1,0.0.0.0:2s", "address 2"},
      {"256.0.0.1:1", "not an IPv4 address"},
      {"127.0.0.1.5:1", "not an IPv4 address"},
      {"127.1:1", "not an IPv4 address"},
      {"::1:9464", "in brackets"},
      {"[::1]", "no :PORT"},
      {"[::1]9464", "no :PORT"},
      {"[::1:9464", "without ']'"},
      {"[127.0.0.1]:1", "not an IPv6 address"},
      {"[zz::1]:1", "not an IPv6 address"},
      {"-bad-.example:1", "not a host name"},
      {"a..b:1", "not a host name"},
      {"under_score:1", "not a host name"},
      {"unix:", "unix: sockets are only supported"},
  };
  for (const Bad& bad : table) {
    auto parsed = ParseListenList("--metrics_listen", bad.value, /*allow_unix=*/false);
    ASSERT_FALSE(parsed.ok()) << "accepted '" << bad.value << "'";
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    const std::string message(parsed.status().message());
    EXPECT_NE(message.find("--metrics_listen"), std::string::npos) << message;
    EXPECT_NE(message.find(bad.reason), std::string::npos)
        << "'" << bad.value << "': " << message << " (want " << bad.reason << ")";
  }
  auto unix_empty = ParseListenList("--listen", "unix:", /*allow_unix=*/true);
  ASSERT_FALSE(unix_empty.ok());
  EXPECT_NE(unix_empty.status().message().find("without a path"), std::string::npos);
}

TEST(PlanListenersTest, TlsCoversEveryAddressOfBothPorts) {
  auto plan = PlanListeners("127.0.0.1:1,[::1]:2", "127.0.0.1:9649,127.0.0.1:9650",
                            {.tls = true, .tokens = true, .insecure = false});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->grpc.size(), 2u);
  ASSERT_EQ(plan->http.size(), 2u);
  for (const auto* list : {&plan->grpc, &plan->http}) {
    for (const ListenAddress& address : *list) EXPECT_TRUE(address.tls) << address.ToString();
  }
  auto plain = PlanListeners("127.0.0.1:1", "127.0.0.1:2,127.0.0.1:3", {});
  ASSERT_TRUE(plain.ok()) << plain.status();
  for (const ListenAddress& address : plain->http) EXPECT_FALSE(address.tls);
}

TEST(PlanListenersTest, EveryNonLoopbackElementNeedsTlsAndTokens) {
  struct Case {
    const char* listen;
    const char* metrics_listen;
    ListenSecurity security;
    const char* refused;  // nullptr: allowed
  };
  const std::vector<Case> table = {
      {"127.0.0.1:1", "127.0.0.1:2", {}, nullptr},
      {"127.0.0.1:1", "[::1]:2,localhost:3", {}, nullptr},
      // The issue's bypass: a loopback first element hid the second.
      {"127.0.0.1:1", "[::1]:2,0.0.0.0:3", {}, "--metrics_listen address 0.0.0.0:3"},
      {"[::1]:1,0.0.0.0:2", "127.0.0.1:3", {}, "--listen address 0.0.0.0:2"},
      {"127.0.0.1:1", "127.0.0.1:2,[::]:3", {}, "--metrics_listen address [::]:3"},
      {"0.0.0.0:1", "127.0.0.1:2", {.tls = true}, "--listen address 0.0.0.0:1"},
      {"0.0.0.0:1", "127.0.0.1:2", {.tokens = true}, "--listen address 0.0.0.0:1"},
      {"127.0.0.1:1", "myhost:2", {}, "--metrics_listen address myhost:2"},
      {"0.0.0.0:1", "0.0.0.0:2,[::]:3", {.tls = true, .tokens = true}, nullptr},
      {"0.0.0.0:1", "[::1]:2,0.0.0.0:3", {.insecure = true}, nullptr},
  };
  for (const Case& c : table) {
    auto plan = PlanListeners(c.listen, c.metrics_listen, c.security);
    const std::string where = std::string(c.listen) + " / " + c.metrics_listen;
    if (c.refused == nullptr) {
      EXPECT_TRUE(plan.ok()) << where << ": " << plan.status();
      continue;
    }
    ASSERT_FALSE(plan.ok()) << where;
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
    const std::string message(plan.status().message());
    EXPECT_NE(message.find(std::string("refusing ") + c.refused), std::string::npos)
        << where << ": " << message;
    EXPECT_NE(message.find("--insecure"), std::string::npos) << message;
  }
}

TEST(PlanListenersTest, InsecureWarnsForEachExposedAddress) {
  auto plan = PlanListeners("0.0.0.0:1", "[::1]:2,0.0.0.0:3", {.insecure = true});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->warnings.size(), 2u);
  EXPECT_EQ(plan->warnings[0], "--insecure: gRPC on 0.0.0.0:1 without TLS and tokens");
  EXPECT_EQ(plan->warnings[1], "--insecure: HTTP on 0.0.0.0:3 without TLS and tokens");
  auto tls_only = PlanListeners("127.0.0.1:1", "0.0.0.0:3", {.tls = true, .insecure = true});
  ASSERT_TRUE(tls_only.ok());
  ASSERT_EQ(tls_only->warnings.size(), 1u);
  EXPECT_EQ(tls_only->warnings[0], "--insecure: HTTPS on 0.0.0.0:3 without tokens");
}

TEST(PlanListenersTest, MalformedListIsRefusedBeforeTheRule) {
  auto plan = PlanListeners("127.0.0.1:1", "127.0.0.1:2,", {.insecure = true});
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  auto grpc = PlanListeners("127.0.0.1", "127.0.0.1:2", {.insecure = true});
  ASSERT_FALSE(grpc.ok());
  EXPECT_NE(grpc.status().message().find("--listen=127.0.0.1: address 1"), std::string::npos)
      << grpc.status();
}

}  // namespace
}  // namespace foreshock::server
