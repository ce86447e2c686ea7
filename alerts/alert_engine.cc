#include "alerts/alert_engine.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <tuple>

#include "alerts/alert_engine_state.h"
#include "alerts/text.h"

namespace foreshock::alerts {
using engine_internal::IsAttentionFamily;
using engine_internal::kFamilyCount;
using engine_internal::Num;
using engine_internal::SeriesKey;

namespace engine_internal {

std::string Num(double value) {
  if (std::isnan(value)) return "n/a";
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.4g", value);
  return buffer;
}

constexpr std::string_view kHeadKeySeparator = "@h";

std::string SeriesKey(std::string_view signal, int head) {
  if (head == detectors::kAllHeads) return std::string(signal);
  return internal::Cat(signal, kHeadKeySeparator, head);
}

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

}  // namespace engine_internal

namespace {

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

// An alert's description: what the series that moved it did, against its
// baseline and bound, over how many samples, and the run's first firing layer.
std::string DescribeChange(std::string_view signal, int head, const ChangeDetectorOptions& o,
                           const SampleCounts& n, const ChangeAssessment& a, bool confirmed,
                           const std::optional<FirstFiring>& first_firing) {
  const bool rise = o.direction == Direction::kRise;
  std::string text;
  const std::string name =
      head == detectors::kAllHeads ? std::string(signal) : internal::Cat(signal, " of head ", head);
  if (a.change_flag) {
    text = internal::Cat(name, rise ? " rose" : " dropped", " to ", Num(a.value), " at step ",
                         a.step, " (baseline ", Num(a.baseline), ", robust z ", Num(a.z),
                         ", change ", Num(100 * a.relative_change), "%)");
  } else {
    text = internal::Cat(name, " = ", Num(a.value), " at step ", a.step);
    if (!std::isnan(a.baseline)) {
      text += internal::Cat(" (baseline ", Num(a.baseline), ", robust z ", Num(a.z), ")");
    }
  }
  if (a.guard_flag) {
    text += internal::Cat(rise ? ", above" : ", below", " the absolute bound ", Num(*o.bound));
  }
  // The counts are at this series' sampling interval (reference_interval_steps).
  if (confirmed) {
    text += internal::Cat("; anomalous in ", n.persist_m, " of ", n.persist_n,
                          " samples since step ", a.onset_step, ".");
  } else {
    text += internal::Cat("; ", a.anomalous_in_window, " of the last ", n.persist_n,
                          " samples anomalous (", n.persist_m, " fire it), since step ",
                          a.onset_step, ".");
  }
  if (first_firing) {
    text += internal::Cat(" First layer to fire in this run: layer ", first_firing->layer, " (",
                          first_firing->alertname, ", ", first_firing->signal, ", step ",
                          first_firing->firing_step, ").");
  }
  return text;
}

// Why a confirmed alert still waits, pending (HeldForCorroboration).
std::string_view HeldNote(AlertFamily family) {
  if (family == AlertFamily::kCurvature) {
    return " Held: a curvature surge alone is often an edge-of-stability "
           "excursion the optimizer resolves by itself, so this waits for "
           "another kind of alert (attention, router, learning rate, loss).";
  }
  if (family == AlertFamily::kRouterCollapse) {
    return " Held: experts that stopped receiving tokens while the router's "
           "logits stay steady are often a router without (enough) balance "
           "loss settling on fewer experts, which costs capacity, not the "
           "run; this waits for another kind of alert (attention, curvature, "
           "learning rate, loss) or for the router's logits to move.";
  }
  if (family == AlertFamily::kRouterImbalance) {
    return " Held: a skewed expert load while nothing else moves is often a "
           "router without (enough) balance loss, which costs throughput, not "
           "the run; this waits for another kind of alert (attention, router "
           "collapse, curvature, learning rate, loss).";
  }
  return " Held: this run computes attention in fp32, so this waits for another "
         "kind of alert (curvature, router, learning rate, loss) to fire.";
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
      HeldForCorroboration(run, *series.record, point.step)) {
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
       !HeldForCorroboration(run, *series.record, point.step))) {
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
    alert.description = DescribeChange(series.signal, series.head, series.config->detector,
                                       series.detector.counts(), a, confirmed, run.first_firing);
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
                    HeldForCorroboration(run, record, step);
  if (held) {
    any_anomalous = false;
    any_pending = true;
  }
  auto note_held = [&] {
    if (held) alert.description += HeldNote(FamilyOfAlert(alert.alertname));
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

// Firing alerts of `run` resolve and pending ones clear, at its latest step,
// with `reason` (if given) as their resolved_reason.
std::vector<AlertTransition> AlertEngine::CloseOpenAlerts(
    RunState& run, std::optional<std::string_view> reason) {
  std::vector<AlertTransition> out;
  const int64_t step = run.latest_step;
  for (auto& [key, record] : run.alerts) {
    Alert& alert = record.alert;
    const AlertState from = alert.state;
    if (from == AlertState::kFiring) {
      alert.state = AlertState::kResolved;
    } else if (from == AlertState::kPending) {
      alert.state = AlertState::kInactive;
    } else {
      continue;
    }
    alert.resolved_step = step;
    if (reason) alert.resolved_reason = std::string(*reason);
    out.push_back(AlertTransition{alert, from, alert.state, step});
  }
  return out;
}

std::vector<AlertTransition> AlertEngine::ForgetRun(std::string_view run) {
  std::vector<AlertTransition> out;
  const auto it = runs_.find(run);
  if (it == runs_.end()) return out;
  out = CloseOpenAlerts(*it->second, std::nullopt);
  kept_episodes_ -= it->second->earlier_episodes.size();
  runs_.erase(it);
  return out;
}

std::vector<AlertTransition> AlertEngine::ReleaseBaselines(std::string_view run_name) {
  std::vector<AlertTransition> out;
  const auto it = runs_.find(run_name);
  if (it == runs_.end()) return out;
  RunState& run = *it->second;
  out = CloseOpenAlerts(run, kRunIdle);
  for (auto& [key, record] : run.alerts) record.series.clear();
  run.series.clear();
  run.learning_rate.clear();
  run.attention_bits.clear();
  return out;
}

size_t AlertEngine::BaselineSeries() const {
  size_t count = 0;
  for (const auto& [name, run] : runs_) {
    for (const auto& [key, by_layer] : run->series) count += by_layer.size();
  }
  return count;
}

// ---------------------------------------------------------------------------
// Run lifecycle.

std::vector<AlertTransition> AlertEngine::CloseEpisodes(std::string_view run_name,
                                                        std::string_view reason) {
  std::vector<AlertTransition> out;
  const auto it = runs_.find(run_name);
  if (it == runs_.end()) return out;
  RunState& run = *it->second;
  out = CloseOpenAlerts(run, reason);
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

}  // namespace foreshock::alerts
