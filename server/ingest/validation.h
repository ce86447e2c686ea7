// Turns wire records into detector samples, or into a rejection with a
// reason. Every check the v1 contract promises lives here, so that nothing
// malformed ever reaches a worker.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "detectors/sample.h"
#include "foreshock/v1/ingest.pb.h"

namespace foreshock::server {

struct IngestLimits {
  int64_t max_tokens = 4096;
  int64_t max_head_dim = 256;
  int64_t max_heads = 256;
  int64_t max_layers = 1024;
  int64_t max_experts = 1024;
  size_t max_id_bytes = 256;  // run_id, job, probe_id
  // Elements of one tensor (q, k, router logits; curvature layer_rayleigh):
  // reason tensor_too_large above it (--max_tensor_elements).
  int64_t max_tensor_elements = int64_t{1} << 24;
  // Ingest streams open at once; the one beyond ends with RESOURCE_EXHAUSTED
  // (--max_streams). 0: no limit.
  int64_t max_streams = 1024;
  // Distinct runs the daemon accepts Hellos for; a Hello for a new run beyond
  // it ends its stream with RESOURCE_EXHAUSTED (--max_runs). 0: no limit.
  int64_t max_runs = 1000;
  // Bytes of one ingest message (--max_message_mb): RESOURCE_EXHAUSTED with
  // reason message_too_large above it. gRPC's own transport limit is set to
  // twice this (TransportMessageLimit), so that the service sees, counts and
  // explains oversized messages; beyond that gRPC refuses them before decoding.
  int64_t max_message_bytes = int64_t{64} << 20;
  // A stream whose first message has not arrived after this long ends with
  // DEADLINE_EXCEEDED (reason hello_timeout), so that connections that never
  // speak do not hold --max_streams slots. 0: no timeout.
  std::chrono::milliseconds hello_timeout{10000};
  // A stream that has had its Hello and then sends no message for this long,
  // with nothing of it in progress (no batch parked or being processed), ends
  // with DEADLINE_EXCEEDED (reason stream_idle_timeout), freeing its
  // --max_streams slot. Every batch of it was acknowledged, so nothing is
  // lost; clients reconnect when they next have data. 0: no timeout.
  std::chrono::milliseconds stream_idle_timeout{300000};
  // Streams one tenant may hold open at once (--max_streams_per_tenant): a
  // token with --token_file (checked when the stream opens), else a run_id
  // (checked at its Hello). Beyond it: RESOURCE_EXHAUSTED
  // too_many_streams_for_tenant with retry-after-ms. -1: a quarter of
  // max_streams, at least 64 (TenantStreamLimit). 0: no limit.
  int64_t max_streams_per_tenant = -1;
  // A record whose step is more than this beyond the highest step the run
  // has had accepted (0 before its first) is rejected with reason
  // step_out_of_range, so that one corrupt step (2^63-1, a timestamp) cannot
  // become the run's last step (--max_step_jump). 0: no bound.
  int64_t max_step_jump = 100000000;
  // Distinct probe_ids (QK and router) one run may use: the detectors keep
  // the previous sample per (run, layer, probe_id), so this bounds their
  // state per run. Records with a further new probe_id are rejected with
  // reason too_many_probe_ids (--max_probe_ids_per_run). 0: no limit.
  int64_t max_probe_ids_per_run = 64;
  // Ranks one run may have (--max_ranks_per_run): a Hello whose world_size
  // label is above it is refused (world_size_over_limit), and a Hello's rank
  // must be in [0, world_size), or [0, this) without the label (bad_rank).
  // 0: no bound beyond the label's own range.
  int64_t max_ranks_per_run = 65536;
  // Runs one tenant may have counted toward max_runs at once
  // (--max_runs_per_tenant): a token with --token_file, else the Hello's job.
  // A new run beyond it ends its stream with RESOURCE_EXHAUSTED
  // too_many_runs_for_tenant. -1: a quarter of max_runs, at least 1
  // (TenantRunLimit). 0: no per-tenant limit.
  int64_t max_runs_per_tenant = -1;
  // A run that has stored no sample and has no stream open stops counting
  // toward max_runs (and its tenant's share) after this long
  // (--empty_run_release_s); a run with samples, after kIdleRunRelease.
  std::chrono::milliseconds empty_run_release{120000};
  // A rank belongs to the stream that holds it (docs/DESIGN.md §3.4): a
  // Hello for it from another sender is refused (ALREADY_EXISTS rank_in_use)
  // while the holder's stream is open and active within this long
  // (--rank_takeover_grace_ms); past it, the holder counts as gone and the
  // new sender takes the rank over.
  std::chrono::milliseconds rank_takeover_grace{60000};
  // Records one Batch may carry (--max_records_per_batch): a batch with more
  // is not parsed (its records would cost ~50 bytes each in memory, an empty
  // one 2 bytes on the wire) and every record is rejected too_many_records.
  // 0: no limit.
  int64_t max_records_per_batch = 262144;
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

// The --max_runs_per_tenant in force: the configured one, or for -1 a
// quarter of max_runs, at least 1 (0 when max_runs is 0). 0: none.
inline int64_t TenantRunLimit(const IngestLimits& limits) {
  if (limits.max_runs_per_tenant >= 0) return limits.max_runs_per_tenant;
  if (limits.max_runs <= 0) return 0;
  return std::max<int64_t>(1, limits.max_runs / 4);
}

// The --max_streams_per_tenant in force: the configured one, or for -1 a
// quarter of max_streams but at least 64 (0 when max_streams is 0). 0: none.
inline int64_t TenantStreamLimit(const IngestLimits& limits) {
  if (limits.max_streams_per_tenant >= 0) return limits.max_streams_per_tenant;
  if (limits.max_streams <= 0) return 0;
  return std::max<int64_t>(64, limits.max_streams / 4);
}

// The gRPC receive limit for a --max_message_mb of `max_message_bytes`.
inline int TransportMessageLimit(int64_t max_message_bytes) {
  return static_cast<int>(std::min<int64_t>(2 * max_message_bytes, 0x7fffffff));
}

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

// Every code above that ingest counts in foreshock_ingest_rejected_total,
// record-level first (docs/DESIGN.md §3.2); the ingest service declares them
// to the metrics (exported at 0 from the start). tests/server/common/
// metrics_test.cc checks the list against the codes declared here.
std::span<const std::string_view> RejectionReasons();

// An Ack lists at most this many rejections; the rest are counted in
// Ack.omitted_rejections and omitted_by_reason, so that an Ack stays small
// whatever the batch (5M bad records made an Ack of 408 MB).
inline constexpr int kMaxAckRejections = 256;

// Rejects `count` records of the batch from index `first` on, all with
// `reason_text` ("<code>: <detail>"), within kMaxAckRejections.
void AddRejections(foreshock::v1::Ack& ack, int64_t first, int64_t count, std::string_view code,
                   const std::string& reason_text);
inline void AddRejection(foreshock::v1::Ack& ack, int64_t index, std::string_view code,
                         const std::string& reason_text) {
  AddRejections(ack, index, 1, code, reason_text);
}

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
                                       const IngestLimits& limits);

// Validates `record` and, on success, moves its payload into `out` (tensor
// bytes are moved, not copied). On failure `record` is left intact.
std::optional<Rejection> ValidateRecord(foreshock::v1::Record& record,
                                        const StreamContext& context,
                                        const IngestLimits& limits, detectors::Sample& out);

// Bytes a validated sample holds (what it costs in the work queue).
size_t SampleBytes(const detectors::Sample& sample);

}  // namespace foreshock::server
