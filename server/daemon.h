// foreshockd as a library: the gRPC ingest service, the worker pool, the
// series store and the HTTP port, wired together. main() only parses flags
// and handles signals; tests run the same Daemon in process.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "alerts/config.h"
#include "detectors/detector.h"
#include "server/series_store.h"
#include "server/validation.h"

namespace grpc {
class Server;
}
namespace prometheus {
class Registry;
}

namespace foreshock::server {

class AdmissionGate;
class AlertHub;
class FanoutSink;
class QueryService;
class DaemonMetrics;
class ExportSink;
class HttpServer;
class IngestService;
class RunTracker;
class WorkerPool;

struct DaemonOptions {
  std::string listen = "127.0.0.1:50051";
  std::string metrics_listen = "127.0.0.1:9464";
  int workers = 0;  // 0: one per core
  bool per_head_metrics = false;
  size_t series_capacity = 4096;
  size_t max_queue_bytes = size_t{256} << 20;
  int max_message_bytes = 64 << 20;
  IngestLimits limits;
  detectors::DetectorOptions detector_options;
  alerts::AlertConfig alert_config = alerts::DefaultAlertConfig();
  std::string alertmanager_url;  // empty: no Alertmanager delivery
  std::chrono::milliseconds alertmanager_resend_interval{60000};
  // Directory for recordings of the raw ingest streams (record/recording.h),
  // one file per stream. Empty: nothing is recorded.
  std::string record_dir;
};

class Daemon {
 public:
  explicit Daemon(DaemonOptions options);
  ~Daemon();

  // Binds both ports and starts serving.
  absl::Status Start();
  // Stops accepting streams (cancelling those still open after `grace`),
  // processes everything already accepted, then stops the HTTP port.
  void Shutdown(std::chrono::milliseconds grace);
  // Blocks until every accepted sample has been processed.
  void WaitIdle();

  int grpc_port() const { return grpc_port_; }
  int metrics_port() const;
  prometheus::Registry& registry() { return *registry_; }
  SeriesStore& store() { return *store_; }
  RunTracker& runs() { return *runs_; }
  AlertHub& alerts() { return *alerts_; }

 private:
  DaemonOptions options_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<DaemonMetrics> metrics_;
  std::unique_ptr<SeriesStore> store_;
  std::unique_ptr<RunTracker> runs_;
  std::unique_ptr<ExportSink> export_sink_;
  std::unique_ptr<AlertHub> alerts_;
  std::unique_ptr<FanoutSink> sink_;
  std::unique_ptr<QueryService> query_;
  std::unique_ptr<AdmissionGate> gate_;
  std::unique_ptr<WorkerPool> pool_;
  std::unique_ptr<IngestService> ingest_;
  std::unique_ptr<grpc::Server> grpc_server_;
  std::unique_ptr<HttpServer> http_;
  int grpc_port_ = 0;
  bool shut_down_ = false;
};

}  // namespace foreshock::server
