// What the daemon knows about each run: its Hello (job, model shape) and the
// highest step processed. Feeds foreshock_run_info and foreshock_last_step.
// A forgotten run keeps its summary (ListRuns) and leaves /metrics: its
// run_info, last_step, nonfinite_values_total and signal series go.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "foreshock/v1/ingest.pb.h"
#include "server/common/metrics.h"
#include "server/pipeline/run_state_owner.h"

namespace foreshock::server {

class RunTracker : public RunStateOwner {
 public:
  explicit RunTracker(DaemonMetrics& metrics) : metrics_(metrics) {}

  void OnHello(const foreshock::v1::Hello& hello);
  void OnStep(const std::string& run, int64_t step);
  // The run resumed from a checkpoint (server/pipeline/run_lifecycle.h): its
  // last step (and foreshock_last_step) becomes `step`, where the resumed
  // attempt stands, even though a superseded attempt had gone further.
  void ResetLastStep(const std::string& run, int64_t step);
  int64_t LastStep(const std::string& run) const;  // -1: none or unknown run

  // RunStateOwner: only forgetting changes what is exported.
  void OnRunRestarted(const std::string&) override {}
  void OnRunEnded(const std::string&) override {}
  void OnRunForgotten(const std::string& run) override;

  struct RunSummary {
    std::string run;
    std::string job;
    foreshock::v1::ModelInfo model;
    int64_t last_step = -1;
    int ranks_seen = 0;
  };
  std::vector<RunSummary> Runs() const;

 private:
  struct RunState {
    RunSummary summary;
    std::map<int32_t, bool> ranks;
    prometheus::Gauge* last_step_gauge = nullptr;
    prometheus::Gauge* info_gauge = nullptr;
    bool series_added = false;  // DaemonMetrics::AddRun
  };
  RunState& StateLocked(const std::string& run);
  DaemonMetrics& metrics_;
  mutable std::mutex mu_;
  std::map<std::string, RunState> runs_;
};

}  // namespace foreshock::server
