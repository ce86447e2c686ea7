// The probable-cause rule table (DESIGN.md sections 1.2 and 5).
//
// Evidence is the set of alert families that fired in a run near its onset
// (see ProbableCauseConfig::onset_window_steps). Families:
//   attention        ForeshockQKIncrementCollapse, ForeshockAttentionLogitGrowth,
//                    ForeshockAttentionEntropyCollapse
//   router collapse  ForeshockRouterCollapse (entropy drop, flip surge, z-loss, dead experts)
//   router imbalance ForeshockRouterImbalance (load CV, MaxVio)
//   curvature        ForeshockCurvatureAboveEdge (rho surge or rho > 1)
//   (loss spikes and non-finite values are consequences, not evidence)
//
// Rules, first match wins:
//
//   attention | curvature or router collapse | router imbalance || cause
//   ----------+------------------------------+------------------++------------------------
//   yes       | yes                          | any              || combined
//   no        | yes                          | any              || learning_rate_too_high
//   yes       | no                           | no               || low_precision_attention
//   yes       | no                           | yes              || unknown
//   no        | no                           | any              || unknown
//
// Why: a precision fault in attention leaves the router and the curvature
// quiet at first, while a too-large learning rate shows first in the
// curvature and the router (rising logit norms, falling entropy, flip
// surges, dead experts). A router that is only imbalanced is not quiet, yet
// is no evidence of a learning-rate problem either, so attention plus
// imbalance stays unknown.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace foreshock::alerts {

enum class ProbableCause : uint8_t {
  kUnknown,
  kLowPrecisionAttention,
  kLearningRateTooHigh,
  kCombined,
};

// "unknown", "low_precision_attention", "learning_rate_too_high", "combined"
// (the probable_cause annotation values, DESIGN.md section 5).
std::string_view ProbableCauseName(ProbableCause cause);

enum class AlertFamily : uint8_t {
  kAttention,
  kRouterCollapse,
  kRouterImbalance,
  kCurvature,
  kConsequence,  // loss spikes, non-finite values
};

// The family of one of the DESIGN.md alert names (kConsequence for others).
AlertFamily FamilyOfAlert(std::string_view alertname);

struct CauseEvidence {
  bool attention = false;
  bool router_collapse = false;
  bool router_imbalance = false;
  bool curvature = false;
};

ProbableCause ClassifyProbableCause(const CauseEvidence& evidence);

// The suggested_action annotation for `cause`; `rollback_step` is the step
// before which the last good checkpoint lies (the run's earliest anomaly).
std::string SuggestedAction(ProbableCause cause, int64_t rollback_step);

}  // namespace foreshock::alerts
