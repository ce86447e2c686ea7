// A component that keeps state per run and must let go of it when the run
// lifecycle (run_lifecycle.h) says so. The lifecycle tells every owner
// registered with it, in registration order and through this interface only,
// so that the end of a run, a resume from a checkpoint and forgetting a run
// are fanned out in one place (the daemon registers the owners once). The alerts are told
// through RunAlertEffects instead: their episodes close with a reason and a
// mark that their own checkpoint must agree with.
//
// Called under the lifecycle's lock: an owner must not call back into it.
#pragma once

#include <string>

namespace foreshock::server {

class RunStateOwner {
 public:
  virtual ~RunStateOwner() = default;
  // A new attempt of the run starts over from a checkpoint (or the restored
  // state predates one): state that pairs its samples with the abandoned
  // attempt's (increments, windows, open steps) is dropped. Called before
  // the new attempt's first samples are dispatched.
  virtual void OnRunRestarted(const std::string& run) = 0;
  // Every sample of the run's attempt was processed and every sender said
  // goodbye: state kept only to judge later samples can go.
  virtual void OnRunEnded(const std::string& run) = 0;
  // The run had no stream open for --forget_runs_idle_s (ended or not): the
  // one rule by which the daemon forgets a run. Everything kept only to
  // judge or count its later samples goes; what records the run (stored
  // points, alert episodes, its lifecycle and ListRuns summary) stays. A
  // forgotten run that sends again starts its baselines afresh.
  virtual void OnRunForgotten(const std::string& run) = 0;
};

}  // namespace foreshock::server
