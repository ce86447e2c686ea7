#include "server/http/http_server.h"

#include <CivetServer.h>
#include <arpa/inet.h>
#include <dirent.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "prometheus/text_serializer.h"

namespace foreshock::server {
namespace {

// A HEAD request gets the GET answer's status and headers (Content-Length
// included), without the body.
void Reply(mg_connection* conn, bool head, int status, const char* content_type,
           const std::string& body) {
  mg_printf(conn,
            "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
            "Cache-Control: no-store\r\nConnection: close\r\n\r\n",
            status, mg_get_response_code_text(conn, status), content_type, body.size());
  if (!head) mg_write(conn, body.data(), body.size());
}

constexpr char kTooManyConnections[] =
    "too many connections from this address (--http_max_connections_per_ip)\n";

// "a=1&b=x%20y" -> {a: 1, b: "x y"}.
std::map<std::string, std::string> ParseQuery(const char* query) {
  std::map<std::string, std::string> out;
  if (query == nullptr) return out;
  const std::string text(query);
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t end = text.find('&', pos);
    if (end == std::string::npos) end = text.size();
    const std::string pair = text.substr(pos, end - pos);
    if (!pair.empty()) {
      const size_t eq = pair.find('=');
      auto decode = [](const std::string& in) {
        std::string buffer(in.size() + 1, '\0');
        const int n = mg_url_decode(in.c_str(), static_cast<int>(in.size()), buffer.data(),
                                    static_cast<int>(buffer.size()), /*is_form_url_encoded=*/1);
        buffer.resize(n < 0 ? 0 : static_cast<size_t>(n));
        return buffer;
      };
      out[decode(pair.substr(0, eq))] = eq == std::string::npos ? "" : decode(pair.substr(eq + 1));
    }
    pos = end + 1;
  }
  return out;
}

}  // namespace

class HttpServer::MetricsHandler final : public CivetHandler {
 public:
  MetricsHandler(std::shared_ptr<prometheus::Registry> registry, std::function<void()> before_scrape,
                 std::function<bool(const std::string&)> allowed)
      : registry_(std::move(registry)),
        before_scrape_(std::move(before_scrape)),
        allowed_(std::move(allowed)) {}
  bool handleGet(CivetServer*, mg_connection* conn) override { return Serve(conn, false); }
  bool handleHead(CivetServer*, mg_connection* conn) override { return Serve(conn, true); }

 private:
  bool Serve(mg_connection* conn, bool head) {
    if (allowed_) {
      const char* header = mg_get_header(conn, "Authorization");
      if (!allowed_(header ? header : "")) {
        Reply(conn, head, 401, "text/plain",
              "/metrics needs 'Authorization: Bearer <token>' with the metrics right\n");
        return true;
      }
    }
    if (before_scrape_) before_scrape_();
    std::ostringstream body;
    prometheus::TextSerializer().Serialize(body, registry_->Collect());
    Reply(conn, head, 200, "text/plain; version=0.0.4; charset=utf-8", body.str());
    return true;
  }

  std::shared_ptr<prometheus::Registry> registry_;
  std::function<void()> before_scrape_;
  std::function<bool(const std::string&)> allowed_;
};

class HttpServer::TextHandler final : public CivetHandler {
 public:
  TextHandler(std::string content_type, std::string body)
      : content_type_(std::move(content_type)), body_(std::move(body)) {}
  bool handleGet(CivetServer*, mg_connection* conn) override {
    Reply(conn, false, 200, content_type_.c_str(), body_);
    return true;
  }
  bool handleHead(CivetServer*, mg_connection* conn) override {
    Reply(conn, true, 200, content_type_.c_str(), body_);
    return true;
  }

 private:
  std::string content_type_;
  std::string body_;
};

class HttpServer::RouteHandler final : public CivetHandler {
 public:
  explicit RouteHandler(HttpHandler handler) : handler_(std::move(handler)) {}
  bool handleGet(CivetServer*, mg_connection* conn) override { return Serve(conn, false); }
  bool handleHead(CivetServer*, mg_connection* conn) override { return Serve(conn, true); }

