// The alert engine: turns detector output into docs/DESIGN.md §5 alerts.
//
// Pure computation: no clock, no threads, no I/O, no gRPC/HTTP/Prometheus.
// The server feeds it every detector observation and non-finite event, and
// delivers the transitions it returns (Alertmanager, WatchAlerts, the
// foreshock_alert_active gauge, a log line).
//
// What drives alerts (which points, which signals, per head or per layer,
// deduplicated across ranks), the lifecycle (inactive -> pending -> firing ->
// resolved, episodes), labels and annotations, and how the probable cause is
// derived and settled are the contract of docs/DESIGN.md §5.1-§5.5; the
// shipped signal -> alert mapping is default_config.cc. Implementation:
// alert_engine.cc (the state machine), probable_cause.cc (cause and
// corroboration), alert_engine_checkpoint.cc (SaveState/RestoreState).
//
// ## Threading
//
// Thread-compatible, not thread-safe: const methods may run concurrently
// with each other, but not with Observe/ObserveNonFinite/ForgetRun and the
// lifecycle methods (CloseEpisodes, RewindRun, SetLifecycleMark). All
// state is partitioned by run, so the server may either call one engine
// under one mutex, or run one engine per shard as long as every point and
// event of a run (layer-level AND run-level) reaches the same shard; the
// snapshots are then the union over shards.
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "alerts/change_detector.h"
#include "alerts/config.h"
#include "alerts/probable_cause.h"
#include "detectors/detector.h"
#include "detectors/sample.h"

namespace foreshock::alerts {

// One detector output value. Views: only read during the call.
struct SignalPoint {
  std::string_view run;
  int64_t step = 0;
  std::string_view signal;
  int layer = detectors::kNoLayer;
  int head = detectors::kAllHeads;
  double value = 0;
  bool for_detection = true;
};

// Non-finite values found in one sample (detectors::Emitter::NonFinite).
struct NonFiniteEvent {
  std::string_view run;
  int64_t step = 0;
  detectors::SampleKind kind = detectors::SampleKind::kScalars;
  int64_t count = 0;
  int layer = detectors::kNoLayer;  // the sample's layer if known; for the description only
};

enum class AlertState : uint8_t { kInactive, kPending, kFiring, kResolved };
std::string_view AlertStateName(AlertState state);  // "inactive", "pending", "firing", "resolved"

inline constexpr std::string_view kRunLevelLayer = "all";
inline constexpr std::string_view kNonFiniteSignal = "nonfinite_values";
// The run-level signal the trainer streams its learning rate as (StepScalars.lr).
inline constexpr std::string_view kLearningRateSignal = "lr";
// The per-layer signal the QK detector reports the client's attention compute
// dtype as (bits: 32 for fp32); fp32 rules out a precision fault.
inline constexpr std::string_view kAttentionComputeBitsSignal = "attention_compute_bits";
// Alert::resolved_reason values (public contract: the annotation and
// foreshock.v1.Alert.resolved_reason).
inline constexpr std::string_view kRunEnded = "run_ended";
inline constexpr std::string_view kRunResumed = "run_resumed";
// The run sent nothing, with no stream open, for the daemon's forgetting
// period (server/pipeline/run_lifecycle.h, ForgetIdleRuns).
inline constexpr std::string_view kRunIdle = "run_idle";

// What of the server's run lifecycle (server/pipeline/run_lifecycle.h) the
// engine's state already reflects. The engine only stores it, with its
// checkpoint, so that a restarted daemon re-applies exactly what the
// checkpoint missed.
struct LifecycleMark {
  int32_t attempt = 1;       // the attempt whose start (CloseEpisodes) was applied
  int64_t rewound_to = -1;   // that attempt's RewindRun step; -1: none yet
  bool ended = false;        // the run's end (CloseEpisodes with kRunEnded) was applied
  bool operator==(const LifecycleMark&) const = default;
};

struct Alert {
  // Labels (docs/DESIGN.md §5.4).
  std::string alertname;
  std::string run;
  std::string layer;  // the layer index, or "all" for run-level alerts
  std::string signal;
  std::string severity;
  // Annotations (docs/DESIGN.md §5.4).
  std::string summary;
  std::string description;
  std::string probable_cause;
  std::string suggested_action;
  int64_t first_step = -1;
  bool probable_cause_settled = false;  // annotation probable_cause_status: provisional|settled
  std::string probable_cause_evidence;  // what the cause rests on, for humans

