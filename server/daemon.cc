#include "server/daemon.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <filesystem>
#include <set>
#include <map>
#include <limits>
#include <thread>

#include "absl/strings/str_cat.h"
#include "server/alerting/alertmanager_url.h"
#include "server/ingest/admission.h"
#include "server/alerting/alert_hub.h"
#include "server/query/query_service.h"
#include "server/pipeline/export_sink.h"
#include "server/query/http_api.h"
#include "server/http/http_server.h"
#include "server/query/query_backend.h"
#include "server/ingest/ingest_service.h"
#include "server/common/metrics.h"
#include "wire/rank_scalars.h"
#include "server/pipeline/run_lifecycle.h"
#include "server/pipeline/run_tracker.h"
#include "server/common/clock.h"
#include "server/pipeline/series_limit.h"
#include "server/pipeline/series_store.h"
#include "server/pipeline/worker_pool.h"

namespace foreshock::server {

// The web UI (ui/index.html), embedded at build time (cmake/embed_file.cmake).
extern const char kWebUiHtml[];
extern const size_t kWebUiHtmlSize;

namespace {
constexpr std::string_view kHelloEvents = "hello";
constexpr std::string_view kAlertEvents = "alert";
constexpr std::string_view kDetectorCheckpoint = "detectors";
constexpr std::string_view kAlertCheckpoint = "alerts";

StreamRecorderOptions RecordingOptions(const DaemonOptions& options) {
  StreamRecorderOptions recording(options.record_dir);
  recording.max_total_bytes = options.record_max_bytes;
  recording.max_age = options.record_max_age;
  return recording;
}
}  // namespace

Daemon::Daemon(DaemonOptions options) : options_(std::move(options)) {
  options_.limits.max_message_bytes = options_.max_message_bytes;
  options_.limits.forget_runs_idle = options_.forget_runs_idle;  // one rule for both
  if (!options_.listen_plan) {
    auto plan = PlanListeners(options_.listen, options_.metrics_listen,
                              {.tls = options_.tls.enabled(),
                               .tokens = options_.authorizer != nullptr,
                               .insecure = false});
    if (plan.ok()) {
      options_.listen_plan = *std::move(plan);
    } else {
      listen_status_ = plan.status();
      options_.listen_plan.emplace();
    }
  }
  if (options_.workers <= 0) {
    options_.workers = std::max(1u, std::thread::hardware_concurrency());
  }
  registry_ = std::make_shared<prometheus::Registry>();
  metrics_ = std::make_unique<DaemonMetrics>(*registry_, options_.per_head_metrics,
                                             options_.max_metrics_series);
  metrics_->runs_forgotten_total.Add({});  // 0 from the start
  if (!options_.store_options.data_dir.empty()) {
    auto durable = store::DurableSeriesStore::Open(options_.store_options);
    if (durable.ok()) {
      durable_ = durable->get();
      store_ = *std::move(durable);
    } else {
      init_status_ = durable.status();
    }
  }
  if (!store_) store_ = std::make_unique<InMemorySeriesStore>(options_.series_capacity);
  runs_ = std::make_unique<RunTracker>(*metrics_);
  export_sink_ = std::make_unique<ExportSink>(*metrics_, *store_, *runs_);
  std::unique_ptr<AlertmanagerNotifier> notifier;
  if (!options_.alertmanager_url.empty()) {
    AlertmanagerOptions am;
    am.url = options_.alertmanager_url;
    am.resend_interval = options_.alertmanager_resend_interval;
    // Where a human finds the source: the first HTTP address, as served.
    if (!options_.listen_plan->http.empty()) {
      const ListenAddress& http = options_.listen_plan->http.front();
      am.generator_url = absl::StrCat(http.tls ? "https://" : "http://", http.ToString(), "/");
    }
    notifier = std::make_unique<AlertmanagerNotifier>(am, *metrics_);
  }
  alerts_ = std::make_unique<AlertHub>(options_.alert_config, *metrics_, std::move(notifier));
  alerts_->SetKeptEpisodeLimit(static_cast<size_t>(options_.max_alert_episodes));
  sink_ = std::make_unique<FanoutSink>(std::vector<ObservationSink*>{export_sink_.get(), alerts_.get()});
  backend_ = std::make_unique<QueryBackend>(*store_, *alerts_, *runs_);
  query_budget_ = std::make_unique<QueryBudget>(options_.max_query_bytes,
                                                options_.max_query_total_bytes, *metrics_);
  backend_->SetBudget(query_budget_.get());
  query_ = std::make_unique<QueryService>(*alerts_, *metrics_, *backend_);
  gate_ = std::make_unique<AdmissionGate>(options_.max_queue_bytes);
  series_limit_ =
      std::make_unique<SeriesLimitSink>(*sink_, options_.max_series_per_run, *metrics_);
  pool_ = std::make_unique<WorkerPool>(options_.workers, options_.detector_options, *series_limit_,
                                       [gate = gate_.get()](size_t bytes) { gate->Release(bytes); });
  ingest_ = std::make_unique<IngestService>(
      options_.limits, *gate_, *pool_, *metrics_,
      [runs = runs_.get(), store = store_.get()](const foreshock::v1::Hello& hello) {
        runs->OnHello(hello);
        // Best effort: the Hello log is for ListRuns after a restart; a store
        // that refuses writes says so through its own health and counters.
        store->AppendEvent(kHelloEvents, hello.SerializeAsString()).IgnoreError();
      },
      RecordingOptions(options_));
  delivery_ = std::make_unique<DeliveryTracker>(*store_);
  ingest_->SetDeliveryTracker(delivery_.get());
  ingest_->SetStore(store_.get());
  lifecycle_ = std::make_unique<RunLifecycle>(store_.get(), alerts_.get(), runs_.get());
  ingest_->SetLifecycle(lifecycle_.get());
  backend_->SetLifecycle(lifecycle_.get());
  memory_ = std::make_unique<MemoryGuard>(options_.max_memory_bytes);
  // Accepted and not processed yet, or parked waiting for the queue.
  memory_->SetInFlight([gate = gate_.get()] {
    return static_cast<int64_t>(gate->in_flight_bytes() + gate->waiting());
  });
  ingest_->SetMemoryGuard(memory_.get());
  state_budget_ = std::make_unique<StateBudget>(options_.max_state_bytes_per_run);
  // What keeps state per run, told by the lifecycle when a run restarts,
  // ends or is forgotten: the detectors first, then the budget that counts
  // their state.
  lifecycle_->AddStateOwner(pool_.get());
  lifecycle_->AddStateOwner(state_budget_.get());
  // And, when a run is forgotten, what counts it or exports it.
  lifecycle_->AddStateOwner(series_limit_.get());
  lifecycle_->AddStateOwner(runs_.get());
  lifecycle_->AddStateOwner(ingest_.get());
  ingest_->SetStateBudget(state_budget_.get());
  http_ = std::make_unique<HttpServer>(registry_, [this] {
    metrics_->queue_bytes.Add({}).Set(static_cast<double>(gate_->in_flight_bytes()));
    metrics_->memory_resident_bytes.Add({}).Set(static_cast<double>(memory_->resident_bytes()));
    metrics_->memory_limit_bytes.Add({}).Set(static_cast<double>(memory_->limit_bytes()));
    metrics_->memory_reserved_bytes.Add({}).Set(static_cast<double>(memory_->reserved_bytes()));
    alerts_->ExportCounters();
    ExportStateGauges();
    ExportDataDirBytes();
    for (int i = 0; i < pool_->size(); ++i) {
      metrics_->queue_depth.Add({{"worker", std::to_string(i)}})
          .Set(static_cast<double>(pool_->QueueDepth(i)));
    }
  });
  if (options_.authorizer) {
    auth_metrics_ = std::make_unique<AuthMetrics>(*registry_);
    const Authorizer* authorizer = options_.authorizer.get();
    ingest_->SetAuthorizer(authorizer, auth_metrics_.get());
    query_->SetAuthorizer(authorizer, auth_metrics_.get());
    http_->GuardMetrics([authorizer, metrics = auth_metrics_.get()](const std::string& header) {
      const AccessCheck access(authorizer, metrics, "http", header);
      return access.Check("", Right::kMetrics).ok();
    });
  }
  AddApiRoutes(*http_, *backend_, options_.authorizer.get(), auth_metrics_.get());
  http_->AddRoute("/", [](const HttpRequest&) {
    return HttpResponse{200, "text/html; charset=utf-8", std::string(kWebUiHtml, kWebUiHtmlSize)};
  });
  if (init_status_.ok()) RestoreFromStore();
  // Recovered runs count toward --max_runs and their tenant's share (as
  // before the restart, or one tenant adding a run per restart would fill
  // --max_runs for everyone); --max_step_jump counts from their last step.
  for (const RunTracker::RunSummary& run : runs_->Runs()) {
    ingest_->NoteKnownRun(run.run, run.last_step, run.job, lifecycle_->TenantOf(run.run));
  }
  if (init_status_.ok()) delivery_->Restore();
  alerts_->SetEventLog([store = store_.get()](const foreshock::v1::AlertEvent& event) {
    // Best effort, as above: alert state itself is checkpointed separately.
    store->AppendEvent(kAlertEvents, event.SerializeAsString()).IgnoreError();
  });
}

void Daemon::ExportStateGauges() {
  std::lock_guard<std::mutex> lock(state_gauges_mu_);
  std::set<std::string> runs;
  for (const auto& [run, bytes] : state_budget_->Runs()) {
    metrics_->run_state_bytes.Add({{"run", run}}).Set(static_cast<double>(bytes));
    runs.insert(run);
  }
  // A run whose state was freed (ended, new attempt) leaves the family.
  for (const std::string& run : state_gauge_runs_) {
    if (!runs.count(run)) metrics_->run_state_bytes.Remove(&metrics_->run_state_bytes.Add({{"run", run}}));
  }
  state_gauge_runs_ = std::move(runs);
}

void Daemon::ExportDataDirBytes() {
  std::lock_guard<std::mutex> lock(data_dir_bytes_mu_);
  const auto now = std::chrono::steady_clock::now();
  // A directory walk per scrape is cheap but not free: a few hundred files
  // at most (segments of 64 MiB, checkpoints), summed every 5 s at most.
  if (data_dir_bytes_at_ != std::chrono::steady_clock::time_point{} &&
      now - data_dir_bytes_at_ < std::chrono::seconds(5)) {
    return;
  }
  data_dir_bytes_at_ = now;
  uint64_t bytes = 0;
  if (durable_ != nullptr) {
    std::error_code error;
    for (std::filesystem::recursive_directory_iterator it(
             options_.store_options.data_dir,
             std::filesystem::directory_options::skip_permission_denied, error), end;
         !error && it != end; it.increment(error)) {
      std::error_code size_error;
      if (it->is_regular_file(size_error)) {
        const uintmax_t size = it->file_size(size_error);
        if (!size_error) bytes += size;
      }
    }
  }
  metrics_->data_dir_bytes.Add({}).Set(static_cast<double>(bytes));
}

void Daemon::RestoreFromStore() {
  // Runs: their Hellos (job name, model shape) and how far they got.
  for (const std::string& bytes : store_->Events(kHelloEvents)) {
    foreshock::v1::Hello hello;
    if (hello.ParseFromString(bytes)) runs_->OnHello(hello);
  }
  for (const store::RunInfo& run : store_->ListRuns()) runs_->OnStep(run.run, run.last_step);
  // Their signal gauges, as they were before the restart (docs/OPERATIONS.md).
  if (const size_t gauges = export_sink_->RestoreGauges(); gauges > 0) {
    spdlog::info("restored {} signal gauge(s) from the store", gauges);
  }
  // Detector and alert-engine state, so that detection continues where it was.
  // Mapped, not read into the heap: the detector state may be near
  // --max_memory_mb, and holding it twice at a restart is what would get
  // the daemon killed.
  if (auto state = store_->ReadLargeCheckpoint(kDetectorCheckpoint)) {
    if (pool_->RestoreDetectorState(state->view())) {
      spdlog::info("restored detector state from the checkpoint ({} bytes)", state->size());
    } else {
      spdlog::warn("the detector checkpoint is unusable; detectors start empty");
    }
  }
  if (auto state = store_->ReadLargeCheckpoint(kAlertCheckpoint)) {
    if (alerts_->RestoreState(state->view())) {
      spdlog::info("restored alert state from the checkpoint: {} active alert(s)",
                   alerts_->Alerts("", false).size());
    } else {
      spdlog::warn("the alert checkpoint is unusable; the alert engine starts empty");
    }
  }
  // Runs that ended or resumed after those checkpoints (server/pipeline/run_lifecycle.h).
  lifecycle_->Restore();
  RecoverOpenRankScalars();
  // The state budget counts what the detectors hold now, as they report it.
  state_budget_->Rebuild([this](const detectors::RetainedVisitor& visit) { pool_->VisitRetained(visit); });
  if (durable_) {
    const store::DurableStoreStats stats = durable_->Stats();
    spdlog::info("data directory {}: {} segment(s), {} series, {} points recovered",
                 options_.store_options.data_dir, stats.segments, stats.series,
                 stats.recovered_points);
    for (const std::string& problem : durable_->Problems()) {
      spdlog::warn("data directory {}: {}", options_.store_options.data_dir, problem);
    }
  }
}

void Daemon::RecoverOpenRankScalars() {
  // Each rank's own step scalars (head = rank) are stored with the batch that
  // brought them, before its Ack; the run-level mean (head kAllHeads) with
  // the batch that completed its step. So the reports stored beyond the last
  // merged step are exactly the steps open when the daemon stopped, which a
  // kill -9 may have kept out of the detector checkpoint. (Non-finite values
  // are not stored as a rank's own: such a field is missing from the mean.)
  constexpr std::string_view kFields[] = {"loss", "grad_norm", "lr"};
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  for (const store::RunInfo& info : store_->ListRuns()) {
    const std::optional<RunLifecycle::Status> status = lifecycle_->GetStatus(info.run);
    if (status && status->ended) continue;
    const std::vector<RunLifecycle::Boundary> boundaries = lifecycle_->Boundaries(info.run);
    int64_t from_step = std::numeric_limits<int64_t>::min();  // the latest attempt's points
    for (const RunLifecycle::Boundary& b : boundaries) from_step = std::max(from_step, b.from_step);
    std::vector<store::SeriesInfo> own;
    int64_t merged_through = -1;
    for (const store::SeriesInfo& series : store_->ListSeries(info.run)) {
      if (series.key.layer != detectors::kNoLayer ||
          std::find(std::begin(kFields), std::end(kFields), series.key.signal) == std::end(kFields)) {
        continue;
      }
      if (series.key.head >= 0) {
        own.push_back(series);
        continue;
      }
      if (series.key.head != detectors::kAllHeads) continue;
      std::vector<Point> tail = store_->Range(series.key, from_step, kMax);
      RunLifecycle::LatestAttempt(tail, boundaries);
      if (!tail.empty()) merged_through = std::max(merged_through, tail.back().step);
    }
    if (own.empty()) continue;
    std::map<std::pair<int64_t, int32_t>, detectors::ScalarsSample> by_step_rank;
    std::set<int32_t> ranks;
    for (const store::SeriesInfo& series : own) {
      const int32_t rank = series.key.head;
      if (series.last_step > merged_through - wire::RankScalars::kDefaultWindow) ranks.insert(rank);
      std::vector<Point> points = store_->Range(series.key, merged_through + 1, kMax);
      RunLifecycle::LatestAttempt(points, boundaries);
      for (const Point& p : points) {
        detectors::ScalarsSample& s = by_step_rank[{p.step, rank}];
        if (series.key.signal == "loss") {
          s.has_loss = true;
          s.loss = p.value;
        } else if (series.key.signal == "grad_norm") {
          s.has_grad_norm = true;
          s.grad_norm = p.value;
        } else {
          s.has_lr = true;
          s.lr = p.value;
        }
      }
    }
    if (by_step_rank.empty()) continue;
    const int32_t world_size = status ? std::max(status->world_size, 0) : 0;
    std::vector<detectors::Sample> reports;
    for (const auto& [key, scalars] : by_step_rank) {
      detectors::Sample sample;
      sample.run = info.run;
      sample.rank = key.second;
      sample.world_size = world_size;
      sample.step = key.first;
      sample.payload = scalars;
      reports.push_back(std::move(sample));
    }
    spdlog::info("run {}: {} rank report(s) after step {} were acknowledged but not merged; "
                 "their steps are open again",
                 info.run, reports.size(), merged_through);
    pool_->RecoverRankScalars(info.run, world_size, merged_through,
                              std::vector<int32_t>(ranks.begin(), ranks.end()), reports);
  }
}

bool Daemon::Checkpoint() {
  // Detector state first: the alert state it is paired with may only be newer.
  // Streamed, run by run, as each worker's detectors serialize their series:
  // a checkpoint adds a chunk to the daemon's memory, not a copy of the
  // detector state (which can be most of it under large probes).
  const bool detectors_ok = store_->WriteCheckpointStreamed(
      kDetectorCheckpoint, [this](codec::StateSink& out) {
        codec::StateWriter writer(&out);
        pool_->SaveDetectorState(writer);
        writer.Flush();
        return true;
      });
  const bool alerts_ok = store_->WriteCheckpoint(kAlertCheckpoint, alerts_->SaveState());
  // After the alert state: it may be newer than that, never older (Restore re-applies).
  lifecycle_->Checkpoint();
  delivery_->Checkpoint();
  if (!detectors_ok || !alerts_ok) spdlog::warn("writing the state checkpoints failed");
  return detectors_ok && alerts_ok;
}

void Daemon::CheckpointLoop() {
  std::unique_lock<std::mutex> lock(checkpoint_mu_);
  while (!stop_checkpoints_) {
    checkpoint_cv_.wait_for(lock, options_.checkpoint_interval);
    if (stop_checkpoints_) break;
    lock.unlock();
    Checkpoint();
    lock.lock();
  }
}

void Daemon::ForgetLoop() {
  const auto tick = std::clamp<std::chrono::milliseconds>(options_.forget_runs_idle / 4,
                                                          std::chrono::milliseconds(100),
                                                          std::chrono::minutes(1));
  std::unique_lock<std::mutex> lock(checkpoint_mu_);
  while (!stop_checkpoints_) {
    checkpoint_cv_.wait_for(lock, tick);
    if (stop_checkpoints_) break;
    lock.unlock();
    const std::vector<std::string> forgotten =
        lifecycle_->ForgetIdleRuns(NowUnixMillis(), options_.forget_runs_idle.count());
    if (!forgotten.empty()) {
      metrics_->runs_forgotten_total.Add({}).Increment(static_cast<double>(forgotten.size()));
    }
    lock.lock();
  }
}

Daemon::~Daemon() { Shutdown(std::chrono::milliseconds(0)); }

absl::Status Daemon::Start() {
  if (!listen_status_.ok()) return listen_status_;
  if (!init_status_.ok()) {
    return absl::Status(init_status_.code(),
                        absl::StrCat("cannot open the data directory '",
                                     options_.store_options.data_dir,
                                     "': ", init_status_.message()));
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (options_.tls.enabled()) {
    auto cert = ReadFileToString(options_.tls.cert);
    if (!cert.ok()) return cert.status();
    auto key = ReadFileToString(options_.tls.key);
    if (!key.ok()) return key.status();
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back({*key, *cert});
    if (!options_.tls.client_ca.empty()) {
      auto ca = ReadFileToString(options_.tls.client_ca);
      if (!ca.ok()) return ca.status();
      ssl.pem_root_certs = *ca;
      ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
    }
    credentials = grpc::SslServerCredentials(ssl);
  }
  // Every address with the same credentials: TLS on all of them or none.
  const ListenPlan& plan = *options_.listen_plan;
  if (plan.grpc.empty()) return absl::InvalidArgumentError("gRPC: no address to listen on");
  grpc_ports_.assign(plan.grpc.size(), 0);
  for (size_t i = 0; i < plan.grpc.size(); ++i) {
    if (plan.grpc[i].tls != options_.tls.enabled()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "refusing to serve gRPC on ", plan.grpc[i].ToString(),
          options_.tls.enabled() ? " without TLS while --tls_cert is set"
                                 : " with TLS but no certificate"));
    }
    builder.AddListeningPort(plan.grpc[i].ToString(), credentials, &grpc_ports_[i]);
  }
  // Above --max_message_mb the ingest service refuses (and counts) a message
  // itself; gRPC's transport only stops what is far beyond it.
  builder.SetMaxReceiveMessageSize(TransportMessageLimit(options_.max_message_bytes));
  // gRPC sets SO_REUSEPORT by default: a second daemon on the same port would
  // silently share the traffic instead of failing to start.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Transport memory is outside --max_memory_mb's reach (a message is
  // resident before ingest can refuse it), so it is bounded here: fixed
  // per-stream windows instead of BDP-grown ones.
  if (options_.grpc_stream_window_bytes > 0) {
    builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES,
                               options_.grpc_stream_window_bytes);
  }
  builder.RegisterService(ingest_.get());
  builder.RegisterService(query_.get());
  grpc_server_ = builder.BuildAndStart();
  // gRPC reports a port it could not bind as 0 (unix: sockets as 1).
  const bool every_port_bound =
      std::find(grpc_ports_.begin(), grpc_ports_.end(), 0) == grpc_ports_.end();
  if (!grpc_server_ || !every_port_bound) {
    if (grpc_server_) {
      grpc_server_->Shutdown();
      grpc_server_.reset();
    }
    return absl::UnavailableError(
        absl::StrCat("cannot serve gRPC on ", JoinAddresses(plan.grpc)));
  }
  grpc_port_ = grpc_ports_.front();
  if (absl::Status status = http_->Start(plan.http, options_.tls, options_.http_limits);
      !status.ok()) {
    grpc_server_->Shutdown();
    grpc_server_.reset();
    return status;
  }
  spdlog::info("foreshockd serving gRPC on {} (port {}), metrics, API and UI on {} (port {}), "
               "{} workers, data in {}",
               JoinAddresses(plan.grpc), grpc_port_, JoinAddresses(plan.http), http_->port(),
               pool_->size(),
               durable_ ? options_.store_options.data_dir : std::string("memory only"));
  spdlog::info("security: {}; {}",
               !options_.tls.enabled() ? "no TLS (plaintext gRPC and HTTP)"
               : options_.tls.client_ca.empty()
                   ? "TLS on gRPC and HTTPS, client certificates not required"
                   : "mutual TLS on gRPC and HTTPS (client certificates required)",
               options_.authorizer
                   ? absl::StrCat(options_.authorizer->size(), " token(s) from --token_file")
                   : std::string("no --token_file: every client that reaches the ports is trusted"));
  if (!options_.alertmanager_url.empty()) {
    // Never the URL as given: it may carry user:password@.
    spdlog::info("alerts are delivered to Alertmanager at {}",
                 RedactUrlUserinfo(options_.alertmanager_url));
  }
  memory_->Start();
  if (options_.max_memory_bytes > 0) {
    spdlog::info("memory bound: ingest pauses at {} MiB resident (--max_memory_mb), now {} MiB",
                 options_.max_memory_bytes >> 20, memory_->resident_bytes() >> 20);
  }
  if (options_.max_state_bytes_per_run > 0) {
    spdlog::info("detector state: at most {} MiB per run (--max_state_mb_per_run); further new "
                 "probe layers of a run are refused (state_limit)",
                 options_.max_state_bytes_per_run >> 20);
  }
  if (durable_ && options_.checkpoint_interval.count() > 0) {
    checkpoint_thread_ = std::thread([this] { CheckpointLoop(); });
  }
  forget_thread_ = std::thread([this] { ForgetLoop(); });
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
  memory_->Stop();
  {
    std::lock_guard<std::mutex> lock(checkpoint_mu_);
    stop_checkpoints_ = true;
  }
  checkpoint_cv_.notify_all();
  if (checkpoint_thread_.joinable()) checkpoint_thread_.join();
  if (forget_thread_.joinable()) forget_thread_.join();
  // Everything accepted is processed: the final state goes with the data.
  if (durable_) {
    Checkpoint();
    durable_->Sync();
  }
  spdlog::info("foreshockd stopped: {} samples processed", export_sink_->samples_processed());
}

void Daemon::WaitIdle() { gate_->WaitIdle(); }

int Daemon::metrics_port() const { return http_->port(); }

}  // namespace foreshock::server
