// The evaluation's loss divergence rule as a signal (docs/DESIGN.md §6.3,
// demo/train.py divergence_step): the 20-step mean of the training loss over
// its running minimum since warm-up,
//
//   loss_over_running_min = mean(loss[t-19..t]) / min over warm-up <= s <= t of mean(loss[s-19..s])
//
// A run has diverged once it exceeds 1.3 (ForeshockLossDiverging's bound).
// Counted in loss samples (the trainer reports one per step): the value
// starts at the 101st sample (warm-up kWarmupSamples = 100, the demo's and
// the evaluation corpus's LR warm-up), so the running minimum ignores the
// fast early fall of a fresh model; it is not emitted while the minimum is
// not positive (a loss that can go negative has no meaningful ratio).
// Non-finite losses are ForeshockNonFinite's (detectors/scalars_detector.cc)
// and do not enter the mean. Several ranks' scalars reach it merged, once
// per step; a step at or below the last one seen (a resumed run) is skipped.
#include <algorithm>
#include <array>
#include <cmath>
#include <deque>
#include <limits>
#include <map>

#include "detectors/detector.h"
#include "detectors/run_map_state.h"

namespace foreshock::detectors {
namespace {

constexpr std::array<SignalSpec, 1> kLossDivergenceSignals = {{
    {"loss_over_running_min",
     "20-step mean loss over its running minimum since warm-up (the first 100 loss samples); "
     "above 1.3 the run has diverged (the evaluation's rule).",
     SignalScope::kRun},
}};

constexpr size_t kMeanSamples = 20;
constexpr int64_t kWarmupSamples = 100;

class LossDivergenceDetector final : public Detector {
 public:
  static constexpr std::string_view kName = "loss_divergence";
  static constexpr SampleKind kKind = SampleKind::kScalars;
  static std::span<const SignalSpec> Signals() { return kLossDivergenceSignals; }

  explicit LossDivergenceDetector(const DetectorOptions&) {}

  void Process(const Sample& sample, Emitter& emitter) override {
    const auto& s = std::get<ScalarsSample>(sample.payload);
    if (!s.has_loss || !std::isfinite(s.loss)) return;
    auto [it, inserted] = runs_.try_emplace(sample.run);
    RunState& run = it->second;
    if (!inserted && sample.step <= run.last_step) return;
    run.last_step = sample.step;
    run.losses.push_back(s.loss);
    if (run.losses.size() > kMeanSamples) run.losses.pop_front();
    const int64_t index = run.samples++;  // 0-based, as the demo's step
    if (run.losses.size() < kMeanSamples || index < kWarmupSamples) return;
    double sum = 0;
    for (double loss : run.losses) sum += loss;
    const double mean = sum / static_cast<double>(kMeanSamples);
    run.running_min = std::min(run.running_min, mean);
    if (!(run.running_min > 0) || !std::isfinite(mean)) return;
    emitter.Emit(Observation{"loss_over_running_min", kNoLayer, kAllHeads, mean / run.running_min});
  }

  void ForgetRun(const std::string& run) override { runs_.erase(run); }

  // State, version 1: U64 run count, then per run (by name): run, I64 last
  // step, I64 samples, Double running minimum, U64 count and Double losses
  // of the mean window (oldest first).
  void SaveState(codec::StateWriter& writer) const override {
    SaveRunMap(writer, kStateVersion, runs_, [](codec::StateWriter& w, const RunState& run) {
      w.PutI64(run.last_step);
      w.PutI64(run.samples);
      w.PutDouble(run.running_min);
      w.PutU64(run.losses.size());
      for (double loss : run.losses) w.PutDouble(loss);
    });
  }

  bool RestoreState(codec::StateReader& reader, const SeriesFilter& keep) override {
    return RestoreRunMap(
        reader, "loss_divergence", kStateVersion, keep, runs_, [] { return RunState(); },
        [](codec::StateReader& r, RunState& run) {
          uint64_t losses = 0;
          if (!r.GetI64(run.last_step) || !r.GetI64(run.samples) ||
              !r.GetDouble(run.running_min) || !r.GetCount(losses, 8)) {
            return false;
          }
          if (losses > kMeanSamples || run.samples < 0) {
            return r.Fail("loss window longer than the mean window");
          }
          for (uint64_t j = 0; j < losses; ++j) {
            double loss = 0;
            if (!r.GetDouble(loss)) return false;
            run.losses.push_back(loss);
          }
          return true;
        });
  }

 private:
  static constexpr uint32_t kStateVersion = 1;
  struct RunState {
    int64_t last_step = -1;
    int64_t samples = 0;
    double running_min = std::numeric_limits<double>::infinity();
    std::deque<double> losses;  // the last kMeanSamples finite losses
  };
  std::map<std::string, RunState, std::less<>> runs_;
};

}  // namespace

FORESHOCK_REGISTER_DETECTOR(LossDivergenceDetector);

}  // namespace foreshock::detectors
