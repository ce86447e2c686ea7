#include "server/security/auth.h"

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace foreshock::server {
namespace {
// Debian's Abseil has its own string_view type.
absl::string_view A(std::string_view s) { return absl::string_view(s.data(), s.size()); }
}  // namespace

bool Principal::Allows(std::string_view run, Right right) const {
  for (const Grant& grant : grants) {
    const bool has = right == Right::kIngest   ? grant.ingest
                     : right == Right::kQuery  ? grant.query
                                               : grant.metrics;
    if (!has) continue;
    if (grant.prefix == "*" || absl::StartsWith(A(run), grant.prefix)) return true;
  }
  return false;
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

absl::StatusOr<std::shared_ptr<const Authorizer>> Authorizer::LoadFile(const std::string& path) {
  auto text = ReadFileToString(path);
  if (!text.ok()) return text.status();
  auto parsed = Parse(*text);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", parsed.status().message()));
  }
  return parsed;
}

absl::StatusOr<std::shared_ptr<const Authorizer>> Authorizer::Parse(std::string_view text) {
  auto authorizer = std::make_shared<Authorizer>();
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(A(text), '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line.front() == '#') continue;
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    // Errors name the line, never the token.
    if (fields.size() != 3) {
      return absl::InvalidArgumentError(absl::StrCat(
          "line ", line_number, ": expected '<token> <run-prefix>[,...] <right>[,...]', got ",
          fields.size(), " fields"));
    }
    std::vector<Principal::Grant> grants;
    Principal::Grant rights;
    for (absl::string_view right : absl::StrSplit(fields[2], ',', absl::SkipEmpty())) {
      if (right == "ingest") {
        rights.ingest = true;
      } else if (right == "query") {
        rights.query = true;
      } else if (right == "metrics") {
        rights.metrics = true;
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            "line ", line_number, ": unknown right '", right, "' (ingest, query, metrics)"));
      }
    }
    for (absl::string_view prefix : absl::StrSplit(fields[1], ',', absl::SkipEmpty())) {
      Principal::Grant grant = rights;
      grant.prefix = std::string(prefix);
      grants.push_back(std::move(grant));
    }
    if (grants.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("line ", line_number, ": no run prefix"));
    }
    Principal& principal = authorizer->principals_[std::string(fields[0])];
    if (principal.name.empty()) principal.name = absl::StrCat("token@", line_number);
    for (auto& grant : grants) principal.grants.push_back(std::move(grant));
  }
  if (authorizer->principals_.empty()) {
    return absl::InvalidArgumentError("no tokens (every line is empty or a comment)");
  }
  return std::shared_ptr<const Authorizer>(std::move(authorizer));
}

absl::StatusOr<const Principal*> Authorizer::Authenticate(std::string_view authorization) const {
  if (authorization.empty()) {
    return absl::UnauthenticatedError("missing 'authorization: Bearer <token>'");
  }
  absl::string_view token = A(authorization);
  if (!absl::ConsumePrefix(&token, "Bearer ") && !absl::ConsumePrefix(&token, "bearer ")) {
    return absl::UnauthenticatedError("the authorization is not 'Bearer <token>'");
  }
  token = absl::StripAsciiWhitespace(token);
  auto it = principals_.find(std::string(token));
  if (it == principals_.end()) return absl::UnauthenticatedError("unknown token");
  return &it->second;
}

AuthMetrics::AuthMetrics(prometheus::Registry& registry)
    : family_(&prometheus::BuildCounter()
                   .Name("foreshock_auth_denied_total")
                   .Help("Requests refused by --token_file authorization, by API (grpc_ingest, "
                         "grpc_query, http) and reason (unauthenticated: token missing or "
                         "unknown; permission_denied: the token does not cover the run or right)")
                   .Register(registry)) {
  // Every API and reason at 0 from the start (known label values,
  // server/common/metrics.h). The APIs are the names AccessCheck's callers pass.
  for (const char* api : {"grpc_ingest", "grpc_query", "http"}) {
    for (const char* reason : {"unauthenticated", "permission_denied"}) {
      family_->Add({{"api", api}, {"reason", reason}});
    }
  }
}

void AuthMetrics::Denied(std::string_view api, bool unauthenticated) {
  family_
      ->Add({{"api", std::string(api)},
             {"reason", unauthenticated ? "unauthenticated" : "permission_denied"}})
      .Increment();
}

AccessCheck::AccessCheck(const Authorizer* authorizer, AuthMetrics* metrics, std::string api,
                         std::string_view authorization)
    : authorizer_(authorizer), metrics_(metrics), api_(std::move(api)) {
  if (authorizer_ == nullptr) return;
  auto principal = authorizer_->Authenticate(authorization);
  if (principal.ok()) {
    principal_ = *principal;
  } else {
    authenticated_ = principal.status();
  }
}

bool AccessCheck::Allows(std::string_view run, Right right) const {
  if (authorizer_ == nullptr) return true;
  return principal_ != nullptr && principal_->Allows(run, right);
}

absl::Status AccessCheck::Check(std::string_view run, Right right) const {
  if (authorizer_ == nullptr) return absl::OkStatus();
  if (!authenticated_.ok()) {
    CountUnauthenticated();
    return authenticated_;
  }
  if (principal_->Allows(run, right)) return absl::OkStatus();
  if (metrics_) metrics_->Denied(api_, /*unauthenticated=*/false);
  const char* what = right == Right::kIngest ? "ingest" : right == Right::kQuery ? "query" : "metrics";
  return absl::PermissionDeniedError(
      right == Right::kMetrics
          ? std::string("this token has no metrics right")
          : absl::StrCat("this token may not ", what, " run '", A(run), "'"));
}

void AccessCheck::CountUnauthenticated() const {
  if (metrics_) metrics_->Denied(api_, /*unauthenticated=*/true);
}

std::string AccessCheck::name() const {
  if (authorizer_ == nullptr) return "-";
  return principal_ ? principal_->name : "anonymous";
}

}  // namespace foreshock::server
