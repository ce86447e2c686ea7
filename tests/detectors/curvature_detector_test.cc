#include <gtest/gtest.h>

#include <cmath>

#include "detectors/curvature.h"
#include "tests/detectors/detector_test_support.h"
#include "detectors/curvature_detector.h"

namespace foreshock::detectors {
namespace {

using testing::MakeDetector;
using testing::RecordingEmitter;

Sample CurvatureSampleOf(CurvatureSample c) {
  Sample sample;
  sample.run = "r";
  sample.step = 50;
  sample.payload = std::move(c);
  return sample;
}

TEST(EdgeOfStabilityTest, ThresholdsFromDesign) {
  EXPECT_DOUBLE_EQ(EdgeOfStabilityThreshold(0.1, 0.0, false), 20.0);            // 2 / lr
  EXPECT_DOUBLE_EQ(EdgeOfStabilityThreshold(1e-3, 0.9, true), 38.0 / 1e-3);     // 38 / lr at beta1 0.9
  EXPECT_DOUBLE_EQ(EdgeOfStabilityThreshold(0.1, 0.9, false), 38.0);            // heavy ball (2+2b)/lr
  EXPECT_EQ(EdgeOfStabilityThreshold(0.0, 0.9, true), 0.0);
  EXPECT_EQ(EdgeOfStabilityThreshold(1e-3, 1.0, true), 0.0);
}

TEST(CurvatureDetectorTest, RatioAgainstAdamThresholdAndBlocks) {
  auto detector = MakeDetector("curvature");
  RecordingEmitter emitter;
  CurvatureSample c;
  c.lambda_max = 57000;
  c.residual = 0.01;
  c.hvps = 3;
  c.preconditioned = true;
  c.lr = 1e-3;
  c.beta1 = 0.9;
  c.overlap = 0.98;
  c.layer_rayleigh = {1000, 2000, 54000};
  detector->Process(CurvatureSampleOf(c), emitter);
  EXPECT_DOUBLE_EQ(emitter.Value("curvature_lambda_max"), 57000);
  EXPECT_NEAR(emitter.Value("curvature_eos_ratio"), 57000 / 38000.0, 1e-12);
  EXPECT_EQ(emitter.Value("curvature_converged"), 1.0);
  EXPECT_EQ(emitter.Value("curvature_block_rayleigh", 2), 54000);
  EXPECT_EQ(emitter.Value("curvature_hvps"), 3);
  for (const auto& r : emitter.observations) EXPECT_TRUE(r.for_detection) << r.signal;
}

TEST(CurvatureDetectorTest, UnconvergedEstimatesAreExportedButNotForDetection) {
  DetectorOptions options;
  options.Mutable<CurvatureDetectorOptions>().max_residual = 0.05;
  auto detector = MakeDetector("curvature", options);
  RecordingEmitter emitter;
  CurvatureSample c;
  c.lambda_max = 10;
  c.residual = 0.2;
  c.lr = 0.1;
  detector->Process(CurvatureSampleOf(c), emitter);
  EXPECT_EQ(emitter.Value("curvature_converged"), 0.0);
  EXPECT_DOUBLE_EQ(emitter.Value("curvature_eos_ratio"), 0.5);
  for (const auto& r : emitter.observations) EXPECT_FALSE(r.for_detection) << r.signal;
}

TEST(CurvatureDetectorTest, NonFiniteEstimateIsCounted) {
  auto detector = MakeDetector("curvature");
  RecordingEmitter emitter;
  CurvatureSample c;
  c.lambda_max = NAN;
  c.layer_rayleigh = {1, INFINITY};
  detector->Process(CurvatureSampleOf(c), emitter);
  EXPECT_EQ(emitter.non_finite, 2);
  EXPECT_TRUE(emitter.observations.empty());
}

TEST(CurvatureDetectorTest, NoRatioWithoutLearningRate) {
  auto detector = MakeDetector("curvature");
  RecordingEmitter emitter;
  CurvatureSample c;
  c.lambda_max = 3;
  detector->Process(CurvatureSampleOf(c), emitter);
  EXPECT_TRUE(emitter.Has("curvature_lambda_max"));
  EXPECT_FALSE(emitter.Has("curvature_eos_ratio"));
}

}  // namespace
}  // namespace foreshock::detectors
