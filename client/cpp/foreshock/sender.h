// The C++ counterpart of the Python client's background sender: training code
// calls Enqueue, which never waits on the network; one thread owns the
// foreshock.v1.Ingest stream.
//
// - Records wait in a bounded queue (max_queue_bytes); a full queue drops its
//   oldest records (counted: dropped_queue_full).
// - Records go out in Batches of up to max_batch_bytes, numbered by a
//   SenderState: every batch stays unacknowledged until its Ack (at most
//   max_unacked_bytes; beyond that the oldest are dropped, counted:
//   dropped_unacked).
// - When the stream breaks (the daemon restarts, refuses at a limit, the
//   network fails), the thread reconnects with exponential backoff and full
//   jitter, or after the daemon's retry-after-ms hint, and resends every
//   unacknowledged batch with its old seq first; the daemon deduplicates.
// - A rank another sender's live stream holds (ALREADY_EXISTS rank_in_use,
//   docs/DESIGN.md §3.4) is retried the same way until it is free (counted:
//   rank_in_use).
// - A batch over the daemon's --max_message_mb (message_too_large) is dropped,
//   not resent forever (counted: dropped_too_large).
// - A stream the daemon ended for idleness (stream_idle_timeout: nothing was
//   sent for --stream_idle_timeout_ms, and everything sent was acked) is
//   reopened only once there is something to send.
//
//   foreshock::client::Sender sender("127.0.0.1:50051", hello);
//   sender.Enqueue(record);              // in the training loop
//   sender.Close(std::chrono::seconds(10));  // and the run has ended
//
// - Close(timeout) ends by telling the daemon this sender is done with the
//   run (Batch.goodbye, after everything queued; kept and resent like any
//   batch until acked): once every sender of the run has said so, the run
//   has ended and its alerts resolve (docs/DESIGN.md §3.4). Close(timeout,
//   CloseMode::kKeepRunOpen) stops streaming without saying so (a process
//   handing the run over to another). A Sender destroyed without Close says
//   nothing either: to the daemon that looks like a crash.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "foreshock/client.h"
#include "foreshock/v1/ingest.grpc.pb.h"

namespace foreshock::client {

struct SenderOptions {
  size_t max_queue_bytes = size_t{256} << 20;   // records not yet sent
  size_t max_unacked_bytes = size_t{64} << 20;  // batches sent, not yet acked
  size_t max_batch_bytes = size_t{1} << 20;
  std::chrono::milliseconds backoff_initial{100};
  std::chrono::milliseconds backoff_max{10000};
  // TLS (grpc::SslCredentials) or plaintext; and the bearer token for
  // --token_file daemons (empty: none).
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  std::string token;
};

struct SenderStats {
  uint64_t enqueued = 0;            // records handed to Enqueue
  uint64_t sent = 0;                // records written (first time)
  uint64_t resent = 0;              // records written again on a new stream
  uint64_t acked = 0;               // records the daemon accepted
  uint64_t duplicates = 0;          // records acked as already stored
  uint64_t rejected = 0;            // records rejected (listed in the Ack, or counted there)
  uint64_t dropped_queue_full = 0;  // oldest queued records dropped
  uint64_t dropped_unacked = 0;     // oldest unacked records dropped
  uint64_t dropped_too_large = 0;   // records in batches over the daemon's message limit
  uint64_t dropped_after_close = 0; // records enqueued after Close
  uint64_t reconnects = 0;          // streams accepted (HelloAck) after the first accepted one
  uint64_t failed_connects = 0;     // stream attempts that ended without a HelloAck
  // Streams refused or ended with ALREADY_EXISTS rank_in_use: another
  // sender's live stream holds the rank (retried after the daemon's hint).
  uint64_t rank_in_use = 0;
  uint64_t queued = 0;              // records waiting now
  uint64_t unacked = 0;             // batches waiting for an Ack now
};

enum class CloseMode { kEndRun, kKeepRunOpen };

class Sender {
 public:
  Sender(std::string endpoint, foreshock::v1::Hello hello, SenderOptions options = {});
  ~Sender();  // Close(0, kKeepRunOpen): whatever is not yet acked is abandoned
  Sender(const Sender&) = delete;
  Sender& operator=(const Sender&) = delete;

  // Queues a record; never blocks on the network.
  void Enqueue(foreshock::v1::Record record);
  // Sends what is queued and waits for its Acks, at most `timeout`; with
  // kEndRun, then sends the goodbye and waits for its Ack too. Then stops the
  // thread. True when everything (the goodbye included) was acknowledged.
  bool Close(std::chrono::milliseconds timeout, CloseMode mode = CloseMode::kEndRun);
  SenderStats stats() const;
  bool connected() const { return connected_.load(); }

 private:
  void Run();
  // One stream's life; true when it ended because Close drained everything.
  bool RunStream(std::chrono::milliseconds* retry_hint);
  void OnAck(const foreshock::v1::Ack& ack);
  void DropTooLarge(const std::string& details);
  // Nothing left to deliver: the queue, the unacked batches, and the goodbye
  // (which, once assigned, is one of the unacked batches until its Ack).
  bool DrainedLocked() const {
    return queue_.empty() && state_.unacked().empty() && (!goodbye_ || goodbye_assigned_);
  }
  // Closing, everything queued is sent, and the goodbye is still to go.
  bool GoodbyeDueLocked() const {
    return closing_ && goodbye_ && !goodbye_assigned_ && queue_.empty();
  }

  const std::string endpoint_;
  const foreshock::v1::Hello hello_;
  const SenderOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<foreshock::v1::Ingest::Stub> stub_;

  mutable std::mutex mu_;
  std::condition_variable cv_;  // queue or unacked changed, or closing
  std::deque<std::pair<foreshock::v1::Record, size_t>> queue_;
  size_t queue_bytes_ = 0;
  SenderState state_;
  SenderStats stats_;
  bool closing_ = false;  // Close called: drain, then stop
  bool abort_ = false;    // stop now
  bool goodbye_ = false;  // Close(kEndRun): end with a Batch.goodbye
  bool goodbye_assigned_ = false;  // it has its seq (and is unacked until its Ack)
  grpc::ClientContext* live_context_ = nullptr;  // to cancel a blocked stream
  std::atomic<bool> connected_{false};
  bool ever_accepted_ = false;  // under mu_: a stream got its HelloAck before
  bool idle_ended_ = false;  // sender thread only: the last stream ended for idleness
  bool rank_in_use_ = false;  // sender thread only: the last stream ended with rank_in_use
  std::thread thread_;
};

}  // namespace foreshock::client
