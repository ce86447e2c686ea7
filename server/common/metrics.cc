#include "server/common/metrics.h"

#include <spdlog/spdlog.h>

#include <atomic>
#include <string>


namespace foreshock::server {
namespace {

std::string Prefixed(std::string_view name) {
  return std::string(kMetricPrefix) + std::string(name);
}

}  // namespace

const prometheus::Histogram::BucketBoundaries& DaemonMetrics::DetectorSecondsBuckets() {
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1};
  return kBuckets;
}

DaemonMetrics::DaemonMetrics(prometheus::Registry& registry, bool per_head_metrics,
                             int64_t max_signal_series)
    :
#define FORESHOCK_BUILD_FAMILY(member, name, help) \
  member(prometheus::BuildCounter().Name(Prefixed(name)).Help(help).Register(registry)),
      FORESHOCK_DAEMON_COUNTERS(FORESHOCK_BUILD_FAMILY)
#undef FORESHOCK_BUILD_FAMILY
#define FORESHOCK_BUILD_FAMILY(member, name, help) \
  member(prometheus::BuildGauge().Name(Prefixed(name)).Help(help).Register(registry)),
      FORESHOCK_DAEMON_GAUGES(FORESHOCK_BUILD_FAMILY)
#undef FORESHOCK_BUILD_FAMILY
#define FORESHOCK_BUILD_FAMILY(member, name, help) \
  member(prometheus::BuildHistogram().Name(Prefixed(name)).Help(help).Register(registry)),
      FORESHOCK_DAEMON_HISTOGRAMS(FORESHOCK_BUILD_FAMILY)
#undef FORESHOCK_BUILD_FAMILY
      per_head_metrics_(per_head_metrics),
      max_signal_series_(max_signal_series),
      signal_series_gauge_(&metrics_signal_series.Add({})),
      series_dropped_(&metrics_series_dropped_total.Add({})) {
  // Label-free series exist from the start, so that rate() and dashboards see 0, not absence.
  ingest_bytes_total.Add({});
  ingest_streams_total.Add({});
  ingest_duplicate_batches_total.Add({});
  watch_events_dropped_total.Add({});
  ingest_active_streams.Add({});
  streams_waiting_for_queue.Add({});
  queue_bytes.Add({});
  query_bytes.Add({});
  for (const char* reason : {"too_large", "busy"}) query_refused_total.Add({{"reason", reason}});
  for (size_t i = 0; i < kSampleKinds; ++i) {
    const std::string kind = detectors::SampleKindName(static_cast<detectors::SampleKind>(i));
    records_accepted_[i] = &ingest_records_total.Add({{"kind", kind}});
    samples_processed_[i] = &samples_processed_total.Add({{"kind", kind}});
  }
  for (std::string_view outcome : kAlertPointOutcomes) {
    alert_points_total.Add({{"outcome", std::string(outcome)}});
  }
  for (const detectors::DetectorInfo& detector : detectors::DetectorRegistry::Instance().detectors()) {
    const prometheus::Labels labels{{"detector", std::string(detector.name)}};
    detectors_.emplace(std::string(detector.name),
                       DetectorSeries{&detector_seconds.Add(labels, DetectorSecondsBuckets()),
                                      &detector_errors_total.Add(labels)});
    for (const detectors::SignalSpec& spec : detector.signals) {
      auto& family = prometheus::BuildGauge()
                         .Name(Prefixed(spec.name))
                         .Help(std::string(spec.help))
                         .Register(registry);
      signals_.emplace(std::string(spec.name), SignalFamily{&spec, &family});
    }
  }
}

prometheus::Family<prometheus::Gauge>* DaemonMetrics::signal(std::string_view name) const {
  auto it = signals_.find(name);
  return it == signals_.end() ? nullptr : it->second.family;
}

