// Reads values back from a prometheus-cpp registry, for tests.
#pragma once

#include <cmath>
#include <limits>
#include <map>
#include <string>

#include <prometheus/registry.h>

namespace foreshock::testing {

// The value of the sample of family `name` whose labels are exactly `labels`,
// or NaN when there is none.
inline double MetricValue(prometheus::Registry& registry, const std::string& name,
                          const std::map<std::string, std::string>& labels = {}) {
  for (const auto& family : registry.Collect()) {
    if (family.name != name) continue;
    for (const auto& metric : family.metric) {
      std::map<std::string, std::string> got;
      for (const auto& label : metric.label) got[label.name] = label.value;
      if (got != labels) continue;
      switch (family.type) {
        case prometheus::MetricType::Counter: return metric.counter.value;
        case prometheus::MetricType::Gauge: return metric.gauge.value;
        default: return metric.untyped.value;
      }
    }
  }
  return std::numeric_limits<double>::quiet_NaN();
}

// 0 when the counter does not exist yet.
inline double CounterValue(prometheus::Registry& registry, const std::string& name,
                           const std::map<std::string, std::string>& labels = {}) {
  const double v = MetricValue(registry, name, labels);
  return std::isnan(v) ? 0.0 : v;
}

}  // namespace foreshock::testing
