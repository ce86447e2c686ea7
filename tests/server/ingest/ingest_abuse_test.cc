// Issue 16, "no client can starve the others; bad input never costs others":
// each test reproduces one finding of the adversarial pass against the daemon
// in process (real gRPC over loopback), and shows the limit that now stops it.
//
// A. Streams that send a Hello and then nothing held --max_streams slots for
//    ever (--stream_idle_timeout_ms), and one tenant could hold every slot
//    (--max_streams_per_tenant).
// B. One curvature sample with 100,000 layer_rayleigh values created 100,000
//    series (too_many_layers: at most n_layers values).
// C. One record with step 2^63-1 became the run's last step, so every real
//    later step was stale (step_out_of_range, --max_step_jump).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <thread>

#include "foreshock/client.h"
#include "foreshock/sender.h"
#include "server/alerting/alert_hub.h"
#include "server/security/auth.h"
#include "server/daemon.h"
#include "server/pipeline/series_store.h"
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

v1::Hello MakeHello(const std::string& run, int n_layers = 4, int rank = 0) {
  v1::Hello hello;
  hello.set_run_id(run);
  hello.set_job("abuse-test");
  hello.set_rank(rank);
  hello.mutable_model()->set_n_layers(n_layers);
  return hello;
}

v1::Record LossRecord(int64_t step, double loss = 1.0) {
  v1::Record record;
  record.set_step(step);
  record.mutable_scalars()->set_loss(loss);
  return record;
}

v1::Batch OneRecord(v1::Record record) {
  v1::Batch batch;
  *batch.add_records() = std::move(record);
  return batch;
}

