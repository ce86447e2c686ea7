#include "detectors/retained_state.h"

#include <algorithm>
#include <map>

#include "detectors/detector.h"

namespace foreshock::detectors {

int64_t QKHeadRetainedBytes(int64_t tokens, int64_t head_dim, DType q_dtype, DType k_dtype,
                            int64_t k_sharers, bool top_vector) {
  const int64_t elements = tokens * head_dim;
  const int64_t k_bytes = elements * static_cast<int64_t>(DTypeSize(k_dtype));
  const int64_t sharers = std::max<int64_t>(1, k_sharers);
  return elements * static_cast<int64_t>(DTypeSize(q_dtype)) + (k_bytes + sharers - 1) / sharers +
         (top_vector ? tokens * static_cast<int64_t>(sizeof(double)) : 0) + kRetainedOverheadBytes;
}

int64_t RouterRetainedBytes(int64_t tokens, int64_t experts, int64_t top_k,
                            int dead_window_samples) {
  const int64_t window = std::max(1, dead_window_samples);
  return tokens * top_k * static_cast<int64_t>(sizeof(int32_t)) +
         tokens * experts * static_cast<int64_t>(sizeof(float)) +
         tokens * static_cast<int64_t>(sizeof(double)) +
         (window + 1) * experts * static_cast<int64_t>(sizeof(double)) +
         window * static_cast<int64_t>(sizeof(int64_t)) + kRetainedOverheadBytes;
}

std::optional<RetainedFootprint> RetainedBy(const Sample& sample, const DetectorOptions& options) {
  if (const auto* qk = std::get_if<QKSample>(&sample.payload)) {
    const auto& q = qk->q.shape;
    const auto& k = qk->k.shape;
    if (q.size() != 3 || k.size() != 3) return std::nullopt;
    const int64_t rows = q[0];
    if (!qk->heads.empty() && static_cast<int64_t>(qk->heads.size()) != rows) return std::nullopt;
    // Query heads per K head in this sample: they share one copy of it.
    std::map<int64_t, int64_t> sharers;
    for (int64_t row = 0; row < rows; ++row) {
      ++sharers[qk->kv_head_of.empty() ? row : qk->kv_head_of[static_cast<size_t>(row)]];
    }
    RetainedFootprint footprint{SampleKind::kQK, qk->layer, qk->probe_id, qk->heads.empty(), {}};
    footprint.heads.reserve(static_cast<size_t>(rows));
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t kv = qk->kv_head_of.empty() ? row : qk->kv_head_of[static_cast<size_t>(row)];
      const int head = qk->heads.empty() ? static_cast<int>(row) : qk->heads[static_cast<size_t>(row)];
      footprint.heads.emplace_back(
          head, QKHeadRetainedBytes(q[1], q[2], qk->q.dtype, qk->k.dtype, sharers[kv],
                                    options.qk_track_top_vector));
    }
    return footprint;
  }
  if (const auto* router = std::get_if<RouterSample>(&sample.payload)) {
    const auto& shape = router->logits.shape;
    if (shape.size() != 2) return std::nullopt;
    return RetainedFootprint{
        SampleKind::kRouter, router->layer, router->probe_id, true,
        {{-1, RouterRetainedBytes(shape[0], shape[1], router->top_k,
                                 std::max(options.router_dead_window,
                                          options.router_dead_window_max))}}};
  }
  return std::nullopt;
}

}  // namespace foreshock::detectors
