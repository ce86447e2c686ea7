// Dense kernels of the QK spectrum's Gram route (detectors/qk_spectrum.cc),
// which spends most of its time in them. With AVX2 + FMA (the README's
// x86-64-v3 build) they run one register-blocked tile kernel (12 accumulators,
// no packing copy, no heap allocation); otherwise they call Eigen.
#pragma once

#include <cstddef>
#include <vector>

namespace foreshock::detectors {

// The lower triangle of X^T X, X being rows x cols doubles with row i at
// x + i * stride (stride >= cols), into gram (cols x cols, column-major,
// leading dimension ld >= cols); entries above the diagonal are unspecified.
// Reads X in row chunks that stay in L1; sums in double.
void GramLowerTriangle(const double* x, std::ptrdiff_t rows, std::ptrdiff_t cols, std::ptrdiff_t stride,
                       double* gram, std::ptrdiff_t ld);

// The congruence C = U G U^T of a symmetric G by an upper triangular U (both
// m x m, column-major, leading dimension m; G full, U's strict lower triangle
// zero), with W = G U^T on the way: w receives W row-major (W(i, j) at
// w[i * m + j]) and c the lower triangle of C (column-major, leading
// dimension m; above the diagonal unspecified). U's triangle halves the work
// of each product: m^3/2 + m^3/6 multiply-adds instead of 2 m^3.
void UpperCongruence(const double* u, const double* g, std::ptrdiff_t m, double* w, double* c);

// Cholesky factor G = L L^T of the symmetric m x m matrix whose lower
// triangle is in g (column-major, leading dimension m; g is not changed):
// l receives L (column-major, leading dimension m, above the diagonal
// unspecified) and u receives U = L^T (column-major, strict lower triangle
// zero), the layout UpperCongruence reads. Returns false, with l and u
// unspecified, when a pivot is not positive and finite (G not numerically
// positive definite). With AVX2 a left-looking factorization on the tile
// kernel; otherwise Eigen's LLT.
bool CholeskyLower(const double* g, std::ptrdiff_t m, double* l, double* u);

// Householder reduction to tridiagonal form of the symmetric n x n matrix
// whose lower triangle is in `a` (column-major, leading dimension n), in the
// layout of Eigen's internal::tridiagonalization_inplace, so that the same
// HouseholderSequence applies: diagonal on a's diagonal, off-diagonal on its
// first subdiagonal, reflector i's essential part below that, its coefficient
// in h[i] (n - 1 of them). With AVX2 each step's rank-2 update and the next
// step's symmetric matrix-vector product share one pass over the trailing
// matrix (Eigen makes two); otherwise Eigen's routine.
void TridiagonalizeLower(double* a, std::ptrdiff_t n, double* h);

// Eigenvalues (unsorted) of the symmetric tridiagonal matrix with diagonal
// `diag` and off-diagonal `off` (size n - 1): diag receives them, off is
// destroyed. Root-free QL (Pal-Walker-Kahan, LAPACK dsterf), three sweeps per
// shift run side by side (the sweep is latency-bound); absolute accuracy
// ~eps ||T||. Returns false if the sweeps do not converge (not seen).
bool TridiagonalEigenvalues(std::vector<double>& diag, std::vector<double>& off);

}  // namespace foreshock::detectors
