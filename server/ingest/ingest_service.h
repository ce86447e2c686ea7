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
#include <map>
#include <optional>
#include <vector>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "foreshock/v1/ingest.grpc.pb.h"
#include "server/ingest/admission.h"
#include "server/ingest/delivery.h"
#include "server/ingest/memory_guard.h"
#include "server/ingest/state_budget.h"
#include "server/security/auth.h"
#include "server/common/metrics.h"
#include "server/ingest/stream_recorder.h"
#include "server/ingest/validation.h"
#include "server/pipeline/run_state_owner.h"
#include "server/pipeline/worker_pool.h"

namespace foreshock::server {

class IngestReactor;
class RunLifecycle;

// Called once per accepted Hello (run registry, run_info metric).
using HelloObserver = std::function<void(const foreshock::v1::Hello&)>;

class IngestService final
    : public foreshock::v1::Ingest::WithRawCallbackMethod_Stream<foreshock::v1::Ingest::Service>,
      public RunStateOwner {
 public:
  // With a non-empty `record_dir`, every stream is recorded there
  // (server/ingest/stream_recorder.h).
  IngestService(const IngestLimits& limits, AdmissionGate& gate, WorkerPool& pool,
                DaemonMetrics& metrics, HelloObserver on_hello,
                StreamRecorderOptions recording = {});
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
  // counts toward --max_runs and toward its `tenant`'s share (the one its
  // first Hello counted in, as RunLifecycle stored it; when that is empty,
  // without --token_file, the share of its `job`), and its Hellos are
  // admitted while it counts. Its `last_step` (-1: none) is where
  // --max_step_jump counts from; a run without one stops counting after
  // --empty_run_release_s.
  void NoteKnownRun(const std::string& run_id, int64_t last_step = -1,
                    const std::string& job = "", const std::string& tenant = "");

  // --max_memory_mb: at the bound, probe records (QK, router) are rejected
  // in the Ack (memory_limit) and everything else is still accepted. Call
  // before the server starts. Null: no bound.
  void SetMemoryGuard(MemoryGuard* guard) { memory_ = guard; }
  // --max_state_mb_per_run: a probe that would grow its run's detector state
  // past the budget is rejected in the Ack (state_limit). Call before the
  // server starts. Null: not counted.
  void SetStateBudget(StateBudget* budget) { state_budget_ = budget; }

  // Null unless recording.
  StreamRecorder* recorder() { return recorder_.get(); }

  // Deduplication of resent batches (server/ingest/delivery.h) for streams whose
  // Hello has first_seq. Call before the server starts. Null: none.
  void SetDeliveryTracker(DeliveryTracker* delivery) { delivery_ = delivery; }
  // The store the batches' points go to: while it reports a write failure
  // (SeriesStore::WriteHealth), batches are refused up front (disk_full or
  // store_unavailable, retry-after-ms), and a batch whose points it refuses
  // is never acknowledged.
  void SetStore(const SeriesStore* store) { store_ = store; }
  // Run lifecycle (server/pipeline/run_lifecycle.h): Hellos, stream ends,
  // Batch.goodbye and each batch's first step go to it. Call before the
  // server starts. Null: none (a goodbye is acked like an empty batch).
  void SetLifecycle(RunLifecycle* lifecycle) { lifecycle_ = lifecycle; }

  // RunStateOwner: a forgotten run with no stream open stops counting toward
  // --max_runs and its tenant's share; its probe ids, highest step and
  // ranks' histories go with it.
  void OnRunRestarted(const std::string&) override {}
  void OnRunEnded(const std::string&) override {}
  void OnRunForgotten(const std::string& run_id) override;

 private:
  friend class IngestReactor;
  // The tenant whose share of --max_runs a run counts in, without --token_file.
  static std::string RunTenantOfJob(const std::string& job);
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
  // --max_runs and --max_runs_per_tenant: nullopt when the run is admitted
  // (a known run, or a new one within both), else the refusal's code and
  // detail. `tenant`: the token, or without --token_file the Hello's job.
  // Admitted, `counted_in` is the tenant whose share the run counts in (its
  // first Hello's).
  std::optional<wire::Rejection> AdmitRun(const std::string& run_id, const std::string& tenant,
                                    std::string& counted_in);
  void ReleaseRun(const std::string& run_id);  // its stream ended
  // When a run stops counting, for the refusals' detail.
  std::string ReleaseRule() const;
  // Runs that stopped counting: no stream open, and no sample stored for
  // --empty_run_release_s, or idle for --forget_runs_idle_s. Under runs_mu_.
  void PruneRunsLocked(std::chrono::steady_clock::time_point now);
  // Rank ownership (docs/DESIGN.md §3.4): `stream` asks to hold (run, rank)
  // as `sender` (Hello.sender_id with first_seq, else 0) under `grant` (the
  // token's name; "-" without tokens). Refused (the detail of rank_in_use)
  // while another sender's stream holds it, open and active within
  // --rank_takeover_grace_ms; otherwise `stream` holds it from now on and a
  // previous holder is revoked (its goodbye no longer counts, its next batch
  // ends it). Holders of the run's other ranks idle past the grace count as
  // gone too. Returns the revoked streams' lifecycle closes for the caller to
  // report (outside the lock) before its own Hello.
  struct RevokedSender {
    std::string run;
    int32_t rank;
    uint64_t sender;
  };
  std::optional<std::string> ClaimRank(IngestReactor* stream, const std::string& run_id,
                                       int32_t rank, uint64_t sender, const std::string& grant,
                                       std::vector<RevokedSender>& revoked);
  void ReleaseRank(IngestReactor* stream, const std::string& run_id, int32_t rank);
  struct RankHolder {
    IngestReactor* stream = nullptr;  // valid under ranks_mu_: OnDone releases it first
    uint64_t sender = 0;
    std::string grant;
  };
  std::mutex ranks_mu_;  // before a stream's own lock
  std::map<std::pair<std::string, int32_t>, RankHolder> rank_holders_;
  // false: `probe_id` would be one more than --max_probe_ids_per_run for the run.
  bool AdmitProbeId(const std::string& run_id, const std::string& probe_id);
  // --max_step_jump: the highest step accepted for the run so far (-1: none),
  // and raising it (`established`: by a rank with a history, below).
  int64_t RunMaxStep(const std::string& run_id);
  void NoteStep(const std::string& run_id, int64_t step, bool established = true);
  // A rank joining a live run late: until the daemon has accepted
  // kLateJoinSteps steps of its own (since start), a step of it more than
  // kLateJoinLeadSteps beyond the highest step of the run's ranks that have
  // such a history is refused (step_ahead_of_run), so that a second client
  // cannot move foreshock_last_step far ahead of the job. Counts `step`
  // toward the rank's history otherwise; `established` becomes true once it
  // has one. The run's first ranks are never held to it: no rank has a
  // history yet when they start (nor right after a daemon restart).
  std::optional<wire::Rejection> AdmitLateJoinerStep(const std::string& run_id, int32_t rank,
                                               int64_t step, bool& established);
  static constexpr int kLateJoinSteps = 8;  // wire::RankScalars::kLateJoinSteps, the same rule
  static constexpr int64_t kLateJoinLeadSteps = 1000;
  // --max_streams_per_tenant: takes one of `tenant`'s stream slots (false:
  // it holds them all), and gives it back when the stream ends.
  bool AcquireTenant(const std::string& tenant);
  void ReleaseTenant(const std::string& tenant);
  const int64_t tenant_limit_;  // TenantStreamLimit(limits_); 0: none
  const int64_t tenant_run_limit_;  // TenantRunLimit(limits_); 0: none
  std::mutex tenants_mu_;
  std::unordered_map<std::string, int64_t> tenant_streams_;  // open streams by tenant
  // Silent streams: --hello_timeout_ms before the first message,
  // --stream_idle_timeout_ms after the Hello. Every stream is watched (when
  // either is set) until it ends; the watchdog thread asks each, when its
  // deadline comes, whether it is overdue (IngestReactor::CheckSilence).
  void WatchStream(IngestReactor* stream);
  void StreamDone(IngestReactor* stream);
  void SilenceWatchdog();
  std::mutex watch_mu_;  // held while the watchdog checks a stream: OnDone waits
  std::unordered_map<IngestReactor*, std::chrono::steady_clock::time_point> watched_;
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
    int64_t max_step = -1;  // highest step accepted (or recovered); -1: none
    std::string tenant;     // whose share of --max_runs it counts in; empty: none known
    struct RankHistory {
      int64_t last_step = -1;
      int steps = 0;  // accepted steps above the previous one, up to kLateJoinSteps
    };
    std::unordered_map<int32_t, RankHistory> rank_history;  // since start
    int64_t established_max_step = -1;  // highest step of ranks with a history; -1: none
  };
  std::unordered_map<std::string, RunSlot> runs_;  // admitted or recovered runs
  DeliveryTracker* delivery_ = nullptr;
  MemoryGuard* memory_ = nullptr;
  StateBudget* state_budget_ = nullptr;
  const SeriesStore* store_ = nullptr;
  RunLifecycle* lifecycle_ = nullptr;
  const Authorizer* authorizer_ = nullptr;
  AuthMetrics* auth_metrics_ = nullptr;
};

}  // namespace foreshock::server
