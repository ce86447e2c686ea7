// The alert engine: lifecycle, labels and annotations, dedup across heads and
// ranks, guards, non-finite values, the first layer to fire, and the
// probable cause as the engine derives it from a run's alerts.
#include "alerts/alert_engine.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace foreshock::alerts {
namespace {

using detectors::kAllHeads;
using detectors::kNoLayer;

std::string Annotation(const Alert& alert, const std::string& name) {
  for (const auto& [key, value] : alert.Annotations()) {
    if (key == name) return value;
  }
  ADD_FAILURE() << "no annotation " << name;
  return "";
}

std::string Label(const Alert& alert, const std::string& name) {
  for (const auto& [key, value] : alert.Labels()) {
    if (key == name) return value;
  }
  ADD_FAILURE() << "no label " << name;
  return "";
}

// The defaults with the attention signals alerting on changes (by default
// the max logit alerts on its bound only and the entropy not at all): the
// engine's mechanics are the same for every signal, and the cause rules
// take attention-logit evidence however it came.
AlertConfig WithAttentionAlerts() {
  AlertConfig config = DefaultAlertConfig();
  config.signals.at("attention_max_logit").detector.change_detection = true;
  config.signals.at("attention_entropy").enabled = true;
  return config;
}

// The series rules alone, without the curvature's, the expert deaths' and
// the router imbalance's holds for another kind of alert (each tested on its
// own: CurvatureAloneIsHeldUntilAnotherKindIsAnomalous,
// ExpertDeathsAloneAreHeldUntilAnotherKindFires,
// RouterImbalanceAloneIsHeldUntilAnotherKindFires).
AlertConfig WithoutHolds() {
  AlertConfig config = WithAttentionAlerts();
  config.probable_cause.curvature_needs_corroboration = false;
  config.probable_cause.expert_deaths_need_corroboration = false;
  config.probable_cause.imbalance_needs_corroboration = false;
  return config;
}

// Drives an engine and keeps every transition it returned.
class EngineDriver {
 public:
  explicit EngineDriver(AlertConfig config = WithAttentionAlerts()) : engine(std::move(config)) {}

  void Point(std::string_view run, int64_t step, std::string_view signal, int layer, double value,
             int head = kAllHeads, bool for_detection = true) {
    Keep(engine.Observe(SignalPoint{run, step, signal, layer, head, value, for_detection}));
  }
  void NonFinite(std::string_view run, int64_t step, int64_t count = 3) {
    Keep(engine.ObserveNonFinite(NonFiniteEvent{run, step, detectors::SampleKind::kQK, count, 4}));
  }
  // `count` samples of `signal` every `stride` steps from `first_step`, at
  // `level` with 0.5% noise.
  void Series(std::string_view run, std::string_view signal, int layer, int64_t first_step,
              int count, double level, int64_t stride = 10) {
    std::normal_distribution<double> noise(0.0, 0.005);
    for (int i = 0; i < count; ++i) {
      Point(run, first_step + i * stride, signal, layer, level * (1 + noise(rng_)));
    }
  }
  // A signal that is normal at `normal` for `normal_samples` (past its
  // warm-up), then at `faulty` for 10 samples from `fault_step`: it fires at
  // fault_step + 2 * stride.
  void Fault(std::string_view run, std::string_view signal, int layer, int64_t fault_step,
             double normal, double faulty, int64_t stride = 10, int normal_samples = 60) {
    Series(run, signal, layer, fault_step - normal_samples * stride, normal_samples, normal,
           stride);
    Series(run, signal, layer, fault_step, 10, faulty, stride);
  }

  std::vector<AlertTransition> Transitions(std::string_view alertname,
                                           std::string_view layer) const {
    std::vector<AlertTransition> selected;
    for (const AlertTransition& t : transitions) {
      if (t.alert.alertname == alertname && t.alert.layer == layer) selected.push_back(t);
    }
    return selected;
  }
  // The same without firing -> firing re-annotations (a refined or settled cause).
  std::vector<AlertTransition> StateChanges(std::string_view alertname,
                                            std::string_view layer) const {
    std::vector<AlertTransition> selected = Transitions(alertname, layer);
    std::erase_if(selected, [](const AlertTransition& t) {
      return t.from == AlertState::kFiring && t.to == AlertState::kFiring;
    });
    return selected;
  }

  AlertEngine engine;
  std::vector<AlertTransition> transitions;

 private:
  void Keep(std::vector<AlertTransition> more) {
    transitions.insert(transitions.end(), more.begin(), more.end());
  }
  std::mt19937_64 rng_{42};
};

TEST(AlertEngineTest, LifecyclePendingFiringResolvedWithLabelsAndAnnotations) {
  EngineDriver driver;
  driver.Series("r1", "qk_increment_entropy", 2, 0, 100, 0.8);  // steps 0..990
  for (int i = 0; i < 5; ++i) driver.Point("r1", 1000 + 10 * i, "qk_increment_entropy", 2, 0.4);
  driver.Series("r1", "qk_increment_entropy", 2, 1050, 30, 0.8);  // recovered from 1050

  auto transitions = driver.Transitions(kQKIncrementCollapse, "2");
  ASSERT_EQ(transitions.size(), 4u);
  // The cause settles settle_steps (100) after the onset: the firing alert is
  // re-sent once with its final diagnosis.
  EXPECT_EQ(transitions[2].from, AlertState::kFiring);
  EXPECT_EQ(transitions[2].to, AlertState::kFiring);
  EXPECT_EQ(transitions[2].step, 1100);
  EXPECT_EQ(Annotation(transitions[2].alert, "probable_cause_status"), "settled");
  EXPECT_EQ(Annotation(transitions[1].alert, "probable_cause_status"), "provisional");
  transitions.erase(transitions.begin() + 2);
  EXPECT_EQ(transitions[0].from, AlertState::kInactive);
  EXPECT_EQ(transitions[0].to, AlertState::kPending);
  EXPECT_EQ(transitions[0].step, 1000);
  EXPECT_EQ(transitions[1].from, AlertState::kPending);
  EXPECT_EQ(transitions[1].to, AlertState::kFiring);
  EXPECT_EQ(transitions[1].step, 1020);  // persistence: 3 of 5
  EXPECT_EQ(transitions[2].from, AlertState::kFiring);
  EXPECT_EQ(transitions[2].to, AlertState::kResolved);
  // Hysteresis: the 10th consecutive normal sample after the collapse (1050 + 9 * 10).
  EXPECT_EQ(transitions[2].step, 1140);
  EXPECT_EQ(driver.transitions.size(), 4u) << "no other alert may move";

  const Alert& firing = transitions[1].alert;
  EXPECT_EQ(Label(firing, "alertname"), "ForeshockQKIncrementCollapse");
  EXPECT_EQ(Label(firing, "run"), "r1");
  EXPECT_EQ(Label(firing, "layer"), "2");
  EXPECT_EQ(Label(firing, "signal"), "qk_increment_entropy");
  EXPECT_EQ(Label(firing, "severity"), "warning");
  EXPECT_EQ(Annotation(firing, "first_step"), "1000");
  EXPECT_EQ(Annotation(firing, "probable_cause"), "low_precision_attention");
  EXPECT_NE(Annotation(firing, "suggested_action").find("fp32"), std::string::npos);
  EXPECT_NE(Annotation(firing, "suggested_action").find("before step 1000"), std::string::npos);
  EXPECT_NE(Annotation(firing, "summary").find("layer 2 of run r1"), std::string::npos);
  const std::string description = Annotation(firing, "description");
  for (const char* part :
       {"qk_increment_entropy dropped to 0.4 at step 1020", "(baseline 0.", "robust z",
        "since step 1000", "First layer to fire in this run: layer 2"}) {
    EXPECT_NE(description.find(part), std::string::npos) << part << " in: " << description;
  }
  EXPECT_NEAR(firing.baseline, 0.8, 0.01);
  EXPECT_LT(firing.z, -5);
  EXPECT_EQ(firing.firing_step, 1020);
  EXPECT_EQ(firing.pending_step, 1000);

  const Alert& resolved = transitions[2].alert;
  EXPECT_EQ(resolved.state, AlertState::kResolved);
  EXPECT_EQ(resolved.resolved_step, 1140);
  EXPECT_EQ(resolved.firing_step, 1020);
  EXPECT_TRUE(driver.engine.ActiveAlerts().empty());
  ASSERT_EQ(driver.engine.AllAlerts("r1").size(), 1u);
  EXPECT_EQ(driver.engine.AllAlerts("r1")[0].state, AlertState::kResolved);
}

TEST(AlertEngineTest, PendingThatDoesNotPersistReturnsToInactive) {
  EngineDriver driver;
  driver.Series("r1", "attention_entropy", 0, 0, 100, 2.0);
  driver.Point("r1", 1000, "attention_entropy", 0, 1.0);  // one collapsed sample
  driver.Series("r1", "attention_entropy", 0, 1010, 20, 2.0);
  const auto transitions = driver.Transitions(kAttentionEntropyCollapse, "0");
  ASSERT_EQ(transitions.size(), 2u);
  EXPECT_EQ(transitions[0].to, AlertState::kPending);
  EXPECT_EQ(transitions[1].from, AlertState::kPending);
  EXPECT_EQ(transitions[1].to, AlertState::kInactive);
  EXPECT_EQ(transitions[1].step, 1050);  // the spike left the 5-sample window
}

// Every episode is kept (issue 36): an alert that fired, resolved, went
// pending and cleared, and fired again is three entries of AllAlerts, each
// with its own steps, in episode order, and a checkpoint keeps them all.
TEST(AlertEngineTest, EveryEpisodeIsListedWithItsOwnSteps) {
  EngineDriver driver;
  driver.Series("r1", "qk_increment_entropy", 2, 0, 100, 0.8);      // steps 0..990
  for (int i = 0; i < 5; ++i) driver.Point("r1", 1000 + 10 * i, "qk_increment_entropy", 2, 0.4);
  driver.Series("r1", "qk_increment_entropy", 2, 1050, 30, 0.8);    // resolves at 1140
  driver.Point("r1", 1350, "qk_increment_entropy", 2, 0.4);         // one sample: pending only
  driver.Series("r1", "qk_increment_entropy", 2, 1360, 20, 0.8);    // clears
  for (int i = 0; i < 5; ++i) driver.Point("r1", 1600 + 10 * i, "qk_increment_entropy", 2, 0.4);

  std::vector<Alert> all = driver.engine.AllAlerts("r1");
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[0].episode, 1);
  EXPECT_EQ(all[0].state, AlertState::kResolved);
  EXPECT_EQ(all[0].pending_step, 1000);
  EXPECT_EQ(all[0].firing_step, 1020);
  EXPECT_EQ(all[0].resolved_step, 1140);
  EXPECT_EQ(all[1].episode, 2);
  EXPECT_EQ(all[1].state, AlertState::kInactive);
  EXPECT_EQ(all[1].pending_step, 1350);
  EXPECT_EQ(all[1].firing_step, -1);
  EXPECT_EQ(all[1].resolved_step, 1400);  // the step it cleared: the sample left the window
  EXPECT_EQ(all[2].episode, 3);
  EXPECT_EQ(all[2].state, AlertState::kFiring);
  EXPECT_EQ(all[2].pending_step, 1600);
  EXPECT_EQ(all[2].firing_step, 1620);
  EXPECT_EQ(all[2].resolved_step, -1);
  // The transitions the engine returned agree: each episode's last one is its entry.
  for (const Alert& entry : all) {
    const AlertTransition* last = nullptr;
    for (const AlertTransition& t : driver.transitions) {
      if (t.alert.alertname == entry.alertname && t.alert.episode == entry.episode) last = &t;
    }
    ASSERT_NE(last, nullptr) << entry.episode;
    EXPECT_EQ(last->alert.state, entry.state) << entry.episode;
    EXPECT_EQ(last->alert.firing_step, entry.firing_step) << entry.episode;
    EXPECT_EQ(last->alert.resolved_step, entry.resolved_step) << entry.episode;
  }

