// Dedup of resent batches by (run, rank, seq): the C++ client's SenderState
// resends unacked batches on a new stream and after a daemon restart; the
// daemon acks them as duplicates and stores each point once.
#include <gtest/gtest.h>

#include <filesystem>
#include <thread>

#include "foreshock/client.h"
#include "server/daemon.h"
#include "server/ingest/delivery.h"
#include "server/pipeline/series_store.h"
#include "tests/server/metric_reader.h"

namespace foreshock::server {
namespace {

namespace v1 = foreshock::v1;
using foreshock::client::IngestStream;
using foreshock::client::SenderState;

v1::Batch LossBatch(int64_t first_step, int n) {
  v1::Batch batch;
  for (int i = 0; i < n; ++i) {
    v1::Record* record = batch.add_records();
    record->set_step(first_step + i);
    record->mutable_scalars()->set_loss(0.5 * static_cast<double>(first_step + i));
  }
  return batch;
}

v1::Hello MakeHello() {
  v1::Hello hello;
  hello.set_run_id("dedup");
  hello.set_job("t");
  hello.set_rank(2);
  return hello;
}

class DeliveryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("foreshock_delivery_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    Start();
  }
  void TearDown() override {
    daemon_.reset();
    std::filesystem::remove_all(dir_);
  }
  void Start() {
    DaemonOptions options;
    options.listen = "127.0.0.1:0";
    options.metrics_listen = "127.0.0.1:0";
    options.workers = 2;
    options.store_options.data_dir = dir_.string();
    daemon_ = std::make_unique<Daemon>(options);
    ASSERT_TRUE(daemon_->Start().ok());
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(daemon_->grpc_port()),
                                   grpc::InsecureChannelCredentials());
  }
  void Restart() {
    daemon_->Shutdown(std::chrono::milliseconds(0));
    daemon_.reset();
    Start();
  }
  std::vector<Point> Loss() {
    return daemon_->store().Range(SeriesKey{"dedup", "loss", -1, -1}, INT64_MIN, INT64_MAX);
  }

