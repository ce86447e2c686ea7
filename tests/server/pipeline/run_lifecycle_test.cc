// RunLifecycle (server/pipeline/run_lifecycle.h): when a run ends, when it
// restarted, the attempt boundary GetSeries filters by, and the restore that
// re-applies to the alert state what its checkpoint missed.
#include "server/pipeline/run_lifecycle.h"

#include <gtest/gtest.h>
#include <prometheus/registry.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <thread>

#include "codec/state_codec.h"
#include "server/alerting/alert_hub.h"
#include "server/common/clock.h"
#include "server/ingest/state_budget.h"
#include "server/pipeline/run_tracker.h"
#include "server/pipeline/worker_pool.h"
#include "tests/server/metric_reader.h"

namespace foreshock::server {
namespace {

using testing::MetricValue;

// The daemon's parts a lifecycle drives, on one store; Restart() builds them
// anew on the same store, as a restarted daemon would.
class LifecycleTest : public ::testing::Test {
 protected:
  void SetUp() override { Build(); }

  void Build(const std::string& alert_checkpoint = "") {
    lifecycle_.reset();
    pool_.reset();
    hub_.reset();
    tracker_.reset();
    metrics_.reset();
    registry_ = std::make_unique<prometheus::Registry>();
    metrics_ = std::make_unique<DaemonMetrics>(*registry_, false);
    hub_ = std::make_unique<AlertHub>(alerts::DefaultAlertConfig(), *metrics_, nullptr);
    if (!alert_checkpoint.empty()) {
      ASSERT_TRUE(hub_->RestoreState(alert_checkpoint));
    }
    tracker_ = std::make_unique<RunTracker>(*metrics_);
    pool_ = std::make_unique<WorkerPool>(1, detectors::DetectorOptions{}, *hub_, [](size_t) {});
    lifecycle_ = std::make_unique<RunLifecycle>(&store_, hub_.get(), tracker_.get());
    lifecycle_->AddStateOwner(pool_.get());
  }
  void Restart(const std::string& alert_checkpoint) {
    Build(alert_checkpoint);
    lifecycle_->Restore();
  }

  // ForeshockNonFinite fires for `run` at `step`.
  void Fire(const std::string& run, int64_t step) {
    detectors::Sample sample;
    sample.run = run;
    sample.step = step;
    hub_->OnNonFinite(sample, detectors::SampleKind::kScalars, 1);
  }
  std::vector<foreshock::v1::Alert> Alerts(const std::string& run) {
    return hub_->Alerts(run, /*include_resolved=*/true);
  }
  double Active(const std::string& run) {
    return MetricValue(*registry_, "foreshock_alert_active",
                       {{"alertname", "ForeshockNonFinite"}, {"run", run}, {"layer", "all"},
                        {"severity", "critical"}});
  }

