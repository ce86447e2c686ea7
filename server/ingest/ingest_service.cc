#include "server/ingest/ingest_service.h"

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

namespace {

// A message that is not a parseable StreamRequest (with the typed API gRPC
// would end such a stream itself). Counted like the codes in validation.h.
constexpr char kMalformedRequest[] = "malformed_request";

// The tenant whose share of --max_runs a run counts in, without --token_file.
std::string RunTenantOfJob(const std::string& job) { return absl::StrCat("job '", job, "'"); }

int64_t NowUnixMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

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
                AccessCheck access = {}, std::string tenant = {})
      : service_(service),
        call_(context),
        session_(session),
        access_(std::move(access)),
        tenant_(std::move(tenant)) {
    service_.metrics_.ingest_streams_total.Add({}).Increment();
    service_.metrics_.ingest_active_streams.Add({}).Increment();
    last_activity_ = std::chrono::steady_clock::now();
    service_.WatchStream(this);
    StartRead(&received_);
  }

  // The watchdog thread, with the service's watch_mu_ held (so OnDone cannot
  // delete this meanwhile): ends the stream with DEADLINE_EXCEEDED when its
  // first message is overdue (--hello_timeout_ms), or when after the Hello it
  // has sent nothing for --stream_idle_timeout_ms while nothing of it is in
  // progress (a parked batch or one being processed keeps it alive: the wait
  // is the daemon's, and the idle time counts from its Ack). Returns when to
  // look again; nullopt: no more (it ended, is ending, or no timeout applies).
  std::optional<std::chrono::steady_clock::time_point> CheckSilence(
      std::chrono::steady_clock::time_point now) {
    const IngestLimits& limits = service_.limits_;
    std::optional<grpc::Status> finish;
    bool cancel = false;
    std::string_view code;
    std::string detail;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_ || finish_status_) return std::nullopt;
      if (!first_message_seen_) {
        if (limits.hello_timeout.count() <= 0) {  // only the idle timeout, after the Hello
          return now + limits.stream_idle_timeout;
        }
        const auto deadline = last_activity_ + limits.hello_timeout;
        if (now < deadline) return deadline;
        code = reason::kHelloTimeout;
        detail = absl::StrCat("no Hello within ", limits.hello_timeout.count(),
                              " ms of opening the stream (--hello_timeout_ms)");
      } else {
        if (limits.stream_idle_timeout.count() <= 0) return std::nullopt;
        if (parked_ || !unacked_.empty()) return now + limits.stream_idle_timeout;
        const auto deadline = last_activity_ + limits.stream_idle_timeout;
        if (now < deadline) return deadline;
        code = reason::kStreamIdleTimeout;
        detail = absl::StrCat(
            "no message for ", limits.stream_idle_timeout.count(),
            " ms (--stream_idle_timeout_ms); every batch of the stream was acknowledged, so "
            "nothing is lost: open a new stream when there is data to send");
      }
      silence_expired_ = true;
      reads_done_ = true;
      finish_status_ = grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                                    absl::StrCat(std::string(code), ": ", detail));
      finish = TakeFinishLocked();
      // Acks the client has not read (it stopped reading too): end it anyway.
      cancel = !finish && !pending_writes_.empty();
    }
    service_.metrics_.CountRejection(code);
    service_.LogRefusal(code, detail);
    // The outstanding read then completes with ok=false.
    if (finish) {
      Finish(*finish);
    } else if (cancel) {
      call_->TryCancel();
    }
    return std::nullopt;
  }

  void OnReadDone(bool ok) override {
    // The message is resident now (or there is none): its room is no longer
    // reserved, it is measured.
    SetReserved(0);
    if (!ok) {  // client half-closed, or the call is cancelled
      std::lock_guard<std::mutex> lock(mu_);
      reads_done_ = true;
      if (!finish_status_) finish_status_ = grpc::Status::OK;
      MaybeFinishLocked();
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      // The watchdog already ended the stream: the message is not acked, so
      // the client still has it (and resends it on its next stream).
      if (silence_expired_) return;
      first_message_seen_ = true;
      last_activity_ = std::chrono::steady_clock::now();
    }
    const int64_t recv_unix_us = NowUnixMicros();
    // Shares the slices with what is parsed below; no bytes are copied.
    std::optional<grpc::ByteBuffer> raw;
    if (service_.recorder_) raw.emplace(received_);
    const size_t received_bytes = received_.Valid() ? received_.Length() : 0;
    last_message_bytes_ = static_cast<int64_t>(received_bytes);
    if (service_.limits_.max_message_bytes > 0 &&
        static_cast<int64_t>(received_bytes) > service_.limits_.max_message_bytes) {
      received_.Clear();
      RefuseStream(reason::kMessageTooLarge,
                   absl::StrCat("a message of ", received_bytes, " bytes; the limit is ",
                                service_.limits_.max_message_bytes,
                                " (--max_message_mb); send smaller batches"));
      return;
    }
    grpc::Status parsed;
    // --max_records_per_batch, on the wire bytes: a batch over it is not
    // parsed (an empty record is 2 bytes there and ~50 in memory); only its
    // seq and goodbye are kept, and HandleBatch rejects every record.
    oversized_records_.reset();
    const int64_t max_records = service_.limits_.max_records_per_batch;
    std::optional<BatchShape> oversized;
    if (max_records > 0 && received_.Valid() &&
        static_cast<int64_t>(received_bytes) > 2 * max_records) {  // a record is >= 2 bytes
      if (auto shape = ScanBatch(received_); shape && shape->records > max_records) {
        oversized = shape;
      }
    }
    if (oversized) {
      received_.Clear();
      request_.Clear();
      v1::Batch& skeleton = *request_.mutable_batch();
      skeleton.set_seq(oversized->seq);
      if (oversized->goodbye) skeleton.mutable_goodbye();
      oversized_records_ = oversized->records;
    } else if (received_.Valid()) {
      parsed = grpc::SerializationTraits<v1::StreamRequest>::Deserialize(&received_, &request_);
    } else {
      request_.Clear();  // a zero-length message: an empty StreamRequest
    }
    if (raw) RecordReceived(*raw, recv_unix_us, parsed.ok());
    if (!parsed.ok()) {
      FailStream(kMalformedRequest,
                 absl::StrCat("the message is not a StreamRequest (", received_bytes,
                              " bytes): not protobuf, or a string field (run_id, job, a "
                              "label, probe_id) that is not valid UTF-8"));
      return;
    }
    switch (request_.kind_case()) {
      case v1::StreamRequest::kHello:
        HandleHello();
        break;
      case v1::StreamRequest::kBatch:
        HandleBatch();
        break;
      case v1::StreamRequest::KIND_NOT_SET:
        FailStream(reason::kEmptyRequest, "StreamRequest carries neither hello nor batch");
        break;
    }
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    pending_writes_.pop_front();
    if (!ok) {  // the client is gone; nothing more will be delivered
      pending_writes_.clear();
      client_gone_ = true;
      if (!finish_status_) finish_status_ = grpc::Status::CANCELLED;
      reads_done_ = true;
    }
    if (!pending_writes_.empty()) {
      StartWrite(&pending_writes_.front());
      return;
    }
    MaybeFinishLocked();
  }

  void OnCancel() override {}

  // Rank ownership (IngestService::ClaimRank, with the service's ranks_mu_
  // held, so this stream is not deleted meanwhile): when this stream was last
  // active (now while a batch of it is parked or in process); nullopt when
  // it is ending, so that it no longer holds its rank.
  std::optional<std::chrono::steady_clock::time_point> ActiveAt(
      std::chrono::steady_clock::time_point now) {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_ || finish_status_ || revoked_) return std::nullopt;
    if (parked_ || !unacked_.empty()) return now;
    return last_activity_;
  }

  // Another stream took this one's rank over: its goodbye no longer counts
  // and its next batch ends it. Returns its sender for the lifecycle's
  // stream close when that is still to be reported.
  std::optional<IngestService::RevokedSender> Revoke() {
    revoked_ = true;
    if (!lifecycle_open_.exchange(false)) return std::nullopt;
    return IngestService::RevokedSender{context_->run_id, context_->rank, lifecycle_sender_};
  }

  void OnDone() override {
    SetReserved(0);
    service_.StreamDone(this);
    if (recording_) service_.recorder_->Close(session_);
    // The rank first: once it is released no other stream can revoke this one.
    if (holds_rank_) service_.ReleaseRank(this, context_->run_id, context_->rank);
    if (lifecycle_open_.exchange(false)) {
      service_.lifecycle_->OnStreamClosed(context_->run_id, context_->rank, lifecycle_sender_);
    }
    if (context_) service_.ReleaseRun(context_->run_id);
    if (!tenant_.empty()) service_.ReleaseTenant(tenant_);
    service_.metrics_.ingest_active_streams.Add({}).Decrement();
    service_.open_streams_.fetch_sub(1);
    delete this;
  }

 private:
  // The next message, with room reserved for it: a stream whose last
  // message was large is expected to send another like it, which the
  // transport assembles whole before ingest sees it. (Its parsed copy
  // exists only while a gRPC thread parses it: a few at once, not one per
  // stream, so it is left to the bound's slack.)
  void ReadNext() {
    const int64_t expected = last_message_bytes_ >= MemoryGuard::kFreshCheckBytes
                                 ? last_message_bytes_ : 0;
    SetReserved(expected);
    StartRead(&received_);
  }

  void SetReserved(int64_t bytes) {
    const int64_t before = reserved_bytes_.exchange(bytes);
    if (service_.memory_ != nullptr && bytes != before) {
      service_.memory_->AdjustReserved(bytes - before);
    }
  }

  // The first message names the file: run and rank from its Hello (a stream
  // that starts otherwise is recorded too, as run "unknown").
  void RecordReceived(const grpc::ByteBuffer& raw, int64_t recv_unix_us, bool parsed) {
    StreamRecorder& recorder = *service_.recorder_;
    const bool first = !recording_;
    if (first) {
      const bool hello = parsed && request_.kind_case() == v1::StreamRequest::kHello;
      recorder.Open(session_, StreamRecorder::FileName(
                                  recv_unix_us, hello ? request_.hello().run_id() : "",
                                  hello ? request_.hello().rank() : -1, session_));
      recording_ = true;
    }
    if (!recorder.Record(session_, raw, recv_unix_us, /*force=*/first) && !drop_logged_) {
      drop_logged_ = true;
      spdlog::warn("stream {}: the recorder is behind (--record_dir on a slow disk?); dropping "
                   "messages from the recording of this stream",
                   session_);
    }
  }

  void HandleHello() {
    if (context_) {
      FailStream(reason::kDuplicateHello, "a stream sends exactly one Hello, first");
      return;
    }
    if (auto rejection = ValidateHello(request_.hello(), service_.limits_)) {
      FailStream(rejection->code, rejection->detail);
      return;
    }
    // --token_file: the stream's token must grant ingest for the Hello's run.
    if (absl::Status allowed = access_.Check(request_.hello().run_id(), Right::kIngest);
        !allowed.ok()) {
      DenyStream(allowed);
      return;
    }
    // --max_streams_per_tenant without --token_file: the tenant is the run.
    if (tenant_.empty() && service_.tenant_limit_ > 0 && service_.authorizer_ == nullptr) {
      std::string tenant = absl::StrCat("run '", request_.hello().run_id(), "'");
      if (!service_.AcquireTenant(tenant)) {
        call_->AddTrailingMetadata("retry-after-ms",
                                   std::to_string(IngestService::kRetryAfterMs));
        RefuseStream(reason::kTooManyStreamsForTenant,
                     absl::StrCat(tenant, " already has ", service_.tenant_limit_,
                                  " ingest streams open (--max_streams_per_tenant; without "
                                  "--token_file a tenant is a run_id); retry after ",
                                  IngestService::kRetryAfterMs,
                                  " ms (trailing metadata retry-after-ms)"));
        return;
      }
      tenant_ = std::move(tenant);
    }
    // --max_runs, shared per tenant: the token, or without tokens the job.
    const std::string run_tenant = service_.authorizer_ != nullptr
                                       ? absl::StrCat("token ", access_.name())
                                       : RunTenantOfJob(request_.hello().job());
    std::string counted_in;  // the tenant whose share the run counts in
    if (auto refused = service_.AdmitRun(request_.hello().run_id(), run_tenant, counted_in)) {
      call_->AddTrailingMetadata("retry-after-ms", std::to_string(IngestService::kRetryAfterMs));
      RefuseStream(refused->code,
                   absl::StrCat(refused->detail, "; retry after ", IngestService::kRetryAfterMs,
                                " ms (trailing metadata retry-after-ms)"));
      return;
    }
    const v1::Hello& hello = request_.hello();
    context_.emplace();  // from here on, OnDone releases the run
    context_->run_id = hello.run_id();
    context_->job = hello.job();
    context_->rank = hello.rank();
    context_->world_size = WorldSizeOf(hello);
    context_->model = hello.model();
    lifecycle_sender_ = hello.first_seq() > 0 ? hello.sender_id() : 0;
    // The world size the run's attempt declared: no other client raises it
    // (a run waiting for ranks that do not exist would never end).
    if (service_.lifecycle_ != nullptr) {
      if (auto conflict = service_.lifecycle_->WorldSizeConflict(
              context_->run_id, context_->rank, lifecycle_sender_, context_->world_size)) {
        FailStream(reason::kWorldSizeConflict, *conflict, grpc::StatusCode::FAILED_PRECONDITION);
        return;
      }
    }
    // Rank ownership: a rank belongs to the live stream that holds it.
    std::vector<IngestService::RevokedSender> revoked;
    if (auto in_use = service_.ClaimRank(this, context_->run_id, context_->rank,
                                         lifecycle_sender_, access_.name(), revoked)) {
      call_->AddTrailingMetadata("retry-after-ms", std::to_string(IngestService::kRetryAfterMs));
      service_.metrics_.CountRejection(reason::kRankInUse);
      service_.LogRefusal(reason::kRankInUse, *in_use);
      std::lock_guard<std::mutex> lock(mu_);
      reads_done_ = true;
      finish_status_ = grpc::Status(
          grpc::StatusCode::ALREADY_EXISTS,
          absl::StrCat(reason::kRankInUse, ": ", *in_use, "; retry after ",
                       IngestService::kRetryAfterMs, " ms (trailing metadata retry-after-ms)"));
      MaybeFinishLocked();
      return;
    }
    holds_rank_ = true;
    if (service_.lifecycle_ != nullptr) {
      for (const IngestService::RevokedSender& gone : revoked) {
        spdlog::info("run {} rank {}: a stream of sender {} no longer holds the rank (its own "
                     "reconnect, or idle past --rank_takeover_grace_ms)",
                     gone.run, gone.rank, gone.sender);
        service_.lifecycle_->OnStreamClosed(gone.run, gone.rank, gone.sender);
      }
    }
    service_.on_hello_(hello);
    // Hello.first_seq: seqs are per sender and resends are deduplicated.
    dedup_ = service_.delivery_ != nullptr && hello.first_seq() > 0;
    if (dedup_) {
      sender_ = DeliveryTracker::Sender{hello.run_id(), hello.rank(), hello.sender_id()};
      service_.delivery_->OnHello(sender_, hello.first_seq());
    }
    if (service_.lifecycle_ != nullptr) {
      // Before the HelloAck: a restart has closed the old attempt's alerts
      // by the time the client learns it is connected.
      service_.lifecycle_->OnHello(context_->run_id, context_->rank, lifecycle_sender_,
                                   context_->world_size, counted_in);
      lifecycle_registered_ = true;
      lifecycle_open_ = true;
      // Taken over meanwhile: the stream close is this thread's to report.
      if (revoked_ && lifecycle_open_.exchange(false)) {
        service_.lifecycle_->OnStreamClosed(context_->run_id, context_->rank, lifecycle_sender_);
      }
    }
    spdlog::info("stream {} opened: run={} job={} rank={}", session_, context_->run_id,
                 context_->job, context_->rank);

    v1::StreamResponse response;
    response.mutable_hello_ack()->set_session_id(absl::StrCat("s", session_));
    Write(response);
    ReadNext();
  }

  void HandleBatch() {
    if (!context_) {
      FailStream(reason::kBatchBeforeHello, "the first message of a stream must be a Hello");
      return;
    }
    if (revoked_) {
      // Its rank changed hands: not processed, not acked (a reconnect of the
      // same sender resends it; anyone else is refused at its Hello).
      request_.Clear();
      service_.metrics_.CountRejection(reason::kRankInUse);
      const std::string detail = absl::StrCat(
          "rank ", context_->rank, " of run '", context_->run_id,
          "' was taken over by a newer stream (this sender's reconnect, or another sender after "
          "this stream was idle for --rank_takeover_grace_ms); this stream ends");
      service_.LogRefusal(reason::kRankInUse, detail);
      call_->AddTrailingMetadata("retry-after-ms", std::to_string(IngestService::kRetryAfterMs));
      std::lock_guard<std::mutex> lock(mu_);
      reads_done_ = true;
      finish_status_ = grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                                    absl::StrCat(reason::kRankInUse, ": ", detail));
      MaybeFinishLocked();
      return;
    }
    if (service_.store_ != nullptr) {
      if (absl::Status health = service_.store_->WriteHealth(); !health.ok()) {
        // Not processed, not acked: the client resends it after the hint.
        request_.Clear();
        RefuseForStore(health);
        return;
      }
    }
    DaemonMetrics& metrics = service_.metrics_;
    v1::Batch& batch = *request_.mutable_batch();
    const size_t batch_bytes = batch.ByteSizeLong();
    metrics.ingest_bytes_total.Add({}).Increment(static_cast<double>(batch_bytes));
    // At --max_memory_mb, probes (QK and router samples: the large records
    // and the detector state they grow) are refused record by record, and
    // everything else (step scalars, curvature: a few bytes each) is still
    // accepted, so that one client's flood of probes cannot stop every run's
    // loss curve. The refused records' memory goes with request_.Clear().
    // A curvature per-layer value is 8 bytes on the wire and a series in
    // memory: the guard weighs it at what the state budget counts, so that a
    // batch of them gets the fresh check a large batch of probes gets.
    int64_t admission_bytes = static_cast<int64_t>(batch_bytes);
    for (const v1::Record& record : batch.records()) {
      if (record.payload_case() == v1::Record::kCurvature) {
        admission_bytes += record.curvature().layer_rayleigh_size() * kCurvatureValueBytes;
      }
    }
    const bool refuse_probes =
        service_.memory_ != nullptr && !service_.memory_->AdmitProbes(admission_bytes);
    std::string memory_detail;  // set when probes of this batch are refused

    ack_ = v1::StreamResponse();
    v1::Ack& ack = *ack_.mutable_ack();
    ack.set_seq(batch.seq());
    items_.clear();
    item_index_.clear();
    size_t bytes = 0;

    // Records of the batch: those parsed, or of one over --max_records_per_batch.
    const int64_t records = oversized_records_.value_or(batch.records_size());
    if (last_seq_ && batch.seq() <= *last_seq_) {
      const std::string detail =
          absl::StrCat("batch seq ", batch.seq(), " is not above the previous ", *last_seq_);
      AddRejections(ack, 0, records, reason::kNonIncreasingSeq,
                    absl::StrCat(reason::kNonIncreasingSeq, ": ", detail));
      metrics.CountRejection(reason::kNonIncreasingSeq, std::max<int64_t>(1, records));
    } else if (last_seq_ = batch.seq(); dedup_ && BeginDedup(batch, records)) {
      // A resend of a batch already stored (or being stored): acked, not stored again.
      batch_goodbye_ = batch.has_goodbye();  // applied again: a no-op if it was
    } else if (oversized_records_) {
      batch_goodbye_ = batch.has_goodbye();
      AddRejections(ack, 0, records, reason::kTooManyRecords,
                    absl::StrCat(reason::kTooManyRecords, ": the batch has ", records,
                                 " records; the limit is ",
                                 service_.limits_.max_records_per_batch,
                                 " (--max_records_per_batch): send smaller batches"));
      metrics.CountRejection(reason::kTooManyRecords, records);
    } else {
      batch_goodbye_ = batch.has_goodbye();
      bool raised_max_step = false;  // run_max_step_ grew: tell the service once
      int64_t min_step = std::numeric_limits<int64_t>::max();
      int64_t max_step = -1;
      for (int i = 0; i < batch.records_size(); ++i) {
        if (refuse_probes && RefusedAtMemoryBound(batch.records(i))) {
          if (memory_detail.empty()) {
            memory_detail = absl::StrCat(reason::kMemoryLimit,
                                         ": probes and curvature per-layer values are refused "
                                         "while ",
                                         service_.MemoryLimitDetail(),
                                         "; step scalars and curvature without layer_rayleigh "
                                         "are still accepted");
          }
          AddRejection(ack, i, reason::kMemoryLimit, memory_detail);
          metrics.CountRejection(reason::kMemoryLimit);
          continue;
        }
        WorkItem item;
        auto rejection = ValidateRecord(*batch.mutable_records(i), *context_, service_.limits_,
                                        item.sample);
        if (!rejection) rejection = CheckStep(item.sample.step);
        if (!rejection) rejection = CheckProbeId(item.sample);
        if (rejection) {
          AddRejection(ack, i, rejection->code, rejection->ToString());
          metrics.CountRejection(rejection->code);
          continue;
        }
        if (item.sample.step > run_max_step_) {
          run_max_step_ = item.sample.step;
          raised_max_step = true;
        }
        min_step = std::min(min_step, item.sample.step);
        max_step = std::max(max_step, item.sample.step);
        items_.push_back(std::move(item));
        item_index_.push_back(i);
      }
      if (raised_max_step) service_.NoteStep(context_->run_id, run_max_step_, rank_established_);
      // A new attempt's first records say where it resumed; the run is
      // rewound before they are dispatched.
      if (!items_.empty() && lifecycle_registered_) {
        service_.lifecycle_->BeforeRecords(context_->run_id, context_->rank, lifecycle_sender_,
                                           min_step, max_step);
      }
      // After the rewind, which forgets the previous attempt's state.
      AdmitState(ack);
      for (WorkItem& item : items_) {
        metrics.records_accepted(item.sample.kind()).Increment();
        item.bytes = SampleBytes(item.sample);
        bytes += item.bytes;
      }
    }
    ack.set_accepted(static_cast<uint32_t>(items_.size()));
    request_.Clear();

    if (items_.empty()) {
      Admitted();
      return;
    }
    batch_bytes_ = bytes;
    {
      std::lock_guard<std::mutex> lock(mu_);
      parked_ = true;
    }
    // Counted as waiting first: a worker may resume the stream (and decrement)
    // before Acquire even returns.
    metrics.streams_waiting_for_queue.Add({}).Increment();
    if (service_.gate_.Acquire(bytes, [this] { Resume(); })) {
      metrics.streams_waiting_for_queue.Add({}).Decrement();
      Admitted();
    }
  }

  // --max_state_mb_per_run: drops from items_ the probes that would grow the
  // run's detector state past its budget (their memory goes with them).
  void AdmitState(v1::Ack& ack) {
    StateBudget* budget = service_.state_budget_;
    if (budget == nullptr) return;
    size_t kept = 0;
    for (size_t j = 0; j < items_.size(); ++j) {
      std::optional<std::string> refusal;
      auto footprint = detectors::RetainedBy(items_[j].sample, service_.pool_.options());
      if (!footprint) footprint = CurvatureFootprint(items_[j].sample);
      if (footprint) refusal = budget->Admit(context_->run_id, *footprint);
      if (refusal) {
        AddRejection(ack, item_index_[j], reason::kStateLimit,
                     absl::StrCat(reason::kStateLimit, ": ", *refusal));
        service_.metrics_.CountRejection(reason::kStateLimit);
        continue;
      }
      if (kept != j) items_[kept] = std::move(items_[j]);
      ++kept;
    }
    items_.resize(kept);
  }

  static bool IsProbe(const v1::Record& record) {
    return record.payload_case() == v1::Record::kQk || record.payload_case() == v1::Record::kRouter;
  }

  // What --max_memory_mb refuses: probes, and curvature records with
  // per-layer values (each value a series of its own, up to --max_layers of
  // them); not step scalars nor curvature's few run-level values.
  static bool RefusedAtMemoryBound(const v1::Record& record) {
    return IsProbe(record) || (record.payload_case() == v1::Record::kCurvature &&
                               record.curvature().layer_rayleigh_size() > 0);
  }

  // --max_step_jump: a step more than that beyond the run's highest accepted
  // step (0 before the first) is refused, so that one corrupt step cannot
  // become the run's last and make every real later step look stale. The
  // stream's own view of the run's highest step is a lower bound; the
  // service is asked only when a step looks too far ahead of it.
  std::optional<Rejection> CheckStep(int64_t step) {
    if (!rank_established_) {
      if (auto ahead = service_.AdmitLateJoinerStep(context_->run_id, context_->rank, step,
                                                    rank_established_)) {
        return ahead;
      }
    }
    const int64_t jump = service_.limits_.max_step_jump;
    if (jump <= 0) return std::nullopt;
    // step >= 0 (negative_step is checked first): no overflow.
    auto too_far = [&] { return step - std::max<int64_t>(run_max_step_, 0) > jump; };
    if (!too_far()) return std::nullopt;
    run_max_step_ = std::max(run_max_step_, service_.RunMaxStep(context_->run_id));
    if (!too_far()) return std::nullopt;
    return Rejection{reason::kStepOutOfRange,
                     absl::StrCat("step ", step, " is more than ", jump,
                                  " beyond the highest step accepted for run '",
                                  context_->run_id, "' (", std::max<int64_t>(run_max_step_, 0),
                                  "; --max_step_jump): a corrupt step or a counter that is not "
                                  "the training step")};
  }

  // --max_probe_ids_per_run; this stream remembers the probe_ids it got
  // admitted, so the service's lock is taken once per new one.
  std::optional<Rejection> CheckProbeId(const detectors::Sample& sample) {
    const std::string* probe_id = nullptr;
    if (const auto* qk = std::get_if<detectors::QKSample>(&sample.payload)) probe_id = &qk->probe_id;
    if (const auto* r = std::get_if<detectors::RouterSample>(&sample.payload)) probe_id = &r->probe_id;
    if (probe_id == nullptr || admitted_probe_ids_.count(*probe_id)) return std::nullopt;
    if (!service_.AdmitProbeId(context_->run_id, *probe_id)) {
      return Rejection{reason::kTooManyProbeIds,
                       absl::StrCat("run '", context_->run_id, "' already uses ",
                                    service_.limits_.max_probe_ids_per_run,
                                    " probe_ids (--max_probe_ids_per_run); a probe_id names a "
                                    "fixed probe batch, not a step")};
    }
    admitted_probe_ids_.insert(*probe_id);
    return std::nullopt;
  }

  // Called from the worker thread that freed room for this parked stream.
  void Resume() {
    service_.metrics_.streams_waiting_for_queue.Add({}).Decrement();
    Admitted();
  }

  // For a dedup stream: true when the batch is a resend (Admitted queues its
  // ack, done once the batch is stored), false when it is new.
  bool BeginDedup(const v1::Batch& batch, int64_t records) {
    auto wait = std::make_shared<DuplicateWait>();
    const auto admission = service_.delivery_->Begin(
        sender_, batch.seq(), [this, wait](bool committed) {
          std::optional<uint64_t> ticket;
          {
            std::lock_guard<std::mutex> lock(wait->mu);
            wait->settled = true;
            wait->committed = committed;
            ticket = wait->ticket;
          }
          if (ticket) AckDone(*ticket, wait->Outcome());
        });
    if (admission == DeliveryTracker::Admission::kNew) {
      dedup_seq_ = batch.seq();
      return false;
    }
    service_.metrics_.ingest_duplicate_batches_total.Add({}).Increment();
    if (admission == DeliveryTracker::Admission::kDuplicate) wait->settled = true;
    duplicate_ = wait;
    duplicate_records_ = static_cast<uint32_t>(records);
    return true;
  }

  void Admitted() {
    if (duplicate_) {  // a resend: acked once the first copy is stored
      std::shared_ptr<DuplicateWait> wait = std::exchange(duplicate_, nullptr);
      ack_.mutable_ack()->set_duplicates(duplicate_records_);
      const uint64_t ticket = QueueAck(std::move(ack_), /*done=*/false);
      bool settled = false;
      {
        std::lock_guard<std::mutex> lock(wait->mu);
        wait->ticket = ticket;
        settled = wait->settled;
      }
      if (settled) AckDone(ticket, wait->Outcome());
      FinishAdmission();
      return;
    }
    if (dedup_ && dedup_seq_) {
      // Dedup: the batch's points and its mark are stored together, then acked.
      const uint64_t seq = *std::exchange(dedup_seq_, std::nullopt);
      const uint64_t ticket = QueueAck(std::move(ack_), /*done=*/false);
      DeliveryTracker* delivery = service_.delivery_;
      if (items_.empty()) {
        AckDone(ticket, delivery->Commit(sender_, seq, {}));
      } else {
        auto completion = std::make_shared<BatchCompletion>(static_cast<int>(items_.size()),
                                                            std::function<void()>());
        completion->collect_points = true;
        completion->done = [this, ticket, seq, delivery, c = completion.get()] {
          std::vector<KeyedPoint> points;
          {
            std::lock_guard<std::mutex> lock(c->points_mu);
            points.swap(c->points);
          }
          // A sample whose points could not be collected failed already.
          absl::Status stored = c->Failure();
          if (stored.ok()) {
            stored = delivery->Commit(sender_, seq, points);
          } else {
            delivery->Abort(sender_, seq);
          }
          AckDone(ticket, stored);
        };
        for (WorkItem& item : items_) item.completion = completion;
        service_.pool_.Dispatch(std::move(items_));
        items_.clear();
      }
      FinishAdmission();
      return;
    }
    const uint64_t ticket = QueueAck(std::move(ack_), /*done=*/items_.empty());
    if (!items_.empty()) {
      // The last worker to finish one of the batch's samples releases its ack.
      auto completion = std::make_shared<BatchCompletion>(static_cast<int>(items_.size()),
                                                          std::function<void()>());
      completion->done = [this, ticket, c = completion.get()] { AckDone(ticket, c->Failure()); };
      for (WorkItem& item : items_) item.completion = completion;
      service_.pool_.Dispatch(std::move(items_));
      items_.clear();
    }
    FinishAdmission();
  }

  void FinishAdmission() {
    std::optional<grpc::Status> finish;
    {
      std::lock_guard<std::mutex> lock(mu_);
      parked_ = false;
      if (finish_status_) {  // the client went away while this stream was parked
        finish = TakeFinishLocked();
        if (!finish) return;  // another thread finishes it; `this` may be gone after unlock
      }
    }
    if (finish) {
      Finish(*finish);
      return;
    }
    ReadNext();
  }

  // For code on worker threads: decides under the lock whether this thread
  // finishes the stream; the caller then calls Finish after unlocking and must
  // not touch the reactor otherwise, since once the lock is released another
  // thread may finish it and OnDone delete it.
  std::optional<grpc::Status> TakeFinishLocked() {
    if (!ReadyToFinishLocked()) return std::nullopt;
    finished_ = true;
    return *finish_status_;
  }

  // Acks wait here, in the order of their batches, until they are done.
  uint64_t QueueAck(v1::StreamResponse ack, bool done) {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t ticket = next_ticket_++;
    unacked_.push_back(PendingAck{ticket, std::move(ack), done, absl::OkStatus(),
                                  std::exchange(batch_goodbye_, false)});
    if (done) FlushAcksLocked();
    return ticket;
  }

  // Called on a worker thread when the batch's last sample is stored, or
  // (`stored` not OK) when the store refused its points.
  void AckDone(uint64_t ticket, absl::Status stored = absl::OkStatus()) {
    std::optional<grpc::Status> finish;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (PendingAck& pending : unacked_) {
        if (pending.ticket == ticket) {
          pending.done = true;
          pending.stored = std::move(stored);
        }
      }
      FlushAcksLocked();
      finish = TakeFinishLocked();
    }
    if (finish) Finish(*finish);
  }

  // Acks go out in order. A batch the store refused is never acked: the
  // stream ends there (RESOURCE_EXHAUSTED disk_full or UNAVAILABLE
  // store_unavailable, retry-after-ms) and no later ack goes out, so the
  // client resends everything from it on.
  void FlushAcksLocked() {
    while (!unacked_.empty() && unacked_.front().done) {
      PendingAck& front = unacked_.front();
      if (!front.stored.ok() && !store_refused_) {
        store_refused_ = true;
        const bool full = front.stored.code() == absl::StatusCode::kResourceExhausted;
        const char* code = full ? reason::kDiskFull : reason::kStoreUnavailable;
        const std::string detail = StoreRefusalDetail(front.stored);
        service_.metrics_.CountRejection(code, std::max<int>(1, front.response.ack().accepted()));
        service_.LogRefusal(code, detail);
        if (!finished_) {
          call_->AddTrailingMetadata("retry-after-ms", std::to_string(IngestService::kRetryAfterMs));
        }
        reads_done_ = true;
        finish_status_ = grpc::Status(
            full ? grpc::StatusCode::RESOURCE_EXHAUSTED : grpc::StatusCode::UNAVAILABLE,
            absl::StrCat(code, ": ", detail));
      }
      if (!store_refused_ && front.goodbye && lifecycle_registered_ && revoked_) {
        spdlog::warn("run {} rank {}: a goodbye from sender {}, which no longer holds the rank, "
                     "does not count",
                     context_->run_id, context_->rank, lifecycle_sender_);
      } else if (!store_refused_ && front.goodbye && lifecycle_registered_) {
        // Everything this sender sent before is processed: its goodbye
        // counts now, before the Ack tells the client so.
        service_.lifecycle_->OnGoodbye(context_->run_id, context_->rank, lifecycle_sender_);
      }
      if (!store_refused_) WriteLocked(front.response);
      unacked_.pop_front();
    }
  }

  static std::string StoreRefusalDetail(const absl::Status& status) {
    return absl::StrCat("the daemon could not store the batch (", status.message(),
                        "); not acknowledged, retry after ", IngestService::kRetryAfterMs,
                        " ms (trailing metadata retry-after-ms)");
  }

  // Before processing: the store is failing, so the batch is refused now.
  void RefuseForStore(const absl::Status& health) {
    const bool full = health.code() == absl::StatusCode::kResourceExhausted;
    const char* code = full ? reason::kDiskFull : reason::kStoreUnavailable;
    const std::string detail = StoreRefusalDetail(health);
    service_.metrics_.CountRejection(code);
    service_.LogRefusal(code, detail);
    call_->AddTrailingMetadata("retry-after-ms", std::to_string(IngestService::kRetryAfterMs));
    std::lock_guard<std::mutex> lock(mu_);
    reads_done_ = true;
    finish_status_ = grpc::Status(
        full ? grpc::StatusCode::RESOURCE_EXHAUSTED : grpc::StatusCode::UNAVAILABLE,
        absl::StrCat(code, ": ", detail));
    MaybeFinishLocked();
  }

  // Ends the stream with INVALID_ARGUMENT (or `status`) once queued acks are written.
  void FailStream(std::string_view code, const std::string& detail,
                  grpc::StatusCode status = grpc::StatusCode::INVALID_ARGUMENT) {
    service_.metrics_.CountRejection(code);
    spdlog::warn("stream {} rejected: {}: {}", session_, code, detail);
    std::lock_guard<std::mutex> lock(mu_);
    reads_done_ = true;
    finish_status_ = grpc::Status(status, std::string(code) + ": " + detail);
    MaybeFinishLocked();
  }

  // Ends the stream with UNAUTHENTICATED or PERMISSION_DENIED (counted by
  // AccessCheck). The log names the grant, never the token.
  void DenyStream(const absl::Status& status) {
    spdlog::warn("stream {} refused ({}): {}", session_, access_.name(),
                 std::string(status.message()));
    std::lock_guard<std::mutex> lock(mu_);
    reads_done_ = true;
    finish_status_ = grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                                  std::string(status.message()));
    MaybeFinishLocked();
  }

  // Ends the stream with RESOURCE_EXHAUSTED (a limit, not a bad client).
  void RefuseStream(std::string_view code, const std::string& detail) {
    service_.metrics_.CountRejection(code);
    service_.LogRefusal(code, detail);
    std::lock_guard<std::mutex> lock(mu_);
    reads_done_ = true;
    finish_status_ =
        grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, std::string(code) + ": " + detail);
    MaybeFinishLocked();
  }

  void Write(const v1::StreamResponse& response) {
    std::lock_guard<std::mutex> lock(mu_);
    WriteLocked(response);
  }

  void WriteLocked(const v1::StreamResponse& response) {
    last_activity_ = std::chrono::steady_clock::now();  // --stream_idle_timeout_ms counts from here
    // Acks of accepted batches still go out after a rejection ends the stream
    // (the client learns what was stored); nothing does once the client is gone.
    if (finished_ || client_gone_) return;
    grpc::ByteBuffer bytes;
    bool own_buffer = false;
    grpc::SerializationTraits<v1::StreamResponse>::Serialize(response, &bytes, &own_buffer);
    pending_writes_.push_back(std::move(bytes));
    if (pending_writes_.size() == 1) StartWrite(&pending_writes_.front());
  }

  bool ReadyToFinishLocked() const {
    return !finished_ && reads_done_ && !parked_ && unacked_.empty() && pending_writes_.empty() &&
           finish_status_.has_value();
  }

  // Only from gRPC reactions (OnReadDone, OnWriteDone): OnDone cannot run
  // before they return.
  void MaybeFinishLocked() {
    if (!ReadyToFinishLocked()) return;
    finished_ = true;
    Finish(*finish_status_);
  }

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
  std::optional<StreamContext> context_;
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

