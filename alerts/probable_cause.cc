#include "alerts/probable_cause.h"

#include <algorithm>
#include <cmath>

#include "alerts/alert_engine_state.h"

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

// ---------------------------------------------------------------------------
// The engine's side of the probable cause: which alerts wait for
// corroboration, what happens when an alert fires, and how the run's cause is
// derived, settled and written into its alerts (docs/DESIGN.md §5.5).

using engine_internal::IsAttentionFamily;
using engine_internal::IsExpertDeathSignal;
using engine_internal::kFamilyCount;
using engine_internal::kFarBeyondBound;
using engine_internal::kOutputBiasSignal;
using engine_internal::kUnbiasedOutputEvidence;
using engine_internal::Num;

bool AlertEngine::FiredBy(const AlertRecord& record, int64_t step) {
  const AlertState state = record.alert.state;
  return (state == AlertState::kFiring || state == AlertState::kResolved) &&
         record.alert.firing_step >= 0 && record.alert.firing_step <= step;
}

bool AlertEngine::HeldForCorroboration(const RunState& run, const AlertRecord& record,
                                       int64_t step) const {
  const AlertFamily family = FamilyOfAlert(record.alert.alertname);
  if (family == AlertFamily::kCurvature) {
    if (!config_.probable_cause.curvature_needs_corroboration) return false;
    // Another kind of alert anomalous now: fired, or confirmed and held
    // itself (an fp32 attention alert; the two holds release each other).
    for (const auto& [key, other] : run.alerts) {
      if (&other == &record || FamilyOfAlert(other.alert.alertname) == AlertFamily::kCurvature) {
        continue;
      }
      if (other.alert.state != AlertState::kResolved && Anomalous(other)) return false;
    }
    return true;
  }
  if (family == AlertFamily::kRouterCollapse) return ExpertDeathsAlone(run, record, step);
  if (family == AlertFamily::kRouterImbalance) {
    return config_.probable_cause.imbalance_needs_corroboration &&
           !OtherTroubleBy(run, record, step);
  }
  if (!config_.probable_cause.fp32_attention_needs_corroboration) return false;
  if (!IsAttentionFamily(family)) return false;
  // Attention logits past their absolute bound are never held (issue 33): in
  // fp32 they have no precision mechanism, so their growth is the update
  // size's mark (Wortsman et al. 2023), and DeriveCause names the learning
  // rate. Holding them kept a run's earliest signal pending for hundreds of
  // steps while it diverged. The hold only keeps fp32 from being diagnosed
  // as a precision fault from changes of the QK spectrum and the entropy.
  if (record.alert.alertname == kAttentionLogitGrowth) return false;
  if (run.attention_bits.empty()) return false;
  for (const auto& [layer, bits] : run.attention_bits) {
    if (bits < 32) return false;
  }
  // Another sign of trouble in the run: an alert of another kind firing now,
  // or one that fired earlier in the run (then resolved: a loss spike).
  bool trouble_seen = false;
  for (const auto& [key, other] : run.alerts) {
    const AlertFamily other_family = FamilyOfAlert(other.alert.alertname);
    if (!Corroborates(other_family)) continue;
    if (other.alert.state == AlertState::kFiring && FiredBy(other, step)) return false;
    // A curvature surge held for corroboration itself is the other kind.
    if (other_family == AlertFamily::kCurvature && other.alert.state == AlertState::kPending &&
        Anomalous(other)) {
      return false;
    }
    trouble_seen |= other.alert.state == AlertState::kResolved && FiredBy(other, step);
  }
  // A value far beyond its absolute bound (attention max logit 800 against
  // 100) is not the model learning: once the run has shown trouble it is not
  // held any longer (issue 26: logits of 821-1,880 stayed held while the run
  // diverged).
  if (trouble_seen) {
    for (const Series* s : record.series) {
      const std::optional<double>& bound = s->config->detector.bound;
      if (!bound || s->detector.state() != SeriesState::kAnomalous) continue;
      const double value = s->detector.last().value;
      const bool rise = s->config->detector.direction == Direction::kRise;
      if (rise ? value >= kFarBeyondBound * *bound && *bound > 0
               : value <= *bound / kFarBeyondBound && *bound > 0) {
        return false;
      }
    }
  }
  return true;
}

