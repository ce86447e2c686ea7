// MoE router detector: how sharply, evenly and stably the router chooses
// experts on the fixed probe batch (docs/DESIGN.md §1.2). A too-high
// learning rate shows as rising logit norms and z-loss, falling entropy,
// flip-rate spikes or freezes and dead experts.
#include <algorithm>
#include <array>
#include <deque>
#include <limits>
#include <map>
#include <tuple>

#include "detectors/detector.h"
#include "detectors/dtype.h"
#include "detectors/router_detector.h"
#include "detectors/router_stats.h"

namespace foreshock::detectors {
namespace {

constexpr std::array<SignalSpec, 15> kRouterSignals = {{
    {"router_entropy", "Routing entropy H(p_t)/log E, mean over probe tokens (1 = uniform).",
     SignalScope::kLayer},
    {"router_low_entropy_fraction",
     "Fraction of probe tokens whose normalized routing entropy is below the floor.",
     SignalScope::kLayer},
    {"router_load_cv", "Coefficient of variation of expert load over the top-k assignments.",
     SignalScope::kLayer},
    {"router_load_cv_noise_floor",
     "CV that uniform random routing would show on this probe, sqrt((E-k)/(k*T)).",
     SignalScope::kLayer},
    {"router_max_violation", "MaxVio: (max load - mean load) / mean load.", SignalScope::kLayer},
    {"router_load_entropy", "Entropy of the expert load distribution, normalized by log E.",
     SignalScope::kLayer},
    {"router_dead_experts",
     "Experts whose mean load over the dead-expert window is below 0.1/E.", SignalScope::kLayer},
    {"router_experts_died",
     "Dead experts (windowed load below 0.1/E) whose windowed load once reached 0.5/E: experts "
     "that died during training, not those dead from initialization.",
     SignalScope::kLayer},
    {"router_overloaded_experts", "Experts whose load exceeds capacity_factor/E.",
     SignalScope::kLayer},
    {"router_topk_margin", "Mean over tokens of the logit margin z_(k) - z_(k+1).",
     SignalScope::kLayer},
    {"router_topk_margin_p10", "10th percentile over tokens of the margin z_(k) - z_(k+1).",
     SignalScope::kLayer},
    {"router_z_loss", "Router z-loss: mean over tokens of logsumexp(z)^2.", SignalScope::kLayer},
    {"router_max_abs_logit", "Largest absolute router logit on the probe.", SignalScope::kLayer},
    {"router_flip_rate",
     "Fraction of probe tokens whose top-k expert set changed since the previous sample.",
     SignalScope::kLayer},
    {"router_js_divergence",
     "Mean Jensen-Shannon divergence (nats) of the routing distributions between samples.",
     SignalScope::kLayer},
}};

class RouterDetector final : public Detector {
 public:
  static constexpr std::string_view kName = "router";
  static constexpr SampleKind kKind = SampleKind::kRouter;
  static std::span<const SignalSpec> Signals() { return kRouterSignals; }

  static std::optional<RetainedFootprint> RetainedBy(const Sample& sample,
                                                     const DetectorOptions& options);
  explicit RouterDetector(const DetectorOptions& options)
      : options_(options.Get<RouterDetectorOptions>()) {}

  void Process(const Sample& sample, Emitter& emitter) override {
    const auto& router = std::get<RouterSample>(sample.payload);
    if (const int64_t bad = CountNonFinite(router.logits); bad > 0) {
      emitter.NonFinite(SampleKind::kRouter, bad);
      return;
    }
    const int tokens = static_cast<int>(router.logits.shape[0]);
    const int experts = static_cast<int>(router.logits.shape[1]);
    DecodeTensor(router.logits, logits_);

    State& state = states_[Key{sample.run, router.layer, router.probe_id}];
    const bool comparable = state.previous.tokens == tokens &&
                            state.previous.experts == experts &&
                            state.previous.top_k == router.top_k;
    if (!comparable) state = State{};

    RouterOptions options{router.top_k, options_.entropy_floor, options_.capacity_factor};
    RouterDecisions current;
    const RouterStats stats = ComputeRouterStats(logits_, tokens, experts, options, current);
    state.loads.push_back(stats.load);
    state.load_steps.push_back(sample.step);
    TrimDeadWindow(state);

    const int layer = router.layer;
    auto emit = [&](std::string_view signal, double value) {
      emitter.Emit(Observation{signal, layer, kAllHeads, value});
    };
    emit("router_entropy", stats.entropy_mean);
    emit("router_low_entropy_fraction", stats.low_entropy_fraction);
    emit("router_load_cv", stats.load_cv);
    emit("router_load_cv_noise_floor", stats.cv_noise_floor);
    emit("router_max_violation", stats.max_violation);
    emit("router_load_entropy", stats.load_entropy);
    emit("router_dead_experts", CountDeadExperts(state.loads));
    const std::vector<double> mean_loads = MeanLoads(state.loads);
    if (state.peak.size() != mean_loads.size()) state.peak.assign(mean_loads.size(), 0.0);
    for (size_t e = 0; e < mean_loads.size(); ++e) {
      state.peak[e] = std::max(state.peak[e], mean_loads[e]);
    }
    emit("router_experts_died", CountDiedExperts(mean_loads, state.peak));
    emit("router_overloaded_experts", stats.overloaded_experts);
    emit("router_topk_margin", stats.topk_margin_mean);
    emit("router_topk_margin_p10", stats.topk_margin_p10);
    emit("router_z_loss", stats.z_loss);
    emit("router_max_abs_logit", stats.max_abs_logit);
    if (comparable) {
      emit("router_flip_rate", FlipRate(state.previous, current));
      emit("router_js_divergence", MeanJensenShannon(state.previous, current));
    }
    state.previous = std::move(current);
  }