std::optional<Rejection> IngestService::AdmitRun(const std::string& run_id,
                                                 const std::string& tenant,
                                                 std::string& counted_in) {
  std::lock_guard<std::mutex> lock(runs_mu_);
  const auto now = std::chrono::steady_clock::now();
  if (auto it = runs_.find(run_id); it != runs_.end()) {
    ++it->second.open_streams;
    it->second.last_seen = now;
    if (it->second.tenant.empty()) it->second.tenant = tenant;
    counted_in = it->second.tenant;
    return std::nullopt;
  }
  auto tenant_runs = [&] {
    return std::count_if(runs_.begin(), runs_.end(),
                         [&](const auto& entry) { return entry.second.tenant == tenant; });
  };
  const bool total_full =
      limits_.max_runs > 0 && static_cast<int64_t>(runs_.size()) >= limits_.max_runs;
  if (total_full || (tenant_run_limit_ > 0 && tenant_runs() >= tenant_run_limit_)) {
    PruneRunsLocked(now);
  }
  // The tenant's share first: a tenant at its share is told so, whatever the total.
  if (tenant_run_limit_ > 0) {
    if (const int64_t held = tenant_runs(); held >= tenant_run_limit_) {
      return Rejection{reason::kTooManyRunsForTenant,
                       absl::StrCat(tenant, " already has ", held, " runs (--max_runs_per_tenant=",
                                    tenant_run_limit_, "); run '", run_id,
                                    "' is refused. A run stops counting once it has no stream "
                                    "open for ",
                                    std::chrono::duration_cast<std::chrono::seconds>(
                                        limits_.empty_run_release)
                                        .count(),
                                    " s without a sample stored, or for 24 h")};
    }
  }
  if (limits_.max_runs > 0 && static_cast<int64_t>(runs_.size()) >= limits_.max_runs) {
    return Rejection{reason::kTooManyRuns,
                     absl::StrCat("the daemon already serves ", limits_.max_runs,
                                  " runs (--max_runs); run '", run_id, "' is refused")};
  }
  RunSlot slot;
  slot.open_streams = 1;
  slot.last_seen = now;
  slot.tenant = tenant;
  counted_in = tenant;
  runs_.emplace(run_id, std::move(slot));
  return std::nullopt;
}

