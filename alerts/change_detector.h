// A per-series change detector: decides, one sample at a time, whether a
// signal series (one run, one signal, one layer or head) has changed in the
// alert direction, and tracks that decision with persistence and hysteresis.
// Pure computation: no clock, no threads, no I/O.
//
// The algorithm and its defaults are docs/DESIGN.md §5.2: a robust baseline
// trailing the sample by a gap (so that a collapse is confirmed before it
// enters its own baseline), an optional clamped trend, the robust z, an
// effect-size gate, a one-sided CUSUM, the absolute bound, persistence m of n,
// and a baseline frozen while anomalous. The comments on Options and in the
// .cc give each knob's exact arithmetic.
//
// Several sources per step (ranks): the first value of a step is scored at
// once; a later value for that step that is worse in the alert direction
// rolls the detector back to its state before the step and re-scores it,
// anything else for the step (or an older step: stale) is ignored. So a
// worse value never retracts a decision; it can only postpone a clearing.
//
// Known limitation: since the baseline freezes while anomalous, a permanent
// level shift that was confirmed stays anomalous until the value returns;
// thresholds keep benign shifts (an LR decay, a data switch) below the gate.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>
#include <vector>

#include "codec/state_codec.h"

namespace foreshock::alerts {

enum class Direction : uint8_t { kRise, kDrop };
std::string_view DirectionName(Direction direction);  // "rise" or "drop"

// Every knob of one detector. The defaults here are the generic defaults;
// default_config.cc overrides some per signal (DefaultAlertConfig()). Counts are
// in samples of the series, not in training steps.
struct ChangeDetectorOptions {
  Direction direction = Direction::kRise;
  // False: only the absolute guard (`bound`) can make a sample anomalous.
  bool change_detection = true;
  // Samples seen before anything is scored (baseline and guard alike).
  int warmup = 12;
  // Training steps before the series starts: a sample at a step below this
  // is ignored, kept out of the baseline and of the `warmup` count. Early
  // training is a transient (attention and routing leave their random-init
  // state within the LR warm-up) that a baseline of the first probes mistakes
  // for the normal level; a count of samples alone cannot say when it ends,
  // since a probe every 5 steps reaches 12 samples at step 60 and one every
  // 50 at step 600. 0: from the first sample.
  int warmup_steps = 0;
  // Samples in the baseline window.
  int window = 40;
  // Samples the window must hold before the baseline is ready; 0: half the
  // window (at least 3).
  int min_baseline = 4;
  // The baseline scale is multiplied by 1 + small_sample_inflation / n for a
  // window of n samples (the uncertainty of a median and MAD from few samples).
  double small_sample_inflation = 25.0;
  // The effect-size gate (min_relative_change) is multiplied by
  // (1 + gate_inflation / n) / (1 + gate_inflation / window) for a window of
  // n samples: a young baseline needs a larger change, a full one the gate as set.
  double gate_inflation = 20.0;
  // Score log(value) (values <= 1e-30 as 1e-30): for series that change by
  // factors (logits, z-loss), so that the trend follows exponential growth and
  // the scale is relative. min_relative_change then means a rise by the factor
  // 1 + r or a drop to 1 - r; min_absolute_change still applies to the value.
  bool log_scale = false;
  // Samples between the newest baseline sample and the current one. Keep
  // it >= persist_n so a collapse confirms before it leaks into the baseline.
  int gap = 8;
  // Follow the series' own trend in the alert direction, clamped to it (two
  // spans, the whole window and its newer half when each holds >= 6 samples;
  // the level further along the alert direction and the larger scale win).
  bool trend = true;
  // Robust z-score that marks a sample anomalous on its own.
  double z_threshold = 5.0;
  // CUSUM allowance k (in z units) and decision threshold h.
  double cusum_k = 1.0;
  double cusum_h = 8.0;
  // Effect-size gate: minimum change relative to |baseline| and in absolute
  // units; the larger of the two applies.
  double min_relative_change = 0.10;
  double min_absolute_change = 0.0;
  // Persistence: persist_m anomalous samples among the last persist_n.
  int persist_m = 3;
  int persist_n = 5;
  // Hysteresis: consecutive normal samples before an anomalous series clears.
  int clear_after = 10;
  // Absolute guard: anomalous while value > bound (kRise) or < bound (kDrop).
  std::optional<double> bound;
  // Growth the guard also asks for (issue 33; kRise with log_scale only):
  // past `bound` a sample is anomalous only if the value grew by at least
  // the factor bound_growth over the last bound_growth_steps training steps
  // (against the newest history sample that old; with a younger history,
  // against its oldest sample, the factor scaled to the steps between them;
  // with none, anomalous). Past bound_without_growth no growth is asked.
  // A level that sits past the bound and holds (an attention head that has
  // specialised) is the model's state; one still growing by factors is the
  // runaway the bound is for. bound_growth <= 1: no growth asked.
  double bound_growth = 0;
  int bound_growth_steps = 100;
  std::optional<double> bound_without_growth;
  // Cadence (issue 33): the counts above (warmup, window, gap, min_baseline,
  // persist_m, persist_n, clear_after) were calibrated on series sampled once
  // every `reference_interval_steps` training steps. A series sampled at
  // another interval (measured: the median step distance between its recent
  // samples) scales them by reference / interval, so that they span the same
  // training steps: a probe every 50 steps confirms a change on 2 samples
  // (100 steps) instead of 3 of 5 (up to 250), a probe every 5 steps needs 6
  // of 10 (50 steps) instead of 3 of 5 (25). Floors keep the noise
  // protection (persistence at least 2 of 2 where it was more, a window of 8,
  // a warm-up of 3) and the scale is capped at 4 (memory). At the reference
  // interval nothing changes. 0: counts are in samples, whatever the cadence.
  int reference_interval_steps = 0;
};

// The sample counts a detector uses at a given sampling interval (see
// ChangeDetectorOptions::reference_interval_steps). interval <= 0 (not known
// yet) or reference_interval_steps 0: the configured counts.
struct SampleCounts {
  int warmup = 0;
  int window = 0;
  int gap = 0;
  int min_baseline = 0;
  int persist_m = 0;
  int persist_n = 0;
  int clear_after = 0;
};
SampleCounts CountsForInterval(const ChangeDetectorOptions& options, double interval_steps);

// The persistence state of one series.
enum class SeriesState : uint8_t {
  kNormal,     // no anomalous sample in the persistence window
  kPending,    // some anomalous samples, fewer than persist_m
  kAnomalous,  // persistence reached; stays until clear_after normal samples
};
std::string_view SeriesStateName(SeriesState state);

// What one Update() concluded. Baseline fields are NaN when the baseline was
// not ready (warm-up, or a guard-only detector).
struct ChangeAssessment {
  enum class Disposition : uint8_t {
    kScored,     // the sample was scored (possibly replacing a same-step value)
    kWarmup,     // recorded for the baseline, not scored
    kStale,      // older step than the latest: ignored
    kDuplicate,  // same step, not worse than the value already scored: ignored
  };
  Disposition disposition = Disposition::kScored;
  int64_t step = 0;
  double value = 0;
  double baseline = std::numeric_limits<double>::quiet_NaN();
  double scale = std::numeric_limits<double>::quiet_NaN();  // robust sigma
  double z = std::numeric_limits<double>::quiet_NaN();      // signed: (x - baseline) / scale
  double cusum = 0;
  // Signed relative change (x - baseline) / |baseline|; NaN without baseline.
  double relative_change = std::numeric_limits<double>::quiet_NaN();
  bool change_flag = false;  // the change test marked the sample
  bool guard_flag = false;   // the absolute guard marked the sample
  bool anomalous() const { return change_flag || guard_flag; }
  SeriesState state = SeriesState::kNormal;  // after this sample
  // The earliest anomalous step of the episode, -1 if none.
  int64_t onset_step = -1;
  // anomalous samples among the last persist_n (while not kAnomalous)
  int anomalous_in_window = 0;
};

class ChangeDetector {
 public:
  // `options` must be valid (ValidateAlertConfig in config.h checks them).
  explicit ChangeDetector(const ChangeDetectorOptions& options);