  AlertEngine restored(WithAttentionAlerts());
  std::string error;
  ASSERT_TRUE(restored.RestoreState(driver.engine.SaveState(), &error)) << error;
  const std::vector<Alert> again = restored.AllAlerts("r1");
  ASSERT_EQ(again.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(again[i].episode, all[i].episode);
    EXPECT_EQ(again[i].state, all[i].state);
    EXPECT_EQ(again[i].firing_step, all[i].firing_step);
    EXPECT_EQ(again[i].resolved_step, all[i].resolved_step);
  }
}

// Issue 34: closed episodes are fed by step scalars, which the memory bound
// never refuses, so a run whose alerts flap could grow the daemon without
// bound over many runs. Past the engine-wide limit the run that keeps the
// most drops its own, oldest never-fired first; other runs keep theirs.
TEST(AlertEngineTest, ADaemonWideEpisodeLimitTakesFromTheRunThatKeepsTheMost) {
  constexpr std::string_view kSignal = "qk_increment_entropy";
  auto drive = [&](EngineDriver& driver) {
    // "steady": three fired episodes.
    driver.Series("steady", kSignal, 2, 0, 100, 0.8);
    for (int cycle = 0; cycle < 3; ++cycle) {
      const int64_t at = 1000 + 400 * cycle;
      for (int i = 0; i < 5; ++i) driver.Point("steady", at + 10 * i, kSignal, 2, 0.4);
      driver.Series("steady", kSignal, 2, at + 50, 30, 0.8);
    }
    // "flappy": one-sample excursions, each a pending episode that clears.
    driver.Series("flappy", kSignal, 2, 0, 100, 0.8);
    for (int cycle = 0; cycle < 12; ++cycle) {
      const int64_t at = 1000 + 250 * cycle;
      driver.Point("flappy", at, kSignal, 2, 0.4);
      driver.Series("flappy", kSignal, 2, at + 10, 20, 0.8);
    }
  };
  auto closed = [](const AlertEngine& engine, const std::string& run) {
    std::vector<Alert> all = engine.AllAlerts(run);
    all.pop_back();  // the current episode, never dropped
    return all;
  };
  EngineDriver unbounded;
  drive(unbounded);
  const std::vector<Alert> steady = closed(unbounded.engine, "steady");
  const std::vector<Alert> flappy = closed(unbounded.engine, "flappy");
  ASSERT_EQ(steady.size(), 2u);
  for (const Alert& a : steady) EXPECT_GE(a.firing_step, 0);
  ASSERT_GE(flappy.size(), 6u) << "the excursions must open episodes for the limit to matter";
  EXPECT_EQ(unbounded.engine.kept_episodes(), steady.size() + flappy.size());
  EXPECT_EQ(unbounded.engine.counters().episodes_dropped, 0u);

  const size_t limit = steady.size() + 3;
  EngineDriver bounded;
  bounded.engine.SetKeptEpisodeLimit(limit);
  drive(bounded);
  EXPECT_EQ(bounded.engine.kept_episodes(), limit);
  EXPECT_EQ(bounded.engine.counters().episodes_dropped, steady.size() + flappy.size() - limit);
  // The steady run kept every episode; the flapping one its latest three.
  const std::vector<Alert> steady_kept = closed(bounded.engine, "steady");
  ASSERT_EQ(steady_kept.size(), steady.size());
  const std::vector<Alert> flappy_kept = closed(bounded.engine, "flappy");
  ASSERT_EQ(flappy_kept.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(flappy_kept[i].episode, flappy[flappy.size() - 3 + i].episode);
  }

  // A daemon restarted with a lower limit applies it to what it restores.
  AlertEngine restored(WithAttentionAlerts());
  restored.SetKeptEpisodeLimit(steady.size());
  std::string error;
  ASSERT_TRUE(restored.RestoreState(bounded.engine.SaveState(), &error)) << error;
  EXPECT_EQ(restored.kept_episodes(), steady.size());
  // 2 + 3 kept, limit 2: whichever keeps more gives one up until it holds.
  EXPECT_EQ(closed(restored, "steady").size(), 1u);
  EXPECT_EQ(closed(restored, "flappy").size(), 1u);
}

TEST(AlertEngineTest, OneAlertPerLayerWhateverTheHeadsAndRanksFeeding) {
  // The signal judged by its layer aggregate (per-head judgement:
  // per_head_test.cc).
  AlertConfig config = WithAttentionAlerts();
  config.signals.at("qk_increment_entropy").per_head = false;
  EngineDriver driver(config);
  std::normal_distribution<double> noise(0.0, 0.002);
  std::mt19937_64 rng(1);
  for (int i = 0; i < 120; ++i) {
    const int64_t step = 10 * i;
    const double layer_value = i < 100 ? 0.8 : 0.3;
    for (int rank = 0; rank < 3; ++rank) {
      // Per-head values, one head wild from the start: only the layer
      // aggregate (head = -1) drives alerts.
      for (int head = 0; head < 4; ++head) {
        driver.Point("r1", step, "qk_increment_entropy", 5, head == 3 ? 0.01 : 0.8, head);
      }
      // Every rank reports the same layer aggregate (data parallel).
      driver.Point("r1", step, "qk_increment_entropy", 5, layer_value + noise(rng));
    }
    // An unconverged value flagged out of detection is ignored too.
    driver.Point("r1", step, "qk_increment_entropy", 5, 0.0, kAllHeads, /*for_detection=*/false);
  }
  const auto transitions = driver.StateChanges(kQKIncrementCollapse, "5");
  ASSERT_EQ(transitions.size(), 2u);
  EXPECT_EQ(transitions[0].to, AlertState::kPending);
  EXPECT_EQ(transitions[1].to, AlertState::kFiring);
  EXPECT_EQ(transitions[1].step, 1020);
  EXPECT_EQ(driver.engine.AllAlerts("r1").size(), 1u);
  EXPECT_EQ(driver.engine.ActiveAlerts().size(), 1u);
  EXPECT_GT(driver.engine.counters().points_duplicate, 0u);
}

TEST(AlertEngineTest, SignalsOfOneAlertShareItAndItResolvesWhenAllClear) {
  EngineDriver driver;
  // Entropy drops and the top-1 share rises in layer 1: one QK collapse alert.
  driver.Series("r1", "qk_increment_entropy", 1, 0, 100, 0.8);
  driver.Series("r1", "qk_increment_top1_share", 1, 0, 100, 0.2);
  for (int i = 0; i < 5; ++i) {
    driver.Point("r1", 1000 + 10 * i, "qk_increment_entropy", 1, 0.4);
    driver.Point("r1", 1000 + 10 * i, "qk_increment_top1_share", 1, 0.7);
  }
  // The entropy recovers at once; the share only 100 steps later.
  for (int i = 5; i < 40; ++i) {
    driver.Point("r1", 1000 + 10 * i, "qk_increment_entropy", 1, 0.8);
    driver.Point("r1", 1000 + 10 * i, "qk_increment_top1_share", 1, i < 15 ? 0.7 : 0.2);
  }
  const auto transitions = driver.StateChanges(kQKIncrementCollapse, "1");
  ASSERT_EQ(transitions.size(), 3u);
  EXPECT_EQ(transitions[0].to, AlertState::kPending);
  EXPECT_EQ(transitions[1].to, AlertState::kFiring);
  EXPECT_EQ(transitions[1].alert.signal, "qk_increment_entropy");  // fed first
  EXPECT_EQ(transitions[2].to, AlertState::kResolved);
  EXPECT_EQ(transitions[2].step, 1000 + 10 * 24);  // the share's 10th normal sample
  EXPECT_EQ(driver.engine.AllAlerts("r1").size(), 1u);
}

TEST(AlertEngineTest, RunLevelSignalsAlertOnLayerAll) {
  EngineDriver driver;
  driver.Series("r1", "loss", kNoLayer, 0, 300, 2.0, 1);
  driver.Series("r1", "loss", kNoLayer, 300, 5, 4.0, 1);
  const auto transitions = driver.Transitions(kLossSpike, "all");
  ASSERT_EQ(transitions.size(), 2u);
  EXPECT_EQ(transitions[1].to, AlertState::kFiring);
  EXPECT_EQ(transitions[1].step, 302);
  EXPECT_EQ(transitions[1].alert.first_step, 300);
  EXPECT_NE(transitions[1].alert.summary.find("Loss spike in run r1"), std::string::npos);
  // No mechanism alert: the cause is unknown.
  EXPECT_EQ(transitions[1].alert.probable_cause, "unknown");
}

int Warmup(std::string_view signal) {
  return DefaultAlertConfig().signals.find(signal)->second.detector.warmup;
}
// The training step a signal's series starts at by default (warmup_steps).
int64_t StartStep(std::string_view signal) {
  return DefaultAlertConfig().signals.find(signal)->second.detector.warmup_steps;
}

TEST(AlertEngineTest, ExpertsDeadFromInitializationAreNoCollapse) {
  // Issue 26: a random-init MoE with 2 experts dead from the first probe on
  // raised ForeshockRouterCollapse on every layer once scoring started (the
  // old rule: any dead expert after warm-up). The count is exported, not alerted on.
  EngineDriver driver;
  for (int i = 0; i < 200; ++i) driver.Point("r1", 10 * i, "router_dead_experts", 3, 2 + i % 2);
  for (int i = 0; i < 200; ++i) driver.Point("r1", 10 * i, "router_experts_died", 3, 0);
  EXPECT_TRUE(driver.transitions.empty());
}

TEST(AlertEngineTest, ExpertsThatDieDuringTrainingFireRouterCollapseAfterWarmup) {
  EngineDriver driver(WithoutHolds());  // the series rule; its hold is tested below
  const int warmup = Warmup("router_experts_died");
  const int64_t start = StartStep("router_experts_died");
  // Died before the series starts (early training's transient): ignored ...
  for (int64_t step = 0; step < start; step += 10) {
    driver.Point("r1", step, "router_experts_died", 3, 1);
  }
  // ... and during its warm-up ...
  for (int i = 0; i < warmup; ++i) {
    driver.Point("r1", start + 10 * i, "router_experts_died", 3, i < warmup / 2 ? 1 : 0);
  }
  for (int i = warmup; i < warmup + 20; ++i)
    driver.Point("r1", start + 10 * i, "router_experts_died", 3, 0);
  EXPECT_TRUE(driver.transitions.empty());
  // ... one after it fires on the third sample.
  const int first = warmup + 20;
  for (int i = first; i < first + 3; ++i) {
    driver.Point("r1", start + 10 * i, "router_experts_died", 3, 1);
  }
  const auto transitions = driver.Transitions(kRouterCollapse, "3");
  ASSERT_EQ(transitions.size(), 2u);
  EXPECT_EQ(transitions[1].to, AlertState::kFiring);
  EXPECT_EQ(transitions[1].step, start + 10 * (first + 2));
  EXPECT_EQ(transitions[1].alert.signal, "router_experts_died");
  EXPECT_NE(transitions[1].alert.description.find("above the absolute bound 0"), std::string::npos)
      << transitions[1].alert.description;
  // A router alert alone is no evidence of a cause.
  EXPECT_EQ(transitions[1].alert.probable_cause, "unknown");
}

TEST(AlertEngineTest, CurvatureAtOrAboveTheEdgeIsNormalOnlyASustainedSurgeFires) {
  EngineDriver driver(WithoutHolds());
  // rho hovers around the edge and above it, as healthy Adam training does,
  // with the noise of small-batch estimates (0.6x to 1.8x its level).
  ASSERT_LT(Warmup("curvature_eos_ratio"), 50);
  const double noise[] = {1.0, 1.8, 0.6, 1.2, 0.9, 1.5, 0.7, 1.1};
  for (int i = 0; i < 50; ++i) {
    driver.Point("r1", 10 * i, "curvature_eos_ratio", kNoLayer, 1.3 * noise[i % 8]);
  }
  // Two samples of a surge, then back: not sustained.
  driver.Point("r1", 500, "curvature_eos_ratio", kNoLayer, 5.0);
  driver.Point("r1", 510, "curvature_eos_ratio", kNoLayer, 5.0);
  driver.Point("r1", 520, "curvature_eos_ratio", kNoLayer, 1.3);
  // Unconverged estimates are kept out of detection, however high.
  for (int i = 0; i < 5; ++i) {
    driver.Point("r1", 530 + 10 * i, "curvature_eos_ratio", kNoLayer, 30.0, kAllHeads, false);
  }
  for (const AlertTransition& t : driver.transitions) EXPECT_NE(t.to, AlertState::kFiring);
  // Three in a row at several times the run's own level fire it.
  for (int i = 0; i < 3; ++i) driver.Point("r1", 600 + 10 * i, "curvature_eos_ratio", kNoLayer, 6.0);
  const auto transitions = driver.Transitions(kCurvatureAboveEdge, "all");
  ASSERT_FALSE(transitions.empty());
  EXPECT_EQ(transitions.back().to, AlertState::kFiring);
  EXPECT_EQ(transitions.back().step, 620);
  EXPECT_EQ(transitions.back().alert.probable_cause, "learning_rate_too_high");
}

