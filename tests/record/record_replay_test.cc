// foreshockd --record_dir and foreshockctl's replay, in process: a recording
// written by hand (with bytes no protobuf serializer would produce) is
// replayed into a recording daemon, whose own recording must hold the very
// same bytes; rejected and malformed messages are recorded too; an unusable
// directory drops frames without failing any stream.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "ctl/replay.h"
#include "foreshock/v1/ingest.pb.h"
#include "record/recording.h"
#include "server/daemon.h"
#include "server/ingest/stream_recorder.h"
#include "tests/server/metric_reader.h"

namespace foreshock {
namespace {

namespace fs = std::filesystem;
namespace v1 = foreshock::v1;
using testing::CounterValue;
using testing::MetricValue;

std::string Varint(uint64_t v) {
  std::string out;
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
  return out;
}
std::string LengthDelimited(int field, const std::string& bytes) {
  return Varint(static_cast<uint64_t>(field) << 3 | 2) + Varint(bytes.size()) + bytes;
}

// A Hello with its fields in reverse order and an unknown field 99: valid,
// but not what SerializeAsString would write for the parsed message.
std::string OddHello(const std::string& run) {
  std::string hello = Varint(3 << 3) + Varint(0);                // rank = 0
  hello += Varint(uint64_t{99} << 3) + Varint(1);                 // unknown field 99
  hello += LengthDelimited(2, "replay-test");                     // job
  hello += LengthDelimited(1, run);                               // run_id
  return LengthDelimited(1, hello);                               // StreamRequest.hello
}

std::string ScalarsBatch(uint64_t seq, std::vector<int64_t> steps) {
  v1::StreamRequest request;
  v1::Batch* batch = request.mutable_batch();
  batch->set_seq(seq);
  for (int64_t step : steps) {
    v1::Record* record = batch->add_records();
    record->set_step(step);
    record->mutable_scalars()->set_loss(2.0 + 0.01 * static_cast<double>(step));
    record->mutable_scalars()->set_lr(1e-3);
  }
  return request.SerializeAsString();
}

class RecordReplayTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("record_replay_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    daemon_.reset();
    fs::remove_all(dir_);
  }

  void StartDaemon(const std::string& record_dir) {
    server::DaemonOptions options;
    options.listen = "127.0.0.1:0";
    options.metrics_listen = "127.0.0.1:0";
    options.workers = 1;
    options.record_dir = record_dir;
    daemon_ = std::make_unique<server::Daemon>(options);
    ASSERT_TRUE(daemon_->Start().ok());
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(daemon_->grpc_port()),
                                   grpc::InsecureChannelCredentials());
  }

  std::string WriteSource(const std::vector<std::string>& payloads) {
    const std::string path = (dir_ / "source.fsrec").string();
    record::RecordingWriter writer;
    std::string error;
    EXPECT_TRUE(writer.Create(path, &error)) << error;
    int64_t t = 1714521600000000;
    for (const std::string& p : payloads) EXPECT_TRUE(writer.Append(p, t += 1000, &error)) << error;
    EXPECT_TRUE(writer.Close(&error)) << error;
    return path;
  }

  ctl::ReplayResult Replay(const std::string& path) {
    return ctl::ReplayFile(channel_, path, ctl::ReplaySpeed::kMax, 0,
                           std::chrono::steady_clock::now());
  }

  static std::vector<fs::path> Recordings(const fs::path& dir) {
    std::vector<fs::path> out;
    for (const auto& entry : fs::directory_iterator(dir)) {
      if (entry.path().extension() == ".fsrec") out.push_back(entry.path());
    }
    std::sort(out.begin(), out.end());
    return out;
  }

  static std::vector<record::Frame> ReadAll(const fs::path& path, record::ReadStatus* end) {
    record::RecordingReader reader;
    EXPECT_TRUE(reader.Open(path.string())) << reader.error();
    std::vector<record::Frame> frames;
    record::Frame frame;
    while ((*end = reader.Next(&frame)) == record::ReadStatus::kFrame) frames.push_back(frame);
    return frames;
  }

