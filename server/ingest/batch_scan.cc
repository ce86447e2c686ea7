#include "server/ingest/batch_scan.h"

#include <grpcpp/support/proto_buffer_reader.h>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>

namespace foreshock::server {

namespace {
using google::protobuf::io::CodedInputStream;
using google::protobuf::internal::WireFormatLite;

// Field numbers of foreshock.v1.StreamRequest and Batch (ingest.proto).
constexpr int kRequestHello = 1;
constexpr int kRequestBatch = 2;
constexpr int kBatchSeq = 1;
constexpr int kBatchRecords = 2;
constexpr int kBatchGoodbye = 3;

bool ScanBatchBody(CodedInputStream& in, BatchShape& shape) {
  while (const uint32_t tag = in.ReadTag()) {
    const int field = WireFormatLite::GetTagFieldNumber(tag);
    const auto type = WireFormatLite::GetTagWireType(tag);
    if (field == kBatchSeq && type == WireFormatLite::WIRETYPE_VARINT) {
      if (!in.ReadVarint64(&shape.seq)) return false;
    } else if ((field == kBatchRecords || field == kBatchGoodbye) &&
               type == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      uint32_t length = 0;
      if (!in.ReadVarint32(&length) || !in.Skip(static_cast<int>(length))) return false;
      if (field == kBatchRecords) ++shape.records;
      if (field == kBatchGoodbye) shape.goodbye = true;
    } else if (!WireFormatLite::SkipField(&in, tag)) {
      return false;
    }
  }
  return in.ConsumedEntireMessage();
}
}  // namespace

std::optional<BatchShape> ScanBatch(const grpc::ByteBuffer& message) {
  grpc::ByteBuffer copy(message);  // shares the slices; the reader advances its own
  grpc::ProtoBufferReader reader(&copy);
  CodedInputStream in(&reader);
  in.SetTotalBytesLimit(INT32_MAX);
  std::optional<BatchShape> batch;
  bool last_is_batch = false;
  while (const uint32_t tag = in.ReadTag()) {
    const int field = WireFormatLite::GetTagFieldNumber(tag);
    const auto type = WireFormatLite::GetTagWireType(tag);
    if (field == kRequestBatch && type == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      uint32_t length = 0;
      if (!in.ReadVarint32(&length)) return std::nullopt;
      const auto limit = in.PushLimit(static_cast<int>(length));
      // A second Batch field merges into the first, as the parser does; one
      // after a Hello replaces it.
      if (!last_is_batch) batch.emplace();
      if (!ScanBatchBody(in, *batch)) return std::nullopt;
      in.PopLimit(limit);
      last_is_batch = true;
    } else if (field == kRequestHello && type == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      uint32_t length = 0;
      if (!in.ReadVarint32(&length) || !in.Skip(static_cast<int>(length))) return std::nullopt;
      last_is_batch = false;
      batch.reset();
    } else if (!WireFormatLite::SkipField(&in, tag)) {
      return std::nullopt;
    }
  }
  if (!in.ConsumedEntireMessage() || !last_is_batch) return std::nullopt;
  return batch;
}

}  // namespace foreshock::server
