// A rank's step-scalars sample for the rank-merge tests (wire/rank_scalars.h),
// shared by tests/wire/ and the worker pool's tests.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "detectors/sample.h"

namespace foreshock::wire::testing {

inline detectors::Sample Report(const std::string& run, int32_t rank, int64_t step,
                                std::optional<double> loss,
                                std::optional<double> grad_norm = std::nullopt,
                                std::optional<double> lr = std::nullopt, int32_t world_size = 0) {
  detectors::ScalarsSample s;
  s.has_loss = loss.has_value();
  s.loss = loss.value_or(0);
  s.has_grad_norm = grad_norm.has_value();
  s.grad_norm = grad_norm.value_or(0);
  s.has_lr = lr.has_value();
  s.lr = lr.value_or(0);
  detectors::Sample sample;
  sample.run = run;
  sample.rank = rank;
  sample.world_size = world_size;
  sample.step = step;
  sample.payload = s;
  return sample;
}

}  // namespace foreshock::wire::testing
