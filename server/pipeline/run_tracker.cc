#include "server/pipeline/run_tracker.h"

namespace foreshock::server {

RunTracker::RunState& RunTracker::StateLocked(const std::string& run) {
  RunState& state = runs_[run];
  if (!state.series_added) {
    // The run's known series start at 0 when it first appears (a Hello, or
    // a run restored from the store), so that increase() sees its first event.
    metrics_.AddRun(run);
    state.series_added = true;
  }
  return state;
}

void RunTracker::OnHello(const foreshock::v1::Hello& hello) {
  std::lock_guard<std::mutex> lock(mu_);
  RunState& state = StateLocked(hello.run_id());
  state.ranks[hello.rank()] = true;
  state.summary.ranks_seen = static_cast<int>(state.ranks.size());
  if (state.info_gauge != nullptr) return;  // the first Hello of a run describes it
  state.summary.run = hello.run_id();
  state.summary.job = hello.job();
  state.summary.model = hello.model();
  const auto& m = hello.model();
  state.info_gauge = &metrics_.run_info.Add({{"run", hello.run_id()},
                                             {"job_name", hello.job()},
                                             {"n_layers", std::to_string(m.n_layers())},
                                             {"n_heads", std::to_string(m.n_heads())},
                                             {"head_dim", std::to_string(m.head_dim())},
                                             {"n_experts", std::to_string(m.n_experts())}});
  state.info_gauge->Set(1);
}

void RunTracker::OnStep(const std::string& run, int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  RunState& state = StateLocked(run);
  if (step <= state.summary.last_step) return;
  state.summary.last_step = step;
  if (state.last_step_gauge == nullptr) {
    state.last_step_gauge = &metrics_.last_step.Add({{"run", run}});
  }
  state.last_step_gauge->Set(static_cast<double>(step));
}

void RunTracker::ResetLastStep(const std::string& run, int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  RunState& state = StateLocked(run);
  state.summary.last_step = step;
  if (step < 0) return;
  if (state.last_step_gauge == nullptr) {
    state.last_step_gauge = &metrics_.last_step.Add({{"run", run}});
  }
  state.last_step_gauge->Set(static_cast<double>(step));
}

int64_t RunTracker::LastStep(const std::string& run) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = runs_.find(run);
  return it == runs_.end() ? -1 : it->second.summary.last_step;
}

void RunTracker::OnRunForgotten(const std::string& run) {
  std::lock_guard<std::mutex> lock(mu_);
  if (const auto it = runs_.find(run); it != runs_.end()) {
    RunState& state = it->second;
    if (state.info_gauge != nullptr) metrics_.run_info.Remove(state.info_gauge);
    if (state.last_step_gauge != nullptr) metrics_.last_step.Remove(state.last_step_gauge);
    state.info_gauge = nullptr;  // a later Hello describes the run again
    state.last_step_gauge = nullptr;
    state.series_added = false;
  }
  // Also signal gauges exported without a summary here (restored from the store).
  metrics_.RemoveRun(run);
}

std::vector<RunTracker::RunSummary> RunTracker::Runs() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<RunSummary> out;
  for (const auto& [run, state] : runs_) out.push_back(state.summary);
  return out;
}

}  // namespace foreshock::server