// A curvature surge alone is often an edge-of-stability excursion that the
// optimizer resolves by itself, with a flat loss (two healthy runs of the
// second preregistered draw): it waits, pending and saying why, for another
// kind of alert, and fires with it, its onset kept as evidence.
TEST(AlertEngineTest, CurvatureAloneIsHeldUntilAnotherKindIsAnomalous) {
  EngineDriver driver(DefaultAlertConfig());
  // r1: an excursion of 10 estimates, then back: pending, never firing.
  driver.Fault("r1", "curvature_eos_ratio", kNoLayer, 1000, 0.5, 2.5);
  driver.Series("r1", "curvature_eos_ratio", kNoLayer, 1100, 30, 0.5);
  const auto alone = driver.StateChanges(kCurvatureAboveEdge, "all");
  ASSERT_FALSE(alone.empty());
  EXPECT_EQ(alone[0].to, AlertState::kPending);
  EXPECT_EQ(alone[0].step, 1000);
  for (const AlertTransition& t : alone) EXPECT_NE(t.to, AlertState::kFiring) << t.step;
  bool said_why = false;
  for (const Alert& alert : driver.engine.AllAlerts("r1")) {
    said_why |= alert.alertname == kCurvatureAboveEdge &&
                alert.description.find("Held: a curvature surge alone") != std::string::npos;
  }
  EXPECT_TRUE(said_why);
  EXPECT_TRUE(driver.engine.ActiveAlerts().empty() ||
              driver.engine.ActiveAlerts()[0].state != AlertState::kFiring);

  // r2: the same surge, and the loss spikes 30 steps after its onset: the
  // curvature fires with the loss spike, as the learning rate's evidence.
  driver.Series("r2", "curvature_eos_ratio", kNoLayer, 400, 60, 0.5);
  driver.Series("r2", "curvature_eos_ratio", kNoLayer, 1000, 3, 2.5);  // confirmed at 1020: held
  ASSERT_EQ(driver.StateChanges(kCurvatureAboveEdge, "all").size(), alone.size() + 1);
  driver.Series("r2", "loss", kNoLayer, 880, 150, 2.0, 1);
  driver.Series("r2", "loss", kNoLayer, 1030, 10, 4.0, 1);
  std::vector<AlertTransition> r2;
  for (const AlertTransition& t : driver.StateChanges(kCurvatureAboveEdge, "all")) {
    if (t.alert.run == "r2") r2.push_back(t);
  }
  ASSERT_EQ(r2.size(), 2u);
  EXPECT_EQ(r2[0].to, AlertState::kPending);
  EXPECT_EQ(r2[1].to, AlertState::kFiring);
  EXPECT_EQ(r2[1].alert.first_step, 1000);
  EXPECT_EQ(r2[1].alert.description.find("Held: "), std::string::npos);
  const auto spike = driver.StateChanges(kLossSpike, "all");
  ASSERT_FALSE(spike.empty());
  ASSERT_EQ(spike.back().to, AlertState::kFiring);
  EXPECT_EQ(r2[1].step, spike.back().step);
  EXPECT_EQ(driver.engine.RunProbableCause("r2"), ProbableCause::kLearningRateTooHigh);

  // r3: another kind already firing (a router collapse): the surge fires at once.
  driver.Fault("r3", "router_entropy", 1, 990, 0.9, 0.5);
  driver.Fault("r3", "curvature_eos_ratio", kNoLayer, 1000, 0.5, 2.5);
  std::vector<AlertTransition> r3;
  for (const AlertTransition& t : driver.StateChanges(kCurvatureAboveEdge, "all")) {
    if (t.alert.run == "r3") r3.push_back(t);
  }
  ASSERT_FALSE(r3.empty());
  EXPECT_EQ(r3.back().to, AlertState::kFiring);
  EXPECT_EQ(r3.back().step, 1020);
}

// Issue 33: a MoE without a balance loss loses experts at every LR and still
// trains to its best loss (9 of 16 healthy Hugging Face Qwen3-MoE runs paged
// with cause unknown). Expert deaths alone wait, pending and saying why, for
// another kind of alert or for the router's logits to move.
TEST(AlertEngineTest, ExpertDeathsAloneAreHeldUntilAnotherKindFires) {
  EngineDriver driver(DefaultAlertConfig());
  const int64_t start = StartStep("router_experts_died");
  const int samples = static_cast<int>(start / 10) + Warmup("router_experts_died") + 20;
  const int64_t died = 10 * samples;  // after the series' warm-up
  auto dying = [&](std::string_view run, int layer) {
    driver.Series(run, "router_experts_died", layer, 0, samples, 0.0);
    driver.Series(run, "router_experts_died", layer, died, 60, 2.0);  // to died + 590
  };
  auto changes = [&](std::string_view run) {
    std::vector<AlertTransition> selected;
    for (const AlertTransition& t : driver.StateChanges(kRouterCollapse, "1")) {
      if (t.alert.run == run) selected.push_back(t);
    }
    return selected;
  };

  // r1: the experts die and stay dead, and the router imbalance that starves
  // them is anomalous too: both pending, never firing, saying why (two
  // symptoms do not corroborate each other).
  driver.Fault("r1", "router_load_cv", 3, died + 100, 0.3, 0.9);
  dying("r1", 1);
  const auto imbalance = driver.StateChanges(kRouterImbalance, "3");
  ASSERT_EQ(imbalance.size(), 1u);
  EXPECT_EQ(imbalance[0].to, AlertState::kPending);
  const auto r1 = changes("r1");
  ASSERT_EQ(r1.size(), 1u);
  EXPECT_EQ(r1[0].to, AlertState::kPending);
  EXPECT_EQ(r1[0].step, died);
  bool said_why = false;
  for (const Alert& alert : driver.engine.AllAlerts("r1")) {
    if (alert.alertname != kRouterCollapse) continue;
    EXPECT_EQ(alert.state, AlertState::kPending);
    said_why |= alert.description.find("Held: experts that stopped receiving tokens") !=
                std::string::npos;
  }
  EXPECT_TRUE(said_why);

  // r2: the loss spikes 200 steps after the experts died: the collapse fires
  // with it, its onset kept.
  driver.Series("r2", "loss", kNoLayer, died + 50, 150, 2.0, 1);
  dying("r2", 1);
  driver.Series("r2", "loss", kNoLayer, died + 200, 10, 4.0, 1);
  const auto r2 = changes("r2");
  ASSERT_EQ(r2.size(), 2u);
  EXPECT_EQ(r2[0].to, AlertState::kPending);
  EXPECT_EQ(r2[1].to, AlertState::kFiring);
  EXPECT_EQ(r2[1].alert.first_step, died);
  EXPECT_GE(r2[1].step, died + 200);
  EXPECT_LE(r2[1].step, died + 220);  // the next probe of the held series
  EXPECT_EQ(r2[1].alert.description.find("Held: "), std::string::npos);

  // r5: r2 as another worker may deliver it: the loss, spike included, is
  // processed before the router's layer reaches the deaths. A spike at a
  // later step corroborates nothing yet: the collapse fires at the spike's
  // step or the held series' next probe, as in step order, not when its layer
  // first shows the deaths (under load an end-to-end run fired at 319
  // against a spike at 402).
  driver.Series("r5", "loss", kNoLayer, died + 50, 150, 2.0, 1);
  driver.Series("r5", "loss", kNoLayer, died + 200, 10, 4.0, 1);
  dying("r5", 1);
  const auto r5 = changes("r5");
  ASSERT_EQ(r5.size(), 2u);
  EXPECT_EQ(r5[0].to, AlertState::kPending);
  EXPECT_EQ(r5[1].to, AlertState::kFiring);
  EXPECT_EQ(r5[1].alert.first_step, died);
  EXPECT_GE(r5[1].step, died + 200);
  EXPECT_LE(r5[1].step, died + 220);

  // r3: the router's logits grow in the same layer as its experts die: the
  // collapse fires from the z-loss, unheld.
  driver.Fault("r3", "router_z_loss", 1, died + 100, 1.0, 3.0);
  dying("r3", 1);
  const auto r3 = changes("r3");
  ASSERT_FALSE(r3.empty());
  EXPECT_EQ(r3.back().to, AlertState::kFiring);
  EXPECT_EQ(r3.back().step, died + 120);
  EXPECT_EQ(r3.back().alert.signal, "router_z_loss");

  // r4: the experts die first (held), then the router's logits grow in the
  // same layer: the collapse fires from the z-loss, which is learning-rate
  // evidence (the held deaths' labels do not decide it).
  dying("r4", 1);
  driver.Fault("r4", "router_z_loss", 1, died + 100, 1.0, 3.0);
  const auto r4 = changes("r4");
  ASSERT_EQ(r4.size(), 2u);
  EXPECT_EQ(r4[0].to, AlertState::kPending);
  EXPECT_EQ(r4[1].to, AlertState::kFiring);
  EXPECT_EQ(r4[1].step, died + 120);
  EXPECT_EQ(r4[1].alert.signal, "router_z_loss");
  EXPECT_EQ(r4[1].alert.probable_cause, "learning_rate_too_high");

  // With the hold off, the deaths alone fire, as before.
  EngineDriver unheld(WithoutHolds());
  unheld.Series("r1", "router_experts_died", 1, 0, samples, 0.0);
  unheld.Series("r1", "router_experts_died", 1, died, 3, 2.0);
  const auto fired = unheld.StateChanges(kRouterCollapse, "1");
  ASSERT_EQ(fired.size(), 2u);
  EXPECT_EQ(fired[1].to, AlertState::kFiring);
  EXPECT_EQ(fired[1].step, died + 20);
}

// Issue 33 (Hugging Face seed 1, a Qwen3-MoE at every=50): held expert
// deaths released by the loss set the run's onset at step 400, the router's
// z-loss that began at 500 fell outside the onset window, and the run stayed
// "unknown". Symptoms count as evidence but do not anchor the diagnosis: a
// diagnosis resting on symptoms alone is opened again by the first family
// that can name a cause, anchored there.
TEST(AlertEngineTest, SymptomsDoNotAnchorTheDiagnosis) {
  EngineDriver driver(DefaultAlertConfig());
  const int64_t start = StartStep("router_experts_died");
  const int samples = static_cast<int>(start / 10) + Warmup("router_experts_died") + 20;
  const int64_t died = 10 * samples;
  driver.Series("r1", "loss", kNoLayer, died + 50, 150, 2.0, 1);
  driver.Series("r1", "router_experts_died", 2, 0, samples, 0.0);
  driver.Series("r1", "router_experts_died", 2, died, 60, 2.0);  // held, to died + 590
  driver.Series("r1", "loss", kNoLayer, died + 200, 10, 4.0, 1);
  driver.Series("r1", "loss", kNoLayer, died + 210, 200, 4.0, 1);
  const auto deaths = driver.Transitions(kRouterCollapse, "2");
  ASSERT_GE(deaths.size(), 2u);
  EXPECT_EQ(deaths[1].to, AlertState::kFiring);
  EXPECT_EQ(deaths[1].alert.first_step, died);
  // Symptoms alone: the diagnosis settles, naming nothing.
  EXPECT_EQ(deaths.back().alert.probable_cause, "unknown");
  EXPECT_TRUE(deaths.back().alert.probable_cause_settled);

  // The router's logits grow in another layer, 250 steps after the deaths.
  driver.Fault("r1", "router_z_loss", 1, died + 250, 1.0, 3.0);
  driver.Series("r1", "router_z_loss", 1, died + 350, 6, 3.0);
  driver.Series("r1", "loss", kNoLayer, died + 410, 50, 4.0, 1);
  const auto growth = driver.Transitions(kRouterCollapse, "1");
  ASSERT_GE(growth.size(), 2u);
  EXPECT_EQ(growth[1].to, AlertState::kFiring);
  EXPECT_EQ(growth[1].alert.first_step, died + 250);
  EXPECT_EQ(growth[1].alert.probable_cause, "learning_rate_too_high");
  EXPECT_FALSE(growth[1].alert.probable_cause_settled);  // open again, anchored at died + 250
  EXPECT_EQ(driver.engine.RunProbableCause("r1"), ProbableCause::kLearningRateTooHigh);
  // Settled at the new anchor + settle_steps; the deaths' alert is re-sent
  // with it, and the rollback still goes before the deaths.
  const auto redone = driver.Transitions(kRouterCollapse, "2");
  EXPECT_EQ(redone.back().alert.probable_cause, "learning_rate_too_high");
  EXPECT_TRUE(redone.back().alert.probable_cause_settled);
  EXPECT_NE(Annotation(redone.back().alert, "suggested_action")
                .find("before step " + std::to_string(died)),
            std::string::npos);
  const std::string evidence = Annotation(redone.back().alert, "probable_cause_evidence");
  EXPECT_NE(evidence.find("router collapse from step " + std::to_string(died)), std::string::npos)
      << evidence;
}

