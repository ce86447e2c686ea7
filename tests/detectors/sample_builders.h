// Builds detector samples from plain floats, for tests and benchmarks.
#pragma once

#include <cstring>
#include <string>
#include <vector>

#include "detectors/sample.h"

namespace foreshock::detectors::testing {

// A router sample of layer 1 with fp32 logits [tokens, experts].
inline Sample RouterSampleOf(const std::vector<float>& logits, int tokens, int experts,
                             int top_k, int64_t step = 0, std::string run = "r") {
  RouterSample router;
  router.layer = 1;
  router.top_k = top_k;
  router.logits.dtype = DType::kFloat32;
  router.logits.shape = {tokens, experts};
  router.logits.data.resize(logits.size() * 4);
  std::memcpy(router.logits.data.data(), logits.data(), router.logits.data.size());
  Sample sample;
  sample.run = std::move(run);
  sample.step = step;
  sample.payload = std::move(router);
  return sample;
}

}  // namespace foreshock::detectors::testing
