// Checkpointed detector state (Detector::SaveState / RestoreState).
//
// For every detector with cross-sample state: feed samples A, save, restore
// into a fresh instance, feed samples B to both; the output must be identical
// to the last bit. Corrupt or truncated state must be refused and leave the
// detector empty and usable.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "detectors/detector.h"
#include "codec/state_codec.h"
#include "tests/detectors/detector_test_support.h"
#include "tests/detectors/sample_streams.h"
#include "detectors/scalar_baselines_detector.h"

namespace foreshock::detectors {
namespace {

using testing::MakeDetector;
using testing::RecordingEmitter;
using testing::QKStream;
using testing::RouterStream;
using testing::Scalars;

std::string Save(const Detector& detector) {
  codec::StateWriter writer;
  detector.SaveState(writer);
  return writer.Take();
}

// Restores `bytes` and checks that every byte was read.
bool Restore(Detector& detector, std::string_view bytes, const SeriesFilter& keep = {},
             std::string* error = nullptr) {
  codec::StateReader reader(bytes);
  const bool ok = detector.RestoreState(reader, keep) && reader.ExpectEnd();
  if (error) *error = reader.error();
  return ok;
}

void ExpectSameOutput(const RecordingEmitter& expected, const RecordingEmitter& actual) {
  ASSERT_EQ(expected.observations.size(), actual.observations.size());
  for (size_t i = 0; i < expected.observations.size(); ++i) {
    const auto& e = expected.observations[i];
    const auto& a = actual.observations[i];
    EXPECT_EQ(e.signal, a.signal) << i;
    EXPECT_EQ(e.layer, a.layer) << i;
    EXPECT_EQ(e.head, a.head) << i;
    EXPECT_EQ(e.for_detection, a.for_detection) << i;
    EXPECT_EQ(std::bit_cast<uint64_t>(e.value), std::bit_cast<uint64_t>(a.value))
        << i << " " << e.signal << " layer " << e.layer << " head " << e.head << ": " << e.value
        << " vs " << a.value;
  }
  EXPECT_EQ(expected.non_finite, actual.non_finite);
}

RecordingEmitter Feed(Detector& detector, const std::vector<Sample>& samples) {
  RecordingEmitter emitter;
  for (const Sample& sample : samples) detector.Process(sample, emitter);
  return emitter;
}

// ---------------------------------------------------------------------------
// Scenarios: samples A (before the checkpoint) and B (after).

struct QKScenario {
  std::vector<Sample> a, b;
};

QKScenario MakeQKScenario() {
  std::mt19937 rng(7);
  std::vector<QKStream> streams = {
      {"r1", 0, "p0", 2, 12, 4},
      {"r1", 0, "p1", 3, 10, 4, DType::kBFloat16, true},
      {"r1", 3, "p0", 2, 16, 8},
      {"r2", 0, "p0", 1, 8, 4, DType::kBFloat16},
  };
  QKScenario scenario;
  for (int64_t step = 0; step < 6; ++step) {
    for (QKStream& s : streams) scenario.a.push_back(s.Next(step, rng));
  }
  // A zero increment (clears that head's top direction) and a non-finite
  // sample (the previous finite sample stays the reference).
  scenario.a.push_back(streams[0].Same(6));
  scenario.a.push_back(streams[2].Same(6, /*nan=*/true));
  // A shape change restarts r2's series.
  streams[3].tokens = 6;
  scenario.a.push_back(streams[3].Next(6, rng));
  for (int64_t step = 7; step < 12; ++step) {
    for (QKStream& s : streams) scenario.b.push_back(s.Next(step, rng));
  }
  QKStream fresh{"r3", 1, "p0", 2, 8, 4};
  scenario.b.push_back(fresh.Next(7, rng));
  scenario.b.push_back(fresh.Next(8, rng));
  return scenario;
}

struct Scenario {
  std::vector<Sample> a, b;
};

Scenario MakeRouterScenario() {
  std::mt19937 rng(11);
  std::vector<RouterStream> streams = {
      {"r1", 1, "p0", 32, 8, 2},
      {"r1", 1, "p1", 16, 8, 1},
      {"r1", 4, "p0", 24, 16, 2},
      {"r2", 1, "p0", 20, 4, 1},
  };
  Scenario scenario;
  for (int64_t step = 0; step < 11; ++step) {  // longer than the 8-sample dead window
    for (RouterStream& s : streams) scenario.a.push_back(s.Next(step, rng));
  }
  Sample bad = streams[0].Next(11, rng);
  std::get<RouterSample>(bad.payload).logits.data.replace(0, 4, "\xff\xff\xc0\x7f", 4);  // NaN
  scenario.a.push_back(bad);
  for (int64_t step = 12; step < 20; ++step) {
    for (RouterStream& s : streams) scenario.b.push_back(s.Next(step, rng));
  }
  return scenario;
}

Scenario MakeScalarScenario() {
  std::mt19937 rng(3);
  std::normal_distribution<double> noise(0.0, 0.02);
  Scenario scenario;
  for (int64_t step = 0; step < 300; ++step) {
    scenario.a.push_back(Scalars("r1", step, 3 + noise(rng), 1 + noise(rng)));
    if (step % 3 == 0) scenario.a.push_back(Scalars("r1", step, 9, 9));  // another rank: ignored
    if (step < 60) scenario.a.push_back(Scalars("r2", step, 2 + noise(rng), 0.5 + noise(rng)));
  }
  scenario.a.push_back(Scalars("r1", 300, NAN, 1));
  for (int64_t step = 301; step < 420; ++step) {
    const double spike = step == 350 ? 1.0 : 0.0;
    scenario.b.push_back(Scalars("r1", step, 3 + spike + noise(rng), 1 + noise(rng)));
    scenario.b.push_back(Scalars("r2", step, 2 + noise(rng), 0.5 + noise(rng)));
  }
  scenario.b.push_back(Scalars("r1", 350, 1, 1));  // stale: ignored by original and restored
  return scenario;
}

struct Case {
  std::string detector;
  std::function<Scenario()> make;
};

std::vector<Case> StatefulCases() {
  return {
      {"qk",
       [] {
         QKScenario qk = MakeQKScenario();
         return Scenario{qk.a, qk.b};
       }},
      {"router", MakeRouterScenario},
      {"scalar_baselines", MakeScalarScenario},
      {"loss_divergence", MakeScalarScenario},
  };
}

class DetectorStateTest : public ::testing::TestWithParam<Case> {};

TEST_P(DetectorStateTest, RestoredDetectorContinuesExactlyLikeTheOriginal) {
  const Case& c = GetParam();
  const Scenario scenario = c.make();
  auto original = MakeDetector(c.detector);
  Feed(*original, scenario.a);
  const std::string state = Save(*original);
  ASSERT_FALSE(state.empty());
  EXPECT_EQ(Save(*original), state) << "saving is deterministic";

  auto restored = MakeDetector(c.detector);
  std::string error;
  ASSERT_TRUE(Restore(*restored, state, {}, &error)) << error;
  EXPECT_EQ(Save(*restored), state);

  const RecordingEmitter expected = Feed(*original, scenario.b);
  const RecordingEmitter actual = Feed(*restored, scenario.b);
  ExpectSameOutput(expected, actual);
  EXPECT_EQ(Save(*original), Save(*restored));

  // Not vacuous: a detector that starts from nothing says something else.
  auto fresh = MakeDetector(c.detector);
  const RecordingEmitter cold = Feed(*fresh, scenario.b);
  bool same = cold.observations.size() == expected.observations.size();
  for (size_t i = 0; same && i < cold.observations.size(); ++i) {
    same = cold.observations[i].signal == expected.observations[i].signal &&
           cold.observations[i].value == expected.observations[i].value;
  }
  EXPECT_FALSE(same) << "the state made no difference to the output";
}

TEST_P(DetectorStateTest, RestoresAShardAtATimeAndMerges) {
  const Case& c = GetParam();
  const Scenario scenario = c.make();
  auto original = MakeDetector(c.detector);
  Feed(*original, scenario.a);
  const std::string state = Save(*original);

  // Only run r1 ...
  auto only_r1 = MakeDetector(c.detector);
  ASSERT_TRUE(Restore(*only_r1, state, [](std::string_view run, int) { return run == "r1"; }));
  auto forgot_r2 = MakeDetector(c.detector);
  ASSERT_TRUE(Restore(*forgot_r2, state));
  forgot_r2->ForgetRun("r2");
  EXPECT_EQ(Save(*only_r1), Save(*forgot_r2));
  EXPECT_NE(Save(*only_r1), state);

  // ... then the rest from the same blob: the union is the whole state.
  ASSERT_TRUE(Restore(*only_r1, state, [](std::string_view run, int) { return run != "r1"; }));
  EXPECT_EQ(Save(*only_r1), state);

  // The filter sees the layer as Sample::layer() reports it.
  std::map<std::string, std::vector<int>> seen;
  auto probe = MakeDetector(c.detector);
  ASSERT_TRUE(Restore(*probe, state, [&](std::string_view run, int layer) {
    seen[std::string(run)].push_back(layer);
    return false;
  }));
  EXPECT_EQ(Save(*probe), Save(*MakeDetector(c.detector))) << "nothing kept";
  std::map<std::string, std::vector<int>> expected;
  for (const Sample& s : scenario.a) {
    auto& layers = expected[s.run];
    if (std::find(layers.begin(), layers.end(), s.layer()) == layers.end()) {
      layers.push_back(s.layer());
    }
  }
  for (auto& [run, layers] : expected) {
    std::vector<int> got = seen[run];
    std::sort(got.begin(), got.end());
    got.erase(std::unique(got.begin(), got.end()), got.end());
    std::sort(layers.begin(), layers.end());
    EXPECT_EQ(got, layers) << run;
  }
}

TEST_P(DetectorStateTest, TruncatedStateIsRefusedAndLeavesTheDetectorEmpty) {
  const Case& c = GetParam();
  const Scenario scenario = c.make();
  auto original = MakeDetector(c.detector);
  Feed(*original, scenario.a);
  const std::string state = Save(*original);
  const std::string empty_state = Save(*MakeDetector(c.detector));

  auto fresh = MakeDetector(c.detector);
  const RecordingEmitter cold = Feed(*fresh, scenario.b);

  // Every short prefix, then a spread of longer ones.
  std::vector<size_t> lengths;
  for (size_t n = 0; n < std::min<size_t>(state.size(), 300); ++n) lengths.push_back(n);
  std::mt19937 rng(5);
  for (int i = 0; i < 200 && state.size() > 300; ++i) {
    lengths.push_back(std::uniform_int_distribution<size_t>(300, state.size() - 1)(rng));
  }
  lengths.push_back(state.size() - 1);
  for (size_t length : lengths) {
    auto detector = MakeDetector(c.detector);
    Feed(*detector, scenario.a);  // state that a failed restore must drop
    std::string error;
    EXPECT_FALSE(Restore(*detector, std::string_view(state).substr(0, length), {}, &error))
        << length;
    EXPECT_FALSE(error.empty()) << length;
    ASSERT_EQ(Save(*detector), empty_state) << "length " << length;
  }
  // Empty and usable: it behaves like a new detector.
  auto detector = MakeDetector(c.detector);
  Feed(*detector, scenario.a);
  EXPECT_FALSE(Restore(*detector, std::string_view(state).substr(0, state.size() / 2)));
  ExpectSameOutput(cold, Feed(*detector, scenario.b));
}

TEST_P(DetectorStateTest, CorruptBytesNeverCrash) {
  const Case& c = GetParam();
  const Scenario scenario = c.make();
  auto original = MakeDetector(c.detector);
  Feed(*original, scenario.a);
  const std::string state = Save(*original);
  const std::string empty_state = Save(*MakeDetector(c.detector));

  std::mt19937 rng(9);
  std::uniform_int_distribution<size_t> position(0, state.size() - 1);
  // The structural part (counts, lengths, shapes) is near the start of each
  // series; corrupting anywhere must be caught or harmless.
  int refused = 0;
  for (int i = 0; i < 300; ++i) {
    std::string corrupt = state;
    const int flips = 1 + i % 3;
    for (int f = 0; f < flips; ++f) {
      const size_t at = i % 2 == 0 ? position(rng) % std::min<size_t>(state.size(), 512)
                                   : position(rng);
      corrupt[at] = static_cast<char>(corrupt[at] ^ (1 << (rng() % 8)));
    }
    auto detector = MakeDetector(c.detector);
    codec::StateReader reader(corrupt);
    if (!detector->RestoreState(reader)) {
      ++refused;
      EXPECT_EQ(Save(*detector), empty_state);
    }
    Feed(*detector, scenario.b);  // must not crash whatever was accepted
  }
  EXPECT_GT(refused, 0);
}

TEST_P(DetectorStateTest, RefusesAnotherDetectorsStateAndUnknownVersions) {
  const Case& c = GetParam();
  const Scenario scenario = c.make();
  auto original = MakeDetector(c.detector);
  Feed(*original, scenario.a);
  std::string state = Save(*original);
  state[0] = 99;  // the version comes first
  auto detector = MakeDetector(c.detector);
  std::string error;
  EXPECT_FALSE(Restore(*detector, state, {}, &error));
  EXPECT_NE(error.find("version 99"), std::string::npos) << error;
}

INSTANTIATE_TEST_SUITE_P(Stateful, DetectorStateTest, ::testing::ValuesIn(StatefulCases()),
                         [](const auto& info) { return info.param.detector; });

TEST(DetectorStateTest, StatelessDetectorsWriteAndReadNothing) {
  for (const char* name : {"scalars", "curvature"}) {
    auto detector = MakeDetector(name);
    EXPECT_EQ(Save(*detector), "") << name;
    EXPECT_TRUE(Restore(*detector, "")) << name;
  }
}

TEST(DetectorStateTest, EveryRegisteredDetectorRoundTripsItsEmptyState) {
  for (const DetectorInfo& info : DetectorRegistry::Instance().detectors()) {
    auto detector = info.create({});
    const std::string state = Save(*detector);
    auto restored = info.create({});
    EXPECT_TRUE(Restore(*restored, state)) << info.name;
    EXPECT_EQ(Save(*restored), state) << info.name;
  }
}

TEST(DetectorStateTest, QKStateMismatchedShapesAndDirectionsAreRefused) {
  // A hand-built blob: one series whose top direction does not match the
  // probe's token count (it would be read out of bounds by the overlap).
  auto build = [](int64_t tokens, size_t direction_length, int64_t k_tokens) {
    codec::StateWriter w;
    w.PutU32(1);
    w.PutU64(1);
    w.PutString("r");
    w.PutI32(0);
    w.PutString("p");
    for (int64_t t : {tokens, k_tokens}) {
      w.PutU8(0);  // float32
      w.PutVector(std::vector<int64_t>{1, t, 2});
      w.PutBytes(std::string(static_cast<size_t>(t) * 2 * 4, '\0'));
    }
    w.PutU64(1);
    w.PutVector(std::vector<double>(direction_length, 0.5));
    return w.Take();
  };
  auto detector = MakeDetector("qk");
  EXPECT_TRUE(Restore(*detector, build(4, 4, 4)));
  EXPECT_TRUE(Restore(*detector, build(4, 0, 4)));
  EXPECT_FALSE(Restore(*detector, build(4, 5, 4)));
  EXPECT_FALSE(Restore(*detector, build(4, 4, 3)));
}

TEST(DetectorStateTest, ScalarBaselinesWindowShorterThanSavedKeepsTheNewest) {
  const Scenario scenario = MakeScalarScenario();
  auto original = MakeDetector("scalar_baselines");
  Feed(*original, scenario.a);
  DetectorOptions shorter;
  shorter.Mutable<ScalarBaselinesOptions>().spike_window = 16;
  auto restored = MakeDetector("scalar_baselines", shorter);
  ASSERT_TRUE(Restore(*restored, Save(*original)));
  // Compare with a detector that ran with the short window all along (its
  // running sums round differently: close, not bit-identical).
  auto reference = MakeDetector("scalar_baselines", shorter);
  Feed(*reference, scenario.a);
  const RecordingEmitter expected = Feed(*reference, scenario.b);
  const RecordingEmitter actual = Feed(*restored, scenario.b);
  ASSERT_EQ(expected.observations.size(), actual.observations.size());
  for (size_t i = 0; i < expected.observations.size(); ++i) {
    EXPECT_EQ(expected.observations[i].signal, actual.observations[i].signal);
    EXPECT_NEAR(expected.observations[i].value, actual.observations[i].value, 1e-6);
  }
}

}  // namespace
}  // namespace foreshock::detectors