  double Frames(const std::string& outcome) {
    return CounterValue(daemon_->registry(), "foreshock_record_frames_total",
                        {{"outcome", outcome}});
  }
  bool WaitForCounter(const std::string& outcome, double want) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (Frames(outcome) != want) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return true;
  }

  fs::path dir_;
  std::unique_ptr<server::Daemon> daemon_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(RecordReplayTest, RecordingHoldsTheBytesReceivedIncludingRejectedOnes) {
  const fs::path out = dir_ / "recorded";
  StartDaemon(out.string());
  const std::vector<std::string> payloads = {
      OddHello("replay-run"),
      ScalarsBatch(1, {0, 1, 2}),
      ScalarsBatch(2, {3, -4, 5}),  // step -4 is rejected (negative_step)
      ScalarsBatch(2, {6}),         // seq not above 2: rejected (non_increasing_seq)
      ScalarsBatch(3, {7}),
  };
  const std::string source = WriteSource(payloads);

  const ctl::ReplayResult result = Replay(source);
  EXPECT_TRUE(result.ok()) << result.Summary();
  EXPECT_EQ(result.hellos, 1u);
  EXPECT_EQ(result.batches, 4u);
  EXPECT_EQ(result.records, 8u);
  EXPECT_EQ(result.hello_acks, 1u);
  EXPECT_EQ(result.acks, 4u);
  EXPECT_EQ(result.accepted, 6u);
  EXPECT_EQ(result.rejected, 2u);
  EXPECT_EQ(result.rejection_reasons.at("negative_step"), 1u);
  EXPECT_EQ(result.rejection_reasons.at("non_increasing_seq"), 1u);
  EXPECT_EQ(result.session_id, "s1");
  EXPECT_TRUE(result.status.ok()) << result.status.error_message();

  // The stream has ended: its file is flushed and closed without a shutdown.
  EXPECT_TRUE(WaitForCounter("written", 5)) << "written: " << Frames("written");
  EXPECT_EQ(Frames("dropped"), 0);
  daemon_.reset();

  const auto files = Recordings(out);
  ASSERT_EQ(files.size(), 1u);
  EXPECT_TRUE(std::regex_match(files[0].filename().string(),
                               std::regex(R"(\d{8}T\d{6}-replay-run-rank0-s1\.fsrec)")))
      << files[0];
  record::ReadStatus end;
  const auto frames = ReadAll(files[0], &end);
  EXPECT_EQ(end, record::ReadStatus::kEnd);
  ASSERT_EQ(frames.size(), payloads.size());
  const int64_t now_us = std::chrono::duration_cast<std::chrono::microseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  for (size_t i = 0; i < frames.size(); ++i) {
    EXPECT_EQ(frames[i].payload, payloads[i]) << "frame " << i << " differs from what was sent";
    EXPECT_LE(frames[i].recv_unix_us, now_us);
    EXPECT_GT(frames[i].recv_unix_us, now_us - 60'000'000);
    if (i > 0) {
      EXPECT_GE(frames[i].recv_unix_us, frames[i - 1].recv_unix_us);
    }
  }
  v1::StreamRequest reparsed;
  ASSERT_TRUE(reparsed.ParseFromString(frames[0].payload));
  EXPECT_NE(reparsed.SerializeAsString(), frames[0].payload)
      << "the test's Hello should not be canonical, or it proves nothing";
}

