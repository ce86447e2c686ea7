#include "alerts/alert_engine.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <tuple>

#include "alerts/text.h"

namespace foreshock::alerts {
namespace {

constexpr size_t kFamilyCount = static_cast<size_t>(AlertFamily::kRouterLogitGrowth) + 1;
// The cause evidence that says low-precision attention was measured
// unbiased (DeriveCause); a rounding bias measured after the cause settled
// re-derives a cause that rested on it.
constexpr std::string_view kUnbiasedOutputEvidence =
    "attention output measured unbiased against fp32";
constexpr std::string_view kOutputBiasSignal = "attention_output_bias";
// The fp32 hold lets go of a guard signal this many times beyond its bound
// once the run has shown another sign of trouble (HeldForCorroboration).
constexpr double kFarBeyondBound = 4.0;

bool IsAttentionFamily(AlertFamily family) {
  return family == AlertFamily::kQKSpectrum || family == AlertFamily::kAttentionLogits;
}

// The router signals that count experts starved of tokens, as opposed to
// those read from the router's logits.
bool IsExpertDeathSignal(std::string_view signal) {
  return signal == "router_experts_died" || signal == "router_dead_experts";
}

std::string Num(double value) {
  if (std::isnan(value)) return "n/a";
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.4g", value);
  return buffer;
}

std::string LayerLabel(int layer) {
  return layer < 0 ? std::string(kRunLevelLayer) : std::to_string(layer);
}

std::string Summary(std::string_view alertname, const std::string& run, int layer) {
  const std::string where =
      layer < 0 ? internal::Cat("run ", run) : internal::Cat("layer ", layer, " of run ", run);
  std::string_view what = "Foreshock alert";
  if (alertname == kQKIncrementCollapse) {
    what = "QK increment collapse (low-rank attention updates)";
  }
  if (alertname == kAttentionLogitGrowth) what = "Attention logit growth";
  if (alertname == kAttentionEntropyCollapse) what = "Attention entropy collapse";
  if (alertname == kRouterCollapse) what = "MoE router collapse";
  if (alertname == kRouterImbalance) what = "MoE router load imbalance";
  if (alertname == kCurvatureAboveEdge) what = "Curvature above the edge of stability";
  if (alertname == kLearningRateSurge) what = "Learning rate above any the run trained at";
  if (alertname == kAttentionRoundingBias) {
    what = "Biased rounding in the attention kernel (output off its fp32 reference)";
  }
  if (alertname == kLossSpike) what = "Loss spike";
  if (alertname == kLossDiverging) what = "Loss diverging (20-step mean above 1.3x its minimum)";
  if (alertname == kNonFinite) what = "Non-finite values";
  return internal::Cat(what, " in ", where);
}

}  // namespace

std::string_view AlertStateName(AlertState state) {
  switch (state) {
    case AlertState::kInactive: return "inactive";
    case AlertState::kPending: return "pending";
    case AlertState::kFiring: return "firing";
    case AlertState::kResolved: return "resolved";
  }
  return "?";
}

Alert::KeyValues Alert::Labels() const {
  return {{"alertname", alertname},
          {"layer", layer},
          {"run", run},
          {"severity", severity},
          {"signal", signal}};
}

Alert::KeyValues Alert::Annotations() const {
  KeyValues out = {{"description", description},
                   {"first_step", std::to_string(first_step)},
                   {"probable_cause", probable_cause},
                   {"probable_cause_evidence", probable_cause_evidence},
                   {"probable_cause_status", probable_cause_settled ? "settled" : "provisional"}};
  // Only on alerts the run's lifecycle resolved, so that other alerts carry
  // exactly the annotations they always had.
  if (!resolved_reason.empty()) out.emplace_back("resolved_reason", resolved_reason);
  out.emplace_back("suggested_action", suggested_action);
  out.emplace_back("summary", summary);
  return out;
}

// ---------------------------------------------------------------------------

namespace {

// Per-head series are keyed "<signal>@h<head>" (signal names have no '@').
constexpr std::string_view kHeadKeySeparator = "@h";

std::string SeriesKey(std::string_view signal, int head) {
  if (head == detectors::kAllHeads) return std::string(signal);
  return internal::Cat(signal, kHeadKeySeparator, head);
}

// The signal and head of a series key; nullopt when the head part is malformed.
std::optional<std::pair<std::string, int>> ParseSeriesKey(std::string_view key) {
  const size_t at = key.rfind(kHeadKeySeparator);
  if (at == std::string_view::npos) return std::pair{std::string(key), detectors::kAllHeads};
  const std::string_view digits = key.substr(at + kHeadKeySeparator.size());
  if (digits.empty() || digits.size() > 9 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return std::nullopt;
  }
  return std::pair{std::string(key.substr(0, at)), std::stoi(std::string(digits))};
}

}  // namespace

struct AlertEngine::Series {
  Series(const SignalConfig& signal_config, std::string signal_name,
         int head_index = detectors::kAllHeads)
      : config(&signal_config),
        signal(std::move(signal_name)),
        head(head_index),
        key(SeriesKey(signal, head)),
        detector(signal_config.detector) {}
  const SignalConfig* config;
  std::string signal;
  // The head this series judges (SignalConfig::per_head), or kAllHeads: the
  // layer aggregate (or a run-level series).
  int head;
  // Its key in RunState::series and in checkpoints: the signal, or for a
  // per-head series "<signal>@h<head>".
  std::string key;
  ChangeDetector detector;
  AlertRecord* record = nullptr;
};

struct AlertEngine::AlertRecord {
  Alert alert;
  // Its episode is closed and kept in the run's earlier_episodes (a resume
  // archived it); not listed again until a new episode opens.
  bool archived = false;
  int layer = detectors::kNoLayer;
  std::vector<const Series*> series;  // the series that feed this alert
};

struct AlertEngine::RunState {
  std::string name;
  // series key (Series::key: the signal, or "<signal>@h<head>") -> layer -> series
  std::map<std::string, std::map<int, Series>, std::less<>> series;
  // (alertname, layer) -> alert
  std::map<std::pair<std::string, int>, AlertRecord> alerts;

  // Probable cause: per family, the first_step of its first firing episode (-1: never fired).
  std::array<int64_t, kFamilyCount> family_onset;
  std::array<int64_t, kFamilyCount> family_fired_step;  // when that episode fired
  ProbableCause cause = ProbableCause::kUnknown;
  int64_t mechanism_onset = -1;  // earliest onset among the evidence families
  bool cause_settled = false;
  std::string cause_evidence;
  // The streamed learning rate, (step, value) by step; trimmed to what the
  // LR-rise evidence can still look at.
  std::deque<std::pair<int64_t, double>> learning_rate;
  std::optional<FirstFiring> first_firing;
  // The latest attention compute width per layer, as the client reports it
  // (signal attention_compute_bits). Not checkpointed: every QK sample says it again.
  std::map<int, double> attention_bits;