void IngestService::ReleaseRun(const std::string& run_id) {
  std::lock_guard<std::mutex> lock(runs_mu_);
  if (auto it = runs_.find(run_id); it != runs_.end()) {
    it->second.open_streams = std::max(0, it->second.open_streams - 1);
    it->second.last_seen = std::chrono::steady_clock::now();
  }
}

void IngestService::PruneRunsLocked(std::chrono::steady_clock::time_point now) {
  std::erase_if(runs_, [&](const auto& entry) {
    const RunSlot& run = entry.second;
    if (run.open_streams > 0) return false;
    const auto idle = now - run.last_seen;
    return (run.max_step < 0 && idle >= limits_.empty_run_release) || idle > kIdleRunRelease;
  });
}

std::optional<std::string> IngestService::ClaimRank(IngestReactor* stream,
                                                    const std::string& run_id, int32_t rank,
                                                    uint64_t sender, const std::string& grant,
                                                    std::vector<RevokedSender>& revoked) {
  std::lock_guard<std::mutex> lock(ranks_mu_);
  const auto now = std::chrono::steady_clock::now();
  const auto key = std::make_pair(run_id, rank);
  auto it = rank_holders_.find(key);
  if (it != rank_holders_.end()) {
    RankHolder& holder = it->second;
    const std::optional<std::chrono::steady_clock::time_point> active = holder.stream->ActiveAt(now);
    const bool live = active && now - *active < limits_.rank_takeover_grace;
    if (live && (holder.sender != sender || holder.grant != grant)) {
      const int64_t idle_ms =
          std::chrono::duration_cast<std::chrono::milliseconds>(now - *active).count();
      return absl::StrCat("rank ", rank, " of run '", run_id,
                          "' is held by another sender's open stream (last active ", idle_ms,
                          " ms ago); it is free once that stream ends or is idle for ",
                          limits_.rank_takeover_grace.count(),
                          " ms (--rank_takeover_grace_ms). Two processes with one rank, or a "
                          "restarted process whose predecessor's connection has not ended yet");
    }
    // The holder's own reconnect, or a holder that is gone: the rank changes hands.
    const bool new_sender = holder.sender != sender || holder.grant != grant;
    if (auto closed = holder.stream->Revoke()) revoked.push_back(*closed);
    // A new process after the holder's host vanished: the run's other holders
    // idle past the grace are gone too (the whole job restarted).
    for (auto& [other_key, other] : rank_holders_) {
      if (!new_sender) break;
      if (other_key.first != run_id || other_key.second == rank) continue;
      const auto other_active = other.stream->ActiveAt(now);
      if (other_active && now - *other_active < limits_.rank_takeover_grace) continue;
      if (auto closed = other.stream->Revoke()) revoked.push_back(*closed);
    }
  }
  rank_holders_[key] = RankHolder{stream, sender, grant};
  return std::nullopt;
}

