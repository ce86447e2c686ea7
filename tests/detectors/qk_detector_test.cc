// The QK detector through the interface the daemon uses: the registry and an Emitter.
#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "detectors/attention_stats.h"
#include "detectors/detector.h"
#include "detectors/qk_spectrum.h"
#include "codec/state_codec.h"
#include "detectors/qk_detector.h"

namespace foreshock::detectors {
namespace {

using MatrixD = RowMajorMatrix<double>;

struct Recorded {
  std::string signal;
  int layer;
  int head;
  double value;
};

class RecordingEmitter : public Emitter {
 public:
  void Emit(const Observation& o) override { observations.push_back({std::string(o.signal), o.layer, o.head, o.value}); }
  void NonFinite(SampleKind kind, int64_t count) override {
    EXPECT_EQ(kind, SampleKind::kQK);
    non_finite += count;
  }
  // signal -> head -> value; fails the test on a duplicate.
  std::map<std::string, std::map<int, double>> BySignal() const {
    std::map<std::string, std::map<int, double>> result;
    for (const Recorded& r : observations) {
      EXPECT_TRUE(result[r.signal].emplace(r.head, r.value).second) << r.signal << " head " << r.head;
    }
    return result;
  }
  std::vector<Recorded> observations;
  int64_t non_finite = 0;
};

std::unique_ptr<Detector> MakeDetector(std::string_view name, const DetectorOptions& options = {}) {
  for (const DetectorInfo& info : DetectorRegistry::Instance().detectors()) {
    if (info.name == name) return info.create(options);
  }
  ADD_FAILURE() << "detector not registered: " << name;
  return nullptr;
}

// Per-head [tokens, head_dim] values; every value exactly representable in float.
using Heads = std::vector<MatrixD>;

Heads RandomHeads(int heads, int n, int d, std::mt19937& rng, double scale = 1.0) {
  std::normal_distribution<double> normal(0.0, scale);
  Heads result;
  for (int h = 0; h < heads; ++h) {
    MatrixD m(n, d);
    // Heads differ in scale so the per-layer min and max come from different heads.
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < d; ++j) m(i, j) = static_cast<float>(normal(rng) * (1.0 + 0.5 * h));
    result.push_back(m);
  }
  return result;
}

Heads Perturb(const Heads& base, std::mt19937& rng, double scale) {
  std::normal_distribution<double> normal(0.0, scale);
  Heads result = base;
  for (MatrixD& m : result)
    for (int i = 0; i < m.rows(); ++i)
      for (int j = 0; j < m.cols(); ++j) m(i, j) = static_cast<float>(m(i, j) + normal(rng));
  return result;
}

RawTensor ToFloat32Tensor(const Heads& heads) {
  RawTensor t;
  t.dtype = DType::kFloat32;
  t.shape = {static_cast<int64_t>(heads.size()), heads[0].rows(), heads[0].cols()};
  for (const MatrixD& m : heads)
    for (int i = 0; i < m.rows(); ++i)
      for (int j = 0; j < m.cols(); ++j) {
        const uint32_t b = std::bit_cast<uint32_t>(static_cast<float>(m(i, j)));
        for (int shift = 0; shift < 32; shift += 8) t.data.push_back(static_cast<char>((b >> shift) & 0xFF));
      }
  return t;
}

Sample MakeSample(const std::string& run, int layer, const std::string& probe, const Heads& q, const Heads& k,
                  bool causal = true, int seq_len = 0) {
  QKSample qk;
  qk.layer = layer;
  qk.probe_id = probe;
  qk.q = ToFloat32Tensor(q);
  qk.k = ToFloat32Tensor(k);
  qk.causal = causal;
  qk.seq_len = seq_len;
  Sample sample;
  sample.run = run;
  sample.payload = std::move(qk);
  return sample;
}

const std::vector<std::string> kIncrementSignals = {"qk_increment_entropy", "qk_increment_effective_rank",
                                                    "qk_increment_top1_share", "qk_second_order_ratio"};

// Every signal: one value per head plus an aggregate equal to min or max of them.
void ExpectAggregates(const std::map<std::string, std::map<int, double>>& by_signal, int heads) {
  const std::map<std::string, bool> takes_min = {
      {"qk_increment_entropy", true},  {"qk_increment_effective_rank", true}, {"qk_increment_top1_share", false},
      {"qk_second_order_ratio", false}, {"qk_increment_top1_overlap", true},  {"attention_entropy", true},
      {"attention_max_logit", false}};
  for (const auto& [signal, values] : by_signal) {
    if (signal.starts_with("qk_probe_")) continue;  // per layer: what was sampled
    SCOPED_TRACE(signal);
    ASSERT_TRUE(takes_min.count(signal));
    ASSERT_EQ(values.size(), static_cast<size_t>(heads + 1));
    ASSERT_TRUE(values.count(kAllHeads));
    double lo = std::numeric_limits<double>::infinity(), hi = -lo;
    for (int h = 0; h < heads; ++h) {
      ASSERT_TRUE(values.count(h));
      lo = std::min(lo, values.at(h));
      hi = std::max(hi, values.at(h));
    }
    EXPECT_EQ(values.at(kAllHeads), takes_min.at(signal) ? lo : hi);
  }
}

void ExpectRelative(double actual, double expected, double tolerance, const std::string& what) {
  EXPECT_LE(std::abs(actual - expected), tolerance * std::abs(expected))
      << what << ": actual " << actual << " expected " << expected;
}

TEST(QKDetector, IsRegisteredWithItsSignals) {
  const DetectorInfo* qk = nullptr;
  for (const DetectorInfo& info : DetectorRegistry::Instance().detectors())
    if (info.name == "qk") qk = &info;
  ASSERT_NE(qk, nullptr);
  EXPECT_EQ(qk->kind, SampleKind::kQK);
  const std::map<std::string, HeadAggregation> expected = {
      {"qk_increment_entropy", HeadAggregation::kMin}, {"qk_increment_effective_rank", HeadAggregation::kMin},
      {"qk_increment_top1_share", HeadAggregation::kMax}, {"qk_second_order_ratio", HeadAggregation::kMax},
      {"qk_increment_top1_overlap", HeadAggregation::kMin}, {"attention_entropy", HeadAggregation::kMin},
      {"attention_max_logit", HeadAggregation::kMax}, {"qk_probe_heads", HeadAggregation::kNone},
      {"qk_probe_tokens", HeadAggregation::kNone}, {"attention_compute_bits", HeadAggregation::kNone},
      {"attention_output_bias", HeadAggregation::kNone}, {"attention_output_error", HeadAggregation::kNone}};
  ASSERT_EQ(qk->signals.size(), expected.size());
  for (const SignalSpec& spec : qk->signals) {
    SCOPED_TRACE(std::string(spec.name));
    ASSERT_TRUE(expected.count(std::string(spec.name)));
    EXPECT_EQ(spec.aggregation, expected.at(std::string(spec.name)));
    const bool per_layer = std::string_view(spec.name).starts_with("qk_probe_") ||
                           spec.name == "attention_compute_bits" ||
                           std::string_view(spec.name).starts_with("attention_output_");
    EXPECT_EQ(spec.scope, per_layer ? SignalScope::kLayer : SignalScope::kLayerHead);
    EXPECT_FALSE(spec.help.empty());
    EXPECT_EQ(spec.help.find('\n'), std::string_view::npos);
  }
}

class QKDetectorSeries : public ::testing::Test {
 protected:
  static constexpr int kHeads = 3, kTokens = 48, kDim = 8, kLayer = 5;
  void SetUp() override {
    std::mt19937 rng(42);
    q0 = RandomHeads(kHeads, kTokens, kDim, rng);
    k0 = RandomHeads(kHeads, kTokens, kDim, rng);
    q1 = Perturb(q0, rng, 0.05), k1 = Perturb(k0, rng, 0.05);
    q2 = Perturb(q1, rng, 0.05), k2 = Perturb(k1, rng, 0.05);
    detector = MakeDetector("qk");
    ASSERT_NE(detector, nullptr);
  }
  std::map<std::string, std::map<int, double>> Process(const Heads& q, const Heads& k, const std::string& probe = "p",
                                                       const std::string& run = "run-a") {
    RecordingEmitter emitter;
    detector->Process(MakeSample(run, kLayer, probe, q, k), emitter);
    EXPECT_EQ(emitter.non_finite, 0);
    for (const Recorded& r : emitter.observations) EXPECT_EQ(r.layer, kLayer);
    auto by_signal = emitter.BySignal();
    // What was sampled: every head and token of these samples, per layer.
    EXPECT_EQ(by_signal["qk_probe_heads"], (std::map<int, double>{{kAllHeads, double(q.size())}}));
    EXPECT_EQ(by_signal["qk_probe_tokens"], (std::map<int, double>{{kAllHeads, double(q[0].rows())}}));
    by_signal.erase("qk_probe_heads");
    by_signal.erase("qk_probe_tokens");
    return by_signal;
  }
  Heads q0, k0, q1, k1, q2, k2;
  std::unique_ptr<Detector> detector;
};

TEST(QKDetector, ReportsTheAttentionComputeWidthOnlyWhenTheClientSaysIt) {
  std::mt19937 rng(5);
  const Heads q = RandomHeads(2, 8, 4, rng), k = RandomHeads(2, 8, 4, rng);
  std::unique_ptr<Detector> detector = MakeDetector("qk");
  const std::vector<std::pair<std::optional<DType>, std::optional<double>>> cases = {
      {std::nullopt, std::nullopt}, {DType::kFloat32, 32.0}, {DType::kBFloat16, 16.0},
      {DType::kFloat16, 16.0}};
  for (const auto& [dtype, bits] : cases) {
    Sample sample = MakeSample("run", 3, "p", q, k);
    std::get<QKSample>(sample.payload).attention_dtype = dtype;
    RecordingEmitter emitter;
    detector->Process(sample, emitter);
    const auto by_signal = emitter.BySignal();
    const auto it = by_signal.find("attention_compute_bits");
    ASSERT_EQ(it != by_signal.end(), bits.has_value());
    if (bits) {
      EXPECT_EQ(it->second, (std::map<int, double>{{kAllHeads, *bits}}));
    }
  }
}

// The output check in units of the attention dtype's unit roundoff:
// (|mean signed error| - 4 rms / sqrt(N))+ / (mean |O_ref| * u) and
// rms / (mean |O_ref| * u).
TEST(QKDetector, ScalesTheOutputCheckByTheAttentionDtypesUnitRoundoff) {
  std::mt19937 rng(6);
  const Heads q = RandomHeads(2, 8, 4, rng), k = RandomHeads(2, 8, 4, rng);
  std::unique_ptr<Detector> detector = MakeDetector("qk");
  struct Case {
    std::optional<DType> dtype;
    double unit;  // 0: no output signals expected
  };
  const AttentionOutputCheck check{-0.003, 0.004, 0.5, 64};
  for (const Case& c : {Case{std::nullopt, 0}, Case{DType::kBFloat16, 0x1p-8},
                        Case{DType::kFloat16, 0x1p-11}, Case{DType::kFloat32, 0x1p-24}}) {
    Sample sample = MakeSample("run", 3, "p", q, k);
    std::get<QKSample>(sample.payload).attention_dtype = c.dtype;
    std::get<QKSample>(sample.payload).output_check = check;
    RecordingEmitter emitter;
    detector->Process(sample, emitter);
    EXPECT_EQ(emitter.non_finite, 0);
    const auto by_signal = emitter.BySignal();
    ASSERT_EQ(by_signal.count("attention_output_bias"), c.unit > 0 ? 1u : 0u);
    ASSERT_EQ(by_signal.count("attention_output_error"), c.unit > 0 ? 1u : 0u);
    if (c.unit == 0) continue;
    // 0.003 - 4 * 0.004 / sqrt(64) = 0.001
    EXPECT_DOUBLE_EQ(by_signal.at("attention_output_bias").at(kAllHeads), 0.001 / (0.5 * c.unit));
    EXPECT_DOUBLE_EQ(by_signal.at("attention_output_error").at(kAllHeads), 0.004 / (0.5 * c.unit));
  }
  // A mean within 4 standard errors of 0 reads 0: round-to-nearest noise.
  {
    Sample sample = MakeSample("run", 3, "p", q, k);
    std::get<QKSample>(sample.payload).attention_dtype = DType::kBFloat16;
    std::get<QKSample>(sample.payload).output_check = AttentionOutputCheck{0.0019, 0.004, 0.5, 64};
    RecordingEmitter emitter;
    detector->Process(sample, emitter);
    EXPECT_EQ(emitter.BySignal().at("attention_output_bias").at(kAllHeads), 0.0);
  }
  // Without a check: no output signals; an all-zero reference has no scale.
  for (const std::optional<AttentionOutputCheck>& absent :
       {std::optional<AttentionOutputCheck>(), std::optional(AttentionOutputCheck{0, 0, 0, 64})}) {
    Sample sample = MakeSample("run", 3, "p", q, k);
    std::get<QKSample>(sample.payload).attention_dtype = DType::kBFloat16;
    std::get<QKSample>(sample.payload).output_check = absent;
    RecordingEmitter emitter;
    detector->Process(sample, emitter);
    EXPECT_EQ(emitter.BySignal().count("attention_output_bias"), 0u);
  }
  // A kernel output with NaN/Inf: reported as non-finite, no output signals,
  // and the sample's attention signals still computed.
  Sample sample = MakeSample("run", 3, "p", q, k);
  std::get<QKSample>(sample.payload).attention_dtype = DType::kBFloat16;
  std::get<QKSample>(sample.payload).output_check =
      AttentionOutputCheck{std::numeric_limits<double>::quiet_NaN(), 1, 1, 64};
  RecordingEmitter emitter;
  detector->Process(sample, emitter);
  EXPECT_EQ(emitter.non_finite, 1);
  const auto by_signal = emitter.BySignal();
  EXPECT_EQ(by_signal.count("attention_output_bias"), 0u);
  EXPECT_EQ(by_signal.count("attention_entropy"), 1u);
}

TEST_F(QKDetectorSeries, FirstSampleEmitsOnlyAttentionSignals) {
  const auto by_signal = Process(q0, k0);
  EXPECT_EQ(by_signal.size(), 2u);
  ASSERT_TRUE(by_signal.count("attention_entropy"));
  ASSERT_TRUE(by_signal.count("attention_max_logit"));
  ExpectAggregates(by_signal, kHeads);
  for (int h = 0; h < kHeads; ++h) {
    const AttentionStats expected = ComputeAttentionStats<double>(q0[h], k0[h], {true, 0});
    ExpectRelative(by_signal.at("attention_entropy").at(h), expected.mean_entropy, 1e-4, "entropy");
    ExpectRelative(by_signal.at("attention_max_logit").at(h), expected.max_logit, 1e-5, "max logit");
  }
}

TEST_F(QKDetectorSeries, IncrementSignalsMatchDenseReferencePerHead) {
  Process(q0, k0);
  const auto second = Process(q1, k1);
  ExpectAggregates(second, kHeads);
  for (const std::string& signal : kIncrementSignals) ASSERT_TRUE(second.count(signal)) << signal;
  EXPECT_FALSE(second.count("qk_increment_top1_overlap")) << "one increment has no predecessor";

  std::vector<std::vector<double>> first_top(kHeads);
  for (int h = 0; h < kHeads; ++h) {
    const QKIncrementSpectrum dense =
        ComputeQKIncrementSpectrumDense(q0[h], k0[h], q1[h], k1[h], {.compute_top_vector = true});
    first_top[h] = dense.top_vector;
    ExpectRelative(second.at("qk_increment_entropy").at(h), dense.normalized_entropy, 1e-3, "entropy");
    ExpectRelative(second.at("qk_increment_effective_rank").at(h), dense.effective_rank, 1e-3, "rank");
    ExpectRelative(second.at("qk_increment_top1_share").at(h), dense.top1_share, 1e-3, "share");
    ExpectRelative(second.at("qk_second_order_ratio").at(h), dense.second_order_ratio, 1e-3, "ratio");
  }

  const auto third = Process(q2, k2);
  ExpectAggregates(third, kHeads);
  ASSERT_TRUE(third.count("qk_increment_top1_overlap"));
  for (int h = 0; h < kHeads; ++h) {
    const QKIncrementSpectrum dense =
        ComputeQKIncrementSpectrumDense(q1[h], k1[h], q2[h], k2[h], {.compute_top_vector = true});
    EXPECT_NEAR(third.at("qk_increment_top1_overlap").at(h), TopVectorOverlap(first_top[h], dense.top_vector), 1e-3);
  }
}

TEST_F(QKDetectorSeries, NonFiniteSampleIsCountedAndSkipped) {
  Process(q0, k0);
  Heads bad_q = q1;
  bad_q[1](3, 2) = std::numeric_limits<double>::quiet_NaN();
  bad_q[2](0, 0) = std::numeric_limits<double>::infinity();
  RecordingEmitter emitter;
  detector->Process(MakeSample("run-a", kLayer, "p", bad_q, k1), emitter);
  EXPECT_EQ(emitter.non_finite, 2);
  EXPECT_TRUE(emitter.observations.empty());

  // The next finite sample is compared with the last finite one (q0, k0).
  const auto next = Process(q1, k1);
  ASSERT_TRUE(next.count("qk_increment_entropy"));
  const QKIncrementSpectrum dense = ComputeQKIncrementSpectrumDense(q0[0], k0[0], q1[0], k1[0]);
  ExpectRelative(next.at("qk_increment_entropy").at(0), dense.normalized_entropy, 1e-3, "entropy");
}

TEST_F(QKDetectorSeries, ShapeChangeRestartsTheSeries) {
  Process(q0, k0);
  std::mt19937 rng(9);
  const Heads longer_q = RandomHeads(kHeads, kTokens + 4, kDim, rng);
  const Heads longer_k = RandomHeads(kHeads, kTokens + 4, kDim, rng);
  EXPECT_EQ(Process(longer_q, longer_k).size(), 2u) << "no increment across a shape change";
  EXPECT_TRUE(Process(Perturb(longer_q, rng, 0.05), longer_k).count("qk_increment_entropy"));
}

TEST_F(QKDetectorSeries, SeriesAreKeyedByRunAndProbe) {
  Process(q0, k0, "p", "run-a");
  EXPECT_EQ(Process(q1, k1, "other-probe", "run-a").size(), 2u);
  EXPECT_EQ(Process(q1, k1, "p", "run-b").size(), 2u);
  EXPECT_TRUE(Process(q1, k1, "p", "run-a").count("qk_increment_entropy"));
}

TEST_F(QKDetectorSeries, ForgetRunDropsOnlyThatRun) {
  Process(q0, k0, "p", "run-a");
  Process(q0, k0, "p", "run-b");
  detector->ForgetRun("run-a");
  EXPECT_EQ(Process(q1, k1, "p", "run-a").size(), 2u);
  EXPECT_TRUE(Process(q1, k1, "p", "run-b").count("qk_increment_entropy"));
}

TEST_F(QKDetectorSeries, ZeroIncrementEmitsNoIncrementSignals) {
  Process(q0, k0);
  const auto same = Process(q0, k0);
  EXPECT_EQ(same.size(), 2u);
  for (const auto& [signal, values] : same)
    for (const auto& [head, value] : values) EXPECT_TRUE(std::isfinite(value)) << signal;
}

// Finite float32 values near the top of the range overflow float arithmetic
// (logits, and q - q_prev when signs flip); every emitted value must stay finite.
TEST_F(QKDetectorSeries, HugeFiniteValuesGiveFiniteSignals) {
  Heads huge_q0 = q0, huge_q1 = q0;
  for (int h = 0; h < kHeads; ++h) {
    // +-3e38 (float max is 3.4e38): q - q_prev = -6e38 and the logits overflow float.
    huge_q0[h] = 3e38 * q0[h].array().sign();
    huge_q1[h] = -huge_q0[h];
  }
  Process(huge_q0, k0);
  const auto by_signal = Process(huge_q1, k1);
  ASSERT_TRUE(by_signal.count("qk_increment_entropy"));
  for (const auto& [signal, values] : by_signal)
    for (const auto& [head, value] : values) EXPECT_TRUE(std::isfinite(value)) << signal << " head " << head;
}

// Grouped-query K sent once per group gives exactly what the same K
// broadcast to every query head gives (what clients sent before kv_head_of),
// for contiguous groups and for an explicit, interleaved mapping; and the
// pairing survives a state save and restore.
TEST(QKDetector, GroupedQueryKGivesWhatBroadcastKGives) {
  std::mt19937 rng(3);
  constexpr int kQueryHeads = 6, kKVHeads = 2, kTokens = 24, kDim = 8;
  const Heads q0 = RandomHeads(kQueryHeads, kTokens, kDim, rng);
  const Heads k0 = RandomHeads(kKVHeads, kTokens, kDim, rng);
  const Heads q1 = Perturb(q0, rng, 0.05), k1 = Perturb(k0, rng, 0.05);
  const Heads q2 = Perturb(q1, rng, 0.05), k2 = Perturb(k1, rng, 0.05);
  for (const std::vector<int32_t>& kv_head_of :
       {std::vector<int32_t>{0, 0, 0, 1, 1, 1}, std::vector<int32_t>{0, 1, 0, 1, 0, 1}}) {
    auto broadcast = [&](const Heads& k) {
      Heads out;
      for (int32_t kv : kv_head_of) out.push_back(k[static_cast<size_t>(kv)]);
      return out;
    };
    auto grouped = [&](const Heads& q, const Heads& k) {
      Sample sample = MakeSample("run", 1, "p", q, k);
      std::get<QKSample>(sample.payload).kv_head_of = kv_head_of;
      return sample;
    };
    std::unique_ptr<Detector> reference = MakeDetector("qk"), gqa = MakeDetector("qk");
    std::vector<std::map<std::string, std::map<int, double>>> want, got;
    for (const auto& [q, k] : {std::pair{&q0, &k0}, std::pair{&q1, &k1}}) {
      RecordingEmitter a, b;
      reference->Process(MakeSample("run", 1, "p", *q, broadcast(*k)), a);
      gqa->Process(grouped(*q, *k), b);
      want.push_back(a.BySignal());
      got.push_back(b.BySignal());
    }
    // Restored from its state, the grouped detector still pairs the previous sample right.
    codec::StateWriter writer;
    gqa->SaveState(writer);
    std::unique_ptr<Detector> restored = MakeDetector("qk");
    const std::string state = writer.Take();
    codec::StateReader reader(state);
    ASSERT_TRUE(restored->RestoreState(reader, {}));
    RecordingEmitter a, b;
    reference->Process(MakeSample("run", 1, "p", q2, broadcast(k2)), a);
    restored->Process(grouped(q2, k2), b);
    want.push_back(a.BySignal());
    got.push_back(b.BySignal());
    EXPECT_EQ(got, want);
    EXPECT_EQ(got[1].count("qk_increment_entropy"), 1u);
    EXPECT_EQ(got[2].count("qk_increment_entropy"), 1u);
    EXPECT_EQ(got[2].at("qk_increment_entropy").size(), static_cast<size_t>(kQueryHeads + 1));
  }
}

// A checkpoint written before kv_head_of (state version 1) restores: its
// previous sample pairs with the next one as before.
TEST(QKDetector, RestoresVersion1State) {
  std::mt19937 rng(5);
  const Heads q0 = RandomHeads(2, 16, 4, rng), k0 = RandomHeads(2, 16, 4, rng);
  const Heads q1 = Perturb(q0, rng, 0.05), k1 = Perturb(k0, rng, 0.05);
  codec::StateWriter writer;
  writer.PutU32(1);
  writer.PutU64(1);
  writer.PutString("run");
  writer.PutI32(0);
  writer.PutString("p");
  for (const Heads* heads : {&q0, &k0}) {
    const RawTensor t = ToFloat32Tensor(*heads);
    writer.PutU8(static_cast<uint8_t>(t.dtype));
    writer.PutVector(t.shape);
    writer.PutBytes(t.data);
  }
  writer.PutU64(0);  // no top directions yet
  const std::string state = writer.Take();
  std::unique_ptr<Detector> restored = MakeDetector("qk"), reference = MakeDetector("qk");
  codec::StateReader reader(state);
  ASSERT_TRUE(restored->RestoreState(reader, {})) << reader.error();
  RecordingEmitter ignored, a, b;
  reference->Process(MakeSample("run", 0, "p", q0, k0), ignored);
  reference->Process(MakeSample("run", 0, "p", q1, k1), a);
  restored->Process(MakeSample("run", 0, "p", q1, k1), b);
  EXPECT_EQ(b.BySignal().count("qk_increment_entropy"), 1u);
  EXPECT_EQ(b.BySignal(), a.BySignal());
}

// A rotating subset of heads (QKSample.heads): each head's increment spans
// from its own previous sample, and signals carry the model's head index.
TEST(QKDetector, RotatingHeadSubsetsPairEachHeadWithItsOwnPreviousSample) {
  std::mt19937 rng(6);
  constexpr int kTokens = 20, kDim = 4;
  const Heads q0 = RandomHeads(4, kTokens, kDim, rng), k0 = RandomHeads(2, kTokens, kDim, rng);
  const Heads q1 = Perturb(q0, rng, 0.05), k1 = Perturb(k0, rng, 0.05);
  auto rows = [](const Heads& heads, std::vector<int> pick) {
    Heads out;
    for (int h : pick) out.push_back(heads[static_cast<size_t>(h)]);
    return out;
  };
  // Model: 4 query heads over 2 K heads (0,1 -> K 0; 2,3 -> K 1). Probes:
  // heads {1, 2} at step 0, {0, 3} at step 1, {1, 2} again at step 2.
  auto subset = [&](const Heads& q, const Heads& k, std::vector<int32_t> heads) {
    std::vector<int> pick(heads.begin(), heads.end());
    Sample sample = MakeSample("run", 0, "p", rows(q, pick), k);
    auto& qk = std::get<QKSample>(sample.payload);
    qk.heads = heads;
    for (int32_t h : heads) qk.kv_head_of.push_back(h / 2);
    return sample;
  };
  std::unique_ptr<Detector> detector = MakeDetector("qk");
  RecordingEmitter first, second, third;
  detector->Process(subset(q0, k0, {1, 2}), first);
  detector->Process(subset(q0, k0, {0, 3}), second);
  detector->Process(subset(q1, k1, {1, 2}), third);
  EXPECT_EQ(first.BySignal().at("attention_entropy").size(), 3u);  // heads 1, 2 and the layer
  EXPECT_EQ(first.BySignal().at("qk_probe_heads").at(kAllHeads), 2);
  EXPECT_EQ(first.BySignal().at("qk_probe_tokens").at(kAllHeads), kTokens);
  EXPECT_EQ(second.BySignal().count("qk_increment_entropy"), 0u);   // 0 and 3 are new
  ASSERT_EQ(third.BySignal().count("qk_increment_entropy"), 1u);
  const std::map<int, double> got = third.BySignal().at("qk_increment_entropy");
  ASSERT_EQ(got.size(), 3u);
  // Reference: heads 1 and 2 alone, as a full two-head series with their K heads.
  std::unique_ptr<Detector> reference = MakeDetector("qk");
  RecordingEmitter ignored, want;
  reference->Process(MakeSample("run", 0, "p", rows(q0, {1, 2}), rows(k0, {0, 1})), ignored);
  reference->Process(MakeSample("run", 0, "p", rows(q1, {1, 2}), rows(k1, {0, 1})), want);
  const std::map<int, double> expected = want.BySignal().at("qk_increment_entropy");
  EXPECT_EQ(got.at(1), expected.at(0));
  EXPECT_EQ(got.at(2), expected.at(1));
  EXPECT_EQ(got.at(kAllHeads), expected.at(kAllHeads));  // heads 0 and 3 have no increment yet
  // The layer's attention entropy is over every head's latest value: heads 1
  // and 2 from this sample, 0 and 3 from the previous one.
  const auto second_entropy = second.BySignal().at("attention_entropy");
  const auto third_entropy = third.BySignal().at("attention_entropy");
  EXPECT_EQ(third_entropy.at(kAllHeads), std::min({second_entropy.at(0), second_entropy.at(3),
                                                   third_entropy.at(1), third_entropy.at(2)}));
  // Heads 0 and 3 restored from a saved state still pair with step 1's sample.
  codec::StateWriter writer;
  detector->SaveState(writer);
  const std::string state = writer.Take();
  std::unique_ptr<Detector> restored = MakeDetector("qk");
  codec::StateReader reader(state);
  ASSERT_TRUE(restored->RestoreState(reader, {})) << reader.error();
  RecordingEmitter fourth;
  restored->Process(subset(q1, k1, {0, 3}), fourth);
  EXPECT_EQ(fourth.BySignal().at("qk_increment_entropy").size(), 3u);
}

// The query heads of one K head share the Gram of [K0 | dK] only when they
// share the previous K too: here heads 0 and 1 (K head 0) are sampled together
// after being sampled apart, so their previous K differ; each must get what it
// gets alone.
TEST(QKDetector, HeadsOfOneKHeadWithDifferentPreviousKGetTheirOwnIncrement) {
  std::mt19937 rng(8);
  constexpr int kTokens = 32, kDim = 8;
  const Heads q0 = RandomHeads(4, kTokens, kDim, rng), k0 = RandomHeads(2, kTokens, kDim, rng);
  const Heads q1 = Perturb(q0, rng, 0.05), k1 = Perturb(k0, rng, 0.05);
  const Heads q2 = Perturb(q1, rng, 0.05), k2 = Perturb(k1, rng, 0.05);
  auto subset = [&](const Heads& q, const Heads& k, std::vector<int32_t> heads) {
    Heads rows;
    for (int32_t h : heads) rows.push_back(q[static_cast<size_t>(h)]);
    Sample sample = MakeSample("run", 0, "p", rows, k);
    auto& qk = std::get<QKSample>(sample.payload);
    qk.heads = heads;
    for (int32_t h : heads) qk.kv_head_of.push_back(h / 2);
    return sample;
  };
  std::unique_ptr<Detector> detector = MakeDetector("qk");
  RecordingEmitter ignored, got;
  detector->Process(subset(q0, k0, {0}), ignored);
  detector->Process(subset(q1, k1, {1}), ignored);
  detector->Process(subset(q2, k2, {0, 1}), got);
  const auto by_signal = got.BySignal();
  for (int head : {0, 1}) {
    SCOPED_TRACE(head);
    const Heads& q_before = head == 0 ? q0 : q1;
    const Heads& k_before = head == 0 ? k0 : k1;
    std::unique_ptr<Detector> alone = MakeDetector("qk");
    RecordingEmitter first, want;
    alone->Process(MakeSample("run", 0, "p", Heads{q_before[static_cast<size_t>(head)]}, Heads{k_before[0]}), first);
    alone->Process(MakeSample("run", 0, "p", Heads{q2[static_cast<size_t>(head)]}, Heads{k2[0]}), want);
    for (const char* signal : {"qk_increment_entropy", "qk_increment_effective_rank", "qk_increment_top1_share",
                               "qk_second_order_ratio"}) {
      ASSERT_EQ(by_signal.count(signal), 1u) << signal;
      EXPECT_EQ(by_signal.at(signal).at(head), want.BySignal().at(signal).at(0)) << signal;
    }
  }
}

// The increment is of each query head's logits: the order in which a sample
// carries the K heads (and so kv_head_of) may change between samples.
TEST(QKDetector, TheIncrementFollowsEachQueryHeadsKAcrossKOrders) {
  std::mt19937 rng(4);
  const Heads q0 = RandomHeads(4, 16, 4, rng), k0 = RandomHeads(2, 16, 4, rng);
  const Heads q1 = Perturb(q0, rng, 0.1), k1 = Perturb(k0, rng, 0.1);
  std::unique_ptr<Detector> detector = MakeDetector("qk"), reference = MakeDetector("qk");
  Sample first = MakeSample("run", 0, "p", q0, k0);
  std::get<QKSample>(first.payload).kv_head_of = {0, 0, 1, 1};
  Sample second = MakeSample("run", 0, "p", q1, Heads{k1[1], k1[0]});  // K rows swapped
  std::get<QKSample>(second.payload).kv_head_of = {1, 1, 0, 0};
  Sample first_ref = MakeSample("run", 0, "p", q0, k0), second_ref = MakeSample("run", 0, "p", q1, k1);
  std::get<QKSample>(first_ref.payload).kv_head_of = {0, 0, 1, 1};
  std::get<QKSample>(second_ref.payload).kv_head_of = {0, 0, 1, 1};
  RecordingEmitter ignored, a, b;
  detector->Process(first, ignored);
  detector->Process(second, a);
  reference->Process(first_ref, ignored);
  reference->Process(second_ref, b);
  EXPECT_EQ(a.BySignal().count("qk_increment_entropy"), 1u);
  EXPECT_EQ(a.BySignal(), b.BySignal());
}

TEST(QKDetector, NoOverlapWhenTopVectorTrackingIsOff) {
  std::mt19937 rng(4);
  auto detector = MakeDetector("qk", DetectorOptions().With(QKDetectorOptions{.track_top_vector = false}));
  Heads q = RandomHeads(2, 20, 4, rng), k = RandomHeads(2, 20, 4, rng);
  RecordingEmitter emitter;
  for (int step = 0; step < 4; ++step) {
    detector->Process(MakeSample("r", 0, "p", q, k), emitter);
    q = Perturb(q, rng, 0.1);
  }
  for (const Recorded& r : emitter.observations) EXPECT_NE(r.signal, "qk_increment_top1_overlap");
  EXPECT_TRUE(std::any_of(emitter.observations.begin(), emitter.observations.end(),
                          [](const Recorded& r) { return r.signal == "qk_increment_entropy"; }));
}

TEST(QKDetector, DecodesBFloat16Samples) {
  // bf16 1.0 = 0x3F80 everywhere, one head, 4 tokens, dim 2: every logit is 2/sqrt(2).
  QKSample qk;
  qk.layer = 0;
  qk.probe_id = "p";
  qk.causal = false;
  qk.q.dtype = qk.k.dtype = DType::kBFloat16;
  qk.q.shape = qk.k.shape = {1, 4, 2};
  for (int i = 0; i < 8; ++i) qk.q.data += std::string("\x80\x3F", 2);
  qk.k.data = qk.q.data;
  Sample sample;
  sample.run = "r";
  sample.payload = qk;
  RecordingEmitter emitter;
  MakeDetector("qk")->Process(sample, emitter);
  const auto by_signal = emitter.BySignal();
  EXPECT_NEAR(by_signal.at("attention_max_logit").at(0), std::sqrt(2.0), 1e-6);
  EXPECT_NEAR(by_signal.at("attention_entropy").at(0), std::log(4.0), 1e-6);
}

}  // namespace
}  // namespace foreshock::detectors
