// Issue 27, "no client breaks another's run, no tenant locks out another":
// each test reproduces a finding of the adversarial pass against the daemon
// in process (real gRPC over loopback) and shows what now stops it.
//
// 1. A second client (a new sender_id, or another token with ingest on the
//    prefix) said Hello for a live run's rank, one record at step 1 and a
//    goodbye: the run's alerts resolved run_resumed, its series lost their
//    points and the run was marked ended. Now the rank belongs to the live
//    stream that holds it: the Hello is refused (ALREADY_EXISTS rank_in_use).
// 2. One flaky rank of an 8-rank run (its stream dropped, a new sender_id)
//    reset the whole run. Now it resumes that rank only.
// 3. A world_size label of 2^20 kept a run from ever ending; a Hello of rank
//    -1 was acknowledged and its data appeared nowhere. Both are refused.
// 4. One tenant's Hellos for new runs (each closed at once) filled --max_runs
//    for every other tenant, also after a restart. Now each tenant has a
//    share, and runs that never stored a sample stop counting in minutes.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <limits>
#include <thread>

#include <unistd.h>

#include <grpcpp/grpcpp.h>

#include "foreshock/v1/ingest.grpc.pb.h"
#include "foreshock/v1/query.grpc.pb.h"
#include "server/daemon.h"
#include "server/security/auth.h"
#include "tests/server/ingest/raw_stream.h"
#include "tests/server/metric_reader.h"

