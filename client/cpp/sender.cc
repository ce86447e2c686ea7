#include "foreshock/sender.h"

#include <algorithm>
#include <cstdlib>
#include <random>
#include <string_view>
#include <vector>

namespace foreshock::client {

namespace v1 = foreshock::v1;

namespace {
constexpr std::chrono::milliseconds kPoll{50};
}  // namespace

Sender::Sender(std::string endpoint, v1::Hello hello, SenderOptions options)
    : endpoint_(std::move(endpoint)),
      hello_(std::move(hello)),
      options_(std::move(options)),
      state_(options_.max_unacked_bytes) {
  // gRPC's own reconnect backoff (1 s, then growing) would add to ours after
  // a daemon restart: keep it to the same bounds.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, static_cast<int>(options_.backoff_initial.count()));
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, static_cast<int>(options_.backoff_initial.count()));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, static_cast<int>(options_.backoff_max.count()));
  channel_ = grpc::CreateCustomChannel(endpoint_, options_.credentials, args);
  stub_ = v1::Ingest::NewStub(channel_);
  thread_ = std::thread([this] { Run(); });
}

Sender::~Sender() { Close(std::chrono::milliseconds(0), CloseMode::kKeepRunOpen); }

void Sender::Enqueue(v1::Record record) {
  const size_t size = record.ByteSizeLong();
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.enqueued;
    if (closing_) {
      ++stats_.dropped_after_close;
      return;
    }
    queue_.emplace_back(std::move(record), size);
    queue_bytes_ += size;
    // Training never waits: beyond the bound the oldest records go.
    while (queue_bytes_ > options_.max_queue_bytes && !queue_.empty()) {
      queue_bytes_ -= queue_.front().second;
      queue_.pop_front();
      ++stats_.dropped_queue_full;
    }
  }
  cv_.notify_all();
}

bool Sender::Close(std::chrono::milliseconds timeout, CloseMode mode) {
  std::unique_lock<std::mutex> lock(mu_);
  // The first Close decides (the destructor's never turns a goodbye off).
  if (!closing_) goodbye_ = mode == CloseMode::kEndRun;
  closing_ = true;
  cv_.notify_all();
  const bool drained =
      cv_.wait_for(lock, timeout, [this] { return DrainedLocked() || abort_; }) && DrainedLocked();
  abort_ = true;
  if (live_context_ != nullptr) live_context_->TryCancel();
  lock.unlock();
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  return drained;
}

SenderStats Sender::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  SenderStats stats = stats_;
  stats.dropped_unacked = state_.dropped_records();
  stats.queued = queue_.size();
  stats.unacked = state_.unacked().size();
  return stats;
}

void Sender::Run() {
  std::mt19937_64 rng(std::random_device{}());
  std::chrono::milliseconds backoff = options_.backoff_initial;
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (abort_ || (closing_ && DrainedLocked())) return;
    }
    std::chrono::milliseconds hint{0};
    const bool had_hello = RunStream(&hint);
    if (!had_hello || rank_in_use_) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!had_hello) ++stats_.failed_connects;
      if (rank_in_use_) ++stats_.rank_in_use;
    }
    if (had_hello) backoff = options_.backoff_initial;
    if (idle_ended_) {
      // The daemon ended a stream with nothing pending: the next one opens
      // when there is something to send (or to flush at Close).
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return abort_ || closing_ || !DrainedLocked(); });
      continue;
    }
    // Full jitter on the upper half, so that many ranks do not reconnect in
    // lock step; a daemon at a limit says when to come back.
    const std::chrono::milliseconds base = hint.count() > 0 ? hint : backoff;
    const auto wait = std::chrono::milliseconds(
        base.count() / 2 + std::uniform_int_distribution<int64_t>(0, base.count() / 2)(rng));
    backoff = std::min(backoff * 2, options_.backoff_max);
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, wait, [this] { return abort_; });
  }
}