bool AlertEngine::ExpertDeathsAlone(const RunState& run, const AlertRecord& record,
                                    int64_t step) const {
  if (!config_.probable_cause.expert_deaths_need_corroboration) return false;
  // The router's logits moving (entropy, z-loss, flips) is a collapse of its
  // own: never held.
  for (const Series* s : record.series) {
    if (s->detector.state() == SeriesState::kAnomalous && !IsExpertDeathSignal(s->signal)) {
      return false;
    }
  }
  return !OtherTroubleBy(run, record, step);
}

bool AlertEngine::OtherTroubleBy(const RunState& run, const AlertRecord& record, int64_t step) {
  // An alert firing now or fired earlier (then resolved), or a curvature
  // surge held itself. A router collapse elsewhere fired from its logits,
  // since expert deaths alone never fire. Router imbalance is the same
  // skewed load that starves the experts, so it proves nothing more, and two
  // imbalanced layers do not corroborate each other.
  for (const auto& [key, other] : run.alerts) {
    if (&other == &record) continue;
    const AlertFamily other_family = FamilyOfAlert(other.alert.alertname);
    if (other_family == AlertFamily::kRouterImbalance) continue;
    if (FiredBy(other, step)) return true;
    if (other_family == AlertFamily::kCurvature && other.alert.state == AlertState::kPending &&
        Anomalous(other)) {
      return true;
    }
  }
  return false;
}

bool AlertEngine::Corroborates(AlertFamily family) {
  return family == AlertFamily::kCurvature || family == AlertFamily::kRouterCollapse ||
         family == AlertFamily::kLearningRate || family == AlertFamily::kConsequence ||
         family == AlertFamily::kRoundingBias;
}

void AlertEngine::ReleaseHeld(RunState& run, int64_t step, std::vector<AlertTransition>& out) {
  std::vector<AlertRecord*> held;
  for (auto& [key, record] : run.alerts) {
    if (record.alert.state != AlertState::kPending) continue;
    for (const Series* s : record.series) {
      if (s->detector.state() == SeriesState::kAnomalous) {
        held.push_back(&record);
        break;
      }
    }
  }
  for (AlertRecord* record : held) {
    for (const Series* s : record->series) {
      if (s->detector.state() != SeriesState::kAnomalous) continue;
      Evaluate(run, *record, *s, s->detector.last(), step, out);
      break;
    }
  }
}

void AlertEngine::OnFired(RunState& run, AlertRecord& fired, int64_t step,
                          std::vector<AlertTransition>& out) {
  CountFiredEvidence(run, fired, step, out);
  // Held alerts fire with the first alert of another kind, after its evidence
  // counted: they fire with the diagnosis it completes (issue 33: dead
  // experts released by the router's z-loss fired "unknown" at the step the
  // z-loss named the learning rate, then were re-sent with it).
  ReleaseHeld(run, step, out);
}

