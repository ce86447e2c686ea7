// The alarms users have today, computed from the step scalars so that the
// mechanism detectors can be measured against them (docs/DESIGN.md §1.4, §6.4):
//  - OLMo-style spike: loss or grad norm above mean + 6 sigma of the trailing
//    128-step window (evaluated once the window is full);
//  - Megatron-style spiky loss: loss above 10x the running maximum;
//  - non-finite loss or grad norm.
// Each is exported as a 0/1 indicator per step. Several ranks' scalars reach
// it merged, once per step (server/pipeline/rank_scalars.h); a step at or
// below the last one seen (a resumed run) is skipped.
#include <array>
#include <cmath>
#include <deque>
#include <limits>
#include <map>

#include "detectors/detector.h"
#include "detectors/scalar_baselines_detector.h"
#include "detectors/run_map_state.h"

namespace foreshock::detectors {
namespace {

constexpr std::array<SignalSpec, 5> kBaselineSignals = {{
    {"baseline_olmo_spike",
     "1 when loss or grad norm exceeds mean + 6 sigma of the trailing 128-step window "
     "(OLMo-style spike), else 0.",
     SignalScope::kRun},
    {"baseline_megatron_spiky_loss",
     "1 when loss exceeds 10x its running maximum (Megatron-style spiky loss), else 0.",
     SignalScope::kRun},
    {"baseline_nonfinite", "1 when the reported loss or grad norm is NaN or infinite, else 0.",
     SignalScope::kRun},
    {"loss_zscore", "(loss - window mean) / window std over the trailing spike window.",
     SignalScope::kRun},
    {"grad_norm_zscore",
     "(grad norm - window mean) / window std over the trailing spike window.",
     SignalScope::kRun},
}};

// Trailing window of one scalar with its running sums.
class Window {
 public:
  explicit Window(size_t capacity) : capacity_(capacity) {}
  bool full() const { return values_.size() >= capacity_; }
  // z-score of `x` against the window (0 for a constant window).
  double ZScore(double x) const {
    const double n = static_cast<double>(values_.size());
    const double mean = sum_ / n;
    const double var = std::max(0.0, sum_sq_ / n - mean * mean);
    return var > 0 ? (x - mean) / std::sqrt(var) : 0.0;
  }
  // State: Vector<double> values (oldest first), Double sum, Double sum of
  // squares (saved, not recomputed, so that a restored window gives the same
  // z-scores to the last bit).
  void Save(codec::StateWriter& writer) const {
    writer.PutU64(values_.size());
    for (double v : values_) writer.PutDouble(v);
    writer.PutDouble(sum_);
    writer.PutDouble(sum_sq_);
  }
  bool Restore(codec::StateReader& reader) {
    uint64_t n = 0;
    if (!reader.GetCount(n, 8)) return false;
    values_.clear();
    for (uint64_t i = 0; i < n; ++i) {
      double v = 0;
      if (!reader.GetDouble(v)) return false;
      values_.push_back(v);
    }
    if (!reader.GetDouble(sum_) || !reader.GetDouble(sum_sq_)) return false;
    if (values_.size() > capacity_) {
      // The window is shorter than when saved: keep the newest values.
      while (values_.size() > capacity_) values_.pop_front();
      sum_ = sum_sq_ = 0;
      for (double v : values_) {
        sum_ += v;
        sum_sq_ += v * v;
      }
    }
    return true;
  }

  void Push(double x) {
    values_.push_back(x);
    sum_ += x;
    sum_sq_ += x * x;
    if (values_.size() > capacity_) {
      sum_ -= values_.front();
      sum_sq_ -= values_.front() * values_.front();
      values_.pop_front();
    }
  }

