// Spectrum of the first-order increment of one attention head's QK form
// (docs/DESIGN.md §1.1), without forming the n x n matrix.
//
// With previous Q0, K0 and current Q, K (each [n, d], same probe tokens):
//   dQ = Q - Q0, dK = K - K0,
//   dS1 = (dQ K0^T + Q0 dK^T) / sqrt(d) = A B^T / sqrt(d),
//   A = [dQ | Q0], B = [K0 | dK]  (n x 2d).
// Two routes, both O(n d^2 + d^3) instead of O(n^3):
// - Gram (float inputs, n >= 2d): G_A = A^T A and G_B = B^T B in double,
//   G_B = L L^T (Cholesky); then dS1^T dS1 = Qb (L^T G_A L / d) Qb^T with Qb
//   orthonormal, so the sigma_i^2 are the eigenvalues of the 2d x 2d core
//   C = L^T G_A L / d. L depends on K alone, so the query heads of one K head
//   share it. When B is numerically rank-deficient (e.g. dK = 0), the roles
//   swap: G_A = F F^T (rank-revealing when A is rank-deficient too) and
//   C = F^T G_B F / d (r x r, r = rank A <= 2d).
// - Householder: thin QR A = Qa Ra, B = Qb Rb, dS1 = Qa (Ra Rb^T / sqrt(d)) Qb^T,
//   so the sigma_i are those of the small core Ra Rb^T / sqrt(d), of size
//   min(n, 2d). Squares nothing: full accuracy in the working precision.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "detectors/dtype.h"

