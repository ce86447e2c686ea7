#include "server/pipeline/run_tracker.h"

namespace foreshock::server {

void RunTracker::OnHello(const foreshock::v1::Hello& hello) {
  std::lock_guard<std::mutex> lock(mu_);
  RunState& state = runs_[hello.run_id()];
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
  RunState& state = runs_[run];
  if (step <= state.summary.last_step) return;
  state.summary.last_step = step;
  if (state.last_step_gauge == nullptr) {
    state.last_step_gauge = &metrics_.last_step.Add({{"run", run}});
  }
  state.last_step_gauge->Set(static_cast<double>(step));
}

std::vector<RunTracker::RunSummary> RunTracker::Runs() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<RunSummary> out;
  for (const auto& [run, state] : runs_) out.push_back(state.summary);
  return out;
}

}  // namespace foreshock::server
