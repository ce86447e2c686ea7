// --max_state_mb_per_run: the detector state one run may pin.
//
// The QK and router detectors keep the previous probe of every (run, layer,
// probe_id), head by head (detectors/retained_state.h), for as long as the
// run lives. Without a bound one run streaming large probes over many
// layers holds the daemon at --max_memory_mb, and then every run's probes
// are refused. This ledger counts, per run, the state its admitted probes
// leave (sized by detectors/, from the sample's shape) and refuses a probe
// that would grow the run's state past the budget: a new layer, probe_id
// or head, or a larger shape. A probe that replaces state of the same size
// or less is always admitted, and other runs are not affected. Counts only
// grow until the run's state is freed (see Admit). The ledger
// forgets a run when the detectors do (both are state owners of the run
// lifecycle, server/pipeline/run_state_owner.h, the pool first), and
// is rebuilt from the detectors' own report after a restore.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "detectors/retained_state.h"
#include "server/pipeline/run_state_owner.h"

namespace foreshock::server {

// A curvature record's per-layer values (layer_rayleigh) each open a series
// of their own (its store cache of --series_cache_points, its gauge): about
// 1 KiB each plus 30 bytes a cached point, measured. They are counted in the
// run's budget at kCurvatureValueBytes apiece (a full default cache of 256
// points), as a footprint of kind curvature, layer -1, so that one run
// cannot fill the daemon with them either.
inline constexpr int64_t kCurvatureValueBytes = int64_t{8} << 10;
// nullopt for anything but a curvature sample with per-layer values.
std::optional<detectors::RetainedFootprint> CurvatureFootprint(const detectors::Sample& sample);

class StateBudget : public RunStateOwner {
 public:
  // `limit_bytes` per run; 0: counted (for the gauge), never refused.
  explicit StateBudget(int64_t limit_bytes) : limit_bytes_(limit_bytes) {}

  // Counts what `footprint` leaves for `run` and returns nullopt, or, when
  // that would grow the run's state past the budget, counts nothing and
  // says why.
  std::optional<std::string> Admit(const std::string& run,
                                   const detectors::RetainedFootprint& footprint);
  void ForgetRun(const std::string& run);
  // RunStateOwner: the detectors dropped the run's state (registered after
  // the worker pool), so its count goes too.
  void OnRunRestarted(const std::string& run) override { ForgetRun(run); }
  void OnRunEnded(const std::string& run) override { ForgetRun(run); }
  void OnRunForgotten(const std::string& run) override { ForgetRun(run); }
  // Replaces every count with what `visit_all` reports (after a restore).
  void Rebuild(const std::function<void(const detectors::RetainedVisitor&)>& visit_all);

  int64_t limit_bytes() const { return limit_bytes_; }
  int64_t RunBytes(const std::string& run) const;
  std::vector<std::pair<std::string, int64_t>> Runs() const;  // runs holding state, by name

 private:
  using SeriesKey = std::tuple<detectors::SampleKind, int, std::string>;  // kind, layer, probe_id
  struct RunState {
    int64_t bytes = 0;
    std::map<SeriesKey, std::map<int, int64_t>> series;  // bytes by head (-1: a router series)
  };
  const int64_t limit_bytes_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, RunState> runs_;
};

}  // namespace foreshock::server
