// The retained-state footprint (detectors/retained_state.h): what the daemon
// predicts a probe leaves (RetainedBy, before a worker has it) must be what
// the detector then reports it holds (VisitRetained), also after a restore,
// so that the per-run state budget neither drifts nor lets state in unseen.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "detectors/detector.h"
#include "detectors/retained_state.h"
#include "codec/state_codec.h"
#include "tests/detectors/detector_test_support.h"
#include "tests/detectors/sample_streams.h"
#include "detectors/router_detector.h"

namespace foreshock::detectors {
namespace {

using testing::MakeDetector;
using testing::QKStream;
using testing::RecordingEmitter;
using testing::RouterStream;

// (run, kind, layer, probe_id, head) -> bytes
using Ledger = std::map<std::tuple<std::string, int, int, std::string, int>, int64_t>;

// What the daemon's ledger does with each footprint (server/ingest/state_budget.cc).
void Apply(Ledger& ledger, const std::string& run, const RetainedFootprint& f) {
  if (f.whole) {
    std::erase_if(ledger, [&](const auto& e) {
      const auto& [r, kind, layer, probe, head] = e.first;
      return r == run && kind == static_cast<int>(f.kind) && layer == f.layer && probe == f.probe_id;
    });
  }
  for (const auto& [head, bytes] : f.heads) {
    ledger[{run, static_cast<int>(f.kind), f.layer, f.probe_id, head}] = bytes;
  }
}

Ledger Reported(const Detector& detector) {
  Ledger ledger;
  detector.VisitRetained([&](std::string_view run, SampleKind kind, int layer,
                             std::string_view probe, int head, int64_t bytes) {
    EXPECT_TRUE(ledger.emplace(std::make_tuple(std::string(run), static_cast<int>(kind), layer,
                                               std::string(probe), head),
                               bytes).second);
  });
  return ledger;
}

int64_t Total(const Ledger& ledger) {
  int64_t total = 0;
  for (const auto& [key, bytes] : ledger) total += bytes;
  return total;
}

// Processes each sample and applies its predicted footprint.
void Feed(Detector& detector, Ledger& predicted, const std::vector<Sample>& samples,
          const DetectorOptions& options = {}) {
  RecordingEmitter emitter;
  for (const Sample& sample : samples) {
    detector.Process(sample, emitter);
    auto footprint = RetainedBy(sample, options);
    ASSERT_TRUE(footprint.has_value());
    Apply(predicted, sample.run, *footprint);
  }
}

Sample Subset(const Sample& full, const std::vector<int32_t>& heads) {
  Sample sample = full;
  auto& qk = std::get<QKSample>(sample.payload);
  const int64_t tokens = qk.q.shape[1], dim = qk.q.shape[2];
  const size_t head_bytes = static_cast<size_t>(tokens * dim) * DTypeSize(qk.q.dtype);
  std::string q, k;
  for (int32_t h : heads) {
    q += qk.q.data.substr(static_cast<size_t>(h) * head_bytes, head_bytes);
    k += qk.k.data.substr(static_cast<size_t>(h) * head_bytes, head_bytes);
  }
  qk.q.data = q;
  qk.k.data = k;
  qk.q.shape[0] = qk.k.shape[0] = static_cast<int64_t>(heads.size());
  qk.heads = heads;
  return sample;
}

TEST(RetainedStateTest, QKHeadBytesCountQAndItsShareOfK) {
  // bf16 [64, 32]: Q 4 KiB, K 4 KiB shared by 4 query heads, 64 doubles of direction.
  EXPECT_EQ(QKHeadRetainedBytes(64, 32, DType::kBFloat16, DType::kBFloat16, 4, true),
            4096 + 1024 + 512 + kRetainedOverheadBytes);
  EXPECT_EQ(QKHeadRetainedBytes(64, 32, DType::kFloat32, DType::kFloat32, 1, false),
            8192 + 8192 + kRetainedOverheadBytes);
  EXPECT_EQ(RouterRetainedBytes(16, 8, 2, 8),
            16 * 2 * 4 + 16 * 8 * 4 + 16 * 8 + 9 * 8 * 8 + 8 * 8 + kRetainedOverheadBytes);
}

TEST(RetainedStateTest, ScalarsAndCurvatureRetainNothingPerProbe) {
  EXPECT_FALSE(RetainedBy(testing::Scalars("r", 1, 2.0, 1.0), {}).has_value());
  Sample curvature;
  curvature.payload = CurvatureSample{};
  EXPECT_FALSE(RetainedBy(curvature, {}).has_value());
}

// The footprint is declared with the detector's registration (T::RetainedBy):
// the two detectors that keep probe state have one, the others none, and
// RetainedBy answers with the one of the sample's kind.
TEST(RetainedStateTest, TheDetectorsThatKeepProbeStateRegisterTheirFootprint) {
  std::vector<std::string> with;
  for (const DetectorInfo& info : DetectorRegistry::Instance().detectors()) {
    if (info.retained_by) with.emplace_back(info.name);
  }
  std::sort(with.begin(), with.end());
  EXPECT_EQ(with, (std::vector<std::string>{"qk", "router"}));
}

TEST(RetainedStateTest, QKPredictionMatchesWhatTheDetectorHolds) {
  std::mt19937 rng(3);
  const DetectorOptions options;
  auto detector = MakeDetector("qk", options);
  Ledger predicted;
  QKStream a{"run-a", 0, "p", 4, 16, 8, DType::kBFloat16};
  QKStream b{"run-a", 3, "p", 2, 8, 4};
  QKStream c{"run-b", 0, "p", 8, 16, 8};
  for (int step = 0; step < 3; ++step) {
    Feed(*detector, predicted, {a.Next(step, rng), b.Next(step, rng), c.Next(step, rng)}, options);
  }
  EXPECT_EQ(Reported(*detector), predicted);
  // A full sample covers every head: (QKSample.heads empty)
  // A rotating subset replaces only its heads.
  Feed(*detector, predicted, {Subset(c.Next(3, rng), {1, 5}), Subset(c.Next(4, rng), {2, 6})},
       options);
  EXPECT_EQ(Reported(*detector), predicted);
  // A smaller full sample drops the heads beyond it; a larger shape grows them.
  QKStream c_small{"run-b", 0, "p", 3, 16, 8};
  QKStream a_large{"run-a", 0, "p", 4, 32, 8, DType::kBFloat16};
  const int64_t before = Total(predicted);
  Feed(*detector, predicted, {c_small.Next(5, rng)}, options);
  EXPECT_LT(Total(predicted), before);
  Feed(*detector, predicted, {a_large.Next(6, rng)}, options);
  EXPECT_EQ(Reported(*detector), predicted);
  // The tensors themselves are counted: at least Q and K of every head held.
  EXPECT_GE(Total(predicted), 4 * 32 * 8 * 2 * 2 + 2 * 8 * 4 * 4 * 2 + 3 * 16 * 8 * 4 * 2);
}

TEST(RetainedStateTest, GroupedQueryHeadsShareTheirKCopy) {
  std::mt19937 rng(5);
  auto detector = MakeDetector("qk");
  Ledger predicted;
  QKStream s{"r", 1, "p", 4, 16, 8};
  Sample sample = s.Next(0, rng);
  auto& qk = std::get<QKSample>(sample.payload);
  // 4 query heads over 2 K heads: K [2, 16, 8].
  qk.k.data.resize(qk.k.data.size() / 2);
  qk.k.shape[0] = 2;
  qk.kv_head_of = {0, 0, 1, 1};
  Feed(*detector, predicted, {sample});
  EXPECT_EQ(Reported(*detector), predicted);
  EXPECT_EQ(Total(predicted),
            4 * (16 * 8 * 4 + 16 * 8 * 4 / 2 + 16 * 8 + kRetainedOverheadBytes));
}

TEST(RetainedStateTest, RouterPredictionMatchesWhatTheDetectorHolds) {
  std::mt19937 rng(9);
  DetectorOptions options;
  options.Mutable<RouterDetectorOptions>().dead_window = 4;
  auto detector = MakeDetector("router", options);
  Ledger predicted;
  RouterStream a{"r", 1, "p", 16, 8, 2};
  RouterStream b{"r", 2, "p", 32, 4, 1};
  for (int step = 0; step < 6; ++step) Feed(*detector, predicted, {a.Next(step, rng), b.Next(step, rng)}, options);
  EXPECT_EQ(Reported(*detector), predicted);
  RouterStream a_wider{"r", 1, "p", 16, 16, 2};
  Feed(*detector, predicted, {a_wider.Next(6, rng)}, options);
  EXPECT_EQ(Reported(*detector), predicted);
}

TEST(RetainedStateTest, RestoredStateReportsWhatWasSavedAndForgetRunReportsNothing) {
  std::mt19937 rng(11);
  for (const char* name : {"qk", "router"}) {
    auto detector = MakeDetector(name);
    Ledger predicted;
    QKStream q{"r", 0, "p", 4, 16, 8, DType::kBFloat16};
    RouterStream r{"r", 1, "p", 16, 8, 2};
    for (int step = 0; step < 3; ++step) {
      Feed(*detector, predicted, {std::string(name) == "qk" ? q.Next(step, rng) : r.Next(step, rng)});
    }
    codec::StateWriter writer;
    detector->SaveState(writer);
    const std::string bytes = writer.Take();
    auto restored = MakeDetector(name);
    codec::StateReader reader(bytes);
    ASSERT_TRUE(restored->RestoreState(reader)) << name;
    EXPECT_EQ(Reported(*restored), predicted) << name;
    EXPECT_GT(Total(predicted), 0) << name;
    restored->ForgetRun("r");
    EXPECT_TRUE(Reported(*restored).empty()) << name;
  }
}

}  // namespace
}  // namespace foreshock::detectors