TEST_F(RecordReplayTest, MalformedAndRejectedStreamsAreRecordedAndReplayFails) {
  const fs::path out = dir_ / "recorded";
  StartDaemon(out.string());
  // A run id that needs sanitizing for a file name.
  {
    const std::string source = WriteSource({OddHello("a/b c"), ScalarsBatch(1, {0})});
    const ctl::ReplayResult result = Replay(source);
    EXPECT_TRUE(result.ok()) << result.Summary();
    fs::remove(source);
  }
  // A Hello the daemon rejects: the stream ends, the recording stays.
  v1::StreamRequest bad_hello;
  bad_hello.mutable_hello()->set_run_id("rejected-run");
  bad_hello.mutable_hello()->set_rank(3);
  bad_hello.mutable_hello()->mutable_model()->set_n_layers(-1);
  {
    const std::string source =
        WriteSource({bad_hello.SerializeAsString(), ScalarsBatch(1, {0})});
    const ctl::ReplayResult result = Replay(source);
    EXPECT_FALSE(result.ok());
    EXPECT_EQ(result.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(result.status.error_message().find("bad_hello"), std::string::npos)
        << result.status.error_message();
    fs::remove(source);
  }
  // Bytes that are no StreamRequest after a good Hello.
  {
    const std::string source =
        WriteSource({OddHello("malformed-run"), std::string("\xff\xff\xff", 3)});
    const ctl::ReplayResult result = Replay(source);
    EXPECT_FALSE(result.ok());
    EXPECT_EQ(result.unparsed, 1u);
    EXPECT_EQ(result.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(result.status.error_message().find("malformed_request"), std::string::npos)
        << result.status.error_message();
  }
  EXPECT_EQ(CounterValue(daemon_->registry(), "foreshock_ingest_rejected_total",
                         {{"reason", "malformed_request"}}),
            1);
  daemon_.reset();
  const auto files = Recordings(out);
  ASSERT_EQ(files.size(), 3u);
  bool saw_sanitized = false, saw_rejected = false, saw_malformed = false;
  for (const fs::path& file : files) {
    record::ReadStatus end;
    const auto frames = ReadAll(file, &end);
    EXPECT_EQ(end, record::ReadStatus::kEnd);
    const std::string name = file.filename().string();
    if (name.find("-a_b_c-rank0-") != std::string::npos) {
      saw_sanitized = true;
      ASSERT_EQ(frames.size(), 2u);
      EXPECT_EQ(frames[0].payload, OddHello("a/b c"));
    } else if (name.find("-rejected-run-rank3-") != std::string::npos) {
      saw_rejected = true;
      ASSERT_GE(frames.size(), 1u);  // the batch may or may not have arrived before the end
      EXPECT_EQ(frames[0].payload, bad_hello.SerializeAsString());
    } else if (name.find("-malformed-run-rank0-") != std::string::npos) {
      saw_malformed = true;
      ASSERT_EQ(frames.size(), 2u);
      EXPECT_EQ(frames[1].payload, std::string("\xff\xff\xff", 3));
    }
  }
  EXPECT_TRUE(saw_sanitized);
  EXPECT_TRUE(saw_rejected);
  EXPECT_TRUE(saw_malformed);
}

TEST_F(RecordReplayTest, AnUnusableDirectoryDropsFramesButNeverFailsAStream) {
  // A directory that cannot be created: its parent is a regular file.
  const fs::path blocker = dir_ / "not-a-directory";
  std::ofstream(blocker) << "x";
  StartDaemon((blocker / "recordings").string());
  const std::string source =
      WriteSource({OddHello("unrecorded"), ScalarsBatch(1, {0, 1}), ScalarsBatch(2, {2})});
  const ctl::ReplayResult result = Replay(source);
  EXPECT_TRUE(result.ok()) << result.Summary();
  EXPECT_EQ(result.accepted, 3u);
  // The recorder counts on its own thread: wait for it.
  EXPECT_TRUE(WaitForCounter("dropped", 3)) << "dropped: " << Frames("dropped");
  EXPECT_EQ(Frames("written"), 0);
  daemon_.reset();
  EXPECT_TRUE(fs::is_regular_file(blocker));
}

TEST_F(RecordReplayTest, AFullRecorderQueueDropsAndCountsButKeepsTheFirstMessage) {
  prometheus::Registry registry;
  server::DaemonMetrics metrics(registry, false);
  server::StreamRecorderOptions options;
  options.dir = (dir_ / "queue").string();
  options.max_queued_bytes = 0;  // every message but a stream's first is over the bound
  std::string hello = OddHello("queue-run"), batch = ScalarsBatch(1, {0});
  {
    server::StreamRecorder recorder(options, metrics);
    grpc::Slice hello_slice(hello), batch_slice(batch);
    const grpc::ByteBuffer hello_bytes(&hello_slice, 1), batch_bytes(&batch_slice, 1);
    recorder.Open(7, server::StreamRecorder::FileName(1714521600000000, "queue-run", 2, 7));
    EXPECT_TRUE(recorder.Record(7, hello_bytes, 1, /*force=*/true));
    EXPECT_FALSE(recorder.Record(7, batch_bytes, 2));
    recorder.Close(7);
    recorder.Flush();
    EXPECT_EQ(CounterValue(registry, "foreshock_record_frames_total", {{"outcome", "written"}}), 1);
    EXPECT_EQ(CounterValue(registry, "foreshock_record_frames_total", {{"outcome", "dropped"}}), 1);
  }
  record::ReadStatus end;
  const auto frames = ReadAll(dir_ / "queue" / "20240501T000000-queue-run-rank2-s7.fsrec", &end);
  EXPECT_EQ(end, record::ReadStatus::kEnd);
  ASSERT_EQ(frames.size(), 1u);
  EXPECT_EQ(frames[0].payload, hello);
  EXPECT_EQ(server::StreamRecorder::FileName(0, "", -1, 3), "19700101T000000-unknown-rankNA-s3.fsrec");
}

TEST_F(RecordReplayTest, AFileNameInUseGetsASuffix) {
  prometheus::Registry registry;
  server::DaemonMetrics metrics(registry, false);
  server::StreamRecorderOptions options;
  options.dir = dir_.string();
  const std::string name = "taken.fsrec";
  std::ofstream(dir_ / name) << "someone else's";
  {
    server::StreamRecorder recorder(options, metrics);
    recorder.Open(1, name);
    std::string hello = OddHello("x");
    grpc::Slice slice(hello);
    EXPECT_TRUE(recorder.Record(1, grpc::ByteBuffer(&slice, 1), 1));
  }  // the destructor closes what is open
  record::ReadStatus end;
  EXPECT_EQ(ReadAll(dir_ / "taken-2.fsrec", &end).size(), 1u);
  EXPECT_EQ(end, record::ReadStatus::kEnd);
}

// Issue 36: --record_max_mb. The directory holds an old recording from an
// earlier daemon, a closed one, and a live one that outgrows the bound:
// closed recordings go oldest first, the live one is never touched, and what
// it could not hold is dropped and counted, so its file stays a complete
// prefix of its stream.
uint64_t DirectoryBytes(const fs::path& dir) {
  uint64_t bytes = 0;
  for (const auto& entry : fs::directory_iterator(dir)) bytes += entry.file_size();
  return bytes;
}

TEST_F(RecordReplayTest, RetentionKeepsTheDirectoryUnderItsBoundAndNeverTouchesAnOpenRecording) {
  prometheus::Registry registry;
  server::DaemonMetrics metrics(registry, false);
  const fs::path dir = dir_ / "bounded";
  fs::create_directories(dir);
  const fs::path old_file = dir / "20200101T000000-old-rank0-s1.fsrec";
  std::ofstream(old_file) << std::string(3000, 'x');
  std::ofstream(dir / "notes.txt") << "not a recording: neither counted nor deleted";
  server::StreamRecorderOptions options(dir.string());
  options.max_total_bytes = 8000;
  const std::string hello = OddHello("bounded-run");
  std::vector<std::string> batches;
  for (uint64_t i = 0; i < 200; ++i) batches.push_back(ScalarsBatch(i + 1, {int64_t(i)}));
  uint64_t live_written = 0;
  {
    server::StreamRecorder recorder(options, metrics);
    EXPECT_EQ(MetricValue(registry, "foreshock_record_bytes"), 3000);
    auto record = [&](uint64_t session, const std::string& bytes, bool first) {
      grpc::Slice slice(bytes);
      return recorder.Record(session, grpc::ByteBuffer(&slice, 1), 1, first);
    };
    // A closed recording of about 2.7 KB.
    recorder.Open(2, server::StreamRecorder::FileName(1714521600000000, "closed-run", 0, 2));
    record(2, hello, true);
    for (int i = 0; i < 60; ++i) record(2, batches[i], false);
    recorder.Close(2);
    recorder.Flush();
    const uint64_t closed_bytes = DirectoryBytes(dir) - 3000 - 44;
    ASSERT_GT(closed_bytes, 2000u);
    // The live one: far more than the bound.
    recorder.Open(3, server::StreamRecorder::FileName(1714521700000000, "bounded-run", 0, 3));
    record(3, hello, true);
    for (const std::string& batch : batches) record(3, batch, false);
    recorder.Flush();
    // Both closed recordings are gone, oldest first; the live one holds what fit.
    EXPECT_FALSE(fs::exists(old_file));
    EXPECT_EQ(CounterValue(registry, "foreshock_record_files_deleted_total", {{"reason", "size"}}), 2);
    EXPECT_TRUE(fs::exists(dir / "notes.txt"));
    const uint64_t recordings = DirectoryBytes(dir) - 44;
    EXPECT_LE(recordings, options.max_total_bytes);
    EXPECT_EQ(MetricValue(registry, "foreshock_record_bytes"), recordings);
    EXPECT_GT(CounterValue(registry, "foreshock_record_frames_total", {{"outcome", "dropped"}}), 0);
    live_written = recordings;
  }
  record::ReadStatus end;
  const auto frames = ReadAll(dir / "20240501T000140-bounded-run-rank0-s3.fsrec", &end);
  EXPECT_EQ(end, record::ReadStatus::kEnd);
  ASSERT_GT(frames.size(), 10u);
  ASSERT_LT(frames.size(), 201u);
  EXPECT_EQ(frames[0].payload, hello);
  for (size_t i = 1; i < frames.size(); ++i) EXPECT_EQ(frames[i].payload, batches[i - 1]) << i;
  EXPECT_GT(live_written, options.max_total_bytes - 200);  // it filled the bound
}

TEST_F(RecordReplayTest, RetentionDeletesClosedRecordingsOlderThanTheMaxAge) {
  prometheus::Registry registry;
  server::DaemonMetrics metrics(registry, false);
  const fs::path dir = dir_ / "aged";
  fs::create_directories(dir);
  const fs::path stale = dir / "20200101T000000-stale-rank0-s1.fsrec";
  const fs::path recent = dir / "20200101T000000-recent-rank0-s2.fsrec";
  std::ofstream(stale) << std::string(100, 'x');
  std::ofstream(recent) << std::string(100, 'x');
  fs::last_write_time(stale, fs::file_time_type::clock::now() - std::chrono::hours(3));
  server::StreamRecorderOptions options(dir.string());
  options.max_age = std::chrono::hours(2);
  {
    server::StreamRecorder recorder(options, metrics);
    recorder.Flush();  // the first expiry check runs as the writer starts
    for (int i = 0; i < 100 && fs::exists(stale); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    EXPECT_FALSE(fs::exists(stale));
    EXPECT_TRUE(fs::exists(recent));
    EXPECT_EQ(CounterValue(registry, "foreshock_record_files_deleted_total", {{"reason", "age"}}), 1);
    EXPECT_EQ(MetricValue(registry, "foreshock_record_bytes"), 100);
  }
}

TEST_F(RecordReplayTest, WithoutARecordDirNothingIsRecorded) {
  StartDaemon("");
  const std::string source = WriteSource({OddHello("plain"), ScalarsBatch(1, {0})});
  const ctl::ReplayResult result = Replay(source);
  EXPECT_TRUE(result.ok()) << result.Summary();
  EXPECT_TRUE(std::isnan(testing::MetricValue(daemon_->registry(), "foreshock_record_frames_total",
                                              {{"outcome", "written"}})));
}

}  // namespace
}  // namespace foreshock
