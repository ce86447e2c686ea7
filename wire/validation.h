// What the v1 wire contract (proto/foreshock/v1/ingest.proto) means, for
// every consumer of it: the daemon's ingest and foreshockctl's offline replay
// link this one library. It turns wire records into detector samples, or
// into a rejection with a stable code; every check the contract promises
// lives here, so that nothing malformed ever reaches a worker. The codes are
// the labels of foreshock_ingest_rejected_total (docs/DESIGN.md §3.2).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "detectors/sample.h"
#include "foreshock/v1/ingest.pb.h"

namespace foreshock::wire {

// The bounds a Hello and a record are checked against (the daemon's flags of
// the same names; server/ingest/validation.h adds the daemon's own limits).
struct RecordLimits {
  int64_t max_tokens = 4096;
  int64_t max_head_dim = 256;
  int64_t max_heads = 256;
  int64_t max_layers = 1024;
  int64_t max_experts = 1024;
  size_t max_id_bytes = 256;  // run_id, job, probe_id
  // Elements of one tensor (q, k, router logits; curvature layer_rayleigh):
  // reason tensor_too_large above it (--max_tensor_elements).
  int64_t max_tensor_elements = int64_t{1} << 24;
  // Ranks one run may have (--max_ranks_per_run): a Hello whose world_size
  // label is above it is refused (world_size_over_limit), and a Hello's rank
  // must be in [0, world_size), or [0, this) without the label (bad_rank).
  // 0: no bound beyond the label's own range.
  int64_t max_ranks_per_run = 65536;
  // Hello.labels: at most max_labels labels, keys of at most
  // max_label_key_bytes, values of at most max_label_value_bytes, and
  // max_labels_bytes of keys and values in all; beyond, the Hello is refused
  // (bad_labels). Every Hello is kept in the Hello log, on disk and the
  // latest in memory: its size is memory and disk. 0: no bound (each).
  int64_t max_labels = 64;
  int64_t max_label_key_bytes = 128;
  int64_t max_label_value_bytes = 1024;
  int64_t max_labels_bytes = 16 << 10;
};

// A rejection: `code` is a stable snake_case identifier (the label of
// foreshock_ingest_rejected_total), `detail` says what was wrong.
struct Rejection {
  std::string code;
  std::string detail;
  std::string ToString() const { return code + ": " + detail; }
};

// Stable rejection codes.
namespace reason {
inline constexpr char kMissingPayload[] = "missing_payload";
inline constexpr char kUnknownDType[] = "unknown_dtype";
inline constexpr char kBadShape[] = "bad_shape";
inline constexpr char kByteLengthMismatch[] = "byte_length_mismatch";
inline constexpr char kShapeMismatch[] = "shape_mismatch";
inline constexpr char kShapeOverLimit[] = "shape_over_limit";
inline constexpr char kLayerOutOfRange[] = "layer_out_of_range";
inline constexpr char kHeadsMismatch[] = "heads_mismatch";
inline constexpr char kBadSeqLen[] = "bad_seq_len";
// QKSample.output_check with no elements, or a negative or inconsistent
// (|mean signed error| above the rms error) figure.
inline constexpr char kBadOutputCheck[] = "bad_output_check";
// QKSample.logit_softcap negative or not finite.
inline constexpr char kBadSoftcap[] = "bad_softcap";
inline constexpr char kBadTopK[] = "bad_top_k";
inline constexpr char kExpertsMismatch[] = "experts_mismatch";
inline constexpr char kNotMoeLayer[] = "not_moe_layer";
inline constexpr char kBadId[] = "bad_id";
inline constexpr char kNonIncreasingSeq[] = "non_increasing_seq";
inline constexpr char kNegativeStep[] = "negative_step";
inline constexpr char kTensorTooLarge[] = "tensor_too_large";
// More per-layer values than the run has layers (curvature layer_rayleigh
// longer than the Hello's n_layers, or --max_layers when it does not say).
inline constexpr char kTooManyLayers[] = "too_many_layers";
// A step more than --max_step_jump beyond the run's highest accepted step.
inline constexpr char kStepOutOfRange[] = "step_out_of_range";
// A step of a rank joining a live run late, far beyond the run's progress,
// before the rank has a history of its own (IngestService::AdmitLateJoinerStep).
inline constexpr char kStepAheadOfRun[] = "step_ahead_of_run";
// Stream-level (the stream ends with INVALID_ARGUMENT).
inline constexpr char kBatchBeforeHello[] = "batch_before_hello";
inline constexpr char kDuplicateHello[] = "duplicate_hello";
inline constexpr char kBadHello[] = "bad_hello";
// Hello.labels over a bound of IngestLimits (count, key, value, total bytes).
inline constexpr char kBadLabels[] = "bad_labels";
// A Hello's rank outside [0, world_size) (or [0, --max_ranks_per_run)
// without the world_size label), and a world_size label above
// --max_ranks_per_run.
inline constexpr char kBadRank[] = "bad_rank";
inline constexpr char kWorldSizeOverLimit[] = "world_size_over_limit";
// Stream-level, FAILED_PRECONDITION: a Hello whose world_size label raises
// the one the run's attempt declared with its first Hello, or whose rank is
// outside it (RunLifecycle::WorldSizeConflict).
inline constexpr char kWorldSizeConflict[] = "world_size_conflict";
inline constexpr char kEmptyRequest[] = "empty_request";
// A message that is not a parseable StreamRequest (with the typed API gRPC
// would end such a stream itself).
inline constexpr char kMalformedRequest[] = "malformed_request";
// Stream-level, RESOURCE_EXHAUSTED (the client may retry later).
inline constexpr char kTooManyStreams[] = "too_many_streams";
inline constexpr char kTooManyRuns[] = "too_many_runs";
inline constexpr char kMessageTooLarge[] = "message_too_large";
inline constexpr char kMemoryLimit[] = "memory_limit";
// Record-level: a probe that would grow its run's detector state past
// --max_state_mb_per_run (server/ingest/state_budget.h).
inline constexpr char kStateLimit[] = "state_limit";
// The store cannot write (a full disk: disk_full; another I/O error:
// store_unavailable). The batch is not acknowledged; clients resend it after
// the retry hint, and the daemon resumes by itself when writes succeed.
inline constexpr char kDiskFull[] = "disk_full";
inline constexpr char kStoreUnavailable[] = "store_unavailable";
inline constexpr char kTooManyProbeIds[] = "too_many_probe_ids";  // record-level
// Record-level: every record of a batch of more than --max_records_per_batch.
inline constexpr char kTooManyRecords[] = "too_many_records";
inline constexpr char kTooManyStreamsForTenant[] = "too_many_streams_for_tenant";
inline constexpr char kTooManyRunsForTenant[] = "too_many_runs_for_tenant";
// Stream-level, ALREADY_EXISTS: a Hello for a rank another sender's live
// stream holds (docs/DESIGN.md §3.4); retry-after-ms.
inline constexpr char kRankInUse[] = "rank_in_use";
// Stream-level, DEADLINE_EXCEEDED: a stream silent for too long.
inline constexpr char kHelloTimeout[] = "hello_timeout";
inline constexpr char kStreamIdleTimeout[] = "stream_idle_timeout";
}  // namespace reason

// What a stream's Hello established; records are checked against it.
struct StreamContext {
  std::string run_id;
  std::string job;
  int32_t rank = 0;
  int32_t world_size = 0;  // WorldSizeOf(hello)
  foreshock::v1::ModelInfo model;
};

// The Hello's label "world_size" (the number of ranks that report scalars for
// the run; the Python Monitor sets it from torch.distributed) when it is an
// integer in [1, 2^20], else 0 (not said). A hint: it makes the run's first
// steps wait for every rank (server/pipeline/rank_scalars.h), and the run
// ends once that many ranks said goodbye (ValidateHello bounds it by
// max_ranks_per_run first).
int32_t WorldSizeOf(const foreshock::v1::Hello& hello);

// Checks a Hello against the limits: ids, model shape, the world_size label
// (world_size_over_limit) and the rank (bad_rank).
std::optional<Rejection> ValidateHello(const foreshock::v1::Hello& hello,
                                       const RecordLimits& limits);

// Validates `record` and, on success, moves its payload into `out` (tensor
// bytes are moved, not copied). On failure `record` is left intact.
std::optional<Rejection> ValidateRecord(foreshock::v1::Record& record,
                                        const StreamContext& context,
                                        const RecordLimits& limits, detectors::Sample& out);

// Bytes a validated sample holds (what it costs in the work queue).
size_t SampleBytes(const detectors::Sample& sample);

}  // namespace foreshock::wire
