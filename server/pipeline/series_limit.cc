#include "server/pipeline/series_limit.h"

#include <spdlog/spdlog.h>

namespace foreshock::server {

SeriesLimitSink::SeriesLimitSink(ObservationSink& inner, int64_t max_series_per_run,
                                 DaemonMetrics& metrics)
    : inner_(inner),
      max_series_per_run_(max_series_per_run),
      limited_(metrics.series_limited_total.Add({})) {}

void SeriesLimitSink::OnObservation(const detectors::Sample& sample,
                                    const detectors::Observation& observation) {
  if (max_series_per_run_ > 0) {
    std::string key(observation.signal);
    key += '\0';
    key += std::to_string(observation.layer);
    key += '\0';
    key += std::to_string(observation.head);
    std::lock_guard<std::mutex> lock(mu_);
    RunSeries& run = runs_[sample.run];
    if (!run.keys.contains(key)) {
      if (static_cast<int64_t>(run.keys.size()) >= max_series_per_run_) {
        limited_.Increment();
        if (!run.limited) {
          run.limited = true;
          spdlog::warn("run {} reached --max_series_per_run={}: observations of its new series "
                       "(here {} layer {} head {}) are dropped, not exported nor stored",
                       sample.run, max_series_per_run_, observation.signal, observation.layer,
                       observation.head);
        }
        return;
      }
      run.keys.insert(std::move(key));
    }
  }
  inner_.OnObservation(sample, observation);
}

void SeriesLimitSink::OnRunForgotten(const std::string& run) {
  std::lock_guard<std::mutex> lock(mu_);
  runs_.erase(run);
}

size_t SeriesLimitSink::RunsCounted() {
  std::lock_guard<std::mutex> lock(mu_);
  return runs_.size();
}

}  // namespace foreshock::server
