// IngestReactor's send side: a batch admitted, its ack queued and sent in
// seq order once the batch is stored, refusals, and finishing the stream
// when nothing of it is left in progress (ingest_reactor.h).
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

void IngestReactor::Admitted() {
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

void IngestReactor::FinishAdmission() {
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

std::optional<grpc::Status> IngestReactor::TakeFinishLocked() {
  if (!ReadyToFinishLocked()) return std::nullopt;
  finished_ = true;
  return *finish_status_;
}

uint64_t IngestReactor::QueueAck(v1::StreamResponse ack, bool done) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t ticket = next_ticket_++;
  unacked_.push_back(PendingAck{ticket, std::move(ack), done, absl::OkStatus(),
                                std::exchange(batch_goodbye_, false)});
  if (done) FlushAcksLocked();
  return ticket;
}

void IngestReactor::AckDone(uint64_t ticket, absl::Status stored) {
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

void IngestReactor::FlushAcksLocked() {
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

std::string IngestReactor::StoreRefusalDetail(const absl::Status& status) {
  return absl::StrCat("the daemon could not store the batch (", status.message(),
                      "); not acknowledged, retry after ", IngestService::kRetryAfterMs,
                      " ms (trailing metadata retry-after-ms)");
}

void IngestReactor::RefuseForStore(const absl::Status& health) {
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

void IngestReactor::FailStream(std::string_view code, const std::string& detail,
                               grpc::StatusCode status) {
  service_.metrics_.CountRejection(code);
  spdlog::warn("stream {} rejected: {}: {}", session_, code, detail);
  std::lock_guard<std::mutex> lock(mu_);
  reads_done_ = true;
  finish_status_ = grpc::Status(status, std::string(code) + ": " + detail);
  MaybeFinishLocked();
}

void IngestReactor::DenyStream(const absl::Status& status) {
  spdlog::warn("stream {} refused ({}): {}", session_, access_.name(),
               std::string(status.message()));
  std::lock_guard<std::mutex> lock(mu_);
  reads_done_ = true;
  finish_status_ = grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                                std::string(status.message()));
  MaybeFinishLocked();
}

void IngestReactor::RefuseStream(std::string_view code, const std::string& detail) {
  service_.metrics_.CountRejection(code);
  service_.LogRefusal(code, detail);
  std::lock_guard<std::mutex> lock(mu_);
  reads_done_ = true;
  finish_status_ =
      grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, std::string(code) + ": " + detail);
  MaybeFinishLocked();
}

void IngestReactor::Write(const v1::StreamResponse& response) {
  std::lock_guard<std::mutex> lock(mu_);
  WriteLocked(response);
}

void IngestReactor::WriteLocked(const v1::StreamResponse& response) {
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

bool IngestReactor::ReadyToFinishLocked() const {
  return !finished_ && reads_done_ && !parked_ && unacked_.empty() && pending_writes_.empty() &&
         finish_status_.has_value();
}

void IngestReactor::MaybeFinishLocked() {
  if (!ReadyToFinishLocked()) return;
  finished_ = true;
  Finish(*finish_status_);
}

}  // namespace foreshock::server