 private:
  bool Serve(mg_connection* conn, bool head) {
    const mg_request_info* info = mg_get_request_info(conn);
    HttpRequest request;
    request.path = info->local_uri ? info->local_uri : "";
    request.query = ParseQuery(info->query_string);
    if (const char* header = mg_get_header(conn, "Authorization")) request.authorization = header;
    HttpResponse response;
    try {
      response = handler_(request);
    } catch (const std::exception& e) {
      response = HttpResponse{500, "text/plain", std::string("internal error: ") + e.what()};
    }
    Reply(conn, head, response.status, response.content_type.c_str(), response.body);
    // The body first, then what it held (a query's lease, which may return
    // the freed memory to the kernel).
    std::string().swap(response.body);
    response.hold.reset();
    return true;
  }

  HttpHandler handler_;
};

HttpServer::HttpServer(std::shared_ptr<prometheus::Registry> registry,
                       std::function<void()> before_scrape)
    : registry_(std::move(registry)),
      before_scrape_(std::move(before_scrape)),
      // Exported from the start, so that rate() and alerts see 0, not absence.
      refused_(&prometheus::BuildCounter()
                    .Name("foreshock_http_connections_refused_total")
                    .Help("HTTP connections answered 503 and closed before their request was "
                          "read, because their client address already held "
                          "--http_max_connections_per_ip connections.")
                    .Register(*registry_)
                    .Add({})) {}

HttpServer::~HttpServer() { Stop(); }

void HttpServer::AddRoute(std::string path, HttpHandler handler) {
  routes_.emplace_back(std::move(path), std::move(handler));
}

namespace {

// civetweb 1.15 fills in the client's address and port before it calls
// init_connection, but mg_get_request_info() answers null until a request has
// been read. The fields are in the connection's mg_request_info, which
// civetweb 1.15 keeps 16 bytes into struct mg_connection (after its
// connection_type, protocol_type and request_state ints; the offset
// mg_get_request_info() itself adds). Checked on every connection: the
// mg_request_info found there must be the one whose conn_data
// mg_set_user_connection_data() writes, and its address must parse. Null
// where either fails (another civetweb build): then no address is limited.
const mg_request_info* EarlyRequestInfo(const mg_connection* conn) {
  constexpr size_t kRequestInfoOffset = 16;
  const auto* info = reinterpret_cast<const mg_request_info*>(
      reinterpret_cast<const char*>(conn) + kRequestInfoOffset);
  int probe = 0;
  mg_set_user_connection_data(conn, &probe);
  const void* written = *static_cast<void* const volatile*>(&info->conn_data);
  mg_set_user_connection_data(conn, nullptr);
  if (written != &probe) return nullptr;
  if (std::memchr(info->remote_addr, '\0', sizeof info->remote_addr) == nullptr) return nullptr;
  unsigned char parsed[sizeof(in6_addr)];
  if (inet_pton(AF_INET, info->remote_addr, parsed) != 1 &&
      inet_pton(AF_INET6, info->remote_addr, parsed) != 1) {
    return nullptr;
  }
  if (info->remote_port <= 0 || info->remote_port > 65535) return nullptr;
  return info;
}

// The port and printed address of a socket address; false for other families.
bool PortAndAddress(const sockaddr_storage& address, int* port, char* text, size_t size) {
  if (address.ss_family == AF_INET) {
    const auto& v4 = reinterpret_cast<const sockaddr_in&>(address);
    *port = ntohs(v4.sin_port);
    return inet_ntop(AF_INET, &v4.sin_addr, text, static_cast<socklen_t>(size)) != nullptr;
  }
  if (address.ss_family == AF_INET6) {
    const auto& v6 = reinterpret_cast<const sockaddr_in6&>(address);
    *port = ntohs(v6.sin6_port);
    return inet_ntop(AF_INET6, &v6.sin6_addr, text, static_cast<socklen_t>(size)) != nullptr;
  }
  return false;
}

// civetweb does not hand out a connection's socket; it is the one of this
// process whose peer is remote_addr:remote_port and whose local port is
// server_port. -1 when there is none (e.g. no /proc).
int FindSocket(const mg_request_info& info) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int found = -1;
  while (const dirent* entry = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || fd == dirfd(dir)) continue;
    sockaddr_storage peer{}, local{};
    socklen_t peer_size = sizeof peer, local_size = sizeof local;
    if (getpeername(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&peer), &peer_size) != 0 ||
        getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&local), &local_size) != 0) {
      continue;
    }
    char peer_text[INET6_ADDRSTRLEN], local_text[INET6_ADDRSTRLEN];
    int peer_port = 0, local_port = 0;
    if (PortAndAddress(peer, &peer_port, peer_text, sizeof peer_text) &&
        PortAndAddress(local, &local_port, local_text, sizeof local_text) &&
        peer_port == info.remote_port && local_port == info.server_port &&
        std::strcmp(peer_text, info.remote_addr) == 0) {
      found = static_cast<int>(fd);
      break;
    }
  }
  closedir(dir);
  return found;
}