bool StartsWith(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

class IngestAbuseTest : public ::testing::Test {
 protected:
  void Start(DaemonOptions options) {
    options.listen = "127.0.0.1:0";
    options.metrics_listen = "127.0.0.1:0";
    options.workers = 2;
    daemon_ = std::make_unique<Daemon>(std::move(options));
    ASSERT_TRUE(daemon_->Start().ok());
    channel_ = grpc::CreateChannel(endpoint(), grpc::InsecureChannelCredentials());
    stub_ = v1::Ingest::NewStub(channel_);
  }
  std::string endpoint() const { return "127.0.0.1:" + std::to_string(daemon_->grpc_port()); }
  double Rejected(const std::string& reason) {
    return CounterValue(daemon_->registry(), "foreshock_ingest_rejected_total", {{"reason", reason}});
  }
  // Series of the family `name` in the registry (what /metrics would show).
  size_t FamilySize(const std::string& name) {
    for (const auto& family : daemon_->registry().Collect()) {
      if (family.name == name) return family.metric.size();
    }
    return 0;
  }
  size_t TotalSeries() {
    size_t n = 0;
    for (const auto& family : daemon_->registry().Collect()) n += family.metric.size();
    return n;
  }
  bool WaitFor(const std::function<bool()>& predicate, milliseconds timeout = milliseconds(5000)) {
    const auto deadline = Clock::now() + timeout;
    while (!predicate()) {
      if (Clock::now() > deadline) return predicate();
      std::this_thread::sleep_for(milliseconds(10));
    }
    return true;
  }
  // A well-behaved client: a new stream, one record, its Ack.
  ::testing::AssertionResult GoodClientGetsAck(const std::string& run) {
    client::IngestStream stream(channel_);
    if (grpc::Status status = stream.Open(MakeHello(run)); !status.ok()) {
      return ::testing::AssertionFailure() << "Hello refused: " << status.error_message();
    }
    auto ack = stream.SendAndWait(OneRecord(LossRecord(1)));
    if (!ack || ack->accepted() != 1) return ::testing::AssertionFailure() << "no ack";
    stream.Close();
    return ::testing::AssertionSuccess();
  }

  std::unique_ptr<Daemon> daemon_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Ingest::Stub> stub_;
};

// Finding A: Hello, then silence, on every slot.
TEST_F(IngestAbuseTest, HelloThenSilenceStreamsAreEndedAndCountedAndFreeTheirSlots) {
  DaemonOptions options;
  options.limits.max_streams = 8;
  options.limits.max_streams_per_tenant = 0;  // this test is about the idle timeout alone
  options.limits.stream_idle_timeout = milliseconds(400);
  Start(options);
  std::vector<std::unique_ptr<RawStream>> idle;
  for (int i = 0; i < 8; ++i) {
    idle.push_back(std::make_unique<RawStream>(*stub_));
    ASSERT_TRUE(idle.back()->Hello(MakeHello("idle-" + std::to_string(i))));
  }
  const auto held = Clock::now();
  {  // Every slot is held: the finding's lock-out, while it lasts.
    client::IngestStream locked_out(channel_);
    const grpc::Status status = locked_out.Open(MakeHello("good"));
    EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_TRUE(StartsWith(status.error_message(), "too_many_streams:")) << status.error_message();
  }
  for (auto& stream : idle) {
    const grpc::Status status = stream->Wait();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
    EXPECT_TRUE(StartsWith(status.error_message(), "stream_idle_timeout: "))
        << status.error_message();
  }
  // Ended by the daemon's idle timeout (the status says so), not before it;
  // no upper bound: a busy machine may take its time.
  EXPECT_GE(Clock::now() - held, milliseconds(300));
  EXPECT_EQ(Rejected("stream_idle_timeout"), 8);
  ASSERT_TRUE(WaitFor([&] { return MetricValue(daemon_->registry(), "foreshock_ingest_active_streams") == 0; }));
  EXPECT_TRUE(GoodClientGetsAck("good"));
}

TEST_F(IngestAbuseTest, AStreamThatKeepsSendingIsNotIdle) {
  DaemonOptions options;
  options.limits.stream_idle_timeout = milliseconds(500);
  Start(options);
  client::IngestStream stream(channel_);
  ASSERT_TRUE(stream.Open(MakeHello("busy")).ok());
  // A batch (an empty one is a heartbeat) every 100 ms for 1.5 s: three timeouts' worth.
  for (int i = 0; i < 15; ++i) {
    v1::Batch batch;
    if (i % 2 == 0) *batch.add_records() = LossRecord(i);
    auto ack = stream.SendAndWait(batch);
    ASSERT_TRUE(ack.has_value()) << "cut off after " << i << " batches";
    std::this_thread::sleep_for(milliseconds(100));
  }
  EXPECT_TRUE(stream.Close().ok());
  EXPECT_EQ(Rejected("stream_idle_timeout"), 0);
}

TEST_F(IngestAbuseTest, SenderReopensAnIdleStreamOnlyWithDataAndLosesNothing) {
  DaemonOptions options;
  options.limits.stream_idle_timeout = milliseconds(300);
  Start(options);
  client::SenderOptions fast;
  fast.backoff_initial = milliseconds(20);
  fast.backoff_max = milliseconds(200);
  client::Sender sender(endpoint(), MakeHello("lazy"), fast);
  sender.Enqueue(LossRecord(1));
  ASSERT_TRUE(WaitFor([&] { return sender.stats().acked == 1; }));
  // The daemon ends the idle stream once; the sender, with nothing to send,
  // does not open another (which would be ended again every 300 ms).
  std::this_thread::sleep_for(milliseconds(1500));
  EXPECT_EQ(Rejected("stream_idle_timeout"), 1);
  EXPECT_EQ(sender.stats().reconnects, 0u);
  sender.Enqueue(LossRecord(2));
  ASSERT_TRUE(WaitFor([&] { return sender.stats().acked == 2; }));
  EXPECT_EQ(sender.stats().reconnects, 1u);
  ASSERT_TRUE(sender.Close(std::chrono::seconds(10)));
  daemon_->WaitIdle();
  const auto loss = daemon_->store().Range(SeriesKey{"lazy", "loss", -1, -1}, 0, 100);
  ASSERT_EQ(loss.size(), 2u);
  EXPECT_EQ(loss[0].step, 1);
  EXPECT_EQ(loss[1].step, 2);
}

// Finding A, without tokens: one run opens streams until refused.
TEST_F(IngestAbuseTest, OneRunOpeningStreamsIsRefusedWhileAnotherRunConnects) {
  DaemonOptions options;
  options.limits.max_streams = 16;
  options.limits.max_streams_per_tenant = 4;
  Start(options);
  std::vector<std::unique_ptr<RawStream>> greedy;
  grpc::Status refused;
  std::string retry_after;
  for (int i = 0; i < 32; ++i) {
    auto stream = std::make_unique<RawStream>(*stub_);
    if (stream->Hello(MakeHello("greedy", 4, i))) {
      greedy.push_back(std::move(stream));
      continue;
    }
    refused = stream->Wait();
    retry_after = stream->Trailer("retry-after-ms");
    break;
  }
  EXPECT_EQ(greedy.size(), 4u);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(StartsWith(refused.error_message(), "too_many_streams_for_tenant: run 'greedy'"))
      << refused.error_message();
  EXPECT_EQ(retry_after, "1000");
  EXPECT_EQ(Rejected("too_many_streams_for_tenant"), 1);
  EXPECT_TRUE(GoodClientGetsAck("polite"));
  // A slot of the tenant frees when one of its streams ends.
  greedy.front()->rw->WritesDone();
  EXPECT_TRUE(greedy.front()->Wait().ok());
  EXPECT_TRUE(WaitFor([&] { return MetricValue(daemon_->registry(), "foreshock_ingest_active_streams") == 3; }));
  RawStream again(*stub_);
  EXPECT_TRUE(again.Hello(MakeHello("greedy", 4, 99)));
}

// Finding A, with --token_file: one token's streams, whatever their runs (or
// with no Hello at all), cannot take every slot.
TEST_F(IngestAbuseTest, OneTokenOpeningStreamsIsRefusedWhileAnotherTokenConnects) {
  DaemonOptions options;
  options.limits.max_streams = 16;
  options.limits.max_streams_per_tenant = 4;
  auto authorizer = Authorizer::Parse("tokA team-a/ ingest\ntokB team-b/ ingest\n");
  ASSERT_TRUE(authorizer.ok());
  options.authorizer = *authorizer;
  Start(options);
  std::vector<std::unique_ptr<RawStream>> greedy;
  // Two silent streams (no Hello yet) and then Hellos for different runs.
  for (int i = 0; i < 2; ++i) greedy.push_back(std::make_unique<RawStream>(*stub_, "tokA"));
  grpc::Status refused;
  std::string retry_after;
  for (int i = 0; i < 32; ++i) {
    auto stream = std::make_unique<RawStream>(*stub_, "tokA");
    if (stream->Hello(MakeHello("team-a/run-" + std::to_string(i)))) {
      greedy.push_back(std::move(stream));
      continue;
    }
    refused = stream->Wait();
    retry_after = stream->Trailer("retry-after-ms");
    break;
  }
  EXPECT_EQ(greedy.size(), 4u);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(StartsWith(refused.error_message(), "too_many_streams_for_tenant: token token@1"))
      << refused.error_message();
  EXPECT_EQ(retry_after, "1000");
  EXPECT_EQ(Rejected("too_many_streams_for_tenant"), 1);
  // The other tenant connects and gets acks.
  RawStream other(*stub_, "tokB");
  ASSERT_TRUE(other.Hello(MakeHello("team-b/run")));
  v1::StreamRequest request;
  request.mutable_batch()->set_seq(1);
  *request.mutable_batch()->add_records() = LossRecord(1);
  ASSERT_TRUE(other.rw->Write(request));
  v1::StreamResponse response;
  ASSERT_TRUE(other.rw->Read(&response));
  EXPECT_EQ(response.ack().accepted(), 1u);
  other.rw->WritesDone();
  EXPECT_TRUE(other.Wait().ok());
}

// Finding B: one message, 100,000 series.
TEST_F(IngestAbuseTest, PerLayerValuesBeyondTheModelsLayersAreRejectedAndCreateNoSeries) {
  DaemonOptions options;
  options.limits.max_layers = 64;
  Start(options);
  client::IngestStream stream(channel_);
  ASSERT_TRUE(stream.Open(MakeHello("curvature", /*n_layers=*/4)).ok());
  auto curvature = [](int64_t step, int values) {
    v1::Record record;
    record.set_step(step);
    auto* c = record.mutable_curvature();
    c->set_lambda_max(10);
    c->set_residual(0.01);
    c->set_lr(1e-3);
    c->set_beta1(0.9);
    c->set_preconditioned(true);
    for (int i = 0; i < values; ++i) c->add_layer_rayleigh(0.5 + i);
    return record;
  };
  const size_t series_before = TotalSeries();
  v1::Batch huge = OneRecord(curvature(1, 100000));  // 800 KB, one message
  ASSERT_GT(huge.ByteSizeLong(), 800000u);
  auto ack = stream.SendAndWait(huge);
  ASSERT_TRUE(ack.has_value());
  EXPECT_EQ(ack->accepted(), 0u);
  ASSERT_EQ(ack->rejections_size(), 1);
  EXPECT_TRUE(StartsWith(ack->rejections(0).reason(), "too_many_layers: layer_rayleigh has 100000"))
      << ack->rejections(0).reason();
  EXPECT_EQ(Rejected("too_many_layers"), 1);
  daemon_->WaitIdle();
  EXPECT_EQ(FamilySize("foreshock_curvature_block_rayleigh"), 0u);
  EXPECT_TRUE(daemon_->store().ListSeries("curvature").empty());
  EXPECT_LE(TotalSeries(), series_before + 2);  // the rejection counter's label, nothing else

  // n_layers values are fine: one series per layer, no more.
  ack = stream.SendAndWait(OneRecord(curvature(2, 4)));
  ASSERT_TRUE(ack.has_value());
  EXPECT_EQ(ack->accepted(), 1u);
  daemon_->WaitIdle();
  EXPECT_EQ(FamilySize("foreshock_curvature_block_rayleigh"), 4u);
  EXPECT_LE(daemon_->store().ListSeries("curvature").size(), 4u + 7u);
  EXPECT_TRUE(stream.Close().ok());

  // Without n_layers in the Hello, --max_layers bounds them.
  client::IngestStream unsized(channel_);
  ASSERT_TRUE(unsized.Open(MakeHello("curvature-unsized", /*n_layers=*/0)).ok());
  ack = unsized.SendAndWait(OneRecord(curvature(1, 65)));
  ASSERT_TRUE(ack.has_value());
  ASSERT_EQ(ack->rejections_size(), 1);
  EXPECT_TRUE(StartsWith(ack->rejections(0).reason(), "too_many_layers: ")) << ack->rejections(0).reason();
  EXPECT_NE(ack->rejections(0).reason().find("--max_layers"), std::string::npos);
  ack = unsized.SendAndWait(OneRecord(curvature(2, 64)));
  ASSERT_TRUE(ack.has_value());
  EXPECT_EQ(ack->accepted(), 1u);
  EXPECT_TRUE(unsized.Close().ok());
  EXPECT_EQ(Rejected("too_many_layers"), 2);

  // Layer indices of QK and router samples are checked against n_layers
  // (layer_out_of_range, ingest_integration_test), and so is the Hello's
  // moe_layers list.
  client::IngestStream moe(channel_);
  v1::Hello hello = MakeHello("moe", 4);
  for (int i = 0; i < 100000; ++i) hello.mutable_model()->add_moe_layers(i);
  const grpc::Status status = moe.Open(hello);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(StartsWith(status.error_message(), "bad_hello: model.moe_layers"))
      << status.error_message();
}

// Finding C: one record with step 2^63-1.
TEST_F(IngestAbuseTest, AStepFarBeyondTheRunIsRejectedAndLaterStepsAreNotStale) {
  Start(DaemonOptions());
  client::IngestStream stream(channel_);
  ASSERT_TRUE(stream.Open(MakeHello("steps")).ok());
  auto ack = stream.SendAndWait(OneRecord(LossRecord(5)));
  ASSERT_TRUE(ack.has_value());
  EXPECT_EQ(ack->accepted(), 1u);
  ack = stream.SendAndWait(OneRecord(LossRecord(std::numeric_limits<int64_t>::max(), 9.0)));
  ASSERT_TRUE(ack.has_value());
  EXPECT_EQ(ack->accepted(), 0u);
  ASSERT_EQ(ack->rejections_size(), 1);
  EXPECT_TRUE(StartsWith(ack->rejections(0).reason(), "step_out_of_range: step 9223372036854775807"))
      << ack->rejections(0).reason();
  {  // Another rank of the run: the bound is the run's, not the stream's.
    client::IngestStream rank1(channel_);
    ASSERT_TRUE(rank1.Open(MakeHello("steps", 4, 1)).ok());
    auto other = rank1.SendAndWait(OneRecord(LossRecord(std::numeric_limits<int64_t>::max() - 1)));
    ASSERT_TRUE(other.has_value());
    ASSERT_EQ(other->rejections_size(), 1);
    EXPECT_TRUE(StartsWith(other->rejections(0).reason(), "step_out_of_range: "));
    EXPECT_TRUE(rank1.Close().ok());
  }
  EXPECT_EQ(Rejected("step_out_of_range"), 2);
  // The real later steps are accepted, advance the run and are scored, not stale.
  for (int64_t step = 6; step <= 60; ++step) {
    ack = stream.SendAndWait(OneRecord(LossRecord(step, 1.0 + 0.01 * static_cast<double>(step))));
    ASSERT_TRUE(ack.has_value());
    ASSERT_EQ(ack->accepted(), 1u) << "step " << step;
  }
  EXPECT_TRUE(stream.Close().ok());
  daemon_->WaitIdle();
  EXPECT_EQ(MetricValue(daemon_->registry(), "foreshock_last_step", {{"run", "steps"}}), 60);
  daemon_->alerts().ExportCounters();
  EXPECT_EQ(CounterValue(daemon_->registry(), "foreshock_alert_points_total", {{"outcome", "stale"}}), 0);
  EXPECT_GE(CounterValue(daemon_->registry(), "foreshock_alert_points_total", {{"outcome", "scored"}}), 56);
  const auto loss = daemon_->store().Range(SeriesKey{"steps", "loss", -1, -1}, 0,
                                           std::numeric_limits<int64_t>::max());
  ASSERT_EQ(loss.size(), 56u);
  EXPECT_EQ(loss.back().step, 60);
}

TEST_F(IngestAbuseTest, TheStepBoundFollowsTheRunAndIsConfigurable) {
  DaemonOptions options;
  options.limits.max_step_jump = 1000;
  Start(options);
  client::IngestStream stream(channel_);
  ASSERT_TRUE(stream.Open(MakeHello("jumps")).ok());
  v1::Batch batch;
  for (int64_t step : {900, 2000, 1800, 2700, 3801, -1}) *batch.add_records() = LossRecord(step);
  auto ack = stream.SendAndWait(batch);
  ASSERT_TRUE(ack.has_value());
  // 900 (within 1000 of 0), 1800 (of 900) and 2700 (of 1800) are accepted;
  // 2000 is more than 1000 beyond 900, 3801 beyond 2700; -1 is negative.
  EXPECT_EQ(ack->accepted(), 3u);
  ASSERT_EQ(ack->rejections_size(), 3);
  EXPECT_EQ(ack->rejections(0).index(), 1u);
  EXPECT_TRUE(StartsWith(ack->rejections(0).reason(), "step_out_of_range: step 2000 is more than 1000"));
  EXPECT_EQ(ack->rejections(1).index(), 4u);
  EXPECT_TRUE(StartsWith(ack->rejections(1).reason(), "step_out_of_range: "));
  EXPECT_TRUE(StartsWith(ack->rejections(2).reason(), "negative_step: "));
  // Going back (a run resumed from a checkpoint) is not this check's business.
  ack = stream.SendAndWait(OneRecord(LossRecord(10)));
  ASSERT_TRUE(ack.has_value());
  EXPECT_EQ(ack->accepted(), 1u);
  EXPECT_TRUE(stream.Close().ok());
}

}  // namespace
}  // namespace foreshock::server