 private:
  size_t capacity_;
  std::deque<double> values_;
  double sum_ = 0, sum_sq_ = 0;
};

class ScalarBaselinesDetector final : public Detector {
 public:
  static constexpr std::string_view kName = "scalar_baselines";
  static constexpr SampleKind kKind = SampleKind::kScalars;
  static std::span<const SignalSpec> Signals() { return kBaselineSignals; }

  explicit ScalarBaselinesDetector(const DetectorOptions& options)
      : options_(options.Get<ScalarBaselinesOptions>()) {}

  void Process(const Sample& sample, Emitter& emitter) override {
    const auto& s = std::get<ScalarsSample>(sample.payload);
    if (!s.has_loss && !s.has_grad_norm) return;
    auto [it, inserted] = runs_.try_emplace(sample.run, options_);
    RunState& state = it->second;
    if (!inserted && sample.step <= state.last_step) return;  // a step seen already
    state.last_step = sample.step;

    auto emit = [&](std::string_view signal, double value) {
      emitter.Emit(Observation{signal, kNoLayer, kAllHeads, value});
    };
    const bool nonfinite = (s.has_loss && !std::isfinite(s.loss)) ||
                           (s.has_grad_norm && !std::isfinite(s.grad_norm));
    emit("baseline_nonfinite", nonfinite ? 1.0 : 0.0);
    if (nonfinite) return;  // keep the windows clean

    bool spike = false;
    const double sigmas = options_.spike_sigmas;
    if (s.has_loss) {
      if (state.loss.full()) {
        const double z = state.loss.ZScore(s.loss);
        emit("loss_zscore", z);
        spike |= z > sigmas;
      }
      const bool spiky = state.max_loss > -std::numeric_limits<double>::infinity() &&
                         s.loss > options_.spiky_loss_factor * state.max_loss;
      emit("baseline_megatron_spiky_loss", spiky ? 1.0 : 0.0);
      state.loss.Push(s.loss);
      state.max_loss = std::max(state.max_loss, s.loss);
    }
    if (s.has_grad_norm) {
      if (state.grad_norm.full()) {
        const double z = state.grad_norm.ZScore(s.grad_norm);
        emit("grad_norm_zscore", z);
        spike |= z > sigmas;
      }
      state.grad_norm.Push(s.grad_norm);
    }
    emit("baseline_olmo_spike", spike ? 1.0 : 0.0);
  }

  void ForgetRun(const std::string& run) override { runs_.erase(run); }

  // State, version 1: U64 run count, then per run (by name): run, I64 last
  // step, Double max loss, the loss window, the grad-norm window.
  void SaveState(codec::StateWriter& writer) const override {
    SaveRunMap(writer, kStateVersion, runs_, [](codec::StateWriter& w, const RunState& state) {
      w.PutI64(state.last_step);
      w.PutDouble(state.max_loss);
      state.loss.Save(w);
      state.grad_norm.Save(w);
    });
  }

  bool RestoreState(codec::StateReader& reader, const SeriesFilter& keep) override {
    return RestoreRunMap(
        reader, "scalar_baselines", kStateVersion, keep, runs_,
        [this] { return RunState(options_); },
        [](codec::StateReader& r, RunState& state) {
          return r.GetI64(state.last_step) && r.GetDouble(state.max_loss) &&
                 state.loss.Restore(r) && state.grad_norm.Restore(r);
        });
  }

 private:
  static constexpr uint32_t kStateVersion = 1;
  struct RunState {
    explicit RunState(const ScalarBaselinesOptions& options)
        : loss(static_cast<size_t>(std::max(2, options.spike_window))),
          grad_norm(static_cast<size_t>(std::max(2, options.spike_window))) {}
    int64_t last_step = -1;
    Window loss, grad_norm;
    double max_loss = -std::numeric_limits<double>::infinity();
  };
  const ScalarBaselinesOptions options_;
  std::map<std::string, RunState> runs_;
};

}  // namespace

FORESHOCK_REGISTER_DETECTOR(ScalarBaselinesDetector);

}  // namespace foreshock::detectors
