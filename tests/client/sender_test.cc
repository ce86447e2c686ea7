// The C++ background sender (client/cpp/foreshock/sender.h) against a real
// foreshockd in this process: Enqueue never waits on the network, a full
// queue drops its oldest records, and every record survives daemon restarts
// exactly once (resent after reconnecting, deduplicated by the daemon).
#include "foreshock/sender.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <future>
#include <iostream>
#include <optional>
#include <set>
#include <thread>

#include "foreshock/v1/query.grpc.pb.h"
#include "server/daemon.h"
#include "server/pipeline/series_store.h"
#include "tests/server/metric_reader.h"

namespace foreshock::client {
namespace {

namespace v1 = foreshock::v1;
using Clock = std::chrono::steady_clock;

int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

v1::Record LossRecord(int64_t step) {
  v1::Record record;
  record.set_step(step);
  record.mutable_scalars()->set_loss(1.0 + 0.001 * static_cast<double>(step));
  return record;
}

v1::Hello MakeHello(const std::string& run) {
  v1::Hello hello;
  hello.set_run_id(run);
  hello.set_job("sender-test");
  hello.set_rank(0);
  return hello;
}

SenderOptions FastBackoff() {
  SenderOptions options;
  options.backoff_initial = std::chrono::milliseconds(20);
  options.backoff_max = std::chrono::milliseconds(200);
  return options;
}

class SenderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("foreshock_sender_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    port_ = FreePort();
  }
  void TearDown() override {
    daemon_.reset();
    std::filesystem::remove_all(dir_);
  }
  std::string endpoint() const { return "127.0.0.1:" + std::to_string(port_); }
  void Start(std::function<void(server::DaemonOptions&)> configure = {}) {
    server::DaemonOptions options;
    options.listen = endpoint();  // the same port across restarts
    options.metrics_listen = "127.0.0.1:0";
    options.workers = 2;
    options.store_options.data_dir = dir_.string();
    options.store_options.fsync = store::FsyncPolicy::kEvery;
    if (configure) configure(options);
    daemon_ = std::make_unique<server::Daemon>(options);
    ASSERT_TRUE(daemon_->Start().ok());
  }
  void Kill() {  // no grace: open streams are cut
    daemon_->Shutdown(std::chrono::milliseconds(0));
    daemon_.reset();
  }
  std::vector<server::Point> Loss(const std::string& run) {
    return daemon_->store().Range(server::SeriesKey{run, "loss", -1, -1}, INT64_MIN, INT64_MAX);
  }

