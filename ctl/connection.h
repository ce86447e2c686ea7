// foreshockctl's connection to foreshockd and its diagnostics: the global
// options every command shares, a channel that is connected or one line on
// stderr saying why not (refused, unresolved, TLS, silent), per-call
// deadlines and tokens, and what a failed call prints.
#pragma once

#include <grpc/support/log.h>
#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>

namespace foreshock::ctl {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailed = 1;
inline constexpr int kExitUsage = 2;  // also: the daemon cannot be reached

inline constexpr char kDefaultEndpoint[] = "127.0.0.1:50051";

struct Globals {
  std::string endpoint = kDefaultEndpoint;
  std::string endpoint_flag = "--endpoint";  // the option that set it, for error messages
  bool json = false;
  int64_t timeout_s = 10;
  // TLS (a daemon with --tls_cert): PEM contents, read at start.
  bool tls = false;
  std::string tls_ca, tls_cert, tls_key;
};

// The name of a gRPC status code ("NOT_FOUND").
std::string StatusCodeName(grpc::StatusCode code);
// gRPC's own log, less the line it writes for a failed TLS handshake (Connect
// reports that failure itself); install with gpr_set_log_function.
void GrpcLog(gpr_log_func_args* args);
// The daemon cannot be reached: one line naming the endpoint and why; returns
// kExitUsage.
int CannotReach(const Globals& g, const std::string& reason);
// CannotReach after --timeout_s without a connection.
int Unreachable(const Globals& g);
// gRPC's text for a failed connection, shortened for one line.
std::string ConnectionReason(const std::string& message);
// A channel that is connected, or null after printing why (exit 2).
std::shared_ptr<grpc::Channel> Connect(const Globals& g);
// The call's bearer token (if any) and --timeout_s deadline.
void SetDeadline(grpc::ClientContext& context, const Globals& g);
// Prints why `command`'s call of `method` failed; returns the exit status.
int RpcFailed(const std::string& command, const std::string& method, const grpc::Status& status,
              const Globals& g);

}  // namespace foreshock::ctl
