// loss_over_running_min (detectors/loss_divergence_detector.cc): the
// evaluation's divergence rule (demo/train.py divergence_step) as a signal.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <vector>

#include "tests/detectors/detector_test_support.h"

namespace foreshock::detectors {
namespace {

using testing::MakeDetector;
using testing::RecordingEmitter;

Sample Loss(int64_t step, double loss, std::string run = "r") {
  ScalarsSample s;
  s.has_loss = true;
  s.loss = loss;
  Sample sample;
  sample.run = std::move(run);
  sample.step = step;
  sample.payload = s;
  return sample;
}

std::vector<std::optional<double>> Feed(Detector& detector, const std::vector<double>& losses) {
  std::vector<std::optional<double>> out;
  for (size_t step = 0; step < losses.size(); ++step) {
    RecordingEmitter emitter;
    detector.Process(Loss(static_cast<int64_t>(step), losses[step]), emitter);
    out.push_back(emitter.Has("loss_over_running_min")
                      ? std::optional<double>(emitter.Value("loss_over_running_min"))
                      : std::nullopt);
  }
  return out;
}

// demo/train.py divergence_step with warm-up 100, transcribed.
std::optional<size_t> DivergenceStep(const std::vector<double>& losses) {
  double running_min = std::numeric_limits<double>::infinity();
  for (size_t step = 0; step < losses.size(); ++step) {
    if (step + 1 < 20 || step < 100) continue;
    double sum = 0;
    for (size_t i = step - 19; i <= step; ++i) sum += losses[i];
    running_min = std::min(running_min, sum / 20);
    if (sum / 20 > 1.3 * running_min) return step;
  }
  return std::nullopt;
}

TEST(LossDivergenceTest, ExceedsTheBoundExactlyWhereTheEvaluationsRuleSaysDiverged) {
  std::vector<double> losses;
  for (int s = 0; s < 400; ++s) {
    double loss = 2.0 + 3.0 * std::exp(-s / 30.0) + 0.05 * std::sin(s * 1.7);  // falls, noisy
    if (s >= 250) loss *= 1.0 + 0.01 * (s - 250);                                // then diverges
    losses.push_back(loss);
  }
  auto detector = MakeDetector("loss_divergence");
  const auto ratios = Feed(*detector, losses);
  for (size_t s = 0; s < 100; ++s) EXPECT_FALSE(ratios[s]) << s;  // warm-up
  std::optional<size_t> first;
  for (size_t s = 100; s < ratios.size(); ++s) {
    ASSERT_TRUE(ratios[s]) << s;
    if (!first && *ratios[s] > 1.3) first = s;
  }
  ASSERT_TRUE(DivergenceStep(losses));
  EXPECT_EQ(first, DivergenceStep(losses));
  // It stays above while the run stays diverged.
  for (size_t s = *first; s < ratios.size(); ++s) EXPECT_GT(*ratios[s], 1.3) << s;
}

TEST(LossDivergenceTest, NonFiniteLossesAreSkippedAndStepsAreNotCountedTwice) {
  auto detector = MakeDetector("loss_divergence");
  RecordingEmitter emitter;
  for (int64_t s = 0; s < 100; ++s) detector->Process(Loss(s, 2.0), emitter);
  EXPECT_TRUE(emitter.observations.empty());
  detector->Process(Loss(100, std::numeric_limits<double>::quiet_NaN()), emitter);
  EXPECT_TRUE(emitter.observations.empty());
  detector->Process(Loss(101, 2.0), emitter);
  EXPECT_DOUBLE_EQ(emitter.Value("loss_over_running_min"), 1.0);
  emitter.Clear();
  detector->Process(Loss(101, 100.0), emitter);  // another rank's copy of step 101
  EXPECT_TRUE(emitter.observations.empty());
}

}  // namespace
}  // namespace foreshock::detectors
