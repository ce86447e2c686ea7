// Router detector throughput: one probe's logits [T, E] with top-k routing,
// through the registered detector (decode, non-finite scan, statistics, flip
// rate and JS divergence against the previous sample). Target: >= 200 samples
// per second per core at T = 4096, E = 64, k = 2. See docs/PERFORMANCE.md.
#include <benchmark/benchmark.h>

#include <cstring>
#include <random>

#include "detectors/detector.h"
#include "tests/detectors/sample_builders.h"

namespace foreshock::detectors {
namespace {

class NullEmitter final : public Emitter {
 public:
  void Emit(const Observation& o) override { benchmark::DoNotOptimize(o.value); }
  void NonFinite(SampleKind, int64_t) override {}
};

Sample RandomRouterSample(int tokens, int experts, int top_k, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 2.f);
  std::vector<float> logits(static_cast<size_t>(tokens) * experts);
  for (float& z : logits) z = normal(rng);
  return testing::RouterSampleOf(logits, tokens, experts, top_k, 0, "bench");
}

void BM_RouterDetector(benchmark::State& state) {
  const int tokens = static_cast<int>(state.range(0));
  const int experts = static_cast<int>(state.range(1));
  const int top_k = static_cast<int>(state.range(2));
  std::unique_ptr<Detector> detector;
  for (const auto& info : DetectorRegistry::Instance().detectors()) {
    if (info.name == "router") detector = info.create(DetectorOptions{});
  }
  // Two alternating probes, so every call computes flip rate and JS divergence.
  const Sample samples[2] = {RandomRouterSample(tokens, experts, top_k, 1),
                             RandomRouterSample(tokens, experts, top_k, 2)};
  NullEmitter emitter;
  int i = 0;
  for (auto _ : state) detector->Process(samples[i++ & 1], emitter);
  state.SetItemsProcessed(state.iterations());
}

void RouterArgs(benchmark::internal::Benchmark* b) {
  for (int tokens : {512, 4096})
    for (int experts : {8, 64, 256})
      for (int top_k : {1, 2, 8})
        if (top_k < experts) b->Args({tokens, experts, top_k});
}
BENCHMARK(BM_RouterDetector)->Apply(RouterArgs)->ArgNames({"T", "E", "k"})->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace foreshock::detectors

BENCHMARK_MAIN();
