#include "server/daemon.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include <thread>

#include "absl/strings/str_cat.h"
#include "server/admission.h"
#include "server/alert_hub.h"
#include "server/query_service.h"
#include "server/export_sink.h"
#include "server/http_server.h"
#include "server/ingest_service.h"
#include "server/metrics.h"
#include "server/run_tracker.h"
#include "server/series_store.h"
#include "server/worker_pool.h"

namespace foreshock::server {

Daemon::Daemon(DaemonOptions options) : options_(std::move(options)) {
  if (options_.workers <= 0) {
    options_.workers = std::max(1u, std::thread::hardware_concurrency());
  }
  registry_ = std::make_shared<prometheus::Registry>();
  metrics_ = std::make_unique<DaemonMetrics>(*registry_, options_.per_head_metrics);
  store_ = std::make_unique<InMemorySeriesStore>(options_.series_capacity);
  runs_ = std::make_unique<RunTracker>(*metrics_);
  export_sink_ = std::make_unique<ExportSink>(*metrics_, *store_, *runs_);
  std::unique_ptr<AlertmanagerNotifier> notifier;
  if (!options_.alertmanager_url.empty()) {
    AlertmanagerOptions am;
    am.url = options_.alertmanager_url;
    am.resend_interval = options_.alertmanager_resend_interval;
    am.generator_url = "http://" + options_.metrics_listen + "/";
    notifier = std::make_unique<AlertmanagerNotifier>(am, *metrics_);
  }
  alerts_ = std::make_unique<AlertHub>(options_.alert_config, *metrics_, std::move(notifier));
  sink_ = std::make_unique<FanoutSink>(std::vector<ObservationSink*>{export_sink_.get(), alerts_.get()});
  query_ = std::make_unique<QueryService>(*alerts_, *metrics_);
  gate_ = std::make_unique<AdmissionGate>(options_.max_queue_bytes);
  pool_ = std::make_unique<WorkerPool>(options_.workers, options_.detector_options, *sink_,
                                       [gate = gate_.get()](size_t bytes) { gate->Release(bytes); });
  ingest_ = std::make_unique<IngestService>(
      options_.limits, *gate_, *pool_, *metrics_,
      [runs = runs_.get()](const foreshock::v1::Hello& hello) { runs->OnHello(hello); },
      options_.record_dir);
  http_ = std::make_unique<HttpServer>(registry_, [this] {
    metrics_->queue_bytes.Add({}).Set(static_cast<double>(gate_->in_flight_bytes()));
    alerts_->ExportCounters();
    for (int i = 0; i < pool_->size(); ++i) {
      metrics_->queue_depth.Add({{"worker", std::to_string(i)}})
          .Set(static_cast<double>(pool_->QueueDepth(i)));
    }
  });
}

Daemon::~Daemon() { Shutdown(std::chrono::milliseconds(0)); }

absl::Status Daemon::Start() {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options_.listen, grpc::InsecureServerCredentials(), &grpc_port_);
  builder.SetMaxReceiveMessageSize(options_.max_message_bytes);
  // gRPC sets SO_REUSEPORT by default: a second daemon on the same port would
  // silently share the traffic instead of failing to start.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.RegisterService(ingest_.get());
  builder.RegisterService(query_.get());
  grpc_server_ = builder.BuildAndStart();
  if (!grpc_server_ || grpc_port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot serve gRPC on ", options_.listen));
  }
  if (absl::Status status = http_->Start(options_.metrics_listen); !status.ok()) {
    grpc_server_->Shutdown();
    grpc_server_.reset();
    return status;
  }
  spdlog::info("foreshockd serving gRPC on {} (port {}), metrics on {} (port {}), {} workers",
               options_.listen, grpc_port_, options_.metrics_listen, http_->port(),
               pool_->size());
  return absl::OkStatus();
}

void Daemon::Shutdown(std::chrono::milliseconds grace) {
  if (shut_down_) return;
  shut_down_ = true;
  if (grpc_server_) {
    // Streams still open after the grace period are cancelled; their parked
    // batches are still dispatched once workers free room.
    grpc_server_->Shutdown(std::chrono::system_clock::now() + grace);
  }
  pool_->DrainAndStop();
  if (grpc_server_) grpc_server_->Wait();
  http_->Stop();
  spdlog::info("foreshockd stopped: {} samples processed", export_sink_->samples_processed());
}

void Daemon::WaitIdle() { gate_->WaitIdle(); }

int Daemon::metrics_port() const { return http_->port(); }

}  // namespace foreshock::server
