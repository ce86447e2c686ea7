// How much detector state a probe sample leaves behind, for the daemon's
// per-run state budget (--max_state_mb_per_run, docs/OPERATIONS.md "Memory").
//
// The QK and router detectors keep state per (run, layer, probe_id): the QK
// detector the previous Q and K of each query head (for the next increment),
// the router detector the previous routing decisions and a window of expert
// loads. The daemon must decide whether to admit a probe before a worker
// processes it, so the footprint is a function of the sample's shape, and
// the detectors report what they hold with the same functions
// (Detector::VisitRetained), so that the two agree after a restore.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "detectors/sample.h"

namespace foreshock::detectors {

class DetectorOptions;

// Allocator and container overhead per retained head or router series
// (map node, tensor headers, the shared K's control block): small probes
// must not look free.
inline constexpr int64_t kRetainedOverheadBytes = 256;

// The byte counts of the two detectors that keep probe state, defined with
// them (qk_detector.cc, router_detector.cc), which report their state by them
// (VisitRetained) and predict it (their RetainedBy, registered with them).
//
// One QK head's retained state: its previous Q [tokens, dim] and its share
// of the K copy it attended with (one copy per K head and sample, shared by
// `k_sharers` query heads of that sample), the previous top direction
// (tokens doubles, when tracked) and the overhead.
int64_t QKHeadRetainedBytes(int64_t tokens, int64_t head_dim, DType q_dtype, DType k_dtype,
                            int64_t k_sharers, bool top_vector);
// One router series: the previous decisions (top-k indices, probabilities,
// per-token entropy), the dead-expert window of loads and the peak loads.
int64_t RouterRetainedBytes(int64_t tokens, int64_t experts, int64_t top_k,
                            int dead_window_samples);

// The state a probe leaves for its (kind, layer, probe_id) series once
// processed. `whole` : the state replaces the series' (a router sample, a
// full QK sample: heads beyond it are dropped); otherwise the listed heads
// replace theirs and the others stay (a rotating subset of QK heads).
struct RetainedFootprint {
  SampleKind kind = SampleKind::kQK;
  int layer = 0;
  std::string probe_id;
  bool whole = true;
  std::vector<std::pair<int, int64_t>> heads;  // (head, bytes); router: one, head -1
};

// What processing `sample` retains, as the registered detector of its kind
// that keeps probe state says (DetectorInfo::retained_by); nullopt for kinds
// without per-series probe state (scalars, curvature) and for samples the
// detector would drop.
std::optional<RetainedFootprint> RetainedBy(const Sample& sample, const DetectorOptions& options);

// Reported by Detector::VisitRetained: one head (or router series, head -1)
// of a run's state and its bytes, by the functions above.
using RetainedVisitor = std::function<void(std::string_view run, SampleKind kind, int layer,
                                           std::string_view probe_id, int head, int64_t bytes)>;

}  // namespace foreshock::detectors
