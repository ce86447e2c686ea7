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
//   attention | curvature or router collapse || cause
//   ----------+------------------------------++------------------------
//   yes       | yes                          || combined
//   no        | yes                          || learning_rate_too_high
//   yes       | no                           || low_precision_attention
//   no        | no                           || unknown
//
// Why: a precision fault in attention leaves the router and the curvature
// quiet at first, while a too-large learning rate shows first in the
// curvature and the router (rising logit norms, falling entropy, flip
// surges, dead experts). Router load imbalance alone is no evidence either
// way: on the demo model an attention fault unbalanced the MoE load within
// a few samples of the attention alerts, as the hidden states feeding the
// router changed; so it neither blocks low_precision_attention nor implies
// learning_rate_too_high. Which families count is decided by the engine's
// onset window, so later consequences do not change the diagnosis.
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
  bool router_imbalance = false;  // recorded for completeness; no rule depends on it
  bool curvature = false;
};

ProbableCause ClassifyProbableCause(const CauseEvidence& evidence);

// The suggested_action annotation for `cause`; `rollback_step` is the step
// before which the last good checkpoint lies (the run's earliest anomaly).
std::string SuggestedAction(ProbableCause cause, int64_t rollback_step);

}  // namespace foreshock::alerts
