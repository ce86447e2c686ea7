#include "detectors/qk_linalg.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <Eigen/Cholesky>
#include <Eigen/Core>
#include <Eigen/Eigenvalues>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FORESHOCK_QK_AVX2 1
#endif

namespace foreshock::detectors {
namespace {

using Index = std::ptrdiff_t;

#ifdef FORESHOCK_QK_AVX2

// Where the two operands of a tile product live: out(i, j) = sum_k X(k, i) Y(k, j)
// with X(k, i) at x[k * x_row + i] (8 consecutive i per vector) and Y(k, j) at
// y[k * y_row + j] (broadcast; consecutive j, so each is an immediate offset).
struct Operands {
  const double* x;
  Index x_row;
  const double* y;
  Index y_row;
};

// One tile: out rows i0 .. i0 + 7 (two 4-wide vectors, masked past the edge
// when `Tail`) by out columns j0 .. j0 + R - 1, over k in [k_begin, k_end):
// 2 vector loads, R broadcasts and 2R FMAs per k. Stores into out (column-
// major, leading dimension ld), or adds to it when `accumulate`.
// Inlined: a call per tile costs ~25% at these sizes (32 k-steps per tile).
template <int R, bool Tail>
__attribute__((always_inline)) inline void Tile(const Operands in, Index k_begin, Index k_end, Index i0, Index j0, __m256i mask0, __m256i mask1,
          double* out, Index ld, bool accumulate) {
  // Named accumulators: GCC 12 keeps an array of them in memory across the loop.
  __m256d a00 = _mm256_setzero_pd(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
  __m256d a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  const double* xk = in.x + k_begin * in.x_row + i0;
  const double* yk = in.y + k_begin * in.y_row + j0;
  for (Index k = k_begin; k < k_end; ++k, xk += in.x_row, yk += in.y_row) {
    const __m256d v0 = Tail ? _mm256_maskload_pd(xk, mask0) : _mm256_loadu_pd(xk);
    const __m256d v1 = Tail ? _mm256_maskload_pd(xk + 4, mask1) : _mm256_loadu_pd(xk + 4);
    __m256d b = _mm256_broadcast_sd(yk);
    a00 = _mm256_fmadd_pd(b, v0, a00);
    a01 = _mm256_fmadd_pd(b, v1, a01);
    if constexpr (R > 1) {
      b = _mm256_broadcast_sd(yk + 1);
      a10 = _mm256_fmadd_pd(b, v0, a10);
      a11 = _mm256_fmadd_pd(b, v1, a11);
    }
    if constexpr (R > 2) {
      b = _mm256_broadcast_sd(yk + 2);
      a20 = _mm256_fmadd_pd(b, v0, a20);
      a21 = _mm256_fmadd_pd(b, v1, a21);
    }
    if constexpr (R > 3) {
      b = _mm256_broadcast_sd(yk + 3);
      a30 = _mm256_fmadd_pd(b, v0, a30);
      a31 = _mm256_fmadd_pd(b, v1, a31);
    }
    if constexpr (R > 4) {
      b = _mm256_broadcast_sd(yk + 4);
      a40 = _mm256_fmadd_pd(b, v0, a40);
      a41 = _mm256_fmadd_pd(b, v1, a41);
    }
    if constexpr (R > 5) {
      b = _mm256_broadcast_sd(yk + 5);
      a50 = _mm256_fmadd_pd(b, v0, a50);
      a51 = _mm256_fmadd_pd(b, v1, a51);
    }
  }
  const __m256d sums[6][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
  for (int r = 0; r < R; ++r) {
    double* o = out + (j0 + r) * ld + i0;
    __m256d sum0 = sums[r][0], sum1 = sums[r][1];
    if (Tail) {
      if (accumulate) {
        sum0 = _mm256_add_pd(sum0, _mm256_maskload_pd(o, mask0));
        sum1 = _mm256_add_pd(sum1, _mm256_maskload_pd(o + 4, mask1));
      }
      _mm256_maskstore_pd(o, mask0, sum0);
      _mm256_maskstore_pd(o + 4, mask1, sum1);
    } else {
      if (accumulate) {
        sum0 = _mm256_add_pd(sum0, _mm256_loadu_pd(o));
        sum1 = _mm256_add_pd(sum1, _mm256_loadu_pd(o + 4));
      }
      _mm256_storeu_pd(o, sum0);
      _mm256_storeu_pd(o + 4, sum1);
    }
  }
}

template <bool Tail>
void TileColumns(int columns, const Operands& in, Index k_begin, Index k_end, Index i0, Index j0, __m256i mask0,
                 __m256i mask1, double* out, Index ld, bool accumulate) {
  switch (columns) {
    case 6: return Tile<6, Tail>(in, k_begin, k_end, i0, j0, mask0, mask1, out, ld, accumulate);
    case 5: return Tile<5, Tail>(in, k_begin, k_end, i0, j0, mask0, mask1, out, ld, accumulate);
    case 4: return Tile<4, Tail>(in, k_begin, k_end, i0, j0, mask0, mask1, out, ld, accumulate);
    case 3: return Tile<3, Tail>(in, k_begin, k_end, i0, j0, mask0, mask1, out, ld, accumulate);
    case 2: return Tile<2, Tail>(in, k_begin, k_end, i0, j0, mask0, mask1, out, ld, accumulate);
    default: return Tile<1, Tail>(in, k_begin, k_end, i0, j0, mask0, mask1, out, ld, accumulate);
  }
}

constexpr int kTileColumns = 6;  // 12 accumulators + 2 loads + 1 broadcast = 15 of 16 registers

// out (rows x cols) = X^T Y over k in [k_begin(i0, j0), k_end) (k_begin < k_end),
// for the tiles that `wanted(i0, j0)` selects (i0 the tile's first row, a
// multiple of 8; j0 its first column, a multiple of kTileColumns).
template <typename KBegin, typename Wanted>
void TileProduct(const Operands& in, Index rows, Index cols, KBegin k_begin, Index k_end, Wanted wanted,
                 double* out, Index ld) {
  const Index full_blocks = rows / 8;
  const Index tail = rows - 8 * full_blocks;
  const __m256i all = _mm256_set1_epi64x(-1);
  __m256i tail0 = all, tail1 = all;
  if (tail > 0) {
    alignas(32) long long lanes[8];
    for (int i = 0; i < 8; ++i) lanes[i] = i < tail ? -1 : 0;
    tail0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
    tail1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes + 4));
  }
  // k in chunks of 32 (at 2d = 128 all of k in one: measured fastest there);
  // a tile's sum starts in the chunk holding its k_begin.
  constexpr Index kChunk = 32;
  for (Index k0 = 0; k0 < k_end; k0 += kChunk) {
    const Index k1 = std::min(k_end, k0 + kChunk);
    for (Index j0 = 0; j0 < cols; j0 += kTileColumns) {
      const int columns = static_cast<int>(std::min<Index>(kTileColumns, cols - j0));
      for (Index i0 = 0; i0 < rows; i0 += 8) {
        const Index begin = k_begin(i0, j0);
        if (!wanted(i0, j0) || begin >= k1) continue;
        const bool add = begin < k0;
        const Index from = std::max(begin, k0);
        if (i0 + 8 <= rows) {
          TileColumns<false>(columns, in, from, k1, i0, j0, all, all, out, ld, add);
        } else {
          TileColumns<true>(columns, in, from, k1, i0, j0, tail0, tail1, out, ld, add);
        }
      }
    }
  }
}

// Rows of X per pass: 32 rows of 2d = 128 doubles are 32 KB, which stay in
// L1 while every tile of the Gram reads them.
constexpr Index kChunkRows = 32;

// One tile: Gram columns r0 .. r0 + R - 1 (broadcast from X) times Gram rows
// c0 .. c0 + 7 (two 4-wide vectors of X): 2R accumulators, 2 vector loads
// and R broadcasts per row of X for 2R FMAs. `Tail` masks the vectors past
// `cols`. Accumulates into the Gram unless `first` (the first chunk).
template <int R, bool Tail>
void GramTile(const double* x, Index rows, Index stride, Index r0, Index c0, __m256i mask0, __m256i mask1,
              double* gram, Index ld, bool first) {
  __m256d acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_pd();
  const double* row = x;
  for (Index k = 0; k < rows; ++k, row += stride) {
    const __m256d v0 = Tail ? _mm256_maskload_pd(row + c0, mask0) : _mm256_loadu_pd(row + c0);
    const __m256d v1 = Tail ? _mm256_maskload_pd(row + c0 + 4, mask1) : _mm256_loadu_pd(row + c0 + 4);
    for (int r = 0; r < R; ++r) {
      const __m256d b = _mm256_broadcast_sd(row + r0 + r);
      acc[r][0] = _mm256_fmadd_pd(b, v0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_pd(b, v1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    double* out = gram + (r0 + r) * ld + c0;  // Gram(c0.., r0 + r), column-major
    if (Tail) {
      if (!first) {
        acc[r][0] = _mm256_add_pd(acc[r][0], _mm256_maskload_pd(out, mask0));
        acc[r][1] = _mm256_add_pd(acc[r][1], _mm256_maskload_pd(out + 4, mask1));
      }
      _mm256_maskstore_pd(out, mask0, acc[r][0]);
      _mm256_maskstore_pd(out + 4, mask1, acc[r][1]);
    } else {
      if (!first) {
        acc[r][0] = _mm256_add_pd(acc[r][0], _mm256_loadu_pd(out));
        acc[r][1] = _mm256_add_pd(acc[r][1], _mm256_loadu_pd(out + 4));
      }
      _mm256_storeu_pd(out, acc[r][0]);
      _mm256_storeu_pd(out + 4, acc[r][1]);
    }
  }
}

template <bool Tail>
void GramTileRows(int r_count, const double* x, Index rows, Index stride, Index r0, Index c0, __m256i mask0,
                  __m256i mask1, double* gram, Index ld, bool first) {
  switch (r_count) {
    case 6: return GramTile<6, Tail>(x, rows, stride, r0, c0, mask0, mask1, gram, ld, first);
    case 5: return GramTile<5, Tail>(x, rows, stride, r0, c0, mask0, mask1, gram, ld, first);
    case 4: return GramTile<4, Tail>(x, rows, stride, r0, c0, mask0, mask1, gram, ld, first);
    case 3: return GramTile<3, Tail>(x, rows, stride, r0, c0, mask0, mask1, gram, ld, first);
    case 2: return GramTile<2, Tail>(x, rows, stride, r0, c0, mask0, mask1, gram, ld, first);
    default: return GramTile<1, Tail>(x, rows, stride, r0, c0, mask0, mask1, gram, ld, first);
  }
}

#endif  // FORESHOCK_QK_AVX2

}  // namespace

void GramLowerTriangle(const double* x, Index rows, Index cols, Index stride, double* gram, Index ld) {
  if (cols <= 0) return;
  if (rows <= 0) {
    for (Index j = 0; j < cols; ++j) std::fill(gram + j * ld + j, gram + j * ld + cols, 0.0);
    return;
  }
#ifdef FORESHOCK_QK_AVX2
  const Index full_blocks = cols / 8;
  const Index tail = cols - 8 * full_blocks;
  const __m256i all = _mm256_set1_epi64x(-1);
  __m256i tail0 = all, tail1 = all;
  if (tail > 0) {
    alignas(32) long long lanes[8];
    for (int i = 0; i < 8; ++i) lanes[i] = i < tail ? -1 : 0;
    tail0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
    tail1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes + 4));
  }
  for (Index k0 = 0; k0 < rows; k0 += kChunkRows) {
    const Index chunk = std::min(kChunkRows, rows - k0);
    const double* block = x + k0 * stride;
    const bool first = k0 == 0;
    for (Index r0 = 0; r0 < cols; r0 += kTileColumns) {
      const int r_count = static_cast<int>(std::min<Index>(kTileColumns, cols - r0));
      // Gram rows from the 8-block holding r0 down: the lower triangle.
      for (Index c0 = (r0 / 8) * 8; c0 < 8 * full_blocks; c0 += 8) {
        GramTileRows<false>(r_count, block, chunk, stride, r0, c0, all, all, gram, ld, first);
      }
      if (tail > 0) {
        GramTileRows<true>(r_count, block, chunk, stride, r0, 8 * full_blocks, tail0, tail1, gram, ld, first);
      }
    }
  }
#else
  using RowMajor = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const Eigen::Map<const RowMajor, 0, Eigen::OuterStride<>> matrix(x, rows, cols, Eigen::OuterStride<>(stride));
  Eigen::Map<Eigen::MatrixXd, 0, Eigen::OuterStride<>> out(gram, cols, cols, Eigen::OuterStride<>(ld));
  out.triangularView<Eigen::Lower>().setZero();
  out.selfadjointView<Eigen::Lower>().rankUpdate(matrix.transpose());
#endif
}

void UpperCongruence(const double* u, const double* g, Index m, double* w, double* c) {
  if (m <= 0) return;
#ifdef FORESHOCK_QK_AVX2
  // W^T = U G: W^T(i, j) = sum_k U(i, k) G(k, j), k >= i (U upper), with
  // U(i, k) at u[k * m + i] and G(k, j) = G(j, k) at g[k * m + j]; W^T
  // column-major is W row-major.
  TileProduct(Operands{u, m, g, m}, m, m, [](Index i0, Index) { return i0; }, m,
              [](Index, Index) { return true; }, w, m);
  // C = W^T U^T, lower: C(i, j) = sum_k W(k, i) U(j, k), k >= j, with W(k, i)
  // at w[k * m + i] and U(j, k) at u[k * m + j].
  TileProduct(Operands{w, m, u, m}, m, m, [](Index, Index j0) { return j0; }, m,
              [](Index i0, Index j0) { return i0 + 8 > j0; }, c, m);
#else
  using RowMajor = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const Eigen::Map<const Eigen::MatrixXd> upper(u, m, m), symmetric(g, m, m);
  Eigen::Map<RowMajor> product(w, m, m);
  Eigen::Map<Eigen::MatrixXd> core(c, m, m);
  product.noalias() = symmetric * upper.triangularView<Eigen::Upper>().transpose();
  core.noalias() = upper.triangularView<Eigen::Upper>() * product;
#endif
}

bool CholeskyLower(const double* g, Index m, double* l, double* u) {
  if (m <= 0) return true;
#ifdef FORESHOCK_QK_AVX2
  // Left-looking by panels of kTileColumns columns: the panel's update from
  // every column before it, L(kb.., K) = sum_p L(kb.., p) L(K, p)^T over
  // p < kb, is one tile product (inner dimension kb, long enough to run
  // fast); inside the panel, column by column.
  for (Index kb = 0; kb < m; kb += kTileColumns) {
    const Index width = std::min<Index>(kTileColumns, m - kb);
    double* panel = l + kb * m + kb;  // L(kb.., kb..), leading dimension m
    if (kb > 0) {
      TileProduct(Operands{l + kb, m, l + kb, m}, m - kb, width, [](Index, Index) { return Index{0}; }, kb,
                  [](Index i0, Index j0) { return i0 + 8 > j0; }, panel, m);
    }
    for (Index j = kb; j < kb + width; ++j) {
      double* column = l + j * m;
      const double* source = g + j * m;
      if (kb > 0) {
        for (Index i = j; i < m; ++i) column[i] = source[i] - column[i];
      } else {
        for (Index i = j; i < m; ++i) column[i] = source[i];
      }
      for (Index p = kb; p < j; ++p) {
        const double factor = l[p * m + j];
        const double* earlier = l + p * m;
        for (Index i = j; i < m; ++i) column[i] -= factor * earlier[i];
      }
      const double pivot = column[j];
      if (!(pivot > 0) || !std::isfinite(pivot)) return false;  // not (numerically) positive definite
      const double root = std::sqrt(pivot);
      const double inverse = 1.0 / root;
      column[j] = root;
      for (Index i = j + 1; i < m; ++i) column[i] *= inverse;
    }
    // Rows kb.. of U = L^T, a panel row (width entries, contiguous in U) at a
    // time: U's columns are 8m bytes apart, which one L1 set per column would
    // take entry by entry.
    for (Index i = kb; i < m; ++i) {
      const Index last = std::min(kb + width, i + 1);
      for (Index j = kb; j < last; ++j) u[i * m + j] = l[j * m + i];
    }
  }
  for (Index k = 0; k + 1 < m; ++k) std::fill(u + k * m + k + 1, u + (k + 1) * m, 0.0);
  return true;
#else
  Eigen::Map<const Eigen::MatrixXd> gram(g, m, m);
  Eigen::Map<Eigen::MatrixXd> lower(l, m, m), upper(u, m, m);
  const Eigen::LLT<Eigen::MatrixXd, Eigen::Lower> llt(gram.selfadjointView<Eigen::Lower>());
  if (llt.info() != Eigen::Success) return false;
  lower = llt.matrixL();
  // Eigen's LLT tests pivot <= 0, which a NaN pivot passes.
  if (!lower.allFinite()) return false;
  upper = lower.transpose();
  return true;
#endif
}

void TridiagonalizeLower(double* a, Index n, double* h) {
  if (n < 2) return;
#ifdef FORESHOCK_QK_AVX2
  // Step t: reflector t from column t (rows t + 1..), v_t stored there with a
  // unit first entry; w_t = tau (A22 v_t) - (tau^2 / 2)(v_t' A22 v_t) v_t;
  // update A22 -= v_t w_t' + w_t v_t'. The update of step t - 1 is applied
  // to column t first (it holds reflector t), then to columns t + 1.. in the
  // same pass that forms A22 v_t from the updated entries.
  thread_local std::vector<double> w_now, w_prev, y, zeros;
  w_now.assign(static_cast<size_t>(n), 0.0);
  w_prev.assign(static_cast<size_t>(n), 0.0);
  y.assign(static_cast<size_t>(n), 0.0);
  zeros.assign(static_cast<size_t>(n), 0.0);
  const double* pv = zeros.data();  // v_{t-1} (column t - 1 of a); zeros before step 0
  double pending_beta = 0;
  for (Index t = 0; t <= n - 1; ++t) {
    double* ct = a + t * n;
    const double* pw = w_prev.data();
    // Column t (rows t..) gets step t - 1's update.
    for (Index k = t; k < n; ++k) ct[k] -= pv[k] * pw[t] + pw[k] * pv[t];
    if (t > 0) a[(t - 1) * n + t] = pending_beta;  // v_{t-1}'s unit entry is no longer read
    if (t == n - 1) break;
    const Index below = n - t - 1;
    double tau, beta;
    Eigen::Map<Eigen::VectorXd>(ct + t + 1, below).makeHouseholderInPlace(tau, beta);
    ct[t + 1] = 1;
    h[t] = tau;
    pending_beta = beta;
    const double* v = ct;  // v_t(k) = a(k, t), k > t
    std::fill(y.begin() + t + 1, y.end(), 0.0);
    double* yd = y.data();
    auto horizontal_sum = [](__m256d x) {
      const __m128d half = _mm_add_pd(_mm256_castpd256_pd128(x), _mm256_extractf128_pd(x, 1));
      return _mm_cvtsd_f64(_mm_add_sd(half, _mm_unpackhi_pd(half, half)));
    };
    Index j = t + 1;
    // Columns in pairs: the loads of pv, pw, v and the load and store of y
    // serve both (the loop is bound by loads and stores, not by FMAs).
    for (; j + 1 < n; j += 2) {
      double* c0 = a + j * n;
      double* c1 = c0 + n;
      const double pv0 = pv[j], pw0 = pw[j], v0 = v[j];
      const double pv1 = pv[j + 1], pw1 = pw[j + 1], v1 = v[j + 1];
      const double diagonal0 = c0[j] - 2 * pv0 * pw0;
      c0[j] = diagonal0;
      const double below0 = c0[j + 1] - pv1 * pw0 - pw1 * pv0;  // a(j + 1, j)
      c0[j + 1] = below0;
      const double diagonal1 = c1[j + 1] - 2 * pv1 * pw1;
      c1[j + 1] = diagonal1;
      double dot0 = diagonal0 * v0 + below0 * v1;
      double dot1 = diagonal1 * v1;
      yd[j + 1] += below0 * v0;
      const __m256d pw0v = _mm256_set1_pd(pw0), pv0v = _mm256_set1_pd(pv0), v0v = _mm256_set1_pd(v0);
      const __m256d pw1v = _mm256_set1_pd(pw1), pv1v = _mm256_set1_pd(pv1), v1v = _mm256_set1_pd(v1);
      __m256d dots0 = _mm256_setzero_pd(), dots1 = _mm256_setzero_pd();
      Index k = j + 2;
      for (; k + 4 <= n; k += 4) {
        const __m256d pvk = _mm256_loadu_pd(pv + k), pwk = _mm256_loadu_pd(pw + k), vk = _mm256_loadu_pd(v + k);
        __m256d x0 = _mm256_loadu_pd(c0 + k), x1 = _mm256_loadu_pd(c1 + k);
        x0 = _mm256_fnmadd_pd(pwk, pv0v, _mm256_fnmadd_pd(pvk, pw0v, x0));
        x1 = _mm256_fnmadd_pd(pwk, pv1v, _mm256_fnmadd_pd(pvk, pw1v, x1));
        _mm256_storeu_pd(c0 + k, x0);
        _mm256_storeu_pd(c1 + k, x1);
        __m256d yk = _mm256_fmadd_pd(x0, v0v, _mm256_loadu_pd(yd + k));
        _mm256_storeu_pd(yd + k, _mm256_fmadd_pd(x1, v1v, yk));
        dots0 = _mm256_fmadd_pd(x0, vk, dots0);
        dots1 = _mm256_fmadd_pd(x1, vk, dots1);
      }
      for (; k < n; ++k) {
        const double x0 = c0[k] - pv[k] * pw0 - pw[k] * pv0;
        const double x1 = c1[k] - pv[k] * pw1 - pw[k] * pv1;
        c0[k] = x0;
        c1[k] = x1;
        yd[k] += x0 * v0 + x1 * v1;
        dot0 += x0 * v[k];
        dot1 += x1 * v[k];
      }
      yd[j] += dot0 + horizontal_sum(dots0);
      yd[j + 1] += dot1 + horizontal_sum(dots1);
    }
    for (; j < n; ++j) {  // the last column when their count is odd
      double* cj = a + j * n;
      const double pvj = pv[j], pwj = pw[j], vj = v[j];
      const double diagonal = cj[j] - 2 * pv[j] * pw[j];
      cj[j] = diagonal;
      double dot = diagonal * vj;  // y(j) gets the diagonal once, the rest below
      for (Index k = j + 1; k < n; ++k) {
        const double x = cj[k] - pv[k] * pwj - pw[k] * pvj;
        cj[k] = x;
        yd[k] += x * vj;
        dot += x * v[k];
      }
      yd[j] += dot;
    }
    // w_t = tau y - (tau / 2)(tau y . v) v, rows t + 1..
    double wv = 0;
    for (Index k = t + 1; k < n; ++k) {
      w_now[k] = tau * yd[k];
      wv += w_now[k] * v[k];
    }
    const double alpha = -0.5 * tau * wv;
    for (Index k = t + 1; k < n; ++k) w_now[k] += alpha * v[k];
    w_now[t] = 0;  // pw[t + 1 - 1]: read as pw[j] only for j > t
    std::swap(w_now, w_prev);
    pv = v;
  }
#else
  Eigen::Map<Eigen::MatrixXd> matrix(a, n, n);
  Eigen::Map<Eigen::VectorXd> coefficients(h, n - 1);
  Eigen::internal::tridiagonalization_inplace(matrix, coefficients);
#endif
}

namespace {

// One root-free QL sweep with shift sigma over rows m - 1 .. l (Start, Step
// from i = m - 1 down to l, then Finish): dsterf's iteration on the diagonal
// and the squared off-diagonal e2.
// Sweeps run together per shift (see TridiagonalEigenvalues): 3 measured
// 1.6x faster than one at a time on a 128 x 128 core, 4 hardly more.
constexpr int kSweeps = 3;

struct Sweep {
  double sigma = 0, gamma = 0, pp = 0, c = 1, s = 0;

