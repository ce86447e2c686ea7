// Transport security and per-run authorization for foreshockd.
//
// Tokens: --token_file holds one grant per line,
//
//   # comment
//   <token> <run-prefix>[,<run-prefix>...] <right>[,<right>...]
//
// rights: ingest (open Ingest streams for the run), query (read the run over
// gRPC Query and /api/v1), metrics (scrape /metrics, which covers every run).
// A run-prefix of * matches every run. A token on several lines holds the
// union of the grants. Clients send `authorization: Bearer <token>` (gRPC
// metadata or the HTTP header). Tokens are never logged; a grant is named in
// logs by its line number in the file ("token@3").
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/registry.h"


namespace foreshock::server {

enum class Right { kIngest, kQuery, kMetrics };

// What one token may do. A null `const Principal*` from Authorizer::Authenticate
// never happens; without a token file there is no Authorizer and every call
// is allowed (see Authorizer::Allows with a null authorizer).
struct Principal {
  struct Grant {
    std::string prefix;  // "*": every run
    bool ingest = false;
    bool query = false;
    bool metrics = false;
  };
  std::string name;  // "token@<line>", safe to log
  std::vector<Grant> grants;
  bool Allows(std::string_view run, Right right) const;
};

class Authorizer {
 public:
  static absl::StatusOr<std::shared_ptr<const Authorizer>> LoadFile(const std::string& path);
  static absl::StatusOr<std::shared_ptr<const Authorizer>> Parse(std::string_view text);

  // `authorization` is the header/metadata value ("Bearer <token>"); empty
  // when absent. UNAUTHENTICATED when missing, malformed or unknown.
  absl::StatusOr<const Principal*> Authenticate(std::string_view authorization) const;
  size_t size() const { return principals_.size(); }

 private:
  std::unordered_map<std::string, Principal> principals_;  // by token
};

// Authorization counters: foreshock_auth_denied_total{api, reason}, reason
// unauthenticated or permission_denied; api grpc_ingest, grpc_query, http.
class AuthMetrics {
 public:
  explicit AuthMetrics(prometheus::Registry& registry);
  void Denied(std::string_view api, bool unauthenticated);

 private:
  prometheus::Family<prometheus::Counter>* family_;
};

// One request's view: null authorizer = no token file, everything allowed.
class AccessCheck {
 public:
  AccessCheck() = default;  // allows everything
  AccessCheck(const Authorizer* authorizer, AuthMetrics* metrics, std::string api,
              std::string_view authorization);
  // OK, or UNAUTHENTICATED when the token is missing/unknown.
  const absl::Status& authenticated() const { return authenticated_; }
  // OK, UNAUTHENTICATED, or PERMISSION_DENIED (counted).
  absl::Status Check(std::string_view run, Right right) const;
  // Without counting: whether `run` may be read/written (for filtering lists).
  bool Allows(std::string_view run, Right right) const;
  // Counts an UNAUTHENTICATED answer (call once per refused request).
  void CountUnauthenticated() const;
  // The principal's loggable name ("-" when open, "anonymous" when unauthenticated).
  std::string name() const;

 private:
  const Authorizer* authorizer_ = nullptr;
  AuthMetrics* metrics_ = nullptr;
  std::string api_;
  const Principal* principal_ = nullptr;
  absl::Status authenticated_;
};

struct TlsFiles {
  std::string cert;       // PEM server certificate (chain)
  std::string key;        // PEM private key
  std::string client_ca;  // PEM CA bundle; non-empty: client certificates required
  bool enabled() const { return !cert.empty(); }
};

// Reads a whole file; NOT_FOUND/PERMISSION_DENIED with the path on failure.
absl::StatusOr<std::string> ReadFileToString(const std::string& path);

}  // namespace foreshock::server
