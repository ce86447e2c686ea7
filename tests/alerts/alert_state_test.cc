// Checkpointed alert state: ChangeDetector and AlertEngine SaveState /
// RestoreState. A restored engine must continue exactly like the original:
// same transitions, same snapshots, same bytes when saved again.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "alerts/alert_engine.h"
#include "alerts/change_detector.h"
#include "alerts/config.h"
#include "codec/state_codec.h"

namespace foreshock::alerts {
namespace {

using detectors::kAllHeads;
using detectors::kNoLayer;

// Doubles by their bits: NaN == NaN, -0 != 0.
std::string Bits(double v) { return std::to_string(std::bit_cast<uint64_t>(v)); }

std::string Describe(const ChangeAssessment& a) {
  std::ostringstream out;
  out << static_cast<int>(a.disposition) << " " << a.step << " " << Bits(a.value) << " "
      << Bits(a.baseline) << " " << Bits(a.scale) << " " << Bits(a.z) << " " << Bits(a.cusum)
      << " " << Bits(a.relative_change) << " " << a.change_flag << a.guard_flag << " "
      << static_cast<int>(a.state) << " " << a.onset_step << " " << a.anomalous_in_window;
  return out.str();
}

std::string Describe(const Alert& a) {
  std::ostringstream out;
  for (const auto& [k, v] : a.Labels()) out << k << "=" << v << ";";
  for (const auto& [k, v] : a.Annotations()) out << k << "=" << v << ";";
  out << static_cast<int>(a.state) << " ep" << a.episode << " " << a.pending_step << " "
      << a.firing_step << " " << a.resolved_step << " " << Bits(a.value) << " "
      << Bits(a.baseline) << " " << Bits(a.z);
  return out.str();
}

std::string Describe(const AlertTransition& t) {
  return std::string(AlertStateName(t.from)) + "->" + std::string(AlertStateName(t.to)) + "@" +
         std::to_string(t.step) + " " + Describe(t.alert);
}

// ---------------------------------------------------------------------------
// ChangeDetector.

ChangeDetectorOptions DetectorOptions() {
  ChangeDetectorOptions o;
  o.direction = Direction::kDrop;
  o.warmup = 20;
  o.window = 20;
  o.gap = 6;
  o.persist_m = 3;
  o.persist_n = 5;
  o.clear_after = 6;
  o.bound = 0.1;
  return o;
}

// (step, value) pairs: noise, a collapse, recovery, with repeated steps
// (other ranks, some worse) and stale steps.
std::vector<std::pair<int64_t, double>> DetectorScript() {
  std::mt19937_64 rng(3);
  std::normal_distribution<double> noise(0.0, 0.01);
  std::vector<std::pair<int64_t, double>> script;
  for (int64_t i = 0; i < 200; ++i) {
    const bool collapsed = (i >= 80 && i < 100) || (i >= 150 && i < 153);
    const double level = collapsed ? 0.4 : 0.8;
    script.emplace_back(i, level + noise(rng));
    script.emplace_back(i, level + noise(rng));  // another rank: worse half the time
    if (i % 7 == 0) script.emplace_back(i - 3, 0.0);  // stale
  }
  return script;
}

std::string Save(const ChangeDetector& detector) {
  codec::StateWriter w;
  detector.SaveState(w);
  return w.Take();
}

TEST(ChangeDetectorStateTest, RestoredDetectorContinuesExactly) {
  const auto script = DetectorScript();
  for (size_t cut : {size_t{0}, size_t{10}, size_t{61}, size_t{250}, size_t{255}, size_t{280},
                     size_t{301}, script.size()}) {
    ChangeDetector original(DetectorOptions());
    for (size_t i = 0; i < cut; ++i) original.Update(script[i].first, script[i].second);
    const std::string state = Save(original);
    ChangeDetector restored(DetectorOptions());
    codec::StateReader reader(state);
    ASSERT_TRUE(restored.RestoreState(reader)) << reader.error();
    EXPECT_TRUE(reader.ExpectEnd());
    EXPECT_EQ(Save(restored), state);
    EXPECT_EQ(restored.state(), original.state());
    EXPECT_EQ(Describe(restored.last()), Describe(original.last()));
    for (size_t i = cut; i < script.size(); ++i) {
      const auto& [step, value] = script[i];
      ASSERT_EQ(Describe(original.Update(step, value)), Describe(restored.Update(step, value)))
          << "cut " << cut << " at " << i;
    }
  }
}

TEST(ChangeDetectorStateTest, CorruptStateLeavesTheDetectorNew) {
  const auto script = DetectorScript();
  ChangeDetector original(DetectorOptions());
  for (size_t i = 0; i < 260; ++i) original.Update(script[i].first, script[i].second);
  const std::string state = Save(original);
  const std::string fresh = Save(ChangeDetector(DetectorOptions()));
  for (size_t length = 0; length < state.size(); ++length) {
    ChangeDetector detector(DetectorOptions());
    codec::StateReader ok_reader(state);
    ASSERT_TRUE(detector.RestoreState(ok_reader));
    codec::StateReader reader(std::string_view(state).substr(0, length));
    EXPECT_FALSE(detector.RestoreState(reader)) << length;
    ASSERT_EQ(Save(detector), fresh) << length;
  }
  // A history longer than this detector's window + gap does not fit.
  ChangeDetectorOptions smaller = DetectorOptions();
  smaller.window = 8;
  ChangeDetector detector(smaller);
  codec::StateReader reader(state);
  EXPECT_FALSE(detector.RestoreState(reader));
  EXPECT_NE(reader.error().find("window + gap"), std::string::npos) << reader.error();
}

// ---------------------------------------------------------------------------
// AlertEngine.

struct Event {
  bool nonfinite = false;
  std::string run;
  int64_t step = 0;
  std::string signal;
  int layer = kNoLayer;
  int head = kAllHeads;
  double value = 0;
  bool for_detection = true;
};

struct Fault {
  std::string run;
  std::string signal;
  int layer;
  double normal;
  double faulty;
  int64_t from;
  int64_t to;  // exclusive
};

// Two runs, two ranks, every 10 steps from 0 to 2400. Run r1: a QK collapse
// in layers 2 then 1, logit growth, an LR rise, a loss spike, non-finite
// values, recovery. Run r2: a router collapse with curvature above the edge.
// Plus per-head values, values out of detection, stale and NaN points.
std::vector<Event> EngineScript() {
  const std::vector<Fault> series = {
      {"r1", "qk_increment_entropy", 0, 0.8, 0.8, 0, 0},
      {"r1", "qk_increment_entropy", 1, 0.8, 0.45, 1260, 1700},
      {"r1", "qk_increment_entropy", 2, 0.8, 0.4, 1200, 1700},
      {"r1", "qk_increment_top1_share", 2, 0.1, 0.5, 1220, 1700},
      {"r1", "attention_max_logit", 2, 20, 60, 1300, 1700},
      {"r1", "attention_entropy", 0, 2.0, 2.0, 0, 0},
      {"r1", "attention_entropy", 3, 2.0, 1.0, 1320, 1420},
      {"r1", "loss", kNoLayer, 3.0, 6.0, 1500, 1650},
      {"r1", "curvature_eos_ratio", kNoLayer, 0.9, 0.9, 0, 0},
      {"r2", "router_entropy", 1, 0.9, 0.4, 1800, 2100},
      {"r2", "router_load_cv", 1, 0.2, 0.8, 1800, 2100},
      {"r2", "router_entropy", 3, 0.9, 0.9, 0, 0},
      {"r2", "curvature_eos_ratio", kNoLayer, 0.9, 4.0, 1850, 2100},
      {"r2", "loss", kNoLayer, 2.5, 2.5, 0, 0},
  };
  std::mt19937_64 rng(42);
  std::normal_distribution<double> noise(0.0, 0.005);
  std::vector<Event> events;
  for (int64_t step = 0; step <= 2400; step += 10) {
    for (int rank = 0; rank < 2; ++rank) {
      for (const Fault& f : series) {
        const double level = step >= f.from && step < f.to ? f.faulty : f.normal;
        events.push_back({false, f.run, step, f.signal, f.layer, kAllHeads, level * (1 + noise(rng))});
      }
      for (const char* run : {"r1", "r2"}) {
        const double lr = std::string(run) == "r1" && step >= 1400 ? 4e-3 : 1e-3;
        events.push_back({false, run, step, "lr", kNoLayer, kAllHeads, lr});
      }
    }
    events.push_back({false, "r1", step, "qk_increment_entropy", 2, 1, 0.01});  // one head
    events.push_back({false, "r1", step, "curvature_eos_ratio", kNoLayer, kAllHeads, 9.0, false});
    if (step % 130 == 0 && step > 0) {
      events.push_back({false, "r1", step - 40, "qk_increment_entropy", 0, kAllHeads, 0.8});
    }
    if (step == 700) {
      events.push_back({false, "r2", step, "loss", kNoLayer, kAllHeads,
                        std::numeric_limits<double>::quiet_NaN()});
    }
    if (step == 1600 || step == 1610) {
      events.push_back({true, "r1", step, "", 4, kAllHeads, 3});
    }
  }
  return events;
}

class Driver {
 public:
  explicit Driver(AlertConfig config = DefaultAlertConfig()) : engine(std::move(config)) {}
  void Feed(const std::vector<Event>& events, size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      const Event& e = events[i];
      std::vector<AlertTransition> out =
          e.nonfinite ? engine.ObserveNonFinite(NonFiniteEvent{
                            e.run, e.step, detectors::SampleKind::kQK,
                            static_cast<int64_t>(e.value), e.layer})
                      : engine.Observe(SignalPoint{e.run, e.step, e.signal, e.layer, e.head,
                                                   e.value, e.for_detection});
      for (const AlertTransition& t : out) transitions.push_back(Describe(t));
    }
  }
  // Everything the engine shows to the outside.
  std::string Snapshot() const {
    std::ostringstream out;
    for (const Alert& a : engine.ActiveAlerts()) out << "active " << Describe(a) << "\n";
    for (const char* run : {"r1", "r2"}) {
      for (const Alert& a : engine.AllAlerts(run)) out << "all " << Describe(a) << "\n";
      if (const auto first = engine.FirstFiringLayer(run)) {
        out << "first " << first->alertname << " " << first->layer << " " << first->signal << " "
            << first->firing_step << " " << first->first_step << "\n";
      }
      out << "cause " << ProbableCauseName(engine.RunProbableCause(run)) << "\n";
    }
    const AlertEngineCounters& c = engine.counters();
    out << "counters " << c.points_scored << " " << c.points_stale << " " << c.points_duplicate
        << " " << c.points_nonfinite << "\n";
    return out.str();
  }