void IngestService::ReleaseRank(IngestReactor* stream, const std::string& run_id, int32_t rank) {
  std::lock_guard<std::mutex> lock(ranks_mu_);
  auto it = rank_holders_.find({run_id, rank});
  if (it != rank_holders_.end() && it->second.stream == stream) rank_holders_.erase(it);
}

bool IngestService::AdmitProbeId(const std::string& run_id, const std::string& probe_id) {
  if (limits_.max_probe_ids_per_run <= 0) return true;
  std::lock_guard<std::mutex> lock(runs_mu_);
  std::unordered_set<std::string>& ids = runs_[run_id].probe_ids;
  if (ids.count(probe_id)) return true;
  if (static_cast<int64_t>(ids.size()) >= limits_.max_probe_ids_per_run) return false;
  ids.insert(probe_id);
  return true;
}

void IngestService::NoteKnownRun(const std::string& run_id, int64_t last_step,
                                 const std::string& job, const std::string& tenant) {
  std::lock_guard<std::mutex> lock(runs_mu_);
  auto [it, _] = runs_.try_emplace(run_id, RunSlot{0, std::chrono::steady_clock::now(), {}});
  it->second.max_step = std::max(it->second.max_step, last_step);
  if (!it->second.tenant.empty()) return;
  // The tenant stored with the run (its lifecycle); for runs from before it
  // was stored, without tokens, the job of a recovered Hello.
  if (!tenant.empty()) {
    it->second.tenant = tenant;
  } else if (authorizer_ == nullptr && !job.empty()) {
    it->second.tenant = RunTenantOfJob(job);
  }
}

