// Passes the trainer's per-step scalars through as run-level signals.
//
// Fields are independent, so a non-finite loss does not hide a finite lr:
// non-finite present fields are counted (Emitter::NonFinite) and only the
// finite ones are emitted.
#include <array>
#include <cmath>

#include "detectors/detector.h"

namespace foreshock::detectors {
namespace {

constexpr std::array<SignalSpec, 3> kScalarSignals = {{
    {"loss", "Training loss reported by the trainer for the latest step.", SignalScope::kRun},
    {"grad_norm", "Global gradient norm reported by the trainer for the latest step.",
     SignalScope::kRun},
    {"lr", "Learning rate reported by the trainer for the latest step.", SignalScope::kRun},
}};

class ScalarsDetector final : public Detector {
 public:
  static constexpr std::string_view kName = "scalars";
  static constexpr SampleKind kKind = SampleKind::kScalars;
  static std::span<const SignalSpec> Signals() { return kScalarSignals; }

  explicit ScalarsDetector(const DetectorOptions&) {}

  void Process(const Sample& sample, Emitter& emitter) override {
    const auto& scalars = std::get<ScalarsSample>(sample.payload);
    int64_t non_finite = 0;
    auto emit = [&](bool present, std::string_view signal, double value) {
      if (!present) return;
      if (!std::isfinite(value)) {
        ++non_finite;
        return;
      }
      emitter.Emit(Observation{signal, kNoLayer, kAllHeads, value});
    };
    emit(scalars.has_loss, "loss", scalars.loss);
    emit(scalars.has_grad_norm, "grad_norm", scalars.grad_norm);
    emit(scalars.has_lr, "lr", scalars.lr);
    if (non_finite > 0) emitter.NonFinite(SampleKind::kScalars, non_finite);
  }

  void ForgetRun(const std::string&) override {}  // stateless
};

}  // namespace

FORESHOCK_REGISTER_DETECTOR(ScalarsDetector);

}  // namespace foreshock::detectors
