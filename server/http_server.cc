#include "server/http_server.h"

#include <CivetServer.h>

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
            status, status == 200 ? "OK" : "Error", content_type, body.size());
  mg_write(conn, body.data(), body.size());
}

}  // namespace

class HttpServer::MetricsHandler final : public CivetHandler {
 public:
  MetricsHandler(std::shared_ptr<prometheus::Registry> registry, std::function<void()> before_scrape)
      : registry_(std::move(registry)), before_scrape_(std::move(before_scrape)) {}
  bool handleGet(CivetServer*, mg_connection* conn) override {
    if (before_scrape_) before_scrape_();
    std::ostringstream body;
    prometheus::TextSerializer().Serialize(body, registry_->Collect());
    Reply(conn, 200, "text/plain; version=0.0.4; charset=utf-8", body.str());
    return true;
  }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::function<void()> before_scrape_;
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

HttpServer::HttpServer(std::shared_ptr<prometheus::Registry> registry,
                       std::function<void()> before_scrape)
    : registry_(std::move(registry)), before_scrape_(std::move(before_scrape)) {}

HttpServer::~HttpServer() { Stop(); }

absl::Status HttpServer::Start(const std::string& listen) {
  std::vector<std::string> options = {"listening_ports", listen, "num_threads", "4",
                                      "enable_keep_alive", "no"};
  try {
    server_ = std::make_unique<CivetServer>(options);
  } catch (const CivetException& e) {
    return absl::UnavailableError(absl::StrCat("cannot serve HTTP on ", listen, ": ", e.what()));
  }
  metrics_handler_ = std::make_unique<MetricsHandler>(registry_, before_scrape_);
  index_handler_ = std::make_unique<TextHandler>(
      "text/html; charset=utf-8",
      "<!doctype html><title>foreshockd</title><h1>foreshockd</h1>"
      "<p>Prometheus metrics: <a href=\"/metrics\">/metrics</a></p>");
  healthy_handler_ = std::make_unique<TextHandler>("text/plain", "ok\n");
  server_->addHandler("/metrics", *metrics_handler_);
  server_->addHandler("/-/healthy", *healthy_handler_);
  server_->addHandler("/$", *index_handler_);
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