int64_t IngestService::RunMaxStep(const std::string& run_id) {
  std::lock_guard<std::mutex> lock(runs_mu_);
  auto it = runs_.find(run_id);
  return it == runs_.end() ? -1 : it->second.max_step;
}

void IngestService::NoteStep(const std::string& run_id, int64_t step, bool established) {
  std::lock_guard<std::mutex> lock(runs_mu_);
  RunSlot& slot = runs_[run_id];
  slot.max_step = std::max(slot.max_step, step);
  if (established) slot.established_max_step = std::max(slot.established_max_step, step);
}

std::optional<Rejection> IngestService::AdmitLateJoinerStep(const std::string& run_id,
                                                            int32_t rank, int64_t step,
                                                            bool& established) {
  std::lock_guard<std::mutex> lock(runs_mu_);
  RunSlot& slot = runs_[run_id];
  RunSlot::RankHistory& own = slot.rank_history[rank];
  if (own.steps < kLateJoinSteps && slot.established_max_step >= 0 &&
      step > slot.established_max_step + kLateJoinLeadSteps) {
    return Rejection{reason::kStepAheadOfRun,
                     absl::StrCat("step ", step, " of rank ", rank, " is more than ",
                                  kLateJoinLeadSteps, " beyond run '", run_id, "' (at step ",
                                  slot.established_max_step, ") while the rank has ", own.steps,
                                  " of the ", kLateJoinSteps,
                                  " steps of its own a rank joining a live run needs first")};
  }
  if (step > own.last_step) {
    own.last_step = step;
    ++own.steps;
  }
  if (own.steps >= kLateJoinSteps) {
    established = true;
    slot.established_max_step = std::max(slot.established_max_step, own.last_step);
  }
  return std::nullopt;
}

bool IngestService::AcquireTenant(const std::string& tenant) {
  if (tenant_limit_ <= 0) return true;
  std::lock_guard<std::mutex> lock(tenants_mu_);
  int64_t& open = tenant_streams_[tenant];
  if (open >= tenant_limit_) {
    if (open == 0) tenant_streams_.erase(tenant);
    return false;
  }
  ++open;
  return true;
}

void IngestService::ReleaseTenant(const std::string& tenant) {
  if (tenant_limit_ <= 0) return;
  std::lock_guard<std::mutex> lock(tenants_mu_);
  auto it = tenant_streams_.find(tenant);
  if (it != tenant_streams_.end() && --it->second <= 0) tenant_streams_.erase(it);
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
