#pragma once

namespace foreshock::detectors {

// Edge-of-stability threshold tau of the optimizer (docs/DESIGN.md §1.3):
// (2 + 2 beta1) / ((1 - beta1) lr) for Adam (preconditioned), (2 + 2 beta1) / lr
// for heavy-ball SGD, which is 2 / lr for plain gradient descent. Returns 0
// when lr <= 0 or beta1 is outside [0, 1).
double EdgeOfStabilityThreshold(double lr, double beta1, bool preconditioned);

}  // namespace foreshock::detectors
