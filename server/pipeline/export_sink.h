// Sends detector output to Prometheus gauges and the series store.
#pragma once

#include <atomic>

#include "server/common/metrics.h"
#include "server/pipeline/run_tracker.h"
#include "server/pipeline/series_store.h"
#include "server/pipeline/worker_pool.h"

namespace foreshock::server {

class ExportSink final : public ObservationSink {
 public:
  ExportSink(DaemonMetrics& metrics, SeriesStore& store, RunTracker& runs)
      : metrics_(metrics), store_(store), runs_(runs) {}

  void OnObservation(const detectors::Sample& sample,
                     const detectors::Observation& observation) override;
  void OnNonFinite(const detectors::Sample& sample, detectors::SampleKind kind,
                   int64_t count) override;
  void OnSampleDone(const detectors::Sample& sample) override;
  // Stored with the sample's points; the gauge keeps the latest step's value.
  void OnCorrection(const detectors::Sample& sample,
                    const detectors::Observation& observation) override;
  void OnDetectorTime(std::string_view detector, double seconds) override;
  void OnDetectorError(std::string_view detector, const detectors::Sample& sample,
                       const char* what) override;

  uint64_t samples_processed() const { return samples_processed_.load(); }

  // Sets the signal gauges of every run in the store to the value at each
  // series' highest stored step, so that after a restart the gauges of runs
  // that do not stream again are there, as they were before it, next to
  // their run_info, last_step and restored alert_active series. Called once
  // at startup, before ingest. Returns the number of gauges set.
  size_t RestoreGauges();

 private:
  DaemonMetrics& metrics_;
  SeriesStore& store_;
  RunTracker& runs_;
  std::atomic<uint64_t> samples_processed_{0};
};

}  // namespace foreshock::server