  AlertEngine engine;
  std::vector<std::string> transitions;
};

// Event indices after which the engine has both pending and firing alerts.
std::vector<size_t> MidEpisodeCuts(const std::vector<Event>& events) {
  Driver probe;
  std::vector<size_t> cuts;
  for (size_t i = 0; i < events.size(); ++i) {
    probe.Feed(events, i, i + 1);
    bool pending = false, firing = false;
    for (const Alert& a : probe.engine.ActiveAlerts()) {
      pending |= a.state == AlertState::kPending;
      firing |= a.state == AlertState::kFiring;
    }
    if (pending && firing) cuts.push_back(i + 1);
  }
  return cuts;
}

// Feeds events[0, cut), saves, restores into a new engine, feeds the rest to
// both and expects identical output.
void ExpectContinuesIdentically(const std::vector<Event>& events, size_t cut) {
  Driver original;
  original.Feed(events, 0, cut);
  const std::string state = original.engine.SaveState();
  EXPECT_EQ(original.engine.SaveState(), state) << "saving is deterministic";

  Driver restored;
  std::string error;
  ASSERT_TRUE(restored.engine.RestoreState(state, &error)) << error;
  EXPECT_EQ(restored.engine.SaveState(), state);
  EXPECT_EQ(restored.Snapshot(), original.Snapshot()) << "cut " << cut;

  original.transitions.clear();
  original.Feed(events, cut, events.size());
  restored.Feed(events, cut, events.size());
  EXPECT_EQ(restored.transitions, original.transitions) << "cut " << cut;
  EXPECT_EQ(restored.Snapshot(), original.Snapshot()) << "cut " << cut;
  EXPECT_EQ(restored.engine.SaveState(), original.engine.SaveState()) << "cut " << cut;
}

TEST(AlertEngineStateTest, SavedMidEpisodeRestoredEngineContinuesIdentically) {
  const std::vector<Event> events = EngineScript();
  const std::vector<size_t> cuts = MidEpisodeCuts(events);
  ASSERT_FALSE(cuts.empty()) << "the script must have pending and firing alerts at once";
  const size_t cut = cuts[cuts.size() / 2];

  Driver original;
  original.Feed(events, 0, cut);
  // The script covers what matters: firing and pending alerts, a cause in
  // progress, learning-rate history.
  std::map<AlertState, int> active;
  for (const Alert& a : original.engine.ActiveAlerts()) ++active[a.state];
  EXPECT_GT(active[AlertState::kPending], 0);
  EXPECT_GT(active[AlertState::kFiring], 0);
  ExpectContinuesIdentically(events, cut);

  // And the continuation is not trivial: alerts still move after the cut.
  Driver full;
  full.Feed(events, 0, cut);
  full.transitions.clear();
  full.Feed(events, cut, events.size());
  EXPECT_GE(full.transitions.size(), 3u);
  // A cold engine fed only the continuation says something else.
  Driver cold;
  cold.Feed(events, cut, events.size());
  EXPECT_NE(cold.transitions, full.transitions);
}

TEST(AlertEngineStateTest, ContinuesIdenticallyFromAnyCut) {
  const std::vector<Event> events = EngineScript();
  // Through warm-up, every episode's onset, firing, settling, non-finite
  // values and resolution.
  for (size_t cut = 0; cut <= events.size(); cut += events.size() / 23) {
    ExpectContinuesIdentically(events, cut);
    if (::testing::Test::HasFatalFailure()) return;
  }
  ExpectContinuesIdentically(events, events.size());
  // Mid-episode cuts; most fall between the two ranks' reports of a step,
  // where a worse second value is re-scored from the state before the step.
  const std::vector<size_t> mid = MidEpisodeCuts(events);
  for (size_t i = 0; i < mid.size(); i += std::max<size_t>(1, mid.size() / 8)) {
    ExpectContinuesIdentically(events, mid[i]);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(AlertEngineStateTest, CorruptStateIsRefusedAndLeavesTheEngineEmpty) {
  const std::vector<Event> events = EngineScript();
  const size_t cut = MidEpisodeCuts(events).front();
  Driver original;
  original.Feed(events, 0, cut);
  const std::string state = original.engine.SaveState();
  const std::string empty = AlertEngine().SaveState();

  Driver cold;
  cold.Feed(events, cut, events.size());

  std::vector<size_t> lengths;
  for (size_t n = 0; n < 400; ++n) lengths.push_back(n);
  std::mt19937 rng(2);
  for (int i = 0; i < 300; ++i) {
    lengths.push_back(std::uniform_int_distribution<size_t>(400, state.size() - 1)(rng));
  }
  lengths.push_back(state.size() - 1);
  Driver restored;
  for (size_t length : lengths) {
    ASSERT_TRUE(restored.engine.RestoreState(state));  // state a failure must drop
    std::string error;
    EXPECT_FALSE(restored.engine.RestoreState(std::string_view(state).substr(0, length), &error))
        << length;
    EXPECT_FALSE(error.empty());
    ASSERT_EQ(restored.engine.SaveState(), empty) << length;
  }
  EXPECT_FALSE(restored.engine.RestoreState(state + "x"));
  EXPECT_TRUE(restored.engine.ActiveAlerts().empty());
  EXPECT_TRUE(restored.engine.AllAlerts("r1").empty());
  EXPECT_EQ(restored.engine.counters().points_scored, 0u);
  // Empty and usable.
  restored.Feed(events, cut, events.size());
  EXPECT_EQ(restored.transitions, cold.transitions);
  EXPECT_EQ(restored.Snapshot(), cold.Snapshot());
}

TEST(AlertEngineStateTest, RandomCorruptionNeverCrashes) {
  const std::vector<Event> events = EngineScript();
  const size_t cut = MidEpisodeCuts(events).front();
  Driver original;
  original.Feed(events, 0, cut);
  const std::string state = original.engine.SaveState();
  const std::string empty = AlertEngine().SaveState();
  std::mt19937 rng(8);
  int refused = 0;
  // Mostly in the structural part near the start (header, run, series
  // shapes), some anywhere.
  std::uniform_int_distribution<size_t> anywhere(0, state.size() - 1);
  std::uniform_int_distribution<size_t> early(0, std::min<size_t>(state.size() - 1, 2000));
  for (int i = 0; i < 400; ++i) {
    std::string corrupt = state;
    const size_t at = i % 3 == 0 ? anywhere(rng) : early(rng);
    corrupt[at] = static_cast<char>(corrupt[at] ^ (1 << (rng() % 8)));
    Driver restored;
    if (!restored.engine.RestoreState(corrupt)) {
      ++refused;
      EXPECT_EQ(restored.engine.SaveState(), empty);
    }
    restored.Feed(events, cut, std::min(events.size(), cut + 3000));  // must not crash
  }
  EXPECT_GT(refused, 0);
}

TEST(AlertEngineStateTest, AChangedConfigurationIsRefused) {
  const std::vector<Event> events = EngineScript();
  Driver original;
  original.Feed(events, 0, events.size() / 2);
  const std::string state = original.engine.SaveState();

  AlertConfig changed = DefaultAlertConfig();
  changed.signals.at("qk_increment_entropy").detector.persist_m = 2;
  AlertEngine engine(changed);
  std::string error;
  EXPECT_FALSE(engine.RestoreState(state, &error));
  EXPECT_NE(error.find("configuration changed"), std::string::npos) << error;
  EXPECT_TRUE(engine.ActiveAlerts().empty());

  // A series' start in steps is part of the configuration too.
  AlertConfig later_start = DefaultAlertConfig();
  later_start.signals.at("router_entropy").detector.warmup_steps = 500;
  AlertEngine engine3(later_start);
  EXPECT_FALSE(engine3.RestoreState(state, &error));
  EXPECT_NE(error.find("configuration changed"), std::string::npos) << error;

  AlertConfig same = DefaultAlertConfig();
  AlertEngine engine2(same);
  EXPECT_TRUE(engine2.RestoreState(state, &error)) << error;
}

// The built-in defaults before the evaluation corpus recalibrated them (the
// configuration the version-2 checkpoint below was saved with).
AlertConfig DefaultsBeforeIssue13() {
  AlertConfig config = DefaultAlertConfig();
  config.signals.erase("lr_over_held_max");  // no learning-rate alert then
  config.signals.erase("attention_output_bias");  // nor a rounding-bias alert
  config.signals.erase("loss_over_running_min");  // nor a loss-divergence alert (issue 26)
  config.signals.erase("curvature_lambda_max");  // nor a rule on lambda itself (issue 33)
  // Any dead expert was a collapse then (issue 26: experts that died).
  config.signals.erase("router_experts_died");
  config.signals.at("router_dead_experts").enabled = true;
  for (auto& [name, signal] : config.signals) {
    signal.per_head = false;  // every signal was judged by its layer aggregate (issue 25)
    ChangeDetectorOptions& o = signal.detector;
    o.warmup = 40;
    o.min_baseline = 0;
    o.small_sample_inflation = 0;
    o.gate_inflation = 0;
    o.log_scale = false;
    o.warmup_steps = 0;  // series started at step 0 (warmup_steps: issue 25)
  }
  config.signals.at("attention_entropy").detector.min_relative_change = 0.20;
  config.signals.at("attention_entropy").enabled = true;
  config.signals.at("attention_max_logit").detector.change_detection = true;
  ChangeDetectorOptions& curvature = config.signals.at("curvature_eos_ratio").detector;
  curvature.warmup = 10;
  curvature.min_absolute_change = 0.0;  // added by issue 25
  curvature.z_threshold = 5.0;          // log scale, z 3 and window 24: issue 25
  curvature.window = 12;
  curvature.bound = 1.0;
  curvature.min_relative_change = 0.5;
  curvature.trend = true;
  ChangeDetectorOptions& loss = config.signals.at("loss").detector;
  loss.warmup = 100;
  loss.min_relative_change = 0.25;
  return config;
}

// A checkpoint of the previous format (version 2, before the run lifecycle),
// written by the code of that version (testdata/alert_engine_state_v2_gen.cc.txt):
// an upgraded daemon keeps its alerts and baselines.
TEST(AlertEngineStateTest, ReadsTheVersionBeforeTheRunLifecycle) {
  std::ifstream file(std::string(FORESHOCK_SOURCE_DIR) +
                     "/tests/alerts/testdata/alert_engine_state_v2.hex");
  std::string hex;
  ASSERT_TRUE(std::getline(file, hex));
  ASSERT_EQ(hex.size() % 2, 0u);
  std::string state;
  for (size_t i = 0; i < hex.size(); i += 2) {
    state.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  ASSERT_EQ(state.substr(0, 8), std::string("FSAE\x02\0\0\0", 8));
  // The configuration it was saved with: the defaults of that version, whose
  // curvature rule had an absolute bound (a changed configuration is refused).
  AlertConfig config = DefaultsBeforeIssue13();
  AlertEngine engine(config);
  std::string error;
  ASSERT_TRUE(engine.RestoreState(state, &error)) << error;
  std::vector<Alert> alerts = engine.AllAlerts("r");
  ASSERT_EQ(alerts.size(), 2u);
  EXPECT_EQ(alerts[0].alertname, kNonFinite);
  EXPECT_EQ(alerts[0].state, AlertState::kFiring);
  EXPECT_EQ(alerts[1].alertname, kQKIncrementCollapse);
  EXPECT_EQ(alerts[1].state, AlertState::kFiring);
  EXPECT_EQ(alerts[1].first_step, 600);
  EXPECT_EQ(alerts[1].resolved_reason, "");
  EXPECT_EQ(engine.GetLifecycleMark("r"), LifecycleMark{});
  // It goes on as before: the collapse clears after its hysteresis, and a
  // rewind keeps the history (its steps are unknown in version 2) while it
  // closes the episodes.
  std::vector<AlertTransition> out;
  for (int i = 65; i < 80; ++i) {
    auto more = engine.Observe(SignalPoint{"r", 10 * i, "qk_increment_entropy", 0, kAllHeads, 0.8, true});
    out.insert(out.end(), more.begin(), more.end());
  }
  ASSERT_FALSE(out.empty());
  EXPECT_EQ(out.back().to, AlertState::kResolved);
  EXPECT_EQ(out.back().alert.alertname, kQKIncrementCollapse);
  const std::vector<AlertTransition> closed = engine.RewindRun("r", 700);
  ASSERT_EQ(closed.size(), 1u);
  EXPECT_EQ(closed[0].alert.alertname, kNonFinite);
  EXPECT_EQ(closed[0].alert.resolved_reason, "run_resumed");
  // Saved again, it is the current version.
  AlertEngine again(config);
  ASSERT_TRUE(again.RestoreState(engine.SaveState(), &error)) << error;
  EXPECT_EQ(again.SaveState(), engine.SaveState());
}

TEST(AlertEngineStateTest, RefusesOtherBlobsAndVersions) {
  std::string error;
  AlertEngine engine;
  EXPECT_FALSE(engine.RestoreState("", &error));
  EXPECT_FALSE(engine.RestoreState("FSDP\x01\0\0\0", &error));
  EXPECT_NE(error.find("not a FSAE blob"), std::string::npos) << error;
  std::string state = AlertEngine().SaveState();
  state[4] = 5;  // the version after the magic: one this build does not know
  EXPECT_FALSE(engine.RestoreState(state, &error));
  EXPECT_NE(error.find("version 5"), std::string::npos) << error;
  state[4] = 1;  // the first version, without the settle watermark: refused too
  EXPECT_FALSE(engine.RestoreState(state, &error));
  EXPECT_NE(error.find("version 1"), std::string::npos) << error;
  // Version 2 (before the run lifecycle) is still read: without runs its
  // layout is the same.
  state[4] = 2;
  EXPECT_TRUE(engine.RestoreState(state, &error)) << error;
  state[4] = 3;  // and version 3 (before earlier attempts' alerts were kept)
  EXPECT_TRUE(engine.RestoreState(state, &error)) << error;
  EXPECT_TRUE(engine.RestoreState(AlertEngine().SaveState(), &error)) << error;
}

// Issue 26: a crashed attempt's alerts were overwritten in AllAlerts (and so
// `foreshockctl alerts --all`) by the resumed attempt's alerts of the same
// name and layer. Every attempt's alerts are kept, each with its attempt,
// also across a checkpoint.
TEST(AlertEngineStateTest, EveryAttemptsAlertsAreKept) {
  AlertEngine engine;
  auto loss_spike = [&](int64_t from) {
    for (int64_t s = from; s < from + 60; ++s) {
      engine.Observe(SignalPoint{"r", s, "loss", kNoLayer, kAllHeads, 2.0});
    }
    for (int64_t s = from + 60; s < from + 66; ++s) {
      engine.Observe(SignalPoint{"r", s, "loss", kNoLayer, kAllHeads, 5.0});
    }
  };
  loss_spike(0);  // attempt 1 fires ForeshockLossSpike, then crashes
  ASSERT_EQ(engine.AllAlerts("r").size(), 1u);
  engine.RewindRun("r", 50);  // attempt 2 resumes from step 50
  engine.SetLifecycleMark("r", LifecycleMark{2, 50, false});
  loss_spike(200);  // and fires the same alert again
  std::vector<Alert> all = engine.AllAlerts("r");
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].alertname, kLossSpike);
  EXPECT_EQ(all[0].attempt, 1);
  EXPECT_EQ(all[0].state, AlertState::kResolved);
  EXPECT_EQ(all[0].resolved_reason, kRunResumed);
  EXPECT_EQ(all[0].first_step, 60);
  EXPECT_EQ(all[1].alertname, kLossSpike);
  EXPECT_EQ(all[1].attempt, 2);
  EXPECT_EQ(all[1].state, AlertState::kFiring);
  EXPECT_EQ(all[1].first_step, 260);

  AlertEngine restored;
  std::string error;
  ASSERT_TRUE(restored.RestoreState(engine.SaveState(), &error)) << error;
  const std::vector<Alert> again = restored.AllAlerts("r");
  ASSERT_EQ(again.size(), 2u);
  EXPECT_EQ(again[0].attempt, 1);
  EXPECT_EQ(again[0].first_step, 60);
  EXPECT_EQ(again[1].attempt, 2);
  EXPECT_EQ(restored.SaveState(), engine.SaveState());
}

}  // namespace
}  // namespace foreshock::alerts
