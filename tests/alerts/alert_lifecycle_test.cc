// Run lifecycle in the alert engine (docs/DESIGN.md §5.3): CloseEpisodes
// when a run ends or restarts, RewindRun when it resumed from a checkpoint,
// and the change detector's ResetEpisode / Rewind under them.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "alerts/alert_engine.h"
#include "alerts/change_detector.h"

namespace foreshock::alerts {
namespace {

using detectors::kAllHeads;
using detectors::kNoLayer;

std::vector<double> Noisy(int n, double level, uint64_t seed, double sigma = 0.01) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> noise(0.0, sigma);
  std::vector<double> values(n);
  for (double& v : values) v = level * (1 + noise(rng));
  return values;
}

ChangeDetectorOptions DropOptions() {
  ChangeDetectorOptions o;
  o.direction = Direction::kDrop;
  return o;
}

TEST(ChangeDetectorLifecycleTest, RewindScoresTheReplayedStepsAgainstTheSharedPast) {
  const std::vector<double> healthy = Noisy(200, 1.0, 7);
  ChangeDetector resumed(DropOptions()), control(DropOptions());
  for (int i = 0; i < 100; ++i) {
    resumed.Update(10 * i, healthy[i]);
    control.Update(10 * i, healthy[i]);
  }
  // The abandoned attempt collapsed from step 1000.
  for (int i = 100; i < 110; ++i) resumed.Update(10 * i, 0.5);
  ASSERT_EQ(resumed.state(), SeriesState::kAnomalous);

  resumed.Rewind(1000);
  EXPECT_EQ(resumed.state(), SeriesState::kNormal);
  // The resumed attempt replays steps 1000.. healthy: scored, never stale,
  // never anomalous, against (nearly) the baseline the shared past gives.
  for (int i = 100; i < 200; ++i) {
    const ChangeAssessment a = resumed.Update(10 * i, healthy[i]);
    const ChangeAssessment b = control.Update(10 * i, healthy[i]);
    ASSERT_EQ(a.disposition, ChangeAssessment::Disposition::kScored) << i;
    EXPECT_FALSE(a.anomalous()) << i;
    EXPECT_FALSE(b.anomalous()) << i;
    // The collapse's first (pending) samples pushed two of the oldest values
    // out of the history; the rest is the same.
    EXPECT_NEAR(a.baseline, b.baseline, 0.01) << i;
  }
  // Steps before the rewind were shared: still stale (or a duplicate at 990).
  EXPECT_EQ(resumed.Update(500, 1.0).disposition, ChangeAssessment::Disposition::kStale);
}

TEST(ChangeDetectorLifecycleTest, RewindBeforeAnySampleOfTheReplayedStepsOnlyResetsTheEpisode) {
  ChangeDetector d(DropOptions());
  const std::vector<double> healthy = Noisy(60, 1.0, 3);
  for (int i = 0; i < 60; ++i) d.Update(i, healthy[i]);
  for (int i = 60; i < 66; ++i) d.Update(i, 0.5);
  ASSERT_EQ(d.state(), SeriesState::kAnomalous);
  d.Rewind(100);  // nothing at or after step 100 was seen: the run just goes on
  EXPECT_EQ(d.state(), SeriesState::kNormal);
  EXPECT_EQ(d.Update(64, 0.5).disposition, ChangeAssessment::Disposition::kStale);
  EXPECT_EQ(d.Update(100, 0.5).disposition, ChangeAssessment::Disposition::kScored);
}

TEST(ChangeDetectorLifecycleTest, ResetEpisodeKeepsTheBaselineAndDetectsAgain) {
  ChangeDetector d(DropOptions());
  const std::vector<double> healthy = Noisy(60, 1.0, 5);
  for (int i = 0; i < 60; ++i) d.Update(i, healthy[i]);
  ChangeAssessment last;
  for (int i = 60; i < 66; ++i) last = d.Update(i, 0.5);
  ASSERT_EQ(d.state(), SeriesState::kAnomalous);
  const double baseline = last.baseline;

  d.ResetEpisode();
  EXPECT_EQ(d.state(), SeriesState::kNormal);
  EXPECT_EQ(d.last().state, SeriesState::kNormal);
  // A worse value for the latest step does not bring the old episode back.
  EXPECT_EQ(d.Update(65, 0.4).state, SeriesState::kPending);
  const ChangeAssessment next = d.Update(66, 0.5);
  EXPECT_EQ(next.baseline, baseline);  // frozen during the episode, kept across the reset
  EXPECT_TRUE(next.anomalous());
  d.Update(67, 0.5);
  EXPECT_EQ(d.state(), SeriesState::kAnomalous);  // 3 of 5 again: a new episode
}

TEST(ChangeDetectorLifecycleTest, CheckpointKeepsTheStepsARewindNeeds) {
  ChangeDetector original(DropOptions());
  const std::vector<double> values = Noisy(120, 1.0, 11);
  for (int i = 0; i < 80; ++i) original.Update(i, values[i]);
  codec::StateWriter writer;
  original.SaveState(writer);
  ChangeDetector restored(DropOptions());
  codec::StateReader reader(writer.data());
  ASSERT_TRUE(restored.RestoreState(reader)) << reader.error();
  original.Rewind(70);
  restored.Rewind(70);
  for (int i = 70; i < 120; ++i) {
    const ChangeAssessment a = original.Update(i, values[i]);
    const ChangeAssessment b = restored.Update(i, values[i]);
    EXPECT_EQ(a.disposition, b.disposition);
    EXPECT_EQ(a.baseline, b.baseline);  // bit-exact
    EXPECT_EQ(a.z, b.z);
  }
}

// -- the engine -------------------------------------------------------------

class Driver {
 public:
  void Point(std::string_view run, int64_t step, std::string_view signal, int layer,
             double value) {
    Keep(engine.Observe(SignalPoint{run, step, signal, layer, kAllHeads, value, true}));
  }
  void Points(std::string_view run, std::string_view signal, int layer, int64_t first_step,
              const std::vector<double>& values, int64_t stride = 10) {
    for (size_t i = 0; i < values.size(); ++i) {
      Point(run, first_step + static_cast<int64_t>(i) * stride, signal, layer, values[i]);
    }
  }
  void Keep(std::vector<AlertTransition> more) {
    transitions.insert(transitions.end(), more.begin(), more.end());
  }
  std::vector<AlertTransition> Take() { return std::exchange(transitions, {}); }

