#include "detectors/qk_gram.h"

#include <algorithm>

#include <Eigen/Core>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FORESHOCK_GRAM_AVX2 1
#endif

namespace foreshock::detectors {
namespace {

using Index = std::ptrdiff_t;

#ifdef FORESHOCK_GRAM_AVX2

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

#endif  // FORESHOCK_GRAM_AVX2

}  // namespace

void GramLowerTriangle(const double* x, Index rows, Index cols, Index stride, double* gram, Index ld) {
  if (cols <= 0) return;
  if (rows <= 0) {
    for (Index j = 0; j < cols; ++j) std::fill(gram + j * ld + j, gram + j * ld + cols, 0.0);
    return;
  }
#ifdef FORESHOCK_GRAM_AVX2
  constexpr int kTileColumns = 6;  // broadcast columns per tile (12 accumulators)
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

}  // namespace foreshock::detectors
