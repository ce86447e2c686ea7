// The daemon's HTTP port: Prometheus exposition at /metrics, a liveness
// probe at /-/healthy, and whatever routes the daemon adds (the JSON API under
// /api/v1/ and the web UI at /). Knows HTTP, not what the routes mean.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "prometheus/registry.h"
#include "server/auth.h"

class CivetServer;

namespace foreshock::server {

struct HttpRequest {
  std::string path;
  std::map<std::string, std::string> query;  // decoded; the last of repeated keys wins
  std::string authorization;                 // the Authorization header; never log it
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
};

using HttpHandler = std::function<HttpResponse(const HttpRequest&)>;

class HttpServer {
 public:
  // `before_scrape` refreshes gauges that are cheaper to read than to track.
  HttpServer(std::shared_ptr<prometheus::Registry> registry, std::function<void()> before_scrape);
  ~HttpServer();
  // GET `path` (exact match) answers with `handler`; call before Start.
  void AddRoute(std::string path, HttpHandler handler);
  // /metrics answers 401 unless `allowed(authorization header)`; call before Start.
  void GuardMetrics(std::function<bool(const std::string&)> allowed) {
    metrics_allowed_ = std::move(allowed);
  }
  // `listen` is HOST:PORT; port 0 picks a free port. With `tls` enabled the
  // port speaks HTTPS only (TLS 1.2+), and with tls.client_ca it requires a
  // client certificate signed by that CA (mutual TLS), as the gRPC port does.
  absl::Status Start(const std::string& listen, const TlsFiles& tls = {});
  void Stop();
  int port() const { return port_; }

 private:
  class MetricsHandler;
  class TextHandler;
  class RouteHandler;
  std::shared_ptr<prometheus::Registry> registry_;
  std::function<void()> before_scrape_;
  std::function<bool(const std::string&)> metrics_allowed_;
  std::unique_ptr<CivetServer> server_;
  std::unique_ptr<MetricsHandler> metrics_handler_;
  std::unique_ptr<TextHandler> index_handler_;
  std::unique_ptr<TextHandler> healthy_handler_;
  std::vector<std::pair<std::string, HttpHandler>> routes_;
  std::vector<std::unique_ptr<RouteHandler>> route_handlers_;
  int port_ = 0;
};

}  // namespace foreshock::server