  // Scores the value of the series at `step` (see "Steps and several sources
  // per step" above for repeated steps). Non-finite values are not accepted:
  // the caller drops them (they are ForeshockNonFinite's business).
  ChangeAssessment Update(int64_t step, double value);

  // Run lifecycle (docs/DESIGN.md §5.3). ResetEpisode ends the current
  // episode (the run ended or restarted): the series is normal again, with
  // its CUSUM and persistence window cleared, and keeps its baseline history.
  // Rewind(from_step) also forgets every sample at a step >= from_step (a
  // run resumed from a checkpoint replays them): they leave the history, and
  // steps from from_step on are scored again instead of being stale.
  void ResetEpisode();
  void Rewind(int64_t from_step);

  // Changes the two decision thresholds of a running detector (z_threshold
  // and cusum_h; each must be > 0). The alert engine uses it for per-head
  // series, whose thresholds grow with the number of heads judged in the
  // layer (SignalConfig::per_head); nothing else of the state changes.
  void SetThresholds(double z_threshold, double cusum_h) {
    options_.z_threshold = z_threshold;
    options_.cusum_h = cusum_h;
  }

  SeriesState state() const { return core_.state; }
  // The counts in force at the series' measured sampling interval.
  const SampleCounts& counts() const { return counts_; }
  // The last assessment that was scored or recorded (default before any).
  const ChangeAssessment& last() const { return last_; }
  const ChangeDetectorOptions& options() const { return options_; }