namespace foreshock::server {
namespace {

namespace v1 = foreshock::v1;
using foreshock::testing::CounterValue;
using foreshock::testing::MetricValue;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

using test_support::RawStream;

v1::Hello MakeHello(const std::string& run, int rank, uint64_t sender, int world_size = 0,
                    const std::string& job = "ownership-test") {
  v1::Hello hello;
  hello.set_run_id(run);
  hello.set_job(job);
  hello.set_rank(rank);
  hello.mutable_model()->set_n_layers(2);
  if (sender != 0) {
    hello.set_first_seq(1);
    hello.set_sender_id(sender);
  }
  if (world_size > 0) (*hello.mutable_labels())["world_size"] = std::to_string(world_size);
  return hello;
}

v1::Record Loss(int64_t step, double loss) {
  v1::Record record;
  record.set_step(step);
  record.mutable_scalars()->set_loss(loss);
  return record;
}

// Steps [from, to] of loss, one record each; NaN at `nan_step`.
std::vector<v1::Record> Losses(int64_t from, int64_t to, int64_t nan_step = -1) {
  std::vector<v1::Record> records;
  for (int64_t s = from; s <= to; ++s) {
    records.push_back(Loss(s, s == nan_step ? std::nan("") : 2.0 - 0.01 * static_cast<double>(s)));
  }
  return records;
}

bool StartsWith(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

class RankOwnershipTest : public ::testing::Test {
 protected:
  void Start(DaemonOptions options) {
    options.listen = "127.0.0.1:0";
    options.metrics_listen = "127.0.0.1:0";
    options.workers = 2;
    daemon_ = std::make_unique<Daemon>(std::move(options));
    ASSERT_TRUE(daemon_->Start().ok());
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(daemon_->grpc_port()),
                                   grpc::InsecureChannelCredentials());
    stub_ = v1::Ingest::NewStub(channel_);
    query_ = v1::Query::NewStub(channel_);
  }
  void Stop() {
    stub_.reset();
    query_.reset();
    channel_.reset();
    daemon_->Shutdown(milliseconds(2000));
    daemon_.reset();
  }
  double Rejected(const std::string& reason) {
    return CounterValue(daemon_->registry(), "foreshock_ingest_rejected_total", {{"reason", reason}});
  }
  bool WaitFor(const std::function<bool()>& predicate, milliseconds timeout = milliseconds(10000)) {
    const auto deadline = Clock::now() + timeout;
    while (!predicate()) {
      if (Clock::now() > deadline) return predicate();
      std::this_thread::sleep_for(milliseconds(10));
    }
    return true;
  }
  // Through the Query service, as a user sees them (the query token with tokens).
  std::vector<v1::Alert> Alerts(const std::string& run, const std::string& token = "") {
    grpc::ClientContext context;
    if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
    v1::ListAlertsRequest request;
    request.set_run(run);
    request.set_include_resolved(true);
    v1::ListAlertsResponse response;
    EXPECT_TRUE(query_->ListAlerts(&context, request, &response).ok());
    return {response.alerts().begin(), response.alerts().end()};
  }
  v1::RunInfo Run(const std::string& run, const std::string& token = "") {
    grpc::ClientContext context;
    if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
    v1::ListRunsResponse response;
    EXPECT_TRUE(query_->ListRuns(&context, v1::ListRunsRequest(), &response).ok());
    for (const v1::RunInfo& info : response.runs()) {
      if (info.run() == run) return info;
    }
    return {};
  }
  size_t Points(const std::string& run, const std::string& signal, int head = -1,
                const std::string& token = "") {
    grpc::ClientContext context;
    if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
    v1::GetSeriesRequest request;
    request.set_run(run);
    request.set_signal(signal);
    if (head >= 0) request.set_head(head);
    v1::GetSeriesResponse response;
    if (!query_->GetSeries(&context, request, &response).ok()) return 0;
    return static_cast<size_t>(response.points_size());
  }
  // Every alert of the run firing, and at least one.
  bool AllFiring(const std::string& run, const std::string& token = "") {
    const auto alerts = Alerts(run, token);
    if (alerts.empty()) return false;
    for (const v1::Alert& alert : alerts) {
      if (alert.state() != "firing") return false;
    }
    return true;
  }

  std::unique_ptr<Daemon> daemon_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Ingest::Stub> stub_;
  std::unique_ptr<v1::Query::Stub> query_;
};

// Finding 1, the hijack: without tokens, then with.
TEST_F(RankOwnershipTest, ASecondClientCannotTakeALiveRankNorEndOrResumeTheRun) {
  Start(DaemonOptions{});
  const std::string run = "owned";
  RawStream holder(*stub_);
  ASSERT_TRUE(holder.Hello(MakeHello(run, 0, 111)));
  ASSERT_EQ(holder.Send(Losses(0, 29, /*nan_step=*/20)), 30);
  daemon_->WaitIdle();
  ASSERT_TRUE(WaitFor([&] { return AllFiring(run); }));
  ASSERT_EQ(Points(run, "loss"), 29u);  // the NaN is counted, not stored

  // Another sender: refused before it can send anything, and counted.
  RawStream hijacker(*stub_);
  EXPECT_FALSE(hijacker.Hello(MakeHello(run, 0, 222)));
  const grpc::Status refused = hijacker.Wait();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_TRUE(StartsWith(refused.error_message(), "rank_in_use: rank 0 of run 'owned'"))
      << refused.error_message();
  EXPECT_EQ(hijacker.Trailer("retry-after-ms"), "1000");
  EXPECT_EQ(Rejected("rank_in_use"), 1);
  // Nor can a client without first_seq (sender 0).
  RawStream old_client(*stub_);
  EXPECT_FALSE(old_client.Hello(MakeHello(run, 0, 0)));
  EXPECT_EQ(old_client.Wait().error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(Rejected("rank_in_use"), 2);

  daemon_->WaitIdle();
  EXPECT_TRUE(AllFiring(run));
  EXPECT_EQ(Run(run).attempt(), 1);
  EXPECT_FALSE(Run(run).ended());
  EXPECT_EQ(Points(run, "loss"), 29u);

  // The holder keeps streaming. Its own reconnect (same sender_id, the old
  // stream half-dead) takes the rank over; the old stream cannot send on.
  ASSERT_EQ(holder.Send(Losses(30, 31)), 2);
  RawStream reconnect(*stub_);
  ASSERT_TRUE(reconnect.Hello(MakeHello(run, 0, 111)));
  reconnect.next_seq = 100;
  EXPECT_EQ(holder.Send(Losses(32, 32), /*goodbye=*/true), -1);
  EXPECT_EQ(holder.Wait().error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_FALSE(Run(run).ended());  // the taken-over stream's goodbye never counted
  EXPECT_EQ(Run(run).attempt(), 1);
  EXPECT_EQ(reconnect.Send(Losses(32, 33)), 2);
  EXPECT_EQ(reconnect.Send({}, /*goodbye=*/true), 0);
  EXPECT_TRUE(WaitFor([&] { return Run(run).ended(); }));
  EXPECT_EQ(Run(run).attempt(), 1);
  EXPECT_EQ(Points(run, "loss"), 33u);
  reconnect.rw->WritesDone();
  EXPECT_TRUE(reconnect.Wait().ok());
}

TEST_F(RankOwnershipTest, WithTokensAnotherTokenOnThePrefixCannotTakeALiveRank) {
  DaemonOptions options;
  auto authorizer = Authorizer::Parse(
      "tokA team-a/ ingest,query\ntokA2 team-a/ ingest\n");
  ASSERT_TRUE(authorizer.ok()) << authorizer.status();
  options.authorizer = *authorizer;
  Start(options);
  const std::string run = "team-a/owned";
  RawStream holder(*stub_, "tokA");
  ASSERT_TRUE(holder.Hello(MakeHello(run, 0, 111)));
  ASSERT_EQ(holder.Send(Losses(0, 29, 20)), 30);
  daemon_->WaitIdle();
  ASSERT_TRUE(WaitFor([&] { return AllFiring(run, "tokA"); }));

  // Another token with ingest on the prefix, even with the holder's sender_id.
  for (uint64_t sender : {uint64_t{222}, uint64_t{111}}) {
    RawStream hijacker(*stub_, "tokA2");
    EXPECT_FALSE(hijacker.Hello(MakeHello(run, 0, sender))) << sender;
    const grpc::Status refused = hijacker.Wait();
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::ALREADY_EXISTS) << refused.error_message();
    EXPECT_TRUE(StartsWith(refused.error_message(), "rank_in_use")) << refused.error_message();
  }
  EXPECT_EQ(Rejected("rank_in_use"), 2);
  daemon_->WaitIdle();
  EXPECT_TRUE(AllFiring(run, "tokA"));
  EXPECT_EQ(Run(run, "tokA").attempt(), 1);
  EXPECT_FALSE(Run(run, "tokA").ended());
  EXPECT_EQ(Points(run, "loss", -1, "tokA"), 29u);
  holder.rw->WritesDone();
  EXPECT_TRUE(holder.Wait().ok());
}

TEST_F(RankOwnershipTest, AHolderIdlePastTheGraceIsTakenOverAndItsGoodbyeNoLongerCounts) {
  DaemonOptions options;
  options.limits.rank_takeover_grace = milliseconds(300);
  Start(options);
  const std::string run = "vanished";
  RawStream gone(*stub_);  // its host vanished: the stream stays open, silent
  ASSERT_TRUE(gone.Hello(MakeHello(run, 0, 111)));
  ASSERT_EQ(gone.Send(Losses(0, 40, 30)), 41);
  daemon_->WaitIdle();
  ASSERT_TRUE(WaitFor([&] { return AllFiring(run); }));
  std::this_thread::sleep_for(milliseconds(400));
  // The job restarted (one rank): the new process takes the rank over and
  // starts a new attempt from its checkpoint.
  RawStream resumed(*stub_);
  ASSERT_TRUE(resumed.Hello(MakeHello(run, 0, 333)));
  EXPECT_EQ(Run(run).attempt(), 2);
  ASSERT_EQ(resumed.Send(Losses(35, 36)), 2);
  EXPECT_EQ(gone.Send({}, /*goodbye=*/true), -1);  // the old one: refused, not counted
  EXPECT_EQ(gone.Wait().error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_FALSE(Run(run).ended());
  EXPECT_EQ(resumed.Send({}, true), 0);
  EXPECT_TRUE(WaitFor([&] { return Run(run).ended(); }));
}

// Finding 2: the flaky rank of an 8-rank run.
TEST_F(RankOwnershipTest, OneFlakyRankOfAnEightRankRunResumesThatRankOnly) {
  Start(DaemonOptions{});
  const std::string run = "eight";
  constexpr int kRanks = 8;
  std::vector<std::unique_ptr<RawStream>> ranks;
  for (int r = 0; r < kRanks; ++r) {
    ranks.push_back(std::make_unique<RawStream>(*stub_));
    ASSERT_TRUE(ranks.back()->Hello(MakeHello(run, r, 1000 + r, kRanks)));
  }
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_EQ(ranks[r]->Send(Losses(0, 31, r == 0 ? 20 : -1)), 32);
  }
  daemon_->WaitIdle();
  ASSERT_TRUE(WaitFor([&] { return AllFiring(run); }));
  const size_t merged = Points(run, "loss");
  const size_t rank5 = Points(run, "loss", 5);
  ASSERT_GE(merged, 30u);
  ASSERT_EQ(rank5, 32u);

  // Rank 3's stream drops (no goodbye); a new process of rank 3 says Hello
  // and resumes from step 1 while the other seven stream on.
  ranks[3]->context.TryCancel();
  ranks[3]->Wait();
  ASSERT_TRUE(WaitFor([&] {
    return MetricValue(daemon_->registry(), "foreshock_ingest_active_streams") == kRanks - 1;
  }));
  RawStream restarted(*stub_);
  ASSERT_TRUE(restarted.Hello(MakeHello(run, 3, 3333, kRanks)));
  ASSERT_EQ(restarted.Send(Losses(1, 1)), 1);
  for (int r = 0; r < kRanks; ++r) {
    if (r != 3) {
      ASSERT_EQ(ranks[r]->Send(Losses(32, 32)), 1);
    }
  }
  daemon_->WaitIdle();
  EXPECT_TRUE(AllFiring(run));  // no run_resumed
  for (const v1::Alert& alert : Alerts(run)) EXPECT_NE(alert.resolved_reason(), "run_resumed");
  EXPECT_EQ(Run(run).attempt(), 1);
  EXPECT_GE(Points(run, "loss"), merged);
  EXPECT_GE(Points(run, "loss", 5), rank5 + 1);

  // The run ends with the eight ranks' goodbyes, the new rank 3's included
  // (the dead process of rank 3 is no longer waited for).
  for (int r = 0; r < kRanks; ++r) {
    if (r != 3) {
      ASSERT_EQ(ranks[r]->Send({}, true), 0);
    }
  }
  EXPECT_FALSE(Run(run).ended());
  ASSERT_EQ(restarted.Send({}, true), 0);
  EXPECT_TRUE(WaitFor([&] { return Run(run).ended(); }));
  EXPECT_EQ(Run(run).attempt(), 1);
}

TEST_F(RankOwnershipTest, AWholeMultiRankJobRestartIsANewAttempt) {
  Start(DaemonOptions{});
  const std::string run = "job-restart";
  {
    std::vector<std::unique_ptr<RawStream>> ranks;
    for (int r = 0; r < 2; ++r) {
      ranks.push_back(std::make_unique<RawStream>(*stub_));
      ASSERT_TRUE(ranks.back()->Hello(MakeHello(run, r, 10 + r, 2)));
      ASSERT_EQ(ranks.back()->Send(Losses(0, 30, r == 0 ? 25 : -1)), 31);
    }
    daemon_->WaitIdle();
    ASSERT_TRUE(WaitFor([&] { return AllFiring(run); }));
  }  // both killed
  ASSERT_TRUE(WaitFor([&] {
    return MetricValue(daemon_->registry(), "foreshock_ingest_active_streams") == 0;
  }));
  RawStream r0(*stub_);
  ASSERT_TRUE(r0.Hello(MakeHello(run, 0, 20, 2)));
  EXPECT_EQ(Run(run).attempt(), 2);
  const auto alerts = Alerts(run);
  ASSERT_FALSE(alerts.empty());
  EXPECT_EQ(alerts[0].resolved_reason(), "run_resumed");
}

// Finding 3: world_size and rank bounds.
TEST_F(RankOwnershipTest, AnInflatedWorldSizeAndRanksOutsideItAreRefused) {
  DaemonOptions options;
  Start(options);
  auto refused = [&](const v1::Hello& hello) {
    RawStream stream(*stub_);
    EXPECT_FALSE(stream.Hello(hello));
    return stream.Wait();
  };
  grpc::Status status = refused(MakeHello("ws", 0, 1, 1 << 20));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(StartsWith(status.error_message(), "world_size_over_limit: label world_size 1048576"))
      << status.error_message();
  EXPECT_EQ(Rejected("world_size_over_limit"), 1);

  status = refused(MakeHello("ws", -1, 1));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(StartsWith(status.error_message(), "bad_rank: rank -1")) << status.error_message();
  status = refused(MakeHello("ws", 8, 1, 8));
  EXPECT_TRUE(StartsWith(status.error_message(), "bad_rank: rank 8 is outside [0, 8)"))
      << status.error_message();
  status = refused(MakeHello("ws", 70000, 1));
  EXPECT_TRUE(StartsWith(status.error_message(), "bad_rank")) << status.error_message();
  EXPECT_EQ(Rejected("bad_rank"), 3);

  // So a run of two ranks ends with their two goodbyes.
  for (int r = 0; r < 2; ++r) {
    RawStream stream(*stub_);
    ASSERT_TRUE(stream.Hello(MakeHello("ws", r, 5 + r, 2)));
    ASSERT_EQ(stream.Send(Losses(0, 3)), 4);
    ASSERT_EQ(stream.Send({}, true), 0);
    stream.rw->WritesDone();
    EXPECT_TRUE(stream.Wait().ok());
  }
  EXPECT_TRUE(WaitFor([&] { return Run("ws").ended(); }));
}

// Finding 4: another tenant's runs.
TEST_F(RankOwnershipTest, OneTenantCannotFillTheRunsOfAnother) {
  DaemonOptions options;
  options.limits.max_runs = 8;  // a share of 2 per tenant
  Start(options);
  int admitted = 0;
  grpc::Status refused;
  for (int i = 0; i < 8; ++i) {
    RawStream stream(*stub_);
    if (stream.Hello(MakeHello("flood-" + std::to_string(i), 0, 1, 0, "flooder"))) {
      ++admitted;
      stream.rw->WritesDone();
      stream.Wait();
      continue;
    }
    refused = stream.Wait();
  }
  EXPECT_EQ(admitted, 2);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(StartsWith(refused.error_message(), "too_many_runs_for_tenant: job 'flooder'"))
      << refused.error_message();
  EXPECT_EQ(Rejected("too_many_runs_for_tenant"), 6);
  RawStream other(*stub_);
  ASSERT_TRUE(other.Hello(MakeHello("polite", 0, 1, 0, "polite-job")));
  EXPECT_EQ(other.Send(Losses(0, 0)), 1);
}

TEST_F(RankOwnershipTest, WithTokensOneTokenCannotFillTheRunsOfAnother) {
  DaemonOptions options;
  options.limits.max_runs = 8;
  auto authorizer = Authorizer::Parse("tokA team-a/ ingest\ntokB team-b/ ingest\n");
  ASSERT_TRUE(authorizer.ok());
  options.authorizer = *authorizer;
  Start(options);
  int admitted = 0;
  for (int i = 0; i < 8; ++i) {
    RawStream stream(*stub_, "tokB");
    // Each with its own job name: the token is the tenant.
    if (stream.Hello(MakeHello("team-b/flood-" + std::to_string(i), 0, 1, 0,
                               "job-" + std::to_string(i)))) {
      ++admitted;
      stream.rw->WritesDone();
    }
    stream.Wait();
  }
  EXPECT_EQ(admitted, 2);
  EXPECT_EQ(Rejected("too_many_runs_for_tenant"), 6);
  RawStream other(*stub_, "tokA");
  ASSERT_TRUE(other.Hello(MakeHello("team-a/run", 0, 1)));
  EXPECT_EQ(other.Send(Losses(0, 0)), 1);
}

// Forgetting (--forget_runs_idle_s): runs with samples, ended or not, stop
// counting toward --max_runs once idle past the period, and leave /metrics;
// their alerts (resolved run_idle if still open), stored points and ListRuns
// entry stay. A forgotten run that streams again is admitted and judged
// afresh.
TEST_F(RankOwnershipTest, IdleRunsWithSamplesAreForgottenAndStopCounting) {
  DaemonOptions options;
  options.limits.max_runs = 2;
  options.limits.max_runs_per_tenant = 0;  // the total alone
  options.forget_runs_idle = milliseconds(1500);
  Start(options);
  auto stream_and_close = [&](const std::string& run, bool goodbye) {
    RawStream stream(*stub_);
    if (!stream.Hello(MakeHello(run, 0, 7))) return stream.Wait();
    EXPECT_EQ(stream.Send(Losses(0, 30, /*nan_step=*/30), goodbye), 31);
    stream.rw->WritesDone();
    return stream.Wait();
  };
  ASSERT_TRUE(stream_and_close("crashed", /*goodbye=*/false).ok());
  ASSERT_TRUE(stream_and_close("finished", /*goodbye=*/true).ok());
  ASSERT_TRUE(WaitFor([&] { return AllFiring("crashed"); }));
  const grpc::Status full = stream_and_close("third", false);
  EXPECT_EQ(full.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << full.error_message();
  EXPECT_NE(full.error_message().find("--forget_runs_idle_s"), std::string::npos)
      << full.error_message();

  ASSERT_TRUE(WaitFor([&] {
    return CounterValue(daemon_->registry(), "foreshock_runs_forgotten_total", {}) >= 2;
  }));
  EXPECT_EQ(CounterValue(daemon_->registry(), "foreshock_runs_forgotten_total", {}), 2);
  const std::vector<v1::Alert> crashed = Alerts("crashed");
  ASSERT_EQ(crashed.size(), 1u);  // still listed
  EXPECT_EQ(crashed[0].alertname(), "ForeshockNonFinite");
  EXPECT_EQ(crashed[0].state(), "resolved");
  EXPECT_EQ(crashed[0].resolved_reason(), "run_idle");
  ASSERT_EQ(Alerts("finished").size(), 1u);
  EXPECT_EQ(Alerts("finished")[0].resolved_reason(), "run_ended");
  EXPECT_TRUE(Run("crashed").ended() == false && Run("crashed").run() == "crashed");
  EXPECT_EQ(Points("crashed", "loss"), 30u);  // the NaN step is counted, not stored
  EXPECT_TRUE(std::isnan(MetricValue(daemon_->registry(), "foreshock_loss", {{"run", "crashed"}})));
  EXPECT_TRUE(std::isnan(MetricValue(daemon_->registry(), "foreshock_last_step", {{"run", "finished"}})));

  // Their slots are free; and a forgotten run may come back.
  EXPECT_TRUE(stream_and_close("third", false).ok());
  RawStream back(*stub_);
  ASSERT_TRUE(back.Hello(MakeHello("crashed", 0, 8)));  // the job's new process
  EXPECT_EQ(back.Send(Losses(31, 35)), 5);
  back.rw->WritesDone();
  EXPECT_TRUE(back.Wait().ok());
  EXPECT_TRUE(WaitFor([&] {
    return MetricValue(daemon_->registry(), "foreshock_last_step", {{"run", "crashed"}}) == 35;
  }));
}

TEST_F(RankOwnershipTest, RunsThatNeverStoredASampleStopCountingAlsoAfterARestart) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() /
      ("foreshock-runs-quota-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  DaemonOptions options;
  options.limits.max_runs = 4;
  options.limits.max_runs_per_tenant = 0;  // the total alone
  // Long enough that the runs below still count when the next Hello comes,
  // on a busy machine too.
  options.limits.empty_run_release = milliseconds(2000);
  options.store_options.data_dir = dir.string();
  Start(options);
  auto hello_and_close = [&](const std::string& run, const std::string& job) {
    RawStream stream(*stub_);
    const bool ok = stream.Hello(MakeHello(run, 0, 1, 0, job));
    if (ok) stream.rw->WritesDone();
    const grpc::Status status = stream.Wait();
    return ok ? grpc::Status::OK : status;
  };
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(hello_and_close("empty-" + std::to_string(i), "b").ok());
  grpc::Status status = hello_and_close("real", "a");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(StartsWith(status.error_message(), "too_many_runs:")) << status.error_message();
  // The empty runs stop counting once idle for --empty_run_release_s.
  std::this_thread::sleep_for(milliseconds(2200));
  EXPECT_TRUE(hello_and_close("real", "a").ok());

  // After a restart, the recovered runs that never stored a sample do not
  // hold the slots either.
  for (int i = 4; i < 7; ++i) ASSERT_TRUE(hello_and_close("empty-" + std::to_string(i), "b").ok());
  Stop();
  Start(options);
  std::this_thread::sleep_for(milliseconds(2200));
  RawStream fresh(*stub_);
  ASSERT_TRUE(fresh.Hello(MakeHello("after-restart", 0, 1, 0, "a")));
  EXPECT_EQ(fresh.Send(Losses(0, 0)), 1);
  fresh.rw->WritesDone();
  EXPECT_TRUE(fresh.Wait().ok());
  Stop();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace foreshock::server
