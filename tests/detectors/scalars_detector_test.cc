#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "detectors/detector.h"

namespace foreshock::detectors {
namespace {

class RecordingEmitter : public Emitter {
 public:
  void Emit(const Observation& o) override {
    EXPECT_EQ(o.layer, kNoLayer);
    EXPECT_EQ(o.head, kAllHeads);
    EXPECT_TRUE(values.emplace(std::string(o.signal), o.value).second) << o.signal;
  }
  void NonFinite(SampleKind kind, int64_t count) override {
    EXPECT_EQ(kind, SampleKind::kScalars);
    non_finite += count;
  }
  std::map<std::string, double> values;
  int64_t non_finite = 0;
};

const DetectorInfo& ScalarsInfo() {
  for (const DetectorInfo& info : DetectorRegistry::Instance().detectors())
    if (info.name == "scalars") return info;
  ADD_FAILURE() << "scalars detector not registered";
  static const DetectorInfo none{};
  return none;
}

Sample MakeSample(const ScalarsSample& scalars) {
  Sample sample;
  sample.run = "r";
  sample.step = 10;
  sample.payload = scalars;
  return sample;
}

TEST(ScalarsDetector, RegisteredWithRunScopedSignals) {
  const DetectorInfo& info = ScalarsInfo();
  EXPECT_EQ(info.kind, SampleKind::kScalars);
  std::vector<std::string> names;
  for (const SignalSpec& spec : info.signals) {
    names.emplace_back(spec.name);
    EXPECT_EQ(spec.scope, SignalScope::kRun);
    EXPECT_FALSE(spec.help.empty());
  }
  EXPECT_EQ(names, (std::vector<std::string>{"loss", "grad_norm", "lr"}));
}

TEST(ScalarsDetector, EmitsPresentFields) {
  auto detector = ScalarsInfo().create({});
  RecordingEmitter emitter;
  ScalarsSample s;
  s.has_loss = true, s.loss = 2.5;
  s.has_lr = true, s.lr = 3e-4;
  s.grad_norm = 99;  // not present: must not be emitted
  detector->Process(MakeSample(s), emitter);
  EXPECT_EQ(emitter.values, (std::map<std::string, double>{{"loss", 2.5}, {"lr", 3e-4}}));
  EXPECT_EQ(emitter.non_finite, 0);
}

TEST(ScalarsDetector, NonFiniteFieldsAreCountedNotEmitted) {
  auto detector = ScalarsInfo().create({});
  RecordingEmitter emitter;
  ScalarsSample s;
  s.has_loss = true, s.loss = std::numeric_limits<double>::quiet_NaN();
  s.has_grad_norm = true, s.grad_norm = std::numeric_limits<double>::infinity();
  s.has_lr = true, s.lr = 1e-3;
  detector->Process(MakeSample(s), emitter);
  EXPECT_EQ(emitter.non_finite, 2);
  EXPECT_EQ(emitter.values, (std::map<std::string, double>{{"lr", 1e-3}}));
}

}  // namespace
}  // namespace foreshock::detectors