  void ForgetRun(const std::string& run) override {
    std::erase_if(states_, [&](const auto& entry) { return std::get<0>(entry.first) == run; });
  }

  // State, version 3: U64 series count, then per series (in key order):
  //   run, I32 layer, probe_id, the previous decisions (I32 tokens, experts,
  //   top_k, Vector<i32> topk, Vector<float> probs, Vector<double> entropy),
  //   U64 window length, per sample Vector<double> expert load (oldest first),
  //   Vector<double> peak windowed load per expert (version 2; version 1
  //   checkpoints start it from the saved window's mean), Vector<i64> the
  //   window's sample steps (version 3; older checkpoints' samples have no
  //   step and leave the window as new samples come, down to its minimum).
  // The previous decisions' fields, listed once for SaveState and ReadStates.
  template <typename Io, typename D>
  static bool DecisionFields(Io& io, D& d) {
    return io(d.tokens) && io(d.experts) && io(d.top_k) && io(d.topk) && io(d.probs) &&
           io(d.entropy);
  }

  void SaveState(codec::StateWriter& writer) const override {
    writer.PutU32(kStateVersion);
    writer.PutU64(states_.size());
    for (const auto& [key, state] : states_) {
      const auto& [run, layer, probe_id] = key;
      writer.PutString(run);
      writer.PutI32(layer);
      writer.PutString(probe_id);
      codec::FieldWriter io(writer);
      DecisionFields(io, state.previous);
      writer.PutU64(state.loads.size());
      for (const std::vector<double>& load : state.loads) writer.PutVector(load);
      writer.PutVector(state.peak);
      writer.PutVector(std::vector<int64_t>(state.load_steps.begin(), state.load_steps.end()));
    }
  }

  void VisitRetained(const RetainedVisitor& visit) const override {
    for (const auto& [key, state] : states_) {
      const auto& [run, layer, probe_id] = key;
      const RouterDecisions& d = state.previous;
      visit(run, kKind, layer, probe_id, -1,
            RouterRetainedBytes(d.tokens, d.experts, d.top_k, MaxWindowSamples()));
    }
  }

  bool RestoreState(codec::StateReader& reader, const SeriesFilter& keep) override {
    std::map<Key, State> restored;
    if (!ReadStates(reader, keep, restored)) {
      states_.clear();
      return false;
    }
    for (auto& [key, state] : restored) states_.insert_or_assign(key, std::move(state));
    return true;
  }

 private:
  using Key = std::tuple<std::string, int, std::string>;  // run, layer, probe_id
  struct State {
    RouterDecisions previous;
    std::deque<std::vector<double>> loads;  // the dead-expert window
    std::deque<int64_t> load_steps;         // the step of each, kNoStep if unknown
    std::vector<double> peak;  // highest windowed mean load per expert so far
  };
  static constexpr uint32_t kStateVersion = 3;
  static constexpr int64_t kNoStep = std::numeric_limits<int64_t>::min();

  int MinWindowSamples() const { return std::max(1, options_.dead_window); }
  int MaxWindowSamples() const {
    return std::max(MinWindowSamples(), options_.dead_window_max);
  }

  // Drops the oldest sample while the rest still span the window's steps
  // (and hold its minimum samples), or while the window is over its maximum.
  void TrimDeadWindow(State& state) const {
    const size_t min_samples = static_cast<size_t>(MinWindowSamples());
    const size_t max_samples = static_cast<size_t>(MaxWindowSamples());
    while (state.loads.size() > max_samples ||
           (state.loads.size() > min_samples &&
            (state.load_steps[1] == kNoStep ||
             state.load_steps.back() - state.load_steps[1] >=
                 options_.dead_window_steps))) {
      state.loads.pop_front();
      state.load_steps.pop_front();
    }
  }