  int64_t latest_step = -1;  // the highest step of any point or event

  // ForeshockNonFinite.
  int64_t last_nonfinite_step = -1;
  int64_t last_clean_step = -1;
  int clean_steps = 0;  // distinct steps with finite values after the last non-finite one

  // The highest step processed per layer (-1: run level). Workers process
  // layers independently, so the slowest of them says up to which step the
  // engine has seen everything (the settle watermark).
  std::map<int, int64_t> layer_steps;

  LifecycleMark lifecycle;  // stored for the server (LifecycleMark)
  // Every closed episode of the run that a later one replaced in its record,
  // and the alerts earlier attempts ended with (CloseEpisodes on a resume),
  // each with its Alert::attempt, in the order they closed; bounded by
  // kMaxKeptEpisodesPerRun (KeepEpisode).
  std::deque<Alert> earlier_episodes;

  RunState() {
    family_onset.fill(-1);
    family_fired_step.fill(-1);
  }
};

AlertEngine::AlertEngine(AlertConfig config) : config_(std::move(config)) {}
AlertEngine::~AlertEngine() = default;

AlertEngine::RunState& AlertEngine::GetRun(std::string_view run) {
  auto it = runs_.find(run);
  if (it == runs_.end()) {
    it = runs_.emplace(std::string(run), std::make_unique<RunState>()).first;
    it->second->name = std::string(run);
  }
  return *it->second;
}

AlertEngine::AlertRecord& AlertEngine::GetRecord(RunState& run, std::string_view alertname,
                                                 int layer) {
  auto [it, inserted] = run.alerts.try_emplace({std::string(alertname), layer});
  AlertRecord& record = it->second;
  if (inserted) {
    record.layer = layer;
    record.alert.alertname = std::string(alertname);
    record.alert.run = run.name;
    record.alert.layer = LayerLabel(layer);
    record.alert.summary = Summary(alertname, run.name, layer);
    record.alert.probable_cause = std::string(ProbableCauseName(ProbableCause::kUnknown));
  }
  return record;
}

AlertEngine::Series& AlertEngine::GetSeries(RunState& run, const SignalConfig& config,
                                            std::string_view signal, int layer, int head) {
  const std::string key = SeriesKey(signal, head);
  auto signal_it = run.series.find(key);
  if (signal_it == run.series.end()) {
    signal_it = run.series.emplace(key, std::map<int, Series>{}).first;
  }
  auto& by_layer = signal_it->second;
  auto it = by_layer.find(layer);
  if (it == by_layer.end()) {
    it = by_layer.try_emplace(layer, config, std::string(signal), head).first;
    AlertRecord& record = GetRecord(run, config.alertname, layer);
    it->second.record = &record;
    record.series.push_back(&it->second);
    if (head != detectors::kAllHeads) CorrectHeadThresholds(record, signal);
  }
  return it->second;
}

bool AlertEngine::JudgedPerHead(const RunState& run, const SignalConfig& config,
                                std::string_view signal, int layer) {
  const auto it = run.alerts.find({config.alertname, layer});
  if (it == run.alerts.end()) return false;
  for (const Series* s : it->second.series) {
    if (s->head != detectors::kAllHeads && s->signal == signal) return true;
  }
  return false;
}

void AlertEngine::CorrectHeadThresholds(AlertRecord& record, std::string_view signal) {
  std::vector<Series*> heads;
  for (const Series* s : record.series) {
    if (s->head != detectors::kAllHeads && s->signal == signal) {
      heads.push_back(const_cast<Series*>(s));
    }
  }
  if (heads.empty()) return;
  const SignalConfig& config = *heads.front()->config;
  const double extra =
      config.head_z_correction * std::log(static_cast<double>(heads.size()));
  for (Series* s : heads) {
    s->detector.SetThresholds(config.detector.z_threshold + extra,
                              config.detector.cusum_h + 2.0 * extra);
  }
}

std::vector<AlertTransition> AlertEngine::Observe(const SignalPoint& point) {
  std::vector<AlertTransition> out;
  if (!std::isfinite(point.value)) {
    ++counters_.points_nonfinite;
    return out;
  }
  RunState& run = GetRun(point.run);
  run.latest_step = std::max(run.latest_step, point.step);
  int64_t& layer_step = run.layer_steps[point.layer];
  layer_step = std::max(layer_step, point.step);
  // Any finite value is evidence that the run computes finite numbers again.
  AdvanceCleanSteps(run, point.step, out);
  if (point.signal == kLearningRateSignal && point.layer == detectors::kNoLayer) {
    RecordLearningRate(run, point.step, point.value);
  }
  if (point.signal == kAttentionComputeBitsSignal && point.head == detectors::kAllHeads) {
    run.attention_bits[point.layer] = point.value;
  }
  MaybeSettleCause(run, point.step, out);

  // Values flagged out of detection (e.g. unconverged curvature) are only
  // exported. A per-head signal (SignalConfig::per_head) is judged head by
  // head, and its layer aggregate only in a layer that has sent no per-head
  // value of it (a source that reports aggregates alone); any other signal
  // by the aggregate.
  if (!point.for_detection) return out;
  const auto config_it = config_.signals.find(point.signal);
  if (config_it == config_.signals.end() || !config_it->second.enabled) return out;
  const SignalConfig& signal_config = config_it->second;
  if (point.head != detectors::kAllHeads) {
    if (!signal_config.per_head || point.head < 0) return out;
  } else if (signal_config.per_head &&
             JudgedPerHead(run, signal_config, point.signal, point.layer)) {
    return out;
  }

  Series& series = GetSeries(run, signal_config, point.signal, point.layer, point.head);
  const SeriesState before = series.detector.state();
  const ChangeAssessment assessment = series.detector.Update(point.step, point.value);
  switch (assessment.disposition) {
    case ChangeAssessment::Disposition::kStale: ++counters_.points_stale; return out;
    case ChangeAssessment::Disposition::kDuplicate: ++counters_.points_duplicate; return out;
    case ChangeAssessment::Disposition::kWarmup:
    case ChangeAssessment::Disposition::kScored: ++counters_.points_scored; break;
  }
  // A held attention-side episode (fp32 attention) that nothing corroborated
  // within the onset window is the model learning (heads specializing): the
  // series ends the episode and its baseline takes the new level in.
  if (assessment.state == SeriesState::kAnomalous && before == SeriesState::kAnomalous &&
      series.record->alert.state == AlertState::kPending && assessment.onset_step >= 0 &&
      IsAttentionFamily(FamilyOfAlert(series.record->alert.alertname)) &&
      point.step - assessment.onset_step > config_.probable_cause.onset_window_steps &&
      HeldForCorroboration(run, *series.record)) {
    series.detector.ResetEpisode();
    Evaluate(run, *series.record, series, series.detector.last(), point.step, out);
    return out;
  }
  // Only a change of the series' state can move its alert; and a held alert
  // whose hold no longer applies (its value went far beyond its bound in a
  // run that showed trouble) fires.
  if (assessment.state != before ||
      (assessment.state == SeriesState::kAnomalous &&
       series.record->alert.state == AlertState::kPending &&
       !HeldForCorroboration(run, *series.record))) {
    Evaluate(run, *series.record, series, assessment, point.step, out);
  }
  return out;
}

void AlertEngine::Evaluate(RunState& run, AlertRecord& record, const Series& trigger,
                           const ChangeAssessment& assessment, int64_t step,
                           std::vector<AlertTransition>& out) {
  bool any_anomalous = false, any_pending = false;
  for (const Series* s : record.series) {
    any_anomalous |= s->detector.state() == SeriesState::kAnomalous;
    any_pending |= s->detector.state() == SeriesState::kPending;
  }
  Alert& alert = record.alert;

  auto describe = [&](const Series& series, const ChangeAssessment& a, bool confirmed) {
    const ChangeDetectorOptions& o = series.config->detector;
    const bool rise = o.direction == Direction::kRise;
    std::string text;
    const std::string name = series.head == detectors::kAllHeads
                                 ? series.signal
                                 : internal::Cat(series.signal, " of head ", series.head);
    if (a.change_flag) {
      text = internal::Cat(name, rise ? " rose" : " dropped", " to ", Num(a.value),
                           " at step ", a.step, " (baseline ", Num(a.baseline), ", robust z ",
                           Num(a.z), ", change ", Num(100 * a.relative_change), "%)");
    } else {
      text = internal::Cat(name, " = ", Num(a.value), " at step ", a.step);
      if (!std::isnan(a.baseline)) {
        text += internal::Cat(" (baseline ", Num(a.baseline), ", robust z ", Num(a.z), ")");
      }
    }
    if (a.guard_flag) {
      text += internal::Cat(rise ? ", above" : ", below", " the absolute bound ", Num(*o.bound));
    }
    // The counts at this series' sampling interval (reference_interval_steps).
    const SampleCounts& n = series.detector.counts();
    if (confirmed) {
      text += internal::Cat("; anomalous in ", n.persist_m, " of ", n.persist_n,
                            " samples since step ", a.onset_step, ".");
    } else {
      text += internal::Cat("; ", a.anomalous_in_window, " of the last ", n.persist_n,
                            " samples anomalous (", n.persist_m, " fire it), since step ",
                            a.onset_step, ".");
    }
    if (run.first_firing) {
      text += internal::Cat(" First layer to fire in this run: layer ", run.first_firing->layer,
                            " (", run.first_firing->alertname, ", ", run.first_firing->signal,
                            ", step ", run.first_firing->firing_step, ").");
    }
    return text;
  };
  auto open_episode = [&] {
    KeepEpisode(run, record);
    record.archived = false;
    alert.attempt = run.lifecycle.attempt;
    ++alert.episode;
    alert.pending_step = alert.firing_step = alert.resolved_step = -1;
    alert.resolved_reason.clear();
  };
  // Labels and the values that fired come from the series that moved the alert.
  auto take_labels_from = [&](const Series& series, const ChangeAssessment& a, bool confirmed) {
    alert.signal = series.signal;
    alert.severity = series.config->severity;
    alert.first_step = a.onset_step;
    alert.value = a.value;
    alert.baseline = a.baseline;
    alert.z = a.z;
    alert.description = describe(series, a, confirmed);
  };
  auto emit = [&](AlertState from) {
    RefreshCause(run, record);
    out.push_back(AlertTransition{alert, from, alert.state, step});
  };
  auto fire = [&](AlertState from) {
    alert.state = AlertState::kFiring;
    alert.firing_step = step;
    // The evidence is the confirming series', not that of the episode's
    // pending labels (a held expert death, then the router's z-loss).
    alert.signal = trigger.signal;
    std::vector<AlertTransition> updates;
    OnFired(run, record, step, updates);
    take_labels_from(trigger, assessment, true);  // after OnFired: names the first layer
    emit(from);
    out.insert(out.end(), updates.begin(), updates.end());
  };

  // fp32 attention: an attention-side alert confirms, but waits pending for
  // another kind of alert in the run (ProbableCauseConfig).
  const bool held = any_anomalous && alert.state != AlertState::kFiring &&
                    HeldForCorroboration(run, record);
  if (held) {
    any_anomalous = false;
    any_pending = true;
  }
  auto note_held = [&] {
    if (!held) return;
    const AlertFamily family = FamilyOfAlert(alert.alertname);
    if (family == AlertFamily::kCurvature) {
      alert.description += " Held: a curvature surge alone is often an edge-of-stability "
                           "excursion the optimizer resolves by itself, so this waits for "
                           "another kind of alert (attention, router, learning rate, loss).";
    } else if (family == AlertFamily::kRouterCollapse) {
      alert.description += " Held: experts that stopped receiving tokens while the router's "
                           "logits stay steady are often a router without (enough) balance "
                           "loss settling on fewer experts, which costs capacity, not the "
                           "run; this waits for another kind of alert (attention, curvature, "
                           "learning rate, loss) or for the router's logits to move.";
    } else {
      alert.description += " Held: this run computes attention in fp32, so this waits for another "
                           "kind of alert (curvature, router, learning rate, loss) to fire.";
    }
  };

  switch (alert.state) {
    case AlertState::kInactive:
    case AlertState::kResolved: {
      if (!any_anomalous && !any_pending) return;
      const AlertState from = alert.state;
      open_episode();
      if (any_anomalous) {
        fire(from);
      } else {
        alert.state = AlertState::kPending;
        alert.pending_step = step;
        take_labels_from(trigger, assessment, held);
        note_held();
        emit(from);
      }
      return;
    }
    case AlertState::kPending:
      if (held) {  // stays pending; says why once
        if (alert.description.find(" Held: ") == std::string::npos) {
          take_labels_from(trigger, assessment, true);
          note_held();
        }
        return;
      }
      if (any_anomalous) {
        fire(AlertState::kPending);
      } else if (!any_pending) {
        alert.state = AlertState::kInactive;
        alert.resolved_step = step;  // the episode cleared without firing
        emit(AlertState::kPending);
      }
      return;
    case AlertState::kFiring:
      if (any_anomalous) return;
      alert.state = AlertState::kResolved;
      alert.resolved_step = step;
      emit(AlertState::kFiring);
      if (any_pending) {
        // Another series of the same alert is already building up: it opens
        // the next episode.
        for (const Series* s : record.series) {
          if (s->detector.state() != SeriesState::kPending) continue;
          open_episode();
          alert.state = AlertState::kPending;
          alert.pending_step = step;
          take_labels_from(*s, s->detector.last(), false);
          emit(AlertState::kResolved);
          break;
        }
      }
      return;
  }
}

bool AlertEngine::Anomalous(const AlertRecord& record) {
  if (record.alert.state == AlertState::kFiring) return true;
  for (const Series* s : record.series) {
    if (s->detector.state() == SeriesState::kAnomalous) return true;
  }
  return false;
}

bool AlertEngine::HeldForCorroboration(const RunState& run, const AlertRecord& record) const {
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
  if (family == AlertFamily::kRouterCollapse) return ExpertDeathsAlone(run, record);
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
    if (other.alert.state == AlertState::kFiring) return false;
    // A curvature surge held for corroboration itself is the other kind.
    if (other_family == AlertFamily::kCurvature && other.alert.state == AlertState::kPending &&
        Anomalous(other)) {
      return false;
    }
    trouble_seen |= other.alert.state == AlertState::kResolved;
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

bool AlertEngine::ExpertDeathsAlone(const RunState& run, const AlertRecord& record) const {
  if (!config_.probable_cause.expert_deaths_need_corroboration) return false;
  // The router's logits moving (entropy, z-loss, flips) is a collapse of its
  // own: never held.
  for (const Series* s : record.series) {
    if (s->detector.state() == SeriesState::kAnomalous && !IsExpertDeathSignal(s->signal)) {
      return false;
    }
  }
  // Another kind of trouble in the run: an alert firing now or fired earlier
  // (then resolved), or a curvature surge held itself (the holds release
  // each other). A router collapse elsewhere fired from its logits, since
  // expert deaths alone never fire. Router imbalance is the same skewed load
  // that starves the experts, so it proves nothing more.
  for (const auto& [key, other] : run.alerts) {
    if (&other == &record) continue;
    const AlertFamily other_family = FamilyOfAlert(other.alert.alertname);
    if (other_family == AlertFamily::kRouterImbalance) continue;
    if (other.alert.state == AlertState::kFiring || other.alert.state == AlertState::kResolved) {
      return false;
    }
    if (other_family == AlertFamily::kCurvature && other.alert.state == AlertState::kPending &&
        Anomalous(other)) {
      return false;
    }
  }
  return true;
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
  // Held alerts (fp32 attention, curvature) fire with the first alert of another kind.
  ReleaseHeld(run, step, out);
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
  int64_t mechanism_onset = -1;
  for (size_t f = 0; f < kFamilyCount; ++f) {
    const int64_t onset_f = onset_of(f);
    if (static_cast<AlertFamily>(f) == AlertFamily::kConsequence || onset_f < 0) continue;
    if (mechanism_onset < 0 || onset_f < mechanism_onset) mechanism_onset = onset_f;
  }
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
  int64_t rollback = alert.first_step;
  if (run.mechanism_onset >= 0 && (rollback < 0 || run.mechanism_onset < rollback)) {
    rollback = run.mechanism_onset;
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

std::vector<AlertTransition> AlertEngine::ObserveNonFinite(const NonFiniteEvent& event) {
  std::vector<AlertTransition> out;
  if (!config_.nonfinite.enabled || event.count <= 0) return out;
  RunState& run = GetRun(event.run);
  run.latest_step = std::max(run.latest_step, event.step);
  run.last_nonfinite_step = std::max(run.last_nonfinite_step, event.step);
  run.last_clean_step = run.last_nonfinite_step;
  run.clean_steps = 0;
  MaybeSettleCause(run, event.step, out);

  AlertRecord& record = GetRecord(run, kNonFinite, detectors::kNoLayer);
  Alert& alert = record.alert;
  if (alert.state == AlertState::kFiring) return out;
  const AlertState from = alert.state;
  KeepEpisode(run, record);
  record.archived = false;
  alert.attempt = run.lifecycle.attempt;
  ++alert.episode;
  alert.state = AlertState::kFiring;
  alert.pending_step = alert.resolved_step = -1;
  alert.resolved_reason.clear();
  alert.firing_step = event.step;
  alert.first_step = event.step;
  alert.signal = std::string(kNonFiniteSignal);
  alert.severity = config_.nonfinite.severity;
  alert.value = alert.baseline = alert.z = std::numeric_limits<double>::quiet_NaN();
  std::vector<AlertTransition> updates;
  OnFired(run, record, event.step, updates);
  alert.description =
      internal::Cat(event.count, " non-finite value(s) (NaN or Inf) in a ",
                    detectors::SampleKindName(event.kind), " sample at step ", event.step,
                    event.layer >= 0 ? internal::Cat(", layer ", event.layer) : std::string(),
                    "; the sample was not used for detection.");
  if (run.first_firing) {
    alert.description +=
        internal::Cat(" First layer to fire in this run: layer ", run.first_firing->layer, " (",
                      run.first_firing->alertname, ", step ", run.first_firing->firing_step, ").");
  }
  RefreshCause(run, record);
  out.push_back(AlertTransition{alert, from, AlertState::kFiring, event.step});
  out.insert(out.end(), updates.begin(), updates.end());
  return out;
}

void AlertEngine::AdvanceCleanSteps(RunState& run, int64_t step,
                                    std::vector<AlertTransition>& out) {
  if (run.last_nonfinite_step < 0 || step <= run.last_clean_step) return;
  run.last_clean_step = step;
  ++run.clean_steps;
  auto it = run.alerts.find({std::string(kNonFinite), detectors::kNoLayer});
  if (it == run.alerts.end() || it->second.alert.state != AlertState::kFiring) return;
  if (run.clean_steps < config_.nonfinite.clear_after) return;
  Alert& alert = it->second.alert;
  alert.state = AlertState::kResolved;
  alert.resolved_step = step;
  out.push_back(AlertTransition{alert, AlertState::kFiring, AlertState::kResolved, step});
}

// ---------------------------------------------------------------------------
// Snapshots.

std::vector<Alert> AlertEngine::ActiveAlerts() const {
  std::vector<Alert> active;
  for (const auto& [name, run] : runs_) {
    for (const auto& [key, record] : run->alerts) {
      if (record.alert.state == AlertState::kPending || record.alert.state == AlertState::kFiring) {
        active.push_back(record.alert);
      }
    }
  }
  return active;  // runs_ and alerts are ordered maps: by run, alertname, layer
}

void AlertEngine::KeepEpisode(RunState& run, AlertRecord& record) {
  if (record.alert.episode == 0 || record.archived) return;
  record.archived = true;
  run.earlier_episodes.push_back(record.alert);
  run.earlier_episodes.back().attempt = run.lifecycle.attempt;
  ++kept_episodes_;
  if (run.earlier_episodes.size() > kMaxKeptEpisodesPerRun) DropEpisode(run);
  EnforceKeptEpisodeLimit();
}

void AlertEngine::EnforceKeptEpisodeLimit() {
  while (kept_episode_limit_ > 0 && kept_episodes_ > kept_episode_limit_) {
    RunState* largest = nullptr;
    for (auto& [name, run] : runs_) {
      if (!largest || run->earlier_episodes.size() > largest->earlier_episodes.size()) {
        largest = run.get();
      }
    }
    DropEpisode(*largest);
  }
}

void AlertEngine::DropEpisode(RunState& run) {
  if (run.earlier_episodes.empty()) return;
  // An episode that fired says more than one that did not.
  const auto never_fired = std::find_if(run.earlier_episodes.begin(), run.earlier_episodes.end(),
                                        [](const Alert& a) { return a.firing_step < 0; });
  run.earlier_episodes.erase(never_fired != run.earlier_episodes.end() ? never_fired
                                                                       : run.earlier_episodes.begin());
  --kept_episodes_;
  ++counters_.episodes_dropped;
}

std::vector<Alert> AlertEngine::AllAlerts(std::string_view run) const {
  std::vector<Alert> all;
  const auto it = runs_.find(run);
  if (it == runs_.end()) return all;
  const RunState& state = *it->second;
  all.assign(state.earlier_episodes.begin(), state.earlier_episodes.end());
  for (const auto& [key, record] : state.alerts) {
    if (record.alert.episode > 0 && !record.archived) {
      all.push_back(record.alert);
      all.back().attempt = state.lifecycle.attempt;
    }
  }
  // Oldest attempt first, then by alertname, layer (run-level first) and episode.
  const auto layer_order = [](const Alert& a) {
    return a.layer == "all" ? -1 : std::atoi(a.layer.c_str());
  };
  std::stable_sort(all.begin(), all.end(), [&](const Alert& a, const Alert& b) {
    return std::forward_as_tuple(a.attempt, a.alertname, layer_order(a), a.episode) <
           std::forward_as_tuple(b.attempt, b.alertname, layer_order(b), b.episode);
  });
  return all;
}

std::optional<FirstFiring> AlertEngine::FirstFiringLayer(std::string_view run) const {
  const auto it = runs_.find(run);
  if (it == runs_.end()) return std::nullopt;
  return it->second->first_firing;
}

ProbableCause AlertEngine::RunProbableCause(std::string_view run) const {
  const auto it = runs_.find(run);
  return it == runs_.end() ? ProbableCause::kUnknown : it->second->cause;
}

std::vector<AlertTransition> AlertEngine::ForgetRun(std::string_view run) {
  std::vector<AlertTransition> out;
  const auto it = runs_.find(run);
  if (it == runs_.end()) return out;
  const int64_t step = it->second->latest_step;
  for (auto& [key, record] : it->second->alerts) {
    Alert& alert = record.alert;
    const AlertState from = alert.state;
    if (from == AlertState::kFiring) {
      alert.state = AlertState::kResolved;
      alert.resolved_step = step;
    } else if (from == AlertState::kPending) {
      alert.state = AlertState::kInactive;
      alert.resolved_step = step;
    } else {
      continue;
    }
    out.push_back(AlertTransition{alert, from, alert.state, step});
  }
  kept_episodes_ -= it->second->earlier_episodes.size();
  runs_.erase(it);
  return out;
}

// ---------------------------------------------------------------------------
// Run lifecycle.

std::vector<AlertTransition> AlertEngine::CloseEpisodes(std::string_view run_name,
                                                        std::string_view reason) {
  std::vector<AlertTransition> out;
  const auto it = runs_.find(run_name);
  if (it == runs_.end()) return out;
  RunState& run = *it->second;
  const int64_t step = run.latest_step;
  for (auto& [key, record] : run.alerts) {
    Alert& alert = record.alert;
    const AlertState from = alert.state;
    if (from == AlertState::kFiring) {
      alert.state = AlertState::kResolved;
      alert.resolved_step = step;
    } else if (from == AlertState::kPending) {
      alert.state = AlertState::kInactive;
      alert.resolved_step = step;
    } else {
      continue;
    }
    alert.resolved_reason = std::string(reason);
    out.push_back(AlertTransition{alert, from, alert.state, step});
  }
  // A resumed attempt keeps what the ended one raised: a later episode of the
  // same name and layer must not overwrite it in AllAlerts.
  if (reason == kRunResumed) {
    for (auto& [key, record] : run.alerts) KeepEpisode(run, record);
  }
  for (auto& [signal, by_layer] : run.series) {
    for (auto& [layer, series] : by_layer) series.detector.ResetEpisode();
  }
  // ForeshockNonFinite opens again only on a new non-finite value.
  run.last_nonfinite_step = -1;
  run.clean_steps = 0;
  return out;
}

std::vector<AlertTransition> AlertEngine::RewindRun(std::string_view run_name, int64_t from_step) {
  std::vector<AlertTransition> out = CloseEpisodes(run_name, kRunResumed);
  const auto it = runs_.find(run_name);
  if (it == runs_.end()) return out;
  RunState& run = *it->second;
  const bool replays = run.latest_step >= from_step;  // else the run just goes on
  for (auto& [signal, by_layer] : run.series) {
    for (auto& [layer, series] : by_layer) series.detector.Rewind(from_step);
  }
  while (!run.learning_rate.empty() && run.learning_rate.back().first >= from_step) {
    run.learning_rate.pop_back();
  }
  run.latest_step = std::min(run.latest_step, from_step - 1);
  for (auto& [layer, layer_step] : run.layer_steps) layer_step = std::min(layer_step, from_step - 1);
  run.last_clean_step = std::min(run.last_clean_step, from_step - 1);
  if (run.first_firing && run.first_firing->firing_step >= from_step) run.first_firing.reset();
  // Evidence from the replayed steps belongs to a timeline that no longer exists.
  bool evidence_changed = false;
  for (size_t f = 0; f < kFamilyCount; ++f) {
    if (run.family_onset[f] >= from_step || run.family_fired_step[f] >= from_step) {
      run.family_onset[f] = run.family_fired_step[f] = -1;
      evidence_changed = true;
    }
  }
  // A settled cause rests on every layer up to onset + settle_steps: if that
  // reaches into the replayed steps it is open again.
  if (replays && run.cause_settled &&
      run.mechanism_onset + config_.probable_cause.settle_steps >= from_step) {
    run.cause_settled = false;
    evidence_changed = true;
  }
  if (evidence_changed && !run.cause_settled) {
    run.cause = ProbableCause::kUnknown;
    run.cause_evidence.clear();
    DeriveCause(run);
  }
  return out;
}

LifecycleMark AlertEngine::GetLifecycleMark(std::string_view run) const {
  const auto it = runs_.find(run);
  return it == runs_.end() ? LifecycleMark{} : it->second->lifecycle;
}

void AlertEngine::SetLifecycleMark(std::string_view run, const LifecycleMark& mark) {
  GetRun(run).lifecycle = mark;
}

// ---------------------------------------------------------------------------
// Checkpointing.
//
// Header "FSAE" v1
// Bytes   configuration fingerprint (ConfigFingerprint below)
// U64 x 4 counters: scored, stale, duplicate, nonfinite
// U64     runs, then per run (by name):
//   String name, I64 latest_step
//   U32 family count (kFamilyCount; one fewer: saved before the
//     rounding-bias family; two fewer: before the learning-rate family too;
//     a missing family reads as -1), I64 onset per family,
//     I64 fired step per family (v2)
//   U64 layers, each I32 layer, I64 highest step processed (v2)
//   U8 cause, I64 mechanism_onset, Bool cause_settled, String cause_evidence
//   U64 learning-rate points, each I64 step, Double lr
//   Bool has first firing [String alertname, I32 layer, String signal,
//                          I64 firing_step, I64 first_step]
//   I64 last_nonfinite_step, I64 last_clean_step, I32 clean_steps
//   (v3) I32 lifecycle attempt, I64 rewound_to, Bool ended
//   U64 series, each String key (the signal, or "<signal>@h<head>" for a
//     per-head series), I32 layer, ChangeDetector state
//   U64 alerts, each String alertname, I32 layer, the Alert (PutAlert; v3
//     adds String resolved_reason),
//     U64 feeding series + String key of each, in the record's order
//     (the order Evaluate scans them in), (v4) Bool archived
//   (v4) U64 earlier attempts' alerts, each I32 attempt, the Alert (PutAlert)

namespace {

constexpr std::string_view kEngineStateMagic = "FSAE";
constexpr uint32_t kEngineStateVersion = 4;
constexpr uint32_t kEngineStateOldestVersion = 2;  // without the lifecycle (v3)

// Every configuration value the engine's behaviour depends on.
std::string ConfigFingerprint(const AlertConfig& config) {
  codec::StateWriter w;
  w.PutU64(config.signals.size());
  for (const auto& [name, signal] : config.signals) {
    w.PutString(name);
    w.PutString(signal.alertname);
    w.PutBool(signal.enabled);
    w.PutString(signal.severity);
    const ChangeDetectorOptions& o = signal.detector;
    w.PutU8(static_cast<uint8_t>(o.direction));
    w.PutBool(o.change_detection);
    w.PutI32(o.warmup);
    w.PutI32(o.window);
    w.PutI32(o.gap);
    w.PutBool(o.trend);
    w.PutDouble(o.z_threshold);
    w.PutDouble(o.cusum_k);
    w.PutDouble(o.cusum_h);
    w.PutDouble(o.min_relative_change);
    w.PutDouble(o.min_absolute_change);
    w.PutI32(o.persist_m);
    w.PutI32(o.persist_n);
    w.PutI32(o.clear_after);
    w.PutBool(o.bound.has_value());
    w.PutDouble(o.bound.value_or(0.0));
    // Options added later, only when set: a configuration without them
    // keeps the fingerprint its checkpoints were written with.
    if (signal.per_head) {
      w.PutString("per_head");
      w.PutDouble(signal.head_z_correction);
    }
    if (o.min_baseline != 0 || o.small_sample_inflation != 0 || o.gate_inflation != 0 ||
        o.log_scale) {
      w.PutString("small_sample");
      w.PutI32(o.min_baseline);
      w.PutDouble(o.small_sample_inflation);
      w.PutDouble(o.gate_inflation);
      w.PutBool(o.log_scale);
    }
    if (o.warmup_steps != 0) {
      w.PutString("warmup_steps");
      w.PutI32(o.warmup_steps);
    }
    // Not reference_interval_steps: it only scales the counts a detector
    // applies, and a restored state fits every scale (RestoreState checks the
    // largest), so checkpoints from before it existed still restore.
  }
  w.PutBool(config.nonfinite.enabled);
  w.PutString(config.nonfinite.severity);
  w.PutI32(config.nonfinite.clear_after);
  const ProbableCauseConfig& pc = config.probable_cause;
  w.PutI64(pc.onset_window_steps);
  w.PutI64(pc.settle_steps);
  w.PutDouble(pc.lr_rise_factor);
  w.PutI64(pc.lr_baseline_steps);
  w.PutI64(pc.lr_baseline_gap_steps);
  // Appended only when not the default, so that states saved before the
  // option existed keep their fingerprint.
  if (!pc.fp32_attention_needs_corroboration) w.PutString("fp32_attention_alone");
  if (!pc.curvature_needs_corroboration) w.PutString("curvature_alone");
  if (!pc.unbiased_output_rules_out_precision) w.PutString("unbiased_output_not_evidence");
  if (!pc.expert_deaths_need_corroboration) w.PutString("expert_deaths_alone");
  return w.Take();
}

void PutAlert(codec::StateWriter& w, const Alert& a) {
  for (const std::string* text : {&a.alertname, &a.run, &a.layer, &a.signal, &a.severity,
                                  &a.summary, &a.description, &a.probable_cause,
                                  &a.suggested_action}) {
    w.PutString(*text);
  }
  w.PutI64(a.first_step);
  w.PutBool(a.probable_cause_settled);
  w.PutString(a.probable_cause_evidence);
  w.PutU8(static_cast<uint8_t>(a.state));
  w.PutI32(a.episode);
  w.PutI64(a.pending_step);
  w.PutI64(a.firing_step);
  w.PutI64(a.resolved_step);
  w.PutDouble(a.value);
  w.PutDouble(a.baseline);
  w.PutDouble(a.z);
  w.PutString(a.resolved_reason);
}

bool GetAlert(codec::StateReader& r, Alert& a, uint32_t version) {
  for (std::string* text : {&a.alertname, &a.run, &a.layer, &a.signal, &a.severity, &a.summary,
                            &a.description, &a.probable_cause, &a.suggested_action}) {
    if (!r.GetString(*text)) return false;
  }
  uint8_t state = 0;
  if (!r.GetI64(a.first_step) || !r.GetBool(a.probable_cause_settled) ||
      !r.GetString(a.probable_cause_evidence) || !r.GetU8(state) || !r.GetI32(a.episode) ||
      !r.GetI64(a.pending_step) || !r.GetI64(a.firing_step) || !r.GetI64(a.resolved_step) ||
      !r.GetDouble(a.value) || !r.GetDouble(a.baseline) || !r.GetDouble(a.z)) {
    return false;
  }
  if (version >= 3 && !r.GetString(a.resolved_reason)) return false;
  if (state > static_cast<uint8_t>(AlertState::kResolved)) return r.Fail("unknown alert state");
  a.state = static_cast<AlertState>(state);
  return true;
}

}  // namespace

std::string AlertEngine::SaveState() const {
  codec::StateWriter w;
  w.PutHeader(kEngineStateMagic, kEngineStateVersion);
  w.PutBytes(ConfigFingerprint(config_));
  w.PutU64(counters_.points_scored);
  w.PutU64(counters_.points_stale);
  w.PutU64(counters_.points_duplicate);
  w.PutU64(counters_.points_nonfinite);
  w.PutU64(runs_.size());
  for (const auto& [name, run_ptr] : runs_) {
    const RunState& run = *run_ptr;
    w.PutString(run.name);
    w.PutI64(run.latest_step);
    w.PutU32(static_cast<uint32_t>(run.family_onset.size()));
    for (int64_t onset : run.family_onset) w.PutI64(onset);
    for (int64_t fired : run.family_fired_step) w.PutI64(fired);
    w.PutU64(run.layer_steps.size());
    for (const auto& [layer, layer_step] : run.layer_steps) {
      w.PutI32(layer);
      w.PutI64(layer_step);
    }
    w.PutU8(static_cast<uint8_t>(run.cause));
    w.PutI64(run.mechanism_onset);
    w.PutBool(run.cause_settled);
    w.PutString(run.cause_evidence);
    w.PutU64(run.learning_rate.size());
    for (const auto& [step, lr] : run.learning_rate) {
      w.PutI64(step);
      w.PutDouble(lr);
    }
    w.PutBool(run.first_firing.has_value());
    if (run.first_firing) {
      w.PutString(run.first_firing->alertname);
      w.PutI32(run.first_firing->layer);
      w.PutString(run.first_firing->signal);
      w.PutI64(run.first_firing->firing_step);
      w.PutI64(run.first_firing->first_step);
    }
    w.PutI64(run.last_nonfinite_step);
    w.PutI64(run.last_clean_step);
    w.PutI32(run.clean_steps);
    w.PutI32(run.lifecycle.attempt);
    w.PutI64(run.lifecycle.rewound_to);
    w.PutBool(run.lifecycle.ended);

    size_t series_count = 0;
    for (const auto& [signal, by_layer] : run.series) series_count += by_layer.size();
    w.PutU64(series_count);
    for (const auto& [signal, by_layer] : run.series) {
      for (const auto& [layer, series] : by_layer) {
        w.PutString(signal);
        w.PutI32(layer);
        series.detector.SaveState(w);
      }
    }
    w.PutU64(run.alerts.size());
    for (const auto& [key, record] : run.alerts) {
      w.PutString(key.first);
      w.PutI32(key.second);
      PutAlert(w, record.alert);
      w.PutU64(record.series.size());
      for (const Series* series : record.series) w.PutString(series->key);
      w.PutBool(record.archived);
    }
    w.PutU64(run.earlier_episodes.size());
    for (const Alert& alert : run.earlier_episodes) {
      w.PutI32(alert.attempt);
      PutAlert(w, alert);
    }
  }
  return w.Take();
}

bool AlertEngine::RestoreState(std::string_view bytes, std::string* error) {
  codec::StateReader r(bytes);
  std::map<std::string, std::unique_ptr<RunState>, std::less<>> runs;
  AlertEngineCounters counters;
  uint32_t version = 0;

  auto read_run = [&](RunState& run) -> bool {
    uint32_t families = 0;
    if (!r.GetString(run.name) || !r.GetI64(run.latest_step) || !r.GetU32(families)) return false;
    // Families were added over time: states saved before the router-logit
    // family (the last) have one fewer, those saved before the rounding-bias
    // family too lack that one, and those saved before the learning-rate
    // family that one as well, in this order; a missing family reads as -1
    // (a router z-loss or entropy alert restored from such a state stays
    // router-collapse evidence).
    constexpr size_t kLearningRateIndex = static_cast<size_t>(AlertFamily::kLearningRate);
    constexpr size_t kRoundingBiasIndex = static_cast<size_t>(AlertFamily::kRoundingBias);
    constexpr size_t kRouterLogitGrowthIndex = static_cast<size_t>(AlertFamily::kRouterLogitGrowth);
    if (families > kFamilyCount || families + 3 < kFamilyCount) {
      return r.Fail("alert family count differs");
    }
    auto read_families = [&](std::array<int64_t, kFamilyCount>& values) {
      values.fill(-1);
      for (size_t f = 0; f < kFamilyCount; ++f) {
        if (families < kFamilyCount && f == kRouterLogitGrowthIndex) continue;
        if (families + 1 < kFamilyCount && f == kRoundingBiasIndex) continue;
        if (families + 2 < kFamilyCount && f == kLearningRateIndex) continue;
        if (!r.GetI64(values[f])) return false;
      }
      return true;
    };
    if (!read_families(run.family_onset) || !read_families(run.family_fired_step)) return false;
    uint64_t layers = 0;
    if (!r.GetCount(layers, 12)) return false;
    for (uint64_t i = 0; i < layers; ++i) {
      int32_t layer = 0;
      int64_t layer_step = 0;
      if (!r.GetI32(layer) || !r.GetI64(layer_step)) return false;
      run.layer_steps[layer] = layer_step;
    }
    uint8_t cause = 0;
    uint64_t lr_points = 0;
    if (!r.GetU8(cause) || !r.GetI64(run.mechanism_onset) || !r.GetBool(run.cause_settled) ||
        !r.GetString(run.cause_evidence) || !r.GetCount(lr_points, 16)) {
      return false;
    }
    if (cause > static_cast<uint8_t>(ProbableCause::kCombined)) return r.Fail("unknown cause");
    run.cause = static_cast<ProbableCause>(cause);
    for (uint64_t i = 0; i < lr_points; ++i) {
      int64_t step = 0;
      double lr = 0;
      if (!r.GetI64(step) || !r.GetDouble(lr)) return false;
      if (!std::isfinite(lr)) return r.Fail("non-finite learning rate");
      run.learning_rate.emplace_back(step, lr);
    }
    bool has_first_firing = false;
    if (!r.GetBool(has_first_firing)) return false;
    if (has_first_firing) {
      FirstFiring& f = run.first_firing.emplace();
      int32_t layer = 0;
      if (!r.GetString(f.alertname) || !r.GetI32(layer) || !r.GetString(f.signal) ||
          !r.GetI64(f.firing_step) || !r.GetI64(f.first_step)) {
        return false;
      }
      f.layer = layer;
    }
    int32_t clean_steps = 0;
    if (!r.GetI64(run.last_nonfinite_step) || !r.GetI64(run.last_clean_step) ||
        !r.GetI32(clean_steps)) {
      return false;
    }
    run.clean_steps = clean_steps;
    if (version >= 3) {
      int32_t attempt = 0;
      if (!r.GetI32(attempt) || !r.GetI64(run.lifecycle.rewound_to) ||
          !r.GetBool(run.lifecycle.ended)) {
        return false;
      }
      if (attempt < 1) return r.Fail("lifecycle attempt below 1");
      run.lifecycle.attempt = attempt;
    }

    uint64_t series_count = 0;
    if (!r.GetCount(series_count)) return false;
    for (uint64_t i = 0; i < series_count; ++i) {
      std::string key;
      int32_t layer = 0;
      if (!r.GetString(key) || !r.GetI32(layer)) return false;
      const auto parsed = ParseSeriesKey(key);
      if (!parsed) return r.Fail("malformed series key");
      const auto& [signal, head] = *parsed;
      const auto config_it = config_.signals.find(signal);
      if (config_it == config_.signals.end()) return r.Fail("series of an unknown signal");
      if (!config_it->second.per_head && head != detectors::kAllHeads) {
        return r.Fail("per-head series of a signal the configuration judges per layer");
      }
      auto& by_layer = run.series[key];
      auto [it, inserted] = by_layer.try_emplace(layer, config_it->second, signal, head);
      if (!inserted) return r.Fail("series saved twice");
      if (!it->second.detector.RestoreState(r)) return false;
    }

    uint64_t alert_count = 0;
    if (!r.GetCount(alert_count)) return false;
    for (uint64_t i = 0; i < alert_count; ++i) {
      std::string alertname;
      int32_t layer = 0;
      if (!r.GetString(alertname) || !r.GetI32(layer)) return false;
      auto [it, inserted] = run.alerts.try_emplace({alertname, layer});
      if (!inserted) return r.Fail("alert saved twice");
      AlertRecord& record = it->second;
      record.layer = layer;
      uint64_t feeding = 0;
      if (!GetAlert(r, record.alert, version) || !r.GetCount(feeding)) return false;
      for (uint64_t j = 0; j < feeding; ++j) {
        std::string signal;
        if (!r.GetString(signal)) return false;
        const auto signal_it = run.series.find(signal);
        if (signal_it == run.series.end()) return r.Fail("alert fed by an unknown series");
        const auto series_it = signal_it->second.find(layer);
        if (series_it == signal_it->second.end()) return r.Fail("alert fed by an unknown series");
        Series& series = series_it->second;
        if (series.record != nullptr) return r.Fail("series feeds two alerts");
        if (series.config->alertname != alertname) return r.Fail("series feeds another alert");
        series.record = &record;
        record.series.push_back(&series);
      }
      if (version >= 4 && !r.GetBool(record.archived)) return false;
      record.alert.attempt = run.lifecycle.attempt;
    }
    if (version >= 4) {
      uint64_t earlier = 0;
      if (!r.GetCount(earlier)) return false;
      if (earlier > kMaxKeptEpisodesPerRun) return r.Fail("too many earlier episodes");
      for (uint64_t i = 0; i < earlier; ++i) {
        Alert alert;
        if (!r.GetI32(alert.attempt) || !GetAlert(r, alert, version)) return false;
        if (alert.attempt < 1) return r.Fail("alert attempt below 1");
        run.earlier_episodes.push_back(std::move(alert));
      }
    }
    // Observe relies on every series having its alert.
    for (const auto& [signal, by_layer] : run.series) {
      for (const auto& [layer, series] : by_layer) {
        if (series.record == nullptr) return r.Fail("series without an alert");
      }
    }
    // Per-head thresholds are not saved: they follow from the heads present.
    for (auto& [key, record] : run.alerts) {
      for (const auto& [name, signal] : config_.signals) {
        if (signal.per_head && signal.alertname == key.first) CorrectHeadThresholds(record, name);
      }
    }
    return true;
  };

  auto read = [&]() -> bool {
    std::string_view fingerprint;
    uint64_t run_count = 0;
    if (!r.GetHeader(kEngineStateMagic, kEngineStateOldestVersion, kEngineStateVersion, version) ||
        !r.GetStringView(fingerprint)) {
      return false;
    }
    if (fingerprint != ConfigFingerprint(config_)) {
      return r.Fail("the alert configuration changed since the state was saved");
    }
    if (!r.GetU64(counters.points_scored) || !r.GetU64(counters.points_stale) ||
        !r.GetU64(counters.points_duplicate) || !r.GetU64(counters.points_nonfinite) ||
        !r.GetCount(run_count)) {
      return false;
    }
    for (uint64_t i = 0; i < run_count; ++i) {
      auto run = std::make_unique<RunState>();
      if (!read_run(*run)) return false;
      std::string name = run->name;
      if (!runs.emplace(std::move(name), std::move(run)).second) return r.Fail("run saved twice");
    }
    return r.ExpectEnd();
  };

  if (!read()) {
    runs_.clear();
    kept_episodes_ = 0;
    counters_ = AlertEngineCounters{};
    if (error) *error = "alert engine state refused: " + r.error();
    return false;
  }
  runs_ = std::move(runs);
  counters_ = counters;
  kept_episodes_ = 0;
  for (const auto& [name, run] : runs_) kept_episodes_ += run->earlier_episodes.size();
  EnforceKeptEpisodeLimit();  // saved under a higher limit
  return true;
}

}  // namespace foreshock::alerts
