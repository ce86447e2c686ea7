// Several ranks' step scalars -> one run-level series: per field, the mean
// over the ranks that reported the step, summed in rank order so that the
// series does not depend on the order the ranks' streams arrive in; each
// rank's own value is kept in the series' head slot (head = rank). When a
// step is complete (one rank; every rank; or `window` newer steps open), how
// a rank that replays revises a recent mean (a correction), and how a late
// joiner earns its place in the mean (kLateJoinSteps) are docs/DESIGN.md
// §1.4, the contract this class implements.
//
// One instance per worker: all of a run's scalars go to one worker, in order
// (WorkerPool), so no locks. Checkpointed with the detectors (SaveState):
// the steps open at a checkpoint are completed after the restart as if the
// daemon had not stopped.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "detectors/sample.h"
#include "codec/state_codec.h"

namespace foreshock::wire {

class RankScalars {
 public:
  static constexpr int kDefaultWindow = 32;
  static constexpr int kLateJoinSteps = 8;

  explicit RankScalars(int window = kDefaultWindow) : window_(window < 1 ? 1 : window) {}

  struct Result {
    // The run has several ranks: keep this sample's values as its rank's own.
    bool per_rank = false;
    // Run-level samples completed by this one, in ascending step order
    // (rank -1: the mean over ranks; a one-rank run's own sample unchanged).
    std::vector<detectors::Sample> ready;
    // Run-level samples of steps completed before, revised by this one (a
    // replaying rank's new value in place of its earlier one): stored as the
    // step's value, not scored again.
    std::vector<detectors::Sample> corrected;
  };

  // `sample` must hold a ScalarsSample.
  Result Offer(const detectors::Sample& sample);

  // After a restart (kill -9 included): the reports of a multi-rank run that
  // were acknowledged but not merged yet, read back from the store, so that
  // the steps open when the daemon stopped are completed as they would have
  // been. `merged_through`: the run's last merged step stored (-1: none);
  // `ranks`: the ranks it waits for; `reports` in step order. Steps this
  // completes are returned, as from Offer. Idempotent with the checkpoint's
  // open steps (a rank's report for an open step replaces its earlier one).
  Result Recover(const std::string& run, int32_t world_size, int64_t merged_through,
                 const std::vector<int32_t>& ranks, const std::vector<detectors::Sample>& reports);

  // Drops the run's state, open steps included (a run resumed from a
  // checkpoint: WorkerPool::ForgetRun).
  void ForgetRun(const std::string& run) { runs_.erase(run); }
  // Drops every run's state (a checkpoint that could not be restored).
  void Clear() { runs_.clear(); }

  // Steps waiting for ranks, over all runs (for tests and introspection).
  size_t OpenSteps() const;

  // Every run's state, open steps included (codec, codec/state_codec.h):
  //   Header "FSRS" v2 | U64 runs | per run: String name, I32 world_size,
  //   Bool several, I64 emitted, I64 steps, U64 ranks, per rank: I32 rank,
  //   I64 last_step, I32 missed | U64 open steps, per step: I64 step,
  //   I64 index, U64 reports, per report: I32 rank, U8 fields present
  //   (bit 0 loss, 1 grad_norm, 2 lr), Double loss, grad_norm, lr |
  //   (v2) U64 joining ranks, per rank: I32 rank, I64 last_step, I32 steps.
  //   v1 is read too (no joining ranks).
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
    int missed = 0;     // consecutive completed steps without this rank
    int64_t high = -1;  // highest step it reported (not checkpointed: last_step then)
  };
  struct JoiningRank {  // a late joiner before its kLateJoinSteps-th report
    int64_t last_step = -1;
    int32_t steps = 0;  // reports with a step above the previous one
  };
  struct Run {
    int32_t world_size = 0;  // largest Hello hint seen
    bool several = false;    // more than one rank: steps are merged
    std::map<int32_t, RankState> ranks;
    std::map<int64_t, OpenStep> open;
    int64_t emitted = -1;  // highest step completed
    int64_t steps = 0;     // steps opened (OpenStep::index)
    std::map<int32_t, JoiningRank> joining;
    // The last `window` completed steps' reports, so that a replaying rank
    // can revise its part of them (not checkpointed).
    std::map<int64_t, std::vector<std::pair<int32_t, detectors::ScalarsSample>>> recent;
  };

  bool Complete(const Run& run, const OpenStep& step) const;
  // Completes every open step up to and including `through`, in order.
  // Returns true when a rank stopped being waited for.
  bool CompleteThrough(const std::string& name, Run& run, int64_t through, Result& out);

  const int window_;
  std::map<std::string, Run, std::less<>> runs_;
};

}  // namespace foreshock::wire