// Issue 33 (Hugging Face seed 3): held expert deaths released by the router's
// z-loss in another layer fired with cause "unknown" at the very step the
// z-loss named the learning rate, and were re-sent with it a moment later.
// A released alert fires with the diagnosis that the alert releasing it
// completes.
TEST(AlertEngineTest, ReleasedAlertsFireWithTheEvidenceThatReleasedThem) {
  EngineDriver driver(DefaultAlertConfig());
  const int64_t start = StartStep("router_experts_died");
  const int samples = static_cast<int>(start / 10) + Warmup("router_experts_died") + 20;
  const int64_t died = 10 * samples;
  driver.Series("r1", "router_experts_died", 1, 0, samples, 0.0);
  driver.Series("r1", "router_experts_died", 1, died, 60, 2.0);  // held, to died + 590
  driver.Fault("r1", "router_z_loss", 2, died + 100, 1.0, 3.0);
  const auto growth = driver.StateChanges(kRouterCollapse, "2");
  ASSERT_FALSE(growth.empty());
  ASSERT_EQ(growth.back().to, AlertState::kFiring);
  const int64_t released_at = growth.back().step;
  EXPECT_EQ(growth.back().alert.probable_cause, "learning_rate_too_high");

  const auto deaths = driver.Transitions(kRouterCollapse, "1");
  ASSERT_GE(deaths.size(), 2u);
  EXPECT_EQ(deaths[0].to, AlertState::kPending);
  EXPECT_EQ(deaths[1].from, AlertState::kPending);
  EXPECT_EQ(deaths[1].to, AlertState::kFiring);
  EXPECT_EQ(deaths[1].step, released_at);
  EXPECT_EQ(deaths[1].alert.first_step, died);
  EXPECT_EQ(deaths[1].alert.probable_cause, "learning_rate_too_high");
  // Every transition of the deaths' alert from its firing on names the cause.
  for (size_t i = 1; i < deaths.size(); ++i) {
    EXPECT_EQ(deaths[i].alert.probable_cause, "learning_rate_too_high") << "transition " << i;
  }
}

// Issue 33 (natural draw 7): the only alert on a healthy QK-layernorm twin
// trained without a balance loss was a router imbalance at step 565. A load
// that drifts while nothing else moves names no cause and costs throughput,
// not the run: it waits, pending and saying why, for another kind of alert.
TEST(AlertEngineTest, RouterImbalanceAloneIsHeldUntilAnotherKindFires) {
  EngineDriver driver(DefaultAlertConfig());
  auto changes = [&](std::string_view run) {
    std::vector<AlertTransition> selected;
    for (const AlertTransition& t : driver.StateChanges(kRouterImbalance, "1")) {
      if (t.alert.run == run) selected.push_back(t);
    }
    return selected;
  };
  const int64_t skew = 1000;

  // r1: the load skews and stays skewed: pending, never firing, saying why.
  driver.Series("r1", "router_load_cv", 1, skew - 600, 60, 0.3);
  driver.Series("r1", "router_load_cv", 1, skew, 60, 0.9);
  const auto r1 = changes("r1");
  ASSERT_EQ(r1.size(), 1u);
  EXPECT_EQ(r1[0].to, AlertState::kPending);
  EXPECT_EQ(r1[0].step, skew);
  bool said_why = false;
  for (const Alert& alert : driver.engine.AllAlerts("r1")) {
    if (alert.alertname != kRouterImbalance) continue;
    EXPECT_EQ(alert.state, AlertState::kPending);
    said_why |= alert.description.find("Held: a skewed expert load") != std::string::npos;
  }
  EXPECT_TRUE(said_why);

  // r2: the loss spikes 200 steps into the skew: the imbalance fires with it,
  // its onset kept.
  driver.Series("r2", "loss", kNoLayer, skew - 400, 600, 2.0, 1);
  driver.Series("r2", "router_load_cv", 1, skew - 600, 60, 0.3);
  driver.Series("r2", "router_load_cv", 1, skew, 60, 0.9);
  driver.Series("r2", "loss", kNoLayer, skew + 200, 10, 4.0, 1);
  const auto r2 = changes("r2");
  ASSERT_EQ(r2.size(), 2u);
  EXPECT_EQ(r2[1].to, AlertState::kFiring);
  EXPECT_EQ(r2[1].alert.first_step, skew);
  EXPECT_GE(r2[1].step, skew + 200);
  EXPECT_LE(r2[1].step, skew + 210);
  EXPECT_EQ(r2[1].alert.description.find("Held: "), std::string::npos);

  // With the hold off, the imbalance alone fires, as before.
  EngineDriver unheld(WithoutHolds());
  unheld.Series("r1", "router_load_cv", 1, skew - 600, 60, 0.3);
  unheld.Series("r1", "router_load_cv", 1, skew, 3, 0.9);
  const auto fired = unheld.StateChanges(kRouterImbalance, "1");
  ASSERT_EQ(fired.size(), 2u);
  EXPECT_EQ(fired[1].to, AlertState::kFiring);
  EXPECT_EQ(fired[1].step, skew + 20);
}

TEST(AlertEngineTest, AttentionMaxLogitBoundFiresWithoutABaselineChange) {
  // A model whose logits sit steady past ten times the bound: no change, no
  // growth, but beyond bound_without_growth.
  const int warmup = Warmup("attention_max_logit");
  const int64_t start = StartStep("attention_max_logit");
  EngineDriver driver;
  driver.Series("r1", "attention_max_logit", 0, 0, static_cast<int>(start / 10) + warmup, 1200.0);
  EXPECT_TRUE(driver.transitions.empty());
  driver.Series("r1", "attention_max_logit", 0, start + 10 * warmup, 3, 1200.0);
  const auto transitions = driver.Transitions(kAttentionLogitGrowth, "0");
  ASSERT_EQ(transitions.size(), 2u);
  EXPECT_EQ(transitions[1].to, AlertState::kFiring);
  EXPECT_EQ(transitions[1].step, start + 10 * (warmup + 2));
}

// Issue 33: a head that specialised holds a max logit past 100 and stops
// growing; an LR too high for the architecture keeps growing it by factors.
// Natural draw 2's healthy copy-task run crept past 100 at step 450 (from
// 91 at 400 to 111 at 600) and the plain bound fired on it.
TEST(AlertEngineTest, AttentionLogitBoundIgnoresAHeadThatHoldsPastIt) {
  EngineDriver steady;
  // Rises from 5 to 90 by step 300, then creeps 90 -> 130 over 500 steps.
  for (int64_t step = 30; step <= 800; step += 10) {
    const double value = step <= 300 ? 5.0 * std::pow(18.0, (step - 30) / 270.0)
                                     : 90.0 + 40.0 * (step - 300) / 500.0;
    steady.Point("r1", step, "attention_max_logit", 0, value);
  }
  EXPECT_TRUE(steady.Transitions(kAttentionLogitGrowth, "0").empty());
  // The same start, then doubling every 100 steps from 300: fires.
  EngineDriver runaway;
  for (int64_t step = 30; step <= 800; step += 10) {
    const double value = step <= 300 ? 5.0 * std::pow(18.0, (step - 30) / 270.0)
                                     : 90.0 * std::pow(2.0, (step - 300) / 100.0);
    runaway.Point("r1", step, "attention_max_logit", 0, value);
  }
  const auto fired = runaway.StateChanges(kAttentionLogitGrowth, "0");
  ASSERT_FALSE(fired.empty());
  EXPECT_EQ(fired.back().to, AlertState::kFiring);
  EXPECT_EQ(fired.front().step, 320);  // the first probe past 100, 2.7x its value at 220
}

// Issue 33: an LR too high for a model without QK-layernorm drives the max
// logit past the bound within the LR warm-up; the bound needs no baseline,
// so it is judged from training step 30, not after step 200, at every
// cadence (it was the run's 4th probe: step 150 at a probe every 50).
TEST(AlertEngineTest, AttentionLogitBoundIsJudgedFromStep30AtEveryCadence) {
  for (const int every : {10, 50}) {
    EngineDriver driver(DefaultAlertConfig());
    for (int64_t i = 0; i < 8; ++i) {
      driver.Point("r1", every * i, "attention_max_logit", 0, i == 0 ? 5.0 : 150.0 * i);
    }
    const auto logit = driver.StateChanges(kAttentionLogitGrowth, "0");
    ASSERT_FALSE(logit.empty()) << every;
    EXPECT_EQ(logit.front().to, AlertState::kPending) << every;
    EXPECT_EQ(logit.front().step, every == 10 ? 30 : 50) << every;  // the first probe from 30
    EXPECT_EQ(logit.back().to, AlertState::kFiring) << every;
    // Persistence 3 of 5 probes at the reference cadence; at a probe every 50
    // steps the counts span the same steps, down to their floor of 2 of 2.
    EXPECT_EQ(logit.back().step, every == 10 ? 50 : 100) << every;
  }
}

TEST(AlertEngineTest, NonFiniteFiresAtOnceAndResolvesAfterCleanSteps) {
  EngineDriver driver;
  driver.Series("r1", "loss", kNoLayer, 0, 10, 2.0, 1);
  driver.NonFinite("r1", 10);
  driver.NonFinite("r1", 11);  // still firing: no second transition
  auto transitions = driver.Transitions(kNonFinite, "all");
  ASSERT_EQ(transitions.size(), 1u);
  EXPECT_EQ(transitions[0].from, AlertState::kInactive);
  EXPECT_EQ(transitions[0].to, AlertState::kFiring);
  const Alert& alert = transitions[0].alert;
  EXPECT_EQ(alert.signal, "nonfinite_values");
  EXPECT_EQ(alert.severity, "critical");
  EXPECT_EQ(alert.first_step, 10);
  EXPECT_NE(alert.description.find("qk sample at step 10, layer 4"), std::string::npos)
      << alert.description;

  // Finite values at 19 distinct later steps (several signals per step): not yet.
  for (int64_t step = 12; step < 31; ++step) {
    driver.Point("r1", step, "loss", kNoLayer, 2.0);
    driver.Point("r1", step, "grad_norm", kNoLayer, 1.0);  // not an alert signal, still finite
  }
  EXPECT_EQ(driver.Transitions(kNonFinite, "all").size(), 1u);
  driver.Point("r1", 31, "loss", kNoLayer, 2.0);  // the 20th
  transitions = driver.Transitions(kNonFinite, "all");
  ASSERT_EQ(transitions.size(), 2u);
  EXPECT_EQ(transitions[1].to, AlertState::kResolved);
  EXPECT_EQ(transitions[1].step, 31);
}

