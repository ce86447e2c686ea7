#include "alerts/probable_cause.h"

#include "alerts/config.h"
#include "alerts/text.h"

namespace foreshock::alerts {

std::string_view ProbableCauseName(ProbableCause cause) {
  switch (cause) {
    case ProbableCause::kUnknown: return "unknown";
    case ProbableCause::kLowPrecisionAttention: return "low_precision_attention";
    case ProbableCause::kLearningRateTooHigh: return "learning_rate_too_high";
    case ProbableCause::kCombined: return "combined";
  }
  return "unknown";
}

AlertFamily FamilyOfAlert(std::string_view alertname) {
  if (alertname == kQKIncrementCollapse) return AlertFamily::kQKSpectrum;
  if (alertname == kAttentionLogitGrowth || alertname == kAttentionEntropyCollapse) {
    return AlertFamily::kAttentionLogits;
  }
  if (alertname == kRouterCollapse) return AlertFamily::kRouterCollapse;
  if (alertname == kRouterImbalance) return AlertFamily::kRouterImbalance;
  if (alertname == kCurvatureAboveEdge) return AlertFamily::kCurvature;
  if (alertname == kLearningRateSurge) return AlertFamily::kLearningRate;
  if (alertname == kAttentionRoundingBias) return AlertFamily::kRoundingBias;
  return AlertFamily::kConsequence;
}

AlertFamily EvidenceFamilyOf(std::string_view alertname, std::string_view signal) {
  const AlertFamily family = FamilyOfAlert(alertname);
  if (family == AlertFamily::kRouterCollapse &&
      (signal == "router_z_loss" || signal == "router_entropy")) {
    return AlertFamily::kRouterLogitGrowth;
  }
  return family;
}

ProbableCause ClassifyProbableCause(const CauseEvidence& evidence) {
  const bool attention = evidence.qk_spectrum || evidence.attention_logits;
  const bool precision =
      evidence.rounding_bias ||
      (!evidence.precision_ruled_out &&
       ((evidence.qk_spectrum && evidence.qk_before_learning_rate) ||
        (evidence.attention_logits && evidence.attention_before_learning_rate)));
  // Dead experts and flip surges are symptoms: with attention, curvature or
  // LR evidence they point at the update size, alone they name no cause (a
  // MoE without load balancing sheds experts at a healthy LR).
  const bool router_points_at_lr =
      evidence.router_collapse && (attention || evidence.curvature || evidence.lr_rise);
  // Growing router logits (z-loss up, routing entropy down) at the onset are
  // the update size's own mark: an attention precision fault leaves the router
  // quiet until the run is already unstable (docs/DESIGN.md §5.3).
  // With fp32 attention an attention instability is the update size's doing.
  const bool learning_rate = evidence.lr_rise || evidence.curvature || router_points_at_lr ||
                             evidence.router_logit_growth ||
                             (evidence.precision_ruled_out && attention);
  if (precision && learning_rate) return ProbableCause::kCombined;
  if (learning_rate) return ProbableCause::kLearningRateTooHigh;
  if (attention || precision) return ProbableCause::kLowPrecisionAttention;
  return ProbableCause::kUnknown;
}

std::string SuggestedAction(ProbableCause cause, int64_t rollback_step) {
  const std::string rollback =
      internal::Cat("roll back to the last checkpoint before step ", rollback_step);
  switch (cause) {
    case ProbableCause::kLowPrecisionAttention:
      return internal::Cat(
          "Keep the attention softmax and P.V products in fp32 (disable the low-precision "
          "attention kernel), add QK-norm or QK-clip, and ",
          rollback, ".");
    case ProbableCause::kLearningRateTooHigh:
      return internal::Cat("Lower the learning rate (or lengthen its warm-up) and ", rollback, ".");
    case ProbableCause::kCombined:
      return internal::Cat(
          "Lower the learning rate, keep the attention softmax and P.V products in fp32 with "
          "QK-norm or QK-clip, and ",
          rollback, ".");
    case ProbableCause::kUnknown: break;
  }
  return internal::Cat(
      "Inspect the run's foreshock signals for the alerted layers; if they keep degrading, ",
      rollback, ".");
}

}  // namespace foreshock::alerts
