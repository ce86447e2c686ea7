#include "detectors/attention_stats.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <limits>
#include <vector>

namespace foreshock::detectors {
namespace {

// Queries per block: big enough for an efficient matrix product, small enough
// that the block's logits (block x sequence length) stay in cache.
constexpr Eigen::Index kQueryBlock = 64;

}  // namespace

template <typename Scalar>
AttentionStats ComputeAttentionStats(const ConstRowMajorRef<Scalar>& q,
                                     const ConstRowMajorRef<Scalar>& k, const AttentionMask& mask) {
  using Eigen::Index;
  using RowArray = Eigen::Array<Scalar, 1, Eigen::Dynamic>;
  const Index n = q.rows();
  const Index d = q.cols();
  assert(k.rows() == n && k.cols() == d);
  const Index seq_len = mask.seq_len > 0 ? std::min<Index>(mask.seq_len, n) : n;

  thread_local std::vector<Scalar> logits_buffer;
  thread_local RowArray exp_row;
  logits_buffer.resize(static_cast<size_t>(std::min(kQueryBlock, seq_len) * seq_len));
  exp_row.resize(seq_len);

  const Scalar scale = Scalar(1) / std::sqrt(static_cast<Scalar>(d));
  double entropy_sum = 0;
  Scalar max_logit = -std::numeric_limits<Scalar>::infinity();
  for (Index seq_begin = 0; seq_begin < n; seq_begin += seq_len) {
    const Index seq_end = std::min(seq_begin + seq_len, n);
    for (Index block_begin = seq_begin; block_begin < seq_end; block_begin += kQueryBlock) {
      const Index block_end = std::min(block_begin + kQueryBlock, seq_end);
      const Index rows = block_end - block_begin;
      // Causal: no query in the block sees past block_end - 1, so those keys are skipped.
      const Index keys = (mask.causal ? block_end : seq_end) - seq_begin;
      Eigen::Map<RowMajorMatrix<Scalar>> logits(logits_buffer.data(), rows, keys);
      logits.noalias() =
          (scale * q.middleRows(block_begin, rows)) * k.middleRows(seq_begin, keys).transpose();
      for (Index r = 0; r < rows; ++r) {
        const Index allowed = mask.causal ? block_begin + r - seq_begin + 1 : keys;
        auto shifted = logits.row(r).head(allowed).array();
        const Scalar row_max = shifted.maxCoeff();
        max_logit = std::max(max_logit, row_max);
        shifted -= row_max;  // <= 0, so exp cannot overflow
        auto e = exp_row.head(allowed);
        e = shifted.exp();
        // H = log Z - sum(e * x) / Z with x = s - max, Z = sum(e): both terms are
        // >= 0, so there is no cancellation.
        const double z = static_cast<double>(e.sum());
        const double weighted = static_cast<double>((e * shifted).sum());
        entropy_sum += std::log(z) - weighted / z;
      }
    }
  }
  AttentionStats stats;
  stats.mean_entropy = entropy_sum / static_cast<double>(n);
  stats.max_logit = static_cast<double>(max_logit);
  return stats;
}

template AttentionStats ComputeAttentionStats<float>(const ConstRowMajorRef<float>&,
                                                     const ConstRowMajorRef<float>&,
                                                     const AttentionMask&);
template AttentionStats ComputeAttentionStats<double>(const ConstRowMajorRef<double>&,
                                                      const ConstRowMajorRef<double>&,
                                                      const AttentionMask&);

}  // namespace foreshock::detectors
