// libFuzzer target over the daemon's request decoding and validation: the
// bytes of one ingest message are parsed as a StreamRequest (as
// server/ingest/ingest_service.cc does for every message it reads), then run through
// the same checks: ValidateHello for a Hello; ValidateRecord (and SampleBytes
// for accepted records) for each record of a Batch, against two stream
// contexts, one whose Hello declared nothing and one that declared a model.
//
// Build and run: tests/fuzz/run.sh (see tests/fuzz/README.md).
#include <cstddef>
#include <cstdint>

#include <google/protobuf/stubs/logging.h>

#include "foreshock/v1/ingest.pb.h"
#include "wire/validation.h"

namespace {

namespace v1 = foreshock::v1;
using foreshock::wire::RecordLimits;
using foreshock::wire::StreamContext;

const RecordLimits& Limits() {
  static const RecordLimits limits = [] {
    RecordLimits l;
    l.max_tensor_elements = 1 << 20;  // below the shape limits, so that it triggers
    return l;
  }();
  return limits;
}

const StreamContext& OpenContext() {
  static const StreamContext context = [] {
    StreamContext c;
    c.run_id = "fuzz";
    return c;
  }();
  return context;
}

const StreamContext& DeclaredContext() {
  static const StreamContext context = [] {
    StreamContext c;
    c.run_id = "fuzz";
    c.rank = 3;
    c.model.set_n_layers(4);
    c.model.set_n_heads(2);
    c.model.set_head_dim(8);
    c.model.set_n_experts(8);
    c.model.set_top_k(2);
    c.model.add_moe_layers(1);
    c.model.add_moe_layers(3);
    return c;
  }();
  return context;
}

}  // namespace

// Protobuf logs every string field with invalid UTF-8 it fails to parse; at
// tens of thousands of inputs a second that is only noise.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  v1::StreamRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;  // malformed_request
  switch (request.kind_case()) {
    case v1::StreamRequest::kHello:
      (void)foreshock::wire::ValidateHello(request.hello(), Limits());
      break;
    case v1::StreamRequest::kBatch:
      for (int i = 0; i < request.batch().records_size(); ++i) {
        for (const StreamContext* context : {&OpenContext(), &DeclaredContext()}) {
          v1::Record record = request.batch().records(i);
          foreshock::detectors::Sample sample;
          if (!foreshock::wire::ValidateRecord(record, *context, Limits(), sample)) {
            (void)foreshock::wire::SampleBytes(sample);
          }
        }
      }
      break;
    case v1::StreamRequest::KIND_NOT_SET:
      break;
  }
  return 0;
}