TEST(AlertEngineTest, RemembersWhichLayerFiredFirstByStep) {
  EngineDriver driver;
  driver.Fault("r1", "qk_increment_entropy", 5, 2000, 0.8, 0.4);
  driver.Fault("r1", "qk_increment_entropy", 2, 2500, 0.8, 0.4);
  ASSERT_TRUE(driver.engine.FirstFiringLayer("r1"));
  EXPECT_EQ(driver.engine.FirstFiringLayer("r1")->layer, 5);
  EXPECT_EQ(driver.engine.FirstFiringLayer("r1")->firing_step, 2020);
  EXPECT_EQ(driver.engine.FirstFiringLayer("r1")->first_step, 2000);
  // Worker threads deliver layers out of order: a layer processed later that
  // fired at an earlier step becomes the first.
  driver.Fault("r1", "attention_entropy", 7, 1500, 2.0, 1.0);
  EXPECT_EQ(driver.engine.FirstFiringLayer("r1")->layer, 7);
  EXPECT_EQ(driver.engine.FirstFiringLayer("r1")->alertname, kAttentionEntropyCollapse);
  EXPECT_EQ(driver.engine.FirstFiringLayer("r1")->signal, "attention_entropy");
  // The later layer's description names the first one at the time it fired.
  const auto layer2 = driver.Transitions(kQKIncrementCollapse, "2");
  ASSERT_EQ(layer2.size(), 4u);
  EXPECT_EQ(layer2[1].to, AlertState::kFiring);
  EXPECT_NE(layer2[1].alert.description.find("First layer to fire in this run: layer 5"),
            std::string::npos);
  // The earlier onset moved the rollback step: the firing alert is re-annotated.
  EXPECT_EQ(layer2[2].from, AlertState::kFiring);
  EXPECT_EQ(layer2[2].to, AlertState::kFiring);
  EXPECT_NE(layer2[2].alert.suggested_action.find("before step 1500"), std::string::npos);
  // Layer 7 lags the others by over the stall horizon (1000 steps), so it
  // does not hold the settle watermark back: the cause settles at 1600 on
  // what had fired by then (only layer 7's episode).
  EXPECT_EQ(layer2[3].step, 1530);
  EXPECT_TRUE(layer2[3].alert.probable_cause_settled);
  EXPECT_EQ(layer2[3].alert.probable_cause_evidence, "attention logit growth from step 1500");
  EXPECT_FALSE(driver.engine.FirstFiringLayer("other"));
}

TEST(AlertEngineTest, ProbableCauseFromTheRunsAlertFamilies) {
  struct Case {
    const char* name;
    std::vector<std::pair<std::string, int>> faults;  // signal, layer; fired in this order
    const char* cause;
  };
  const std::vector<Case> cases = {
      {"attention only",
       {{"qk_increment_entropy", 3}, {"attention_max_logit", 4}},
       "low_precision_attention"},
      {"curvature only", {{"curvature_eos_ratio", kNoLayer}}, "learning_rate_too_high"},
      {"router logits growing only (entropy falls): the update size",
       {{"router_entropy", 1}},
       "learning_rate_too_high"},
      {"experts dying only: no evidence of a cause", {{"router_experts_died", 1}}, "unknown"},
      {"experts dying and curvature",
       {{"router_experts_died", 1}, {"curvature_eos_ratio", kNoLayer}},
       "learning_rate_too_high"},
      {"experts dying, then attention logits",
       {{"router_experts_died", 1}, {"attention_max_logit", 2}},
       "learning_rate_too_high"},
      {"QK spectrum, then router logits: both at fault",
       {{"qk_increment_entropy", 2}, {"router_entropy", 1}},
       "combined"},
      {"router collapse and curvature",
       {{"router_entropy", 1}, {"curvature_eos_ratio", kNoLayer}},
       "learning_rate_too_high"},
      {"attention logits, then curvature: both at fault",
       {{"attention_entropy", 2}, {"curvature_eos_ratio", kNoLayer}},
       "combined"},
      {"curvature, then attention logits: the logits follow from the large updates",
       {{"curvature_eos_ratio", kNoLayer}, {"attention_max_logit", 2}},
       "learning_rate_too_high"},
      {"router collapse, then attention logits",
       {{"router_entropy", 1}, {"attention_entropy", 2}},
       "learning_rate_too_high"},
      {"QK spectrum then curvature",
       {{"qk_increment_entropy", 2}, {"curvature_eos_ratio", kNoLayer}},
       "combined"},
      {"attention logits only", {{"attention_max_logit", 1}}, "low_precision_attention"},
      {"attention with router imbalance",
       {{"qk_increment_entropy", 3}, {"router_load_cv", 1}},
       "low_precision_attention"},
      {"router imbalance only", {{"router_load_cv", 1}}, "unknown"},
      {"loss spike only", {{"loss", kNoLayer}}, "unknown"},
  };
  // Healthy level and faulty level per signal, in the signal's alert direction.
  const std::map<std::string, std::pair<double, double>> levels = {
      {"qk_increment_entropy", {0.8, 0.4}},
      {"attention_max_logit", {10, 20}},
      {"attention_entropy", {2.0, 1.0}},
      {"curvature_eos_ratio", {0.5, 2.5}},
      {"router_entropy", {0.9, 0.5}},
      {"router_experts_died", {0, 2}},
      {"router_load_cv", {0.3, 0.9}},
      {"loss", {2.0, 4.0}}};
  for (const Case& c : cases) {
    EngineDriver driver(WithoutHolds());  // the cause rules, not the curvature's hold
    int64_t fault_step = 1000;
    for (const auto& [signal, layer] : c.faults) {
      const auto [normal, faulty] = levels.at(signal);
      // The loss has a 100-sample warm-up; one sample per step.
      const bool loss = signal == "loss";
      driver.Fault("r1", signal, layer, fault_step, normal, faulty, loss ? 1 : 10, loss ? 150 : 60);
      fault_step += 20;  // within the 50-step onset window
    }
    EXPECT_EQ(ProbableCauseName(driver.engine.RunProbableCause("r1")), c.cause) << c.name;
    const std::vector<Alert> active = driver.engine.ActiveAlerts();
    EXPECT_EQ(active.size(), c.faults.size()) << c.name << ": every fault fires its own alert";
    for (const Alert& alert : active) {
      EXPECT_EQ(alert.state, AlertState::kFiring) << c.name << " " << alert.alertname;
      EXPECT_EQ(alert.probable_cause, c.cause) << c.name << " " << alert.alertname;
    }
  }
}

TEST(AlertEngineTest, NewEvidenceReannotatesFiringAlerts) {
  EngineDriver driver;
  driver.Fault("r1", "qk_increment_entropy", 3, 1000, 0.8, 0.4);
  ASSERT_EQ(driver.engine.ActiveAlerts().size(), 1u);
  EXPECT_EQ(driver.engine.ActiveAlerts()[0].probable_cause, "low_precision_attention");
  driver.transitions.clear();

  driver.Fault("r1", "curvature_eos_ratio", kNoLayer, 1040, 0.5, 2.5);
  // The curvature alert fires as combined, and the attention alert is re-sent.
  const auto qk = driver.Transitions(kQKIncrementCollapse, "3");
  ASSERT_EQ(qk.size(), 1u);  // re-annotated at 1060
  EXPECT_EQ(qk[0].from, AlertState::kFiring);
  EXPECT_EQ(qk[0].to, AlertState::kFiring);
  EXPECT_EQ(qk[0].alert.probable_cause, "combined");
  EXPECT_NE(qk[0].alert.suggested_action.find("Lower the learning rate"), std::string::npos);
  // Roll back before the earliest anomaly of the run, not this alert's own.
  EXPECT_NE(qk[0].alert.suggested_action.find("before step 1000"), std::string::npos);
  const auto curvature = driver.Transitions(kCurvatureAboveEdge, "all");
  ASSERT_FALSE(curvature.empty());
  EXPECT_EQ(curvature.back().alert.probable_cause, "combined");
  EXPECT_NE(curvature.back().alert.suggested_action.find("before step 1000"), std::string::npos);
  EXPECT_FALSE(curvature.back().alert.probable_cause_settled);
  // Layer 3 last reported step 1090: the cause settles only once it passes
  // onset + settle_steps (1100) too, and both alerts are re-sent, settled.
  driver.transitions.clear();
  driver.Point("r1", 1100, "qk_increment_entropy", 3, 0.4);
  ASSERT_EQ(driver.transitions.size(), 2u);
  for (const AlertTransition& t : driver.transitions) {
    EXPECT_EQ(t.from, AlertState::kFiring);
    EXPECT_EQ(Annotation(t.alert, "probable_cause_status"), "settled");
    EXPECT_EQ(t.alert.probable_cause, "combined");
  }
}

TEST(AlertEngineTest, EvidenceAfterTheOnsetWindowDoesNotChangeTheCause) {
  EngineDriver driver;
  driver.Fault("r1", "qk_increment_entropy", 3, 1000, 0.8, 0.4);
  // Router collapse 200 steps later: a consequence of a run already failing.
  driver.Fault("r1", "router_entropy", 1, 1200, 0.9, 0.5);
  EXPECT_EQ(driver.engine.RunProbableCause("r1"), ProbableCause::kLowPrecisionAttention);
  for (const Alert& alert : driver.engine.ActiveAlerts()) {
    EXPECT_EQ(alert.probable_cause, "low_precision_attention") << alert.alertname;
  }
}

TEST(AlertEngineTest, RunsAreIndependentAndCanBeForgotten) {
  EngineDriver driver(WithoutHolds());
  driver.Fault("a", "qk_increment_entropy", 0, 1000, 0.8, 0.4);
  driver.Fault("b", "curvature_eos_ratio", kNoLayer, 1000, 0.5, 2.5);
  const auto active = driver.engine.ActiveAlerts();
  ASSERT_EQ(active.size(), 2u);
  EXPECT_EQ(active[0].run, "a");
  EXPECT_EQ(active[0].probable_cause, "low_precision_attention");
  EXPECT_EQ(active[1].run, "b");
  EXPECT_EQ(active[1].probable_cause, "learning_rate_too_high");
  // Forgetting a run (restarted from a checkpoint) closes its open alerts.
  const std::vector<AlertTransition> closed = driver.engine.ForgetRun("a");
  ASSERT_EQ(closed.size(), 1u);
  EXPECT_EQ(closed[0].alert.run, "a");
  EXPECT_EQ(closed[0].from, AlertState::kFiring);
  EXPECT_EQ(closed[0].to, AlertState::kResolved);
  EXPECT_EQ(closed[0].step, 1090);  // the run's latest step
  EXPECT_TRUE(driver.engine.AllAlerts("a").empty());
  EXPECT_TRUE(driver.engine.ForgetRun("a").empty());
  ASSERT_EQ(driver.engine.ActiveAlerts().size(), 1u);
  EXPECT_EQ(driver.engine.ActiveAlerts()[0].run, "b");
}

