#include "detectors/qk_spectrum.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>

#include <type_traits>

#include <Eigen/Cholesky>
#include <Eigen/Eigenvalues>
#include <Eigen/QR>
#include <Eigen/SVD>

#include "detectors/qk_linalg.h"

namespace foreshock::detectors {
namespace {

using Eigen::Dynamic;
using Eigen::Index;

// Flips `v` so that its largest-magnitude entry is positive: singular vectors
// are defined up to sign, and a fixed convention makes results reproducible.
void CanonicalizeSign(std::vector<double>& v) {
  if (v.empty()) return;
  size_t largest = 0;
  for (size_t i = 1; i < v.size(); ++i) {
    if (std::abs(v[i]) > std::abs(v[largest])) largest = i;
  }
  if (v[largest] < 0) {
    for (double& x : v) x = -x;
  }
}

void FillSummary(int head_dim, QKIncrementSpectrum& spectrum) {
  const SpectrumSummary summary = SummarizeSpectrum(spectrum.singular_values, head_dim);
  spectrum.normalized_entropy = summary.normalized_entropy;
  spectrum.effective_rank = summary.effective_rank;
  spectrum.top1_share = summary.top1_share;
}

// Eigen's blocked Householder QR with panels of 16 columns: about 15% faster
// than HouseholderQR's fixed 48 for our n x 2d shapes (measured at
// 256..512 x 128). Leaves R in the upper triangle and the reflectors below it.
template <typename Matrix, typename Vector>
void InPlaceHouseholderQR(Matrix& matrix, Vector& reflector_coefficients, Vector& scratch) {
  Eigen::internal::householder_qr_inplace_blocked<Matrix, Vector>::run(
      matrix, reflector_coefficients, /*maxBlockSize=*/16, scratch.data());
}

// The upper-trapezoidal R (min(n, m) x m) stored in the top of a Householder
// QR's packed matrix; below its diagonal lie the Householder vectors.
template <typename Matrix, typename Packed>
Matrix ExtractR(const Packed& packed) {
  const Index rows = std::min(packed.rows(), packed.cols());
  Matrix r = packed.topRows(rows);
  for (Index j = 0; j < rows; ++j) r.col(j).tail(rows - j - 1).setZero();
  return r;
}

// Solves (T - shift I) x = rhs in place, T symmetric tridiagonal with
// diagonal `diagonal` and off-diagonal `off`, by Gaussian elimination with
// partial pivoting (the scheme of LAPACK dgttrf/dgttrs). Inverse iteration
// wants a nearly singular system: an exactly zero pivot is replaced by `tiny`.
void SolveShiftedTridiagonal(const std::vector<double>& diagonal, const std::vector<double>& off,
                             double shift, double tiny, std::vector<double>& x) {
  const size_t n = off.size() + 1;
  std::vector<double> diag(n), lower(off), upper(off), upper2(n, 0.0);
  for (size_t i = 0; i < n; ++i) diag[i] = diagonal[i] - shift;
  std::vector<bool> swapped(n, false);
  for (size_t i = 0; i + 1 < n; ++i) {
    if (std::abs(diag[i]) >= std::abs(lower[i])) {
      if (diag[i] == 0) diag[i] = tiny;
      const double factor = lower[i] / diag[i];
      lower[i] = factor;
      diag[i + 1] -= factor * upper[i];
    } else {
      const double factor = diag[i] / lower[i];
      diag[i] = lower[i];
      lower[i] = factor;
      const double next_upper = upper[i];
      upper[i] = diag[i + 1];
      diag[i + 1] = next_upper - factor * diag[i + 1];
      if (i + 2 < n) {
        upper2[i] = upper[i + 1];
        upper[i + 1] = -factor * upper[i + 1];
      }
      swapped[i] = true;
    }
  }
  if (diag[n - 1] == 0) diag[n - 1] = tiny;
  for (size_t i = 0; i + 1 < n; ++i) {
    if (swapped[i]) std::swap(x[i], x[i + 1]);
    x[i + 1] -= lower[i] * x[i];
  }
  x[n - 1] /= diag[n - 1];
  if (n >= 2) x[n - 2] = (x[n - 2] - upper[n - 2] * x[n - 1]) / diag[n - 2];
  for (size_t i = n - 2; i-- > 0;) {
    x[i] = (x[i] - upper[i] * x[i + 1] - upper2[i] * x[i + 2]) / diag[i];
  }
}

// Golub-Reinsch implicit-shift QR on an upper bidiagonal matrix, values only
// (the iteration of EISPACK's svd). `w` holds the diagonal and receives the
// singular values (non-negative, unsorted); super[i] = B(i, i + 1). O(k^2).
// Expects entries of order one (no overflow care in the rotations). Returns
// false if some value needs more than 75 sweeps (not seen in practice).
bool BidiagonalSingularValues(std::vector<double>& w, const std::vector<double>& super) {
  const int n = static_cast<int>(w.size());
  std::vector<double> rv1(static_cast<size_t>(n), 0.0);  // rv1[i] = B(i - 1, i)
  for (int i = 1; i < n; ++i) rv1[i] = super[i - 1];
  double anorm = 0;
  for (int i = 0; i < n; ++i) anorm = std::max(anorm, std::abs(w[i]) + std::abs(rv1[i]));
  const double negligible = std::numeric_limits<double>::epsilon() * anorm;
  auto hypot = [](double a, double b) { return std::sqrt(a * a + b * b); };
  for (int k = n - 1; k >= 0; --k) {
    for (int sweep = 0;; ++sweep) {
      if (sweep == 75) return false;
      // Find the unreduced block [l, k]: rv1[l] negligible splits it off; a
      // negligible w[l - 1] needs rv1[l] rotated away first.
      bool cancel = true;
      int l = k;
      for (; l >= 0; --l) {
        if (l == 0 || std::abs(rv1[l]) <= negligible) {
          cancel = false;
          break;
        }
        if (std::abs(w[l - 1]) <= negligible) break;
      }
      if (cancel) {
        double c = 0, s = 1;
        for (int i = l; i <= k; ++i) {
          const double f = s * rv1[i];
          rv1[i] *= c;
          if (std::abs(f) <= negligible) break;
          const double g = w[i];
          const double h = hypot(f, g);
          w[i] = h;
          c = g / h;
          s = -f / h;
        }
      }
      double z = w[k];
      if (l == k) {  // converged
        w[k] = std::abs(z);
        break;
      }
      // Wilkinson-style shift from the trailing 2 x 2 minor.
      double x = w[l];
      double y = w[k - 1];
      double g = rv1[k - 1];
      double h = rv1[k];
      double f = ((y - z) * (y + z) + (g - h) * (g + h)) / (2.0 * h * y);
      g = hypot(f, 1.0);
      f = ((x - z) * (x + z) + h * ((y / (f + std::copysign(g, f))) - h)) / x;
      // One implicit QR sweep chasing the bulge down the block.
      double c = 1, s = 1;
      for (int j = l; j < k; ++j) {
        const int i = j + 1;
        g = rv1[i];
        y = w[i];
        h = s * g;
        g = c * g;
        z = hypot(f, h);
        rv1[j] = z;
        double inverse = 1.0 / z;  // one division instead of two: the loop is latency-bound
        c = f * inverse;
        s = h * inverse;
        f = x * c + g * s;
        g = g * c - x * s;
        h = y * s;
        y *= c;
        z = hypot(f, h);
        w[j] = z;
        if (z != 0) {
          inverse = 1.0 / z;
          c = f * inverse;
          s = h * inverse;
        }
        f = c * g + s * y;
        x = c * y - s * g;
      }
      rv1[l] = 0;
      rv1[k] = f;
      w[k] = x;
    }
  }
  return true;
}

void Normalize(std::vector<double>& x) {
  double norm = 0;
  for (double v : x) norm += v * v;
  norm = std::sqrt(norm);
  if (norm > 0) {
    for (double& v : x) v /= norm;
  }
}

// Rank-revealing Cholesky of a symmetric positive semidefinite `g` (m x m,
// lower triangle read): returns F (m x r) with F F^T = g up to the dropped
// part, r the numerical rank. Works on the unit-diagonal matrix D^-1 g D^-1
// (D = sqrt(diag g)), so that the threshold is on the share of a column
// not explained by the columns before it, whatever the columns' scales; a
// zero column is dropped. Pivots lazily: a column is swapped out only when
// its remaining share is at or below `tolerance`, then the column with the
// largest remaining share takes its place; elimination stops when none is
// above. O(m^3 / 3) on full storage: the fallback for rank-deficient factors.
Eigen::MatrixXd PivotedCholeskyFactor(const Eigen::MatrixXd& g, double tolerance) {
  const Index m = g.rows();
  Eigen::VectorXd scale(m);
  for (Index j = 0; j < m; ++j) scale[j] = g(j, j) > 0 ? std::sqrt(g(j, j)) : 0.0;
  Eigen::MatrixXd a(m, m);
  for (Index j = 0; j < m; ++j) {
    for (Index i = j; i < m; ++i) {
      const double v = scale[i] > 0 && scale[j] > 0 ? g(i, j) / (scale[i] * scale[j]) : 0.0;
      a(i, j) = v;
      a(j, i) = v;
    }
  }
  std::vector<Index> permutation(static_cast<size_t>(m));
  for (Index j = 0; j < m; ++j) permutation[j] = j;
  Index rank = 0;
  for (Index k = 0; k < m; ++k) {
    if (!(a(k, k) > tolerance)) {
      Index best = k;
      for (Index j = k + 1; j < m; ++j) {
        if (a(j, j) > a(best, best)) best = j;
      }
      if (!(a(best, best) > tolerance)) break;
      a.row(k).swap(a.row(best));
      a.col(k).swap(a.col(best));
      std::swap(permutation[k], permutation[best]);
    }
    const double pivot = std::sqrt(a(k, k));
    a(k, k) = pivot;
    a.col(k).tail(m - k - 1) /= pivot;
    for (Index j = k + 1; j < m; ++j) {
      a.col(j).tail(m - k - 1) -= a.col(k).tail(m - k - 1) * a(j, k);
    }
    rank = k + 1;
  }
  // F = D P L: row i of L (pivot order) is row permutation[i] of F.
  Eigen::MatrixXd factor = Eigen::MatrixXd::Zero(m, rank);
  for (Index i = 0; i < m; ++i) {
    const Index columns = std::min(i + 1, rank);
    factor.row(permutation[i]).head(columns) = scale[permutation[i]] * a.row(i).head(columns);
  }
  return factor;
}

}  // namespace

template <typename Scalar>
SmallSvd ComputeSmallSvd(const Eigen::Ref<const Eigen::Matrix<Scalar, Dynamic, Dynamic>>& m,
                         bool top_left_vector) {
  using Matrix = Eigen::Matrix<Scalar, Dynamic, Dynamic>;
  const Index k = m.rows();
  assert(m.cols() == k);
  SmallSvd result;
  if (k == 0) return result;

  // Householder vectors take sums of squares, which under- or overflow for
  // extreme magnitudes (in float already near 1e-20 or 1e19): scale by a power
  // of two, which is exact, so that the largest entry is of order one.
  const double max_abs = static_cast<double>(m.cwiseAbs().maxCoeff());
  if (!(max_abs > 0)) {
    result.singular_values.assign(static_cast<size_t>(k), 0.0);
    return result;  // the zero matrix has no top direction
  }
  const int exponent = std::ilogb(max_abs);
  const Matrix scaled = m * std::ldexp(Scalar(1), -exponent);
  // scaled = U B V^T with B upper bidiagonal (diagonal d, superdiagonal e).
  const Eigen::internal::UpperBidiagonalization<Matrix> bidiagonalization(scaled);
  auto band = bidiagonalization.bidiagonal();  // a copy: Eigen's const diagonal<N>() does not compile
  // Interleaved as the Golub-Kahan tridiagonal [[0, B^T], [B, 0]] (permuted):
  // zero diagonal, off-diagonal (d1, e1, d2, e2, ..., dk); its eigenvalues are
  // +-sigma_i, the eigenvector of +sigma_i is (v1, u1, v2, u2, ...) / sqrt(2).
  // Scaled to a largest entry of 1, for the rotations' sums of squares.
  std::vector<double> off(static_cast<size_t>(2 * k - 1));
  double scale = 0;
  for (Index i = 0; i < k; ++i) {
    off[2 * i] = static_cast<double>(band.diagonal()[i]);
    if (i + 1 < k) off[2 * i + 1] = static_cast<double>(band.template diagonal<1>()[i]);
  }
  for (double v : off) scale = std::max(scale, std::abs(v));
  if (!(scale > 0)) {  // cannot happen: the bidiagonal keeps the Frobenius norm
    result.singular_values.assign(static_cast<size_t>(k), 0.0);
    return result;
  }
  for (double& v : off) v /= scale;

  std::vector<double> sigma(static_cast<size_t>(k)), super(static_cast<size_t>(k - 1));
  for (Index i = 0; i < k; ++i) sigma[i] = off[2 * i];
  for (Index i = 0; i + 1 < k; ++i) super[i] = off[2 * i + 1];
  if (!BidiagonalSingularValues(sigma, super)) {
    // Not seen in practice; fall back on the slower general SVD rather than fail.
    Eigen::BDCSVD<Eigen::MatrixXd> svd(m.template cast<double>(),
                                       top_left_vector ? Eigen::ComputeThinU : 0);
    const Eigen::VectorXd& values = svd.singularValues();
    result.singular_values.assign(values.data(), values.data() + values.size());
    if (top_left_vector) {
      result.top_left_vector.assign(svd.matrixU().col(0).data(), svd.matrixU().col(0).data() + k);
    }
    return result;
  }
  std::sort(sigma.begin(), sigma.end(), std::greater<>());
  result.singular_values.resize(static_cast<size_t>(k));
  for (Index i = 0; i < k; ++i) result.singular_values[i] = std::ldexp(sigma[i] * scale, exponent);
  if (!top_left_vector) return result;

  // The top eigenvector of the Golub-Kahan tridiagonal, by inverse iteration
  // at the (accurate) sigma_1: converges in a step or two, O(k) per step. A
  // fixed pseudo-random start keeps results reproducible.
  const double shift = sigma[0];
  const double tiny = std::numeric_limits<double>::epsilon() * std::max(shift, 1e-300);
  std::vector<double> z(static_cast<size_t>(2 * k));
  uint32_t state = 12345;
  for (double& v : z) {
    state = state * 1664525u + 1013904223u;
    v = static_cast<double>(state >> 8) / 16777216.0 - 0.5;
  }
  const std::vector<double> zero_diagonal(static_cast<size_t>(2 * k), 0.0);
  for (int iteration = 0; iteration < 3; ++iteration) {
    SolveShiftedTridiagonal(zero_diagonal, off, shift, tiny, z);
    Normalize(z);
  }
  Eigen::Matrix<Scalar, Dynamic, 1> u(k);
  for (Index i = 0; i < k; ++i) u[i] = static_cast<Scalar>(z[2 * i + 1]);
  u = bidiagonalization.householderU() * u;
  result.top_left_vector.assign(u.data(), u.data() + k);
  Normalize(result.top_left_vector);
  return result;
}

SpectrumSummary SummarizeSpectrum(std::span<const double> singular_values, int head_dim) {
  double sum = 0;
  double sum_squares = 0;
  double largest = 0;
  for (double s : singular_values) {
    sum += s;
    sum_squares += s * s;
    largest = std::max(largest, s);
  }
  SpectrumSummary summary;
  if (!(sum > 0)) return summary;
  double entropy = 0;  // nats
  for (double s : singular_values) {
    const double p = s / sum;
    if (p > 0) entropy -= p * std::log(p);
  }
  summary.normalized_entropy = entropy / std::log(2.0 * head_dim);
  summary.effective_rank = std::exp(entropy);
  summary.top1_share = largest * largest / sum_squares;
  return summary;
}

template <typename Scalar>
QKIncrementSpectrum ComputeQKIncrementSpectrumHouseholder(const ConstRowMajorRef<Scalar>& q_prev,
                                               const ConstRowMajorRef<Scalar>& k_prev,
                                               const ConstRowMajorRef<Scalar>& q,
                                               const ConstRowMajorRef<Scalar>& k,
                                               const QKSpectrumOptions& options) {
  using Matrix = Eigen::Matrix<Scalar, Dynamic, Dynamic>;  // column-major suits Householder QR
  using Vector = Eigen::Matrix<Scalar, Dynamic, 1>;
  const Index n = q.rows();
  const Index d = q.cols();
  assert(q_prev.rows() == n && k_prev.rows() == n && k.rows() == n);
  assert(q_prev.cols() == d && k_prev.cols() == d && k.cols() == d);
  const Index m = 2 * d;
  const Index core_size = std::min(n, m);

  QKIncrementSpectrum spectrum;
  Matrix a(n, m);
  Matrix b(n, m);
  a.leftCols(d) = q - q_prev;
  a.rightCols(d) = q_prev;
  b.leftCols(d) = k_prev;
  b.rightCols(d) = k - k_prev;
  const Scalar max_dq = a.leftCols(d).cwiseAbs().maxCoeff();
  const Scalar max_dk = b.rightCols(d).cwiseAbs().maxCoeff();
  const double max_a = static_cast<double>(std::max(max_dq, a.rightCols(d).cwiseAbs().maxCoeff()));
  const double max_b = static_cast<double>(std::max(b.leftCols(d).cwiseAbs().maxCoeff(), max_dk));
  // No increment at all, or A = 0 or B = 0: dS1 = A B^T = 0.
  if ((max_dq == 0 && max_dk == 0) || max_a == 0 || max_b == 0) {
    spectrum.zero_increment = true;
    return spectrum;
  }
  if (!std::isfinite(max_a) || !std::isfinite(max_b)) {  // Q - Q0 or K - K0 overflowed Scalar
    const double nan = std::numeric_limits<double>::quiet_NaN();
    spectrum.normalized_entropy = spectrum.effective_rank = nan;
    spectrum.top1_share = spectrum.second_order_ratio = nan;
    return spectrum;
  }

  // Scale A and B by powers of two (exact) so their largest entries are of
  // order one when they are far from it: the QR's sums of squares then
  // neither underflow nor overflow. Every statistic is invariant under this;
  // only sigma is scaled back.
  auto exponent_of = [](double max_abs) {
    const int exponent = std::ilogb(max_abs);
    return std::abs(exponent) <= 16 ? 0 : exponent;  // 2^+-16 is harmless: skip a pass
  };
  const int exponent_a = exponent_of(max_a);
  const int exponent_b = exponent_of(max_b);
  if (exponent_a != 0) a *= std::ldexp(Scalar(1), -exponent_a);
  if (exponent_b != 0) b *= std::ldexp(Scalar(1), -exponent_b);

  // In-place thin Householder QR: R and the reflectors overwrite a and b.
  Vector reflectors_a(core_size), reflectors_b(core_size), qr_scratch(m);
  InPlaceHouseholderQR(a, reflectors_a, qr_scratch);
  InPlaceHouseholderQR(b, reflectors_b, qr_scratch);
  const Matrix r_a = ExtractR<Matrix>(a);
  const Matrix r_b = ExtractR<Matrix>(b);

  const Scalar scale = Scalar(1) / std::sqrt(static_cast<Scalar>(d));
  Matrix core(core_size, core_size);
  core.noalias() = (scale * r_a) * r_b.transpose();

  // dQ = Qa Ra[:, :d] and dK = Qb Rb[:, d:]; the orthonormal factors drop out
  // of the Frobenius norm, so ||dQ dK^T|| = ||Ra[:, :d] Rb[:, d:]^T||. Ra[:, :d]
  // is zero below row d, and a sum of squares has no cancellation.
  const Index dq_rows = std::min(d, core_size);
  const double second_order_squared =
      ((scale * r_a.topLeftCorner(dq_rows, d)) * r_b.rightCols(d).transpose())
          .template cast<double>()
          .squaredNorm();

  SmallSvd svd = ComputeSmallSvd<Scalar>(core, options.compute_top_vector);
  spectrum.singular_values = std::move(svd.singular_values);
  double sum_squares = 0;
  for (double s : spectrum.singular_values) sum_squares += s * s;
  if (sum_squares == 0) {  // the increment cancelled exactly (e.g. dQ K0^T = -Q0 dK^T)
    spectrum.singular_values.clear();
    spectrum.zero_increment = true;
    return spectrum;
  }
  FillSummary(static_cast<int>(d), spectrum);
  spectrum.second_order_ratio = std::sqrt(second_order_squared / sum_squares);
  for (double& sigma : spectrum.singular_values) sigma = std::ldexp(sigma, exponent_a + exponent_b);

  if (options.compute_top_vector) {
    // The token-space vector is Qa [u_core; 0]; apply the reflectors to it.
    Eigen::Matrix<Scalar, Dynamic, 1> u = Eigen::Matrix<Scalar, Dynamic, 1>::Zero(n);
    for (Index i = 0; i < core_size; ++i) u[i] = static_cast<Scalar>(svd.top_left_vector[i]);
    u = Eigen::householderSequence(a, reflectors_a) * u;
    spectrum.top_vector.assign(u.data(), u.data() + n);
    Normalize(spectrum.top_vector);
    CanonicalizeSign(spectrum.top_vector);
  }
  return spectrum;
}

// The core C below is quadratic in the Grams and its reduction sums squares
// of its entries: rescale the Grams (by powers of four, exactly: A and B by
// powers of two) only for inputs far from order one, e.g. float values near
// 1e38 or 1e-38. Statistics are scale-free.
namespace {
// A Cholesky factor is used when every column keeps a share of its norm above
// this once the columns before it are projected out: ~100x the Gram's
// relative rounding error (n eps) at n = 1024.
constexpr double kRankTolerance = 1e-12;

int GramExponent(double max_square) {
  if (!std::isfinite(max_square)) return 0;  // non-finite Grams: no rescaling (ilogb is undefined)
  const int exponent = std::ilogb(max_square) / 2;
  return std::abs(exponent) <= 60 ? 0 : exponent;
}
}  // namespace

template <typename Scalar>
void ComputeQKKeyGram(const ConstRowMajorRef<Scalar>& k_prev, const ConstRowMajorRef<Scalar>& k,
                      QKKeyGram& out) {
  const Index n = k.rows();
  const Index d = k.cols();
  assert(k_prev.rows() == n && k_prev.cols() == d);
  const Index m = 2 * d;
  // B = [K0 | dK] in double: the difference of two floats is exact in double
  // (no overflow either), and so are products of floats. Reused across calls
  // on a thread: malloc would map and page-fault it afresh every call.
  thread_local Eigen::Matrix<double, Dynamic, Dynamic, Eigen::RowMajor> b;
  b.resize(n, m);
  b.leftCols(d) = k_prev.template cast<double>();
  b.rightCols(d) = k.template cast<double>() - k_prev.template cast<double>();
  out.tokens = n;
  out.head_dim = d;
  out.gram.resize(m, m);
  GramLowerTriangle(b.data(), n, m, m, out.gram.data(), m);
  // The diagonal holds the squared column norms (exact zeros stay zero:
  // squares of floats cannot underflow double).
  out.max_dk = out.gram.diagonal().tail(d).maxCoeff();
  out.max_k = std::max(out.max_dk, out.gram.diagonal().head(d).maxCoeff());
  out.exponent = GramExponent(out.max_k);
  if (out.exponent != 0) out.gram *= std::ldexp(1.0, -2 * out.exponent);
  out.gram.triangularView<Eigen::StrictlyUpper>() = out.gram.transpose();
  thread_local Eigen::MatrixXd lower;
  lower.resize(m, m);
  out.upper.resize(m, m);
  out.factored = CholeskyLower(out.gram.data(), m, lower.data(), out.upper.data());
  for (Index j = 0; out.factored && j < m; ++j) {
    out.factored = lower(j, j) * lower(j, j) > kRankTolerance * out.gram(j, j);
  }
}

template <typename Scalar>
QKIncrementSpectrum ComputeQKIncrementSpectrumGram(const ConstRowMajorRef<Scalar>& q_prev,
                                                   const ConstRowMajorRef<Scalar>& k_prev,
                                                   const ConstRowMajorRef<Scalar>& q,
                                                   const ConstRowMajorRef<Scalar>& k,
                                                   const QKSpectrumOptions& options) {
  const Index n = q.rows();
  const Index d = q.cols();
  assert(q_prev.rows() == n && k_prev.rows() == n && k.rows() == n);
  assert(q_prev.cols() == d && k_prev.cols() == d && k.cols() == d);
  const Index m = 2 * d;
  constexpr double kEpsilon = std::numeric_limits<double>::epsilon();

  // Buffers reused across calls on a thread (the detector calls once per head):
  // at n = 256, d = 64 the factors are 256 KB each, which malloc would map and
  // page-fault afresh every call.
  thread_local Eigen::Matrix<double, Dynamic, Dynamic, Eigen::RowMajor> a;
  thread_local Eigen::MatrixXd gram_a, product, core, lower_factor, upper_factor;
  thread_local QKKeyGram own_key_gram;
  thread_local Eigen::Matrix<double, Dynamic, Dynamic, Eigen::RowMajor> product_rows;
  thread_local Eigen::VectorXd householder;

  // G_B = B^T B, B = [K0 | dK]: given (shared by a K head's query heads) or computed.
  const QKKeyGram* key = options.key_gram;
  if (key == nullptr) {
    ComputeQKKeyGram<Scalar>(k_prev, k, own_key_gram);
    key = &own_key_gram;
  }
  assert(key->tokens == n && key->head_dim == d);
  const Eigen::MatrixXd& gram_b = key->gram;

  // A = [dQ | Q0] in double, as B; its Gram's lower triangle: dS1 dS1^T = A G_B A^T / d.
  QKIncrementSpectrum spectrum;
  a.resize(n, m);
  a.leftCols(d) = q.template cast<double>() - q_prev.template cast<double>();
  a.rightCols(d) = q_prev.template cast<double>();
  gram_a.resize(m, m);
  GramLowerTriangle(a.data(), n, m, m, gram_a.data(), m);
  const double max_dq = gram_a.diagonal().head(d).maxCoeff();
  const double max_a = std::max(max_dq, gram_a.diagonal().tail(d).maxCoeff());
  if ((max_dq == 0 && key->max_dk == 0) || max_a == 0 || key->max_k == 0) {  // dS1 = A B^T = 0
    spectrum.zero_increment = true;
    return spectrum;
  }
  const int exponent_a = GramExponent(max_a);
  const int exponent_b = key->exponent;
  if (exponent_a != 0) gram_a *= std::ldexp(1.0, -2 * exponent_a);

  // ||dQ dK^T||_F^2 = <dQ^T dQ, dK^T dK>_F, from the Grams' diagonal blocks.
  double second_order_sum = 0;
  for (Index j = 0; j < d; ++j) {
    second_order_sum += gram_a(j, j) * gram_b(d + j, d + j);
    double off_diagonal = 0;
    for (Index i = j + 1; i < d; ++i) off_diagonal += gram_a(i, j) * gram_b(d + i, d + j);
    second_order_sum += 2 * off_diagonal;
  }
  second_order_sum = std::max(second_order_sum, 0.0);

  const Eigen::VectorXd gram_a_diagonal = gram_a.diagonal();
  Index rank = m;
  bool full_rank = false;
  if (key->factored) {
    // C = L_B^T G_A L_B (m x m) with G_B = L_B L_B^T (the key's, shared by
    // its query heads); its eigenvalues are d sigma_i^2. A rank-deficient A
    // only makes G_A singular: its zero eigenvalues fall under the noise floor below.
    gram_a.triangularView<Eigen::StrictlyUpper>() = gram_a.transpose();
    product_rows.resize(m, m);
    core.resize(m, m);
    UpperCongruence(key->upper.data(), gram_a.data(), m, product_rows.data(), core.data());
  } else {
    // B rank-deficient: G_A = F F^T. Plain Cholesky (F = L; CholeskyLower also
    // writes L^T for the congruence) under the rank tolerance; otherwise the
    // rank-revealing pivoted factor, so that dependent columns (rank-deficient
    // Q0, dQ = 0, repeated columns) are dropped instead of contributing
    // rounding noise.
    lower_factor.resize(m, m);
    upper_factor.resize(m, m);
    full_rank = CholeskyLower(gram_a.data(), m, lower_factor.data(), upper_factor.data());
    for (Index j = 0; full_rank && j < m; ++j) {
      full_rank = lower_factor(j, j) * lower_factor(j, j) > kRankTolerance * gram_a_diagonal[j];
    }
    // C = F^T G_B F (r x r); its eigenvalues are d sigma_i^2. G_B F is kept for
    // the top vector (row-major on the full-rank path, as UpperCongruence writes it).
    if (full_rank) {
      product_rows.resize(m, m);
      core.resize(m, m);
      UpperCongruence(upper_factor.data(), gram_b.data(), m, product_rows.data(), core.data());
    } else {
      gram_a.triangularView<Eigen::StrictlyUpper>() = gram_a.transpose();
      const Eigen::MatrixXd factor = PivotedCholeskyFactor(gram_a, kRankTolerance);
      rank = factor.cols();
      product.noalias() = gram_b * factor;
      core.noalias() = factor.transpose() * product;
    }
  }

  // Eigenvalues of C: Householder tridiagonalization, then root-free QL.
  std::vector<double> diagonal(static_cast<size_t>(rank)), off(static_cast<size_t>(std::max<Index>(rank - 1, 0)));
  if (rank >= 2) {
    householder.resize(rank - 1);
    TridiagonalizeLower(core.data(), rank, householder.data());
  }
  for (Index i = 0; i < rank; ++i) diagonal[i] = core(i, i);
  for (Index i = 0; i + 1 < rank; ++i) off[i] = core(i + 1, i);
  std::vector<double> eigenvalues = diagonal;
  {
    std::vector<double> scratch = off;
    if (!TridiagonalEigenvalues(eigenvalues, scratch)) {
      // Not seen in practice; Eigen's QR instead of failing.
      Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> solver;
      solver.computeFromTridiagonal(Eigen::Map<Eigen::VectorXd>(diagonal.data(), rank),
                                    Eigen::Map<Eigen::VectorXd>(off.data(), rank - 1),
                                    Eigen::EigenvaluesOnly);
      eigenvalues.assign(solver.eigenvalues().data(), solver.eigenvalues().data() + rank);
    }
  }
  std::sort(eigenvalues.begin(), eigenvalues.end(), std::greater<>());
  const double largest = eigenvalues.empty() ? 0.0 : eigenvalues[0];
  // C is positive semidefinite; forming and reducing it leaves an absolute
  // error of about eps S^2 in its eigenvalues, S = sum_k ||A_k|| ||B_k|| the
  // size of dS1 before its terms cancel (S >= sigma_1). Those become sigma of
  // ~sqrt(eps) S: report eigenvalues below r eps S^2 as zero, as they would
  // otherwise add spurious entropy (e.g. 120 noise values around a rank-3 dS1).
  double column_scale = 0;  // S
  for (Index j = 0; j < m; ++j) column_scale += std::sqrt(gram_a_diagonal[j] * gram_b(j, j));
  const double noise = static_cast<double>(rank) * kEpsilon * column_scale * column_scale;
  double sum_eigenvalues = 0;
  for (double& lambda : eigenvalues) {
    if (!(lambda > noise)) lambda = 0;
    sum_eigenvalues += lambda;
  }
  if (!(sum_eigenvalues > 0)) {  // the increment cancelled (e.g. dQ K0^T = -Q0 dK^T)
    spectrum.zero_increment = true;
    return spectrum;
  }

  const Index core_size = std::min(n, m);
  spectrum.singular_values.assign(static_cast<size_t>(core_size), 0.0);
  const double inverse_d = 1.0 / static_cast<double>(d);
  for (Index i = 0; i < std::min(rank, core_size); ++i) {
    spectrum.singular_values[i] = std::sqrt(eigenvalues[i] * inverse_d);
  }
  FillSummary(static_cast<int>(d), spectrum);
  spectrum.second_order_ratio = std::sqrt(second_order_sum / sum_eigenvalues);
  for (double& sigma : spectrum.singular_values) sigma = std::ldexp(sigma, exponent_a + exponent_b);

  if (options.compute_top_vector) {
    // Top eigenvector z of the tridiagonal by inverse iteration at lambda_1,
    // v = Q z that of C; the token-space vector is A y (below).
    std::vector<double> z(static_cast<size_t>(rank));
    if (rank == 1) {
      z[0] = 1;
    } else {
      const double tiny = kEpsilon * std::max(largest, std::numeric_limits<double>::min());
      uint32_t state = 12345;
      for (double& v : z) {
        state = state * 1664525u + 1013904223u;
        v = static_cast<double>(state >> 8) / 16777216.0 - 0.5;
      }
      for (int iteration = 0; iteration < 3; ++iteration) {
        SolveShiftedTridiagonal(diagonal, off, largest, tiny, z);
        Normalize(z);
      }
    }
    Eigen::VectorXd v = Eigen::Map<const Eigen::VectorXd>(z.data(), rank);
    if (rank >= 2) {
      Eigen::HouseholderSequence<Eigen::MatrixXd, Eigen::VectorXd> reflectors(core, householder);
      reflectors.setLength(rank - 1).setShift(1);
      v.applyOnTheLeft(reflectors);
    }
    // y with A y along the top left singular vector: L_B v (v the top
    // eigenvector of L_B^T G_A L_B gives the right one, B L_B^-T v), else G_B F v.
    const Eigen::VectorXd y = key->factored ? Eigen::VectorXd(key->upper.triangularView<Eigen::Upper>().transpose() * v)
                              : full_rank   ? Eigen::VectorXd(product_rows * v)
                                            : Eigen::VectorXd(product.leftCols(rank) * v);
    const Eigen::VectorXd u = a * y;
    spectrum.top_vector.assign(u.data(), u.data() + n);
    Normalize(spectrum.top_vector);
    CanonicalizeSign(spectrum.top_vector);
  }
  return spectrum;
}

template <typename Scalar>
QKIncrementSpectrum ComputeQKIncrementSpectrum(const ConstRowMajorRef<Scalar>& q_prev,
                                               const ConstRowMajorRef<Scalar>& k_prev,
                                               const ConstRowMajorRef<Scalar>& q,
                                               const ConstRowMajorRef<Scalar>& k,
                                               const QKSpectrumOptions& options) {
  // Float inputs: the Gram route, whose sqrt(eps_double) resolution is finer
  // than what float inputs carry. Double inputs keep the Householder route's
  // full double accuracy. Short probes (n < 2d) leave the Gram route nothing
  // to gain: its m x m Grams exceed the n x n problem.
  if constexpr (std::is_same_v<Scalar, float>) {
    if (q.rows() >= 2 * q.cols()) return ComputeQKIncrementSpectrumGram<float>(q_prev, k_prev, q, k, options);
  }
  return ComputeQKIncrementSpectrumHouseholder<Scalar>(q_prev, k_prev, q, k, options);
}

QKIncrementSpectrum ComputeQKIncrementSpectrumDense(const ConstRowMajorRef<double>& q_prev,
                                                    const ConstRowMajorRef<double>& k_prev,
                                                    const ConstRowMajorRef<double>& q,
                                                    const ConstRowMajorRef<double>& k,
                                                    const QKSpectrumOptions& options) {
  const Index d = q.cols();
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const Eigen::MatrixXd dq = q - q_prev;
  const Eigen::MatrixXd dk = k - k_prev;
  const Eigen::MatrixXd first_order = scale * (dq * k_prev.transpose() + q_prev * dk.transpose());
  const Eigen::MatrixXd second_order = scale * (dq * dk.transpose());

  QKIncrementSpectrum spectrum;
  if ((first_order.array() == 0.0).all()) {
    spectrum.zero_increment = true;
    return spectrum;
  }
  Eigen::BDCSVD<Eigen::MatrixXd> svd(first_order,
                                     options.compute_top_vector ? Eigen::ComputeThinU : 0);
  const Eigen::VectorXd& sigma = svd.singularValues();
  spectrum.singular_values.assign(sigma.data(), sigma.data() + sigma.size());
  FillSummary(static_cast<int>(d), spectrum);
  spectrum.second_order_ratio = second_order.norm() / first_order.norm();
  if (options.compute_top_vector) {
    const Eigen::VectorXd u = svd.matrixU().col(0);
    spectrum.top_vector.assign(u.data(), u.data() + u.size());
    CanonicalizeSign(spectrum.top_vector);
  }
  return spectrum;
}

double TopVectorOverlap(std::span<const double> a, std::span<const double> b) {
  assert(a.size() == b.size());
  double dot = 0;
  for (size_t i = 0; i < a.size(); ++i) dot += a[i] * b[i];
  return std::min(1.0, std::abs(dot));
}

template SmallSvd ComputeSmallSvd<float>(const Eigen::Ref<const Eigen::MatrixXf>&, bool);
template SmallSvd ComputeSmallSvd<double>(const Eigen::Ref<const Eigen::MatrixXd>&, bool);
template QKIncrementSpectrum ComputeQKIncrementSpectrum<float>(
    const ConstRowMajorRef<float>&, const ConstRowMajorRef<float>&, const ConstRowMajorRef<float>&,
    const ConstRowMajorRef<float>&, const QKSpectrumOptions&);
template QKIncrementSpectrum ComputeQKIncrementSpectrum<double>(
    const ConstRowMajorRef<double>&, const ConstRowMajorRef<double>&, const ConstRowMajorRef<double>&,
    const ConstRowMajorRef<double>&, const QKSpectrumOptions&);
template QKIncrementSpectrum ComputeQKIncrementSpectrumHouseholder<float>(
    const ConstRowMajorRef<float>&, const ConstRowMajorRef<float>&, const ConstRowMajorRef<float>&,
    const ConstRowMajorRef<float>&, const QKSpectrumOptions&);
template QKIncrementSpectrum ComputeQKIncrementSpectrumHouseholder<double>(
    const ConstRowMajorRef<double>&, const ConstRowMajorRef<double>&, const ConstRowMajorRef<double>&,
    const ConstRowMajorRef<double>&, const QKSpectrumOptions&);
template void ComputeQKKeyGram<float>(const ConstRowMajorRef<float>&, const ConstRowMajorRef<float>&,
                                      QKKeyGram&);
template void ComputeQKKeyGram<double>(const ConstRowMajorRef<double>&, const ConstRowMajorRef<double>&,
                                       QKKeyGram&);
template QKIncrementSpectrum ComputeQKIncrementSpectrumGram<float>(
    const ConstRowMajorRef<float>&, const ConstRowMajorRef<float>&, const ConstRowMajorRef<float>&,
    const ConstRowMajorRef<float>&, const QKSpectrumOptions&);
template QKIncrementSpectrum ComputeQKIncrementSpectrumGram<double>(
    const ConstRowMajorRef<double>&, const ConstRowMajorRef<double>&, const ConstRowMajorRef<double>&,
    const ConstRowMajorRef<double>&, const QKSpectrumOptions&);

}  // namespace foreshock::detectors
