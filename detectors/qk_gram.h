// The Gram matrix X^T X of a tall row-major double matrix, lower triangle
// only: the QK spectrum's Gram route spends most of its time here (two per
// head-sample, n x 2d each). With AVX2 + FMA (the README's x86-64-v3 build) a
// register-blocked kernel reads X in row chunks that stay in L1, with no
// packing copy and no heap allocation; otherwise Eigen's rankUpdate (SYRK).
#pragma once

#include <cstddef>

namespace foreshock::detectors {

// gram (cols x cols, column-major, leading dimension ld >= cols) receives the
// lower triangle (i >= j) of X^T X, X being rows x cols doubles with row i at
// x + i * stride (stride >= cols). Entries above the diagonal are unspecified.
// Sums run over the rows in order within each L1 chunk, in double.
void GramLowerTriangle(const double* x, std::ptrdiff_t rows, std::ptrdiff_t cols, std::ptrdiff_t stride,
                       double* gram, std::ptrdiff_t ld);

}  // namespace foreshock::detectors
