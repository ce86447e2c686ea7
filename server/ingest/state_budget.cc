#include "server/ingest/state_budget.h"

#include <algorithm>

#include <absl/strings/str_cat.h>

namespace foreshock::server {

std::optional<std::string> StateBudget::Admit(const std::string& run,
                                              const detectors::RetainedFootprint& footprint) {
  std::lock_guard<std::mutex> lock(mu_);
  RunState& state = runs_[run];
  const SeriesKey key{footprint.kind, footprint.layer, footprint.probe_id};
  auto series = state.series.find(key);
  int64_t replaced = 0, added = 0;
  if (series != state.series.end()) {
    if (footprint.whole) {
      for (const auto& [head, bytes] : series->second) replaced += bytes;
    } else {
      for (const auto& [head, bytes] : footprint.heads) {
        if (auto it = series->second.find(head); it != series->second.end()) replaced += it->second;
      }
    }
  }
  for (const auto& [head, bytes] : footprint.heads) added += bytes;
  const int64_t after = state.bytes - replaced + added;
  if (limit_bytes_ > 0 && after > limit_bytes_ && after > state.bytes) {
    const int64_t before = state.bytes;
    if (state.series.empty()) runs_.erase(run);
    return absl::StrCat(
        "run '", run, "' holds ", before, " bytes of detector state; this ",
        detectors::SampleKindName(footprint.kind), " probe (layer ", footprint.layer,
        ", probe_id '", footprint.probe_id, "') would make it ", after,
        ", above --max_state_mb_per_run (", limit_bytes_,
        " bytes). Probes that replace state of the same shape and step scalars are still "
        "accepted; send fewer layers, heads or tokens, or raise the budget");
  }
  if (series == state.series.end()) series = state.series.emplace(key, std::map<int, int64_t>()).first;
  if (footprint.whole) series->second.clear();
  for (const auto& [head, bytes] : footprint.heads) series->second[head] = bytes;
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
