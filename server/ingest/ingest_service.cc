// IngestService: the foreshock.v1.Ingest method, stream refusals at limits,
// and the silence watchdog. Streams are IngestReactors (ingest_reactor.h);
// admission of runs, ranks and tenants is in run_admission.cc.
#include "server/ingest/ingest_service.h"

#include "server/ingest/ingest_reactor.h"

#include <grpcpp/support/proto_buffer_reader.h>
#include <grpcpp/support/proto_buffer_writer.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <limits>
#include <mutex>
#include <optional>
#include <utility>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "server/ingest/batch_scan.h"
#include "server/pipeline/run_lifecycle.h"

namespace foreshock::server {

namespace v1 = foreshock::v1;

IngestService::IngestService(const IngestLimits& limits, AdmissionGate& gate, WorkerPool& pool,
                             DaemonMetrics& metrics, HelloObserver on_hello,
                             StreamRecorderOptions recording)
    : limits_(limits),
      gate_(gate),
      pool_(pool),
      metrics_(metrics),
      on_hello_(std::move(on_hello)),
      tenant_limit_(TenantStreamLimit(limits)),
      tenant_run_limit_(TenantRunLimit(limits)) {
  metrics_.DeclareRejectionReasons(RejectionReasons());
  if (!recording.dir.empty()) {
    recorder_ = std::make_unique<StreamRecorder>(std::move(recording), metrics_);
  }
}

IngestService::~IngestService() {
  {
    std::lock_guard<std::mutex> lock(watch_mu_);
    stop_watchdog_ = true;
  }
  watchdog_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
}

namespace {
bool WatchesSilence(const IngestLimits& limits) {
  return limits.hello_timeout.count() > 0 || limits.stream_idle_timeout.count() > 0;
}
}  // namespace

void IngestService::WatchStream(IngestReactor* stream) {
  if (!WatchesSilence(limits_)) return;
  std::lock_guard<std::mutex> lock(watch_mu_);
  // Checked on the watchdog's next round, which works out the real deadline.
  watched_[stream] = std::chrono::steady_clock::now();
  if (!watchdog_.joinable()) watchdog_ = std::thread([this] { SilenceWatchdog(); });
}

void IngestService::StreamDone(IngestReactor* stream) {
  if (!WatchesSilence(limits_)) return;
  std::lock_guard<std::mutex> lock(watch_mu_);
  watched_.erase(stream);
}

void IngestService::SilenceWatchdog() {
  std::unique_lock<std::mutex> lock(watch_mu_);
  // A quarter of the shortest timeout, at most a second: a stream ends at
  // most that much after its deadline.
  std::chrono::steady_clock::duration shortest = std::chrono::seconds(4);
  for (auto timeout : {limits_.hello_timeout, limits_.stream_idle_timeout}) {
    if (timeout.count() > 0) shortest = std::min<std::chrono::steady_clock::duration>(shortest, timeout);
  }
  const auto period = shortest / 4 + std::chrono::milliseconds(1);
  while (!watchdog_cv_.wait_for(lock, period, [this] { return stop_watchdog_; })) {
    const auto now = std::chrono::steady_clock::now();
    for (auto it = watched_.begin(); it != watched_.end();) {
      if (now < it->second) {
        ++it;
        continue;
      }
      if (auto next = it->first->CheckSilence(now)) {
        it->second = *next;
        ++it;
      } else {
        it = watched_.erase(it);
      }
    }
  }
}

namespace {
// A stream refused before it starts: it only finishes.
class RefusedReactor final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  explicit RefusedReactor(grpc::Status status) { Finish(std::move(status)); }
  void OnDone() override { delete this; }
};
}  // namespace

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* IngestService::RefuseStream(
    grpc::CallbackServerContext* context, std::string_view code, const std::string& detail) {
  metrics_.CountRejection(code);
  LogRefusal(code, detail);
  context->AddTrailingMetadata("retry-after-ms", std::to_string(kRetryAfterMs));
  return new RefusedReactor(grpc::Status(
      grpc::StatusCode::RESOURCE_EXHAUSTED,
      absl::StrCat(std::string(code), ": ", detail,
                   absl::StrCat("; retry after ", kRetryAfterMs,
                                " ms (trailing metadata retry-after-ms)"))));
}

void IngestService::LogRefusal(std::string_view code, const std::string& detail) {
  const uint64_t refused = refused_streams_.fetch_add(1) + 1;
  if (refused == 1 || refused % 1000 == 0) {  // a flood of them must not flood the log
    spdlog::warn("{} ingest stream(s) refused so far; the latest: {}: {}", refused,
                 std::string(code), detail);
  }
}

std::string IngestService::MemoryLimitDetail() const {
  return absl::StrCat("the daemon's resident memory (", memory_->resident_bytes() >> 20,
                      " MiB), with this batch and the ", memory_->reserved_bytes() >> 20,
                      " MiB reserved for open streams' next batches, reaches --max_memory_mb=",
                      memory_->limit_bytes() >> 20,
                      " (probes are accepted again below ", memory_->resume_bytes() >> 20,
                      " MiB, or once memory has settled with nothing queued)");
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* IngestService::Stream(
    grpc::CallbackServerContext* context) {
  // Callers without a valid token are turned away before they take a slot.
  std::optional<AccessCheck> access;
  if (authorizer_ != nullptr) {
    const auto& metadata = context->client_metadata();
    auto it = metadata.find("authorization");
    access.emplace(authorizer_, auth_metrics_, "grpc_ingest",
                   it == metadata.end() ? std::string_view()
                                        : std::string_view(it->second.data(), it->second.size()));
    if (const absl::Status& status = access->authenticated(); !status.ok()) {
      access->CountUnauthenticated();
      LogRefusal("unauthenticated", std::string(status.message()));
      return new RefusedReactor(
          grpc::Status(grpc::StatusCode::UNAUTHENTICATED, std::string(status.message())));
    }
  }
  // No refusal at --max_memory_mb here: a Hello costs nothing, and a new
  // run's scalars are accepted while probes are refused (HandleBatch).
  // --max_streams_per_tenant with --token_file: the tenant is the token, so
  // that one tenant's streams (silent ones too) cannot take every slot.
  std::string tenant;
  if (access && tenant_limit_ > 0) {
    tenant = absl::StrCat("token ", access->name());
    if (!AcquireTenant(tenant)) {
      return RefuseStream(context, reason::kTooManyStreamsForTenant,
                          absl::StrCat(tenant, " already has ", tenant_limit_,
                                       " ingest streams open (--max_streams_per_tenant)"));
    }
  }
  if (const int64_t open = open_streams_.fetch_add(1);
      limits_.max_streams > 0 && open >= limits_.max_streams) {
    open_streams_.fetch_sub(1);
    if (!tenant.empty()) ReleaseTenant(tenant);
    return RefuseStream(context, reason::kTooManyStreams,
                        absl::StrCat(limits_.max_streams,
                                     " ingest streams are open (--max_streams)"));
  }
  if (!access) return new IngestReactor(*this, context, next_session_.fetch_add(1));
  return new IngestReactor(*this, context, next_session_.fetch_add(1), *std::move(access),
                           std::move(tenant));
}

}  // namespace foreshock::server
