// The daemon's side of ingest validation: its limits beyond what a record is
// checked against (streams, runs, tenants, timeouts), the rejection reasons it
// counts, and the Ack's list of rejections. What a Hello or a record must be
// is wire/validation.h, which foreshockctl's replay links too.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "foreshock/v1/ingest.pb.h"
#include "wire/validation.h"

namespace foreshock::server {

// The rejection codes (wire/validation.h), as ingest names them.
namespace reason = wire::reason;

struct IngestLimits : wire::RecordLimits {
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
  // Runs one tenant may have counted toward max_runs at once
  // (--max_runs_per_tenant): a token with --token_file, else the Hello's job.
  // A new run beyond it ends its stream with RESOURCE_EXHAUSTED
  // too_many_runs_for_tenant. -1: a quarter of max_runs, at least 1
  // (TenantRunLimit). 0: no per-tenant limit.
  int64_t max_runs_per_tenant = -1;
  // A run that has stored no sample and has no stream open stops counting
  // toward max_runs (and its tenant's share) after this long
  // (--empty_run_release_s); a run with samples, once it is forgotten.
  std::chrono::milliseconds empty_run_release{120000};
  // A run with no stream open for this long is forgotten (--forget_runs_idle_s,
  // server/pipeline/run_lifecycle.h ForgetIdleRuns): it stops counting toward
  // max_runs. The lifecycle tells admission (OnRunForgotten); admission also
  // applies it to runs the lifecycle does not know.
  std::chrono::milliseconds forget_runs_idle{std::chrono::hours(24)};
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

// Every code of wire::reason that ingest counts in foreshock_ingest_rejected_total,
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

}  // namespace foreshock::server
