// QK detector microbenchmarks: factored increment spectrum vs the dense
// reference, the attention statistics, one full head-sample, and the choice
// of SVD for the small core. Run single-threaded; see docs/PERFORMANCE.md.
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <Eigen/SVD>
#include <benchmark/benchmark.h>

#include "detectors/attention_stats.h"
#include "detectors/detector.h"
#include "detectors/qk_linalg.h"
#include "detectors/qk_spectrum.h"

namespace foreshock::detectors {
namespace {

using MatrixF = RowMajorMatrix<float>;

MatrixF Gaussian(int n, int d, double scale, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, static_cast<float>(scale));
  MatrixF m(n, d);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < d; ++j) m(i, j) = normal(rng);
  return m;
}

// Previous and current Q, K of one head; the step moves them by ~1%.
struct HeadPair {
  MatrixF q_prev, k_prev, q, k;
  HeadPair(int n, int d) {
    std::mt19937 rng(1234);
    q_prev = Gaussian(n, d, 1.0, rng);
    k_prev = Gaussian(n, d, 1.0, rng);
    q = q_prev + Gaussian(n, d, 0.01, rng);
    k = k_prev + Gaussian(n, d, 0.01, rng);
  }
};

void SetShapeCounters(benchmark::State& state, int n, int d) {
  state.counters["n"] = n;
  state.counters["d"] = d;
}

// The factored spectrum as the detector calls it (float: the Gram route when
// n >= 2d; double: the Householder route).
template <typename Scalar>
void BM_QKFactored(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0)), d = static_cast<int>(state.range(1));
  const bool top_vector = state.range(2) != 0;
  const HeadPair in(n, d);
  const RowMajorMatrix<Scalar> qp = in.q_prev.cast<Scalar>(), kp = in.k_prev.cast<Scalar>();
  const RowMajorMatrix<Scalar> q = in.q.cast<Scalar>(), k = in.k.cast<Scalar>();
  for (auto _ : state) {
    QKIncrementSpectrum s = ComputeQKIncrementSpectrum<Scalar>(qp, kp, q, k, {top_vector});
    benchmark::DoNotOptimize(s.normalized_entropy);
  }
  SetShapeCounters(state, n, d);
  state.SetItemsProcessed(state.iterations());
}

// The Householder route in float, the detector's route before the Gram one:
// run beside BM_QKFactored<float> for a before/after ratio from one run.
void BM_QKHouseholder(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0)), d = static_cast<int>(state.range(1));
  const bool top_vector = state.range(2) != 0;
  const HeadPair in(n, d);
  for (auto _ : state) {
    QKIncrementSpectrum s =
        ComputeQKIncrementSpectrumHouseholder<float>(in.q_prev, in.k_prev, in.q, in.k, {top_vector});
    benchmark::DoNotOptimize(s.normalized_entropy);
  }
  SetShapeCounters(state, n, d);
  state.SetItemsProcessed(state.iterations());
}

// The dense reference: forms dS1 (n x n) in double and takes its SVD. The
// float -> double conversion of the fp32 inputs is inside the timed loop.
void BM_QKDense(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0)), d = static_cast<int>(state.range(1));
  const HeadPair in(n, d);
  for (auto _ : state) {
    QKIncrementSpectrum s = ComputeQKIncrementSpectrumDense(
        in.q_prev.cast<double>(), in.k_prev.cast<double>(), in.q.cast<double>(), in.k.cast<double>());
    benchmark::DoNotOptimize(s.normalized_entropy);
  }
  SetShapeCounters(state, n, d);
  state.SetItemsProcessed(state.iterations());
}

void FactoredArgs(benchmark::internal::Benchmark* b) {
  for (int n : {128, 256, 512, 1024})
    for (int d : {32, 64, 128})
      for (int top : {0, 1}) b->Args({n, d, top});
}

void DenseArgs(benchmark::internal::Benchmark* b) {
  for (int n : {128, 256, 512})
    for (int d : {32, 64, 128}) b->Args({n, d});
}

// n = 1024 dense takes seconds per call: a couple of iterations are enough.
void DenseLargeArgs(benchmark::internal::Benchmark* b) {
  for (int d : {32, 64, 128}) b->Args({1024, d});
}

