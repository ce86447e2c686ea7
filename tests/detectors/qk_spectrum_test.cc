// The factored increment spectrum against the dense reference (dS1 formed as
// an n x n matrix in double, Eigen BDCSVD), plus hand-computed spectra.
#include "detectors/qk_spectrum.h"
#include "detectors/qk_linalg.h"

#include <algorithm>
#include <limits>
#include <cmath>
#include <ostream>
#include <random>
#include <string>
#include <tuple>

#include <Eigen/Eigenvalues>
#include <Eigen/SVD>
#include <gtest/gtest.h>

namespace foreshock::detectors {
namespace {

using MatrixD = RowMajorMatrix<double>;
using MatrixF = RowMajorMatrix<float>;

TEST(SummarizeSpectrum, HandComputedValues) {
  // p = (0.75, 0.25): H = -(0.75 ln 0.75 + 0.25 ln 0.25).
  const std::vector<double> sigma = {3.0, 1.0, 0.0, 0.0};
  const double entropy = -(0.75 * std::log(0.75) + 0.25 * std::log(0.25));
  const SpectrumSummary s = SummarizeSpectrum(sigma, /*head_dim=*/2);
  EXPECT_NEAR(s.normalized_entropy, entropy / std::log(4.0), 1e-15);
  EXPECT_NEAR(s.effective_rank, std::exp(entropy), 1e-15);
  EXPECT_NEAR(s.top1_share, 9.0 / 10.0, 1e-15);
}

TEST(SummarizeSpectrum, FlatSpectrumHasFullRankAndUnitEntropy) {
  const std::vector<double> sigma(8, 0.5);  // 2d values for d = 4
  const SpectrumSummary s = SummarizeSpectrum(sigma, 4);
  EXPECT_NEAR(s.normalized_entropy, 1.0, 1e-15);
  EXPECT_NEAR(s.effective_rank, 8.0, 1e-13);
  EXPECT_NEAR(s.top1_share, 1.0 / 8.0, 1e-15);
}

TEST(SummarizeSpectrum, SingleDirectionHasZeroEntropy) {
  const SpectrumSummary s = SummarizeSpectrum(std::vector<double>{2.0, 0.0, 0.0}, 16);
  EXPECT_EQ(s.normalized_entropy, 0.0);
  EXPECT_EQ(s.effective_rank, 1.0);
  EXPECT_EQ(s.top1_share, 1.0);
}

enum class InputKind {
  kRandom,              // every factor full rank; increments 10% of the values
  kLowRankIncrement,    // dQ rank 1, dK rank 2, Q0/K0 full rank
  kLowRankEverything,   // Q0, K0 rank 3, dQ rank 2, dK rank 1
  kSmallIncrement,      // increments 1e-3 of the values, as in a real training step
  // Rank-deficient factors and extreme scales, for the Gram route's Cholesky:
  kRepeatedKeyColumns,  // K0 and K have their first d/2 columns repeated
  kLowRankQueries,      // Q0 of rank d/2 (A rank-deficient even when n >= 2d)
  kQueriesUnchanged,    // Q = Q0: dQ = 0, half of A's columns are zero
  kTinyIncrement,       // increments 1e-5 of the values: A's columns differ by 1e5 in scale
};

std::string KindName(InputKind kind) {
  switch (kind) {
    case InputKind::kRandom: return "Random";
    case InputKind::kLowRankIncrement: return "LowRankIncrement";
    case InputKind::kLowRankEverything: return "LowRankEverything";
    case InputKind::kSmallIncrement: return "SmallIncrement";
    case InputKind::kRepeatedKeyColumns: return "RepeatedKeyColumns";
    case InputKind::kLowRankQueries: return "LowRankQueries";
    case InputKind::kQueriesUnchanged: return "QueriesUnchanged";
    case InputKind::kTinyIncrement: return "TinyIncrement";
  }
  return "";
}

void PrintTo(InputKind kind, std::ostream* os) { *os << KindName(kind); }

struct Inputs {
  MatrixD q_prev, k_prev, q, k;  // every value exactly representable in float
};

MatrixD Gaussian(int rows, int cols, std::mt19937& rng) {
  std::normal_distribution<double> normal;
  MatrixD m(rows, cols);
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) m(i, j) = normal(rng);
  return m;
}

MatrixD LowRank(int rows, int cols, int rank, std::mt19937& rng) {
  return Gaussian(rows, rank, rng) * Gaussian(rank, cols, rng) / std::sqrt(static_cast<double>(rank));
}

MatrixD RoundToFloat(const MatrixD& m) { return m.cast<float>().cast<double>(); }

Inputs MakeInputs(int n, int d, InputKind kind, unsigned seed) {
  std::mt19937 rng(seed);
  MatrixD q_prev, k_prev, dq, dk;
  switch (kind) {
    case InputKind::kRandom:
      q_prev = Gaussian(n, d, rng), k_prev = Gaussian(n, d, rng);
      dq = 0.1 * Gaussian(n, d, rng), dk = 0.1 * Gaussian(n, d, rng);
      break;
    case InputKind::kLowRankIncrement:
      q_prev = Gaussian(n, d, rng), k_prev = Gaussian(n, d, rng);
      dq = 0.1 * LowRank(n, d, 1, rng), dk = 0.1 * LowRank(n, d, 2, rng);
      break;
    case InputKind::kLowRankEverything:
      q_prev = LowRank(n, d, 3, rng), k_prev = LowRank(n, d, 3, rng);
      dq = 0.1 * LowRank(n, d, 2, rng), dk = 0.1 * LowRank(n, d, 1, rng);
      break;
    case InputKind::kSmallIncrement:
      q_prev = Gaussian(n, d, rng), k_prev = Gaussian(n, d, rng);
      dq = 1e-3 * Gaussian(n, d, rng), dk = 1e-3 * Gaussian(n, d, rng);
      break;
    case InputKind::kRepeatedKeyColumns:
      q_prev = Gaussian(n, d, rng), k_prev = Gaussian(n, d, rng);
      dq = 0.1 * Gaussian(n, d, rng), dk = 0.1 * Gaussian(n, d, rng);
      for (int j = d / 2; j < d; ++j) {
        k_prev.col(j) = k_prev.col(j - d / 2);
        dk.col(j) = dk.col(j - d / 2);
      }
      break;
    case InputKind::kLowRankQueries:
      q_prev = LowRank(n, d, std::max(1, d / 2), rng), k_prev = Gaussian(n, d, rng);
      dq = 0.1 * Gaussian(n, d, rng), dk = 0.1 * Gaussian(n, d, rng);
      break;
    case InputKind::kQueriesUnchanged:
      q_prev = Gaussian(n, d, rng), k_prev = Gaussian(n, d, rng);
      dq = MatrixD::Zero(n, d), dk = 0.1 * Gaussian(n, d, rng);
      break;
    case InputKind::kTinyIncrement:
      q_prev = Gaussian(n, d, rng), k_prev = Gaussian(n, d, rng);
      dq = 1e-5 * Gaussian(n, d, rng), dk = 1e-5 * Gaussian(n, d, rng);
      break;
  }
  Inputs in;
  in.q_prev = RoundToFloat(q_prev);
  in.k_prev = RoundToFloat(k_prev);
  in.q = RoundToFloat(in.q_prev + dq);
  in.k = RoundToFloat(in.k_prev + dk);
  return in;
}

// The small-matrix SVD used for the core, against Eigen's JacobiSVD in double
// (a different algorithm: one-sided Jacobi rotations).
class SmallSvdVsJacobi : public ::testing::TestWithParam<std::tuple<int, int, double>> {};

TEST_P(SmallSvdVsJacobi, SingularValuesAndTopVector) {
  const auto [size, rank, magnitude] = GetParam();
  std::mt19937 rng(static_cast<unsigned>(size * 31 + rank));
  const MatrixD unscaled = rank >= size ? Gaussian(size, size, rng) : LowRank(size, size, rank, rng);
  const Eigen::MatrixXd m = magnitude * RoundToFloat(unscaled);
  Eigen::JacobiSVD<Eigen::MatrixXd> reference(m, Eigen::ComputeFullU);
  const Eigen::VectorXd& expected = reference.singularValues();
  const double sigma1 = expected[0];
  // A gap between sigma_1 and sigma_2 makes the top vector well defined.
  const bool gap = size == 1 || expected[1] < (1 - 1e-3) * sigma1;

  struct Case {
    const char* name;
    SmallSvd svd;
    double tolerance;
  };
  const Case cases[] = {{"double", ComputeSmallSvd<double>(m, true), 1e-13},
                        {"float", ComputeSmallSvd<float>(m.cast<float>(), true), 1e-5}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    ASSERT_EQ(c.svd.singular_values.size(), static_cast<size_t>(size));
    for (int i = 0; i < size; ++i) {
      EXPECT_NEAR(c.svd.singular_values[i], expected[i], c.tolerance * sigma1) << "sigma " << i;
      if (i > 0) {
        EXPECT_LE(c.svd.singular_values[i], c.svd.singular_values[i - 1]);
      }
    }
    ASSERT_EQ(c.svd.top_left_vector.size(), static_cast<size_t>(size));
    if (gap) {
      double dot = 0;
      for (int i = 0; i < size; ++i) dot += c.svd.top_left_vector[i] * reference.matrixU()(i, 0);
      EXPECT_NEAR(std::abs(dot), 1.0, 100 * c.tolerance);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Matrices, SmallSvdVsJacobi,
    ::testing::Values(std::tuple{1, 1, 1.0}, std::tuple{2, 2, 1.0}, std::tuple{3, 3, 1.0},
                      std::tuple{17, 17, 1.0}, std::tuple{40, 3, 1.0}, std::tuple{40, 1, 1.0},
                      std::tuple{128, 128, 1.0}, std::tuple{128, 5, 1.0}, std::tuple{64, 64, 1e-30},
                      std::tuple{64, 64, 1e30}),
    [](const auto& info) {
      return std::string("size") + std::to_string(std::get<0>(info.param)) + "_rank" +
             std::to_string(std::get<1>(info.param)) + (std::get<2>(info.param) == 1.0 ? "" : "_scaled") +
             (std::get<2>(info.param) > 1.0 ? "Up" : std::get<2>(info.param) < 1.0 ? "Down" : "");
    });

TEST(SmallSvd, ZeroAndDiagonalMatrices) {
  const SmallSvd zero = ComputeSmallSvd<double>(Eigen::MatrixXd::Zero(5, 5), true);
  EXPECT_EQ(zero.singular_values, std::vector<double>(5, 0.0));
  EXPECT_TRUE(zero.top_left_vector.empty());
  // diag(1, -4, 4, 0): singular values 4, 4, 1, 0 (sorted, signs dropped, repeats kept).
  Eigen::MatrixXd diagonal = Eigen::MatrixXd::Zero(4, 4);
  diagonal.diagonal() << 1, -4, 4, 0;
  const SmallSvd s = ComputeSmallSvd<double>(diagonal, false);
  const std::vector<double> expected = {4, 4, 1, 0};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(s.singular_values[i], expected[i], 1e-15);
}

// |actual - expected| <= tolerance * |expected|.
void ExpectRelative(double actual, double expected, double tolerance, const char* what) {
  EXPECT_LE(std::abs(actual - expected), tolerance * std::abs(expected))
      << what << ": actual " << actual << " expected " << expected;
}

class FactoredVsDense : public ::testing::TestWithParam<std::tuple<int, int, InputKind>> {};

TEST_P(FactoredVsDense, AgreesWithDenseReference) {
  const auto [n, d, kind] = GetParam();
  const Inputs in = MakeInputs(n, d, kind, 1000u * n + 10u * d + static_cast<unsigned>(kind));
  const QKSpectrumOptions options{.compute_top_vector = true};
  const QKIncrementSpectrum dense = ComputeQKIncrementSpectrumDense(in.q_prev, in.k_prev, in.q, in.k, options);
  ASSERT_FALSE(dense.zero_increment);
  // The reference must itself be sensible: the rank bound 2d holds.
  const size_t core_size = static_cast<size_t>(std::min(n, 2 * d));
  ASSERT_EQ(dense.singular_values.size(), static_cast<size_t>(n));
  for (size_t i = core_size; i < dense.singular_values.size(); ++i) {
    ASSERT_LT(dense.singular_values[i], 1e-12 * dense.singular_values[0]);
  }

  const MatrixF qp = in.q_prev.cast<float>(), kp = in.k_prev.cast<float>();
  const MatrixF qf = in.q.cast<float>(), kf = in.k.cast<float>();
  struct Case {
    const char* name;
    QKIncrementSpectrum spectrum;
    double tolerance;
  };
  const Case cases[] = {
      {"double", ComputeQKIncrementSpectrum<double>(in.q_prev, in.k_prev, in.q, in.k, options), 1e-6},
      {"float", ComputeQKIncrementSpectrum<float>(qp, kp, qf, kf, options), 1e-3},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const QKIncrementSpectrum& s = c.spectrum;
    ASSERT_FALSE(s.zero_increment);
    ASSERT_EQ(s.singular_values.size(), core_size);
    for (size_t i = 0; i < core_size; ++i) {
      EXPECT_NEAR(s.singular_values[i], dense.singular_values[i], c.tolerance * dense.singular_values[0]) << i;
    }
    ExpectRelative(s.normalized_entropy, dense.normalized_entropy, c.tolerance, "entropy");
    ExpectRelative(s.effective_rank, dense.effective_rank, c.tolerance, "effective rank");
    ExpectRelative(s.top1_share, dense.top1_share, c.tolerance, "top1 share");
    ExpectRelative(s.second_order_ratio, dense.second_order_ratio, c.tolerance, "second-order ratio");
    ASSERT_EQ(s.top_vector.size(), static_cast<size_t>(n));
    double dot = 0, norm = 0;
    for (int i = 0; i < n; ++i) {
      dot += s.top_vector[i] * dense.top_vector[i];
      norm += s.top_vector[i] * s.top_vector[i];
    }
    EXPECT_NEAR(norm, 1.0, 1e-9);
    EXPECT_GE(std::abs(dot), 1.0 - c.tolerance) << "top vector";
    EXPECT_NEAR(TopVectorOverlap(s.top_vector, dense.top_vector), std::abs(dot), 1e-12);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, FactoredVsDense,
    ::testing::Combine(::testing::Values(16, 64, 257), ::testing::Values(4, 16, 64),
                       ::testing::Values(InputKind::kRandom, InputKind::kLowRankIncrement,
                                         InputKind::kLowRankEverything, InputKind::kSmallIncrement)),
    [](const auto& info) {
      return std::string("n") + std::to_string(std::get<0>(info.param)) + "_d" + std::to_string(std::get<1>(info.param)) +
             "_" + KindName(std::get<2>(info.param));
    });

// The Gram route itself (ComputeQKIncrementSpectrum takes it for float inputs
// with n >= 2d), on every shape, n < 2d included (there every A is
// rank-deficient: its 2d columns span at most n dimensions), and on factors
// built to defeat a plain Cholesky: repeated key columns, queries of rank
// d/2, unchanged queries (dQ = 0), and increments 1e-5 of the values. Checked
// against the dense SVD in double, an independent algorithm on the n x n dS1.
class GramVsDense : public ::testing::TestWithParam<std::tuple<int, int, InputKind>> {};

TEST_P(GramVsDense, AgreesWithDenseReference) {
  const auto [n, d, kind] = GetParam();
  const Inputs in = MakeInputs(n, d, kind, 7000u * n + 10u * d + static_cast<unsigned>(kind));
  const QKSpectrumOptions options{.compute_top_vector = true};
  const QKIncrementSpectrum dense = ComputeQKIncrementSpectrumDense(in.q_prev, in.k_prev, in.q, in.k, options);
  ASSERT_FALSE(dense.zero_increment);
  const size_t core_size = static_cast<size_t>(std::min(n, 2 * d));
  // The top vector is defined only up to sign and only with a gap below sigma_1.
  const bool gap = dense.singular_values.size() < 2 ||
                   dense.singular_values[1] < (1 - 1e-2) * dense.singular_values[0];

  const MatrixF qp = in.q_prev.cast<float>(), kp = in.k_prev.cast<float>();
  const MatrixF qf = in.q.cast<float>(), kf = in.k.cast<float>();
  struct Case {
    const char* name;
    QKIncrementSpectrum spectrum;
    double tolerance;
  };
  // Float inputs: the detector's tolerance. Double inputs: the route squares
  // the factors and drops columns of A with less than 1e-6 of their norm
  // outside the span of the others (in LowRankIncrement, the float rounding
  // of a rank-1 dQ, whose ~1e-7 sigma the dense SVD keeps): 1e-4, not 1e-6.
  const Case cases[] = {
      {"float", ComputeQKIncrementSpectrumGram<float>(qp, kp, qf, kf, options), 1e-3},
      {"double", ComputeQKIncrementSpectrumGram<double>(in.q_prev, in.k_prev, in.q, in.k, options), 1e-4},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const QKIncrementSpectrum& s = c.spectrum;
    ASSERT_FALSE(s.zero_increment);
    ASSERT_EQ(s.singular_values.size(), core_size);
    for (size_t i = 0; i < core_size; ++i) {
      EXPECT_NEAR(s.singular_values[i], dense.singular_values[i], c.tolerance * dense.singular_values[0]) << i;
    }
    ExpectRelative(s.normalized_entropy, dense.normalized_entropy, c.tolerance, "entropy");
    ExpectRelative(s.effective_rank, dense.effective_rank, c.tolerance, "effective rank");
    ExpectRelative(s.top1_share, dense.top1_share, c.tolerance, "top1 share");
    if (kind == InputKind::kQueriesUnchanged) {
      EXPECT_EQ(s.second_order_ratio, 0.0);  // dQ = 0: no second-order term
    } else {
      ExpectRelative(s.second_order_ratio, dense.second_order_ratio, c.tolerance, "second-order ratio");
    }
    ASSERT_EQ(s.top_vector.size(), static_cast<size_t>(n));
    if (gap) {
      EXPECT_GE(TopVectorOverlap(s.top_vector, dense.top_vector), 1.0 - c.tolerance) << "top vector";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GramVsDense,
    ::testing::Combine(::testing::Values(16, 64, 257, 512), ::testing::Values(4, 16, 64),
                       ::testing::Values(InputKind::kRandom, InputKind::kLowRankIncrement,
                                         InputKind::kLowRankEverything, InputKind::kSmallIncrement,
                                         InputKind::kRepeatedKeyColumns, InputKind::kLowRankQueries,
                                         InputKind::kQueriesUnchanged, InputKind::kTinyIncrement)),
    [](const auto& info) {
      return std::string("n") + std::to_string(std::get<0>(info.param)) + "_d" + std::to_string(std::get<1>(info.param)) +
             "_" + KindName(std::get<2>(info.param));
    });

// The routes agree with each other where the detector switches between them
// (float at n = 2d - 1 takes the Householder route, at n = 2d the Gram route).
TEST(GramSpectrum, DetectorRouteSwitchesAtTwiceTheHeadDimension) {
  for (int n : {31, 32}) {
    const Inputs in = MakeInputs(n, 16, InputKind::kSmallIncrement, 5u + static_cast<unsigned>(n));
    const MatrixF qp = in.q_prev.cast<float>(), kp = in.k_prev.cast<float>();
    const MatrixF qf = in.q.cast<float>(), kf = in.k.cast<float>();
    const QKIncrementSpectrum routed = ComputeQKIncrementSpectrum<float>(qp, kp, qf, kf);
    const QKIncrementSpectrum expected = n < 32 ? ComputeQKIncrementSpectrumHouseholder<float>(qp, kp, qf, kf)
                                                : ComputeQKIncrementSpectrumGram<float>(qp, kp, qf, kf);
    EXPECT_EQ(routed.singular_values, expected.singular_values) << n;
  }
}

// G_B computed once (ComputeQKKeyGram) and passed to the spectra of several
// query heads of one K gives, bit for bit, what each spectrum computes alone:
// at order one, where the Grams are rescaled (1e30), with K unchanged (dK = 0,
// so the increment is dQ K0^T only) and with nothing changed (zero increment).
TEST(GramSpectrum, SharedKeyGramGivesWhatEachHeadComputesAlone) {
  std::mt19937 rng(23);
  constexpr int kTokens = 96, kDim = 16;
  for (double magnitude : {1.0, 1e30}) {
    for (bool k_moves : {true, false}) {
      SCOPED_TRACE(testing::Message() << "magnitude " << magnitude << ", k moves " << k_moves);
      const MatrixF k_prev = (magnitude * Gaussian(kTokens, kDim, rng)).cast<float>();
      const MatrixF k = k_moves ? MatrixF(k_prev + (0.05 * magnitude * Gaussian(kTokens, kDim, rng)).cast<float>())
                                : k_prev;
      QKKeyGram key;
      ComputeQKKeyGram<float>(k_prev, k, key);
      EXPECT_EQ(key.exponent != 0, magnitude != 1.0);
      for (int head = 0; head < 3; ++head) {
        const MatrixF q_prev = Gaussian(kTokens, kDim, rng).cast<float>();
        // The last head's Q does not move: with K unchanged its increment is zero.
        const MatrixF q = head == 2 ? q_prev : MatrixF(q_prev + (0.05 * Gaussian(kTokens, kDim, rng)).cast<float>());
        const QKIncrementSpectrum alone =
            ComputeQKIncrementSpectrum<float>(q_prev, k_prev, q, k, {.compute_top_vector = true});
        const QKIncrementSpectrum shared = ComputeQKIncrementSpectrum<float>(
            q_prev, k_prev, q, k, {.compute_top_vector = true, .key_gram = &key});
        EXPECT_EQ(shared.zero_increment, alone.zero_increment) << head;
        EXPECT_EQ(alone.zero_increment, head == 2 && !k_moves) << head;
        EXPECT_EQ(shared.singular_values, alone.singular_values) << head;
        EXPECT_EQ(shared.top_vector, alone.top_vector) << head;
        EXPECT_EQ(shared.second_order_ratio, alone.second_order_ratio) << head;
        EXPECT_EQ(shared.normalized_entropy, alone.normalized_entropy) << head;
      }
    }
  }
}

// Statistics of the Gram route are scale-free even where float arithmetic
// would overflow (3e38 values whose increments are 6e38) or squares would
// underflow (1e-30): the route works in double and rescales its Grams.
TEST(GramSpectrum, ExtremeMagnitudes) {
  const Inputs in = MakeInputs(128, 16, InputKind::kRandom, 91);
  const QKIncrementSpectrum reference = ComputeQKIncrementSpectrumDense(in.q_prev, in.k_prev, in.q, in.k);
  for (double magnitude : {1e-30, 1e30}) {
    SCOPED_TRACE(magnitude);
    auto scaled = [&](const MatrixD& m) { return MatrixF((magnitude * m).cast<float>()); };
    const QKIncrementSpectrum s = ComputeQKIncrementSpectrumGram<float>(scaled(in.q_prev), scaled(in.k_prev),
                                                                        scaled(in.q), scaled(in.k));
    ASSERT_FALSE(s.zero_increment);
    ExpectRelative(s.normalized_entropy, reference.normalized_entropy, 1e-3, "entropy");
    ExpectRelative(s.top1_share, reference.top1_share, 1e-3, "top1 share");
    ExpectRelative(s.second_order_ratio, reference.second_order_ratio, 1e-3, "second-order ratio");
    ExpectRelative(s.singular_values[0], magnitude * magnitude * reference.singular_values[0], 1e-3, "sigma_1");
  }
  // Q0 = +-3e38 and Q = -Q0: dQ = -2 Q0 overflows float, not double.
  MatrixF q_prev = (3e38 * in.q_prev.array().sign()).matrix().cast<float>();
  const MatrixF q = -q_prev, k_prev = in.k_prev.cast<float>(), k = in.k.cast<float>();
  const QKIncrementSpectrum huge = ComputeQKIncrementSpectrumGram<float>(q_prev, k_prev, q, k);
  const QKIncrementSpectrum huge_reference =
      ComputeQKIncrementSpectrumDense(q_prev.cast<double>(), k_prev.cast<double>(), q.cast<double>(), k.cast<double>());
  ExpectRelative(huge.normalized_entropy, huge_reference.normalized_entropy, 1e-3, "entropy at 3e38");
  ExpectRelative(huge.singular_values[0], huge_reference.singular_values[0], 1e-3, "sigma_1 at 3e38");
}

TEST(GramSpectrum, ZeroIncrementAndZeroFactors) {
  std::mt19937 rng(21);
  const MatrixF q = Gaussian(40, 8, rng).cast<float>(), k = Gaussian(40, 8, rng).cast<float>();
  const QKIncrementSpectrum same = ComputeQKIncrementSpectrumGram<float>(q, k, q, k, {.compute_top_vector = true});
  EXPECT_TRUE(same.zero_increment);
  EXPECT_TRUE(same.singular_values.empty());
  EXPECT_TRUE(same.top_vector.empty());
  const MatrixF zero = MatrixF::Zero(40, 8);
  EXPECT_TRUE(ComputeQKIncrementSpectrumGram<float>(zero, k, zero, q).zero_increment);  // A = 0
}

// A rank-one increment: only dQ moves, along one token direction u and one
// feature direction v, so dS1 = u (K0 v)^T / sqrt(d) has exactly one singular
// value, ||u|| ||K0 v|| / sqrt(d), and top vector u / ||u||.
TEST(FactoredSpectrum, RankOneIncrementIsExact) {
  const int n = 32, d = 8;
  std::mt19937 rng(7);
  const MatrixD q_prev = RoundToFloat(Gaussian(n, d, rng));
  const MatrixD k_prev = RoundToFloat(Gaussian(n, d, rng));
  MatrixD u = Gaussian(n, 1, rng), v = Gaussian(1, d, rng);
  const MatrixD q = q_prev + u * v;
  const QKIncrementSpectrum s =
      ComputeQKIncrementSpectrum<double>(q_prev, k_prev, q, k_prev, {.compute_top_vector = true});
  ASSERT_FALSE(s.zero_increment);
  const double expected_sigma = u.norm() * (k_prev * v.transpose()).norm() / std::sqrt(double(d));
  EXPECT_NEAR(s.singular_values[0], expected_sigma, 1e-12 * expected_sigma);
  EXPECT_LT(s.singular_values[1], 1e-12 * expected_sigma);
  EXPECT_NEAR(s.top1_share, 1.0, 1e-12);
  EXPECT_NEAR(s.effective_rank, 1.0, 1e-9);
  EXPECT_NEAR(s.second_order_ratio, 0.0, 1e-15);  // dK = 0
  const Eigen::VectorXd u_unit = u.col(0) / u.norm();
  double dot = 0;
  for (int i = 0; i < n; ++i) dot += s.top_vector[i] * u_unit[i];
  EXPECT_NEAR(std::abs(dot), 1.0, 1e-12);
}

// dQ = c Q0 and dK = c K0 give dS1 = 2c Q0 K0^T and dQ dK^T = c^2 Q0 K0^T,
// so the second-order ratio is exactly c / 2.
TEST(FactoredSpectrum, SecondOrderRatioOfUniformScaling) {
  const int n = 40, d = 8;
  std::mt19937 rng(11);
  const MatrixD q_prev = Gaussian(n, d, rng), k_prev = Gaussian(n, d, rng);
  const double c = 0.125;
  const QKIncrementSpectrum s =
      ComputeQKIncrementSpectrum<double>(q_prev, k_prev, (1 + c) * q_prev, (1 + c) * k_prev);
  EXPECT_NEAR(s.second_order_ratio, c / 2, 1e-12);
}

// Statistics do not depend on the magnitude of Q and K; the float path must
// survive magnitudes whose squares leave float's range (1e-20 and 1e18 here).
TEST(FactoredSpectrum, ExtremeMagnitudesInFloat) {
  const Inputs in = MakeInputs(64, 16, InputKind::kRandom, 77);
  const QKIncrementSpectrum reference = ComputeQKIncrementSpectrumDense(in.q_prev, in.k_prev, in.q, in.k);
  for (double magnitude : {1e-20, 1e18}) {
    SCOPED_TRACE(magnitude);
    auto scaled = [&](const MatrixD& m) { return MatrixF((magnitude * m).cast<float>()); };
    const QKIncrementSpectrum s = ComputeQKIncrementSpectrum<float>(scaled(in.q_prev), scaled(in.k_prev),
                                                                    scaled(in.q), scaled(in.k));
    ASSERT_FALSE(s.zero_increment);
    ExpectRelative(s.normalized_entropy, reference.normalized_entropy, 1e-3, "entropy");
    ExpectRelative(s.top1_share, reference.top1_share, 1e-3, "top1 share");
    ExpectRelative(s.second_order_ratio, reference.second_order_ratio, 1e-3, "second-order ratio");
    // sigma scales with the product of the Q and K magnitudes.
    ExpectRelative(s.singular_values[0], magnitude * magnitude * reference.singular_values[0], 1e-3, "sigma_1");
  }
}

// A = [dQ | Q0] = 0 (nothing in Q) makes dS1 = 0 even though K moved.
TEST(FactoredSpectrum, ZeroQueriesGiveZeroIncrement) {
  std::mt19937 rng(8);
  const MatrixD zero = MatrixD::Zero(10, 4);
  const MatrixD k_prev = Gaussian(10, 4, rng), k = Gaussian(10, 4, rng);
  EXPECT_TRUE(ComputeQKIncrementSpectrum<double>(zero, k_prev, zero, k).zero_increment);
}

TEST(FactoredSpectrum, ZeroIncrementIsFlaggedWithoutNaN) {
  std::mt19937 rng(3);
  const MatrixD q = Gaussian(20, 4, rng), k = Gaussian(20, 4, rng);
  for (const QKIncrementSpectrum& s :
       {ComputeQKIncrementSpectrum<double>(q, k, q, k, {.compute_top_vector = true}),
        ComputeQKIncrementSpectrum<float>(q.cast<float>(), k.cast<float>(), q.cast<float>(),
                                          k.cast<float>(), {.compute_top_vector = true}),
        ComputeQKIncrementSpectrumDense(q, k, q, k, {.compute_top_vector = true})}) {
    EXPECT_TRUE(s.zero_increment);
    EXPECT_TRUE(s.singular_values.empty());
    EXPECT_TRUE(s.top_vector.empty());
    EXPECT_EQ(s.normalized_entropy, 0.0);
    EXPECT_EQ(s.effective_rank, 0.0);
    EXPECT_EQ(s.top1_share, 0.0);
    EXPECT_EQ(s.second_order_ratio, 0.0);
  }
}

TEST(FactoredSpectrum, TopVectorOnlyWhenRequested) {
  std::mt19937 rng(5);
  const MatrixD q_prev = Gaussian(20, 4, rng), k_prev = Gaussian(20, 4, rng);
  const MatrixD q = q_prev + 0.1 * Gaussian(20, 4, rng);
  EXPECT_TRUE(ComputeQKIncrementSpectrum<double>(q_prev, k_prev, q, k_prev).top_vector.empty());
  EXPECT_EQ(ComputeQKIncrementSpectrum<double>(q_prev, k_prev, q, k_prev, {.compute_top_vector = true})
                .top_vector.size(),
            20u);
}

// The Gram kernel against sums in long double, on shapes that exercise every
// tile edge (columns not a multiple of 8 or 6, rows across the 32-row
// chunks), a padded stride and leading dimension, exact zero columns (must
// stay exactly zero: the Gram route tests them) and extreme scales.
TEST(GramLowerTriangle, MatchesLongDoubleSums) {
  std::mt19937 rng(17);
  for (int rows : {0, 1, 5, 31, 32, 33, 100, 257}) {
    for (int cols : {1, 2, 5, 7, 8, 9, 13, 16, 63, 128, 130}) {
      for (double scale : {1.0, 1e-150, 1e150}) {
        SCOPED_TRACE(testing::Message() << "rows " << rows << " cols " << cols << " scale " << scale);
        const int stride = cols + 3, ld = cols + 2;
        std::vector<double> x(static_cast<size_t>(std::max(rows, 1) * stride), 7.0);  // padding stays 7
        std::normal_distribution<double> normal;
        for (int i = 0; i < rows; ++i)
          for (int j = 0; j < cols; ++j) x[i * stride + j] = j % 5 == 3 ? 0.0 : scale * normal(rng);
        std::vector<double> gram(static_cast<size_t>(ld * cols), -1.0);
        GramLowerTriangle(x.data(), rows, cols, stride, gram.data(), ld);
        for (int j = 0; j < cols; ++j) {
          for (int i = j; i < cols; ++i) {
            long double sum = 0, bound = 0;
            for (int k = 0; k < rows; ++k) {
              sum += static_cast<long double>(x[k * stride + i]) * x[k * stride + j];
              bound += std::abs(static_cast<long double>(x[k * stride + i]) * x[k * stride + j]);
            }
            const double got = gram[j * ld + i];
            if (i % 5 == 3 || j % 5 == 3 || rows == 0) {
              ASSERT_EQ(got, 0.0) << i << "," << j;
            } else {
              ASSERT_LE(std::abs(got - static_cast<double>(sum)), 1e-15 * (rows + 1) * static_cast<double>(bound))
                  << i << "," << j;
            }
          }
          for (int i = cols; i < ld; ++i) ASSERT_EQ(gram[j * ld + i], -1.0) << "wrote past cols";
        }
      }
    }
  }
}

// The congruence kernel against Eigen's triangular products, on sizes that
// leave partial tiles (not multiples of 8 or 6) and span several k chunks.
TEST(UpperCongruence, MatchesEigenProducts) {
  std::mt19937 rng(23);
  for (int m : {1, 2, 5, 8, 13, 31, 64, 100, 128, 130}) {
    SCOPED_TRACE(testing::Message() << "m " << m);
    const Eigen::MatrixXd x = Gaussian(m, m, rng);
    const Eigen::MatrixXd g = x + x.transpose();  // symmetric, indefinite
    Eigen::MatrixXd u = Gaussian(m, m, rng);
    u.triangularView<Eigen::StrictlyLower>().setZero();
    RowMajorMatrix<double> w(m, m);
    Eigen::MatrixXd c = Eigen::MatrixXd::Constant(m, m, 99.0);
    UpperCongruence(u.data(), g.data(), m, w.data(), c.data());
    const Eigen::MatrixXd w_expected = g * u.transpose();
    const Eigen::MatrixXd c_expected = u * w_expected;
    const double scale = u.norm() * u.norm() * g.norm();
    ASSERT_LE((w - w_expected).norm(), 1e-14 * u.norm() * g.norm() * m);
    for (int j = 0; j < m; ++j)
      for (int i = j; i < m; ++i) ASSERT_NEAR(c(i, j), c_expected(i, j), 1e-14 * scale) << i << "," << j;
  }
}

// The tile-kernel Cholesky against Eigen's LLT: L entry by entry (row i's
// entries are at most sqrt(G_ii), so errors are measured against that, which
// covers graded matrices), U exactly L^T with a zero strict lower triangle,
// and g untouched. Sizes around the 6-column panels and the 8-row tiles;
// grading over 1e+-40, scales 1e+-150, a nearly singular G; then the
// matrices it must reject (a zero column, an indefinite or zero matrix, NaN).
TEST(CholeskyLower, MatchesEigenLltAndRejectsNonDefinite) {
  using Index = Eigen::Index;
  std::mt19937 rng(31);
  struct Case {
    std::string name;
    Eigen::MatrixXd g;
  };
  std::vector<Case> cases;
  for (int m : {1, 2, 5, 6, 7, 8, 13, 31, 64, 128, 130}) {
    const Eigen::MatrixXd x = Gaussian(3 * m, m, rng);
    cases.push_back({"random m=" + std::to_string(m), x.transpose() * x});
  }
  {
    const Eigen::MatrixXd x = Gaussian(256, 128, rng);
    Eigen::VectorXd grading(128);
    for (int i = 0; i < 128; ++i) grading[i] = std::pow(10.0, 40.0 * std::sin(i));
    cases.push_back({"graded 1e+-40", grading.asDiagonal() * (x.transpose() * x) * grading.asDiagonal()});
  }
  for (double scale : {1e-150, 1e150}) {
    const Eigen::MatrixXd x = Gaussian(200, 100, rng);
    cases.push_back({"scaled " + std::to_string(std::log10(scale)), scale * (x.transpose() * x)});
  }
  {
    // Two nearly equal columns: PD with a pivot ~1e-12 of the rest.
    Eigen::MatrixXd x = Gaussian(300, 64, rng);
    x.col(40) = x.col(3) + 1e-6 * x.col(40);
    cases.push_back({"nearly singular", x.transpose() * x});
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const Index m = c.g.rows();
    Eigen::MatrixXd g = c.g;
    g.triangularView<Eigen::StrictlyUpper>().setConstant(std::nan(""));  // only the lower triangle is read
    const Eigen::MatrixXd g_before = g;
    Eigen::MatrixXd l = Eigen::MatrixXd::Constant(m, m, 7.0), u = Eigen::MatrixXd::Constant(m, m, 7.0);
    ASSERT_TRUE(CholeskyLower(g.data(), m, l.data(), u.data()));
    const Eigen::LLT<Eigen::MatrixXd, Eigen::Lower> llt(c.g);
    ASSERT_EQ(llt.info(), Eigen::Success);
    const Eigen::MatrixXd expected = llt.matrixL();
    // Entries below a tiny pivot are ill-determined (~eps cond(G)^(1/2));
    // there L L^T = G (backward stability) and the pivot itself are checked.
    const bool ill_conditioned = c.name == "nearly singular";
    const Eigen::MatrixXd lower = l.triangularView<Eigen::Lower>();
    const Eigen::MatrixXd product = lower * lower.transpose();
    for (Index i = 0; i < m; ++i) {
      const double row_scale = std::sqrt(c.g(i, i));
      for (Index j = 0; j <= i; ++j) {
        const double scale = row_scale * std::sqrt(c.g(j, j));
        ASSERT_NEAR(product(i, j), c.g(i, j), 1e-14 * static_cast<double>(m) * scale) << i << "," << j;
        if (!ill_conditioned) {
          ASSERT_NEAR(l(i, j), expected(i, j), 1e-9 * row_scale) << i << "," << j;
        }
        ASSERT_EQ(u(j, i), l(i, j)) << i << "," << j;
      }
      for (Index j = 0; j < i; ++j) ASSERT_EQ(u(i, j), 0.0) << i << "," << j;
    }
    if (ill_conditioned) {
      EXPECT_NEAR(l(40, 40), expected(40, 40), 1e-2 * expected(40, 40));
    }
    for (Index j = 0; j < m; ++j) {
      for (Index i = j; i < m; ++i) ASSERT_EQ(g(i, j), g_before(i, j));
    }
  }
  auto rejects = [](Eigen::MatrixXd g) {
    const Index m = g.rows();
    Eigen::MatrixXd l(m, m), u(m, m);
    return !CholeskyLower(g.data(), m, l.data(), u.data());
  };
  {
    Eigen::MatrixXd x = Gaussian(100, 50, rng);
    x.col(20).setZero();  // exact zero pivot at 20, in the middle of a panel
    EXPECT_TRUE(rejects(x.transpose() * x));
  }
  {
    const Eigen::MatrixXd x = Gaussian(100, 50, rng);
    Eigen::MatrixXd g = x.transpose() * x;
    g(37, 37) = -g(37, 37);
    EXPECT_TRUE(rejects(g));
    g = x.transpose() * x;
    g(44, 44) = std::nan("");
    EXPECT_TRUE(rejects(g));
    g = x.transpose() * x;
    g(45, 10) = g(10, 45) = 10 * std::sqrt(g(10, 10) * g(45, 45));  // 2 x 2 minor indefinite
    EXPECT_TRUE(rejects(g));
  }
  EXPECT_TRUE(rejects(Eigen::MatrixXd::Zero(9, 9)));
}

// Root-free QL against Eigen's implicit QR on the same tridiagonal (an
// independent algorithm), on the hard cases: repeated and clustered
// eigenvalues, splits (zero off-diagonals), zero diagonals, rank deficiency,
// graded entries and scales whose fourth powers leave double's range.
TEST(TridiagonalEigenvalues, MatchesEigenOnHardCases) {
  std::mt19937 rng(29);
  std::normal_distribution<double> normal;
  struct Case {
    std::string name;
    std::vector<double> diag, off;
  };
  std::vector<Case> cases;
  for (int n : {1, 2, 3, 10, 128}) {
    Case c{"random n=" + std::to_string(n), {}, {}};
    for (int i = 0; i < n; ++i) c.diag.push_back(normal(rng));
    for (int i = 0; i + 1 < n; ++i) c.off.push_back(normal(rng));
    cases.push_back(c);
  }
  {
    Case c{"repeated: identity plus tiny couplings", std::vector<double>(64, 1.0), std::vector<double>(63, 1e-17)};
    cases.push_back(c);
  }
  {
    Case c{"clustered: Wilkinson W+ 41", {}, std::vector<double>(40, 1.0)};
    for (int i = 0; i < 41; ++i) c.diag.push_back(std::abs(20 - i));
    cases.push_back(c);
  }
  {
    Case c{"splits: every third coupling zero", {}, {}};
    for (int i = 0; i < 60; ++i) c.diag.push_back(i % 4 == 0 ? 2.0 : normal(rng));
    for (int i = 0; i < 59; ++i) c.off.push_back(i % 3 == 0 ? 0.0 : normal(rng));
    cases.push_back(c);
  }
  {
    Case c{"zero diagonal (Golub-Kahan form)", std::vector<double>(50, 0.0), {}};
    for (int i = 0; i < 49; ++i) c.off.push_back(1.0 + 0.01 * i);
    cases.push_back(c);
  }
  {
    // T = B^T B for an upper bidiagonal B with zero diagonal entries: PSD
    // with exact zero eigenvalues, as C is for a rank-deficient increment.
    const int n = 40;
    std::vector<double> b(n), e(n - 1);
    for (int i = 0; i < n; ++i) b[i] = i % 5 == 2 ? 0.0 : normal(rng);
    for (int i = 0; i + 1 < n; ++i) e[i] = normal(rng);
    Case c{"rank-deficient PSD", std::vector<double>(n), std::vector<double>(n - 1)};
    for (int i = 0; i < n; ++i) c.diag[i] = b[i] * b[i] + (i > 0 ? e[i - 1] * e[i - 1] : 0.0);
    for (int i = 0; i + 1 < n; ++i) c.off[i] = b[i] * e[i];
    cases.push_back(c);
  }
  {
    Case c{"graded 1 .. 1e-30", {}, {}};
    for (int i = 0; i < 31; ++i) c.diag.push_back(std::pow(10.0, -i));
    for (int i = 0; i < 30; ++i) c.off.push_back(std::pow(10.0, -i - 0.5));
    cases.push_back(c);
  }
  // Tridiagonals of PSD matrices with chosen spectra (Eigen's reduction of
  // V diag(lambda) V^T, V a random orthogonal matrix), as the core C gives
  // them: a 128 x 128 with three large eigenvalues over a tight cluster and
  // exact zeros; one with every eigenvalue repeated in pairs; one graded.
  for (int kind = 0; kind < 3; ++kind) {
    const int n = kind == 1 ? 64 : 128;
    Eigen::MatrixXd random(n, n);
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) random(i, j) = normal(rng);
    }
    const Eigen::HouseholderQR<Eigen::MatrixXd> qr(random);
    const Eigen::MatrixXd v = qr.householderQ();
    Eigen::VectorXd lambda(n);
    for (int i = 0; i < n; ++i) {
      if (kind == 0) lambda[i] = i < 3 ? 10.0 * (i + 1) : (i < 100 ? 1e-3 * (1 + 1e-9 * i) : 0.0);
      if (kind == 1) lambda[i] = 1.0 + i / 2;
      if (kind == 2) lambda[i] = std::pow(10.0, -0.25 * i);
    }
    const Eigen::MatrixXd matrix = v * lambda.asDiagonal() * v.transpose();
    const Eigen::Tridiagonalization<Eigen::MatrixXd> reduced(matrix);
    const std::string names[] = {"PSD: 3 large over a cluster and zeros, n=128", "PSD: pairs of equal eigenvalues, n=64",
                                 "PSD: graded 1 .. 1e-32, n=128"};
    Case c{names[kind], {}, {}};
    c.diag.assign(reduced.diagonal().data(), reduced.diagonal().data() + n);
    c.off.assign(reduced.subDiagonal().data(), reduced.subDiagonal().data() + n - 1);
    cases.push_back(c);
  }
  for (int n : {4, 5, 7}) {  // short blocks: the sweeps start and end within a few rows
    Case c{"random short n=" + std::to_string(n), {}, {}};
    for (int i = 0; i < n; ++i) c.diag.push_back(normal(rng));
    for (int i = 0; i + 1 < n; ++i) c.off.push_back(normal(rng));
    cases.push_back(c);
  }
  cases.push_back({"zero matrix", std::vector<double>(8, 0.0), std::vector<double>(7, 0.0)});
  // The first shift (1, from the leading block [[2, 1], [1, 2]]) equals the
  // last diagonal entry: the sweep starts with gamma = 0 (dsterf's c = 0).
  cases.push_back({"sweep starting at gamma = 0", {2, 2, 1}, {1, 1}});
  cases.push_back({"sweep starting at gamma = 0, n=6", {2, 2, 3, -1, 0.5, 1}, {1, 1, 0.5, 2, 1}});
  // Scales by powers of two, so that the reference is the unscaled matrix's
  // eigenvalues scaled exactly (Eigen's tridiagonal QR does not rescale, and
  // squares of 2^-1000 underflow).
  for (int exponent : {-1000, -500, 500, 1000}) {
    Case c{"random scaled by 2^" + std::to_string(exponent), {}, {}};
    for (int i = 0; i < 30; ++i) c.diag.push_back(normal(rng));
    for (int i = 0; i < 29; ++i) c.off.push_back(normal(rng));
    cases.push_back(c);
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const int n = static_cast<int>(c.diag.size());
    const size_t at = c.name.find("2^");
    const int exponent = at == std::string::npos ? 0 : std::stoi(c.name.substr(at + 2));
    std::vector<double> values = c.diag, scratch = c.off;
    for (double& x : values) x = std::ldexp(x, exponent);
    for (double& x : scratch) x = std::ldexp(x, exponent);
    ASSERT_TRUE(TridiagonalEigenvalues(values, scratch));
    std::sort(values.begin(), values.end());
    Eigen::VectorXd expected(n);
    if (n == 1) {
      expected[0] = c.diag[0];
    } else {
      Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> solver;
      solver.computeFromTridiagonal(Eigen::Map<const Eigen::VectorXd>(c.diag.data(), n),
                                    Eigen::Map<const Eigen::VectorXd>(c.off.data(), n - 1), Eigen::EigenvaluesOnly);
      expected = solver.eigenvalues();  // ascending
    }
    for (int i = 0; i < n; ++i) expected[i] = std::ldexp(expected[i], exponent);
    double norm = 0;
    for (int i = 0; i < n; ++i) norm = std::max(norm, std::abs(expected[i]));
    for (int i = 0; i < n; ++i) {
      ASSERT_TRUE(std::isfinite(values[i])) << i;
      EXPECT_NEAR(values[i], expected[i], 8 * n * std::numeric_limits<double>::epsilon() * norm) << i;
    }
  }
}

// The fused tridiagonal reduction: T and the reflectors (read with Eigen's
// HouseholderSequence, as the top vector reads them) must reproduce the input,
// Q T Q^T = A, and T's eigenvalues must be A's (Eigen's dense solver on A).
// Hard cases: zero, diagonal (every reflector trivial), rank one, repeated
// eigenvalues (identity plus rank one), a PSD Gram of rank 3, and extreme scales.
TEST(TridiagonalizeLower, ReproducesTheMatrixAndItsEigenvalues) {
  std::mt19937 rng(31);
  struct Case {
    std::string name;
    Eigen::MatrixXd a;
  };
  std::vector<Case> cases;
  for (int n : {1, 2, 3, 4, 5, 7, 33, 128}) {
    const Eigen::MatrixXd x = Gaussian(n, n, rng);
    cases.push_back({"random n=" + std::to_string(n), x + x.transpose()});
  }
  cases.push_back({"zero", Eigen::MatrixXd::Zero(20, 20)});
  {
    Eigen::MatrixXd diagonal = Eigen::MatrixXd::Zero(20, 20);
    for (int i = 0; i < 20; ++i) diagonal(i, i) = i - 7.5;
    cases.push_back({"diagonal", diagonal});
  }
  {
    const Eigen::MatrixXd u = Gaussian(40, 1, rng);
    cases.push_back({"rank one", u * u.transpose()});
    cases.push_back({"identity plus rank one", Eigen::MatrixXd::Identity(40, 40) + u * u.transpose()});
  }
  {
    const Eigen::MatrixXd x = Gaussian(128, 3, rng);
    cases.push_back({"PSD of rank 3", x * x.transpose()});
  }
  for (double scale : {1e-150, 1e150}) {
    const Eigen::MatrixXd x = Gaussian(64, 64, rng);
    cases.push_back({"scaled by " + std::to_string(std::log10(scale)), scale * (x + x.transpose())});
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const int n = static_cast<int>(c.a.rows());
    Eigen::MatrixXd packed = c.a;
    packed.triangularView<Eigen::StrictlyUpper>().setConstant(std::nan(""));  // must not be read
    Eigen::VectorXd h(std::max(n - 1, 1));
    TridiagonalizeLower(packed.data(), n, h.data());
    Eigen::MatrixXd t = Eigen::MatrixXd::Zero(n, n);
    for (int i = 0; i < n; ++i) t(i, i) = packed(i, i);
    for (int i = 0; i + 1 < n; ++i) t(i + 1, i) = t(i, i + 1) = packed(i + 1, i);
    Eigen::MatrixXd q = Eigen::MatrixXd::Identity(n, n);
    if (n >= 2) {
      const Eigen::VectorXd coefficients = h.head(n - 1);  // the sequence keeps references
      packed.triangularView<Eigen::StrictlyUpper>().setZero();
      Eigen::HouseholderSequence<Eigen::MatrixXd, Eigen::VectorXd> reflectors(packed, coefficients);
      reflectors.setLength(n - 1).setShift(1);
      q.applyOnTheLeft(reflectors);
    }
    const double norm = std::max(c.a.norm(), std::numeric_limits<double>::min());
    EXPECT_LE((q * t * q.transpose() - c.a).norm(), 1e-13 * n * norm) << "Q T Q^T != A";
    EXPECT_LE((q.transpose() * q - Eigen::MatrixXd::Identity(n, n)).norm(), 1e-13 * n) << "Q not orthogonal";
    const Eigen::VectorXd expected = Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd>(c.a, Eigen::EigenvaluesOnly).eigenvalues();
    const Eigen::VectorXd actual = Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd>(t, Eigen::EigenvaluesOnly).eigenvalues();
    for (int i = 0; i < n; ++i) EXPECT_NEAR(actual[i], expected[i], 1e-13 * n * norm) << i;
  }
}

TEST(TopVectorOverlap, IgnoresSign) {
  const std::vector<double> a = {0.6, 0.8, 0.0};
  const std::vector<double> b = {-0.6, -0.8, 0.0};
  const std::vector<double> c = {0.0, 0.0, 1.0};
  EXPECT_NEAR(TopVectorOverlap(a, b), 1.0, 1e-15);
  EXPECT_EQ(TopVectorOverlap(a, c), 0.0);
}

}  // namespace
}  // namespace foreshock::detectors