void AlertEngine::CountFiredEvidence(RunState& run, AlertRecord& fired, int64_t step,
                                     std::vector<AlertTransition>& out) {
  const Alert& alert = fired.alert;
  // The episode's onset: the earliest first anomalous step of the series
  // that are anomalous now (a non-finite alert has no series: its step).
  int64_t onset = step;
  for (const Series* s : fired.series) {
    if (s->detector.state() == SeriesState::kAnomalous && s->detector.last().onset_step >= 0) {
      onset = std::min(onset, s->detector.last().onset_step);
    }
  }

  if (fired.layer >= 0) {
    const bool earlier = !run.first_firing ||
                         std::pair(step, onset) <
                             std::pair(run.first_firing->firing_step, run.first_firing->first_step);
    if (earlier) {
      run.first_firing = FirstFiring{alert.alertname, fired.layer, "", step, onset};
      // The signal that confirmed: an anomalous series of this record.
      for (const Series* s : fired.series) {
        if (s->detector.state() == SeriesState::kAnomalous) {
          run.first_firing->signal = s->signal;
          break;
        }
      }
    }
  }

  // A new episode after every mechanism alert of the run resolved is a new
  // diagnosis: alerts that came and went before it (false alarms, or an
  // incident the run recovered from) cannot explain it.
  if (run.mechanism_onset >= 0 && !AnyMechanismAlertActive(run, &fired)) {
    run.family_onset.fill(-1);
    run.family_fired_step.fill(-1);
    run.mechanism_onset = -1;
    run.cause = ProbableCause::kUnknown;
    run.cause_settled = false;
    run.cause_evidence.clear();
  }

  const AlertFamily family = EvidenceFamilyOf(alert.alertname, alert.signal);
  int64_t& family_onset = run.family_onset[static_cast<size_t>(family)];
  if (family == AlertFamily::kConsequence || (family_onset >= 0 && family_onset <= onset)) return;
  family_onset = onset;
  run.family_fired_step[static_cast<size_t>(family)] = step;

  // A diagnosis settled on symptoms alone named nothing: the first family
  // that can name a cause opens it again, anchored at that family.
  if (run.cause_settled && !IsSymptomFamily(family) && OnlySymptomsFired(run, family)) {
    run.cause_settled = false;
  }
  if (run.cause_settled) {
    // The diagnosis was delivered as final; an earlier onset (layers arrive
    // out of order) still moves the rollback step.
    run.mechanism_onset = std::min(run.mechanism_onset, onset);
    // A learning-rate surge or a measured rounding bias is a cause whenever it
    // comes (a job input, a kernel's arithmetic): it completes the diagnosis.
    const ProbableCause before = run.cause;
    if (family == AlertFamily::kLearningRate) {
      if (run.cause == ProbableCause::kUnknown) run.cause = ProbableCause::kLearningRateTooHigh;
      if (run.cause == ProbableCause::kLowPrecisionAttention) run.cause = ProbableCause::kCombined;
    } else if (family == AlertFamily::kRoundingBias) {
      if (run.cause == ProbableCause::kUnknown) run.cause = ProbableCause::kLowPrecisionAttention;
      if (run.cause == ProbableCause::kLearningRateTooHigh &&
          run.cause_evidence.find(kUnbiasedOutputEvidence) != std::string::npos) {
        // The learning rate was named because the output looked unbiased;
        // now it is not: derive again with the bias, as of now.
        DeriveCause(run, step);
      } else if (run.cause == ProbableCause::kLearningRateTooHigh) {
        run.cause = ProbableCause::kCombined;
      }
    }
    if (run.cause != before) {
      run.cause_evidence += internal::Cat(
          "; then ", family == AlertFamily::kLearningRate ? "learning rate surge" : "attention rounding bias",
          " from step ", onset);
    }
  } else {
    DeriveCause(run);
  }
  ReannotateRun(run, &fired, step, out);
}

bool AlertEngine::OnlySymptomsFired(const RunState& run, AlertFamily except) {
  for (size_t f = 0; f < kFamilyCount; ++f) {
    const auto family = static_cast<AlertFamily>(f);
    if (family == except || family == AlertFamily::kConsequence || run.family_onset[f] < 0) {
      continue;
    }
    if (!IsSymptomFamily(family)) return false;
  }
  return true;
}

bool AlertEngine::OutputMeasuredUnbiased(const RunState& run) {
  // A kernel that has shown a bias once in the run (an episode of the
  // rounding-bias alert, even one that cleared without firing) stays
  // suspect: a bias that comes and goes does not make later growth the LR's.
  for (const auto& [key, record] : run.alerts) {
    if (key.first == kAttentionRoundingBias && record.alert.episode > 0) return false;
  }
  // Every layer that computes attention below fp32 sent output checks (its
  // attention_output_bias series exists).
  const auto checks = run.series.find(kOutputBiasSignal);
  bool low_precision = false;
  for (const auto& [layer, bits] : run.attention_bits) {
    if (bits >= 32) continue;
    low_precision = true;
    if (checks == run.series.end() || !checks->second.contains(layer)) return false;
  }
  return low_precision;
}

