#include "server/metrics.h"

#include <string>

namespace foreshock::server {
namespace {

std::string Prefixed(std::string_view name) {
  return std::string(kMetricPrefix) + std::string(name);
}

}  // namespace

DaemonMetrics::DaemonMetrics(prometheus::Registry& registry, bool per_head_metrics)
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
      per_head_metrics_(per_head_metrics) {
  // Label-free series exist from the start, so that rate() and dashboards see 0, not absence.
  ingest_bytes_total.Add({});
  ingest_streams_total.Add({});
  ingest_active_streams.Add({});
  streams_waiting_for_queue.Add({});
  queue_bytes.Add({});
  for (size_t i = 0; i < kSampleKinds; ++i) {
    const std::string kind = detectors::SampleKindName(static_cast<detectors::SampleKind>(i));
    records_accepted_[i] = &ingest_records_total.Add({{"kind", kind}});
    samples_processed_[i] = &samples_processed_total.Add({{"kind", kind}});
  }
  for (const detectors::DetectorInfo& detector : detectors::DetectorRegistry::Instance().detectors()) {
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

void DaemonMetrics::ExportObservation(const std::string& run,
                                      const detectors::Observation& observation) {
  auto it = signals_.find(observation.signal);
  if (it == signals_.end()) return;
  const bool per_head = observation.head != detectors::kAllHeads;
  if (per_head && !per_head_metrics_) return;
  prometheus::Labels labels{{"run", run}};
  switch (it->second.spec->scope) {
    case detectors::SignalScope::kRun:
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
  it->second.family->Add(labels).Set(observation.value);
}

void DaemonMetrics::CountRejection(std::string_view reason_code, double n) {
  ingest_rejected_total.Add({{"reason", std::string(reason_code)}}).Increment(n);
}

}  // namespace foreshock::server
