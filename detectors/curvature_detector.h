// Options of the curvature detector (curvature_detector.cc), set through
// DetectorOptions.
#pragma once

namespace foreshock::detectors {

struct CurvatureDetectorOptions {
  // Estimates with residual ||Av - lambda v||/|lambda| above this are
  // exported but flagged as unconverged and kept out of detection.
  double max_residual = 0.1;
};

}  // namespace foreshock::detectors
