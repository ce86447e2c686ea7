// Options of the scalar baselines detector (scalar_baselines_detector.cc, what
// users have today), set through DetectorOptions.
#pragma once

namespace foreshock::detectors {

struct ScalarBaselinesOptions {
  // OLMo-style spike: loss or grad norm above mean + spike_sigmas * std of
  // the trailing spike_window values ...
  int spike_window = 128;
  double spike_sigmas = 6.0;
  // ... and Megatron-style spiky loss: loss above spiky_loss_factor x its
  // running max.
  double spiky_loss_factor = 10.0;
};

}  // namespace foreshock::detectors
