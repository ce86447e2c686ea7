// Decoding of RawTensor bytes (little-endian, row-major) into float or double.
//
// The wire carries float32, bfloat16 and IEEE float16. Decoding is exact:
// every bf16 and fp16 value (subnormals, infinities and NaN included) is
// representable in float32.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include <Eigen/Core>

#include "detectors/sample.h"

namespace foreshock::detectors {

// Decoded tensors keep the wire layout (row-major), so one head of a
// [heads, tokens, head_dim] tensor is a contiguous [tokens, head_dim] block.
template <typename Scalar>
using RowMajorMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
// Read-only view of such a block (a Map or a RowMajorMatrix binds without a copy).
template <typename Scalar>
using ConstRowMajorRef = Eigen::Ref<const RowMajorMatrix<Scalar>>;

// bfloat16 is the upper half of a float32: the bits are shifted into place.
float BFloat16BitsToFloat(uint16_t bits);
// IEEE 754 binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
// Subnormals (exponent 0) are mantissa * 2^-24; exponent 31 is inf or NaN.
float Float16BitsToFloat(uint16_t bits);

// Decodes all num_elements() values of `tensor` into `out`, which must have
// exactly that size. Instantiated for float and double.
template <typename Scalar>
void DecodeTensor(const RawTensor& tensor, std::span<Scalar> out);

// Convenience: decodes into a vector (resized to num_elements()).
template <typename Scalar>
void DecodeTensor(const RawTensor& tensor, std::vector<Scalar>& out);

// Number of NaN or +-Inf values in `tensor`. Reads the exponent bits directly,
// without decoding, so it is cheap enough to run on every sample.
int64_t CountNonFinite(const RawTensor& tensor);

}  // namespace foreshock::detectors
