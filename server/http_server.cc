#include "server/http_server.h"

#include <CivetServer.h>
#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "prometheus/text_serializer.h"

namespace foreshock::server {
namespace {

void Reply(mg_connection* conn, int status, const char* content_type, const std::string& body) {
  mg_printf(conn,
            "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
            "Cache-Control: no-store\r\nConnection: close\r\n\r\n",
            status, mg_get_response_code_text(conn, status), content_type, body.size());
  mg_write(conn, body.data(), body.size());
}

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
  bool handleGet(CivetServer*, mg_connection* conn) override {
    if (allowed_) {
      const char* header = mg_get_header(conn, "Authorization");
      if (!allowed_(header ? header : "")) {
        Reply(conn, 401, "text/plain",
              "/metrics needs 'Authorization: Bearer <token>' with the metrics right\n");
        return true;
      }
    }
    if (before_scrape_) before_scrape_();
    std::ostringstream body;
    prometheus::TextSerializer().Serialize(body, registry_->Collect());
    Reply(conn, 200, "text/plain; version=0.0.4; charset=utf-8", body.str());
    return true;
  }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::function<void()> before_scrape_;
  std::function<bool(const std::string&)> allowed_;
};

class HttpServer::TextHandler final : public CivetHandler {
 public:
  TextHandler(std::string content_type, std::string body)
      : content_type_(std::move(content_type)), body_(std::move(body)) {}
  bool handleGet(CivetServer*, mg_connection* conn) override {
    Reply(conn, 200, content_type_.c_str(), body_);
    return true;
  }

 private:
  std::string content_type_;
  std::string body_;
};

class HttpServer::RouteHandler final : public CivetHandler {
 public:
  explicit RouteHandler(HttpHandler handler) : handler_(std::move(handler)) {}
  bool handleGet(CivetServer*, mg_connection* conn) override {
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
    Reply(conn, response.status, response.content_type.c_str(), response.body);
    return true;
  }

 private:
  HttpHandler handler_;
};

HttpServer::HttpServer(std::shared_ptr<prometheus::Registry> registry,
                       std::function<void()> before_scrape)
    : registry_(std::move(registry)), before_scrape_(std::move(before_scrape)) {}

HttpServer::~HttpServer() { Stop(); }

void HttpServer::AddRoute(std::string path, HttpHandler handler) {
  routes_.emplace_back(std::move(path), std::move(handler));
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
// rather than on the first HTTPS connection (server/civetweb_openssl3.cc).
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
        "binary was linked without server/civetweb_openssl3.cc");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status HttpServer::Start(const std::string& listen, const TlsFiles& tls) {
  std::vector<std::string> options = {"listening_ports", tls.enabled() ? listen + "s" : listen,
                                      "num_threads", "4", "enable_keep_alive", "no"};
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
  try {
    server_ = std::make_unique<CivetServer>(options);
  } catch (const CivetException& e) {
    return absl::UnavailableError(absl::StrCat("cannot serve HTTP", tls.enabled() ? "S" : "",
                                               " on ", listen, ": ", e.what()));
  }
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
  const std::vector<int> ports = server_->getListeningPorts();
  port_ = ports.empty() ? 0 : ports.front();
  return absl::OkStatus();
}

void HttpServer::Stop() {
  if (server_) {
    server_->close();
    server_.reset();
  }
}

}  // namespace foreshock::server
