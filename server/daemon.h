// foreshockd as a library: the gRPC ingest service, the worker pool, the
// series store and the HTTP port, wired together. main() only parses flags
// and handles signals; tests run the same Daemon in process.
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <set>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "alerts/config.h"
#include "detectors/detector.h"
#include "server/security/auth.h"
#include "server/security/listen_address.h"
#include "server/http/http_server.h"
#include "server/ingest/memory_guard.h"
#include "server/ingest/state_budget.h"
#include "server/query/query_budget.h"
#include "server/pipeline/series_store.h"
#include "server/ingest/validation.h"
#include "store/durable_store.h"

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
class SeriesLimitSink;
class QueryBackend;
class QueryService;
class DaemonMetrics;
class DeliveryTracker;
class ExportSink;
class HttpServer;
class IngestService;
class RunLifecycle;
class RunTracker;
class WorkerPool;

struct DaemonOptions {
  static store::DurableStoreOptions MemoryOnlyStore() {
    store::DurableStoreOptions options;
    options.data_dir.clear();
    return options;
  }
  // Comma lists of addresses (server/security/listen_address.h).
  std::string listen = "127.0.0.1:50051";
  std::string metrics_listen = "127.0.0.1:9464";
  // The addresses both ports serve, each with its TLS decision, as
  // PlanListeners made it at start (foreshockd.cc). Unset: the Daemon plans
  // them from listen/metrics_listen, tls and authorizer, without --insecure,
  // and Start fails when that plan refuses.
  std::optional<ListenPlan> listen_plan;
  // Threads, request timeout and per-address connection bound of the HTTP
  // port (server/http/http_server.h).
  HttpLimits http_limits;
  int workers = 0;  // 0: one per core
  bool per_head_metrics = false;
  // --max_metrics_series: detector signal series in /metrics over all runs
  // (0: no bound); further new series are stored but not exported.
  int64_t max_metrics_series = 50000;
  size_t series_capacity = 4096;
  size_t max_queue_bytes = size_t{256} << 20;
  int max_message_bytes = 64 << 20;
  // HTTP/2 receive window per stream, BDP probing off (--grpc_stream_window_kb);
  // 0: gRPC's defaults.
  int grpc_stream_window_bytes = 1 << 20;
  // Resident memory at which ingest refuses new data (server/ingest/memory_guard.h).
  // 0: no bound.
  int64_t max_memory_bytes = 0;
  // Detector state one run's probes may retain (server/ingest/state_budget.h);
  // further probes that would grow it are rejected (state_limit). 0: no bound.
  int64_t max_state_bytes_per_run = 0;
  // Closed alert episodes kept over all runs (AlertHub::SetKeptEpisodeLimit).
  // 0: only the per-run bound.
  int64_t max_alert_episodes = 0;
  // Query answers (server/query/query_budget.h): the most one GetSeries
  // answer may hold, and what all requests in progress may hold together.
  // 0: no limit (each).
  int64_t max_query_bytes = int64_t{64} << 20;
  int64_t max_query_total_bytes = 0;
  IngestLimits limits;
  // Distinct (signal, layer, head) series a run may create; observations
  // of further new series are dropped and counted (server/pipeline/series_limit.h).
  // 0: no limit.
  int64_t max_series_per_run = 100000;
  detectors::DetectorOptions detector_options;
  alerts::AlertConfig alert_config = alerts::DefaultAlertConfig();
  std::string alertmanager_url;  // empty: no Alertmanager delivery
  std::chrono::milliseconds alertmanager_resend_interval{60000};
  // Directory for recordings of the raw ingest streams (record/recording.h),
  // one file per stream. Empty: nothing is recorded.
  std::string record_dir;
  // --record_max_mb / --record_max_age_h (0: no bound, kept forever).
  uint64_t record_max_bytes = 0;
  std::chrono::seconds record_max_age{0};
  // The durable series store (store/durable_store.h): data_dir and its
  // fsync/retention/segment settings. An empty data_dir keeps everything in
  // memory (series_capacity points per series) and nothing survives a restart.
  // store_options.cache_points_per_series bounds the memory of a durable store.
  store::DurableStoreOptions store_options = MemoryOnlyStore();
  // How often detector and alert-engine state is checkpointed into the store
  // (also at a clean shutdown); a restarted daemon continues from it.
  std::chrono::milliseconds checkpoint_interval{30000};
  // A run with no stream open for this long is forgotten (--forget_runs_idle_s,
  // RunLifecycle::ForgetIdleRuns); also limits.forget_runs_idle. Above 0.
  std::chrono::milliseconds forget_runs_idle{std::chrono::hours(24)};
  // TLS for both ports (server/security/auth.h). Empty cert: plaintext.
  TlsFiles tls;
  // Bearer-token authorization (--token_file). Null: every client is trusted.
  std::shared_ptr<const Authorizer> authorizer;
};

