// The daemon's HTTP port: Prometheus exposition at /metrics, a liveness
// probe at /-/healthy, and whatever routes the daemon adds (the JSON API under
// /api/v1/ and the web UI at /). Knows HTTP, not what the routes mean.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "prometheus/counter.h"
#include "prometheus/registry.h"
#include "server/security/auth.h"
#include "server/security/listen_address.h"

class CivetServer;
struct mg_connection;

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
  // Kept until the body is written to the client (a query's memory lease).
  std::shared_ptr<void> hold;
};

using HttpHandler = std::function<HttpResponse(const HttpRequest&)>;

// What keeps a few clients from taking the HTTP port away from the others
// (flags --http_threads, --http_request_timeout_ms, --http_max_connections_per_ip).
// Each open connection holds one of `threads` worker threads from the moment
// a worker takes it until it is closed (connections beyond that wait in
// civetweb's queue). A connection that has not sent its complete request
// within `request_timeout_ms` is closed. A client address may hold at most
// `max_connections_per_ip` workers: a further connection from it is answered
// 503 and closed before its request is read, and counted in
// foreshock_http_connections_refused_total. So idle or slow connections from
// fewer than threads / max_connections_per_ip addresses cannot keep /metrics,
// /-/healthy and the API from answering.
struct HttpLimits {
  int threads = 32;
  int request_timeout_ms = 5000;
  int max_connections_per_ip = 8;  // 0: no limit
};

class HttpServer {
 public:
  // `before_scrape` refreshes gauges that are cheaper to read than to track.
  HttpServer(std::shared_ptr<prometheus::Registry> registry, std::function<void()> before_scrape);
  ~HttpServer();
  // GET and HEAD `path` (exact match) answer with `handler` (HEAD: the same
  // status and headers, no body); call before Start.
  void AddRoute(std::string path, HttpHandler handler);
  // /metrics answers 401 unless `allowed(authorization header)`; call before Start.
  void GuardMetrics(std::function<bool(const std::string&)> allowed) {
    metrics_allowed_ = std::move(allowed);
  }
  // Serves on every address of `listen` (server/security/listen_address.h;
  // port 0 picks a free port). With `tls` enabled every one speaks HTTPS only
  // (TLS 1.2+), and with tls.client_ca requires a client certificate signed by
  // that CA (mutual TLS), as the gRPC port does. Refuses to start when an
  // address's `tls` differs from `tls.enabled()`, or when civetweb did not
  // open exactly one port per address, each with TLS as configured.
  absl::Status Start(const std::vector<ListenAddress>& listen, const TlsFiles& tls = {},
                     const HttpLimits& limits = {});
  void Stop();
  // The first address's port, and every address's in order.
  int port() const { return ports_.empty() ? 0 : ports_.front(); }
  const std::vector<int>& ports() const { return ports_; }

 private:
  class MetricsHandler;
  class TextHandler;
  class RouteHandler;
  // civetweb callbacks: a connection is counted against its client address
  // when a worker takes it (before its request is read) and released when it
  // is closed.
  static int InitConnection(const mg_connection* conn, void** conn_data);
  static void CloseConnection(const mg_connection* conn);
  static int BeginRequest(mg_connection* conn);
  // The per-address slot a connection took (its conn_data), or nullptr when
  // it is not counted or was refused and closed.
  struct ConnectionSlot;
  ConnectionSlot* Admit(const mg_connection* conn);
  void Release(ConnectionSlot* slot);

  std::shared_ptr<prometheus::Registry> registry_;
  std::function<void()> before_scrape_;
  std::function<bool(const std::string&)> metrics_allowed_;
  std::unique_ptr<CivetServer> server_;
  std::unique_ptr<MetricsHandler> metrics_handler_;
  std::unique_ptr<TextHandler> index_handler_;
  std::unique_ptr<TextHandler> healthy_handler_;
  std::vector<std::pair<std::string, HttpHandler>> routes_;
  std::vector<std::unique_ptr<RouteHandler>> route_handlers_;
  std::vector<int> ports_;
  HttpLimits limits_;
  prometheus::Counter* refused_;
  std::mutex connections_mu_;
  std::unordered_map<std::string, int> connections_per_ip_;  // guarded by connections_mu_
};

}  // namespace foreshock::server