bool AlertEngine::AnyMechanismAlertActive(const RunState& run, const AlertRecord* except) {
  for (const auto& [key, record] : run.alerts) {
    if (&record == except || FamilyOfAlert(record.alert.alertname) == AlertFamily::kConsequence) {
      continue;
    }
    if (record.alert.state == AlertState::kPending || record.alert.state == AlertState::kFiring) {
      return true;
    }
  }
  return false;
}

void AlertEngine::ReannotateRun(RunState& run, const AlertRecord* skip, int64_t step,
                                std::vector<AlertTransition>& out) const {
  for (auto& [key, record] : run.alerts) {
    if (&record == skip) continue;
    const bool changed = RefreshCause(run, record);
    if (changed && record.alert.state == AlertState::kFiring) {
      out.push_back(AlertTransition{record.alert, AlertState::kFiring, AlertState::kFiring, step});
    }
  }
}

void AlertEngine::DeriveCause(RunState& run, int64_t fired_by) const {
  const ProbableCauseConfig& cfg = config_.probable_cause;
  // A family's onset, when its episode fired by `fired_by` (else -1): the
  // settled cause counts only what every layer had reached, whatever order
  // the workers delivered it in.
  auto onset_of = [&](size_t f) {
    return run.family_fired_step[f] <= fired_by ? run.family_onset[f] : int64_t{-1};
  };
  // The onset is the earliest family that can name a cause; symptoms anchor
  // it only when nothing else fired (issue 33: held dead experts set a
  // Qwen3-MoE run's onset at step 400, and the router z-loss that began at
  // 500 fell outside the window and named nothing).
  int64_t mechanism_onset = -1;
  int64_t symptom_onset = -1;
  for (size_t f = 0; f < kFamilyCount; ++f) {
    const int64_t onset_f = onset_of(f);
    const auto family = static_cast<AlertFamily>(f);
    if (family == AlertFamily::kConsequence || onset_f < 0) continue;
    int64_t& anchor = IsSymptomFamily(family) ? symptom_onset : mechanism_onset;
    if (anchor < 0 || onset_f < anchor) anchor = onset_f;
  }
  if (mechanism_onset < 0) mechanism_onset = symptom_onset;
  run.mechanism_onset = mechanism_onset;
  if (mechanism_onset < 0) return;
  std::vector<std::string> because;
  auto within = [&](AlertFamily f, std::string_view what) {
    const int64_t o = onset_of(static_cast<size_t>(f));
    const bool in = o >= 0 && o - mechanism_onset <= cfg.onset_window_steps;
    if (in) because.push_back(internal::Cat(what, " from step ", o));
    return in;
  };
  CauseEvidence evidence;
  evidence.qk_spectrum = within(AlertFamily::kQKSpectrum, "QK increment collapse");
  evidence.attention_logits = within(AlertFamily::kAttentionLogits, "attention logit growth");
  evidence.router_collapse = within(AlertFamily::kRouterCollapse, "router collapse");
  evidence.router_logit_growth =
      within(AlertFamily::kRouterLogitGrowth, "router logit growth (z-loss, entropy)");
  evidence.router_imbalance = within(AlertFamily::kRouterImbalance, "router load imbalance");
  evidence.curvature = within(AlertFamily::kCurvature, "curvature above the edge");
  // A learning-rate surge and a measured rounding bias count whenever they
  // began in the episode: neither is a consequence of the instability.
  auto any_time = [&](AlertFamily f, std::string_view what) {
    const int64_t o = onset_of(static_cast<size_t>(f));
    if (o >= 0) because.push_back(internal::Cat(what, " from step ", o));
    return o >= 0;
  };
  evidence.lr_rise = any_time(AlertFamily::kLearningRate, "learning rate surge");
  evidence.rounding_bias = any_time(AlertFamily::kRoundingBias, "attention rounding bias");

  // LR rise: the first LR, up to the end of the provisional period, of at
  // least lr_rise_factor x the highest LR of the lagged baseline window (or
  // the earliest value of a young run). The highest, not the median: a
  // warm-up still climbing in the window has a low median, and the peak it
  // reached is no rise.
  const int64_t lr_window_end = mechanism_onset + cfg.settle_steps;
  const int64_t baseline_from = mechanism_onset - cfg.lr_baseline_steps;
  const int64_t baseline_to = mechanism_onset - cfg.lr_baseline_gap_steps;
  std::vector<double> baseline;
  for (const auto& [lr_step, lr] : run.learning_rate) {
    if (lr_step >= baseline_from && lr_step < baseline_to) baseline.push_back(lr);
  }
  if (baseline.empty() && !run.learning_rate.empty()) {
    baseline.push_back(run.learning_rate.front().second);
  }
  int64_t lr_rise_step = -1;
  if (evidence.lr_rise) lr_rise_step = onset_of(static_cast<size_t>(AlertFamily::kLearningRate));
  if (!baseline.empty() && !evidence.lr_rise) {
    const double reference = *std::max_element(baseline.begin(), baseline.end());
    for (const auto& [lr_step, lr] : run.learning_rate) {
      if (lr_step > lr_window_end) break;
      if (reference > 0 && lr_step >= baseline_to && lr >= cfg.lr_rise_factor * reference) {
        lr_rise_step = lr_step;
        evidence.lr_rise = true;
        because.push_back(internal::Cat("learning rate up ", Num(lr / reference), "x (",
                                        Num(reference), " -> ", Num(lr), ") at step ", lr_step));
        break;
      }
    }
  }
  // Did the attention logits move before anything pointed at the learning rate?
  int64_t learning_rate_onset = lr_rise_step;
  for (AlertFamily f : {AlertFamily::kCurvature, AlertFamily::kRouterCollapse,
                        AlertFamily::kRouterLogitGrowth}) {
    const int64_t o = onset_of(static_cast<size_t>(f));
    const bool in = o >= 0 && o - mechanism_onset <= cfg.onset_window_steps;
    if (in && (learning_rate_onset < 0 || o < learning_rate_onset)) learning_rate_onset = o;
  }
  const int64_t logits_onset = onset_of(static_cast<size_t>(AlertFamily::kAttentionLogits));
  evidence.attention_before_learning_rate =
      evidence.attention_logits && (learning_rate_onset < 0 || logits_onset < learning_rate_onset);
  const int64_t qk_onset = onset_of(static_cast<size_t>(AlertFamily::kQKSpectrum));
  evidence.qk_before_learning_rate =
      evidence.qk_spectrum && (learning_rate_onset < 0 || qk_onset < learning_rate_onset);
  // Attention computed in fp32 (every layer that says) cannot be a precision fault.
  if (!run.attention_bits.empty()) {
    evidence.precision_ruled_out = true;
    for (const auto& [layer, bits] : run.attention_bits) evidence.precision_ruled_out &= bits >= 32;
    if (evidence.precision_ruled_out) because.push_back("attention computed in fp32 (not precision)");
  }
  // Low-precision attention whose output the client measured unbiased
  // against fp32 (the output check): not a precision fault either, unless a
  // rounding bias is measured later in the episode (then re-derived).
  if (!evidence.precision_ruled_out && !evidence.rounding_bias &&
      cfg.unbiased_output_rules_out_precision && OutputMeasuredUnbiased(run)) {
    evidence.precision_ruled_out = true;
    because.push_back(internal::Cat(kUnbiasedOutputEvidence, " (not precision)"));
  }
  run.cause = ClassifyProbableCause(evidence);
  run.cause_evidence = because.empty() ? std::string("none") : internal::Join(because, "; ");
}