  AlertState state = AlertState::kInactive;
  int episode = 0;             // 1 for the first pending/firing episode, +1 per new one
  int64_t pending_step = -1;   // step it became pending (-1: went straight to firing)
  int64_t firing_step = -1;    // step it fired in this episode (-1: not yet)
  // Step the episode ended: it resolved, or (state inactive) cleared
  // without firing. -1 while it is open.
  int64_t resolved_step = -1;
  // The values that fired it (or made it pending); NaN when not applicable
  // (no baseline yet, or a guard / non-finite alert).
  double value = std::numeric_limits<double>::quiet_NaN();
  double baseline = std::numeric_limits<double>::quiet_NaN();
  double z = std::numeric_limits<double>::quiet_NaN();
  // Set when the run's lifecycle, not its signals, ended the episode:
  // kRunEnded or kRunResumed (docs/DESIGN.md §5.3). Empty otherwise.
  std::string resolved_reason;
  // The run's attempt (docs/DESIGN.md §5.3) this alert's episode belongs to.
  // Not a label: an earlier attempt's alerts stay listed (AllAlerts) beside
  // the resumed attempt's alerts of the same name and layer.
  int32_t attempt = 1;

  using KeyValues = std::vector<std::pair<std::string, std::string>>;
  // Sorted by name: alertname, layer, run, severity, signal.
  KeyValues Labels() const;
  // Sorted by name: description, first_step, probable_cause, probable_cause_evidence,
  // probable_cause_status, [resolved_reason, only when set,] suggested_action, summary.
  KeyValues Annotations() const;
};

// One lifecycle change, with the alert as it is after it. from == to ==
// kFiring means the annotations changed (the run's probable cause was
// refined); deliver it like a re-send.
struct AlertTransition {
  Alert alert;
  AlertState from = AlertState::kInactive;
  AlertState to = AlertState::kInactive;
  int64_t step = 0;  // the step of the point or event that caused it
};

// Which layer-level alert of a run fired first (earliest firing step, then
// earliest first_step).
struct FirstFiring {
  std::string alertname;
  int layer = 0;
  std::string signal;
  int64_t firing_step = 0;
  int64_t first_step = 0;
};

// Points that did not reach a detector, for the server's metrics.
struct AlertEngineCounters {
  uint64_t points_scored = 0;     // reached a change detector and were scored or recorded
  uint64_t points_stale = 0;      // older step than the series' latest
  uint64_t points_duplicate = 0;  // same step, not worse than the value already scored
  uint64_t points_nonfinite = 0;  // non-finite values passed to Observe (dropped)
  // Closed episodes no longer listed: past kMaxKeptEpisodesPerRun in their
  // run, or past the engine-wide SetKeptEpisodeLimit.
  uint64_t episodes_dropped = 0;
};

class AlertEngine {
 public:
  // `config` must be valid (ParseAlertConfig validates; ValidateAlertConfig
  // checks a hand-built one).
  explicit AlertEngine(AlertConfig config = DefaultAlertConfig());
  ~AlertEngine();
  // Closed episodes kept per run (AllAlerts); past it the run's oldest
  // episode that never fired goes first, else its oldest.
  static constexpr size_t kMaxKeptEpisodesPerRun = 4096;
  // Closed episodes kept over all runs (0: no bound beyond the per-run one;
  // an episode costs about 1 KiB). Past it the run that keeps the most loses
  // an episode, as above: a run whose alerts flap pays for it, not the others.
  void SetKeptEpisodeLimit(size_t total) {
    kept_episode_limit_ = total;
    EnforceKeptEpisodeLimit();
  }
  size_t kept_episodes() const { return kept_episodes_; }
  AlertEngine(const AlertEngine&) = delete;
  AlertEngine& operator=(const AlertEngine&) = delete;

  std::vector<AlertTransition> Observe(const SignalPoint& point);
  std::vector<AlertTransition> ObserveNonFinite(const NonFiniteEvent& event);

  // Pending and firing alerts of every run, by run, alertname and layer.
  std::vector<Alert> ActiveAlerts() const;
  // Every episode of every alert of `run` that ever left inactive: closed
  // ones (kMaxKeptEpisodesPerRun per run, SetKeptEpisodeLimit over all) and
  // the current one of each alert, ordered by
  // attempt (oldest first), alertname, layer (run-level first) and episode.
  // Alert::attempt and Alert::episode say whose.
  std::vector<Alert> AllAlerts(std::string_view run) const;
  std::optional<FirstFiring> FirstFiringLayer(std::string_view run) const;
  ProbableCause RunProbableCause(std::string_view run) const;

