// Options of the QK detector (qk_detector.cc), set through DetectorOptions.
#pragma once

namespace foreshock::detectors {

struct QKDetectorOptions {
  // Compute the top singular vector overlap between consecutive QK increments.
  bool track_top_vector = true;
};

}  // namespace foreshock::detectors