void AlertEngine::MaybeSettleCause(RunState& run, int64_t step,
                                   std::vector<AlertTransition>& out) {
  if (run.cause_settled || run.mechanism_onset < 0) return;
  const int64_t settle_step = run.mechanism_onset + config_.probable_cause.settle_steps;
  // The watermark: the slowest layer's progress, so that every transition up
  // to settle_step has been seen. A layer that stopped reporting long ago
  // (stalled, or not probed any more) does not hold it back.
  const int64_t stall_horizon = std::max<int64_t>(1000, 10 * config_.probable_cause.settle_steps);
  int64_t watermark = run.latest_step;
  for (const auto& [layer, layer_step] : run.layer_steps) {
    if (layer_step >= run.latest_step - stall_horizon) watermark = std::min(watermark, layer_step);
  }
  if (watermark < settle_step) return;
  DeriveCause(run, settle_step);
  run.cause_settled = true;
  ReannotateRun(run, nullptr, step, out);
  // An alert that resolved after settle_step was active at settle_step: in
  // step order it would have received the settled cause before resolving.
  // With several workers one layer may run ahead and resolve it first, so give
  // it the settled diagnosis here, and the result does not depend on the
  // order the workers delivered the layers in. (Its resolved transition was
  // already delivered; this is what ListAlerts shows for it.)
  for (auto& [key, record] : run.alerts) {
    if (record.alert.state == AlertState::kResolved && record.alert.resolved_step > settle_step) {
      RefreshCause(run, record, /*include_resolved=*/true);
    }
  }
}

