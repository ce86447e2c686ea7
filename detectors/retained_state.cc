#include "detectors/retained_state.h"

#include "detectors/detector.h"

namespace foreshock::detectors {

// The detector of the sample's kind that keeps probe state says what it
// will hold (DetectorInfo::retained_by, registered with it).
std::optional<RetainedFootprint> RetainedBy(const Sample& sample, const DetectorOptions& options) {
  for (const DetectorInfo& info : DetectorRegistry::Instance().detectors()) {
    if (info.kind != sample.kind() || !info.retained_by) continue;
    if (std::optional<RetainedFootprint> footprint = info.retained_by(sample, options)) {
      return footprint;
    }
  }
  return std::nullopt;
}

}  // namespace foreshock::detectors