namespace foreshock::detectors {

// The part of the Gram route that depends on K alone: G_B = B^T B for
// B = [K0 | dK], scaled for the core (below), and its Cholesky factor. The
// query heads of one grouped-query K head, sampled against the same previous
// K, have the same G_B: compute it once (ComputeQKKeyGram) and pass it to each
// head's spectrum.
struct QKKeyGram {
  std::ptrdiff_t tokens = 0, head_dim = 0;
  Eigen::MatrixXd gram;  // 2d x 2d, both triangles, times 4^-exponent
  int exponent = 0;      // a power of two taken out of B (0 for inputs of order one)
  double max_k = 0;      // largest squared column norm of B, before the scaling
  double max_dk = 0;     // largest squared column norm of dK, before the scaling
  // G_B = L_B L_B^T, when every column of B keeps a share of its norm above
  // the rank tolerance (otherwise false, and the route factors G_A instead):
  // upper = L_B^T (column-major, strict lower triangle zero).
  bool factored = false;
  Eigen::MatrixXd upper;
};

struct QKSpectrumOptions {
  // Also return the top left singular vector of dS1 (token space). It costs
  // inverse iteration on the core's reduced form plus one product with A (Qa).
  bool compute_top_vector = false;
  // G_B of exactly this k_prev and k (ComputeQKKeyGram), when already
  // computed; used by the Gram route only. The result is bit for bit what
  // the route gives without it.
  const QKKeyGram* key_gram = nullptr;
};

// What a spectrum yields. Conventions for degenerate input:
// `zero_increment` is true when dS1 is exactly zero (no token moved: Q == Q0
// and K == K0, or the increment underflowed). The spectrum then has no shape:
// every statistic stays 0 and the vectors stay empty; callers report nothing.
struct QKIncrementSpectrum {
  bool zero_increment = false;
  // Singular values of dS1, descending. The factored path returns the
  // min(n, 2d) that can be non-zero; the dense reference returns all n.
  std::vector<double> singular_values;
  // H~ = -sum p_i log p_i / log(2d), p_i = sigma_i / sum(sigma); in [0, 1].
  // (When n < 2d the maximum is log(n)/log(2d): the normalization is fixed by
  // the head dimension so that values compare across probe sizes.)
  double normalized_entropy = 0;
  // exp(H), H the unnormalized entropy in nats; in [1, min(n, 2d)].
  double effective_rank = 0;
  // sigma_1^2 / sum(sigma^2): the share of ||dS1||_F^2 in the top direction.
  double top1_share = 0;
  // ||dQ dK^T||_F / ||dS1||_F (both with the 1/sqrt(d) scale): how far the
  // first-order increment is from the whole increment.
  double second_order_ratio = 0;
  // Unit n-vector (token space), the top left singular vector of dS1; its
  // sign is arbitrary. Empty unless requested (or on a zero increment).
  std::vector<double> top_vector;
};

// Entropy, effective rank and top-1 share of non-negative singular values
// with a positive sum. `head_dim` fixes the normalization log(2 * head_dim).
struct SpectrumSummary {
  double normalized_entropy = 0;
  double effective_rank = 0;
  double top1_share = 0;
};
SpectrumSummary SummarizeSpectrum(std::span<const double> singular_values, int head_dim);

// The factored computation. All four inputs are [n, d] with the same shape
// and finite values. Float inputs with n >= 2d take the Gram route; double
// inputs, and n < 2d (where the Grams would be larger than dS1), the
// Householder route. If Q - Q0 or K - K0 overflows Scalar there (float inputs
// near 3e38), the statistics are NaN: retry in double. Instantiated for float
// and double; the statistics are returned in double either way.
template <typename Scalar>
QKIncrementSpectrum ComputeQKIncrementSpectrum(const ConstRowMajorRef<Scalar>& q_prev,
                                               const ConstRowMajorRef<Scalar>& k_prev,
                                               const ConstRowMajorRef<Scalar>& q,
                                               const ConstRowMajorRef<Scalar>& k,
                                               const QKSpectrumOptions& options = {});

// The Gram route for any n (header comment), computed in double whatever
// Scalar is; never overflows for finite inputs. Squaring the factors costs
// relative resolution: eigenvalues of C below ~2d eps_double lambda_1 (sigma
// below ~2e-7 sigma_1) are reported as 0, which is finer than float inputs
// resolve but coarser than the Householder route on double inputs.
template <typename Scalar>
QKIncrementSpectrum ComputeQKIncrementSpectrumGram(const ConstRowMajorRef<Scalar>& q_prev,
                                                   const ConstRowMajorRef<Scalar>& k_prev,
                                                   const ConstRowMajorRef<Scalar>& q,
                                                   const ConstRowMajorRef<Scalar>& k,
                                                   const QKSpectrumOptions& options = {});

// G_B for the Gram route (QKKeyGram), from the [n, d] previous and current K.
// Instantiated for float and double.
template <typename Scalar>
void ComputeQKKeyGram(const ConstRowMajorRef<Scalar>& k_prev, const ConstRowMajorRef<Scalar>& k,
                      QKKeyGram& out);

// The Householder route (thin QR of A and B in Scalar, SVD of the core), the
// only route before the Gram one; kept for double inputs, short probes and
// the benchmark's before/after comparison.
template <typename Scalar>
QKIncrementSpectrum ComputeQKIncrementSpectrumHouseholder(const ConstRowMajorRef<Scalar>& q_prev,
                                                          const ConstRowMajorRef<Scalar>& k_prev,
                                                          const ConstRowMajorRef<Scalar>& q,
                                                          const ConstRowMajorRef<Scalar>& k,
                                                          const QKSpectrumOptions& options = {});

// Reference implementation for tests and benchmarks: forms dS1 (n x n) and
// dQ dK^T in double and takes the SVD of dS1 with Eigen's BDCSVD. O(n^3).
QKIncrementSpectrum ComputeQKIncrementSpectrumDense(const ConstRowMajorRef<double>& q_prev,
                                                    const ConstRowMajorRef<double>& k_prev,
                                                    const ConstRowMajorRef<double>& q,
                                                    const ConstRowMajorRef<double>& k,
                                                    const QKSpectrumOptions& options = {});

// SVD of a small square matrix, as the Householder route uses it for its core:
// Householder bidiagonalization in Scalar, then the bidiagonal's singular
// values by Golub-Reinsch implicit-shift QR in double (values only, O(k^2)),
// and the top left singular vector by inverse iteration on the Golub-Kahan
// tridiagonal. Several times faster than Eigen's BDCSVD at 128 x 128 (see
// qk_bench, BM_CoreSvd); absolute accuracy about epsilon(Scalar) * sigma_1.
struct SmallSvd {
  std::vector<double> singular_values;  // descending
  std::vector<double> top_left_vector;  // unit, sign arbitrary; empty unless requested
};
template <typename Scalar>
SmallSvd ComputeSmallSvd(const Eigen::Ref<const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>>& m,
                         bool top_left_vector);

// |<a, b>| for two unit vectors: the overlap of consecutive increments' top
// directions, in [0, 1] and blind to the arbitrary sign of each.
double TopVectorOverlap(std::span<const double> a, std::span<const double> b);

}  // namespace foreshock::detectors