// A forgotten run (the daemon's idle rule): its open alerts resolve
// (run_idle), its series and their baselines go, its alert records stay
// listed and checkpointed, and a later sample of it learns a new baseline
// before anything is judged.
TEST(AlertEngineTest, ReleasingARunsBaselinesKeepsItsRecordAndLearnsAfresh) {
  EngineDriver driver(WithoutHolds());
  driver.Fault("a", "qk_increment_entropy", 0, 1000, 0.8, 0.4);
  driver.Fault("b", "qk_increment_entropy", 1, 1000, 0.8, 0.4);
  ASSERT_EQ(driver.engine.ActiveAlerts().size(), 2u);
  ASSERT_EQ(driver.engine.BaselineSeries(), 2u);

  const std::vector<AlertTransition> closed = driver.engine.ReleaseBaselines("a");
  ASSERT_EQ(closed.size(), 1u);
  EXPECT_EQ(closed[0].to, AlertState::kResolved);
  EXPECT_EQ(closed[0].alert.resolved_reason, "run_idle");
  EXPECT_EQ(driver.engine.BaselineSeries(), 1u);  // b's is untouched
  ASSERT_EQ(driver.engine.ActiveAlerts().size(), 1u);
  EXPECT_EQ(driver.engine.ActiveAlerts()[0].run, "b");
  const std::vector<Alert> listed = driver.engine.AllAlerts("a");
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].state, AlertState::kResolved);
  EXPECT_EQ(listed[0].resolved_reason, "run_idle");
  EXPECT_EQ(driver.engine.RunProbableCause("a"), ProbableCause::kLowPrecisionAttention);
  EXPECT_TRUE(driver.engine.ReleaseBaselines("a").empty());
  EXPECT_TRUE(driver.engine.ReleaseBaselines("never-seen").empty());

  // The checkpoint keeps the record without the baseline.
  AlertEngine restored(WithoutHolds());
  std::string error;
  ASSERT_TRUE(restored.RestoreState(driver.engine.SaveState(), &error)) << error;
  EXPECT_EQ(restored.BaselineSeries(), 1u);
  ASSERT_EQ(restored.AllAlerts("a").size(), 1u);
  EXPECT_EQ(restored.AllAlerts("a")[0].resolved_reason, "run_idle");

  // The run comes back at the faulty level: that is its new baseline, not a
  // change from the forgotten one.
  driver.Series("a", "qk_increment_entropy", 0, 1200, 30, 0.4);
  EXPECT_EQ(driver.engine.BaselineSeries(), 2u);
  for (const Alert& alert : driver.engine.ActiveAlerts()) EXPECT_NE(alert.run, "a");
}

TEST(AlertEngineTest, DisabledAndUnknownSignalsNeverAlert) {
  AlertConfig config = WithAttentionAlerts();
  config.signals.at("qk_increment_entropy").enabled = false;
  EngineDriver driver(config);
  driver.Fault("r1", "qk_increment_entropy", 0, 1000, 0.8, 0.4);
  driver.Fault("r1", "qk_second_order_ratio", 0, 1000, 0.1, 5.0);  // exported, not alerted on
  EXPECT_TRUE(driver.transitions.empty());
  EXPECT_TRUE(driver.engine.AllAlerts("r1").empty());
}

TEST(AlertEngineTest, NonFiniteValuesInPointsAreDropped) {
  EngineDriver driver;
  driver.Series("r1", "attention_entropy", 0, 0, 100, 2.0);
  for (int i = 0; i < 5; ++i) {
    driver.Point("r1", 1000 + 10 * i, "attention_entropy", 0, std::nan(""));
  }
  EXPECT_TRUE(driver.transitions.empty());
  EXPECT_EQ(driver.engine.counters().points_nonfinite, 5u);
}

}  // namespace
}  // namespace foreshock::alerts