  void Start(double last) {
    gamma = last - sigma;
    pp = gamma * gamma;
    c = 1;
    s = 0;
  }

  void Step(double* diag, double* e2, int i, int m) {
    const double bb = e2[i];
    const double rr = pp + bb;  // > 0: bb > negligible
    if (i != m - 1) e2[i + 1] = s * rr;
    // The sweep is latency-bound, so it is written to shorten the path from
    // pp to the next pp: with c = pp / rr, s = bb / rr, dsterf's
    // gamma = c (alpha - sigma) - s gamma_old is numerator / rr, and its
    // p = gamma^2 / c is numerator^2 / (rr pp): one division after rr pp,
    // while numerator and 1 / rr run beside it.
    const double old_gamma = gamma;
    const double alpha = diag[i];
    const double numerator = pp * (alpha - sigma) - bb * old_gamma;
    const double denominator = rr * pp;
    if (denominator >= std::numeric_limits<double>::min()) {
      const double inverse_rr = 1.0 / rr;
      c = pp * inverse_rr;
      s = bb * inverse_rr;
      gamma = numerator * inverse_rr;
      pp = numerator * numerator / denominator;
    } else {  // pp = 0 (dsterf's c = 0 case) or rr pp below the normal range
      const double inverse_rr = 1.0 / rr;
      const double old_c = c;
      c = pp * inverse_rr;
      s = bb * inverse_rr;
      gamma = numerator * inverse_rr;
      pp = pp != 0 ? gamma * gamma * (rr / pp) : old_c * bb;
    }
    diag[i + 1] = old_gamma + (alpha - gamma);
  }

