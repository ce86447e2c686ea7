// Options of the router detector (router_detector.cc), set through
// DetectorOptions.
#pragma once

#include <cstdint>

namespace foreshock::detectors {

struct RouterDetectorOptions {
  // A token whose normalized routing entropy is below this counts as
  // low-entropy (router_low_entropy_fraction).
  double entropy_floor = 0.5;
  // An expert is dead when its mean load over the dead-expert window of the
  // same probe is below 0.1/E. The window spans at least dead_window_steps
  // training steps and dead_window samples, and at most dead_window_max
  // samples (what memory is reserved for). In steps, because a fixed sample
  // count judged a probe taken every 5 steps on 40 steps of a small probe,
  // where an expert a balanced router still uses can get no token for that
  // long (docs/DESIGN.md §1.2).
  int dead_window = 8;
  int64_t dead_window_steps = 200;
  int dead_window_max = 64;
  // An expert is overloaded when its load exceeds capacity_factor/E.
  double capacity_factor = 1.25;
};

}  // namespace foreshock::detectors
