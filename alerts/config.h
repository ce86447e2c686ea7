// Alert engine configuration: which signals drive which alert, and every
// threshold, window and persistence per signal.
//
// DefaultAlertConfig() is the documented source of the defaults; the
// checked-in deploy/foreshock.yaml spells out the same values in the file
// layout (a test keeps the two equal). A YAML file (--config) overrides only
// the keys it names: code defaults of the signal < alerts.defaults <
// alerts.signals.<name>. Every key, its default and its range are in
// docs/OPERATIONS.md ("Alert configuration keys"). Unknown keys, wrong types and
// out-of-range values are errors that name the key and its line.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "alerts/change_detector.h"

namespace foreshock::alerts {

// The alert names of docs/DESIGN.md §5.1 (public contract).
inline constexpr std::string_view kQKIncrementCollapse = "ForeshockQKIncrementCollapse";
inline constexpr std::string_view kAttentionLogitGrowth = "ForeshockAttentionLogitGrowth";
inline constexpr std::string_view kAttentionEntropyCollapse = "ForeshockAttentionEntropyCollapse";
inline constexpr std::string_view kRouterCollapse = "ForeshockRouterCollapse";
inline constexpr std::string_view kRouterImbalance = "ForeshockRouterImbalance";
inline constexpr std::string_view kCurvatureAboveEdge = "ForeshockCurvatureAboveEdge";
inline constexpr std::string_view kLearningRateSurge = "ForeshockLearningRateSurge";
inline constexpr std::string_view kAttentionRoundingBias = "ForeshockAttentionRoundingBias";
inline constexpr std::string_view kLossSpike = "ForeshockLossSpike";
inline constexpr std::string_view kNonFinite = "ForeshockNonFinite";
inline constexpr std::string_view kLossDiverging = "ForeshockLossDiverging";
inline constexpr std::array<std::string_view, 11> kAlertNames = {
    kQKIncrementCollapse,
    kAttentionLogitGrowth,
    kAttentionEntropyCollapse,
    kRouterCollapse,
    kRouterImbalance,
    kCurvatureAboveEdge,
    kLearningRateSurge,
    kAttentionRoundingBias,
    kLossSpike,
    kNonFinite,
    kLossDiverging,
};

// Severity label values accepted in the configuration.
inline constexpr std::array<std::string_view, 3> kSeverities = {"info", "warning", "critical"};

struct SignalConfig {
  std::string alertname;  // one of kAlertNames except kNonFinite
  bool enabled = true;
  std::string severity = "warning";
  ChangeDetectorOptions detector;
  // Judge every head of a layer against its own baseline instead of the
  // layer aggregate (the detectors emit per-head values for head-scoped
  // signals, QK spectrum and attention; docs/DESIGN.md §5.2). One change
  // detector per (signal, layer, head), all feeding the layer's alert: the
  // layer fires at its first head. The aggregate point (head = all) is then
  // not scored for this signal. So that a layer of H heads is not H times as
  // likely to alarm on noise, each head's thresholds are raised with
  // ln(H): z_threshold + head_z_correction * ln(H), and cusum_h +
  // 2 * head_z_correction * ln(H) (the CUSUM gains at most 2 per sample, so
  // this asks for ln(H) more samples at the clip). 1 is a Bonferroni
  // correction for noise with exponential (Laplace-like) tails; 0 leaves the
  // heads uncorrected. YAML: per_head, head_z_correction.
  bool per_head = false;
  double head_z_correction = 1.0;
};

struct NonFiniteConfig {
  bool enabled = true;
  std::string severity = "critical";
  // The alert resolves once the run has reported finite values at this many
  // distinct steps after its last non-finite value.
  int clear_after = 20;
};

struct ProbableCauseConfig {
  // Evidence for the probable cause is the set of mechanism alert families
  // (QK spectrum, attention logits, router, curvature) whose first episode
  // began within this many steps of the run's mechanism onset (the earliest
  // such episode that is not a symptom: dead experts, flip surges and load
  // imbalance count when they began before it, but do not anchor it). Later
  // alerts are consequences of a run that is already going unstable and must
  // not change the diagnosis. Short, because a fault
  // spreads: on the demo model, attention faults disturbed the router ~100
  // steps later and LR faults the QK spectrum ~80-150 steps later.
  int64_t onset_window_steps = 50;
  // The cause is provisional (annotation probable_cause_status) until the
  // run's latest step reaches mechanism onset + settle_steps; then it is
  // final, and firing alerts are re-sent with it. Must cover the onset window
  // plus the time an alert needs to confirm (persist_n samples).
  int64_t settle_steps = 100;
  // LR-rise evidence: the run streamed, up to onset + settle_steps, a
  // learning rate of at least lr_rise_factor x the highest of its values in
  // the lagged window [onset - lr_baseline_steps, onset - lr_baseline_gap_steps)
  // (or its earliest value, when the run is younger). A schedule that decays
  // the LR, a warm restart to an earlier peak, or a warm-up that reached its
  // peak in or before that window, never counts.
  double lr_rise_factor = 3.0;
  int64_t lr_baseline_steps = 1000;
  int64_t lr_baseline_gap_steps = 100;
  // In a run whose attention computes in fp32 (every layer's QKSample says
  // so), the QK-spectrum and attention-entropy alerts wait, pending, until an
  // alert of another kind fires in the run (curvature, router collapse,
  // learning-rate surge, loss spike, non-finite): without low precision they
  // have no mechanism of their own, and heads that specialize (a copy task,
  // induction heads) move them in healthy training. Attention logit growth
  // past its bound is not held: in fp32 it is learning-rate evidence, and it
  // fires with the learning rate named (issue 33).
  bool fp32_attention_needs_corroboration = true;
  // The curvature alert waits, pending, until an alert of another kind is
  // anomalous in the run (fired, or itself held): a surge of the estimated
  // sharpness alone is often an edge-of-stability excursion that the
  // optimizer resolves by itself (the catapult) with no effect on the loss.
  // On the evaluation's draws, every curvature alert that fired on a healthy
  // run was such an excursion, and the curvature was the first warning of a
  // real fault once in 110 runs (docs/EVALUATION.md).
  bool curvature_needs_corroboration = true;
  // In a run whose attention computes in bf16 or fp16, attention evidence
  // names the learning rate, as in fp32, when the client measured each such
  // layer's attention output against its fp32 reference (the output check,
  // on by default) and found no bias: the kernel's arithmetic is not at
  // fault, so logit growth is the update size's mark. A rounding bias
  // measured at any time in the episode still names precision (issue 33:
  // bf16 runs at an LR too high for the model were diagnosed as precision
  // faults, with "keep the softmax in fp32" as the action).
  bool unbiased_output_rules_out_precision = true;
  // A router collapse raised only by experts that stopped receiving tokens
  // (router_experts_died) waits, pending, until an alert of another kind
  // fires in the run (attention, curvature, learning rate, loss; router
  // imbalance is the same skewed load and does not count) or the router's
  // logits move (entropy, z-loss, flips). A MoE trained without a balance
  // loss, or with a weak one, loses experts at every LR and still trains to
  // its best loss (issue 33: 9 of 16 healthy Hugging Face Qwen3-MoE runs
  // paged); dead experts cost capacity, which the exported
  // router_experts_died and router_dead_experts series show, not the run.
  bool expert_deaths_need_corroboration = true;
  // A router imbalance alert (router_load_cv, router_max_violation) waits,
  // pending, until an alert of another kind fires in the run, as expert
  // deaths do: the load of a router without (enough) balance loss drifts at
  // a healthy LR, which costs throughput, not the run, and an imbalance
  // names no cause (issue 33: the only alert on a healthy QK-layernorm twin
  // without a balance loss, natural draw 7). On every recorded natural and
  // injected run before it, imbalance fired after another kind had.
  bool imbalance_needs_corroboration = true;
};

struct AlertConfig {
  // Keyed by signal (series) name; only these signals drive alerts.
  std::map<std::string, SignalConfig, std::less<>> signals;
  NonFiniteConfig nonfinite;
  ProbableCauseConfig probable_cause;
};

// The built-in defaults (documented per signal in config.cc and
// deploy/foreshock.yaml).
AlertConfig DefaultAlertConfig();

// Checks every value's range and the cross-field rules (persist_m <=
// persist_n, a signal that can fire at all, a known alert name ...).
absl::Status ValidateAlertConfig(const AlertConfig& config);

// Parses YAML text on top of DefaultAlertConfig(). `source` names the text in
// error messages ("foreshock.yaml:12:5: ..."). The only top-level key is
// `alerts`.
absl::StatusOr<AlertConfig> ParseAlertConfig(std::string_view yaml_text,
                                             std::string_view source = "<config>");

// Reads and parses a file (`--config foreshock.yaml`).
absl::StatusOr<AlertConfig> LoadAlertConfigFile(const std::string& path);

}  // namespace foreshock::alerts
