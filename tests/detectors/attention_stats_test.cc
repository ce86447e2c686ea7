// Attention entropy and max logit against a direct computation in double
// loops (softmax probabilities formed explicitly, H = -sum p log p).
#include "detectors/attention_stats.h"

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

namespace foreshock::detectors {
namespace {

using MatrixD = RowMajorMatrix<double>;

// Whether query i may attend to key j: same sequence and, when causal, j <= i.
bool Allowed(int i, int j, const AttentionMask& mask) {
  if (mask.seq_len > 0 && i / mask.seq_len != j / mask.seq_len) return false;
  return !mask.causal || j <= i;
}

AttentionStats NaiveAttentionStats(const MatrixD& q, const MatrixD& k, const AttentionMask& mask) {
  const int n = static_cast<int>(q.rows()), d = static_cast<int>(q.cols());
  double entropy_sum = 0;
  double max_logit = -std::numeric_limits<double>::infinity();
  for (int i = 0; i < n; ++i) {
    std::vector<double> logits;
    for (int j = 0; j < n; ++j) {
      if (!Allowed(i, j, mask)) continue;
      double s = 0;
      for (int c = 0; c < d; ++c) s += q(i, c) * k(j, c);
      logits.push_back(s / std::sqrt(static_cast<double>(d)));
    }
    double row_max = -std::numeric_limits<double>::infinity();
    for (double s : logits) row_max = std::max(row_max, s);
    max_logit = std::max(max_logit, row_max);
    double z = 0;
    for (double s : logits) z += std::exp(s - row_max);
    double entropy = 0;
    for (double s : logits) {
      const double p = std::exp(s - row_max) / z;
      if (p > 0) entropy -= p * std::log(p);
    }
    entropy_sum += entropy;
  }
  return {entropy_sum / n, max_logit};
}

MatrixD Gaussian(int rows, int cols, double scale, std::mt19937& rng) {
  std::normal_distribution<double> normal(0.0, scale);
  MatrixD m(rows, cols);
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) m(i, j) = static_cast<float>(normal(rng));  // float-exact
  return m;
}

// n, d, causal, seq_len, logit scale
using Params = std::tuple<int, int, bool, int, double>;
class AttentionVsNaive : public ::testing::TestWithParam<Params> {};

TEST_P(AttentionVsNaive, MatchesDirectComputation) {
  const auto [n, d, causal, seq_len, scale] = GetParam();
  std::mt19937 rng(static_cast<unsigned>(n * 131 + d * 7 + seq_len + (causal ? 1 : 0)));
  const MatrixD q = Gaussian(n, d, scale, rng), k = Gaussian(n, d, scale, rng);
  const AttentionMask mask{causal, seq_len};
  const AttentionStats expected = NaiveAttentionStats(q, k, mask);

  const AttentionStats in_double = ComputeAttentionStats<double>(q, k, mask);
  EXPECT_NEAR(in_double.mean_entropy, expected.mean_entropy, 1e-10 * std::max(1.0, expected.mean_entropy));
  EXPECT_NEAR(in_double.max_logit, expected.max_logit, 1e-10 * std::abs(expected.max_logit));

  const RowMajorMatrix<float> qf = q.cast<float>(), kf = k.cast<float>();
  const AttentionStats in_float = ComputeAttentionStats<float>(qf, kf, mask);
  // Float logits carry ~1e-7 relative error, amplified in the entropy by the logit range.
  EXPECT_NEAR(in_float.mean_entropy, expected.mean_entropy, 1e-4 * std::max(1.0, expected.mean_entropy));
  EXPECT_NEAR(in_float.max_logit, expected.max_logit, 1e-5 * std::abs(expected.max_logit));
}

INSTANTIATE_TEST_SUITE_P(
    Masks, AttentionVsNaive,
    ::testing::Values(
        // seq_len 0: one sequence. n not a multiple of the query block (64) on purpose.
        Params{1, 4, true, 0, 1.0}, Params{7, 4, false, 0, 1.0}, Params{64, 16, true, 0, 1.0},
        Params{65, 16, false, 0, 1.0}, Params{200, 32, true, 0, 1.0}, Params{200, 32, false, 0, 1.0},
        // Block-diagonal masks, including a last sequence shorter than seq_len (200 = 3*64 + 8).
        Params{128, 16, true, 32, 1.0}, Params{128, 16, false, 32, 1.0},
        Params{200, 16, true, 64, 1.0}, Params{200, 16, false, 64, 1.0},
        Params{150, 8, true, 100, 1.0}, Params{150, 8, false, 7, 1.0},
        Params{96, 8, true, 96, 1.0}, Params{96, 8, true, 500, 1.0},
        // Large logits (hundreds): the log-sum-exp must stay stable.
        Params{130, 32, true, 0, 6.0}, Params{130, 32, false, 40, 6.0}),
    [](const auto& info) {
      const Params& p = info.param;
      return std::string("n") + std::to_string(std::get<0>(p)) + "_d" + std::to_string(std::get<1>(p)) +
             (std::get<2>(p) ? "_causal" : "_full") + "_seq" + std::to_string(std::get<3>(p)) + "_scale" +
             std::to_string(static_cast<int>(std::get<4>(p)));
    });

// With all keys zero every allowed key gets the same weight, so each query's
// entropy is log(number of keys it sees).
TEST(AttentionStats, UniformAttentionEntropyIsLogOfVisibleKeys) {
  const int n = 100, d = 8;
  std::mt19937 rng(1);
  const MatrixD q = Gaussian(n, d, 1.0, rng);
  const MatrixD k = MatrixD::Zero(n, d);
  double causal_expected = 0;
  for (int i = 0; i < n; ++i) causal_expected += std::log(i + 1.0);
  causal_expected /= n;
  EXPECT_NEAR(ComputeAttentionStats<double>(q, k, {false, 0}).mean_entropy, std::log(100.0), 1e-12);
  EXPECT_NEAR(ComputeAttentionStats<double>(q, k, {true, 0}).mean_entropy, causal_expected, 1e-12);
  // Sequences of 30, 30, 30, 10 tokens without causality.
  const double blocks_expected = (90 * std::log(30.0) + 10 * std::log(10.0)) / n;
  EXPECT_NEAR(ComputeAttentionStats<double>(q, k, {false, 30}).mean_entropy, blocks_expected, 1e-12);
  EXPECT_EQ(ComputeAttentionStats<double>(q, k, {true, 0}).max_logit, 0.0);
}

// A key with a huge logit in the second sequence must be invisible to queries
// of the first sequence, and (causally) to earlier queries of its own.
TEST(AttentionStats, MaskedEntriesDoNotCount) {
  const int n = 8, d = 1;
  MatrixD q = MatrixD::Ones(n, d);
  MatrixD k = MatrixD::Zero(n, d);
  k(6, 0) = 100.0;  // key 6, second sequence of length 4
  EXPECT_EQ(ComputeAttentionStats<double>(q, k, {false, 0}).max_logit, 100.0);
  EXPECT_EQ(ComputeAttentionStats<double>(q, k, {true, 4}).max_logit, 100.0);
  k(6, 0) = 0.0;
  k(7, 0) = 50.0;  // only query 7 sees key 7 causally
  const AttentionStats causal = ComputeAttentionStats<double>(q, k, {true, 4});
  EXPECT_EQ(causal.max_logit, 50.0);
  // Queries 0..6 attend uniformly within their causal window of 1, 2, 3, 4 and
  // 1, 2, 3 keys; query 7 almost only to key 7 (entropy ~ 150 e^-50 ~ 0).
  const double expected = (std::log(2.0) + std::log(3.0) + std::log(4.0) + std::log(2.0) + std::log(3.0)) / n;
  EXPECT_NEAR(causal.mean_entropy, expected, 1e-12);
}

}  // namespace
}  // namespace foreshock::detectors
