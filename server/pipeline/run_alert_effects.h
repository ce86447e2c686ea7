// What a run's end, restart or rewind does to its alerts. The run lifecycle
// (run_lifecycle.h) decides when; the alert hub (server/alerting/) does it.
// Declared here, below both, so that the pipeline calls into the alerting
// through this interface and never includes it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "alerts/alert_engine.h"

namespace foreshock::server {

class RunAlertEffects {
 public:
  virtual ~RunAlertEffects() = default;
  // The run's open episodes close with `reason` (alerts::kRunEnded,
  // kRunResumed), delivered like any other transition; `mark` is recorded
  // with the change, so that a checkpoint holds both or neither.
  virtual void CloseRunEpisodes(const std::string& run, std::string_view reason,
                                const alerts::LifecycleMark& mark) = 0;
  // The run's alert state forgets steps >= from_step (a resumed attempt).
  virtual void RewindRun(const std::string& run, int64_t from_step,
                         const alerts::LifecycleMark& mark) = 0;
  // The run was forgotten (run_state_owner.h, OnRunForgotten): its open
  // episodes close with alerts::kRunIdle and its baselines go; its alert
  // records stay listed.
  virtual void ForgetRun(const std::string& run) = 0;
  // The last mark recorded for `run` (what a restored checkpoint already holds).
  virtual alerts::LifecycleMark GetLifecycleMark(const std::string& run) const = 0;
};

}  // namespace foreshock::server
