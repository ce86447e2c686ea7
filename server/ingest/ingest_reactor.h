// IngestReactor: one ingest stream's state machine (Hello, batches, acks,
// the end of the stream), behind IngestService. Internal to server/ingest/:
// IngestService creates it; its definitions are in ingest_reactor.cc (the
// receive side) and ingest_reactor_acks.cc (admission done, acks, refusals,
// finishing).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "server/ingest/ingest_service.h"

namespace foreshock::server {

// One stream's state machine. Reads are issued one at a time; a Batch whose
// samples do not fit the admission budget leaves the stream parked (no read
// outstanding) until a worker frees room, which is what pushes back on the
// client. A batch is acknowledged only once every accepted sample in it has
// been processed and its points appended to the store (durable as --fsync
// says): an Ack means the data is safe. Acks go out in seq order through a
// small queue, since gRPC allows one outstanding write per stream; the stream
// does not finish while a batch of it is still being processed.
//
// Messages travel as raw ByteBuffers: each one is recorded as received (with
// --record_dir), then parsed here.
class IngestReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  // `tenant`: the --max_streams_per_tenant slot the stream already holds
  // (with --token_file, taken when the stream opened); empty: none yet.
  IngestReactor(IngestService& service, grpc::CallbackServerContext* context, uint64_t session,
                AccessCheck access = {}, std::string tenant = {});

  // The watchdog thread, with the service's watch_mu_ held (so OnDone cannot
  // delete this meanwhile): ends the stream with DEADLINE_EXCEEDED when its
  // first message is overdue (--hello_timeout_ms), or when after the Hello it
  // has sent nothing for --stream_idle_timeout_ms while nothing of it is in
  // progress (a parked batch or one being processed keeps it alive: the wait
  // is the daemon's, and the idle time counts from its Ack). Returns when to
  // look again; nullopt: no more (it ended, is ending, or no timeout applies).
  std::optional<std::chrono::steady_clock::time_point> CheckSilence(
      std::chrono::steady_clock::time_point now);

  void OnReadDone(bool ok) override;

  void OnWriteDone(bool ok) override;

  void OnCancel() override {}

  // Rank ownership (IngestService::ClaimRank, with the service's ranks_mu_
  // held, so this stream is not deleted meanwhile): when this stream was last
  // active (now while a batch of it is parked or in process); nullopt when
  // it is ending, so that it no longer holds its rank.
  std::optional<std::chrono::steady_clock::time_point> ActiveAt(
      std::chrono::steady_clock::time_point now);

  // Another stream took this one's rank over: its goodbye no longer counts
  // and its next batch ends it. Returns its sender for the lifecycle's
  // stream close when that is still to be reported.
  std::optional<IngestService::RevokedSender> Revoke();

  void OnDone() override;

 private:
  // The next message, with room reserved for it: a stream whose last
  // message was large is expected to send another like it, which the
  // transport assembles whole before ingest sees it. (Its parsed copy
  // exists only while a gRPC thread parses it: a few at once, not one per
  // stream, so it is left to the bound's slack.)
  void ReadNext();

  void SetReserved(int64_t bytes);

  // The first message names the file: run and rank from its Hello (a stream
  // that starts otherwise is recorded too, as run "unknown").
  void RecordReceived(const grpc::ByteBuffer& raw, int64_t recv_unix_us, bool parsed);

  void HandleHello();

  void HandleBatch();
  void EndRevokedStream();
  size_t ValidateRecords(v1::Batch& batch, v1::Ack& ack, bool refuse_probes);

  // --max_state_mb_per_run: drops from items_ the probes that would grow the
  // run's detector state past its budget (their memory goes with them).
  void AdmitState(v1::Ack& ack);

  static bool IsProbe(const v1::Record& record);

  // What --max_memory_mb refuses: probes, and curvature records with
  // per-layer values (each value a series of its own, up to --max_layers of
  // them); not step scalars nor curvature's few run-level values.
  static bool RefusedAtMemoryBound(const v1::Record& record);

  // --max_step_jump: a step more than that beyond the run's highest accepted
  // step (0 before the first) is refused, so that one corrupt step cannot
  // become the run's last and make every real later step look stale. The
  // stream's own view of the run's highest step is a lower bound; the
  // service is asked only when a step looks too far ahead of it.
  std::optional<wire::Rejection> CheckStep(int64_t step);

  // --max_probe_ids_per_run; this stream remembers the probe_ids it got
  // admitted, so the service's lock is taken once per new one.
  std::optional<wire::Rejection> CheckProbeId(const detectors::Sample& sample);

  // Called from the worker thread that freed room for this parked stream.
  void Resume();

  // For a dedup stream: true when the batch is a resend (Admitted queues its
  // ack, done once the batch is stored), false when it is new.
  bool BeginDedup(const v1::Batch& batch, int64_t records);

  void Admitted();

  void FinishAdmission();

  // For code on worker threads: decides under the lock whether this thread
  // finishes the stream; the caller then calls Finish after unlocking and must
  // not touch the reactor otherwise, since once the lock is released another
  // thread may finish it and OnDone delete it.
  std::optional<grpc::Status> TakeFinishLocked();

  // Acks wait here, in the order of their batches, until they are done.
  uint64_t QueueAck(v1::StreamResponse ack, bool done);

  // Called on a worker thread when the batch's last sample is stored, or
  // (`stored` not OK) when the store refused its points.
  void AckDone(uint64_t ticket, absl::Status stored = absl::OkStatus());

