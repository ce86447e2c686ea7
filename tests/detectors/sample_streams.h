// Evolving sample streams for tests of stateful detectors and of the worker
// pool: each stream is one probe series whose values drift a little per step.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "detectors/sample.h"

namespace foreshock::detectors::testing {

// fp32 bytes, or bfloat16 (the upper half of each float).
inline RawTensor Encode(const std::vector<float>& values, std::vector<int64_t> shape, DType dtype) {
  RawTensor tensor;
  tensor.dtype = dtype;
  tensor.shape = std::move(shape);
  if (dtype == DType::kFloat32) {
    tensor.data.resize(values.size() * 4);
    std::memcpy(tensor.data.data(), values.data(), tensor.data.size());
  } else {  // bfloat16: the upper half of the float
    tensor.data.resize(values.size() * 2);
    for (size_t i = 0; i < values.size(); ++i) {
      const uint16_t bits = static_cast<uint16_t>(std::bit_cast<uint32_t>(values[i]) >> 16);
      std::memcpy(tensor.data.data() + 2 * i, &bits, 2);
    }
  }
  return tensor;
}

// One (run, layer, probe) QK series.
struct QKStream {
  std::string run;
  int layer;
  std::string probe;
  int heads, tokens, dim;
  DType dtype = DType::kFloat32;
  bool causal = false;
  std::vector<float> q{}, k{};

  Sample Next(int64_t step, std::mt19937& rng, double drift = 0.05) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const size_t n = static_cast<size_t>(heads * tokens * dim);
    if (q.size() != n) {
      q.assign(n, 0);
      k.assign(n, 0);
      for (size_t i = 0; i < n; ++i) q[i] = normal(rng), k[i] = normal(rng);
    } else {
      for (size_t i = 0; i < n; ++i) {
        q[i] += static_cast<float>(drift) * normal(rng);
        k[i] += static_cast<float>(drift) * normal(rng);
      }
    }
    return Same(step);
  }
  // The current values again (a zero increment), or with a NaN.
  Sample Same(int64_t step, bool nan = false) const {
    QKSample s;
    s.layer = layer;
    s.probe_id = probe;
    s.causal = causal;
    std::vector<float> qv = q;
    if (nan) qv[3] = std::numeric_limits<float>::quiet_NaN();
    s.q = Encode(qv, {heads, tokens, dim}, dtype);
    s.k = Encode(k, {heads, tokens, dim}, dtype);
    Sample sample;
    sample.run = run;
    sample.step = step;
    sample.payload = std::move(s);
    return sample;
  }
};

// One (run, layer, probe) router series; expert 0 is nearly never chosen.
struct RouterStream {
  std::string run;
  int layer;
  std::string probe;
  int tokens, experts, top_k;
  std::vector<float> logits{};

  Sample Next(int64_t step, std::mt19937& rng) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const size_t n = static_cast<size_t>(tokens * experts);
    if (logits.size() != n) {
      logits.assign(n, 0);
      for (size_t i = 0; i < n; ++i) logits[i] = normal(rng);
      // Expert 0 is nearly never chosen: dead in the window.
      for (int t = 0; t < tokens; ++t) logits[static_cast<size_t>(t * experts)] = -20;
    } else {
      for (size_t i = 0; i < n; ++i) logits[i] += 0.3f * normal(rng);
    }
    RouterSample r;
    r.layer = layer;
    r.probe_id = probe;
    r.top_k = top_k;
    r.logits = Encode(logits, {tokens, experts}, DType::kFloat32);
    Sample sample;
    sample.run = run;
    sample.step = step;
    sample.payload = std::move(r);
    return sample;
  }
};

inline Sample Scalars(const std::string& run, int64_t step, double loss, double grad_norm,
               double lr = 1e-3) {
  ScalarsSample s;
  s.has_loss = s.has_grad_norm = s.has_lr = true;
  s.loss = loss;
  s.grad_norm = grad_norm;
  s.lr = lr;
  Sample sample;
  sample.run = run;
  sample.step = step;
  sample.payload = s;
  return sample;
}

}  // namespace foreshock::detectors::testing
