// Options of the learning-rate schedule detector (lr_schedule_detector.cc),
// set through DetectorOptions.
#pragma once

namespace foreshock::detectors {

struct LrScheduleOptions {
  // lr_over_held_max: the warm-up is over after this many samples without a
  // new high, and a new LR level counts as trained once it has been held
  // this long.
  int held_samples = 20;
};

}  // namespace foreshock::detectors
