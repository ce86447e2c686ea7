// The learning rate against the highest one the run has trained at
// (docs/DESIGN.md §1.3): lr_over_held_max = lr / reference.
//
// Why: at the edge of stability the sharpness a run can sustain adapts to
// its learning rate (lambda ~ 2/eta for SGD, the preconditioned analogue for
// Adam). An LR far above every LR the run has already trained at steps over
// that edge before the curvature can follow; a misconfigured resume, a
// schedule bug or an LR ramp show here at once, long before the loss moves.
// Schedules are not alarms: warm-up raises the LR step by step, decay and
// warm restarts stay at or below the peak.
//
// The reference, per run (merged scalars, rank_scalars.h):
//  - warm-up: while the LR keeps setting new highs, the reference is the
//    highest LR before this sample, so a linear warm-up reads t/(t-1) and a
//    jump reads its factor;
//  - the warm-up is over once `held_samples` samples (LrScheduleOptions) in a row set no new
//    high (a plateau, a decay); from then on the reference is the highest LR
//    the run has *held*: a new level counts only after it has been held
//    (equal within 1e-6) for `held_samples` samples (LrScheduleOptions). A ramp never holds a
//    level, so it is measured against where it started; a deliberate raise
//    that is kept becomes the new reference, unless it is kSurgeFactor (3,
//    the default bound of ForeshockLearningRateSurge) or more above the
//    reference: such a level is the surge itself, and the run is measured
//    against the LR it held before it for as long as it lasts, so the alert
//    stays firing while the LR stays raised (issue 26: a x30 LR held for 20
//    samples became the reference and the alert resolved while the run
//    diverged).
// Nothing is emitted for the first four samples, nor while the reference is
// not positive (an LR of 0 at the start). Steps at or below the last one seen are skipped (a resumed run is
// forgotten by the pool before its records arrive).
#include <algorithm>
#include <array>
#include <cmath>
#include <map>

#include "detectors/detector.h"
#include "detectors/lr_schedule_detector.h"
#include "detectors/run_map_state.h"

namespace foreshock::detectors {
namespace {

constexpr std::array<SignalSpec, 1> kLrSignals = {{
    {"lr_over_held_max",
     "Learning rate over the highest learning rate the run has trained at: during warm-up the "
     "highest before this step, after it the highest level held for lr_held_samples steps (a "
     "ramp is measured from where it began).",
     SignalScope::kRun},
}};

constexpr double kHeldTolerance = 1e-6;  // relative: a level is "the same" LR within this
// The first samples of a warm-up reported at a coarse cadence read large
// factors (lr ~ step: 51x from step 0 to 50, 2x to 100): the value starts at
// the fifth sample, where a linear warm-up reads at most 4/3, a quadratic 16/9.
constexpr int64_t kFirstScoredSample = 4;
// A held level this many times the reference or more is never adopted as the
// new reference after warm-up (the surge is measured against the LR the run
// held before it while it lasts).
constexpr double kSurgeFactor = 3.0;

class LrScheduleDetector final : public Detector {
 public:
  static constexpr std::string_view kName = "lr_schedule";
  static constexpr SampleKind kKind = SampleKind::kScalars;
  static std::span<const SignalSpec> Signals() { return kLrSignals; }

  explicit LrScheduleDetector(const DetectorOptions& options)
      : held_samples_(std::max<int64_t>(1, options.Get<LrScheduleOptions>().held_samples)) {}

  void Process(const Sample& sample, Emitter& emitter) override {
    const auto& s = std::get<ScalarsSample>(sample.payload);
    if (!s.has_lr || !std::isfinite(s.lr) || s.lr < 0) return;
    auto [it, inserted] = runs_.try_emplace(sample.run);
    RunState& run = it->second;
    if (!inserted && sample.step <= run.last_step) return;
    run.last_step = sample.step;
    const double lr = s.lr;

    // The reference this sample is measured against (before it updates anything).
    const double reference = run.warmed_up ? run.held_max : run.max;
    if (run.samples >= kFirstScoredSample && reference > 0) {
      emitter.Emit(Observation{"lr_over_held_max", kNoLayer, kAllHeads, lr / reference});
    }
    ++run.samples;

    // Warm-up: every new high raises the reference at once; enough samples
    // without one end it.
    if (lr > run.max) {
      run.max = lr;
      run.since_new_max = 0;
    } else if (++run.since_new_max >= held_samples_ && !run.warmed_up && run.max > 0) {
      run.warmed_up = true;
      run.held_max = run.max;
    }
    // Held levels: the current run of equal values.
    if (run.level_samples > 0 && std::abs(lr - run.level) <= kHeldTolerance * run.level) {
      ++run.level_samples;
    } else {
      run.level = lr;
      run.level_samples = 1;
    }
    if (run.warmed_up && run.level_samples >= held_samples_ &&
        run.level < kSurgeFactor * run.held_max) {
      run.held_max = std::max(run.held_max, run.level);
    }
  }

  void ForgetRun(const std::string& run) override { runs_.erase(run); }

  // State, version 1: U64 run count, then per run (by name): run, I64 last
  // step, I64 samples, Double max, I64 samples since a new max, Bool warmed up,
  // Double held max, Double level, I64 samples at that level.
  void SaveState(codec::StateWriter& writer) const override {
    SaveRunMap(writer, kStateVersion, runs_, [](codec::StateWriter& w, const RunState& run) {
      w.PutI64(run.last_step);
      w.PutI64(run.samples);
      w.PutDouble(run.max);
      w.PutI64(run.since_new_max);
      w.PutBool(run.warmed_up);
      w.PutDouble(run.held_max);
      w.PutDouble(run.level);
      w.PutI64(run.level_samples);
    });
  }

  bool RestoreState(codec::StateReader& reader, const SeriesFilter& keep) override {
    return RestoreRunMap(
        reader, "lr_schedule", kStateVersion, keep, runs_, [] { return RunState(); },
        [](codec::StateReader& r, RunState& run) {
          return r.GetI64(run.last_step) && r.GetI64(run.samples) && r.GetDouble(run.max) &&
                 r.GetI64(run.since_new_max) && r.GetBool(run.warmed_up) &&
                 r.GetDouble(run.held_max) && r.GetDouble(run.level) &&
                 r.GetI64(run.level_samples);
        });
  }

 private:
  static constexpr uint32_t kStateVersion = 1;
  struct RunState {
    int64_t last_step = -1;
    int64_t samples = 0;
    double max = 0;             // highest LR so far
    int64_t since_new_max = 0;  // samples since the last new high
    bool warmed_up = false;
    double held_max = 0;        // highest level held (after warm-up)
    double level = 0;           // the current run of equal values ...
    int64_t level_samples = 0;  // ... and its length
  };

  int64_t held_samples_;
  std::map<std::string, RunState, std::less<>> runs_;
};

}  // namespace

FORESHOCK_REGISTER_DETECTOR(LrScheduleDetector);

}  // namespace foreshock::detectors