  // Drops all state of `run` (finished, or restarted from a checkpoint: its
  // steps start over, which every series would otherwise ignore as stale).
  // Returns the transitions that close its open alerts (firing -> resolved,
  // pending -> inactive, at the run's latest step) so they can be delivered.
  std::vector<AlertTransition> ForgetRun(std::string_view run);
  // The run is forgotten (the daemon's idle rule): its open alerts close
  // (kRunIdle) and the baselines that judge its later samples go (every
  // series, the learning-rate history), while its alert records, earlier
  // episodes, probable cause and lifecycle mark stay listed and
  // checkpointed. A later sample of the run starts a fresh series, which
  // warms up before it judges. Returns the closing transitions.
  std::vector<AlertTransition> ReleaseBaselines(std::string_view run);
  // Series (one per signal, layer and head) that keep a baseline, over all runs.
  size_t BaselineSeries() const;

  // Run lifecycle (docs/DESIGN.md §5.3). CloseEpisodes ends every open
  // episode of `run` because the run ended or restarted (`reason`: kRunEnded
  // or kRunResumed): firing -> resolved, pending -> inactive, at the run's
  // latest step, with Alert::resolved_reason set; every series starts a new
  // episode (ChangeDetector::ResetEpisode) and keeps its baseline, so a
  // fault that is still there fires again as a new episode. The alerts stay
  // listed (AllAlerts).
  std::vector<AlertTransition> CloseEpisodes(std::string_view run, std::string_view reason);
  // A run resumed from a checkpoint at `from_step`: CloseEpisodes(kRunResumed),
  // then everything learned at steps >= from_step is forgotten, since the
  // resumed attempt replays those steps: the series' samples
  // (ChangeDetector::Rewind), the learning-rate history, the per-layer
  // progress, and probable-cause evidence whose episode began or fired there
  // (an unsettled or re-opened cause is derived again).
  std::vector<AlertTransition> RewindRun(std::string_view run, int64_t from_step);
  LifecycleMark GetLifecycleMark(std::string_view run) const;  // default for an unknown run
  void SetLifecycleMark(std::string_view run, const LifecycleMark& mark);

  const AlertConfig& config() const { return config_; }
  const AlertEngineCounters& counters() const { return counters_; }

  // Checkpointing, so that a restarted daemon continues its alerts instead of
  // re-learning every baseline. SaveState is const (see Threading) and
  // captures everything the engine's future output depends on: every run's
  // series (their change detectors, including the state before the latest
  // step and the last assessment), alert records (state, labels,
  // annotations, episode and steps), probable-cause state (family onsets,
  // mechanism onset, cause, settled flag, evidence, LR history), first firing
  // layer, non-finite state, and the point counters.
  //
  // RestoreState replaces the engine's state with a saved one; the engine
  // must have the same configuration as the one that saved (the blob carries
  // a fingerprint of it: a changed configuration is refused, since baselines
  // and persistence windows learned under other options would not mean the
  // same). A restored engine continues exactly like the saved one: same
  // transitions, same snapshots. Returns false on truncated, corrupt or
  // unsupported input or a changed configuration; *error (if given) says
  // why, and the engine is left empty, as newly constructed (counters 0).
  // Restoring changes counters(): a caller exporting counter deltas must
  // take the restored values as its new baseline (or export them once).
  //
  // Format: codec (codec/state_codec.h), Header "FSAE" version 4
  // (versions 2 and 3 are still read); see alert_engine_checkpoint.cc for the layout.
  std::string SaveState() const;
  bool RestoreState(std::string_view bytes, std::string* error = nullptr);

 private:
  struct AlertRecord;
  struct Series;
  struct RunState;