namespace foreshock::alerts {
namespace {

// The trainer's learning rate, one point per step: `base` until `change_step`,
// then `lr(step)` (already multiplied in).
void StreamLearningRate(EngineDriver& driver, std::string_view run, int64_t from, int64_t to,
                        const std::function<double(int64_t)>& lr) {
  for (int64_t step = from; step <= to; ++step) driver.Point(run, step, "lr", kNoLayer, lr(step));
}

double Ramp(int64_t step) {  // 1e-3, then geometric to 20x over steps 900..1100
  return step < 900 ? 1e-3 : 1e-3 * std::pow(20.0, std::min<double>(step - 900, 200) / 200.0);
}

// The attention output's rounding bias (attention_output_bias, in unit
// roundoffs): an absolute bound, 2 of 3 probes, no warm-up.
TEST(AlertEngineTest, ARoundingBiasFiresOnItsBoundAndIsAPrecisionFault) {
  EngineDriver driver(DefaultAlertConfig());
  // Round-to-nearest noise, and one odd probe above the bound: silent.
  driver.Point("r1", 0, "attention_output_bias", 2, 0.02);
  driver.Point("r1", 10, "attention_output_bias", 2, 0.4);
  driver.Point("r1", 20, "attention_output_bias", 2, 0.03);
  driver.Point("r1", 30, "attention_output_bias", 2, 0.01);
  auto fired_any = [&] {
    return std::any_of(driver.transitions.begin(), driver.transitions.end(),
                       [](const AlertTransition& t) { return t.to == AlertState::kFiring; });
  };
  EXPECT_FALSE(fired_any());  // pending at most
  // Truncation: fires on the second probe above the bound.
  driver.Point("r1", 40, "attention_output_bias", 2, 0.9);
  EXPECT_FALSE(fired_any());
  driver.Point("r1", 50, "attention_output_bias", 2, 0.8);
  const auto fired = driver.StateChanges(kAttentionRoundingBias, "2");
  ASSERT_FALSE(fired.empty());
  EXPECT_EQ(fired.back().to, AlertState::kFiring);
  EXPECT_EQ(fired.back().alert.probable_cause, "low_precision_attention");
  EXPECT_EQ(Annotation(fired.back().alert, "summary"),
            "Biased rounding in the attention kernel (output off its fp32 reference) in layer 2 "
            "of run r1");
  EXPECT_NE(fired.back().alert.probable_cause_evidence.find("attention rounding bias from step 40"),
            std::string::npos)
      << fired.back().alert.probable_cause_evidence;
}

// A precision fault seen first, then the learning rate surging long after the
// cause settled (a ramp that passes its bound late): combined.
TEST(AlertEngineTest, ALearningRateSurgeAfterASettledPrecisionCauseMakesItCombined) {
  EngineDriver driver(DefaultAlertConfig());
  for (int64_t step = 0; step < 1000; step += 10) driver.Point("r1", step, "attention_output_bias", 2, 0.01);
  for (int64_t step = 0; step < 1000; step += 10) driver.Point("r1", step, "lr_over_held_max", kNoLayer, 1.0);
  for (int64_t step = 1000; step < 1300; step += 10) {
    driver.Point("r1", step, "attention_output_bias", 2, 20.0);
    driver.Point("r1", step, "lr_over_held_max", kNoLayer, step < 1250 ? 1.0 + (step - 1000) / 200.0 : 3.5);
    if (step == 1200) {
      ASSERT_EQ(driver.engine.ActiveAlerts().size(), 1u);
      const Alert settled = driver.engine.ActiveAlerts()[0];
      EXPECT_EQ(settled.probable_cause, "low_precision_attention");
      EXPECT_EQ(Annotation(settled, "probable_cause_status"), "settled");
    }
  }
  const std::vector<Alert> active = driver.engine.ActiveAlerts();
  ASSERT_EQ(active.size(), 2u);
  for (const Alert& alert : active) {
    EXPECT_EQ(alert.probable_cause, "combined") << alert.alertname;
    EXPECT_EQ(Annotation(alert, "probable_cause_status"), "settled") << alert.alertname;
    EXPECT_NE(alert.probable_cause_evidence.find("then learning rate surge from step 1250"),
              std::string::npos)
        << alert.probable_cause_evidence;
    EXPECT_NE(alert.suggested_action.find("Lower the learning rate"), std::string::npos);
    EXPECT_NE(alert.suggested_action.find("before step 1000"), std::string::npos);
  }
  // The rounding-bias alert was re-sent with the new cause.
  const auto bias = driver.Transitions(kAttentionRoundingBias, "2");
  ASSERT_FALSE(bias.empty());
  EXPECT_EQ(bias.back().alert.probable_cause, "combined");
}

// The other order: a learning-rate surge, then the rounding bias measured
// after that cause settled.
TEST(AlertEngineTest, ARoundingBiasAfterASettledLearningRateCauseMakesItCombined) {
  EngineDriver driver(DefaultAlertConfig());
  for (int64_t step = 900; step < 1400; step += 10) {
    driver.Point("r1", step, "lr_over_held_max", kNoLayer, step < 1000 ? 1.0 : 4.0);
    driver.Point("r1", step, "attention_output_bias", 2, step < 1300 ? 0.01 : 3.0);
    if (step == 1250) {
      EXPECT_EQ(driver.engine.RunProbableCause("r1"), ProbableCause::kLearningRateTooHigh);
    }
  }
  EXPECT_EQ(driver.engine.RunProbableCause("r1"), ProbableCause::kCombined);
  for (const Alert& alert : driver.engine.ActiveAlerts()) {
    EXPECT_EQ(alert.probable_cause, "combined") << alert.alertname;
    EXPECT_NE(alert.probable_cause_evidence.find("then attention rounding bias from step 1300"),
              std::string::npos)
        << alert.probable_cause_evidence;
  }
}

// Checkpoints written before the router-logit family (8 families), before the
// rounding-bias family too (7), and before the learning-rate family as well
// (6), still restore: the missing families read as never fired.
TEST(AlertEngineTest, RestoresCheckpointsSavedWithFewerAlertFamilies) {
  EngineDriver driver(DefaultAlertConfig());
  driver.Fault("rold", "qk_increment_entropy", 3, 1000, 0.8, 0.4);
  ASSERT_EQ(driver.engine.RunProbableCause("rold"), ProbableCause::kLowPrecisionAttention);
  const std::string state = driver.engine.SaveState();
  // After the run's name: I64 latest_step, U32 family count, then the onsets
  // and the fired steps, an I64 per family each.
  const std::string name = std::string("\x04\0\0\0\0\0\0\0", 8) + "rold";
  const size_t at = state.find(name);
  ASSERT_NE(at, std::string::npos);
  const size_t count_at = at + name.size() + 8;
  uint32_t families = 0;
  std::memcpy(&families, state.data() + count_at, 4);
  ASSERT_EQ(families, 9u);
  // Drops families `dropped` (indices, ascending) from both arrays.
  auto older = [&](std::vector<size_t> dropped) {
    const size_t arrays_at = count_at + 4;
    std::string out = state.substr(0, count_at);
    const uint32_t fewer = families - static_cast<uint32_t>(dropped.size());
    out.append(reinterpret_cast<const char*>(&fewer), 4);
    for (size_t array = 0; array < 2; ++array) {
      for (size_t f = 0; f < families; ++f) {
        if (std::find(dropped.begin(), dropped.end(), f) != dropped.end()) continue;
        out.append(state, arrays_at + (array * families + f) * 8, 8);
      }
    }
    out.append(state, arrays_at + 2 * families * 8, std::string::npos);
    return out;
  };
  const size_t learning_rate = static_cast<size_t>(AlertFamily::kLearningRate);
  const size_t rounding_bias = static_cast<size_t>(AlertFamily::kRoundingBias);
  const size_t router_logits = static_cast<size_t>(AlertFamily::kRouterLogitGrowth);
  for (const std::vector<size_t>& dropped :
       {std::vector<size_t>{router_logits}, std::vector<size_t>{rounding_bias, router_logits},
        std::vector<size_t>{learning_rate, rounding_bias, router_logits}}) {
    AlertEngine restored(DefaultAlertConfig());
    std::string error;
    ASSERT_TRUE(restored.RestoreState(older(dropped), &error)) << error;
    EXPECT_EQ(restored.SaveState(), state) << dropped.size() << " families dropped";
  }
  // One more family than this engine knows: refused, not misread.
  AlertEngine restored(DefaultAlertConfig());
  std::string bigger = state;
  const uint32_t more = families + 1;
  std::memcpy(bigger.data() + count_at, &more, 4);
  std::string error;
  EXPECT_FALSE(restored.RestoreState(bigger, &error));
  EXPECT_NE(error.find("alert family count"), std::string::npos) << error;
}

TEST(AlertEngineTest, ARisingLearningRateMakesLogitGrowthALearningRateCause) {
  EngineDriver driver;
  StreamLearningRate(driver, "r1", 0, 1099, Ramp);
  driver.Fault("r1", "attention_max_logit", 1, 1000, 10, 20);
  ASSERT_EQ(driver.engine.ActiveAlerts().size(), 1u);
  const Alert provisional = driver.engine.ActiveAlerts()[0];
  EXPECT_EQ(provisional.probable_cause, "learning_rate_too_high");
  EXPECT_EQ(Annotation(provisional, "probable_cause_status"), "provisional");
  // The first step at 3x the baseline: Ramp(974) / 1e-3 = 20^(74/200) = 3.03,
  // before the logits moved.
  EXPECT_NE(provisional.probable_cause_evidence.find("learning rate up 3.03x (0.001 -> 0.00303) at step 974"), std::string::npos)
      << provisional.probable_cause_evidence;
  EXPECT_NE(provisional.probable_cause_evidence.find("attention logit growth from step 1000"),
            std::string::npos)
      << provisional.probable_cause_evidence;
}

// A fault near the end of a long warm-up: the lagged window [onset - 1000,
// onset - 100) holds the warm-up's climb, a quarter of the peak at its median
// and half at its highest; the warm-up then reaches 4x that median but only
// 2x that highest value, and never goes above its peak: no LR rise.
TEST(AlertEngineTest, AWarmUpReachingItsPeakIsNoLearningRateRise) {
  EngineDriver driver;
  // Linear warm-up to 1e-3 over 1000 steps, then flat; logits grow from 950.
  StreamLearningRate(driver, "r1", 0, 1099, [](int64_t step) {
    return 1e-3 * std::min<double>(1.0, (step + 1) / 1000.0);
  });
  driver.Fault("r1", "attention_max_logit", 1, 950, 10, 20, 10, 20);
  driver.Point("r1", 1050, "attention_max_logit", 1, 20);  // layer 1 reaches onset + 100
  ASSERT_FALSE(driver.engine.ActiveAlerts().empty());
  EXPECT_EQ(driver.engine.RunProbableCause("r1"), ProbableCause::kLowPrecisionAttention)
      << driver.engine.ActiveAlerts()[0].probable_cause_evidence;
  EXPECT_EQ(driver.engine.ActiveAlerts()[0].probable_cause_evidence.find("learning rate up"),
            std::string::npos)
      << driver.engine.ActiveAlerts()[0].probable_cause_evidence;
}

TEST(AlertEngineTest, LogitGrowthBeforeTheLRRiseIsAPrecisionFaultToo) {
  EngineDriver driver;
  // The logits grow from step 900, before the LR passes 3x at 974.
  StreamLearningRate(driver, "r1", 0, 1099, Ramp);
  driver.Fault("r1", "attention_max_logit", 1, 900, 10, 20);
  driver.Point("r1", 1000, "attention_max_logit", 1, 20);  // layer 1 reaches onset + 100 too
  EXPECT_EQ(driver.engine.RunProbableCause("r1"), ProbableCause::kCombined);
  EXPECT_EQ(driver.engine.ActiveAlerts().at(0).probable_cause, "combined");
  EXPECT_TRUE(driver.engine.ActiveAlerts().at(0).probable_cause_settled);
}

TEST(AlertEngineTest, ADecayingLearningRateIsNoEvidence) {
  EngineDriver driver;
  StreamLearningRate(driver, "r1", 0, 1200, [](int64_t s) { return s < 900 ? 1e-3 : 3e-4; });
  driver.Fault("r1", "attention_max_logit", 1, 1000, 10, 20);
  ASSERT_EQ(driver.engine.ActiveAlerts().size(), 1u);
  EXPECT_EQ(driver.engine.ActiveAlerts()[0].probable_cause, "low_precision_attention");
}

TEST(AlertEngineTest, AnLRRiseBeforeTheBaselineWindowIsNoEvidence) {
  // A warm-up that ended long before the onset: the baseline is the peak LR.
  EngineDriver driver;
  StreamLearningRate(driver, "r1", 0, 1200,
                     [](int64_t s) { return 1e-3 * std::min<double>(1.0, (s + 1) / 100.0); });
  driver.Fault("r1", "attention_max_logit", 1, 1000, 10, 20);
  EXPECT_EQ(driver.engine.ActiveAlerts().at(0).probable_cause, "low_precision_attention");
}

TEST(AlertEngineTest, AttentionChangesDoNotAlertByDefault) {
  // Healthy training moves attention logits and entropy a lot (the evaluation
  // corpus): by default neither alerts on a change, the logit only above 100.
  EngineDriver driver{DefaultAlertConfig()};
  driver.Fault("r1", "attention_max_logit", 0, 1000, 10, 40);
  driver.Fault("r1", "attention_entropy", 0, 1000, 2.0, 0.5);
  EXPECT_TRUE(driver.transitions.empty());
  driver.Series("r1", "attention_max_logit", 0, 1100, 3, 150.0);
  ASSERT_FALSE(driver.transitions.empty());
  EXPECT_EQ(driver.transitions.back().alert.alertname, kAttentionLogitGrowth);
  EXPECT_EQ(driver.transitions.back().to, AlertState::kFiring);
}

TEST(AlertEngineTest, FP32AttentionRulesOutAPrecisionFault) {
  struct Case {
    const char* name;
    std::vector<double> bits;  // attention_compute_bits of layers 0, 1, ...
    const char* cause;
  };
  const std::vector<Case> cases = {
      {"not reported", {}, "low_precision_attention"},
      {"bf16", {16, 16}, "low_precision_attention"},
      {"fp32 in one layer, bf16 in another", {32, 16}, "low_precision_attention"},
      {"fp32, with the curvature surging too", {32, 32}, "learning_rate_too_high"},
  };
  for (const Case& c : cases) {
    EngineDriver driver;
    for (size_t layer = 0; layer < c.bits.size(); ++layer) {
      driver.Point("r1", 0, kAttentionComputeBitsSignal, static_cast<int>(layer), c.bits[layer],
                   kAllHeads, false);
    }
    // (fp32: the QK alert alone would wait for another kind of alert.)
    if (c.bits == std::vector<double>{32, 32}) {
      driver.Fault("r1", "curvature_eos_ratio", kNoLayer, 1000, 0.5, 2.5);
    }
    driver.Fault("r1", "qk_increment_entropy", 0, 1000, 0.8, 0.4);
    EXPECT_EQ(ProbableCauseName(driver.engine.RunProbableCause("r1")), c.cause) << c.name;
    std::optional<Alert> qk;
    for (const Alert& alert : driver.engine.ActiveAlerts()) {
      if (alert.alertname == kQKIncrementCollapse) qk = alert;
    }
    ASSERT_TRUE(qk) << c.name;
    const Alert alert = *qk;
    EXPECT_EQ(alert.state, AlertState::kFiring) << c.name;
    EXPECT_EQ(alert.probable_cause, c.cause) << c.name;
    EXPECT_EQ(alert.probable_cause_evidence.find("fp32") != std::string::npos,
              std::string(c.cause) == "learning_rate_too_high")
        << c.name << ": " << alert.probable_cause_evidence;
  }
}

// fp32 attention has no precision mechanism: a QK-spectrum or attention-logit
// change alone is heads specializing (a copy task, induction heads). It waits,
// pending, for another kind of alert; none within the onset window, and the
// series takes the new level in.
TEST(AlertEngineTest, FP32AttentionAlertsWaitForAnotherKind) {
  EngineDriver driver;
  for (int layer : {0, 1}) {
    driver.Point("r1", 0, kAttentionComputeBitsSignal, layer, 32, kAllHeads, false);
  }
  driver.Series("r1", "qk_increment_entropy", 0, 400, 60, 0.8);
  driver.Series("r1", "qk_increment_entropy", 0, 1000, 4, 0.4);  // confirmed at 1020: held
  ASSERT_EQ(driver.engine.ActiveAlerts().size(), 1u);
  EXPECT_EQ(driver.engine.ActiveAlerts()[0].state, AlertState::kPending);
  EXPECT_NE(driver.engine.ActiveAlerts()[0].description.find("fp32"), std::string::npos);
  EXPECT_EQ(driver.Transitions(kQKIncrementCollapse, "0").size(), 1u);  // -> pending only

  // The curvature surges from 1010 and fires at 1030: the QK alert fires with
  // it, its onset kept, and both are the learning rate's doing.
  driver.Fault("r1", "curvature_eos_ratio", kNoLayer, 1010, 0.5, 2.5);
  const auto qk = driver.StateChanges(kQKIncrementCollapse, "0");
  ASSERT_EQ(qk.size(), 2u);
  EXPECT_EQ(qk[1].to, AlertState::kFiring);
  EXPECT_EQ(qk[1].step, 1030);
  EXPECT_EQ(qk[1].alert.first_step, 1000);
  EXPECT_EQ(driver.engine.RunProbableCause("r1"), ProbableCause::kLearningRateTooHigh);
  // Once fired it stays firing while its series is anomalous, also after the
  // curvature resolved.
  driver.Series("r1", "curvature_eos_ratio", kNoLayer, 1110, 40, 0.5);
  driver.Series("r1", "qk_increment_top1_share", 0, 400, 60, 0.1);
  driver.Series("r1", "qk_increment_top1_share", 0, 1040, 6, 0.6);  // a second series of it
  driver.Series("r1", "qk_increment_entropy", 0, 1040, 20, 0.4);
  for (const Alert& alert : driver.engine.ActiveAlerts()) {
    EXPECT_NE(alert.alertname, kCurvatureAboveEdge);
  }
  const auto still = driver.StateChanges(kQKIncrementCollapse, "0");
  EXPECT_EQ(still.back().to, AlertState::kFiring);

  // Another run: the collapse alone, held past the onset window (50 steps)
  // with nothing else: absorbed, never fired.
  driver.Point("r2", 0, kAttentionComputeBitsSignal, 0, 32, kAllHeads, false);
  driver.Series("r2", "qk_increment_entropy", 0, 400, 60, 0.8);
  driver.Series("r2", "qk_increment_entropy", 0, 1000, 60, 0.4);
  for (const AlertTransition& t : driver.transitions) {
    if (t.alert.run == "r2") {
      EXPECT_NE(t.to, AlertState::kFiring) << t.step;
    }
  }
  for (const Alert& alert : driver.engine.ActiveAlerts()) EXPECT_NE(alert.run, "r2");
  // Switched off, it fires alone as before.
  AlertConfig config = WithAttentionAlerts();
  config.probable_cause.fp32_attention_needs_corroboration = false;
  EngineDriver alone(config);
  alone.Point("r1", 0, kAttentionComputeBitsSignal, 0, 32, kAllHeads, false);
  alone.Fault("r1", "qk_increment_entropy", 0, 1000, 0.8, 0.4);
  ASSERT_EQ(alone.engine.ActiveAlerts().size(), 1u);
  EXPECT_EQ(alone.engine.ActiveAlerts()[0].state, AlertState::kFiring);
}

TEST(AlertEngineTest, ANewIncidentAfterEveryAlertResolvedIsDiagnosedAfresh) {
  EngineDriver driver;
  // A false alarm: the attention entropy dips, the alert fires with the cause
  // low_precision_attention, which settles; then the entropy recovers.
  driver.Fault("r1", "attention_entropy", 2, 1000, 2.0, 1.0);
  driver.Series("r1", "attention_entropy", 2, 1100, 30, 2.0);
  ASSERT_EQ(driver.engine.RunProbableCause("r1"), ProbableCause::kLowPrecisionAttention);
  const auto attention = driver.StateChanges(kAttentionEntropyCollapse, "2");
  ASSERT_FALSE(attention.empty());
  ASSERT_EQ(attention.back().to, AlertState::kResolved);
  EXPECT_EQ(attention.back().alert.probable_cause, "low_precision_attention");

  // Much later the loss spikes with no mechanism alert active: the old
  // diagnosis does not explain it.
  driver.transitions.clear();
  driver.Fault("r1", "loss", kNoLayer, 3000, 2.0, 4.0, 1, 150);
  const auto loss = driver.StateChanges(kLossSpike, "all");
  ASSERT_FALSE(loss.empty());
  EXPECT_EQ(loss.back().to, AlertState::kFiring);
  EXPECT_EQ(loss.back().alert.probable_cause, "unknown");
  EXPECT_EQ(loss.back().alert.probable_cause_evidence, "");

  // The curvature surges next: a learning-rate incident of its own, not
  // "combined" with the attention false alarm long gone.
  driver.Fault("r1", "curvature_eos_ratio", kNoLayer, 3020, 0.5, 2.5);
  EXPECT_EQ(driver.engine.RunProbableCause("r1"), ProbableCause::kLearningRateTooHigh);
  const auto curvature = driver.Transitions(kCurvatureAboveEdge, "all");
  ASSERT_FALSE(curvature.empty());
  EXPECT_EQ(curvature.back().alert.probable_cause, "learning_rate_too_high");
  EXPECT_EQ(curvature.back().alert.probable_cause_evidence.find("attention"), std::string::npos)
      << curvature.back().alert.probable_cause_evidence;
  EXPECT_NE(curvature.back().alert.suggested_action.find("before step 3020"), std::string::npos)
      << curvature.back().alert.suggested_action;
}

TEST(AlertEngineTest, TheCauseIsProvisionalUntilItSettles) {
  AlertConfig config = WithAttentionAlerts();
  config.probable_cause.settle_steps = 240;  // past the last point Fault() feeds
  EngineDriver driver(config);
  StreamLearningRate(driver, "r1", 0, 1040, Ramp);
  // Fires at 1020, after the LR reached 3x (step 974): the update size.
  driver.Fault("r1", "attention_max_logit", 1, 1000, 10, 20);
  EXPECT_EQ(driver.engine.RunProbableCause("r1"), ProbableCause::kLearningRateTooHigh);
  // Layer 0 (another worker, behind) shows that the QK spectrum had collapsed
  // from step 960, before the LR rose: precision is at fault as well. The
  // onset moves to 960.
  driver.Fault("r1", "qk_increment_entropy", 0, 960, 0.8, 0.4);
  EXPECT_EQ(driver.engine.RunProbableCause("r1"), ProbableCause::kCombined);
  for (const Alert& alert : driver.engine.ActiveAlerts()) {
    EXPECT_EQ(alert.probable_cause, "combined") << alert.alertname;
    EXPECT_FALSE(alert.probable_cause_settled) << alert.alertname;
  }
  driver.transitions.clear();
  StreamLearningRate(driver, "r1", 1041, 1200, Ramp);  // step 1200 = onset + settle_steps
  // Not settled yet: layers 0 and 1 (processed by other workers) are behind.
  EXPECT_TRUE(driver.transitions.empty());
  for (int64_t step = 1100; step <= 1200; step += 10) {
    driver.Point("r1", step, "attention_max_logit", 1, 20);
  }
  EXPECT_TRUE(driver.transitions.empty());
  for (int64_t step = 1100; step <= 1200; step += 10) {
    driver.Point("r1", step, "qk_increment_entropy", 0, 0.4);
  }
  // Both firing alerts are re-sent once, settled, at the step that settled them.
  ASSERT_EQ(driver.transitions.size(), 2u);
  for (const AlertTransition& t : driver.transitions) {
    EXPECT_EQ(t.from, AlertState::kFiring);
    EXPECT_EQ(t.to, AlertState::kFiring);
    EXPECT_EQ(t.step, 1200);
    EXPECT_EQ(t.alert.probable_cause, "combined");
    EXPECT_EQ(Annotation(t.alert, "probable_cause_status"), "settled");
  }
  // Settled means final: a router collapse with an onset inside the window
  // that confirms only now changes nothing.
  driver.Fault("r1", "router_entropy", 2, 1040, 0.9, 0.5);
  EXPECT_EQ(driver.engine.RunProbableCause("r1"), ProbableCause::kCombined);
}

// Issue 33: attention max logits past their bound in an fp32 run are the
// update size's mark, not heads specializing: the alert fires on its own,
// without waiting for another kind, and names the learning rate. (Before, it
// was held: a Hugging Face run's max logit of 2,454 stayed pending for 300
// steps while the run diverged.)
TEST(AlertEngineTest, LogitGrowthInAnFp32RunFiresWithTheLearningRateNamed) {
  EngineDriver driver(DefaultAlertConfig());
  driver.Point("r1", 0, "attention_compute_bits", 0, 32);
  for (int64_t i = 0; i < 20; ++i) driver.Point("r1", 400 + 10 * i, "attention_max_logit", 0, 40);
  for (int64_t i = 20; i < 26; ++i) driver.Point("r1", 400 + 10 * i, "attention_max_logit", 0, 150);
  const auto logit = driver.StateChanges(kAttentionLogitGrowth, "0");
  ASSERT_FALSE(logit.empty());
  EXPECT_EQ(logit.back().to, AlertState::kFiring);
  EXPECT_EQ(logit.back().alert.description.find("Held: "), std::string::npos)
      << logit.back().alert.description;
  EXPECT_EQ(logit.back().alert.probable_cause, "learning_rate_too_high");
  EXPECT_NE(logit.back().alert.probable_cause_evidence.find("fp32"), std::string::npos)
      << logit.back().alert.probable_cause_evidence;
  EXPECT_EQ(driver.engine.RunProbableCause("r1"), ProbableCause::kLearningRateTooHigh);
}

// Issue 33: in bf16 attention whose output the client measured against fp32
// and found unbiased (the output check), logit growth is the update size's
// mark as in fp32, and names the learning rate; without the output check it
// names precision; a bias measured later, after the cause settled, turns it
// into a precision fault (the LR rested on the output looking clean).
TEST(AlertEngineTest, LogitGrowthInBf16WithAnUnbiasedOutputNamesTheLearningRate) {
  struct Case {
    const char* name;
    bool output_checks;
    bool config_on;
    const char* cause;
  };
  for (const Case& c : {Case{"bf16, output measured unbiased", true, true, "learning_rate_too_high"},
                        Case{"bf16, no output check", false, true, "low_precision_attention"},
                        Case{"bf16, rule off", true, false, "low_precision_attention"}}) {
    AlertConfig config = DefaultAlertConfig();
    config.probable_cause.unbiased_output_rules_out_precision = c.config_on;
    EngineDriver driver(config);
    for (int layer : {0, 1}) driver.Point("r1", 0, "attention_compute_bits", layer, 16);
    for (int64_t i = 0; i < 26; ++i) {
      const int64_t step = 400 + 10 * i;
      if (c.output_checks) {
        for (int layer : {0, 1}) driver.Point("r1", step, "attention_output_bias", layer, 0.02);
      }
      driver.Point("r1", step, "attention_max_logit", 0, i < 20 ? 40 : 150);
    }
    const auto logit = driver.StateChanges(kAttentionLogitGrowth, "0");
    ASSERT_FALSE(logit.empty()) << c.name;
    EXPECT_EQ(logit.back().to, AlertState::kFiring) << c.name;
    EXPECT_EQ(logit.back().alert.probable_cause, c.cause)
        << c.name << ": " << logit.back().alert.probable_cause_evidence;
    EXPECT_EQ(logit.back().alert.probable_cause_evidence.find("measured unbiased") !=
                  std::string::npos,
              std::string(c.cause) == "learning_rate_too_high")
        << c.name << ": " << logit.back().alert.probable_cause_evidence;
  }

  // A kernel that showed a bias once stays suspect: a bias at 400-420 that
  // cleared, then logit growth from 600, is not the learning rate's.
  {
    EngineDriver driver(DefaultAlertConfig());
    for (int layer : {0, 1}) driver.Point("r1", 0, "attention_compute_bits", layer, 16);
    for (int64_t i = 0; i < 26; ++i) {
      const int64_t step = 400 + 10 * i;
      for (int layer : {0, 1}) {
        driver.Point("r1", step, "attention_output_bias", layer, step <= 420 ? 0.6 : 0.02);
      }
      driver.Point("r1", step, "attention_max_logit", 0, i < 20 ? 40 : 150);
    }
    ASSERT_FALSE(driver.StateChanges(kAttentionRoundingBias, "0").empty());
    const auto logit = driver.StateChanges(kAttentionLogitGrowth, "0");
    ASSERT_FALSE(logit.empty());
    EXPECT_EQ(logit.back().alert.probable_cause, "low_precision_attention")
        << logit.back().alert.probable_cause_evidence;
  }

  // A bias measured after the cause settled (onset 600, settled at 700).
  EngineDriver driver(DefaultAlertConfig());
  for (int layer : {0, 1}) driver.Point("r1", 0, "attention_compute_bits", layer, 16);
  for (int64_t i = 0; i < 50; ++i) {
    const int64_t step = 400 + 10 * i;
    for (int layer : {0, 1}) {
      driver.Point("r1", step, "attention_output_bias", layer, step < 750 ? 0.02 : 0.6);
    }
    // Still growing (1.6x per 100 steps): a head that holds past the bound
    // would resolve (bound_growth).
    driver.Point("r1", step, "attention_max_logit", 0, i < 20 ? 40 : 150 * std::pow(1.05, i - 20));
    if (step == 720) {
      ASSERT_EQ(driver.engine.RunProbableCause("r1"), ProbableCause::kLearningRateTooHigh);
    }
  }
  EXPECT_EQ(driver.engine.RunProbableCause("r1"), ProbableCause::kLowPrecisionAttention);
  // The firing alert was re-sent (firing -> firing) with the new cause.
  const auto sent = driver.Transitions(kAttentionLogitGrowth, "0");
  ASSERT_FALSE(sent.empty());
  EXPECT_EQ(sent.back().to, AlertState::kFiring);
  EXPECT_EQ(sent.back().alert.probable_cause, "low_precision_attention")
      << sent.back().alert.probable_cause_evidence;
}

// The hold still applies to the QK spectrum in fp32: a collapse alone stays
// pending, and a diverging loss (another sign of trouble) releases it.
TEST(AlertEngineTest, LossDivergingReleasesAHeldAttentionAlert) {
  EngineDriver driver(DefaultAlertConfig());
  driver.Point("r1", 0, "attention_compute_bits", 0, 32);
  driver.Series("r1", "qk_increment_entropy", 0, 400, 60, 0.8);
  driver.Series("r1", "qk_increment_entropy", 0, 1000, 4, 0.4);
  ASSERT_FALSE(driver.StateChanges(kQKIncrementCollapse, "0").empty());
  ASSERT_EQ(driver.StateChanges(kQKIncrementCollapse, "0").back().to, AlertState::kPending);
  driver.Point("r1", 1035, "loss_over_running_min", kNoLayer, 1.5);
  const auto qk = driver.StateChanges(kQKIncrementCollapse, "0");
  ASSERT_FALSE(qk.empty());
  ASSERT_EQ(qk.back().to, AlertState::kFiring);
  EXPECT_EQ(qk.back().step, 1035);
}

// The last line (issue 26): the evaluation's divergence rule as an alert that
// fires on the first diverged sample, stays firing while the run stays
// diverged, and resolves only once it has recovered for 20 samples.
TEST(AlertEngineTest, LossDivergingFiresAtOnceAndStaysFiringUntilTheRunRecovers) {
  EngineDriver driver(DefaultAlertConfig());
  for (int64_t step = 100; step < 150; ++step) {
    driver.Point("r1", step, "loss_over_running_min", kNoLayer, 1.0 + 0.001 * (step % 7));
  }
  EXPECT_TRUE(driver.transitions.empty());
  driver.Point("r1", 150, "loss_over_running_min", kNoLayer, 1.31);
  auto t = driver.StateChanges(kLossDiverging, "all");
  ASSERT_EQ(t.size(), 1u);
  EXPECT_EQ(t[0].to, AlertState::kFiring);
  EXPECT_EQ(t[0].step, 150);
  EXPECT_EQ(t[0].alert.severity, "critical");
  EXPECT_EQ(t[0].alert.signal, "loss_over_running_min");
  // 170 diverged steps, however it moves above the bound: still firing.
  for (int64_t step = 151; step < 320; ++step) {
    driver.Point("r1", step, "loss_over_running_min", kNoLayer, 1.4 + (step % 3));
  }
  ASSERT_EQ(driver.StateChanges(kLossDiverging, "all").size(), 1u);
  // Recovered: 19 samples back under the bound are not enough, 20 are.
  for (int64_t step = 320; step < 339; ++step) {
    driver.Point("r1", step, "loss_over_running_min", kNoLayer, 1.1);
  }
  ASSERT_EQ(driver.StateChanges(kLossDiverging, "all").size(), 1u);
  driver.Point("r1", 339, "loss_over_running_min", kNoLayer, 1.1);
  t = driver.StateChanges(kLossDiverging, "all");
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t[1].to, AlertState::kResolved);
  // A consequence, not evidence: it names no cause by itself.
  EXPECT_EQ(t[0].alert.probable_cause, "unknown");
}

}  // namespace
}  // namespace foreshock::alerts
