// One ingest stream driven by hand over real gRPC, for tests that need to
// misbehave as a client would: a token or none, a Hello or not, batches
// with chosen seqs and goodbyes, or silence until the daemon ends it.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "foreshock/v1/ingest.grpc.pb.h"

namespace foreshock::server::test_support {

struct RawStream {
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StreamRequest, v1::StreamResponse>> rw;
  bool finished = false;
  uint64_t next_seq = 1;

  explicit RawStream(v1::Ingest::Stub& stub, const std::string& token = "",
                     std::chrono::seconds deadline = std::chrono::seconds(30)) {
    if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
    context.set_deadline(std::chrono::system_clock::now() + deadline);
    rw = stub.Stream(&context);
  }
  ~RawStream() {
    if (finished) return;
    context.TryCancel();
    Wait();
  }
  RawStream(const RawStream&) = delete;
  RawStream& operator=(const RawStream&) = delete;

  // Sends the Hello; true when the HelloAck came back.
  bool Hello(const v1::Hello& hello) {
    v1::StreamRequest request;
    *request.mutable_hello() = hello;
    v1::StreamResponse response;
    return rw->Write(request) && rw->Read(&response) && response.has_hello_ack();
  }
  // Sends one batch; the accepted count of its Ack, or -1 without one.
  int Send(const std::vector<v1::Record>& records, bool goodbye = false) {
    v1::StreamRequest request;
    request.mutable_batch()->set_seq(next_seq++);
    for (const v1::Record& r : records) *request.mutable_batch()->add_records() = r;
    if (goodbye) request.mutable_batch()->mutable_goodbye();
    v1::StreamResponse response;
    if (!rw->Write(request) || !rw->Read(&response) || !response.has_ack()) return -1;
    return static_cast<int>(response.ack().accepted());
  }
  // Reads until the daemon ends the stream; its status.
  grpc::Status Wait() {
    v1::StreamResponse response;
    while (rw->Read(&response)) {
    }
    finished = true;
    return rw->Finish();
  }
  std::string Trailer(const std::string& key) {
    const auto& trailers = context.GetServerTrailingMetadata();
    auto it = trailers.find(key);
    return it == trailers.end() ? "" : std::string(it->second.data(), it->second.size());
  }
};

}  // namespace foreshock::server::test_support