  // The run as the daemon's Query service lists it (real gRPC).
  std::optional<v1::RunInfo> Run(const std::string& run) {
    auto stub = v1::Query::NewStub(grpc::CreateChannel(endpoint(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    v1::ListRunsResponse response;
    EXPECT_TRUE(stub->ListRuns(&context, v1::ListRunsRequest(), &response).ok());
    for (const v1::RunInfo& info : response.runs()) {
      if (info.run() == run) return info;
    }
    return std::nullopt;
  }

  std::filesystem::path dir_;
  int port_ = 0;
  std::unique_ptr<server::Daemon> daemon_;
};

TEST_F(SenderTest, DeliversEveryRecordOnceAcrossDaemonRestarts) {
  Start();
  Sender sender(endpoint(), MakeHello("restarts"), FastBackoff());
  int64_t step = 0;
  uint64_t in_flight_at_kill = 0;
  for (int cycle = 0; cycle < 3; ++cycle) {
    for (int i = 0; i < 1000 && !sender.connected(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_TRUE(sender.connected()) << "cycle " << cycle;
    for (int i = 0; i < 200; ++i) {
      sender.Enqueue(LossRecord(step++));
      if (i % 20 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    const SenderStats before = sender.stats();
    in_flight_at_kill += before.queued + before.unacked;
    Kill();
    for (int i = 0; i < 50; ++i) sender.Enqueue(LossRecord(step++));  // while it is down
    Start();
  }
  ASSERT_TRUE(sender.Close(std::chrono::seconds(30))) << "not everything was acknowledged";
  const SenderStats stats = sender.stats();
  EXPECT_EQ(stats.enqueued, static_cast<uint64_t>(step));
  EXPECT_EQ(stats.acked + stats.duplicates, static_cast<uint64_t>(step));
  EXPECT_EQ(stats.dropped_queue_full + stats.dropped_unacked, 0u);
  EXPECT_EQ(stats.reconnects, 3u);  // one per restart, however many attempts each took
  std::cout << "records queued or unacked at the kills: " << in_flight_at_kill
            << ", resent: " << stats.resent << ", acked as duplicates: " << stats.duplicates
            << "\n";

  const std::vector<server::Point> loss = Loss("restarts");
  ASSERT_EQ(loss.size(), static_cast<size_t>(step));  // each step exactly once
  for (int64_t i = 0; i < step; ++i) EXPECT_EQ(loss[static_cast<size_t>(i)].step, i);
}

TEST_F(SenderTest, EnqueueNeverWaitsAndAFullQueueDropsTheOldest) {
  // No daemon at all: every record waits in the queue, whose bound is ~50 records.
  SenderOptions options = FastBackoff();
  const size_t record_bytes = LossRecord(1000).ByteSizeLong();
  options.max_queue_bytes = 50 * record_bytes;
  Sender sender(endpoint(), MakeHello("offline"), options);
  // Enqueue's latency is a benchmark's business (tests/bench/enqueue_latency.py);
  // here: it returns, and the bound drops what does not fit.
  for (int64_t step = 1000; step < 3000; ++step) sender.Enqueue(LossRecord(step));
  SenderStats stats = sender.stats();
  EXPECT_EQ(stats.enqueued, 2000u);
  EXPECT_EQ(stats.queued, 50u);
  EXPECT_EQ(stats.dropped_queue_full, 1950u);
  EXPECT_FALSE(sender.connected());
  for (int i = 0; i < 500 && sender.stats().failed_connects < 2; ++i) {  // it keeps trying
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_GE(sender.stats().failed_connects, 2u);
  EXPECT_EQ(sender.stats().reconnects, 0u);  // never accepted yet

  // The daemon comes up: the newest 50 are delivered, the dropped ones never.
  Start();
  ASSERT_TRUE(sender.Close(std::chrono::seconds(30)));
  const std::vector<server::Point> loss = Loss("offline");
  ASSERT_EQ(loss.size(), 50u);
  EXPECT_EQ(loss.front().step, 2950);
  EXPECT_EQ(loss.back().step, 2999);
}

TEST_F(SenderTest, ABatchOverTheDaemonsMessageLimitIsDroppedNotResentForever) {
  Start([](server::DaemonOptions& options) { options.max_message_bytes = 1 << 20; });
  Sender sender(endpoint(), MakeHello("too-large"), FastBackoff());
  v1::Record big = LossRecord(1);
  big.mutable_qk()->set_layer(0);  // 1.5 MiB: over the 1 MiB limit
  big.mutable_qk()->mutable_q()->set_data(std::string(3 << 19, '\0'));
  sender.Enqueue(big);
  for (int i = 0; i < 200 && sender.stats().dropped_too_large == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (int64_t step = 2; step < 5; ++step) sender.Enqueue(LossRecord(step));
  ASSERT_TRUE(sender.Close(std::chrono::seconds(20)));
  const SenderStats stats = sender.stats();
  EXPECT_EQ(stats.dropped_too_large, 1u);
  EXPECT_EQ(stats.acked, 3u);
  EXPECT_EQ(Loss("too-large").size(), 3u);
  EXPECT_EQ(foreshock::testing::CounterValue(daemon_->registry(),
                                             "foreshock_ingest_rejected_total",
                                             {{"reason", "message_too_large"}}),
            1);
}

TEST_F(SenderTest, RejectionsTheAckOnlyCountsAreCountedToo) {
  // An Ack lists at most 256 rejections and counts the rest (issue 34): the
  // stats must settle every record all the same. Queued while the daemon is
  // down, the 1,000 records go out in one batch.
  Sender sender(endpoint(), MakeHello("omitted"), FastBackoff());
  for (int64_t step = 0; step < 1000; ++step) {
    v1::Record record;  // no payload: missing_payload
    record.set_step(step);
    sender.Enqueue(record);
  }
  Start();
  ASSERT_TRUE(sender.Close(std::chrono::seconds(30)));
  const SenderStats stats = sender.stats();
  EXPECT_EQ(stats.acked, 0u);
  EXPECT_EQ(stats.rejected, 1000u);
  EXPECT_EQ(foreshock::testing::CounterValue(daemon_->registry(),
                                             "foreshock_ingest_rejected_total",
                                             {{"reason", "missing_payload"}}),
            1000);
}

TEST_F(SenderTest, ARefusedStreamWaitsForTheDaemonsRetryHint) {
  // --max_streams=1 and the slot is taken: the daemon refuses with
  // retry-after-ms 1000, which replaces the sender's 20 ms backoff.
  Start([](server::DaemonOptions& options) { options.limits.max_streams = 1; });
  IngestStream holder(grpc::CreateChannel(endpoint(), grpc::InsecureChannelCredentials()));
  ASSERT_TRUE(holder.Open(MakeHello("holder")).ok());
  Sender sender(endpoint(), MakeHello("hinted"), FastBackoff());
  sender.Enqueue(LossRecord(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(1800));
  // 20 ms doubling to 200 ms would have retried ~12 times; with the hint
  // (500-1000 ms after jitter) at most 4.
  EXPECT_LE(sender.stats().failed_connects, 5u);
  EXPECT_GE(sender.stats().failed_connects, 2u);
  EXPECT_EQ(sender.stats().reconnects, 0u);
  EXPECT_GE(foreshock::testing::CounterValue(daemon_->registry(),
                                             "foreshock_ingest_rejected_total",
                                             {{"reason", "too_many_streams"}}),
            1);
  EXPECT_TRUE(holder.Close().ok());  // the slot frees: the record gets through
  ASSERT_TRUE(sender.Close(std::chrono::seconds(20)));
  EXPECT_EQ(Loss("hinted").size(), 1u);
}

// Issue 27: a rank another sender's live stream holds is refused
// (ALREADY_EXISTS rank_in_use). The sender counts it, retries after the
// hint, and delivers once the holder's stream ends.
TEST_F(SenderTest, ARankAnotherSenderHoldsIsRetriedAndCounted) {
  Start();
  IngestStream holder(grpc::CreateChannel(endpoint(), grpc::InsecureChannelCredentials()));
  v1::Hello held = MakeHello("shared-rank");
  held.set_first_seq(1);
  held.set_sender_id(424242);
  ASSERT_TRUE(holder.Open(held).ok());
  Sender sender(endpoint(), MakeHello("shared-rank"), FastBackoff());
  sender.Enqueue(LossRecord(1));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (sender.stats().rank_in_use == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_GE(sender.stats().rank_in_use, 1u);
  EXPECT_EQ(sender.stats().acked, 0u);
  EXPECT_GE(foreshock::testing::CounterValue(daemon_->registry(),
                                             "foreshock_ingest_rejected_total",
                                             {{"reason", "rank_in_use"}}),
            1);
  EXPECT_TRUE(holder.Close().ok());  // the rank frees: the record gets through
  ASSERT_TRUE(sender.Close(std::chrono::seconds(20)));
  EXPECT_EQ(Loss("shared-rank").size(), 1u);
}

TEST_F(SenderTest, CloseEndsTheRunUnlessToldToKeepItOpen) {
  Start();
  {
    Sender ending(endpoint(), MakeHello("ends"), FastBackoff());
    Sender keeping(endpoint(), MakeHello("kept-open"), FastBackoff());
    for (int64_t step = 0; step < 5; ++step) {
      ending.Enqueue(LossRecord(step));
      keeping.Enqueue(LossRecord(step));
    }
    ASSERT_TRUE(ending.Close(std::chrono::seconds(20)));
    ASSERT_TRUE(keeping.Close(std::chrono::seconds(20), CloseMode::kKeepRunOpen));
    EXPECT_EQ(ending.stats().acked, 5u);  // the goodbye carries no record
  }
  const auto ended = Run("ends");
  const auto kept = Run("kept-open");
  ASSERT_TRUE(ended && kept);
  EXPECT_TRUE(ended->ended());
  EXPECT_EQ(ended->last_step(), 4);
  EXPECT_FALSE(kept->ended());
  EXPECT_EQ(kept->last_step(), 4);
}

TEST_F(SenderTest, TheGoodbyeSurvivesADaemonRestart) {
  // Closing while the daemon is down: the goodbye waits (after the records)
  // and goes out, in order, once the daemon is back.
  Start();
  Sender sender(endpoint(), MakeHello("goodbye-later"), FastBackoff());
  for (int64_t step = 0; step < 3; ++step) sender.Enqueue(LossRecord(step));
  for (int i = 0; i < 1000 && sender.stats().acked < 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(sender.stats().acked, 3u);
  Kill();
  sender.Enqueue(LossRecord(3));
  std::thread restart([this] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    Start();
  });
  const bool drained = sender.Close(std::chrono::seconds(30));
  restart.join();
  ASSERT_TRUE(drained);
  const auto run = Run("goodbye-later");
  ASSERT_TRUE(run);
  EXPECT_TRUE(run->ended());
  EXPECT_EQ(run->last_step(), 3);
}

TEST_F(SenderTest, CloseGivesUpAfterItsTimeoutWhenTheDaemonNeverComes) {
  Sender sender(endpoint(), MakeHello("never"), FastBackoff());
  sender.Enqueue(LossRecord(1));
  // The daemon never comes, so a Close that ignored its timeout would never
  // return: the 60 s here is a liveness guard, not a latency bound.
  auto closed = std::async(std::launch::async,
                           [&] { return sender.Close(std::chrono::milliseconds(300)); });
  ASSERT_EQ(closed.wait_for(std::chrono::seconds(60)), std::future_status::ready);
  EXPECT_FALSE(closed.get());
  EXPECT_EQ(sender.stats().queued, 1u);
}

}  // namespace
}  // namespace foreshock::client