HttpServer* ServerOf(const mg_connection* conn) {
  const mg_context* context = mg_get_context(conn);
  auto* civet = context ? static_cast<CivetServer*>(mg_get_user_data(context)) : nullptr;
  // CivetServer calls connection_close only once its context is set; a
  // connection counted before that would never be released.
  if (civet == nullptr || civet->getContext() == nullptr) return nullptr;
  return static_cast<HttpServer*>(const_cast<void*>(civet->getUserContext()));
}

}  // namespace

struct HttpServer::ConnectionSlot {
  std::string address;
  bool refused = false;  // over the limit, but its socket could not be closed at once
};

HttpServer::ConnectionSlot* HttpServer::Admit(const mg_connection* conn) {
  if (limits_.max_connections_per_ip <= 0) return nullptr;
  const mg_request_info* info = EarlyRequestInfo(conn);
  if (info == nullptr) {
    static std::atomic<bool> warned{false};
    if (!warned.exchange(true)) {
      spdlog::warn("HTTP: cannot read a new connection's client address from civetweb {}; "
                   "--http_max_connections_per_ip is not enforced", mg_version());
    }
    return nullptr;
  }
  auto slot = std::make_unique<ConnectionSlot>();
  slot->address = info->remote_addr;
  {
    std::lock_guard<std::mutex> lock(connections_mu_);
    int& open = connections_per_ip_[slot->address];
    if (open < limits_.max_connections_per_ip) {
      ++open;
      return slot.release();
    }
  }
  refused_->Increment();
  if (const int fd = FindSocket(*info); fd >= 0) {
    // Before the request is read, and without waiting: the client gets the
    // 503 if it reads, and the worker is free at once (civetweb reads EOF).
    // Under TLS the handshake is done and only civetweb can write; just close.
    if (!info->is_ssl) {
      // What the client already sent is dropped first: closing a socket with
      // unread data resets the connection, and the client might miss the 503.
      char discard[4096];
      for (int i = 0; i < 16 && ::recv(fd, discard, sizeof discard, MSG_DONTWAIT) > 0; ++i) {
      }
      const std::string reply =
          absl::StrCat("HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
                       "Content-Length: ", sizeof kTooManyConnections - 1,
                       "\r\nRetry-After: 1\r\nConnection: close\r\n\r\n", kTooManyConnections);
      (void)::send(fd, reply.data(), reply.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    }
    ::shutdown(fd, SHUT_RDWR);
    return nullptr;
  }
  // Fallback: answered 503 as soon as its request header is read (BeginRequest).
  slot->refused = true;
  return slot.release();
}

void HttpServer::Release(ConnectionSlot* slot) {
  if (slot == nullptr) return;
  if (!slot->refused) {
    std::lock_guard<std::mutex> lock(connections_mu_);
    auto it = connections_per_ip_.find(slot->address);
    if (it != connections_per_ip_.end() && --it->second <= 0) connections_per_ip_.erase(it);
  }
  delete slot;
}

int HttpServer::InitConnection(const mg_connection* conn, void** conn_data) {
  *conn_data = nullptr;
  if (HttpServer* server = ServerOf(conn)) *conn_data = server->Admit(conn);
  return 0;
}

void HttpServer::CloseConnection(const mg_connection* conn) {
  auto* slot = static_cast<ConnectionSlot*>(mg_get_user_connection_data(conn));
  if (slot == nullptr) return;
  mg_set_user_connection_data(conn, nullptr);
  if (HttpServer* server = ServerOf(conn)) {
    server->Release(slot);
  } else {
    delete slot;
  }
}

int HttpServer::BeginRequest(mg_connection* conn) {
  const auto* slot = static_cast<const ConnectionSlot*>(mg_get_user_connection_data(conn));
  if (slot == nullptr || !slot->refused) return 0;
  Reply(conn, false, 503, "text/plain", kTooManyConnections);
  return 1;
}

namespace {

// civetweb reads its certificate and key from one PEM file; the daemon takes
// them as two (like gRPC). An anonymous in-memory file joins them, so the key
// is never copied to disk. Closed once civetweb has loaded it.
class CombinedPem {
 public:
  static absl::StatusOr<CombinedPem> Create(const TlsFiles& tls) {
    auto cert = ReadFileToString(tls.cert);
    if (!cert.ok()) return cert.status();
    auto key = ReadFileToString(tls.key);
    if (!key.ok()) return key.status();
    const int fd = memfd_create("foreshockd-https-pem", MFD_CLOEXEC);
    if (fd < 0) return absl::InternalError(absl::StrCat("memfd_create: ", std::strerror(errno)));
    CombinedPem pem(fd);
    const std::string joined = *key + "\n" + *cert;
    for (size_t done = 0; done < joined.size();) {
      const ssize_t n = ::write(fd, joined.data() + done, joined.size() - done);
      if (n <= 0) return absl::InternalError(absl::StrCat("memfd write: ", std::strerror(errno)));
      done += static_cast<size_t>(n);
    }
    return pem;
  }
  CombinedPem(CombinedPem&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  ~CombinedPem() {
    if (fd_ >= 0) ::close(fd_);
  }
  std::string path() const { return absl::StrCat("/proc/self/fd/", fd_); }

 private:
  explicit CombinedPem(int fd) : fd_(fd) {}
  int fd_;
};

// civetweb finds OpenSSL only at run time; fail at start, with the reason,
// rather than on the first HTTPS connection (server/http/civetweb_openssl3.cc).
absl::Status CheckCivetwebTls() {
  if (mg_init_library(MG_FEATURES_TLS) == 0) {
    return absl::FailedPreconditionError(
        "HTTPS: civetweb could not load OpenSSL (it opens libssl.so and libcrypto.so, which "
        "the libssl-dev package provides)");
  }
  void* ssl = dlopen("libssl.so", RTLD_LAZY | RTLD_NOLOAD);
  const bool complete = ssl != nullptr && dlsym(ssl, "SSL_get_peer_certificate") != nullptr;
  if (ssl != nullptr) dlclose(ssl);
  if (!complete) {
    return absl::FailedPreconditionError(
        "HTTPS: civetweb's OpenSSL table lacks SSL_get_peer_certificate (OpenSSL 3); this "
        "binary was linked without server/http/civetweb_openssl3.cc");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status HttpServer::Start(const std::vector<ListenAddress>& listen, const TlsFiles& tls,
                              const HttpLimits& limits) {
  limits_ = limits;
  limits_.threads = std::clamp(limits_.threads, 1, 4096);
  limits_.request_timeout_ms = std::max(1, limits_.request_timeout_ms);
  if (listen.empty()) return absl::InvalidArgumentError("HTTP: no address to listen on");
  // civetweb takes TLS per port (a trailing "s"), so every address gets it
  // here, and one that would not is refused: never half the ports in plain.
  std::string ports;
  for (const ListenAddress& address : listen) {
    if (address.kind == ListenAddress::Kind::kUnix) {
      return absl::InvalidArgumentError(
          absl::StrCat("HTTP cannot listen on ", address.ToString()));
    }
    if (address.tls != tls.enabled()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "refusing to serve HTTP", address.tls ? "S" : "", " on ", address.ToString(),
          tls.enabled() ? " without TLS while --tls_cert is set" : " without a certificate"));
    }
    if (!ports.empty()) ports += ',';
    ports += address.ToString() + (address.tls ? "s" : "");
  }
  // Keep-alive off: a connection holds its worker only for one request.
  // request_timeout_ms bounds how long civetweb waits for a request (in
  // total, however slowly it trickles in).
  std::vector<std::string> options = {
      "listening_ports", ports,
      "num_threads", std::to_string(limits_.threads),
      "request_timeout_ms", std::to_string(limits_.request_timeout_ms),
      "enable_keep_alive", "no"};
  std::optional<CombinedPem> pem;
  if (tls.enabled()) {
    if (absl::Status status = CheckCivetwebTls(); !status.ok()) return status;
    auto created = CombinedPem::Create(tls);
    if (!created.ok()) return created.status();
    pem.emplace(*std::move(created));
    // TLS 1.2 and later, as gRPC.
    options.insert(options.end(),
                   {"ssl_certificate", pem->path(), "ssl_protocol_version", "4"});
    if (!tls.client_ca.empty()) {
      options.insert(options.end(),
                     {"ssl_ca_file", tls.client_ca, "ssl_verify_peer", "yes"});
    }
  }
  CivetCallbacks callbacks;
  callbacks.init_connection = &HttpServer::InitConnection;
  callbacks.connection_close = &HttpServer::CloseConnection;
  callbacks.begin_request = &HttpServer::BeginRequest;
  try {
    server_ = std::make_unique<CivetServer>(options, &callbacks, this);
  } catch (const CivetException& e) {
    return absl::UnavailableError(absl::StrCat("cannot serve HTTP", tls.enabled() ? "S" : "",
                                               " on ", JoinAddresses(listen), ": ", e.what()));
  }
  // What civetweb actually opened, checked against what was asked: one port
  // per address, each with TLS exactly when TLS is configured.
  const std::vector<mg_server_port> opened = server_->getListeningPortsFull();
  bool as_asked = opened.size() == listen.size();
  for (const mg_server_port& port : opened) {
    as_asked = as_asked && (port.is_ssl != 0) == tls.enabled() && port.is_redirect == 0;
  }
  if (!as_asked) {
    server_->close();
    server_.reset();
    return absl::InternalError(absl::StrCat(
        "HTTP: civetweb opened ", opened.size(), " port(s) for ", listen.size(),
        " address(es) of ", JoinAddresses(listen), ", not all ", tls.enabled() ? "HTTPS" : "HTTP",
        "; refusing to start"));
  }
  ports_.clear();
  for (const mg_server_port& port : opened) ports_.push_back(port.port);
  metrics_handler_ = std::make_unique<MetricsHandler>(registry_, before_scrape_, metrics_allowed_);
  index_handler_ = std::make_unique<TextHandler>(
      "text/html; charset=utf-8",
      "<!doctype html><title>foreshockd</title><h1>foreshockd</h1>"
      "<p>Prometheus metrics: <a href=\"/metrics\">/metrics</a></p>");
  healthy_handler_ = std::make_unique<TextHandler>("text/plain", "ok\n");
  server_->addHandler("/metrics", *metrics_handler_);
  server_->addHandler("/-/healthy", *healthy_handler_);
  bool has_index = false;
  for (const auto& [path, handler] : routes_) {
    route_handlers_.push_back(std::make_unique<RouteHandler>(handler));
    // civetweb matches prefixes; "$" anchors the exact path.
    server_->addHandler(path + "$", *route_handlers_.back());
    has_index |= path == "/";
  }
  if (!has_index) server_->addHandler("/$", *index_handler_);
  return absl::OkStatus();
}

void HttpServer::Stop() {
  if (server_) {
    server_->close();
    server_.reset();
  }
}

}  // namespace foreshock::server