  // Acks go out in order. A batch the store refused is never acked: the
  // stream ends there (RESOURCE_EXHAUSTED disk_full or UNAVAILABLE
  // store_unavailable, retry-after-ms) and no later ack goes out, so the
  // client resends everything from it on.
  void FlushAcksLocked();

  static std::string StoreRefusalDetail(const absl::Status& status);

  // Before processing: the store is failing, so the batch is refused now.
  void RefuseForStore(const absl::Status& health);

  // Ends the stream with INVALID_ARGUMENT (or `status`) once queued acks are written.
  void FailStream(std::string_view code, const std::string& detail,
                  grpc::StatusCode status = grpc::StatusCode::INVALID_ARGUMENT);

  // Ends the stream with UNAUTHENTICATED or PERMISSION_DENIED (counted by
  // AccessCheck). The log names the grant, never the token.
  void DenyStream(const absl::Status& status);

  // Ends the stream with RESOURCE_EXHAUSTED (a limit, not a bad client).
  void RefuseStream(std::string_view code, const std::string& detail);

  void Write(const v1::StreamResponse& response);

  void WriteLocked(const v1::StreamResponse& response);

  bool ReadyToFinishLocked() const;

  // Only from gRPC reactions (OnReadDone, OnWriteDone): OnDone cannot run
  // before they return.
  void MaybeFinishLocked();

  IngestService& service_;
  grpc::CallbackServerContext* const call_;
  const uint64_t session_;
  const AccessCheck access_;
  std::string tenant_;  // the --max_streams_per_tenant slot held; empty: none
  grpc::ByteBuffer received_;
  v1::StreamRequest request_;
  // The message was a Batch of this many records, over --max_records_per_batch,
  // and request_ holds only its seq and goodbye.
  std::optional<int64_t> oversized_records_;
  bool recording_ = false;    // the recorder has a file for this stream
  bool drop_logged_ = false;  // a dropped recording frame was logged
  std::optional<wire::StreamContext> context_;
  bool lifecycle_registered_ = false;  // the Hello went to the service's RunLifecycle
  // Its stream close is still to be reported to the lifecycle (by OnDone, or
  // by the stream that takes its rank over).
  std::atomic<bool> lifecycle_open_{false};
  bool holds_rank_ = false;            // ClaimRank gave it its rank; OnDone releases it
  // --max_memory_mb: the room this stream's next batch may take while it
  // waits to read it (MemoryGuard::AdjustReserved), from its last message.
  int64_t last_message_bytes_ = 0;
  std::atomic<int64_t> reserved_bytes_{0};
  std::atomic<bool> revoked_{false};   // its rank was taken over
  uint64_t lifecycle_sender_ = 0;      // Hello.sender_id (0 without first_seq)
  bool batch_goodbye_ = false;         // the batch in progress carries Batch.goodbye
  std::unordered_set<std::string> admitted_probe_ids_;  // --max_probe_ids_per_run
  std::optional<uint64_t> last_seq_;
  int64_t run_max_step_ = -1;  // --max_step_jump: the run's highest step as this stream knows it
  bool rank_established_ = false;  // see IngestService::AdmitLateJoinerStep
  bool dedup_ = false;                 // Hello.first_seq: resends are deduplicated
  DeliveryTracker::Sender sender_;     // with dedup_: whose seqs these are
  std::optional<uint64_t> dedup_seq_;  // the new batch in progress of a dedup stream
  struct DuplicateWait {
    // Acked as a duplicate only if the first copy was stored.
    absl::Status Outcome() {
      std::lock_guard<std::mutex> lock(mu);
      return committed ? absl::OkStatus()
                       : absl::UnavailableError("the first copy of this batch was not stored");
    }
    std::mutex mu;
    bool committed = true;            // false: the first copy's store write failed
    bool settled = false;             // the first copy is stored
    std::optional<uint64_t> ticket;   // the resend's queued ack
  };
  std::shared_ptr<DuplicateWait> duplicate_;  // the batch in progress is a resend
  uint32_t duplicate_records_ = 0;

  // The batch in progress (only one: the next read starts after admission).
  std::vector<WorkItem> items_;
  std::vector<int> item_index_;  // each item's record index in the batch
  size_t batch_bytes_ = 0;
  v1::StreamResponse ack_;

  std::mutex mu_;  // guards what follows; reactor callbacks may run concurrently
  std::deque<grpc::ByteBuffer> pending_writes_;
  struct PendingAck {
    uint64_t ticket;
    v1::StreamResponse response;
    bool done;
    absl::Status stored = absl::OkStatus();  // not OK: the store refused the batch
    bool goodbye = false;  // the batch carried Batch.goodbye
  };
  std::deque<PendingAck> unacked_;  // acks of batches still being processed, in order
  uint64_t next_ticket_ = 0;
  bool client_gone_ = false;
  bool store_refused_ = false;  // a batch was not stored: no more acks
  std::optional<grpc::Status> finish_status_;
  bool reads_done_ = false;
  bool first_message_seen_ = false;  // the Hello (or what came instead) arrived
  bool silence_expired_ = false;     // the watchdog ended this stream
  // Opening, the latest message received or response written: silence counts from here.
  std::chrono::steady_clock::time_point last_activity_;
  bool parked_ = false;
  bool finished_ = false;
};

}  // namespace foreshock::server
