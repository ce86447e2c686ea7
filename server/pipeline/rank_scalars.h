// Several ranks' step scalars -> one run-level series (docs/DESIGN.md §1.4).
//
// Every rank of a data-parallel job reports loss, grad_norm and lr for the
// same step. The run's series (what the detectors, the alert rules, the
// dashboards and the UI see) is the mean, per field, over the ranks that
// reported the step; each rank's own value is kept for drill-down as the
// series' head slot (head = rank), which the alert engine ignores.
//
// When a step is complete, so that the series does not depend on the order
// in which the ranks' streams arrive (a replay gives the same means):
//  - a run with one rank (one distinct rank, and no Hello label
//    world_size > 1) passes its samples through unchanged and at once;
//  - otherwise a step is complete once every rank of the run has reported
//    it. The ranks of the run are the ranks that reported scalars for it;
//    during the first `window` steps of the run, at least world_size of
//    them (the Hello hint), so that the first steps wait for ranks whose
//    streams connect late;
//  - a step still open when `window` newer steps are open is completed with
//    the ranks it has, so a dead or slow rank delays the series by at most
//    `window` steps; a rank missing from `window` steps in a row is no
//    longer waited for (it is again once it reports);
//  - completing a step completes every older open step first: the series
//    stays in step order. A report for a step already completed is late: it
//    is kept as that rank's value only;
//  - a rank that reports a step not above its previous one (the job resumed
//    from a checkpoint) completes every open step and starts the run afresh.
// The mean sums in rank order, and equal values give that value exactly.
//
// One instance per worker: all of a run's scalars go to one worker, in order
// (WorkerPool), so no locks. Checkpointed with the detectors (SaveState):
// the steps open at a checkpoint, the one taken at shutdown included, are
// completed after the restart as if the daemon had not stopped.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "detectors/sample.h"
#include "detectors/state_codec.h"

namespace foreshock::server {

class RankScalars {
 public:
  static constexpr int kDefaultWindow = 32;

  explicit RankScalars(int window = kDefaultWindow) : window_(window < 1 ? 1 : window) {}

  struct Result {
    // The run has several ranks: keep this sample's values as its rank's own.
    bool per_rank = false;
    // Run-level samples completed by this one, in ascending step order
    // (rank -1: the mean over ranks; a one-rank run's own sample unchanged).
    std::vector<detectors::Sample> ready;
  };

  // `sample` must hold a ScalarsSample.
  Result Offer(const detectors::Sample& sample);

  // Drops the run's state, open steps included (a run resumed from a
  // checkpoint: WorkerPool::ForgetRun).
  void ForgetRun(const std::string& run) { runs_.erase(run); }
  // Drops every run's state (a checkpoint that could not be restored).
  void Clear() { runs_.clear(); }

  // Steps waiting for ranks, over all runs (for tests and introspection).
  size_t OpenSteps() const;

  // Every run's state, open steps included (codec, detectors/state_codec.h):
  //   Header "FSRS" v1 | U64 runs | per run: String name, I32 world_size,
  //   Bool several, I64 emitted, I64 steps, U64 ranks, per rank: I32 rank,
  //   I64 last_step, I32 missed | U64 open steps, per step: I64 step,
  //   I64 index, U64 reports, per report: I32 rank, U8 fields present
  //   (bit 0 loss, 1 grad_norm, 2 lr), Double loss, grad_norm, lr.
  void SaveState(codec::StateWriter& writer) const;
  // Adds the runs of a SaveState blob for which keep(run) is true (the
  // worker's shard), replacing this instance's state of those runs. On a
  // malformed blob returns false (reader.error() says why) and adds nothing.
  bool RestoreState(codec::StateReader& reader,
                    const std::function<bool(std::string_view run)>& keep);

 private:
  struct OpenStep {
    int64_t index = 0;  // position among the run's steps (the world_size hint window)
    std::vector<std::pair<int32_t, detectors::ScalarsSample>> by_rank;  // sorted by rank
  };
  struct RankState {
    int64_t last_step = -1;
    int missed = 0;  // consecutive completed steps without this rank
  };
  struct Run {
    int32_t world_size = 0;  // largest Hello hint seen
    bool several = false;    // more than one rank: steps are merged
    std::map<int32_t, RankState> ranks;
    std::map<int64_t, OpenStep> open;
    int64_t emitted = -1;  // highest step completed
    int64_t steps = 0;     // steps opened (OpenStep::index)
  };

  bool Complete(const Run& run, const OpenStep& step) const;
  // Completes every open step up to and including `through`, in order.
  // Returns true when a rank stopped being waited for.
  bool CompleteThrough(const std::string& name, Run& run, int64_t through, Result& out);

  const int window_;
  std::map<std::string, Run, std::less<>> runs_;
};

}  // namespace foreshock::server
