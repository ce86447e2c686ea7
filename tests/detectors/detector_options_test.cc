// DetectorOptions (detectors/detector_options.h): each detector's options by
// type, its defaults until set, and copies that do not share changes (the
// worker pool keeps its own copy; a test's change must not leak into it).
#include "detectors/detector_options.h"

#include <gtest/gtest.h>

#include "detectors/curvature_detector.h"
#include "detectors/detector.h"
#include "detectors/router_detector.h"

namespace foreshock::detectors {
namespace {

TEST(DetectorOptionsTest, EachDetectorsOptionsAreItsDefaultsUntilSet) {
  DetectorOptions options;
  EXPECT_EQ(options.Get<RouterDetectorOptions>().dead_window, 8);
  EXPECT_EQ(options.Get<CurvatureDetectorOptions>().max_residual, 0.1);
  options.Mutable<RouterDetectorOptions>().dead_window = 4;
  EXPECT_EQ(options.Get<RouterDetectorOptions>().dead_window, 4);
  EXPECT_EQ(options.Get<RouterDetectorOptions>().dead_window_max, 64);  // the rest kept
  EXPECT_EQ(options.Get<CurvatureDetectorOptions>().max_residual, 0.1);  // another's untouched
  options.With(CurvatureDetectorOptions{.max_residual = 0.05});
  EXPECT_EQ(options.Get<CurvatureDetectorOptions>().max_residual, 0.05);
}

TEST(DetectorOptionsTest, ACopyIsIndependent) {
  DetectorOptions original;
  original.Mutable<RouterDetectorOptions>().dead_window = 4;
  DetectorOptions copy = original;
  copy.Mutable<RouterDetectorOptions>().dead_window = 16;
  copy.Mutable<CurvatureDetectorOptions>().max_residual = 0.5;
  EXPECT_EQ(original.Get<RouterDetectorOptions>().dead_window, 4);
  EXPECT_EQ(original.Get<CurvatureDetectorOptions>().max_residual, 0.1);
  EXPECT_EQ(copy.Get<RouterDetectorOptions>().dead_window, 16);
}

// The options reach the detector the registry creates: the router's
// footprint follows its dead-expert window.
TEST(DetectorOptionsTest, TheRegistryCreatesDetectorsWithTheirOptions) {
  const DetectorInfo* router = nullptr;
  for (const DetectorInfo& info : DetectorRegistry::Instance().detectors()) {
    if (info.name == "router") router = &info;
  }
  ASSERT_NE(router, nullptr);
  Sample sample;
  sample.run = "r";
  RouterSample payload;
  payload.layer = 0;
  payload.top_k = 2;
  payload.logits.shape = {64, 8};
  sample.payload = payload;
  DetectorOptions small, large;
  small.Mutable<RouterDetectorOptions>().dead_window_max = 8;
  large.Mutable<RouterDetectorOptions>().dead_window_max = 128;
  const auto small_bytes = router->retained_by(sample, small)->heads.at(0).second;
  const auto large_bytes = router->retained_by(sample, large)->heads.at(0).second;
  EXPECT_EQ(small_bytes, RouterRetainedBytes(64, 8, 2, 8));
  EXPECT_EQ(large_bytes, RouterRetainedBytes(64, 8, 2, 128));
  EXPECT_NE(router->create(large), nullptr);
}

}  // namespace
}  // namespace foreshock::detectors
