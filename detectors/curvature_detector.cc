// Curvature against the edge of stability (docs/DESIGN.md §1.3). The client
// estimates lambda_max of the (preconditioned) Hessian with warm-started
// Lanczos; the daemon compares it with the stability threshold of the
// optimizer: rho = lambda / tau. rho near 1 is normal at the edge of
// stability; a surge or a sustained rho > 1 precedes instability.
#include <array>
#include <cmath>

#include "detectors/curvature.h"
#include "detectors/curvature_detector.h"
#include "detectors/detector.h"

namespace foreshock::detectors {
namespace {

constexpr std::array<SignalSpec, 8> kCurvatureSignals = {{
    {"curvature_lambda_max",
     "Largest eigenvalue of the (Adam-preconditioned) Hessian on the probe batch.",
     SignalScope::kRun},
    {"curvature_eos_ratio",
     "lambda_max / tau, tau the edge-of-stability threshold of the optimizer (2/lr for "
     "gradient descent, (2+2*beta1)/((1-beta1)*lr) for Adam).",
     SignalScope::kRun},
    {"curvature_eos_threshold", "The edge-of-stability threshold tau used for the ratio.",
     SignalScope::kRun},
    {"curvature_residual", "Relative residual ||Av - lambda v|| / |lambda| of the estimate.",
     SignalScope::kRun},
    {"curvature_hvps", "Hessian-vector products spent on the estimate.", SignalScope::kRun},
    {"curvature_overlap", "Overlap <v_t, v_(t-1)> of consecutive top eigenvector estimates.",
     SignalScope::kRun},
    {"curvature_converged",
     "1 if the estimate's residual is within the configured bound, else 0 (then it is kept "
     "out of detection).",
     SignalScope::kRun},
    {"curvature_block_rayleigh",
     "Per-transformer-block contribution v_l^T (A v)_l to the Rayleigh quotient.",
     SignalScope::kRunBlock},
}};

}  // namespace

double EdgeOfStabilityThreshold(double lr, double beta1, bool preconditioned) {
  if (!(lr > 0) || !(beta1 >= 0 && beta1 < 1)) return 0;
  // Adam: (2 + 2 beta1) / ((1 - beta1) lr). Heavy-ball SGD with momentum beta1:
  // (2 + 2 beta1) / lr, which is 2 / lr for plain gradient descent.
  return preconditioned ? (2 + 2 * beta1) / ((1 - beta1) * lr) : (2 + 2 * beta1) / lr;
}

namespace {

class CurvatureDetector final : public Detector {
 public:
  static constexpr std::string_view kName = "curvature";
  static constexpr SampleKind kKind = SampleKind::kCurvature;
  static std::span<const SignalSpec> Signals() { return kCurvatureSignals; }

  explicit CurvatureDetector(const DetectorOptions& options)
      : max_residual_(options.Get<CurvatureDetectorOptions>().max_residual) {}

  void Process(const Sample& sample, Emitter& emitter) override {
    const auto& c = std::get<CurvatureSample>(sample.payload);
    int64_t non_finite = !std::isfinite(c.lambda_max) + !std::isfinite(c.residual);
    for (double r : c.layer_rayleigh) non_finite += !std::isfinite(r);
    if (non_finite > 0) {
      emitter.NonFinite(SampleKind::kCurvature, non_finite);
      return;
    }
    const bool converged = c.residual <= max_residual_;
    auto emit = [&](std::string_view signal, double value, int index = kNoLayer) {
      Observation observation{signal, index, kAllHeads, value};
      observation.for_detection = converged;
      emitter.Emit(observation);
    };
    emit("curvature_lambda_max", c.lambda_max);
    const double tau = EdgeOfStabilityThreshold(c.lr, c.beta1, c.preconditioned);
    if (tau > 0) {
      emit("curvature_eos_threshold", tau);
      emit("curvature_eos_ratio", c.lambda_max / tau);
    }
    emit("curvature_residual", c.residual);
    emit("curvature_hvps", c.hvps);
    emit("curvature_overlap", c.overlap);
    emit("curvature_converged", converged ? 1.0 : 0.0);
    for (size_t block = 0; block < c.layer_rayleigh.size(); ++block) {
      emit("curvature_block_rayleigh", c.layer_rayleigh[block], static_cast<int>(block));
    }
  }

  void ForgetRun(const std::string&) override {}  // stateless: the client keeps the vector

 private:
  const double max_residual_;
};

}  // namespace

FORESHOCK_REGISTER_DETECTOR(CurvatureDetector);

}  // namespace foreshock::detectors