  InMemorySeriesStore store_{64};
  std::unique_ptr<prometheus::Registry> registry_;
  std::unique_ptr<DaemonMetrics> metrics_;
  std::unique_ptr<AlertHub> hub_;
  std::unique_ptr<RunTracker> tracker_;
  std::unique_ptr<WorkerPool> pool_;
  std::unique_ptr<RunLifecycle> lifecycle_;
};

TEST_F(LifecycleTest, TheRunEndsWhenEverySenderSaidGoodbye) {
  lifecycle_->OnHello("r", 0, 11);
  lifecycle_->OnHello("r", 1, 22);
  lifecycle_->BeforeRecords("r", 0, 11, 0, 5);
  lifecycle_->BeforeRecords("r", 1, 22, 0, 5);
  lifecycle_->BeforeRecords("r", 1, 22, 6, 6);  // counted once per sender
  Fire("r", 5);
  ASSERT_EQ(Active("r"), 1);

  lifecycle_->OnGoodbye("r", 0, 11);
  lifecycle_->OnGoodbye("r", 0, 11);  // a resend changes nothing
  EXPECT_FALSE(lifecycle_->GetStatus("r")->ended);
  EXPECT_EQ(Alerts("r")[0].state(), "firing");

  lifecycle_->OnGoodbye("r", 1, 22);
  const RunLifecycle::Status status = *lifecycle_->GetStatus("r");
  EXPECT_TRUE(status.ended);
  EXPECT_GT(status.ended_ms, 0);
  EXPECT_EQ(status.attempt, 1);
  const auto alerts = Alerts("r");
  ASSERT_EQ(alerts.size(), 1u);
  EXPECT_EQ(alerts[0].state(), "resolved");
  EXPECT_EQ(alerts[0].resolved_reason(), "run_ended");
  EXPECT_EQ(alerts[0].annotations().at("resolved_reason"), "run_ended");
  EXPECT_EQ(Active("r"), 0);
  EXPECT_EQ(hub_->GetLifecycleMark("r"), (alerts::LifecycleMark{1, -1, true}));

  // A sender reconnecting to resend its goodbye does not reopen the run.
  lifecycle_->OnHello("r", 1, 22);
  lifecycle_->OnGoodbye("r", 1, 22);
  EXPECT_TRUE(lifecycle_->GetStatus("r")->ended);
  EXPECT_EQ(lifecycle_->GetStatus("r")->attempt, 1);
  // Two joins, two first records, two goodbyes, one end: the log grows per
  // sender, not per stream or batch.
  EXPECT_EQ(store_.Events(RunLifecycle::kEventKind).size(), 7u);
  EXPECT_FALSE(lifecycle_->GetStatus("never-seen").has_value());
}

TEST_F(LifecycleTest, WithAWorldSizeTheRunWaitsForThatManyRanksGoodbyes) {
  // Rank 0 of a 2-rank job finishes before rank 1's stream opened (a slow
  // connect): the run must not end, and rank 1 joins the same attempt.
  lifecycle_->OnHello("ws", 0, 11, /*world_size=*/2);
  Fire("ws", 5);
  lifecycle_->OnGoodbye("ws", 0, 11);
  EXPECT_FALSE(lifecycle_->GetStatus("ws")->ended);
  EXPECT_EQ(Alerts("ws")[0].state(), "firing");
  lifecycle_->OnHello("ws", 1, 22, 2);
  EXPECT_EQ(lifecycle_->GetStatus("ws")->attempt, 1);
  lifecycle_->OnGoodbye("ws", 1, 22);
  EXPECT_TRUE(lifecycle_->GetStatus("ws")->ended);
  EXPECT_EQ(Alerts("ws")[0].resolved_reason(), "run_ended");

  // Without the label the first rank's goodbye ends the run (nothing else is known).
  lifecycle_->OnHello("nows", 0, 11);
  lifecycle_->OnGoodbye("nows", 0, 11);
  EXPECT_TRUE(lifecycle_->GetStatus("nows")->ended);
}

TEST_F(LifecycleTest, ANewProcessForARankWhoseProcessVanishedStartsAnAttempt) {
  lifecycle_->OnHello("r", 0, 11);
  Fire("r", 40);
  lifecycle_->OnStreamClosed("r", 0, 11);  // killed: no goodbye
  EXPECT_EQ(lifecycle_->GetStatus("r")->attempt, 1);

  lifecycle_->OnHello("r", 0, 33);
  RunLifecycle::Status status = *lifecycle_->GetStatus("r");
  EXPECT_EQ(status.attempt, 2);
  EXPECT_EQ(status.attempt_start_step, -1);  // known at the first records
  EXPECT_FALSE(status.ended);
  const auto alerts = Alerts("r");
  ASSERT_EQ(alerts.size(), 1u);
  EXPECT_EQ(alerts[0].state(), "resolved");
  EXPECT_EQ(alerts[0].resolved_reason(), "run_resumed");
  EXPECT_EQ(Active("r"), 0);

  // Another rank of the new process joins the attempt; so does a reconnect.
  lifecycle_->OnHello("r", 1, 44);
  lifecycle_->OnStreamClosed("r", 0, 33);
  lifecycle_->OnHello("r", 0, 33);
  EXPECT_EQ(lifecycle_->GetStatus("r")->attempt, 2);
  // The run ends with the attempt's senders only (11 is gone with attempt 1).
  lifecycle_->OnGoodbye("r", 0, 33);
  lifecycle_->OnGoodbye("r", 1, 44);
  EXPECT_TRUE(lifecycle_->GetStatus("r")->ended);
  // After the end, any new sender starts the next attempt.
  lifecycle_->OnHello("r", 0, 55);
  EXPECT_EQ(lifecycle_->GetStatus("r")->attempt, 3);
  EXPECT_FALSE(lifecycle_->GetStatus("r")->ended);
}

TEST_F(LifecycleTest, NoRestartWhileTheRanksProcessIsThereOrCannotBeTold) {
  // Two processes claiming rank 0 at once (a misconfigured job): both join.
  lifecycle_->OnHello("dup", 0, 11);
  lifecycle_->OnHello("dup", 0, 22);
  EXPECT_EQ(lifecycle_->GetStatus("dup")->attempt, 1);
  // A rank that said goodbye and comes back with a new monitor joins too.
  lifecycle_->OnHello("again", 0, 11);
  lifecycle_->OnHello("again", 1, 22);
  lifecycle_->BeforeRecords("again", 0, 11, 0, 9);
  lifecycle_->BeforeRecords("again", 1, 22, 0, 9);  // rank 1 streams on
  lifecycle_->OnGoodbye("again", 0, 11);
  lifecycle_->OnStreamClosed("again", 0, 11);
  lifecycle_->OnHello("again", 0, 33);
  EXPECT_EQ(lifecycle_->GetStatus("again")->attempt, 1);
  // Clients without Hello.first_seq (sender 0): a restart looks like a reconnect.
  lifecycle_->OnHello("old", 0, 0);
  lifecycle_->OnStreamClosed("old", 0, 0);
  lifecycle_->OnHello("old", 0, 0);
  EXPECT_EQ(lifecycle_->GetStatus("old")->attempt, 1);
}

TEST_F(LifecycleTest, TheFirstRecordsOfANewAttemptSetItsBoundaryOnce) {
  lifecycle_->OnHello("r", 0, 11);
  tracker_->OnStep("r", 45);
  lifecycle_->BeforeRecords("r", 0, 11, 10, 45);  // attempt 1: no boundary
  EXPECT_TRUE(lifecycle_->Boundaries("r").empty());
  lifecycle_->OnStreamClosed("r", 0, 11);
  lifecycle_->OnHello("r", 0, 22);

  const int64_t before = NowUnixMillis();
  lifecycle_->BeforeRecords("r", 0, 22, 30, 34);
  const int64_t after = NowUnixMillis();
  lifecycle_->BeforeRecords("r", 0, 22, 35, 39);  // later batches: nothing
  const auto boundaries = lifecycle_->Boundaries("r");
  ASSERT_EQ(boundaries.size(), 1u);
  EXPECT_EQ(boundaries[0].attempt, 2);
  EXPECT_EQ(boundaries[0].from_step, 30);
  EXPECT_GE(boundaries[0].wall_ms, before);
  // Points stored from now on are stamped after the boundary.
  EXPECT_GT(after, boundaries[0].wall_ms);
  EXPECT_EQ(lifecycle_->GetStatus("r")->attempt_start_step, 30);
  EXPECT_EQ(tracker_->LastStep("r"), 29);  // where the resumed attempt stands
  EXPECT_EQ(MetricValue(*registry_, "foreshock_last_step", {{"run", "r"}}), 29);
  EXPECT_EQ(hub_->GetLifecycleMark("r"), (alerts::LifecycleMark{2, 30, false}));
}

// What keeps per-run state is told once, in registration order, when a run
// restarts from a checkpoint (at the new attempt's first records) and when
// it ends; the per-run state budget forgets the run's count each time.
class RecordingOwner : public RunStateOwner {
 public:
  explicit RecordingOwner(std::vector<std::string>& log, std::string name)
      : log_(log), name_(std::move(name)) {}
  void OnRunRestarted(const std::string& run) override { log_.push_back(name_ + " restart " + run); }
  void OnRunEnded(const std::string& run) override { log_.push_back(name_ + " end " + run); }
  void OnRunForgotten(const std::string& run) override {
    log_.push_back(name_ + " forgotten " + run);
  }

