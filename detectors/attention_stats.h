// Attention entropy and max logit of one head (docs/DESIGN.md §1.1, the
// cheap companions of the QK increment spectrum).
#pragma once

#include <cstdint>

#include "detectors/dtype.h"

namespace foreshock::detectors {

// Which keys a query sees. Tokens are split into back-to-back sequences of
// `seq_len` tokens when seq_len > 0 (a shorter last sequence takes the rest),
// else one sequence of all tokens. A query sees only keys of its own
// sequence: with `causal`, those at or before it; otherwise all of them.
struct AttentionMask {
  bool causal = false;
  int64_t seq_len = 0;
};

struct AttentionStats {
  // Softmax entropy of each query's attention row, in nats, averaged over queries.
  double mean_entropy = 0;
  // Largest logit S_ij = q_i . k_j / sqrt(d) over the allowed (unmasked) entries.
  double max_logit = 0;
};

// q and k are [n, d]. Rows are processed in blocks (a block of queries times
// the keys it may see), so memory is O(block * n), never n x n; the
// log-sum-exp is shifted by each row's maximum. Instantiated for float and
// double; the scratch buffer is per thread and reused across calls.
template <typename Scalar>
AttentionStats ComputeAttentionStats(const ConstRowMajorRef<Scalar>& q,
                                     const ConstRowMajorRef<Scalar>& k, const AttentionMask& mask);

}  // namespace foreshock::detectors