BENCHMARK(BM_QKFactored<float>)->Apply(FactoredArgs)->ArgNames({"n", "d", "top"})->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_QKFactored<double>)->Apply(FactoredArgs)->ArgNames({"n", "d", "top"})->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_QKHouseholder)->Apply(FactoredArgs)->ArgNames({"n", "d", "top"})->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_QKDense)->Apply(DenseArgs)->ArgNames({"n", "d"})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_QKDense)->Apply(DenseLargeArgs)->ArgNames({"n", "d"})->Iterations(2)->Unit(benchmark::kMillisecond);

void BM_AttentionStats(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0)), d = static_cast<int>(state.range(1));
  const AttentionMask mask{state.range(2) != 0, 0};
  const HeadPair in(n, d);
  for (auto _ : state) {
    AttentionStats s = ComputeAttentionStats<float>(in.q, in.k, mask);
    benchmark::DoNotOptimize(s.mean_entropy);
  }
  SetShapeCounters(state, n, d);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_AttentionStats)
    ->ArgsProduct({{256, 1024}, {64}, {0, 1}})
    ->ArgNames({"n", "d", "causal"})
    ->Unit(benchmark::kMicrosecond);

// Everything the detector computes for one head of one sample (fp32, causal):
// the increment spectrum with its top vector, and the attention statistics.
void BM_FullHeadSample(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0)), d = static_cast<int>(state.range(1));
  const HeadPair in(n, d);
  for (auto _ : state) {
    QKIncrementSpectrum s = ComputeQKIncrementSpectrum<float>(in.q_prev, in.k_prev, in.q, in.k, {true});
    AttentionStats a = ComputeAttentionStats<float>(in.q, in.k, {true, 0});
    benchmark::DoNotOptimize(s.normalized_entropy);
    benchmark::DoNotOptimize(a.mean_entropy);
  }
  SetShapeCounters(state, n, d);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_FullHeadSample)->Args({256, 64})->ArgNames({"n", "d"})->Unit(benchmark::kMicrosecond);

// The same head-sample on the previous kernels (Householder route, attention
// statistics before the rewrite): the "before" of the ratio, same run.
void BM_FullHeadSampleBefore(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0)), d = static_cast<int>(state.range(1));
  const HeadPair in(n, d);
  for (auto _ : state) {
    QKIncrementSpectrum s =
        ComputeQKIncrementSpectrumHouseholder<float>(in.q_prev, in.k_prev, in.q, in.k, {true});
    AttentionStats a = ComputeAttentionStats<float>(in.q, in.k, {true, 0});
    benchmark::DoNotOptimize(s.normalized_entropy);
    benchmark::DoNotOptimize(a.mean_entropy);
  }
  SetShapeCounters(state, n, d);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_FullHeadSampleBefore)->Args({256, 64})->ArgNames({"n", "d"})->Unit(benchmark::kMicrosecond);

// The whole detector on one bf16 sample of [heads, n, d], through the
// registry as the daemon calls it (decode, non-finite scan, all heads).
// Items are head-samples.
class NullEmitter : public Emitter {
 public:
  void Emit(const Observation& o) override { benchmark::DoNotOptimize(o.value); }
  void NonFinite(SampleKind, int64_t) override {}
};

RawTensor ToBFloat16(const std::vector<MatrixF>& heads) {
  RawTensor t;
  t.dtype = DType::kBFloat16;
  t.shape = {static_cast<int64_t>(heads.size()), heads[0].rows(), heads[0].cols()};
  for (const MatrixF& m : heads)
    for (int i = 0; i < m.rows(); ++i)
      for (int j = 0; j < m.cols(); ++j) {
        uint32_t bits;
        const float v = m(i, j);
        std::memcpy(&bits, &v, 4);
        t.data.push_back(static_cast<char>((bits >> 16) & 0xFF));  // truncation to bf16
        t.data.push_back(static_cast<char>(bits >> 24));
      }
  return t;
}