  // Checkpointing (the alert engine's SaveState): everything Update depends
  // on, i.e. the current state, the state before the latest step (to re-score
  // a worse same-step value) and the last assessment, bit-exact. Restore into
  // a detector built with the same options: it then continues exactly like
  // the saved one. On truncated or corrupt input, or state that does not fit
  // the options (a history longer than window + gap ...), RestoreState
  // returns false and leaves the detector as newly constructed.
  // Format, version 2: U8 version, core, core before the latest step, last
  // assessment (see change_detector.cc). Version 1 (no history steps) is
  // still read.
  void SaveState(codec::StateWriter& writer) const;
  bool RestoreState(codec::StateReader& reader);

 private:
  struct Baseline {
    double level = 0;  // median, extrapolated along the clamped trend
    double scale = 0;  // 1.4826 * MAD of the (detrended) window
  };
  struct Flag {
    int64_t step;
    bool anomalous;
  };
  // Everything that changes per sample, copied before each new step so that a
  // worse same-step value can be re-scored from the state before that step.
  struct Core {
    std::vector<double> history;  // oldest first, at most window + gap
    // The step of each history value (Rewind); INT64_MIN where unknown (a
    // state saved by version 1).
    std::vector<int64_t> history_steps;
    std::vector<Flag> flags;      // persistence window, oldest first, at most persist_n
    int64_t samples_seen = 0;
    int64_t last_step = std::numeric_limits<int64_t>::min();
    double cusum = 0;
    int consecutive_normal = 0;
    SeriesState state = SeriesState::kNormal;
    int64_t onset_step = -1;
  };

  ChangeAssessment Score(int64_t step, double value);
  // The baseline from the history; nullopt until it is ready. Because nothing
  // enters the history while kAnomalous, this is frozen during an episode.
  std::optional<Baseline> ComputeBaseline() const;
  // Median/MAD (with the clamped trend) of history[begin, end), extrapolated
  // to the sample after the history.
  Baseline FitWindow(size_t begin, size_t end) const;
  // The median step distance between the series' recent samples (and `step`,
  // the one being scored, unless the history is frozen); 0 when unknown.
  double MeasuredInterval(int64_t step) const;
  // Whether `value` at `step` is past the absolute guard, growth included.
  bool PastBound(int64_t step, double value, double x) const;

  ChangeDetectorOptions options_;
  SampleCounts counts_;  // options_' counts at the measured interval
  double sign_;  // +1 rise, -1 drop
  Core core_;
  Core before_last_step_;  // core_ as it was before the latest step was scored
  ChangeAssessment last_;
  mutable std::vector<double> scratch_, residuals_;  // reused by the medians
};

}  // namespace foreshock::alerts
