// foreshockctl's connection diagnostics (connection.h).
#include "ctl/connection.h"

#include <grpcpp/generic/generic_stub.h>

#include <cctype>
#include <chrono>
#include <cstdio>
#include <future>
#include <string_view>

#include "ctl/replay.h"

namespace foreshock::ctl {
namespace {

// Why a channel in TRANSIENT_FAILURE cannot connect. The channel state does
// not say, so a call that fails fast (wait_for_ready false, gRPC's default)
// asks: on a failed channel it never leaves this process and ends at once in
// UNAVAILABLE with the last connection error. It calls a method no server
// has, so should the channel connect meanwhile, the daemon only answers
// UNIMPLEMENTED.
grpc::Status Probe(const std::shared_ptr<grpc::Channel>& channel,
                   std::chrono::system_clock::time_point deadline) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_wait_for_ready(false);
  context.set_deadline(deadline);
  grpc::Slice empty;  // an empty message
  grpc::ByteBuffer request(&empty, 1), response;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&context, "/foreshock.v1.Query/ConnectivityProbe", grpc::StubOptions(), &request,
                 &response, [&done](grpc::Status status) { done.set_value(std::move(status)); });
  return done.get_future().get();
}

}  // namespace

std::string StatusCodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::UNKNOWN: return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED: return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS: return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    default: return "code " + std::to_string(static_cast<int>(code));
  }
}

// gRPC's own log, less the line it writes for a failed TLS handshake: Connect
// reports that failure itself, in its one line. Everything else is written
// as gRPC would (GRPC_VERBOSITY still sets what reaches here).
void GrpcLog(gpr_log_func_args* args) {
  const std::string_view file = args->file ? args->file : "";
  const std::string_view message = args->message ? args->message : "";
  if (file.ends_with("ssl_transport_security.cc") &&
      message.find("Handshake failed") != std::string_view::npos) {
    return;
  }
  const char severity = args->severity == GPR_LOG_SEVERITY_ERROR  ? 'E'
                        : args->severity == GPR_LOG_SEVERITY_INFO ? 'I'
                                                                  : 'D';
  std::fprintf(stderr, "%c %.*s:%d] %.*s\n", severity, static_cast<int>(file.size()), file.data(),
               args->line, static_cast<int>(message.size()), message.data());
}

// The daemon cannot be reached: one line naming the endpoint and why (exit 2).
int CannotReach(const Globals& g, const std::string& reason) {
  std::string hint_text;
  if (reason == "connection refused" || reason.rfind("no connection within", 0) == 0) {
    hint_text = " (is it running? " + g.endpoint_flag + " sets the address)";
  } else if (reason == "Socket closed" && !g.tls) {
    hint_text = " (a daemon with --tls_cert? --tls_ca connects with TLS)";
  } else if (reason == "Socket closed" && g.tls_cert.empty()) {
    hint_text = " (a daemon with --tls_client_ca? give --tls_cert and --tls_key)";
  }
  std::fprintf(stderr, "foreshockctl: cannot reach foreshockd at %s: %s%s\n", g.endpoint.c_str(),
               reason.c_str(), hint_text.c_str());
  return kExitUsage;
}

int Unreachable(const Globals& g) {
  return CannotReach(g, "no connection within " + std::to_string(g.timeout_s) + " s");
}

// gRPC's text for a failed connection, shortened for one line: "connection
// refused" for a port nothing listens on; otherwise the last connection
// error without gRPC's framing, e.g. "failed to connect to all addresses;
// last error: UNKNOWN: ipv4:127.0.0.1:1: Failed to connect to remote host:
// Connection refused" or "... Ssl handshake failed: ...".
std::string ConnectionReason(const std::string& message) {
  std::string lower = message;
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower.find("connection refused") != std::string::npos) return "connection refused";
  std::string reason = message;
  for (const std::string prefix : {"failed to connect to all addresses; last error: ", "UNKNOWN: ",
                                   "UNAVAILABLE: "}) {
    if (reason.rfind(prefix, 0) == 0) reason = reason.substr(prefix.size());
  }
  // The address again ("ipv4:127.0.0.1:50051: "): the line names the endpoint.
  for (const std::string scheme : {"ipv4:", "ipv6:", "unix:", "unix-abstract:"}) {
    const size_t end = reason.find(": ");
    if (reason.rfind(scheme, 0) == 0 && end != std::string::npos) reason = reason.substr(end + 2);
  }
  while (!reason.empty() && std::isspace(static_cast<unsigned char>(reason.back()))) {
    reason.pop_back();
  }
  return reason.empty() ? "unavailable" : reason;
}

// A channel that is connected, or null after printing why (exit 2). Waits up
// to --timeout_s while a connection is being made (a slow or silent
// endpoint), but not once one has failed: a refused connection, a name that
// does not resolve or a failed TLS handshake end it at once, without waiting
// for gRPC's reconnect backoff.
std::shared_ptr<grpc::Channel> Connect(const Globals& g) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(512 << 20);
  args.SetMaxSendMessageSize(-1);
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (g.tls) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = g.tls_ca;
    ssl.pem_private_key = g.tls_key;
    ssl.pem_cert_chain = g.tls_cert;
    credentials = grpc::SslCredentials(ssl);
  }
  auto channel = grpc::CreateCustomChannel(g.endpoint, credentials, args);
  const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(g.timeout_s);
  grpc_connectivity_state state = channel->GetState(/*try_to_connect=*/true);
  while (state != GRPC_CHANNEL_READY) {
    if (state == GRPC_CHANNEL_TRANSIENT_FAILURE || state == GRPC_CHANNEL_SHUTDOWN) {
      const grpc::Status probe = Probe(channel, deadline);
      if (probe.error_code() == grpc::StatusCode::UNAVAILABLE) {
        CannotReach(g, ConnectionReason(probe.error_message()));
        return nullptr;
      }
      if (probe.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
        Unreachable(g);
        return nullptr;
      }
      break;  // the daemon answered the probe: connected after all
    }
    if (!channel->WaitForStateChange(state, deadline)) {
      Unreachable(g);
      return nullptr;
    }
    state = channel->GetState(/*try_to_connect=*/true);
  }
  return channel;
}

void SetDeadline(grpc::ClientContext& context, const Globals& g) {
  AddCallToken(context);
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(g.timeout_s));
}

int RpcFailed(const std::string& command, const std::string& method, const grpc::Status& status,
              const Globals& g) {
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
    std::fprintf(stderr, "foreshockctl: foreshockd at %s is unavailable: %s\n",
                 g.endpoint.c_str(), ConnectionReason(status.error_message()).c_str());
    return kExitUsage;
  }
  if (status.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
    std::fprintf(stderr,
                 "foreshockctl %s: foreshockd at %s does not implement foreshock.v1.Query/%s "
                 "(an older daemon?)\n",
                 command.c_str(), g.endpoint.c_str(), method.c_str());
    return kExitFailed;
  }
  std::fprintf(stderr, "foreshockctl %s: %s: %s\n", command.c_str(),
               StatusCodeName(status.error_code()).c_str(), status.error_message().c_str());
  return kExitFailed;
}

}  // namespace foreshock::ctl