  // Until the daemon has stored the batches sent (their acks are not read).
  void WaitForPoints(size_t n) {
    for (int i = 0; i < 500 && Loss().size() < n; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_EQ(Loss().size(), n);
  }

  std::filesystem::path dir_;
  std::unique_ptr<Daemon> daemon_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(DeliveryTest, UnackedBatchesResentOnANewStreamAreAckedAsDuplicatesAndStoredOnce) {
  SenderState sender;
  const uint64_t first = sender.first_seq();
  {
    IngestStream stream(channel_);
    ASSERT_TRUE(stream.Open(MakeHello(), &sender).ok());
    ASSERT_TRUE(stream.Send(LossBatch(0, 5)));
    ASSERT_TRUE(stream.Send(LossBatch(5, 5)));
    WaitForPoints(10);
    // The stream breaks before its acks are read: both batches stay unacked.
  }
  ASSERT_EQ(sender.unacked().size(), 2u);
  EXPECT_EQ(sender.first_seq(), first);

  IngestStream stream(channel_);
  ASSERT_TRUE(stream.Open(MakeHello(), &sender).ok());  // resends seqs first, first + 1
  for (uint64_t seq : {first, first + 1}) {
    auto ack = stream.ReadAck();
    ASSERT_TRUE(ack.has_value());
    EXPECT_EQ(ack->seq(), seq);
    EXPECT_EQ(ack->accepted(), 0u);
    EXPECT_EQ(ack->duplicates(), 5u);
  }
  auto ack = stream.SendAndWait(LossBatch(10, 5));
  ASSERT_TRUE(ack.has_value());
  EXPECT_EQ(ack->seq(), first + 2);  // seq continues across streams
  EXPECT_EQ(ack->accepted(), 5u);
  EXPECT_TRUE(stream.Close().ok());
  EXPECT_TRUE(sender.unacked().empty());

  const std::vector<Point> loss = Loss();
  ASSERT_EQ(loss.size(), 15u);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(loss[i].step, i);
  EXPECT_EQ(foreshock::testing::CounterValue(daemon_->registry(),
                                             "foreshock_ingest_duplicate_batches_total", {}),
            2);
}

TEST_F(DeliveryTest, MarksSurviveARestartAndOldClientsAreNotDeduplicated) {
  SenderState sender;
  {
    IngestStream stream(channel_);
    ASSERT_TRUE(stream.Open(MakeHello(), &sender).ok());
    ASSERT_TRUE(stream.Send(LossBatch(0, 3)));
    WaitForPoints(3);
  }
  Restart();
  {
    IngestStream stream(channel_);
    ASSERT_TRUE(stream.Open(MakeHello(), &sender).ok());
    auto ack = stream.ReadAck();
    ASSERT_TRUE(ack.has_value());
    EXPECT_EQ(ack->duplicates(), 3u);
    EXPECT_TRUE(stream.Close().ok());
  }
  EXPECT_EQ(Loss().size(), 3u);

  // Without Hello.first_seq, seq is per stream and nothing is deduplicated.
  for (int i = 0; i < 2; ++i) {
    IngestStream stream(channel_);
    ASSERT_TRUE(stream.Open(MakeHello()).ok());
    auto ack = stream.SendAndWait(LossBatch(100, 1));
    ASSERT_TRUE(ack.has_value());
    EXPECT_EQ(ack->seq(), 1u);
    EXPECT_EQ(ack->accepted(), 1u);
    EXPECT_EQ(ack->duplicates(), 0u);
    EXPECT_TRUE(stream.Close().ok());
  }
  EXPECT_EQ(Loss().size(), 5u);
}

TEST_F(DeliveryTest, TwoSendersSharingARankAreNotTakenForResends) {
  SenderState a, b;  // e.g. two processes both left at rank 0
  IngestStream stream_a(channel_), stream_b(channel_);
  ASSERT_TRUE(stream_a.Open(MakeHello(), &a).ok());
  auto ack = stream_a.SendAndWait(LossBatch(0, 2));
  ASSERT_TRUE(ack.has_value());
  EXPECT_EQ(ack->accepted(), 2u);
  // While a's stream holds the rank, b is refused (rank ownership, docs/DESIGN.md §3.4).
  EXPECT_EQ(stream_b.Open(MakeHello(), &b).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_TRUE(stream_a.Close().ok());
  IngestStream stream_b2(channel_);
  ASSERT_TRUE(stream_b2.Open(MakeHello(), &b).ok());  // a later first_seq
  ack = stream_b2.SendAndWait(LossBatch(0, 2));
  ASSERT_TRUE(ack.has_value());
  EXPECT_EQ(ack->accepted(), 2u);
  EXPECT_TRUE(stream_b2.Close().ok());
  IngestStream stream_a2(channel_);
  ASSERT_TRUE(stream_a2.Open(MakeHello(), &a).ok());
  ack = stream_a2.SendAndWait(LossBatch(2, 2));  // still below b's first_seq
  ASSERT_TRUE(ack.has_value());
  EXPECT_EQ(ack->accepted(), 2u);
  EXPECT_EQ(ack->duplicates(), 0u);
  EXPECT_TRUE(stream_a2.Close().ok());
  EXPECT_EQ(Loss().size(), 6u);
}

TEST(DeliveryTrackerTest, HighWaterIsContiguousAndCheckpointsRoundTrip) {
  const DeliveryTracker::Sender kR0{"r", 0, 7}, kR0Other{"r", 0, 8}, kR1{"r", 1, 7};
  InMemorySeriesStore store(16);
  DeliveryTracker tracker(store);
  std::vector<bool> settled;
  EXPECT_EQ(tracker.Begin(kR0, 11, nullptr), DeliveryTracker::Admission::kNew);
  EXPECT_EQ(tracker.Begin(kR0, 12, nullptr), DeliveryTracker::Admission::kNew);
  EXPECT_EQ(tracker.Begin(kR0, 12, [&](bool ok) { settled.push_back(ok); }),
            DeliveryTracker::Admission::kInFlight);
  tracker.OnHello(kR0, 11);
  tracker.Commit(kR0, 12, {});
  EXPECT_EQ(settled, std::vector<bool>{true});
  EXPECT_EQ(tracker.HighWater(kR0), 10u);  // 11 is still being stored
  EXPECT_EQ(tracker.Begin(kR0, 12, nullptr), DeliveryTracker::Admission::kDuplicate);
  tracker.Commit(kR0, 11, {});
  EXPECT_EQ(tracker.HighWater(kR0), 12u);
  EXPECT_EQ(tracker.Begin(kR1, 12, nullptr), DeliveryTracker::Admission::kNew);
  // Another sender of the same (run, rank): its own seqs.
  EXPECT_EQ(tracker.Begin(kR0Other, 12, nullptr), DeliveryTracker::Admission::kNew);

  DeliveryTracker restored(store);  // from the events alone
  restored.Restore();
  EXPECT_EQ(restored.Begin(kR0, 11, nullptr), DeliveryTracker::Admission::kDuplicate);
  EXPECT_EQ(restored.Begin(kR0, 13, nullptr), DeliveryTracker::Admission::kNew);

  DeliveryTracker loaded(store);
  ASSERT_TRUE(loaded.Load(tracker.Save()));
  EXPECT_EQ(loaded.HighWater(kR0), 12u);
  EXPECT_FALSE(loaded.Load("3:ab"));
}

}  // namespace
}  // namespace foreshock::server
