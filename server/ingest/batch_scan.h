// A look at an ingest message's wire bytes before it is parsed.
//
// Parsing a Batch costs memory per record (a Record object each, some 50
// bytes, for an empty record of 2 wire bytes): a 10 MB message of 5M empty
// records parses into hundreds of MB. --max_records_per_batch is therefore
// checked on the bytes, by counting the Batch's record fields without
// building them, and a batch over it is never parsed.
#pragma once

#include <cstdint>
#include <optional>

#include <grpcpp/support/byte_buffer.h>

namespace foreshock::server {

struct BatchShape {
  uint64_t seq = 0;
  int64_t records = 0;
  bool goodbye = false;
};

// The seq, record count and goodbye of the StreamRequest in `message` when
// it is a Batch (as the parser would see it: the last kind wins, repeated
// fields add up); nullopt when it is not a Batch or not well-formed (the
// parser then says so). `message` is not consumed.
std::optional<BatchShape> ScanBatch(const grpc::ByteBuffer& message);

}  // namespace foreshock::server
