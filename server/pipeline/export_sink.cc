#include "server/pipeline/export_sink.h"

#include <spdlog/spdlog.h>

#include "server/common/clock.h"

namespace foreshock::server {

namespace {
// The points of the sample the calling worker is processing: a worker handles
// one sample at a time, and the store writes each sample as one record.
thread_local std::vector<KeyedPoint> pending_points;
}  // namespace

void ExportSink::OnObservation(const detectors::Sample& sample,
                               const detectors::Observation& observation) {
  metrics_.ExportObservation(sample.run, observation);
  pending_points.emplace_back(
      SeriesKey{sample.run, std::string(observation.signal), observation.layer, observation.head},
      Point{sample.step, observation.value, NowUnixMillis()});
}

void ExportSink::OnCorrection(const detectors::Sample& sample,
                              const detectors::Observation& observation) {
  pending_points.emplace_back(
      SeriesKey{sample.run, std::string(observation.signal), observation.layer, observation.head},
      Point{sample.step, observation.value, NowUnixMillis()});
}

void ExportSink::OnNonFinite(const detectors::Sample& sample, detectors::SampleKind kind,
                             int64_t count) {
  metrics_.nonfinite_values_total
      .Add({{"run", sample.run}, {"kind", detectors::SampleKindName(kind)}})
      .Increment(static_cast<double>(count));
}

void ExportSink::OnSampleDone(const detectors::Sample& sample) {
  if (!pending_points.empty()) {
    BatchCompletion* batch = CurrentBatchCompletion();
    if (batch != nullptr && batch->collect_points) {
      std::lock_guard<std::mutex> lock(batch->points_mu);
      batch->points.insert(batch->points.end(), pending_points.begin(), pending_points.end());
    } else if (absl::Status stored = store_.AppendBatch(pending_points); !stored.ok()) {
      // Not stored: the batch is refused, not acknowledged (the client resends it).
      if (batch != nullptr) batch->Fail(std::move(stored));
    }
    pending_points.clear();
  }
  metrics_.samples_processed(sample.kind()).Increment();
  runs_.OnStep(sample.run, sample.step);
  samples_processed_.fetch_add(1);
}

size_t ExportSink::RestoreGauges() {
  size_t restored = 0;
  for (const store::RunInfo& run : store_.ListRuns()) {
    for (const store::SeriesInfo& series : store_.ListSeries(run.run)) {
      // Several points share the highest step when a run resumed from a
      // checkpoint; the last one stored is the last one exported.
      const std::vector<Point> last = store_.Range(series.key, series.last_step, series.last_step);
      if (last.empty()) continue;
      detectors::Observation observation;
      observation.signal = series.key.signal;
      observation.layer = series.key.layer;
      observation.head = series.key.head;
      observation.value = last.back().value;
      if (metrics_.ExportObservation(run.run, observation)) ++restored;
    }
  }
  return restored;
}

void ExportSink::OnDetectorTime(std::string_view detector, double seconds) {
  if (prometheus::Histogram* time = metrics_.detector_time(detector)) {
    time->Observe(seconds);
    return;
  }
  metrics_.detector_seconds
      .Add({{"detector", std::string(detector)}}, DaemonMetrics::DetectorSecondsBuckets())
      .Observe(seconds);
}

void ExportSink::OnDetectorError(std::string_view detector, const detectors::Sample& sample,
                                 const char* what) {
  spdlog::error("detector {} failed on a sample of run {} step {}: {}", detector, sample.run,
                sample.step, what);
  if (prometheus::Counter* errors = metrics_.detector_errors(detector)) {
    errors->Increment();
  } else {
    metrics_.detector_errors_total.Add({{"detector", std::string(detector)}}).Increment();
  }
}

}  // namespace foreshock::server