class Daemon {
 public:
  explicit Daemon(DaemonOptions options);
  ~Daemon();

  // Binds both ports and starts serving. Fails when the data directory could
  // not be opened (e.g. another daemon holds it).
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
  // Writes the detector and alert-engine checkpoints now (the daemon also
  // does so every checkpoint_interval and at Shutdown). False on failure.
  bool Checkpoint();

 private:
  DaemonOptions options_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<DaemonMetrics> metrics_;
  std::unique_ptr<AuthMetrics> auth_metrics_;
  std::unique_ptr<SeriesStore> store_;
  store::DurableSeriesStore* durable_ = nullptr;  // store_, when it is durable
  absl::Status init_status_;
  std::unique_ptr<RunTracker> runs_;
  std::unique_ptr<ExportSink> export_sink_;
  std::unique_ptr<AlertHub> alerts_;
  std::unique_ptr<FanoutSink> sink_;
  std::unique_ptr<SeriesLimitSink> series_limit_;  // in front of sink_
  std::unique_ptr<QueryBackend> backend_;
  std::unique_ptr<QueryService> query_;
  std::unique_ptr<AdmissionGate> gate_;
  std::unique_ptr<WorkerPool> pool_;
  std::unique_ptr<DeliveryTracker> delivery_;  // dedup marks of resent batches
  std::unique_ptr<RunLifecycle> lifecycle_;   // run ends and resumes; before ingest_
  std::unique_ptr<IngestService> ingest_;
  std::unique_ptr<MemoryGuard> memory_;
  std::unique_ptr<StateBudget> state_budget_;
  std::unique_ptr<QueryBudget> query_budget_;
  std::mutex state_gauges_mu_;
  std::mutex data_dir_bytes_mu_;
  std::chrono::steady_clock::time_point data_dir_bytes_at_{};  // last summed
  std::set<std::string> state_gauge_runs_;  // runs with a foreshock_run_state_bytes series
  std::unique_ptr<grpc::Server> grpc_server_;
  std::unique_ptr<HttpServer> http_;
  int grpc_port_ = 0;                 // the first of grpc_ports_
  std::vector<int> grpc_ports_;       // one per listen_plan.grpc address
  absl::Status listen_status_;        // a refused listen_plan: Start fails with it
  bool shut_down_ = false;

  void RestoreFromStore();
  // The open steps of multi-rank runs' scalars acknowledged after the last
  // detector checkpoint, read back from the ranks' own stored values.
  void RecoverOpenRankScalars();
  void ExportStateGauges();  // foreshock_run_state_bytes, at each scrape
  void ExportDataDirBytes();  // foreshock_data_dir_bytes, at a scrape, every 5 s at most
  void CheckpointLoop();
  // Forgets idle runs (RunLifecycle::ForgetIdleRuns) a few times per
  // forget_runs_idle, at least once a minute.
  void ForgetLoop();
  std::thread checkpoint_thread_;
  std::thread forget_thread_;
  std::mutex checkpoint_mu_;  // with checkpoint_cv_, also wakes ForgetLoop to stop
  std::condition_variable checkpoint_cv_;
  bool stop_checkpoints_ = false;
};

}  // namespace foreshock::server