void AlertEngine::RecordLearningRate(RunState& run, int64_t step, double lr) {
  auto& points = run.learning_rate;
  if (!points.empty() && step <= points.back().first) return;  // resent or stale
  points.emplace_back(step, lr);
  // Keep what a future onset's baseline window can reach, and while the cause
  // is still open, what the current onset's baseline needs.
  int64_t keep_from = step - config_.probable_cause.lr_baseline_steps;
  if (run.mechanism_onset >= 0 && !run.cause_settled) {
    keep_from = std::min(keep_from, run.mechanism_onset - config_.probable_cause.lr_baseline_steps);
  }
  constexpr size_t kMaxPoints = 1 << 14;
  while (!points.empty() && (points.front().first < keep_from || points.size() > kMaxPoints)) {
    points.pop_front();
  }
}

bool AlertEngine::RefreshCause(const RunState& run, AlertRecord& record,
                               bool include_resolved) const {
  Alert& alert = record.alert;
  // Resolved and inactive alerts keep the diagnosis they were delivered with.
  if (alert.state != AlertState::kPending && alert.state != AlertState::kFiring &&
      !(include_resolved && alert.state == AlertState::kResolved)) {
    return false;
  }
  // Roll back before the earliest anomaly of the episode, symptoms included
  // (they do not anchor the diagnosis, but the damage may begin with them).
  // (The mechanism onset is one of these family onsets.)
  int64_t rollback = alert.first_step;
  for (size_t f = 0; f < kFamilyCount; ++f) {
    const int64_t onset = run.family_onset[f];
    if (static_cast<AlertFamily>(f) == AlertFamily::kConsequence || onset < 0) continue;
    if (rollback < 0 || onset < rollback) rollback = onset;
  }
  std::string cause(ProbableCauseName(run.cause));
  std::string action = SuggestedAction(run.cause, rollback);
  if (cause == alert.probable_cause && action == alert.suggested_action &&
      alert.probable_cause_settled == run.cause_settled &&
      alert.probable_cause_evidence == run.cause_evidence) {
    return false;
  }
  alert.probable_cause = std::move(cause);
  alert.suggested_action = std::move(action);
  alert.probable_cause_settled = run.cause_settled;
  alert.probable_cause_evidence = run.cause_evidence;
  return true;
}

}  // namespace foreshock::alerts
