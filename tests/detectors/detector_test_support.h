// Shared helpers for detector tests: a recording Emitter and registry lookup.
#pragma once

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "detectors/detector.h"

namespace foreshock::detectors::testing {

struct Recorded {
  std::string signal;
  int layer;
  int head;
  double value;
  bool for_detection;
};

class RecordingEmitter : public Emitter {
 public:
  void Emit(const Observation& o) override {
    observations.push_back({std::string(o.signal), o.layer, o.head, o.value, o.for_detection});
  }
  void NonFinite(SampleKind kind, int64_t count) override {
    non_finite_kind = kind;
    non_finite += count;
  }
  // The single value of `signal` at (layer, head); fails the test if there is
  // not exactly one.
  double Value(const std::string& signal, int layer = kNoLayer, int head = kAllHeads) const {
    const Recorded* found = nullptr;
    for (const Recorded& r : observations) {
      if (r.signal == signal && r.layer == layer && r.head == head) {
        EXPECT_EQ(found, nullptr) << "duplicate " << signal;
        found = &r;
      }
    }
    EXPECT_NE(found, nullptr) << "missing " << signal;
    return found ? found->value : 0.0;
  }
  bool Has(const std::string& signal) const {
    for (const Recorded& r : observations)
      if (r.signal == signal) return true;
    return false;
  }
  void Clear() {
    observations.clear();
    non_finite = 0;
  }

  std::vector<Recorded> observations;
  int64_t non_finite = 0;
  SampleKind non_finite_kind = SampleKind::kScalars;
};

inline std::unique_ptr<Detector> MakeDetector(std::string_view name,
                                              const DetectorOptions& options = {}) {
  for (const DetectorInfo& info : DetectorRegistry::Instance().detectors()) {
    if (info.name == name) return info.create(options);
  }
  ADD_FAILURE() << "detector not registered: " << name;
  return nullptr;
}

}  // namespace foreshock::detectors::testing
