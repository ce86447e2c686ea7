// A small C++ client for foreshock.v1.Ingest: one stream per rank, a Hello,
// then Batches with increasing seq, Acks read back in order. Used by the
// tests and the load generator; training code in C++ can use it directly.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "foreshock/v1/ingest.grpc.pb.h"

namespace foreshock::client {

// Encodes floats as a wire Tensor (little-endian, row-major). BFLOAT16 and
// FLOAT16 round to nearest even.
foreshock::v1::Tensor MakeTensor(foreshock::v1::DType dtype, std::vector<int64_t> shape,
                                 const float* values, size_t count);
uint16_t FloatToBFloat16(float value);
uint16_t FloatToHalf(float value);

// A sender's numbering and its unacknowledged batches, kept across streams
// (Hello.first_seq in ingest.proto): seqs start at the Unix time in
// microseconds and keep increasing; every sent batch is kept until its Ack,
// at most `max_unacked_bytes` (the oldest are dropped beyond that and their
// records counted). IngestStream::Open with a SenderState resends what it
// holds, with the same seqs; the daemon deduplicates by (run, rank, seq).
// Not thread-safe: one per rank, used by one stream at a time.
class SenderState {
 public:
  explicit SenderState(size_t max_unacked_bytes = size_t{64} << 20);

  // The oldest seq this sender may still send: Hello.first_seq.
  uint64_t first_seq() const;
  // Random, fixed for the life of this object: Hello.sender_id.
  uint64_t sender_id() const { return sender_id_; }
  // Numbers the batch and keeps a copy until it is acked.
  uint64_t Assign(foreshock::v1::Batch& batch);
  // Forgets the batch the ack settles.
  void Settle(const foreshock::v1::Ack& ack);

  const std::map<uint64_t, foreshock::v1::Batch>& unacked() const { return unacked_; }
  uint64_t dropped_records() const { return dropped_records_; }

 private:
  size_t max_unacked_bytes_;
  uint64_t sender_id_;
  uint64_t next_seq_;
  std::map<uint64_t, foreshock::v1::Batch> unacked_;
  size_t unacked_bytes_ = 0;
  uint64_t dropped_records_ = 0;
};

class IngestStream {
 public:
  explicit IngestStream(std::shared_ptr<grpc::Channel> channel);
  ~IngestStream();

  // Opens the stream and exchanges Hello/HelloAck. On failure returns the
  // stream's final status.
  grpc::Status Open(const foreshock::v1::Hello& hello);
  // With a SenderState (which must outlive the stream): Hello.first_seq is
  // set from it, its unacked batches are resent first (same seqs), Send
  // numbers batches through it and acks read settle them.
  grpc::Status Open(const foreshock::v1::Hello& hello, SenderState* sender);
  const std::string& session_id() const { return session_id_; }

  // Sends a batch with the next seq (assigned here unless `seq` is given;
  // with a SenderState, the sender's next seq unless `seq` is given).
  // Returns false if the stream is broken.
  bool Send(foreshock::v1::Batch batch, std::optional<uint64_t> seq = std::nullopt);
  // Blocks for the next Ack; nullopt once the stream has ended.
  std::optional<foreshock::v1::Ack> ReadAck();
  // Send, then wait for its Ack.
  std::optional<foreshock::v1::Ack> SendAndWait(foreshock::v1::Batch batch,
                                                std::optional<uint64_t> seq = std::nullopt);
  // Half-closes, reads any remaining acks, and returns the final status.
  grpc::Status Close();

 private:
  std::shared_ptr<foreshock::v1::Ingest::Stub> stub_;
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReaderWriter<foreshock::v1::StreamRequest,
                                           foreshock::v1::StreamResponse>>
      stream_;
  std::string session_id_;
  uint64_t next_seq_ = 1;
  bool closed_ = false;
  SenderState* sender_ = nullptr;  // per-sender seqs and resends; may be null
};

}  // namespace foreshock::client
