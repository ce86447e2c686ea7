#include "server/ingest/state_budget.h"

#include <algorithm>

#include <absl/strings/str_cat.h>

namespace foreshock::server {

std::optional<detectors::RetainedFootprint> CurvatureFootprint(const detectors::Sample& sample) {
  const auto* curvature = std::get_if<detectors::CurvatureSample>(&sample.payload);
  if (curvature == nullptr || curvature->layer_rayleigh.empty()) return std::nullopt;
  detectors::RetainedFootprint footprint;
  footprint.kind = detectors::SampleKind::kCurvature;
  footprint.layer = -1;
  footprint.heads.emplace_back(
      -1, static_cast<int64_t>(curvature->layer_rayleigh.size()) * kCurvatureValueBytes);
  return footprint;
}

std::optional<std::string> StateBudget::Admit(const std::string& run,
                                              const detectors::RetainedFootprint& footprint) {
  std::lock_guard<std::mutex> lock(mu_);
  RunState& state = runs_[run];
  const SeriesKey key{footprint.kind, footprint.layer, footprint.probe_id};
  auto series = state.series.find(key);
  // Each head's count only grows: a probe the detector then drops (one
  // with a NaN) leaves the previous state in place, so a smaller probe
  // cannot be trusted to have shrunk it. The count is exact again when the
  // run's state is freed or recounted (Rebuild).
  int64_t growth = 0;
  for (const auto& [head, bytes] : footprint.heads) {
    int64_t held = 0;
    if (series != state.series.end()) {
      if (auto it = series->second.find(head); it != series->second.end()) held = it->second;
    }
    growth += std::max<int64_t>(0, bytes - held);
  }
  const int64_t after = state.bytes + growth;
  if (limit_bytes_ > 0 && growth > 0 && after > limit_bytes_) {
    const int64_t before = state.bytes;
    if (state.series.empty()) runs_.erase(run);
    const std::string what =
        footprint.kind == detectors::SampleKind::kCurvature
            ? absl::StrCat("curvature record's per-layer values (", growth / kCurvatureValueBytes,
                           " more series, counted at ", kCurvatureValueBytes, " bytes each)")
            : absl::StrCat(detectors::SampleKindName(footprint.kind), " probe (layer ",
                           footprint.layer, ", probe_id '", footprint.probe_id, "')");
    return absl::StrCat(
        "run '", run, "' holds ", before, " bytes of detector state; this ", what,
        " would make it ", after,
        ", above --max_state_mb_per_run (", limit_bytes_,
        " bytes). Probes that replace state of the same shape and step scalars are still "
        "accepted; send fewer layers, heads or tokens, or raise the budget");
  }
  if (growth == 0 && series != state.series.end()) return std::nullopt;
  if (series == state.series.end()) series = state.series.emplace(key, std::map<int, int64_t>()).first;
  for (const auto& [head, bytes] : footprint.heads) {
    int64_t& held = series->second[head];
    held = std::max(held, bytes);
  }
  state.bytes = after;
  return std::nullopt;
}

void StateBudget::ForgetRun(const std::string& run) {
  std::lock_guard<std::mutex> lock(mu_);
  runs_.erase(run);
}

void StateBudget::Rebuild(
    const std::function<void(const detectors::RetainedVisitor&)>& visit_all) {
  std::unordered_map<std::string, RunState> rebuilt;
  visit_all([&](std::string_view run, detectors::SampleKind kind, int layer,
                std::string_view probe_id, int head, int64_t bytes) {
    RunState& state = rebuilt[std::string(run)];
    int64_t& slot = state.series[SeriesKey{kind, layer, std::string(probe_id)}][head];
    state.bytes += bytes - slot;
    slot = bytes;
  });
  std::lock_guard<std::mutex> lock(mu_);
  runs_ = std::move(rebuilt);
}

int64_t StateBudget::RunBytes(const std::string& run) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = runs_.find(run);
  return it == runs_.end() ? 0 : it->second.bytes;
}

std::vector<std::pair<std::string, int64_t>> StateBudget::Runs() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<std::string, int64_t>> runs;
  runs.reserve(runs_.size());
  for (const auto& [run, state] : runs_) runs.emplace_back(run, state.bytes);
  std::sort(runs.begin(), runs.end());
  return runs;
}

}  // namespace foreshock::server
