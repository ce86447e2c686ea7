// --alertmanager_url (issue 34): a table of good and bad URLs, checked at
// start; errors and logs never carry the userinfo.
#include "server/alerting/alertmanager_url.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace foreshock::server {
namespace {

TEST(AlertmanagerUrlTest, AcceptsGoodUrls) {
  struct Good {
    const char* url;
    const char* normalized;  // what alerts are POSTed under
    const char* redacted;    // what may be logged
  };
  const std::vector<Good> table = {
      {"http://127.0.0.1:9093", "http://127.0.0.1:9093", "http://127.0.0.1:9093"},
      {"http://127.0.0.1:9093/", "http://127.0.0.1:9093", "http://127.0.0.1:9093"},
      {"https://alertmanager.monitoring.svc:9093/am", "https://alertmanager.monitoring.svc:9093/am",
       "https://alertmanager.monitoring.svc:9093/am"},
      {"http://alertmanager-operated", "http://alertmanager-operated",
       "http://alertmanager-operated"},
      {"HTTP://am:9093", "HTTP://am:9093", "HTTP://am:9093"},
      {"http://[::1]:9093", "http://[::1]:9093", "http://[::1]:9093"},
      {"http://[::1]", "http://[::1]", "http://[::1]"},
      {"http://user:s3cret@am:9093", "http://user:s3cret@am:9093", "http://***@am:9093"},
      {"https://user:p%40ss%2Fw@am/prefix/", "https://user:p%40ss%2Fw@am/prefix",
       "https://***@am/prefix"},
      {"http://token@[::1]:9093", "http://token@[::1]:9093", "http://***@[::1]:9093"},
  };
  for (const Good& good : table) {
    auto parsed = ParseAlertmanagerUrl(good.url);
    ASSERT_TRUE(parsed.ok()) << good.url << ": " << parsed.status();
    EXPECT_EQ(parsed->url, good.normalized);
    EXPECT_EQ(parsed->redacted, good.redacted);
  }
}

TEST(AlertmanagerUrlTest, RefusesBadUrlsWithoutQuotingThem) {
  struct Bad {
    const char* url;
    const char* reason;
  };
  const std::vector<Bad> table = {
      {"not a url", "whitespace"},
      {"not-a-url", "must start with http:// or https://"},
      {"127.0.0.1:9093", "must start with http:// or https://"},
      {"ftp://am:9093", "must start with http:// or https://"},
      {"file:///etc/passwd", "must start with http:// or https://"},
      {"http://", "has no host"},
      {"http:///api", "has no host"},
      {"http://:9093", "has no host"},
      {"http://secretuser:secretpw@", "has no host"},
      {"http://secretuser:secretpw@:9093", "has no host"},
      {"http://am:", "port"},
      {"http://am:0", "port"},
      {"http://am:99999", "port"},
      {"http://am:9093x", "port"},
      {"http://secretuser:secretpw@am:x", "port"},
      {"http://am:9093/?q=1", "query or fragment"},
      {"http://am:9093#frag", "query or fragment"},
      {"http://am:9093 ", "whitespace"},
      {"http://a m:9093", "whitespace"},
      {"http://am\n:9093", "control character"},
      {"http://secretuser:secret@pw@am:9093", "more than one '@'"},
      {"http://secretuser:secret/pw@am:9093", "'@' after the host"},
      {"http://[::1:9093", "without ']'"},
      {"http://[nothex]:9093", "not an IPv6 address"},
      {"http://[::1]x:9093", "junk after"},
      {"http://-am-:9093", "not a host name"},
      {"http://a..m:9093", "not a host name"},
      {"http://am!:9093", "not a host name"},
  };
  for (const Bad& bad : table) {
    auto parsed = ParseAlertmanagerUrl(bad.url);
    ASSERT_FALSE(parsed.ok()) << "accepted '" << bad.url << "'";
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    const std::string message(parsed.status().message());
    EXPECT_EQ(message.rfind("--alertmanager_url: ", 0), 0u) << message;
    EXPECT_NE(message.find(bad.reason), std::string::npos)
        << "'" << bad.url << "': " << message << " (want " << bad.reason << ")";
    for (const char* secret : {"secretuser", "secretpw", "secret"}) {
      EXPECT_EQ(message.find(secret), std::string::npos) << message;
    }
  }
}

TEST(AlertmanagerUrlTest, RedactsWhatMayBeUserinfo) {
  EXPECT_EQ(RedactUrlUserinfo("http://am:9093"), "http://am:9093");
  EXPECT_EQ(RedactUrlUserinfo("http://u:p@am:9093/x"), "http://***@am:9093/x");
  // Malformed: hide everything up to the last '@', however it got there.
  EXPECT_EQ(RedactUrlUserinfo("http://u:p/w@am:9093"), "http://***@am:9093");
  EXPECT_EQ(RedactUrlUserinfo("http://u:p@w@am"), "http://***@am");
  EXPECT_EQ(RedactUrlUserinfo("http://am/?user=a@b"), "http://am/?user=a@b");
  EXPECT_EQ(RedactUrlUserinfo("no scheme u:p@host"), "no scheme u:p@host");
}

}  // namespace
}  // namespace foreshock::server