bool DaemonMetrics::ExportObservation(const std::string& run,
                                      const detectors::Observation& observation) {
  auto it = signals_.find(observation.signal);
  if (it == signals_.end()) return false;
  const bool per_head = observation.head != detectors::kAllHeads;
  if (per_head && !per_head_metrics_) return false;
  prometheus::Labels labels{{"run", run}};
  switch (it->second.spec->scope) {
    case detectors::SignalScope::kRun:
      // Run-level values in the head slot are one rank's step scalars
      // (wire/rank_scalars.h).
      if (per_head) labels.emplace("rank", std::to_string(observation.head));
      break;
    case detectors::SignalScope::kRunBlock:
      labels.emplace("block", std::to_string(observation.layer));
      break;
    case detectors::SignalScope::kLayer:
    case detectors::SignalScope::kLayerHead:
      labels.emplace("layer", std::to_string(observation.layer));
      if (per_head) labels.emplace("head", std::to_string(observation.head));
      break;
  }
  prometheus::Family<prometheus::Gauge>& family = *it->second.family;
  if (!family.Has(labels)) {
    // A new series. A (run, layer) is only ever exported by one worker, so
    // the count overshoots the bound by at most one series per worker.
    if (max_signal_series_ > 0 && signal_series_.load(std::memory_order_relaxed) >= max_signal_series_) {
      series_dropped_->Increment();
      return false;
    }
    signal_series_gauge_->Set(static_cast<double>(signal_series_.fetch_add(1) + 1));
  }
  family.Add(labels).Set(observation.value);
  return true;
}

void DaemonMetrics::DeclareRejectionReasons(std::span<const std::string_view> codes) {
  for (std::string_view code : codes) {
    rejections_.emplace(std::string(code), &ingest_rejected_total.Add({{"reason", std::string(code)}}));
  }
}

void DaemonMetrics::CountRejection(std::string_view reason_code, double n) {
  if (auto it = rejections_.find(reason_code); it != rejections_.end()) {
    it->second->Increment(n);
    return;
  }
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true)) {
    spdlog::error("rejection code '{}' is missing from RejectionReasons() (server/common/metrics.cc)",
                  std::string(reason_code));
  }
  ingest_rejected_total.Add({{"reason", std::string(reason_code)}}).Increment(n);
}

void DaemonMetrics::AddRun(const std::string& run) {
  for (size_t i = 0; i < kSampleKinds; ++i) {
    nonfinite_values_total.Add(
        {{"run", run}, {"kind", detectors::SampleKindName(static_cast<detectors::SampleKind>(i))}});
  }
}

void DaemonMetrics::RemoveRun(const std::string& run) {
  for (size_t i = 0; i < kSampleKinds; ++i) {
    prometheus::Labels labels{
        {"run", run}, {"kind", detectors::SampleKindName(static_cast<detectors::SampleKind>(i))}};
    if (nonfinite_values_total.Has(labels)) {
      nonfinite_values_total.Remove(&nonfinite_values_total.Add(labels));
    }
  }
  int64_t removed = 0;
  for (const auto& [name, signal] : signals_) {
    // A family lists its series only through Collect: one pass per signal,
    // once per forgotten run.
    std::vector<prometheus::Labels> of_run;
    for (const prometheus::MetricFamily& family : signal.family->Collect()) {
      for (const prometheus::ClientMetric& metric : family.metric) {
        prometheus::Labels labels;
        for (const prometheus::ClientMetric::Label& label : metric.label) {
          labels.emplace(label.name, label.value);
        }
        if (const auto it = labels.find("run"); it != labels.end() && it->second == run) {
          of_run.push_back(std::move(labels));
        }
      }
    }
    for (const prometheus::Labels& labels : of_run) {
      if (!signal.family->Has(labels)) continue;
      signal.family->Remove(&signal.family->Add(labels));
      ++removed;
    }
  }
  if (removed > 0) {
    signal_series_gauge_->Set(static_cast<double>(signal_series_.fetch_sub(removed) - removed));
  }
}

prometheus::Histogram* DaemonMetrics::detector_time(std::string_view detector) const {
  auto it = detectors_.find(detector);
  return it == detectors_.end() ? nullptr : it->second.time;
}

prometheus::Counter* DaemonMetrics::detector_errors(std::string_view detector) const {
  auto it = detectors_.find(detector);
  return it == detectors_.end() ? nullptr : it->second.errors;
}

}  // namespace foreshock::server
