// AlertEngine::SaveState and RestoreState: the engine's checkpoint (format
// below), so that a restarted daemon continues each run's alerts instead of
// re-learning them (docs/DESIGN.md §4).
#include <algorithm>
#include <cstdint>

#include "alerts/alert_engine_state.h"
#include "alerts/text.h"
#include "codec/state_codec.h"

namespace foreshock::alerts {
using engine_internal::kFamilyCount;
using engine_internal::ParseSeriesKey;

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
  if (!pc.imbalance_needs_corroboration) w.PutString("imbalance_alone");
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

// A run's scalars: families, layer steps, cause, LR history, first firing,
// non-finite counters and (v3) its lifecycle.
bool AlertEngine::RestoreRunScalars(codec::StateReader& r, uint32_t version, RunState& run) {
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

  return true;
}

// A run's series, each with its change detector's state.
bool AlertEngine::RestoreRunSeries(codec::StateReader& r, RunState& run) const {
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

  return true;
}

// A run's alerts, linked to the series that feed them, and (v4) the episodes
// of earlier attempts.
bool AlertEngine::RestoreRunAlerts(codec::StateReader& r, uint32_t version, RunState& run) {
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
  return true;
}

bool AlertEngine::RestoreRun(codec::StateReader& r, uint32_t version, RunState& run) const {
  if (!RestoreRunScalars(r, version, run) || !RestoreRunSeries(r, run) ||
      !RestoreRunAlerts(r, version, run)) {
    return false;
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
}

bool AlertEngine::RestoreState(std::string_view bytes, std::string* error) {
  codec::StateReader r(bytes);
  std::map<std::string, std::unique_ptr<RunState>, std::less<>> runs;
  AlertEngineCounters counters;
  uint32_t version = 0;

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
      if (!RestoreRun(r, version, *run)) return false;
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