  bool ReadStates(codec::StateReader& reader, const SeriesFilter& keep,
                  std::map<Key, State>& restored) const {
    uint32_t version = 0;
    uint64_t count = 0;
    if (!reader.GetVersion("router", 1, kStateVersion, version) ||
        !reader.GetCount(count)) {
      return false;
    }
    for (uint64_t i = 0; i < count; ++i) {
      std::string run, probe_id;
      int32_t layer = 0;
      State state;
      RouterDecisions& d = state.previous;
      uint64_t loads = 0;
      codec::FieldReader io(reader);
      if (!reader.GetString(run) || !reader.GetI32(layer) || !reader.GetString(probe_id) ||
          !DecisionFields(io, d) || !reader.GetCount(loads, 8)) {
        return false;
      }
      if (d.tokens < 0 || d.experts < 0 || d.top_k < 0 ||
          d.topk.size() != static_cast<uint64_t>(d.tokens) * static_cast<uint64_t>(d.top_k) ||
          d.probs.size() != static_cast<uint64_t>(d.tokens) * static_cast<uint64_t>(d.experts) ||
          d.entropy.size() != static_cast<uint64_t>(d.tokens)) {
        return reader.Fail("router decisions do not match their shape");
      }
      for (int32_t expert : d.topk) {
        if (expert < 0 || expert >= d.experts) return reader.Fail("top-k expert out of range");
      }
      for (uint64_t j = 0; j < loads; ++j) {
        std::vector<double> load;
        if (!reader.GetVector(load)) return false;
        if (load.size() != static_cast<uint64_t>(d.experts)) {
          return reader.Fail("expert load does not match the expert count");
        }
        state.loads.push_back(std::move(load));
      }
      if (version >= 2) {
        if (!reader.GetVector(state.peak)) return false;
        if (!state.peak.empty() && state.peak.size() != static_cast<uint64_t>(d.experts)) {
          return reader.Fail("peak expert load does not match the expert count");
        }
      } else {
        state.peak = MeanLoads(state.loads);
      }
      if (version >= 3) {
        std::vector<int64_t> steps;
        if (!reader.GetVector(steps)) return false;
        if (steps.size() != state.loads.size()) {
          return reader.Fail("dead-expert window steps do not match its samples");
        }
        state.load_steps.assign(steps.begin(), steps.end());
      } else {
        state.load_steps.assign(state.loads.size(), kNoStep);
      }
      // A smaller dead-expert window than when saved keeps the newest loads.
      while (state.loads.size() > static_cast<size_t>(MaxWindowSamples())) {
        state.loads.pop_front();
        state.load_steps.pop_front();
      }
      Key key{std::move(run), layer, std::move(probe_id)};
      if (keep && !keep(std::get<0>(key), layer)) continue;
      if (!restored.emplace(std::move(key), std::move(state)).second) {
        return reader.Fail("series saved twice");
      }
    }
    return true;
  }

  const RouterDetectorOptions options_;
  std::map<Key, State> states_;
  std::vector<float> logits_;  // decode buffer, reused
};


// What a router sample leaves: its decisions and the dead-expert window at
// its largest (RouterDetectorOptions::dead_window_max).
std::optional<RetainedFootprint> RouterDetector::RetainedBy(const Sample& sample,
                                                            const DetectorOptions& options) {
  const auto* router = std::get_if<RouterSample>(&sample.payload);
  if (router == nullptr) return std::nullopt;
  const auto& shape = router->logits.shape;
  if (shape.size() != 2) return std::nullopt;
  const auto& router_options = options.Get<RouterDetectorOptions>();
  return RetainedFootprint{
      SampleKind::kRouter, router->layer, router->probe_id, true,
      {{-1, RouterRetainedBytes(shape[0], shape[1], router->top_k,
                               std::max(router_options.dead_window,
                                        router_options.dead_window_max))}}};
}

}  // namespace

// The router detector's retained state per series (retained_state.h).
int64_t RouterRetainedBytes(int64_t tokens, int64_t experts, int64_t top_k,
                            int dead_window_samples) {
  const int64_t window = std::max(1, dead_window_samples);
  return tokens * top_k * static_cast<int64_t>(sizeof(int32_t)) +
         tokens * experts * static_cast<int64_t>(sizeof(float)) +
         tokens * static_cast<int64_t>(sizeof(double)) +
         (window + 1) * experts * static_cast<int64_t>(sizeof(double)) +
         window * static_cast<int64_t>(sizeof(int64_t)) + kRetainedOverheadBytes;
}

FORESHOCK_REGISTER_DETECTOR(RouterDetector);

}  // namespace foreshock::detectors