  void Finish(double* diag, double* e2, int l) const {
    e2[l] = s * pp;
    diag[l] = sigma + gamma;
  }
};

}  // namespace

// Eigenvalues of the symmetric tridiagonal matrix with diagonal `diag` and
// off-diagonal `off`; `diag` receives them (unsorted), `off` is destroyed.
// Pal-Walker-Kahan root-free QL, the iteration of LAPACK dsterf: no square
// roots in the sweep, so it is about 3x faster than Eigen's Givens QR (values
// only). Deflation is absolute (|e| <= eps ||T||): the caller wants accuracy
// relative to the largest eigenvalue, not to each one. Returns false if some
// eigenvalue needs more than 30 sweeps on average (not seen in practice).
bool TridiagonalEigenvalues(std::vector<double>& diag, std::vector<double>& off) {
  const int n = static_cast<int>(diag.size());
  double norm = 0;
  for (int i = 0; i < n; ++i) {
    const double left = i > 0 ? std::abs(off[i - 1]) : 0.0;
    const double right = i + 1 < n ? std::abs(off[i]) : 0.0;
    norm = std::max(norm, std::abs(diag[i]) + left + right);
  }
  if (!(norm > 0)) return true;
  // Scaled by a power of two (exact) to a norm in [1, 2): the sweep's products
  // of squares (rr pp ~ norm^4) then stay far from over- and underflow.
  const int exponent = std::ilogb(norm);
  for (double& x : diag) x = std::ldexp(x, -exponent);
  for (double& x : off) x = std::ldexp(x, -exponent);
  norm = std::ldexp(norm, -exponent);
  // The sweeps deflate at the top; like dsterf (which picks QL or QR per
  // block), start from the end whose diagonal entry is smaller in magnitude,
  // here by reversing T (the same eigenvalues): ~10% fewer steps on the cores
  // of random increments.
  if (n > 1 && std::abs(diag[n - 1]) < std::abs(diag[0])) {
    std::reverse(diag.begin(), diag.end());
    std::reverse(off.begin(), off.end());
  }
  std::vector<double>& e2 = off;  // squared off-diagonal from here on
  for (double& e : e2) e *= e;
  const double tolerance = std::numeric_limits<double>::epsilon() * norm;
  const double negligible = tolerance * tolerance;
  int sweeps = 0;
  for (int l = 0; l < n;) {
    int m = l;
    while (m + 1 < n && e2[m] > negligible) ++m;
    if (m == l) {  // diag[l] has converged
      ++l;
      continue;
    }
    if (m == l + 1) {  // a 2 x 2 block: closed form
      const double mean = 0.5 * (diag[l] + diag[l + 1]);
      const double half_gap = 0.5 * (diag[l] - diag[l + 1]);
      const double radius = std::sqrt(half_gap * half_gap + e2[l]);
      diag[l] = mean + radius;
      diag[l + 1] = mean - radius;
      e2[l] = 0;
      l += 2;
      continue;
    }
    sweeps += kSweeps;
    if (sweeps > 30 * n) return false;
    // Shift: the eigenvalue of the leading 2 x 2 block nearer diag[l].
    const double p = diag[l];
    const double root_e = std::sqrt(e2[l]);
    double sigma = (diag[l + 1] - p) / (2 * root_e);
    sigma = p - root_e / (sigma + std::copysign(std::sqrt(sigma * sigma + 1), sigma));
    // kSweeps sweeps with that shift, each one row behind the one before:
    // a sweep is a chain of dependent operations (latency-bound), so the
    // chains run side by side in about the time of one. Each reads the rows
    // the one before has just finished, so the result is that of the sweeps
    // in turn (with the shift not recomputed in between: near convergence
    // it barely moves).
    Sweep sweep[kSweeps];
    for (Sweep& one : sweep) one.sigma = sigma;
    // At step i, sweep k works on row i + k (k rows behind sweep 0).
    auto edge = [&](int i) {
      for (int k = 0; k < kSweeps; ++k) {
        const int j = i + k;
        if (j == m) {
          sweep[k].Start(diag[m]);
        } else if (j >= l && j < m) {
          sweep[k].Step(diag.data(), e2.data(), j, m);
          if (j == l) sweep[k].Finish(diag.data(), e2.data(), l);
        }
      }
    };
    int i = m;
    for (; i > m - kSweeps && i > l - kSweeps; --i) edge(i);  // the sweeps start
    for (; i > l; --i) {  // every sweep inside the block
#pragma GCC unroll 4
      for (int k = 0; k < kSweeps; ++k) sweep[k].Step(diag.data(), e2.data(), i + k, m);
    }
    for (; i > l - kSweeps; --i) edge(i);  // the sweeps end
  }
  for (double& x : diag) x = std::ldexp(x, exponent);
  return true;
}

}  // namespace foreshock::detectors