  RunState& GetRun(std::string_view run);
  // Resolves the run's firing alerts and clears its pending ones (ForgetRun, CloseEpisodes).
  std::vector<AlertTransition> CloseOpenAlerts(RunState& run,
                                               std::optional<std::string_view> reason);
  // Moves `record`'s episode (if it has one not kept yet) into the run's
  // earlier episodes, before a new one opens or a resume closes it.
  void KeepEpisode(RunState& run, AlertRecord& record);
  // Drops one closed episode of `run` (the oldest that never fired, else the
  // oldest).
  void DropEpisode(RunState& run);
  // Past SetKeptEpisodeLimit: the runs that keep the most drop theirs.
  void EnforceKeptEpisodeLimit();
  Series& GetSeries(RunState& run, const SignalConfig& config, std::string_view signal, int layer,
                    int head = detectors::kAllHeads);
  // Sets the thresholds of `signal`'s per-head series feeding `record` for
  // the number of them (SignalConfig::head_z_correction).
  static void CorrectHeadThresholds(AlertRecord& record, std::string_view signal);
  // A per-head signal's layer has per-head series (then its aggregate is not judged).
  static bool JudgedPerHead(const RunState& run, const SignalConfig& config,
                            std::string_view signal, int layer);
  AlertRecord& GetRecord(RunState& run, std::string_view alertname, int layer);
  void AdvanceCleanSteps(RunState& run, int64_t step, std::vector<AlertTransition>& out);
  void Evaluate(RunState& run, AlertRecord& record, const Series& trigger,
                const ChangeAssessment& assessment, int64_t step,
                std::vector<AlertTransition>& out);
  // Records evidence for the probable cause and the first firing layer, and
  // re-annotates the run's alerts; firing alerts other than `fired` whose
  // annotations changed are appended to `out` as firing -> firing. Then fires
  // the alerts held for corroboration (ReleaseHeld), with that evidence.
  void OnFired(RunState& run, AlertRecord& fired, int64_t step, std::vector<AlertTransition>& out);
  void CountFiredEvidence(RunState& run, AlertRecord& fired, int64_t step,
                          std::vector<AlertTransition>& out);
  // An alert that must wait, pending, for another kind: attention-side in an
  // fp32 run, the curvature, or expert deaths or router imbalance alone
  // (ProbableCauseConfig::*_needs_corroboration), judged as of training step
  // `step`: an alert that fired at a later step (its layer processed ahead by
  // another worker) corroborates nothing yet.
  bool HeldForCorroboration(const RunState& run, const AlertRecord& record, int64_t step) const;
  // A router collapse that only expert deaths raised, in a run with no other
  // kind of trouble by `step` (ProbableCauseConfig::expert_deaths_need_corroboration).
  bool ExpertDeathsAlone(const RunState& run, const AlertRecord& record, int64_t step) const;
  // Another kind of trouble than `record`'s, by `step`, for the router
  // symptoms' holds: an alert that fired (router imbalance aside), or a
  // curvature surge held itself (the holds release each other).
  static bool OtherTroubleBy(const RunState& run, const AlertRecord& record, int64_t step);
  // Fired (firing now, or fired then resolved) at or before `step`.
  static bool FiredBy(const AlertRecord& record, int64_t step);
  // The families whose alerts release an fp32 attention hold.
  static bool Corroborates(AlertFamily family);
  // Firing, or with a series anomalous now (confirmed, though perhaps held).
  static bool Anomalous(const AlertRecord& record);
  // Fires the held alerts whose series are anomalous (another kind fired).
  void ReleaseHeld(RunState& run, int64_t step, std::vector<AlertTransition>& out);
  bool RefreshCause(const RunState& run, AlertRecord& record,
                    bool include_resolved = false) const;
  // RefreshCause for every alert of `run` but `skip`; firing ones whose
  // annotations changed are appended to `out` as firing -> firing at `step`.
  // Some alert of `run` other than `except` and of a mechanism family (not a
  // consequence) is pending or firing.
  static bool AnyMechanismAlertActive(const RunState& run, const AlertRecord* except);
  // Every family of the run's episode, `except` aside, is a symptom (or none fired).
  static bool OnlySymptomsFired(const RunState& run, AlertFamily except);
  // Every layer of `run` that computes attention in bf16 or fp16 sent the
  // output check (ProbableCauseConfig::unbiased_output_rules_out_precision).
  static bool OutputMeasuredUnbiased(const RunState& run);
  void ReannotateRun(RunState& run, const AlertRecord* skip, int64_t step,
                     std::vector<AlertTransition>& out) const;
  // Re-derives the run's cause from its family onsets and LR history,
  // counting only the families whose episode fired by step `fired_by`.
  void DeriveCause(RunState& run,
                   int64_t fired_by = std::numeric_limits<int64_t>::max()) const;
  // Settles the run's cause once its latest step is settle_steps past the
  // onset; firing alerts are re-sent (firing -> firing) with the final cause.
  void MaybeSettleCause(RunState& run, int64_t step, std::vector<AlertTransition>& out);
  void RecordLearningRate(RunState& run, int64_t step, double lr);

  // RestoreState, a run at a time (alert_engine_checkpoint.cc).
  bool RestoreRun(codec::StateReader& r, uint32_t version, RunState& run) const;
  static bool RestoreRunScalars(codec::StateReader& r, uint32_t version, RunState& run);
  bool RestoreRunSeries(codec::StateReader& r, RunState& run) const;
  static bool RestoreRunAlerts(codec::StateReader& r, uint32_t version, RunState& run);

  const AlertConfig config_;
  std::map<std::string, std::unique_ptr<RunState>, std::less<>> runs_;
  AlertEngineCounters counters_;
  size_t kept_episodes_ = 0;       // closed episodes of every run
  size_t kept_episode_limit_ = 0;  // SetKeptEpisodeLimit
};

}  // namespace foreshock::alerts
