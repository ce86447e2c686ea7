// IngestReactor's receive side: opening a stream, reading each message,
// the Hello and a Batch's validation and admission, silence and rank
// takeover (ingest_reactor.h).
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

namespace {

int64_t NowUnixMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

IngestReactor::IngestReactor(IngestService& service, grpc::CallbackServerContext* context,
                             uint64_t session, AccessCheck access, std::string tenant)
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

std::optional<std::chrono::steady_clock::time_point> IngestReactor::CheckSilence(
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

void IngestReactor::OnReadDone(bool ok) {
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
    FailStream(reason::kMalformedRequest,
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

void IngestReactor::OnWriteDone(bool ok) {
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

std::optional<std::chrono::steady_clock::time_point> IngestReactor::ActiveAt(
    std::chrono::steady_clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_ || finish_status_ || revoked_) return std::nullopt;
  if (parked_ || !unacked_.empty()) return now;
  return last_activity_;
}

std::optional<IngestService::RevokedSender> IngestReactor::Revoke() {
  revoked_ = true;
  if (!lifecycle_open_.exchange(false)) return std::nullopt;
  return IngestService::RevokedSender{context_->run_id, context_->rank, lifecycle_sender_};
}

void IngestReactor::OnDone() {
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

void IngestReactor::ReadNext() {
  const int64_t expected = last_message_bytes_ >= MemoryGuard::kFreshCheckBytes
                               ? last_message_bytes_ : 0;
  SetReserved(expected);
  StartRead(&received_);
}

void IngestReactor::SetReserved(int64_t bytes) {
  const int64_t before = reserved_bytes_.exchange(bytes);
  if (service_.memory_ != nullptr && bytes != before) {
    service_.memory_->AdjustReserved(bytes - before);
  }
}

void IngestReactor::RecordReceived(const grpc::ByteBuffer& raw, int64_t recv_unix_us, bool parsed) {
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

void IngestReactor::HandleHello() {
  if (context_) {
    FailStream(reason::kDuplicateHello, "a stream sends exactly one Hello, first");
    return;
  }
  if (auto rejection = wire::ValidateHello(request_.hello(), service_.limits_)) {
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
                                     : IngestService::RunTenantOfJob(request_.hello().job());
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
  context_->world_size = wire::WorldSizeOf(hello);
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

void IngestReactor::HandleBatch() {
  if (!context_) {
    FailStream(reason::kBatchBeforeHello, "the first message of a stream must be a Hello");
    return;
  }
  if (revoked_) {
    EndRevokedStream();
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
    bytes = ValidateRecords(batch, ack, refuse_probes);
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

// Its rank changed hands: the batch is not processed, not acked (a reconnect
// of the same sender resends it; anyone else is refused at its Hello).
void IngestReactor::EndRevokedStream() {
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
}

// The records of a batch that is neither a resend nor over the record limit:
// each validated (the memory bound, the record, its step and probe id), the
// accepted ones queued as items_ after the run's rewind and state admission.
// Returns their bytes.
size_t IngestReactor::ValidateRecords(v1::Batch& batch, v1::Ack& ack, bool refuse_probes) {
  DaemonMetrics& metrics = service_.metrics_;
  std::string memory_detail;  // set when probes of this batch are refused
  size_t bytes = 0;
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
    auto rejection = wire::ValidateRecord(*batch.mutable_records(i), *context_, service_.limits_,
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
    item.bytes = wire::SampleBytes(item.sample);
    bytes += item.bytes;
  }
  return bytes;
}

void IngestReactor::AdmitState(v1::Ack& ack) {
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

bool IngestReactor::IsProbe(const v1::Record& record) {
  return record.payload_case() == v1::Record::kQk || record.payload_case() == v1::Record::kRouter;
}

bool IngestReactor::RefusedAtMemoryBound(const v1::Record& record) {
  return IsProbe(record) || (record.payload_case() == v1::Record::kCurvature &&
                             record.curvature().layer_rayleigh_size() > 0);
}

std::optional<wire::Rejection> IngestReactor::CheckStep(int64_t step) {
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
  return wire::Rejection{reason::kStepOutOfRange,
                   absl::StrCat("step ", step, " is more than ", jump,
                                " beyond the highest step accepted for run '",
                                context_->run_id, "' (", std::max<int64_t>(run_max_step_, 0),
                                "; --max_step_jump): a corrupt step or a counter that is not "
                                "the training step")};
}

std::optional<wire::Rejection> IngestReactor::CheckProbeId(const detectors::Sample& sample) {
  const std::string* probe_id = nullptr;
  if (const auto* qk = std::get_if<detectors::QKSample>(&sample.payload)) probe_id = &qk->probe_id;
  if (const auto* r = std::get_if<detectors::RouterSample>(&sample.payload)) probe_id = &r->probe_id;
  if (probe_id == nullptr || admitted_probe_ids_.count(*probe_id)) return std::nullopt;
  if (!service_.AdmitProbeId(context_->run_id, *probe_id)) {
    return wire::Rejection{reason::kTooManyProbeIds,
                     absl::StrCat("run '", context_->run_id, "' already uses ",
                                  service_.limits_.max_probe_ids_per_run,
                                  " probe_ids (--max_probe_ids_per_run); a probe_id names a "
                                  "fixed probe batch, not a step")};
  }
  admitted_probe_ids_.insert(*probe_id);
  return std::nullopt;
}

void IngestReactor::Resume() {
  service_.metrics_.streams_waiting_for_queue.Add({}).Decrement();
  Admitted();
}

bool IngestReactor::BeginDedup(const v1::Batch& batch, int64_t records) {
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

}  // namespace foreshock::server
