// foreshock.v1.Ingest: one bidirectional stream per training rank, served
// with gRPC's callback API. The service validates, admits and dispatches;
// it computes nothing.
//
// The method is served raw (grpc::ByteBuffer in and out; the service parses
// and serializes the messages itself, as gRPC would), so that --record_dir
// can record every StreamRequest exactly as it arrived, without a copy.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <thread>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "foreshock/v1/ingest.grpc.pb.h"
#include "server/admission.h"
#include "server/delivery.h"
#include "server/memory_guard.h"
#include "server/auth.h"
#include "server/metrics.h"
#include "server/stream_recorder.h"
#include "server/validation.h"
#include "server/worker_pool.h"

namespace foreshock::server {

class IngestReactor;

// Called once per accepted Hello (run registry, run_info metric).
using HelloObserver = std::function<void(const foreshock::v1::Hello&)>;

class IngestService final
    : public foreshock::v1::Ingest::WithRawCallbackMethod_Stream<foreshock::v1::Ingest::Service> {
 public:
  // With a non-empty `record_dir`, every stream is recorded there
  // (server/stream_recorder.h).
  IngestService(const IngestLimits& limits, AdmissionGate& gate, WorkerPool& pool,
                DaemonMetrics& metrics, HelloObserver on_hello, std::string record_dir = "");
  ~IngestService() override;

  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Stream(
      grpc::CallbackServerContext* context) override;

  // --token_file: every Hello must carry a token granting ingest for its run.
  // Call before the server starts. Null: no authorization.
  void SetAuthorizer(const Authorizer* authorizer, AuthMetrics* metrics) {
    authorizer_ = authorizer;
    auth_metrics_ = metrics;
  }

  // A run the daemon already has (recovered from its data directory): it
  // counts toward --max_runs, and its Hellos are always admitted.
  void NoteKnownRun(const std::string& run_id);

  // --max_memory_mb: at the bound new streams and batches are refused
  // (RESOURCE_EXHAUSTED memory_limit, retry-after-ms). Call before the server
  // starts. Null: no bound.
  void SetMemoryGuard(const MemoryGuard* guard) { memory_ = guard; }

  // Null unless recording.
  StreamRecorder* recorder() { return recorder_.get(); }

  // Deduplication of resent batches (server/delivery.h) for streams whose
  // Hello has first_seq. Call before the server starts. Null: none.
  void SetDeliveryTracker(DeliveryTracker* delivery) { delivery_ = delivery; }

 private:
  friend class IngestReactor;
  const IngestLimits limits_;
  AdmissionGate& gate_;
  WorkerPool& pool_;
  DaemonMetrics& metrics_;
  HelloObserver on_hello_;
  std::unique_ptr<StreamRecorder> recorder_;  // null: streams are not recorded
  std::atomic<uint64_t> next_session_{1};
  // A stream refused before it starts, at a limit: RESOURCE_EXHAUSTED with
  // "<code>: <detail>; retry after N ms" and trailing metadata retry-after-ms.
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* RefuseStream(
      grpc::CallbackServerContext* context, std::string_view code, const std::string& detail);
  static constexpr int kRetryAfterMs = 1000;
  std::string MemoryLimitDetail() const;
  // Refusals at limits come in floods: the first and every 1000th is logged.
  void LogRefusal(std::string_view code, const std::string& detail);
  bool AdmitRun(const std::string& run_id);  // false: a new run beyond --max_runs
  void ReleaseRun(const std::string& run_id);  // its stream ended
  // false: `probe_id` would be one more than --max_probe_ids_per_run for the run.
  bool AdmitProbeId(const std::string& run_id, const std::string& probe_id);
  // A run with no open stream for this long stops counting toward --max_runs,
  // so that a long-lived sidecar keeps admitting new runs as old ones finish.
  static constexpr std::chrono::hours kIdleRunRelease{24};
  // --hello_timeout (limits_.hello_timeout): streams that have not sent their
  // first message, and the thread that ends those that take too long.
  void AwaitFirstMessage(IngestReactor* stream);
  void StreamDone(IngestReactor* stream);
  void HelloWatchdog();
  std::mutex awaiting_mu_;  // held while the watchdog ends a stream: OnDone waits
  std::unordered_map<IngestReactor*, std::chrono::steady_clock::time_point> awaiting_;
  std::condition_variable watchdog_cv_;
  bool stop_watchdog_ = false;
  std::thread watchdog_;
  std::atomic<int64_t> open_streams_{0};
  std::atomic<uint64_t> refused_streams_{0};
  std::mutex runs_mu_;
  struct RunSlot {
    int open_streams = 0;
    std::chrono::steady_clock::time_point last_seen;
    std::unordered_set<std::string> probe_ids;  // seen since start
  };
  std::unordered_map<std::string, RunSlot> runs_;  // admitted or recovered runs
  DeliveryTracker* delivery_ = nullptr;
  const MemoryGuard* memory_ = nullptr;
  const Authorizer* authorizer_ = nullptr;
  AuthMetrics* auth_metrics_ = nullptr;
};

}  // namespace foreshock::server
