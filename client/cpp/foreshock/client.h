// A small C++ client for foreshock.v1.Ingest: one stream per rank, a Hello,
// then Batches with increasing seq, Acks read back in order. Used by the
// tests and the load generator; training code in C++ can use it directly.
#pragma once

#include <cstdint>
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

class IngestStream {
 public:
  explicit IngestStream(std::shared_ptr<grpc::Channel> channel);
  ~IngestStream();

  // Opens the stream and exchanges Hello/HelloAck. On failure returns the
  // stream's final status.
  grpc::Status Open(const foreshock::v1::Hello& hello);
  const std::string& session_id() const { return session_id_; }

  // Sends a batch with the next seq (assigned here unless `seq` is given).
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
};

}  // namespace foreshock::client
