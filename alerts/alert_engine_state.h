// AlertEngine's per-run state and the helpers its three implementation
// files share: alert_engine.cc (the state machine: observe, evaluate, fire,
// resolve, episodes), probable_cause.cc (cause derivation and the
// corroboration holds) and alert_engine_checkpoint.cc (SaveState and
// RestoreState). Not part of the alerts API: include alerts/alert_engine.h.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "alerts/alert_engine.h"

namespace foreshock::alerts {
namespace engine_internal {

inline constexpr size_t kFamilyCount = static_cast<size_t>(AlertFamily::kRouterLogitGrowth) + 1;
// The cause evidence that says low-precision attention was measured
// unbiased (DeriveCause); a rounding bias measured after the cause settled
// re-derives a cause that rested on it.
inline constexpr std::string_view kUnbiasedOutputEvidence =
    "attention output measured unbiased against fp32";
inline constexpr std::string_view kOutputBiasSignal = "attention_output_bias";
// The fp32 hold lets go of a guard signal this many times beyond its bound
// once the run has shown another sign of trouble (HeldForCorroboration).
inline constexpr double kFarBeyondBound = 4.0;

inline bool IsAttentionFamily(AlertFamily family) {
  return family == AlertFamily::kQKSpectrum || family == AlertFamily::kAttentionLogits;
}

// The router signals that count experts starved of tokens, as opposed to
// those read from the router's logits.
inline bool IsExpertDeathSignal(std::string_view signal) {
  return signal == "router_experts_died" || signal == "router_dead_experts";
}

// A value for an alert's text: 4 significant digits, "n/a" for NaN.
std::string Num(double value);

// Per-head series are keyed "<signal>@h<head>" (signal names have no '@');
// the layer aggregate and run-level series by the signal alone.
std::string SeriesKey(std::string_view signal, int head);
// The signal and head of a series key; nullopt when the head part is malformed.
std::optional<std::pair<std::string, int>> ParseSeriesKey(std::string_view key);

}  // namespace engine_internal

struct AlertEngine::Series {
  Series(const SignalConfig& signal_config, std::string signal_name,
         int head_index = detectors::kAllHeads)
      : config(&signal_config),
        signal(std::move(signal_name)),
        head(head_index),
        key(engine_internal::SeriesKey(signal, head)),
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
  std::array<int64_t, engine_internal::kFamilyCount> family_onset;
  std::array<int64_t, engine_internal::kFamilyCount> family_fired_step;  // when that episode fired
  ProbableCause cause = ProbableCause::kUnknown;
  int64_t mechanism_onset = -1;  // earliest onset among the families that name a cause (DeriveCause)
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

}  // namespace foreshock::alerts
