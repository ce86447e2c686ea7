// --max_series_per_run: a cardinality guard in front of every observation
// consumer (Prometheus gauges, the series store, the alert engine). A run may
// create up to the limit of distinct (signal, layer, head) series; the
// observations of any further new series are dropped and counted in
// foreshock_series_limited_total, and logged once per run. Series a run
// already has keep flowing.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "server/common/metrics.h"
#include "server/pipeline/worker_pool.h"

namespace foreshock::server {

class SeriesLimitSink final : public ObservationSink, public RunStateOwner {
 public:
  // `max_series_per_run` <= 0: no limit (everything is forwarded).
  SeriesLimitSink(ObservationSink& inner, int64_t max_series_per_run, DaemonMetrics& metrics);

  void OnObservation(const detectors::Sample& sample,
                     const detectors::Observation& observation) override;
  void OnNonFinite(const detectors::Sample& sample, detectors::SampleKind kind,
                   int64_t count) override {
    inner_.OnNonFinite(sample, kind, count);
  }
  void OnSampleDone(const detectors::Sample& sample) override { inner_.OnSampleDone(sample); }
  // A series that exists already (its step was observed): no limit to apply.
  void OnCorrection(const detectors::Sample& sample,
                    const detectors::Observation& observation) override {
    inner_.OnCorrection(sample, observation);
  }
  void OnDetectorTime(std::string_view detector, double seconds) override {
    inner_.OnDetectorTime(detector, seconds);
  }
  void OnDetectorError(std::string_view detector, const detectors::Sample& sample,
                       const char* what) override {
    inner_.OnDetectorError(detector, sample, what);
  }
  // RunStateOwner: a forgotten run's series are no longer counted (a run
  // that comes back counts its series afresh).
  void OnRunRestarted(const std::string&) override {}
  void OnRunEnded(const std::string&) override {}
  void OnRunForgotten(const std::string& run) override;
  size_t RunsCounted();

 private:
  struct RunSeries {
    std::unordered_set<std::string> keys;  // signal '\0' layer '\0' head
    bool limited = false;                  // logged once
  };
  ObservationSink& inner_;
  const int64_t max_series_per_run_;
  prometheus::Counter& limited_;
  std::mutex mu_;
  std::unordered_map<std::string, RunSeries> runs_;
};

}  // namespace foreshock::server
