// The probable-cause rule table: which alert families count as evidence of
// a precision fault or of a too-large learning rate, and the cause they name
// (combined, learning_rate_too_high, low_precision_attention, unknown). The
// engine gathers each run's evidence near its mechanism onset (the first
// step of its earliest mechanism alert that is not a symptom;
// ProbableCauseConfig says how near)
// and settles the cause; the table, the evidence families and why attention
// evidence counts for precision only when it began before any learning-rate
// evidence are docs/DESIGN.md §5.5. Loss spikes and non-finite values are
// consequences, never evidence.
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
// (the probable_cause annotation values, docs/DESIGN.md §5.4).
std::string_view ProbableCauseName(ProbableCause cause);

enum class AlertFamily : uint8_t {
  kQKSpectrum,
  kAttentionLogits,
  kRouterCollapse,
  kRouterImbalance,
  kCurvature,
  kLearningRate,  // ForeshockLearningRateSurge: the LR the run streams
  kConsequence,   // loss spikes, non-finite values
  // ForeshockAttentionRoundingBias: the attention output measured against an
  // fp32 reference (after kConsequence: checkpoints list families in this order).
  kRoundingBias,
  // ForeshockRouterCollapse raised by router_z_loss or router_entropy: the
  // router's logits grow and sharpen, which is what an oversized update does
  // to every logit. Evidence only (its alert is a router collapse); the last
  // family, for the same checkpoint reason.
  kRouterLogitGrowth,
};

// Dead experts, flip surges and load imbalance are symptoms: alone they name
// no cause (a MoE without load balancing sheds experts at a healthy LR), so
// they count as evidence but do not anchor a run's mechanism onset.
inline bool IsSymptomFamily(AlertFamily family) {
  return family == AlertFamily::kRouterCollapse || family == AlertFamily::kRouterImbalance;
}

// The family of one of the docs/DESIGN.md §5.1 alert names (kConsequence for others).
AlertFamily FamilyOfAlert(std::string_view alertname);
// The family an alert is evidence of: its alert's family, except a router
// collapse read from the router's logits (z-loss, entropy), which is
// kRouterLogitGrowth.
AlertFamily EvidenceFamilyOf(std::string_view alertname, std::string_view signal);

struct CauseEvidence {
  bool qk_spectrum = false;
  bool attention_logits = false;
  bool router_collapse = false;  // dead experts, flip surges
  bool router_logit_growth = false;  // router z-loss rise, router entropy drop
  bool router_imbalance = false;  // recorded for completeness; no rule depends on it
  bool curvature = false;
  bool lr_rise = false;
  // The attention kernel's output is biased against its fp32 reference: a
  // direct measurement of a precision fault, whatever else fired when.
  bool rounding_bias = false;
  // The attention-logit evidence began before any learning-rate evidence.
  bool attention_before_learning_rate = false;
  // The QK-spectrum evidence began before any learning-rate evidence.
  bool qk_before_learning_rate = false;
  // Every layer that reports its attention compute dtype computes in fp32:
  // no precision fault (and attention evidence then points at the update size).
  bool precision_ruled_out = false;
};

ProbableCause ClassifyProbableCause(const CauseEvidence& evidence);

// The suggested_action annotation for `cause`; `rollback_step` is the step
// before which the last good checkpoint lies (the run's earliest anomaly).
std::string SuggestedAction(ProbableCause cause, int64_t rollback_step);

}  // namespace foreshock::alerts
