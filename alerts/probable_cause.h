// The probable-cause rule table (docs/DESIGN.md §1.1, §1.2 and §5.5).
//
// Evidence, gathered by the engine per run near its mechanism onset (the
// first_step of the earliest mechanism alert; see ProbableCauseConfig):
//   qk spectrum      ForeshockQKIncrementCollapse: the QK increment concentrates
//                    in a few directions (entropy drop, top-1 share rise)
//   attention logits ForeshockAttentionLogitGrowth, ForeshockAttentionEntropyCollapse
//   router logit     ForeshockRouterCollapse from router_z_loss (rise) or
//     growth         router_entropy (drop): the router's logits grow and sharpen
//   router collapse  ForeshockRouterCollapse from the rest (flip surge, dead experts)
//   router imbalance ForeshockRouterImbalance (load CV, MaxVio)
//   curvature        ForeshockCurvatureAboveEdge (rho surge or rho > 1)
//   LR rise          ForeshockLearningRateSurge (the LR the run streams,
//                    StepScalars.lr, above three times the highest it has trained at),
//                    or, without that alert, an LR lr_rise_factor or more above
//                    its own lagged baseline
//   fp32 attention   every layer's QKSample.attention_dtype says FLOAT32: the
//                    precision column below is "no", and attention evidence
//                    counts as learning-rate evidence
//   unbiased output  every bf16/fp16 layer sent output checks and no rounding
//                    bias was measured: the same as fp32 attention (config
//                    unbiased_output_rules_out_precision)
//   (loss spikes and non-finite values are consequences, not evidence)
//
//   rounding bias    ForeshockAttentionRoundingBias: the attention output is
//                    biased against the client's fp32 reference (measured, so
//                    it counts whatever the declared dtype and the order)
//
// With  precision = rounding bias, or qk spectrum or attention logits that
//                   began before any learning-rate evidence (the LR had not
//                   yet risen, and neither the curvature nor the router had
//                   alerted),
//       learning rate = LR rise or curvature or router logit growth, or
//                       router collapse together with attention, curvature
//                       or LR-rise evidence (a router collapse alone names
//                       no cause: unknown),
//       attention = qk spectrum or attention logits,
// first match wins:
//
//   precision | learning rate | attention || cause
//   ----------+---------------+-----------++------------------------
//   yes       | yes           |  (yes)    || combined
//   no        | yes           |  any      || learning_rate_too_high
//   yes       | no            |  any      || low_precision_attention
//   -         | no            |  yes      || low_precision_attention
//   -         | no            |  no       || unknown
//
// Why: the spectral entropy and top-1 share of the QK increment are
// scale-invariant, so a larger learning rate, which scales every update, does
// not move them by itself; biased rounding in low-precision attention does
// (its gradient errors point the same way every step). But an update large
// enough to destabilize the run moves everything: on the evaluation corpus a
// 15-100x LR jump collapsed the QK increment within 40 steps, and logit
// growth and attention-entropy collapse follow from any too-large update. So
// with learning-rate evidence present, attention evidence counts as a
// precision fault only when it began before the learning rate went up (a
// cause cannot follow its effect).
// A too-large learning rate shows in the curvature and the router (rising logit
// norms, falling entropy, flip surges, dead experts), and most directly in the
// LR the run reports. Router load imbalance alone is no evidence either way:
// an attention fault unbalanced the MoE load within a few samples, as the
// hidden states feeding the router changed.
// A learning-rate surge is a job input, never a consequence of instability:
// one that fires while the episode is still active joins the diagnosis even
// after the onset window and after the cause settled (a settled
// low_precision_attention becomes combined), so a ramp that passes the
// surge bound only after the precision fault was seen is still named.
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