bool Sender::RunStream(std::chrono::milliseconds* retry_hint) {
  grpc::ClientContext context;
  if (!options_.token.empty()) context.AddMetadata("authorization", "Bearer " + options_.token);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (abort_) return false;
    live_context_ = &context;
  }
  auto stream = stub_->Stream(&context);
  v1::StreamRequest request;
  {
    std::lock_guard<std::mutex> lock(mu_);
    *request.mutable_hello() = hello_;
    request.mutable_hello()->set_first_seq(state_.first_seq());
    request.mutable_hello()->set_sender_id(state_.sender_id());
  }
  v1::StreamResponse response;
  const bool answered = stream->Write(request) && stream->Read(&response);
  const bool hello_acked = answered && response.has_hello_ack();
  // Cancel only a call that is still running (an answer that is not a
  // HelloAck): cancelling an ended call would replace the daemon's status and
  // its retry hint with CANCELLED.
  if (answered && !hello_acked) context.TryCancel();
  std::thread reader;
  bool read_side_done = false;  // under mu_: the daemon ended the stream
  if (hello_acked) {
    connected_ = true;
    {
      // Counted as documented: streams accepted after the first accepted
      // one, not connection attempts (those that fail are failed_connects).
      std::lock_guard<std::mutex> lock(mu_);
      if (ever_accepted_) ++stats_.reconnects;
      ever_accepted_ = true;
    }
    reader = std::thread([&] {
      v1::StreamResponse ack;
      while (stream->Read(&ack)) {
        if (ack.has_ack()) OnAck(ack.ack());
      }
      std::lock_guard<std::mutex> lock(mu_);
      read_side_done = true;
      cv_.notify_all();  // the writer notices the stream is gone
    });
    // Resend what earlier streams left unacknowledged, with the same seqs.
    std::vector<v1::Batch> resend;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [seq, batch] : state_.unacked()) {
        resend.push_back(batch);
        stats_.resent += static_cast<uint64_t>(batch.records_size());
      }
    }
    bool ok = true;
    for (v1::Batch& batch : resend) {
      *request.mutable_batch() = std::move(batch);
      if (!(ok = stream->Write(request))) break;
    }
    while (ok) {
      v1::Batch batch;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait_for(lock, kPoll, [&] {
          return abort_ || read_side_done || !queue_.empty() || GoodbyeDueLocked() ||
                 (closing_ && DrainedLocked());
        });
        if (abort_ || read_side_done) break;
        if (GoodbyeDueLocked()) {
          // After every queued record: the daemon applies it once this batch
          // and all earlier ones of the stream are processed.
          batch.mutable_goodbye();
          state_.Assign(batch);  // resent after a reconnect, like any batch
          goodbye_assigned_ = true;
        } else {
          if (queue_.empty()) {
            if (closing_ && DrainedLocked()) {  // drained: half-close
              lock.unlock();
              stream->WritesDone();
              break;
            }
            continue;
          }
          size_t bytes = 0;
          while (!queue_.empty() && (batch.records_size() == 0 ||
                                     bytes + queue_.front().second <= options_.max_batch_bytes)) {
            bytes += queue_.front().second;
            queue_bytes_ -= queue_.front().second;
            *batch.add_records() = std::move(queue_.front().first);
            queue_.pop_front();
          }
          state_.Assign(batch);  // keeps a copy until the Ack
          stats_.sent += static_cast<uint64_t>(batch.records_size());
        }
      }
      *request.mutable_batch() = std::move(batch);
      ok = stream->Write(request);
    }
  }
  // The writer stops when a write fails or the read side ended (the call is
  // over either way), when Close drained everything (the daemon ends the call
  // after the half-close), or on abort (Close cancelled the call).
  if (reader.joinable()) reader.join();
  const grpc::Status status = stream->Finish();
  connected_ = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    live_context_ = nullptr;
  }
  const auto& trailers = context.GetServerTrailingMetadata();
  if (auto it = trailers.find("retry-after-ms"); it != trailers.end()) {
    *retry_hint = std::chrono::milliseconds(
        std::atoll(std::string(it->second.data(), it->second.size()).c_str()));
  }
  if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
    DropTooLarge(status.error_message());
  }
  // --stream_idle_timeout_ms: the daemon acked everything it got; a batch
  // written as the stream ended stays unacked here and is resent.
  // Another sender's live stream holds the rank (docs/DESIGN.md §3.4): the
  // hint above paces the retries until the rank is free.
  rank_in_use_ = status.error_code() == grpc::StatusCode::ALREADY_EXISTS &&
                 status.error_message().rfind("rank_in_use", 0) == 0;
  idle_ended_ = status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
                status.error_message().rfind("stream_idle_timeout", 0) == 0;
  return hello_acked;
}

void Sender::OnAck(const v1::Ack& ack) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_.unacked().count(ack.seq()) == 0) return;  // settled before, or dropped
    state_.Settle(ack);
    stats_.acked += ack.accepted();
    stats_.duplicates += ack.duplicates();
    // The daemon lists at most 256 rejections and counts the rest.
    stats_.rejected += static_cast<uint64_t>(ack.rejections_size()) + ack.omitted_rejections();
  }
  cv_.notify_all();
}

void Sender::DropTooLarge(const std::string& details) {
  // "message_too_large: a message of N bytes; the limit is M (--max_message_mb)..."
  static constexpr std::string_view kCode = "message_too_large: ";
  static constexpr std::string_view kLimit = "the limit is ";
  if (details.rfind(kCode, 0) != 0) return;
  const size_t at = details.find(kLimit);
  if (at == std::string::npos) return;
  const size_t limit = std::strtoull(details.c_str() + at + kLimit.size(), nullptr, 10);
  if (limit == 0) return;
  std::unique_lock<std::mutex> lock(mu_);
  std::vector<v1::Ack> settle;
  for (const auto& [seq, batch] : state_.unacked()) {
    v1::StreamRequest request;
    *request.mutable_batch() = batch;
    if (request.ByteSizeLong() <= limit) continue;
    stats_.dropped_too_large += static_cast<uint64_t>(batch.records_size());
    settle.emplace_back().set_seq(seq);
  }
  for (const v1::Ack& ack : settle) state_.Settle(ack);
  lock.unlock();
  cv_.notify_all();  // Close may be waiting for exactly these
}

}  // namespace foreshock::client