 private:
  std::vector<std::string>& log_;
  std::string name_;
};

TEST_F(LifecycleTest, StateOwnersAreToldOfARestartAndAnEndInOrder) {
  std::vector<std::string> log;
  RecordingOwner first(log, "first"), second(log, "second");
  StateBudget budget(0);
  lifecycle_->AddStateOwner(&first);
  lifecycle_->AddStateOwner(&budget);
  lifecycle_->AddStateOwner(&second);
  detectors::RetainedFootprint footprint;
  footprint.kind = detectors::SampleKind::kRouter;
  footprint.heads = {{-1, 4096}};
  auto admit = [&] { ASSERT_FALSE(budget.Admit("r", footprint).has_value()); };

  lifecycle_->OnHello("r", 0, 11);
  lifecycle_->BeforeRecords("r", 0, 11, 0, 9);
  admit();
  EXPECT_GT(budget.RunBytes("r"), 0);
  EXPECT_TRUE(log.empty());
  lifecycle_->OnStreamClosed("r", 0, 11);
  lifecycle_->OnHello("r", 0, 22);  // a new process: a new attempt
  EXPECT_TRUE(log.empty());         // told at its first records, not at its Hello
  lifecycle_->BeforeRecords("r", 0, 22, 5, 9);
  EXPECT_EQ(log, (std::vector<std::string>{"first restart r", "second restart r"}));
  EXPECT_EQ(budget.RunBytes("r"), 0);
  lifecycle_->BeforeRecords("r", 0, 22, 10, 19);  // later batches: nothing
  EXPECT_EQ(log.size(), 2u);

  admit();
  lifecycle_->OnGoodbye("r", 0, 22);
  EXPECT_EQ(log, (std::vector<std::string>{"first restart r", "second restart r", "first end r",
                                           "second end r"}));
  EXPECT_EQ(budget.RunBytes("r"), 0);
  lifecycle_->OnGoodbye("r", 0, 22);  // a resent goodbye: nothing more
  EXPECT_EQ(log.size(), 4u);
}

// The one rule for forgetting a run: no stream open and nothing of it for
// the idle period, ended or not. Its open alerts resolve (run_idle), every
// state owner is told once, its alert records stay listed, and whatever of
// it comes later makes it live again.
TEST_F(LifecycleTest, ARunIdlePastThePeriodIsForgottenOnceAndItsOwnersAreTold) {
  std::vector<std::string> log;
  RecordingOwner owner(log, "owner");
  lifecycle_->AddStateOwner(&owner);
  constexpr int64_t kIdleMs = 60'000;
  lifecycle_->OnHello("idle", 0, 11);
  lifecycle_->BeforeRecords("idle", 0, 11, 0, 40);
  Fire("idle", 40);
  ASSERT_EQ(Active("idle"), 1);
  lifecycle_->OnHello("live", 0, 21);  // a stream that stays open
  lifecycle_->BeforeRecords("live", 0, 21, 0, 40);
  lifecycle_->OnStreamClosed("idle", 0, 11);  // the job died: no goodbye
  const int64_t now = NowUnixMillis();

  EXPECT_TRUE(lifecycle_->ForgetIdleRuns(now, kIdleMs).empty());  // not idle long enough
  EXPECT_TRUE(log.empty());
  EXPECT_EQ(lifecycle_->ForgetIdleRuns(now + kIdleMs + 1000, kIdleMs),
            (std::vector<std::string>{"idle"}));
  EXPECT_EQ(log, (std::vector<std::string>{"owner forgotten idle"}));
  EXPECT_TRUE(lifecycle_->IsForgotten("idle"));
  EXPECT_FALSE(lifecycle_->IsForgotten("live"));  // its stream is open, however long
  const auto alerts = Alerts("idle");
  ASSERT_EQ(alerts.size(), 1u);  // still listed
  EXPECT_EQ(alerts[0].state(), "resolved");
  EXPECT_EQ(alerts[0].resolved_reason(), "run_idle");
  EXPECT_TRUE(std::isnan(Active("idle")));  // its alert_active series left /metrics
  EXPECT_FALSE(lifecycle_->GetStatus("idle")->ended);  // forgetting is not an end

  // Once: a later sweep leaves it alone.
  EXPECT_TRUE(lifecycle_->ForgetIdleRuns(now + 10 * kIdleMs, kIdleMs).empty());
  EXPECT_EQ(log.size(), 1u);
  // It comes back: a reconnect of the same sender, live again, forgotten
  // again only after another idle period.
  lifecycle_->OnHello("idle", 0, 11);
  EXPECT_FALSE(lifecycle_->IsForgotten("idle"));
  EXPECT_EQ(lifecycle_->GetStatus("idle")->attempt, 1);
  lifecycle_->OnStreamClosed("idle", 0, 11);
  EXPECT_TRUE(lifecycle_->ForgetIdleRuns(NowUnixMillis(), kIdleMs).empty());
  EXPECT_EQ(lifecycle_->ForgetIdleRuns(NowUnixMillis() + kIdleMs, kIdleMs),
            (std::vector<std::string>{"idle"}));
  EXPECT_EQ(log.size(), 2u);
}

// After a restart an ended run's idle time counts from its end (stored), a
// run that had not ended from the restore.
TEST_F(LifecycleTest, ARestoredRunCountsItsIdleTimeFromItsEndOrFromTheRestore) {
  lifecycle_->OnHello("ended", 0, 11);
  lifecycle_->BeforeRecords("ended", 0, 11, 0, 9);
  lifecycle_->OnGoodbye("ended", 0, 11);
  lifecycle_->OnStreamClosed("ended", 0, 11);
  lifecycle_->OnHello("open", 0, 21);
  lifecycle_->BeforeRecords("open", 0, 21, 0, 9);
  const int64_t ended_ms = lifecycle_->GetStatus("ended")->ended_ms;
  ASSERT_TRUE(lifecycle_->Checkpoint());
  // The restore comes strictly after the end.
  while (NowUnixMillis() <= ended_ms + 1) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  Restart(hub_->SaveState());
  const int64_t restored = NowUnixMillis();
  constexpr int64_t kIdleMs = 3'600'000;
  // An hour after the end, but less after the restore: only the ended run.
  EXPECT_EQ(lifecycle_->ForgetIdleRuns(std::max(ended_ms + kIdleMs, restored), kIdleMs),
            (std::vector<std::string>{"ended"}));
  EXPECT_EQ(lifecycle_->ForgetIdleRuns(restored + kIdleMs + 1000, kIdleMs),
            (std::vector<std::string>{"open"}));
}

TEST_F(LifecycleTest, ASecondLiveSenderOfARankIsNoRestartEvenGoingBack) {
  // Which stream may speak for a rank is the ingest service's rank ownership
  // (IngestService::ClaimRank); the lifecycle never guesses a restart from
  // the steps of a sender whose predecessor's stream is open.
  lifecycle_->OnHello("r", 0, 11);
  lifecycle_->BeforeRecords("r", 0, 11, 0, 40);
  Fire("r", 40);
  lifecycle_->OnHello("r", 0, 22);
  lifecycle_->BeforeRecords("r", 0, 22, 1, 1);
  EXPECT_EQ(lifecycle_->GetStatus("r")->attempt, 1);
  EXPECT_EQ(Alerts("r")[0].state(), "firing");
  EXPECT_TRUE(lifecycle_->Boundaries("r").empty());
  // A holder taken over (ingest reports its stream closed first): a restart.
  lifecycle_->OnStreamClosed("r", 0, 11);
  lifecycle_->OnStreamClosed("r", 0, 22);
  lifecycle_->OnHello("r", 0, 33);
  EXPECT_EQ(lifecycle_->GetStatus("r")->attempt, 2);
  EXPECT_EQ(Alerts("r")[0].resolved_reason(), "run_resumed");
}

TEST_F(LifecycleTest, OneRanksNewProcessWhileOthersStreamResumesThatRankOnly) {
  for (int r = 0; r < 8; ++r) lifecycle_->OnHello("r8", r, 100 + r, /*world_size=*/8);
  for (int r = 0; r < 8; ++r) lifecycle_->BeforeRecords("r8", r, 100 + r, 0, 31);
  Fire("r8", 31);
  lifecycle_->OnStreamClosed("r8", 3, 103);  // rank 3's process died
  lifecycle_->OnHello("r8", 3, 333, 8);      // and came back
  lifecycle_->BeforeRecords("r8", 3, 333, 1, 1);
  RunLifecycle::Status status = *lifecycle_->GetStatus("r8");
  EXPECT_EQ(status.attempt, 1);
  EXPECT_EQ(status.attempt_start_step, -1);
  EXPECT_TRUE(lifecycle_->Boundaries("r8").empty());
  EXPECT_EQ(Alerts("r8")[0].state(), "firing");
  EXPECT_EQ(Active("r8"), 1);
  // The run ends with the current eight senders' goodbyes: the dead one's is not awaited.
  for (int r = 0; r < 8; ++r) {
    if (r != 3) lifecycle_->OnGoodbye("r8", r, 100 + r);
  }
  EXPECT_FALSE(lifecycle_->GetStatus("r8")->ended);
  lifecycle_->OnGoodbye("r8", 3, 333);
  EXPECT_TRUE(lifecycle_->GetStatus("r8")->ended);
  EXPECT_EQ(Alerts("r8")[0].resolved_reason(), "run_ended");

  // The same after a daemon restart (the rank's replacement is an event).
  lifecycle_->OnHello("s", 0, 1, 2);
  lifecycle_->OnHello("s", 1, 2, 2);
  lifecycle_->OnStreamClosed("s", 1, 2);
  lifecycle_->OnHello("s", 1, 22, 2);
  Restart(hub_->SaveState());
  EXPECT_EQ(lifecycle_->GetStatus("s")->attempt, 1);
  lifecycle_->OnGoodbye("s", 0, 1);
  lifecycle_->OnGoodbye("s", 1, 22);
  EXPECT_TRUE(lifecycle_->GetStatus("s")->ended);

  // Every rank's process gone (the job restarted): a new attempt.
  lifecycle_->OnHello("all", 0, 1, 2);
  lifecycle_->OnHello("all", 1, 2, 2);
  Fire("all", 9);
  lifecycle_->OnStreamClosed("all", 0, 1);
  lifecycle_->OnStreamClosed("all", 1, 2);
  lifecycle_->OnHello("all", 1, 20, 2);
  EXPECT_EQ(lifecycle_->GetStatus("all")->attempt, 2);
  EXPECT_EQ(Alerts("all")[0].resolved_reason(), "run_resumed");
}

TEST_F(LifecycleTest, ARestartForgetsTheOldAttemptsWorldSize) {
  // A Hello with a large world_size, then the job restarts with one rank:
  // the new attempt ends with its own rank's goodbye.
  lifecycle_->OnHello("w", 0, 1, 64);
  lifecycle_->OnStreamClosed("w", 0, 1);
  lifecycle_->OnHello("w", 0, 2, 1);
  EXPECT_EQ(lifecycle_->GetStatus("w")->attempt, 2);
  lifecycle_->OnGoodbye("w", 0, 2);
  EXPECT_TRUE(lifecycle_->GetStatus("w")->ended);
}

TEST(LatestAttemptTest, LeavesOutWhatALaterAttemptSuperseded) {
  const std::vector<RunLifecycle::Boundary> boundaries = {{2, 30, 1000}, {3, 20, 2000}};
  std::vector<Point> points = {
      {10, 1.0, 500},   // before every boundary step: kept
      {20, 2.0, 900},   // attempt 1, superseded by attempt 3
      {30, 3.0, 900},   // attempt 1
      {30, 3.5, 1000},  // stored at the boundary's time: still attempt 1
      {30, 4.0, 1500},  // attempt 2, superseded by attempt 3 (from 20)
      {20, 5.0, 2001},  // attempt 3
      {30, 6.0, 2002},
      {40, 7.0, 2003},
  };
  RunLifecycle::LatestAttempt(points, boundaries);
  ASSERT_EQ(points.size(), 4u);
  EXPECT_EQ(points[0].value, 1.0);
  EXPECT_EQ(points[1].value, 5.0);
  EXPECT_EQ(points[2].value, 6.0);
  EXPECT_EQ(points[3].value, 7.0);
  std::vector<Point> untouched = {{1, 1.0, 0}, {1, 2.0, 0}};  // two ranks, one attempt
  RunLifecycle::LatestAttempt(untouched, {});
  EXPECT_EQ(untouched.size(), 2u);
}

TEST_F(LifecycleTest, ARestartReappliesTheEndTheAlertCheckpointMissed) {
  lifecycle_->OnHello("r", 0, 11);
  Fire("r", 5);
  const std::string checkpoint = hub_->SaveState();  // taken while the alert fired
  lifecycle_->OnGoodbye("r", 0, 11);
  ASSERT_EQ(Active("r"), 0);

  Restart(checkpoint);  // a crash: only the event log knows the run ended
  EXPECT_TRUE(lifecycle_->GetStatus("r")->ended);
  ASSERT_EQ(Alerts("r").size(), 1u);
  EXPECT_EQ(Alerts("r")[0].state(), "resolved");
  EXPECT_EQ(Alerts("r")[0].resolved_reason(), "run_ended");
  EXPECT_EQ(Active("r"), 0);
  EXPECT_EQ(hub_->GetLifecycleMark("r"), (alerts::LifecycleMark{1, -1, true}));

  // Restoring again from a checkpoint that has it changes nothing.
  const std::string current = hub_->SaveState();
  Restart(current);
  EXPECT_EQ(hub_->SaveState(), current);
}

TEST_F(LifecycleTest, ARestartReappliesTheResumeTheAlertCheckpointMissed) {
  lifecycle_->OnHello("r", 0, 11);
  Fire("r", 40);
  const std::string checkpoint = hub_->SaveState();
  ASSERT_TRUE(lifecycle_->Checkpoint());  // part of the state from the checkpoint,
  lifecycle_->OnStreamClosed("r", 0, 11);
  lifecycle_->OnHello("r", 0, 22);        // the rest from the events after it
  lifecycle_->BeforeRecords("r", 0, 22, 30, 30);
  const auto boundaries = lifecycle_->Boundaries("r");

  Restart(checkpoint);
  const RunLifecycle::Status status = *lifecycle_->GetStatus("r");
  EXPECT_EQ(status.attempt, 2);
  EXPECT_EQ(status.attempt_start_step, 30);
  ASSERT_EQ(lifecycle_->Boundaries("r").size(), 1u);
  EXPECT_EQ(lifecycle_->Boundaries("r")[0].wall_ms, boundaries[0].wall_ms);
  EXPECT_EQ(Alerts("r")[0].state(), "resolved");
  EXPECT_EQ(Alerts("r")[0].resolved_reason(), "run_resumed");
  EXPECT_EQ(hub_->GetLifecycleMark("r"), (alerts::LifecycleMark{2, 30, false}));
  // The senders are remembered: the new process reconnecting is no restart,
  // the old one is not part of the attempt.
  lifecycle_->OnHello("r", 0, 22);
  EXPECT_EQ(lifecycle_->GetStatus("r")->attempt, 2);
  lifecycle_->OnGoodbye("r", 0, 22);
  EXPECT_TRUE(lifecycle_->GetStatus("r")->ended);
}

TEST_F(LifecycleTest, TheStateIsCheckpointedBeforeOldEventsCouldLeaveTheLog) {
  for (int i = 0; i < RunLifecycle::kCheckpointEvery; ++i) {
    lifecycle_->OnHello("run-" + std::to_string(i), 0, 1);
  }
  EXPECT_TRUE(store_.ReadCheckpoint(RunLifecycle::kCheckpointName).has_value());
  lifecycle_->OnGoodbye("run-7", 0, 1);
  Restart("");
  EXPECT_TRUE(lifecycle_->GetStatus("run-7")->ended);
  EXPECT_FALSE(lifecycle_->GetStatus("run-8")->ended);
  EXPECT_TRUE(lifecycle_->GetStatus("run-200").has_value());
}

TEST_F(LifecycleTest, TheRunsTenantIsItsFirstAndSurvivesARestart) {
  // Issue 34 item 3: a recovered run must count in its tenant's share.
  lifecycle_->OnHello("from-events", 0, 11, 0, "token token@2");
  lifecycle_->OnHello("from-events", 1, 22, 0, "token token@3");  // the first one stays
  EXPECT_EQ(lifecycle_->TenantOf("from-events"), "token token@2");
  EXPECT_EQ(lifecycle_->TenantOf("never-seen"), "");
  Restart("");  // from the event log alone
  EXPECT_EQ(lifecycle_->TenantOf("from-events"), "token token@2");

  lifecycle_->OnHello("from-checkpoint", 0, 33, 0, "job 'a'");
  ASSERT_TRUE(lifecycle_->Checkpoint());
  // From the checkpoint alone: a store with no events left.
  InMemorySeriesStore bare(64);
  ASSERT_TRUE(bare.WriteCheckpoint(RunLifecycle::kCheckpointName,
                                   *store_.ReadCheckpoint(RunLifecycle::kCheckpointName)));
  RunLifecycle restored(&bare, nullptr, nullptr);
  restored.Restore();
  EXPECT_EQ(restored.TenantOf("from-checkpoint"), "job 'a'");
  EXPECT_EQ(restored.TenantOf("from-events"), "token token@2");
}

TEST_F(LifecycleTest, ASenderThatOnlySaidHelloDoesNotHoldTheRunOpen) {
  // Issue 34 item 4: a second client's Hello (a free rank, no records) must
  // not keep the job's run from ending at the job's goodbye.
  lifecycle_->OnHello("r", 0, 11);
  lifecycle_->BeforeRecords("r", 0, 11, 0, 9);
  lifecycle_->OnHello("r", 65535, 666);  // never sends a record, never says goodbye
  Fire("r", 9);
  lifecycle_->OnGoodbye("r", 0, 11);
  EXPECT_TRUE(lifecycle_->GetStatus("r")->ended);
  EXPECT_EQ(Alerts("r")[0].resolved_reason(), "run_ended");

  // One that did send records is waited for, across a daemon restart too.
  lifecycle_->OnHello("s", 0, 11);
  lifecycle_->OnHello("s", 1, 22);
  lifecycle_->BeforeRecords("s", 0, 11, 0, 9);
  lifecycle_->BeforeRecords("s", 1, 22, 0, 9);
  Restart(hub_->SaveState());
  lifecycle_->OnGoodbye("s", 0, 11);
  EXPECT_FALSE(lifecycle_->GetStatus("s")->ended);
  lifecycle_->OnGoodbye("s", 1, 22);
  EXPECT_TRUE(lifecycle_->GetStatus("s")->ended);
}

TEST_F(LifecycleTest, ALaterHelloCannotRaiseTheDeclaredWorldSize) {
  lifecycle_->OnHello("w", 0, 11, /*world_size=*/2);
  lifecycle_->BeforeRecords("w", 0, 11, 0, 9);
  EXPECT_EQ(lifecycle_->WorldSizeConflict("w", 1, 22, 2), std::nullopt);
  EXPECT_EQ(lifecycle_->WorldSizeConflict("w", 1, 22, 0), std::nullopt);  // no label
  EXPECT_EQ(lifecycle_->WorldSizeConflict("never-seen", 9, 1, 64), std::nullopt);
  const auto raised = lifecycle_->WorldSizeConflict("w", 65535, 666, 65536);
  ASSERT_TRUE(raised.has_value());
  EXPECT_NE(raised->find("declared world_size 2"), std::string::npos) << *raised;
  // Its own sender's reconnect cannot raise it either.
  EXPECT_TRUE(lifecycle_->WorldSizeConflict("w", 0, 11, 3).has_value());
  // Nor may a rank outside it join without the label.
  EXPECT_TRUE(lifecycle_->WorldSizeConflict("w", 5, 666, 0).has_value());
  // Declared durably: the same after a daemon restart.
  lifecycle_->OnHello("w", 1, 22, 2);
  lifecycle_->BeforeRecords("w", 1, 22, 0, 9);
  Restart(hub_->SaveState());
  EXPECT_TRUE(lifecycle_->WorldSizeConflict("w", 65535, 666, 65536).has_value());
  lifecycle_->OnHello("w", 0, 11, 2);  // the job reconnects
  lifecycle_->OnHello("w", 1, 22, 2);
  // Had one slipped past the check, OnHello still keeps the first declaration.
  lifecycle_->OnHello("w", 1, 666, 65536);
  EXPECT_EQ(lifecycle_->GetStatus("w")->attempt, 1);
  lifecycle_->OnGoodbye("w", 0, 11);
  lifecycle_->OnGoodbye("w", 1, 22);
  EXPECT_TRUE(lifecycle_->GetStatus("w")->ended);
  // A new attempt (after the end) declares its own.
  EXPECT_EQ(lifecycle_->WorldSizeConflict("w", 3, 33, 4), std::nullopt);

  // A run whose first Hello said nothing (one rank): a later Hello cannot
  // make it wait for more (a label of 1 is the same as none).
  lifecycle_->OnHello("one", 0, 11);
  EXPECT_EQ(lifecycle_->WorldSizeConflict("one", 1, 22, 1), std::nullopt);
  EXPECT_EQ(lifecycle_->WorldSizeConflict("one", 7, 22, 0), std::nullopt);
  EXPECT_TRUE(lifecycle_->WorldSizeConflict("one", 65535, 666, 65536).has_value());
}

// Events written before the tenant (v2) and the world size (v3) were stored
// are read back with those fields unset: an old daemon's event log restores.
TEST_F(LifecycleTest, EventsOfEveryEarlierVersionRestore) {
  auto event = [](uint8_t version, uint8_t type, uint64_t seq, int32_t attempt, int32_t rank,
                  int64_t step, const std::string& tenant, int32_t world_size) {
    codec::StateWriter w;
    w.PutU8(version);
    w.PutU8(type);
    w.PutU64(seq);
    w.PutString("old");
    w.PutI32(attempt);
    w.PutI32(rank);
    w.PutU64(11 + rank);  // sender
    w.PutI64(step);
    w.PutI64(1000 + static_cast<int64_t>(seq));  // wall_ms
    if (version >= 2) w.PutString(tenant);
    if (version >= 3) w.PutI32(world_size);
    return w.Take();
  };
  constexpr uint8_t kJoin = 1, kAttempt = 3, kEnd = 5, kTenant = 7;
  const std::string_view kind = RunLifecycle::kEventKind;
  ASSERT_TRUE(store_.AppendEvent(kind, event(1, kJoin, 1, 1, 0, 0, "", 0)).ok());
  ASSERT_TRUE(store_.AppendEvent(kind, event(2, kTenant, 2, 1, 0, 0, "tenant-a", 0)).ok());
  ASSERT_TRUE(store_.AppendEvent(kind, event(3, kJoin, 3, 1, 1, 0, "", 2)).ok());
  ASSERT_TRUE(store_.AppendEvent(kind, event(3, kEnd, 4, 1, 0, 700, "", 0)).ok());
  // A version from the future is skipped, not misread: no attempt 2.
  ASSERT_TRUE(store_.AppendEvent(kind, event(9, kAttempt, 5, 2, 0, 0, "", 0)).ok());
  Restart("");
  std::optional<RunLifecycle::Status> status = lifecycle_->GetStatus("old");
  ASSERT_TRUE(status.has_value());
  EXPECT_EQ(status->attempt, 1);
  EXPECT_TRUE(status->ended);
  EXPECT_EQ(status->ended_step, 700);
  EXPECT_EQ(status->ended_ms, 1004);
  EXPECT_EQ(status->world_size, 2);  // a v1 join cannot say it (-1): the v3 join declares it
  EXPECT_EQ(lifecycle_->TenantOf("old"), "tenant-a");
}

}  // namespace
}  // namespace foreshock::server