// A whole sample through the QK detector: `heads` query heads over `kv` K
// heads (grouped-query attention when kv < heads, K sent once per group).
void BM_QKDetectorProcess(benchmark::State& state) {
  const int heads = static_cast<int>(state.range(0));
  const int n = static_cast<int>(state.range(1)), d = static_cast<int>(state.range(2));
  const int kv = static_cast<int>(state.range(3));
  std::unique_ptr<Detector> detector;
  for (const DetectorInfo& info : DetectorRegistry::Instance().detectors())
    if (info.name == "qk") detector = info.create(DetectorOptions{});
  std::mt19937 rng(99);
  // Two alternating samples, so every call computes an increment.
  Sample samples[2];
  std::vector<MatrixF> q, k;
  for (int h = 0; h < heads; ++h) q.push_back(Gaussian(n, d, 1.0, rng));
  for (int h = 0; h < kv; ++h) k.push_back(Gaussian(n, d, 1.0, rng));
  for (int s = 0; s < 2; ++s) {
    QKSample qk;
    qk.layer = 0;
    qk.probe_id = "probe";
    qk.causal = true;
    for (int h = 0; h < heads; ++h) q[h] += Gaussian(n, d, 0.01, rng);
    for (int h = 0; h < kv; ++h) k[h] += Gaussian(n, d, 0.01, rng);
    qk.q = ToBFloat16(q);
    qk.k = ToBFloat16(k);
    if (kv < heads)
      for (int h = 0; h < heads; ++h) qk.kv_head_of.push_back(h * kv / heads);
    samples[s].run = "run";
    samples[s].payload = std::move(qk);
  }
  NullEmitter emitter;
  detector->Process(samples[1], emitter);
  size_t i = 0;
  for (auto _ : state) detector->Process(samples[i++ % 2], emitter);
  state.counters["heads"] = heads;
  SetShapeCounters(state, n, d);
  state.SetItemsProcessed(state.iterations() * heads);
}
// The second: one probe layer of the 70B shape's default sampling (8 query
// heads of one K head, 256 tokens, head_dim 128; probe_70b.py's "default").
BENCHMARK(BM_QKDetectorProcess)
    ->Args({8, 256, 64, 8})
    ->Args({8, 256, 128, 1})
    ->ArgNames({"heads", "n", "d", "kv"})
    ->Unit(benchmark::kMillisecond);

// The Gram route's n x 2d Gram: our kernel (GramLowerTriangle) against
// Eigen's SYRK (rankUpdate), which it replaced.
void BM_Gram(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0)), m = static_cast<int>(state.range(1));
  const bool eigen = state.range(2) != 0;
  std::mt19937 rng(3);
  const RowMajorMatrix<double> x = Gaussian(n, m, 1.0, rng).cast<double>();
  Eigen::MatrixXd gram(m, m);
  for (auto _ : state) {
    if (eigen) {
      gram.setZero();
      gram.selfadjointView<Eigen::Lower>().rankUpdate(x.transpose());
    } else {
      GramLowerTriangle(x.data(), n, m, m, gram.data(), m);
    }
    benchmark::DoNotOptimize(gram.data());
  }
}
BENCHMARK(BM_Gram)->ArgsProduct({{256, 512}, {128}, {0, 1}})->ArgNames({"n", "m", "eigen"})->Unit(benchmark::kMicrosecond);

// Which SVD for the core (size 2d when n >= 2d): ours (bidiagonalization +
// Golub-Reinsch values + inverse iteration, ComputeSmallSvd), Eigen's BDCSVD
// or JacobiSVD; with and without the (top) left singular vector.
void BM_CoreSvdSmallSvd(benchmark::State& state) {
  const int size = static_cast<int>(state.range(0));
  std::mt19937 rng(5);
  const Eigen::MatrixXf core = Gaussian(size, size, 1.0, rng);
  for (auto _ : state) {
    SmallSvd svd = ComputeSmallSvd<float>(core, state.range(1) != 0);
    benchmark::DoNotOptimize(svd.singular_values.data());
  }
}
BENCHMARK(BM_CoreSvdSmallSvd)->ArgsProduct({{64, 128, 256}, {0, 1}})->ArgNames({"size", "u"})->Unit(benchmark::kMicrosecond);

template <template <typename> class Svd>
void BM_CoreSvd(benchmark::State& state) {
  const int size = static_cast<int>(state.range(0));
  const bool with_u = state.range(1) != 0;
  std::mt19937 rng(5);
  const Eigen::MatrixXf core = Gaussian(size, size, 1.0, rng);
  for (auto _ : state) {
    Svd<Eigen::MatrixXf> svd(core, with_u ? Eigen::ComputeThinU : 0);
    benchmark::DoNotOptimize(svd.singularValues().data());
  }
}
template <typename M>
using Bdc = Eigen::BDCSVD<M>;
template <typename M>
using Jacobi = Eigen::JacobiSVD<M>;
BENCHMARK(BM_CoreSvd<Bdc>)->ArgsProduct({{64, 128, 256}, {0, 1}})->ArgNames({"size", "u"})->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CoreSvd<Jacobi>)->ArgsProduct({{64, 128, 256}, {0, 1}})->ArgNames({"size", "u"})->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace foreshock::detectors

BENCHMARK_MAIN();
