#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "tests/detectors/detector_test_support.h"

namespace foreshock::detectors {
namespace {

using testing::MakeDetector;
using testing::RecordingEmitter;

Sample Scalars(int64_t step, double loss, double grad_norm, std::string run = "r") {
  ScalarsSample s;
  s.has_loss = s.has_grad_norm = true;
  s.loss = loss;
  s.grad_norm = grad_norm;
  Sample sample;
  sample.run = std::move(run);
  sample.step = step;
  sample.payload = s;
  return sample;
}

class ScalarBaselinesTest : public ::testing::Test {
 protected:
  // Feeds `n` noisy steps around loss 3, grad norm 1, starting at `first`.
  void Warm(int64_t first, int n) {
    for (int i = 0; i < n; ++i) {
      detector_->Process(Scalars(first + i, 3 + 0.01 * noise_(rng_), 1 + 0.01 * noise_(rng_)),
                         emitter_);
    }
  }
  int Count(const std::string& signal) const {
    int n = 0;
    for (const auto& r : emitter_.observations) n += r.signal == signal && r.value == 1.0;
    return n;
  }

  std::unique_ptr<Detector> detector_ = MakeDetector("scalar_baselines");
  RecordingEmitter emitter_;
  std::mt19937 rng_{1};
  std::normal_distribution<double> noise_{0, 1};
};

TEST_F(ScalarBaselinesTest, QuietOnNoiseAndSilentUntilTheWindowIsFull) {
  Warm(0, 127);
  EXPECT_FALSE(emitter_.Has("loss_zscore"));  // window not full yet
  Warm(127, 400);
  EXPECT_EQ(Count("baseline_olmo_spike"), 0);
  EXPECT_EQ(Count("baseline_megatron_spiky_loss"), 0);
  EXPECT_EQ(Count("baseline_nonfinite"), 0);
}

TEST_F(ScalarBaselinesTest, SpikesFireOnTheirRules) {
  Warm(0, 200);
  emitter_.Clear();
  detector_->Process(Scalars(200, 3.2, 1.0), emitter_);  // ~20 sigma on loss
  EXPECT_EQ(emitter_.Value("baseline_olmo_spike"), 1.0);
  EXPECT_EQ(emitter_.Value("baseline_megatron_spiky_loss"), 0.0);  // not 10x the max
  EXPECT_GT(emitter_.Value("loss_zscore"), 6.0);

  emitter_.Clear();
  detector_->Process(Scalars(201, 3.0, 5.0), emitter_);  // grad-norm spike alone
  EXPECT_EQ(emitter_.Value("baseline_olmo_spike"), 1.0);

  emitter_.Clear();
  detector_->Process(Scalars(202, 40.0, 1.0), emitter_);  // > 10 x running max (3.2)
  EXPECT_EQ(emitter_.Value("baseline_megatron_spiky_loss"), 1.0);

  emitter_.Clear();
  detector_->Process(Scalars(203, NAN, 1.0), emitter_);
  EXPECT_EQ(emitter_.Value("baseline_nonfinite"), 1.0);
  EXPECT_FALSE(emitter_.Has("baseline_olmo_spike"));
}

TEST_F(ScalarBaselinesTest, LaterRanksReportingTheSameStepAreIgnored) {
  Warm(0, 10);
  emitter_.Clear();
  detector_->Process(Scalars(9, 1e6, 1e6), emitter_);  // rank 1's copy of step 9
  EXPECT_TRUE(emitter_.observations.empty());
}

}  // namespace
}  // namespace foreshock::detectors