  AlertEngine engine;
  std::vector<AlertTransition> transitions;
};

std::string Annotation(const Alert& alert, const std::string& name) {
  for (const auto& [key, value] : alert.Annotations()) {
    if (key == name) return value;
  }
  return "<none>";
}

TEST(AlertEngineLifecycleTest, CloseEpisodesResolvesWithAReasonAndTheNextEpisodeIsNew) {
  Driver d;
  d.Points("r", "qk_increment_entropy", 0, 0, Noisy(60, 0.8, 1));              // steps 0..590
  d.Points("r", "qk_increment_entropy", 0, 600, std::vector<double>(5, 0.4));  // fires at 620
  d.Points("r", "qk_increment_entropy", 1, 0, Noisy(64, 0.8, 2));              // steps 0..630
  d.Point("r", 640, "qk_increment_entropy", 1, 0.4);                           // layer 1: pending
  d.Keep(d.engine.ObserveNonFinite(NonFiniteEvent{"r", 640, detectors::SampleKind::kScalars, 1}));
  ASSERT_EQ(d.engine.ActiveAlerts().size(), 3u);
  d.Take();

  const std::vector<AlertTransition> closed = d.engine.CloseEpisodes("r", kRunEnded);
  ASSERT_EQ(closed.size(), 3u);
  for (const AlertTransition& t : closed) {
    EXPECT_EQ(t.step, 640) << t.alert.alertname;  // the run's latest step
    EXPECT_EQ(t.alert.resolved_reason, "run_ended");
    EXPECT_EQ(Annotation(t.alert, "resolved_reason"), "run_ended");
    if (t.from == AlertState::kFiring) {
      EXPECT_EQ(t.to, AlertState::kResolved);
      EXPECT_EQ(t.alert.resolved_step, 640);
    } else {
      EXPECT_EQ(t.from, AlertState::kPending);
      EXPECT_EQ(t.to, AlertState::kInactive);
      EXPECT_EQ(t.alert.layer, "1");
    }
  }
  EXPECT_TRUE(d.engine.ActiveAlerts().empty());
  EXPECT_EQ(d.engine.AllAlerts("r").size(), 3u);  // still listed, as resolved
  EXPECT_TRUE(d.engine.CloseEpisodes("r", kRunEnded).empty());
  EXPECT_TRUE(d.engine.CloseEpisodes("unknown", kRunEnded).empty());

  // Finite values do not resolve ForeshockNonFinite a second time, and a
  // fault that is still there fires again, as a new episode without a reason.
  d.Points("r", "qk_increment_entropy", 0, 650, std::vector<double>(3, 0.4));
  std::vector<AlertTransition> again = d.Take();
  ASSERT_EQ(again.size(), 2u);  // pending at 650, firing at 670 (3 of 5)
  EXPECT_EQ(again[0].alert.alertname, kQKIncrementCollapse);
  EXPECT_EQ(again[0].from, AlertState::kResolved);
  EXPECT_EQ(again[0].to, AlertState::kPending);
  EXPECT_EQ(again[0].alert.resolved_reason, "");
  EXPECT_EQ(again[1].to, AlertState::kFiring);
  EXPECT_EQ(again[1].alert.episode, 2);
  EXPECT_EQ(again[1].alert.first_step, 650);
  EXPECT_EQ(Annotation(again[1].alert, "resolved_reason"), "<none>");
  d.Keep(d.engine.ObserveNonFinite(NonFiniteEvent{"r", 700, detectors::SampleKind::kScalars, 1}));
  again = d.Take();
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(again[0].alert.alertname, kNonFinite);
  EXPECT_EQ(again[0].to, AlertState::kFiring);
  EXPECT_EQ(again[0].alert.resolved_reason, "");
}

// A loss spike at 4000 in the abandoned attempt; the job resumes at 3800.
TEST(AlertEngineLifecycleTest, RewindRunForgetsTheAbandonedStepsAndScoresTheReplay) {
  const std::vector<double> healthy = Noisy(600, 2.0, 21);
  Driver d;
  d.Points("r", "loss", kNoLayer, 0, std::vector<double>(healthy.begin(), healthy.begin() + 400));
  d.Points("r", "lr", kNoLayer, 0, std::vector<double>(410, 1e-3));
  d.Points("r", "loss", kNoLayer, 4000, std::vector<double>(10, 6.0));
  ASSERT_EQ(d.engine.ActiveAlerts().size(), 1u);
  EXPECT_EQ(d.engine.ActiveAlerts()[0].alertname, kLossSpike);
  d.Take();
  const uint64_t stale_before = d.engine.counters().points_stale;
  const uint64_t scored_before = d.engine.counters().points_scored;

  const std::vector<AlertTransition> closed = d.engine.RewindRun("r", 3800);
  ASSERT_EQ(closed.size(), 1u);
  EXPECT_EQ(closed[0].to, AlertState::kResolved);
  EXPECT_EQ(closed[0].alert.resolved_reason, "run_resumed");
  EXPECT_EQ(closed[0].step, 4090);  // where the abandoned attempt was

  // The resumed attempt is healthy from 3800: no alert, nothing stale.
  d.Points("r", "loss", kNoLayer, 3800,
           std::vector<double>(healthy.begin() + 380, healthy.end()));
  EXPECT_TRUE(d.Take().empty());
  EXPECT_EQ(d.engine.counters().points_stale, stale_before);
  EXPECT_EQ(d.engine.counters().points_scored, scored_before + 220);
  EXPECT_TRUE(d.engine.ActiveAlerts().empty());
  EXPECT_EQ(d.engine.RunProbableCause("r"), ProbableCause::kUnknown);

  // Without the rewind, the replay up to 4090 would be dropped as stale and
  // the abandoned attempt's alert would stay firing.
  Driver control;
  control.Points("r", "loss", kNoLayer, 0,
                 std::vector<double>(healthy.begin(), healthy.begin() + 400));
  control.Points("r", "loss", kNoLayer, 4000, std::vector<double>(10, 6.0));
  const uint64_t control_stale = control.engine.counters().points_stale;
  control.Points("r", "loss", kNoLayer, 3800,
                 std::vector<double>(healthy.begin() + 380, healthy.begin() + 410));
  EXPECT_EQ(control.engine.counters().points_stale, control_stale + 29);  // 3800..4080
  EXPECT_EQ(control.engine.counters().points_duplicate, 1u);              // 4090
  EXPECT_EQ(control.engine.ActiveAlerts().size(), 1u);
}

TEST(AlertEngineLifecycleTest, AFaultThatIsStillThereAfterTheResumeFiresAgain) {
  const std::vector<double> healthy = Noisy(400, 2.0, 22);
  Driver d;
  d.Points("r", "loss", kNoLayer, 0, healthy);
  d.Points("r", "loss", kNoLayer, 4000, std::vector<double>(10, 6.0));
  ASSERT_EQ(d.engine.ActiveAlerts().size(), 1u);
  d.engine.RewindRun("r", 3950);
  d.Take();
  // Replayed 3950..3990 healthy (those were in the abandoned attempt too), then the spike again.
  d.Points("r", "loss", kNoLayer, 3950,
           std::vector<double>(healthy.begin() + 395, healthy.begin() + 400));
  d.Points("r", "loss", kNoLayer, 4000, std::vector<double>(5, 6.0));
  const std::vector<AlertTransition> fired = d.Take();
  ASSERT_FALSE(fired.empty());
  EXPECT_EQ(fired.back().to, AlertState::kFiring);
  EXPECT_EQ(fired.back().alert.first_step, 4000);
  EXPECT_EQ(fired.back().alert.episode, 2);
}

TEST(AlertEngineLifecycleTest, RewindReopensACauseThatSettledOnReplayedSteps) {
  Driver d;
  d.Points("r", "qk_increment_entropy", 0, 0, Noisy(100, 0.8, 4));              // 0..990
  d.Points("r", "qk_increment_entropy", 0, 1000, std::vector<double>(15, 0.4));  // to 1140
  ASSERT_EQ(d.engine.RunProbableCause("r"), ProbableCause::kLowPrecisionAttention);
  ASSERT_EQ(d.engine.ActiveAlerts().size(), 1u);
  EXPECT_TRUE(d.engine.ActiveAlerts()[0].probable_cause_settled);
  d.engine.RewindRun("r", 990);
  EXPECT_EQ(d.engine.RunProbableCause("r"), ProbableCause::kUnknown);
  EXPECT_FALSE(d.engine.FirstFiringLayer("r").has_value());
  // Resumed healthy: no alert, and the next fault gets a fresh diagnosis.
  d.Points("r", "qk_increment_entropy", 0, 990, Noisy(30, 0.8, 5));  // 990..1280
  d.Take();
  d.Points("r", "qk_increment_entropy", 0, 1300, std::vector<double>(3, 0.4));
  const std::vector<AlertTransition> fired = d.Take();
  ASSERT_FALSE(fired.empty());
  EXPECT_EQ(fired.back().alert.first_step, 1300);
  EXPECT_EQ(fired.back().alert.probable_cause, "low_precision_attention");
  EXPECT_FALSE(fired.back().alert.probable_cause_settled);
}

TEST(AlertEngineLifecycleTest, TheMarkAndTheReasonSurviveACheckpoint) {
  Driver d;
  d.Keep(d.engine.ObserveNonFinite(NonFiniteEvent{"r", 5, detectors::SampleKind::kScalars, 1}));
  d.engine.CloseEpisodes("r", kRunEnded);
  const LifecycleMark mark{2, 30, true};
  d.engine.SetLifecycleMark("r", mark);
  EXPECT_EQ(d.engine.GetLifecycleMark("r"), mark);
  EXPECT_EQ(d.engine.GetLifecycleMark("other"), LifecycleMark{});

  AlertEngine restored;
  std::string error;
  ASSERT_TRUE(restored.RestoreState(d.engine.SaveState(), &error)) << error;
  EXPECT_EQ(restored.GetLifecycleMark("r"), mark);
  const std::vector<Alert> alerts = restored.AllAlerts("r");
  ASSERT_EQ(alerts.size(), 1u);
  EXPECT_EQ(alerts[0].state, AlertState::kResolved);
  EXPECT_EQ(alerts[0].resolved_reason, "run_ended");
  EXPECT_EQ(restored.SaveState(), d.engine.SaveState());
}

}  // namespace
}  // namespace foreshock::alerts
