#include "detectors/detector.h"

#include <stdexcept>

namespace foreshock::detectors {

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
  }
  return "unknown";
}

const char* SampleKindName(SampleKind kind) {
  switch (kind) {
    case SampleKind::kScalars: return "scalars";
    case SampleKind::kQK: return "qk";
    case SampleKind::kRouter: return "router";
    case SampleKind::kCurvature: return "curvature";
  }
  return "unknown";
}

int Sample::layer() const {
  switch (kind()) {
    case SampleKind::kQK: return std::get<QKSample>(payload).layer;
    case SampleKind::kRouter: return std::get<RouterSample>(payload).layer;
    default: return kNoLayer;
  }
}

DetectorRegistry& DetectorRegistry::Instance() {
  static DetectorRegistry* registry = new DetectorRegistry();  // never destroyed: used from static init
  return *registry;
}

void DetectorRegistry::Register(DetectorInfo info) {
  for (const SignalSpec& spec : info.signals) {
    if (FindSignal(spec.name) != nullptr) {
      throw std::logic_error("signal registered twice: " + std::string(spec.name));
    }
  }
  detectors_.push_back(std::move(info));
}

const SignalSpec* DetectorRegistry::FindSignal(std::string_view name) const {
  for (const DetectorInfo& info : detectors_) {
    for (const SignalSpec& spec : info.signals) {
      if (spec.name == name) return &spec;
    }
  }
  return nullptr;
}

}  // namespace foreshock::detectors
