// The daemon's HTTP port: Prometheus exposition at /metrics, a liveness
// probe at /-/healthy, and an index page at /.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "prometheus/registry.h"

class CivetServer;

namespace foreshock::server {

class HttpServer {
 public:
  // `before_scrape` refreshes gauges that are cheaper to read than to track.
  HttpServer(std::shared_ptr<prometheus::Registry> registry, std::function<void()> before_scrape);
  ~HttpServer();
  // `listen` is HOST:PORT; port 0 picks a free port.
  absl::Status Start(const std::string& listen);
  void Stop();
  int port() const { return port_; }

 private:
  class MetricsHandler;
  class TextHandler;
  std::shared_ptr<prometheus::Registry> registry_;
  std::function<void()> before_scrape_;
  std::unique_ptr<CivetServer> server_;
  std::unique_ptr<MetricsHandler> metrics_handler_;
  std::unique_ptr<TextHandler> index_handler_;
  std::unique_ptr<TextHandler> healthy_handler_;
  int port_ = 0;
};

}  // namespace foreshock::server
