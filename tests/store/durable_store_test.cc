// DurableSeriesStore: round trips, reads across cache and disk, rolling,
// recovery from torn and corrupt segments, retention, checkpoints and
// concurrency.
#include "store/durable_store.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <random>
#include <thread>

#include "store/record_format.h"
#include "tests/store/store_test_support.h"

namespace foreshock::store {
namespace {

using testing::CopyDir;
using testing::FlipByte;
using testing::Key;
using testing::ReferenceModel;
using testing::SamePoints;
using testing::ScratchDir;
using testing::SegmentFiles;

constexpr int64_t kAllFrom = std::numeric_limits<int64_t>::min();
constexpr int64_t kAllTo = std::numeric_limits<int64_t>::max();
constexpr int64_t kWallStart = 1'700'000'000'000;

DurableStoreOptions SmallOptions(const std::string& dir) {
  DurableStoreOptions options;
  options.data_dir = dir;
  options.fsync = FsyncPolicy::kNone;
  options.segment_bytes = 1 << 20;
  options.block_bytes = 2048;
  options.block_bytes_per_series = 0;  // many small blocks: reads cross them
  options.cache_points_per_series = 32;
  return options;
}

std::unique_ptr<DurableSeriesStore> OpenStore(const DurableStoreOptions& options) {
  auto store = DurableSeriesStore::Open(options);
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? std::move(*store) : nullptr;
}

// One daemon-like sample: `series` observations of step `step` sharing a
// wall time; values drift slowly and occasionally are not finite.
std::vector<KeyedPoint> MakeBatch(int64_t step, int series, std::mt19937_64& rng,
                                  const std::string& run = "run-a") {
  static const char* kSignals[] = {"qk_increment_entropy", "attention_entropy", "router_flip_rate",
                                   "loss", "grad_norm"};
  std::vector<KeyedPoint> batch;
  for (int s = 0; s < series; ++s) {
    double value = std::sin(double(step) * 0.01 + s) + double(rng() % 1000) * 1e-6;
    if (rng() % 97 == 0) value = std::numeric_limits<double>::quiet_NaN();
    batch.push_back({Key(run, kSignals[s % 5], s / 5, -1), Point{step, value, kWallStart + step * 100}});
  }
  return batch;
}

void ExpectMatchesReference(const SeriesStore& store, const ReferenceModel& reference) {
  for (const SeriesKey& key : reference.Keys()) {
    ASSERT_TRUE(SamePoints(reference.Range(key, kAllFrom, kAllTo), store.Range(key, kAllFrom, kAllTo)))
        << testing::KeyName(key);
  }
}

TEST(DurableStoreTest, RoundTripAcrossCacheDiskAndReopen) {
  ScratchDir dir;
  ReferenceModel reference;
  std::mt19937_64 rng(1);
  {
    auto store = OpenStore(SmallOptions(dir.path()));
    for (int64_t step = 0; step < 300; ++step) {
      const auto batch = MakeBatch(step, 20, rng);
      store->AppendBatch(batch);
      reference.Add(batch);
    }
    ExpectMatchesReference(*store, reference);  // 32 cached, 268 on disk per series
    const DurableStoreStats stats = store->Stats();
    EXPECT_EQ(stats.points_appended, 6000u);
    EXPECT_EQ(stats.batches_appended, 300u);
    EXPECT_GT(stats.disk_bytes_read, 0u);
  }
  auto store = OpenStore(SmallOptions(dir.path()));
  ExpectMatchesReference(*store, reference);
  const DurableStoreStats stats = store->Stats();
  EXPECT_EQ(stats.recovered_points, 6000u);
  EXPECT_EQ(stats.truncated_bytes, 0u);
  EXPECT_EQ(stats.corrupt_segments, 0u);
  EXPECT_TRUE(store->Problems().empty());
}

TEST(DurableStoreTest, RangeByStepAndDownsampleMatchBruteForce) {
  ScratchDir dir;
  ReferenceModel reference;
  std::mt19937_64 rng(2);
  auto store = OpenStore(SmallOptions(dir.path()));
  for (int64_t step = 0; step < 1000; step += 1 + static_cast<int64_t>(rng() % 3)) {
    const auto batch = MakeBatch(step, 10, rng);
    store->AppendBatch(batch);
    reference.Add(batch);
  }
  const auto keys = reference.Keys();
  for (int trial = 0; trial < 300; ++trial) {
    const SeriesKey& key = keys[rng() % keys.size()];
    int64_t from = static_cast<int64_t>(rng() % 1100) - 50;
    int64_t to = from + static_cast<int64_t>(rng() % 400);
    SCOPED_TRACE(::testing::Message() << testing::KeyName(key) << " [" << from << ", " << to << "]");
    const auto expected = reference.Range(key, from, to);
    ASSERT_TRUE(SamePoints(expected, store->Range(key, from, to)));
    const size_t max_points = 1 + rng() % 80;
    const auto expected_buckets = DownsamplePoints(expected, max_points);
    const auto buckets = store->Downsample(key, from, to, max_points);
    ASSERT_EQ(expected_buckets.size(), buckets.size());
    for (size_t i = 0; i < buckets.size(); ++i) {
      EXPECT_EQ(expected_buckets[i].first_step, buckets[i].first_step);
      EXPECT_EQ(expected_buckets[i].count, buckets[i].count);
      EXPECT_EQ(expected_buckets[i].nonfinite, buckets[i].nonfinite);
      if (!std::isnan(expected_buckets[i].mean)) {
        EXPECT_DOUBLE_EQ(expected_buckets[i].mean, buckets[i].mean);
      }
    }
  }
  EXPECT_TRUE(store->Range(keys[0], 10, 5).empty());
  EXPECT_TRUE(store->Range(Key("nope", "loss"), kAllFrom, kAllTo).empty());
}

TEST(DurableStoreTest, ManySeriesRollingSegments) {
  ScratchDir dir;
  DurableStoreOptions options = SmallOptions(dir.path());
  options.segment_bytes = 16 << 10;
  options.cache_points_per_series = 8;
  ReferenceModel reference;
  std::mt19937_64 rng(3);
  {
    auto store = OpenStore(options);
    for (int64_t step = 0; step < 60; ++step) {
      for (int run = 0; run < 5; ++run) {
        const auto batch = MakeBatch(step, 100, rng, "run-" + std::to_string(run));
        store->AppendBatch(batch);
        reference.Add(batch);
      }
    }
    const DurableStoreStats stats = store->Stats();
    EXPECT_GT(stats.segments, 5u);
    EXPECT_EQ(stats.segments, SegmentFiles(dir.path()).size());
    EXPECT_EQ(stats.series, 500u);
    ExpectMatchesReference(*store, reference);
  }
  auto store = OpenStore(options);
  ExpectMatchesReference(*store, reference);
  const auto runs = store->ListRuns();
  ASSERT_EQ(runs.size(), 5u);
  EXPECT_EQ(runs[2].run, "run-2");
  EXPECT_EQ(runs[2].first_step, 0);
  EXPECT_EQ(runs[2].last_step, 59);
  EXPECT_EQ(runs[2].series, 100u);
  EXPECT_EQ(runs[2].last_wall_time_ms, kWallStart + 59 * 100);
  const auto series = store->ListSeries("run-4");
  ASSERT_EQ(series.size(), 100u);
  EXPECT_EQ(series[0].points, 60u);
  EXPECT_EQ(series[0].first_step, 0);
  EXPECT_EQ(series[0].last_step, 59);
}

TEST(DurableStoreTest, ResumedRunKeepsDuplicateStepsInArrivalOrder) {
  ScratchDir dir;
  auto store = OpenStore(SmallOptions(dir.path()));
  const SeriesKey key = Key("r", "loss");
  for (int64_t step = 0; step < 100; ++step) store->Append(key, Point{step, 1.0, step});
  for (int64_t step = 50; step < 150; ++step) store->Append(key, Point{step, 2.0, 1000 + step});
  const auto points = store->Range(key, 60, 61);
  ASSERT_EQ(points.size(), 4u);
  EXPECT_EQ(points[0].value, 1.0);
  EXPECT_EQ(points[1].value, 2.0);
  EXPECT_EQ(points[2].step, 61);
  EXPECT_EQ(points[2].value, 1.0);
  EXPECT_EQ(store->Range(key, kAllFrom, kAllTo).size(), 200u);
}

TEST(DurableStoreTest, EventsArePersistedAndBounded) {
  ScratchDir dir;
  DurableStoreOptions options = SmallOptions(dir.path());
  options.events_per_kind = 3;
  {
    auto store = OpenStore(options);
    for (int i = 0; i < 5; ++i) store->AppendEvent("alert", "transition " + std::to_string(i));
    store->AppendEvent("other", std::string("\0binary\xff", 8));
    EXPECT_EQ(store->Events("alert"),
              (std::vector<std::string>{"transition 2", "transition 3", "transition 4"}));
  }
  auto store = OpenStore(options);
  EXPECT_EQ(store->Events("alert"),
            (std::vector<std::string>{"transition 2", "transition 3", "transition 4"}));
  EXPECT_EQ(store->Events("other"), (std::vector<std::string>{std::string("\0binary\xff", 8)}));
  EXPECT_EQ(store->Stats().recovered_events, 6u);
}

TEST(DurableStoreTest, EventsInMemoryAreBoundedInBytesToo) {
  // Issue 34: 30 Hellos of 8 MiB labels each were all held in the Hello log.
  ScratchDir dir;
  DurableStoreOptions options = SmallOptions(dir.path());
  options.events_per_kind = 100;
  options.event_bytes_per_kind = 10'000;
  const std::string big(4'000, 'x');
  {
    auto store = OpenStore(options);
    for (int i = 0; i < 5; ++i) store->AppendEvent("hello", big + std::to_string(i));
    // 3 of 4,001 bytes would be over the bound: the newest 2 stay.
    EXPECT_EQ(store->Events("hello"), (std::vector<std::string>{big + "3", big + "4"}));
    // One event larger than the bound is still kept, alone.
    store->AppendEvent("hello", std::string(20'000, 'y'));
    EXPECT_EQ(store->Events("hello"), (std::vector<std::string>{std::string(20'000, 'y')}));
    store->AppendEvent("hello", "small");
    EXPECT_EQ(store->Events("hello"), (std::vector<std::string>{"small"}));
  }
  // Recovery from disk indexes them under the same bound.
  auto store = OpenStore(options);
  EXPECT_EQ(store->Events("hello"), (std::vector<std::string>{"small"}));
}

// The ingest dedup marks rely on it: a batch's points and its event are one
// write (whole after a process crash), event last, so that a write torn by
// power loss never leaves the event without the points.
TEST(DurableStoreTest, BatchWithEventNeverRecoversTheEventWithoutThePoints) {
  ScratchDir dir;
  DurableStoreOptions options = SmallOptions(dir.path());
  std::mt19937_64 rng(9);
  const auto first = MakeBatch(0, 5, rng);
  const auto second = MakeBatch(1, 5, rng);
  {
    auto store = OpenStore(options);
    store->AppendBatchWithEvent(first, "mark", "0");
    store->AppendBatchWithEvent({}, "mark", "empty");  // an event alone
    store->AppendBatchWithEvent(second, "mark", "1");
    EXPECT_EQ(store->Events("mark"), (std::vector<std::string>{"0", "empty", "1"}));
    store->AbandonForTesting();
  }
  // Cut the last write short by one byte: its event goes.
  const std::string segment = SegmentFiles(dir.path()).back();
  ASSERT_EQ(::truncate(segment.c_str(), std::filesystem::file_size(segment) - 1), 0);
  auto store = OpenStore(options);
  EXPECT_EQ(store->Events("mark"), (std::vector<std::string>{"0", "empty"}));
  for (const auto& [key, point] : first) {  // the first batch is whole
    const std::vector<Point> range = store->Range(key, kAllFrom, kAllTo);
    ASSERT_FALSE(range.empty()) << testing::KeyName(key);
    EXPECT_EQ(range.front().step, 0) << testing::KeyName(key);
  }
  EXPECT_GT(store->Stats().truncated_bytes, 0u);
}

// kill -9 during write() can leave any prefix of it on disk (the kernel
// copies page by page and stops at a fatal signal), whole records included:
// the batch's points before its mark. Cut the last append at every offset:
// none of its points and not its mark may come back, and the appends before
// it are whole.
TEST(DurableStoreTest, AnAppendCutAnywhereIsLostWhole) {
  ScratchDir dir;
  const std::string original = dir.Sub("original");
  std::mt19937_64 rng(11);
  const auto first = MakeBatch(0, 6, rng);
  auto last = MakeBatch(1, 6, rng);
  last.push_back({Key("run-a", "only_in_last"), Point{1, 2.0, 0}});
  uint64_t before_last = 0, after_last = 0;
  {
    auto store = OpenStore(SmallOptions(original));
    ASSERT_TRUE(store->AppendBatchWithEvent(first, "mark", "0").ok());
    before_last = std::filesystem::file_size(SegmentFiles(original).back());
    ASSERT_TRUE(store->AppendBatchWithEvent(last, "mark", "1").ok());
    after_last = std::filesystem::file_size(SegmentFiles(original).back());
    store->AbandonForTesting();
  }
  const std::string newest_name = std::filesystem::path(SegmentFiles(original).back()).filename();
  const std::string work = dir.Sub("work");
  for (uint64_t cut = before_last; cut < after_last; ++cut) {
    SCOPED_TRACE(::testing::Message() << "cut at " << cut << " of " << after_last);
    CopyDir(original, work);
    std::filesystem::resize_file(work + "/segments/" + newest_name, cut);
    auto store = OpenStore(SmallOptions(work));
    EXPECT_EQ(store->Events("mark"), std::vector<std::string>{"0"});
    for (const auto& [key, point] : last) {
      for (const Point& p : store->Range(key, kAllFrom, kAllTo)) {
        ASSERT_EQ(p.step, 0) << testing::KeyName(key) << ": a point of the cut append";
      }
    }
    for (const auto& [key, point] : first) {
      ASSERT_EQ(store->Range(key, kAllFrom, kAllTo).size(), 1u) << testing::KeyName(key);
    }
    EXPECT_EQ(store->Stats().truncated_bytes, cut - before_last);
    EXPECT_EQ(store->Stats().corrupt_segments, 0u);
  }
}

// Segments written before kCommit existed (format 1) have none: their
// unsealed tail is cut after the last whole record, not after a commit.
TEST(DurableStoreTest, FormatOneSegmentsWithoutCommitsAreReadWhole) {
  ScratchDir dir;
  std::mt19937_64 rng(12);
  ReferenceModel reference;
  {
    auto store = OpenStore(SmallOptions(dir.path()));
    for (int64_t step = 0; step < 20; ++step) {
      const auto batch = MakeBatch(step, 4, rng);
      ASSERT_TRUE(store->AppendBatch(batch).ok());
      reference.Add(batch);
    }
    store->AbandonForTesting();  // unsealed, as after kill -9
  }
  // Rewrite every segment as format 1 would have: no kCommit, header version 1.
  for (const std::string& path : SegmentFiles(dir.path())) {
    const std::string bytes = testing::ReadFile(path);
    std::string old_format(kSegmentMagic);
    Record record;
    for (size_t offset = kSegmentMagic.size();
         ParseRecord(bytes, offset, &record) == ParseResult::kOk; offset += record.size) {
      if (record.type == RecordType::kCommit) continue;
      if (record.type == RecordType::kSegmentHeader) {
        SegmentHeader header;
        ASSERT_TRUE(DecodeSegmentHeader(record.payload, &header));
        header.version = 1;
        AppendRecord(&old_format, record.type, EncodeSegmentHeader(header));
      } else {
        AppendRecord(&old_format, record.type, record.payload);
      }
    }
    testing::WriteFile(path, old_format);
  }
  auto store = OpenStore(SmallOptions(dir.path()));
  ExpectMatchesReference(*store, reference);
  EXPECT_EQ(store->Stats().truncated_bytes, 0u);
}

TEST(DurableStoreTest, SyncedDataSurvivesAnUncleanStop) {
  ScratchDir dir;
  DurableStoreOptions options = SmallOptions(dir.path());
  options.fsync = FsyncPolicy::kEvery;
  ReferenceModel reference;
  std::mt19937_64 rng(4);
  {
    auto store = OpenStore(options);
    for (int64_t step = 0; step < 50; ++step) {
      const auto batch = MakeBatch(step, 5, rng);
      store->AppendBatch(batch);
      reference.Add(batch);
    }
    store->AppendEvent("alert", "firing");
    EXPECT_GE(store->Stats().fsyncs, 51u);
    store->AbandonForTesting();  // no close-time fsync, lock released as on kill -9
  }
  auto store = OpenStore(options);
  ExpectMatchesReference(*store, reference);
  EXPECT_EQ(store->Events("alert"), std::vector<std::string>{"firing"});
  ASSERT_EQ(store->Problems().size(), 1u);
  EXPECT_NE(store->Problems()[0].find("not closed cleanly"), std::string::npos);
  EXPECT_EQ(store->Stats().truncated_bytes, 0u);
}

TEST(DurableStoreTest, CopyTakenMidWriteHoldsEverythingAcknowledgedBeforeIt) {
  ScratchDir dir, copies;
  DurableStoreOptions options = SmallOptions(dir.path());
  options.fsync = FsyncPolicy::kEvery;
  options.segment_bytes = 8 << 10;
  const SeriesKey key = Key("r", "loss");
  auto store = OpenStore(options);
  std::atomic<int64_t> acknowledged{0};
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    for (int64_t step = 0; !stop; ++step) {
      store->AppendBatch({{key, Point{step, double(step) * 0.5, step}},
                          {Key("r", "grad_norm"), Point{step, 1.0, step}}});
      acknowledged = step + 1;
    }
  });
  for (int copy = 0; copy < 8; ++copy) {
    while (acknowledged < (copy + 1) * 150) std::this_thread::yield();
    const int64_t before = acknowledged.load();
    const std::string snapshot = copies.Sub("copy" + std::to_string(copy));
    CopyDir(dir.path(), snapshot);
    DurableStoreOptions copy_options = options;
    copy_options.data_dir = snapshot;
    copy_options.fsync = FsyncPolicy::kNone;
    auto recovered = OpenStore(copy_options);
    const auto points = recovered->Range(key, kAllFrom, kAllTo);
    ASSERT_GE(static_cast<int64_t>(points.size()), before) << recovered->Problems().size();
    for (size_t i = 0; i < points.size(); ++i) {
      ASSERT_EQ(points[i].step, static_cast<int64_t>(i));
      ASSERT_EQ(points[i].value, double(i) * 0.5);
    }
  }
  stop = true;
  writer.join();
}

// Writes 40 batches and closes cleanly; returns the size of the newest
// segment before and after the last batch (the end record follows).
std::pair<uint64_t, uint64_t> WriteTornTailFixture(const std::string& dir,
                                                   ReferenceModel* all_but_last) {
  std::mt19937_64 rng(5);
  auto store = OpenStore(SmallOptions(dir));
  uint64_t before_last = 0;
  for (int64_t step = 0; step < 40; ++step) {
    auto batch = MakeBatch(step, 6, rng);
    if (step == 39) {
      before_last = std::filesystem::file_size(SegmentFiles(dir).back());
      batch.push_back({Key("run-a", "new_in_last_batch"), Point{step, 1.0, 0}});
    } else {
      all_but_last->Add(batch);
    }
    store->AppendBatch(batch);
  }
  return {before_last, std::filesystem::file_size(SegmentFiles(dir).back())};
}

TEST(DurableStoreTest, TornLastRecordIsTruncatedAtEveryOffset) {
  ScratchDir dir;
  const std::string original = dir.Sub("original");
  ReferenceModel reference;
  const auto [before_last, after_last] = WriteTornTailFixture(original, &reference);
  const std::string newest_name = std::filesystem::path(SegmentFiles(original).back()).filename();
  ASSERT_GT(after_last, before_last + kRecordHeaderBytes);

  const std::string work = dir.Sub("work");
  for (uint64_t cut = before_last; cut < after_last; ++cut) {
    SCOPED_TRACE(::testing::Message() << "cut at " << cut);
    CopyDir(original, work);
    const std::string newest = work + "/segments/" + newest_name;
    std::filesystem::resize_file(newest, cut);
    {
      auto store = OpenStore(SmallOptions(work));
      ExpectMatchesReference(*store, reference);
      EXPECT_TRUE(store->Range(Key("run-a", "new_in_last_batch"), kAllFrom, kAllTo).empty());
      EXPECT_EQ(store->ListSeries("run-a").size(), 6u);
      const DurableStoreStats stats = store->Stats();
      // The whole unfinished write goes, whole records of it included.
      EXPECT_EQ(stats.truncated_bytes, cut - before_last);
      EXPECT_EQ(stats.corrupt_segments, 0u);
      EXPECT_EQ(store->Problems().size(), 1u);  // truncated and sealed
      EXPECT_GT(std::filesystem::file_size(newest), cut - stats.truncated_bytes);  // + end record
    }
    auto store = OpenStore(SmallOptions(work));  // a second open finds a clean log
    EXPECT_EQ(store->Stats().truncated_bytes, 0u);
    EXPECT_TRUE(store->Problems().empty()) << store->Problems().front();
    ExpectMatchesReference(*store, reference);
  }
}

// Appends batches of a sequence series (step = batch index) plus noise
// series, recording which segment each batch went to.
struct MultiSegmentFixture {
  ReferenceModel reference;
  std::vector<uint64_t> segment_of_batch;
  static constexpr int kBatches = 400;
};

MultiSegmentFixture WriteMultiSegmentFixture(const DurableStoreOptions& options) {
  MultiSegmentFixture fixture;
  std::mt19937_64 rng(6);
  auto store = OpenStore(options);
  for (int64_t step = 0; step < MultiSegmentFixture::kBatches; ++step) {
    auto batch = MakeBatch(step, 8, rng);
    store->AppendBatch(batch);
    fixture.reference.Add(batch);
    fixture.segment_of_batch.push_back(store->Stats().segments_created);
  }
  return fixture;
}

// Every batch outside `damaged` must be whole; batches inside may be missing
// (recovery skips the damage and reads on after it).
void ExpectOnlySegmentLost(const SeriesStore& store, const MultiSegmentFixture& fixture,
                           uint64_t damaged) {
  for (const SeriesKey& key : fixture.reference.Keys()) {
    const auto expected = fixture.reference.Range(key, kAllFrom, kAllTo);
    const auto actual = store.Range(key, kAllFrom, kAllTo);
    size_t a = 0;
    for (size_t i = 0; i < expected.size(); ++i) {
      const uint64_t segment = fixture.segment_of_batch[expected[i].step];
      if (a < actual.size() && testing::SamePoint(actual[a], expected[i])) {
        ++a;
        continue;
      }
      ASSERT_EQ(segment, damaged) << testing::KeyName(key) << " lost step " << expected[i].step;
    }
    ASSERT_EQ(a, actual.size()) << "points that were never written";
  }
}

TEST(DurableStoreTest, CorruptionInAnOlderSegmentIsReportedAndLaterSegmentsRead) {
  ScratchDir dir;
  const std::string original = dir.Sub("original");
  DurableStoreOptions options = SmallOptions(original);
  options.segment_bytes = 4 << 10;
  const MultiSegmentFixture fixture = WriteMultiSegmentFixture(options);
  const auto files = SegmentFiles(original);
  ASSERT_GE(files.size(), 5u);

  struct Damage {
    const char* what;
    std::function<void(const std::string&)> apply;
    bool mid_record;  // else the damage may fall on a record boundary
  };
  const std::vector<Damage> damages = {
      {"flipped byte mid-segment", [](const std::string& f) {
         FlipByte(f, std::filesystem::file_size(f) / 2, 0x10);
       }, true},
      {"flipped byte in the header", [](const std::string& f) { FlipByte(f, 12); }, false},
      {"truncated to half", [](const std::string& f) {
         std::filesystem::resize_file(f, std::filesystem::file_size(f) / 2);
       }, false},
      {"end record cut off", [](const std::string& f) {
         std::filesystem::resize_file(f, std::filesystem::file_size(f) - kRecordHeaderBytes - 1);
       }, false},
  };
  for (const Damage& damage : damages) {
    SCOPED_TRACE(damage.what);
    const std::string work = dir.Sub("work");
    CopyDir(original, work);
    const std::string victim = work + "/segments/00000002.seg";
    damage.apply(victim);
    DurableStoreOptions work_options = options;
    work_options.data_dir = work;
    auto store = OpenStore(work_options);
    const DurableStoreStats stats = store->Stats();
    EXPECT_EQ(stats.corrupt_segments, 1u);
    EXPECT_LE(stats.corrupt_records, 1u);
    if (damage.mid_record) {
      EXPECT_EQ(stats.corrupt_records, 1u);
      EXPECT_GT(stats.skipped_bytes, 0u);
      EXPECT_GT(stats.lost_points, 0u);
    }
    EXPECT_EQ(stats.truncated_bytes, 0u);
    const auto problems = store->Problems();
    ASSERT_EQ(problems.size(), 1u);
    EXPECT_NE(problems[0].find("00000002.seg"), std::string::npos) << problems[0];
    ExpectOnlySegmentLost(*store, fixture, 2);
    // Nothing was modified: an older segment is never truncated.
    EXPECT_TRUE(std::filesystem::exists(victim));
  }
}

TEST(DurableStoreTest, UnreadableNewestSegmentIsQuarantinedAndStrayFilesIgnored) {
  ScratchDir dir;
  DurableStoreOptions options = SmallOptions(dir.path());
  ReferenceModel reference;
  std::mt19937_64 rng(7);
  {
    auto store = OpenStore(options);
    const auto batch = MakeBatch(1, 5, rng);
    store->AppendBatch(batch);
    reference.Add(batch);
  }
  testing::WriteFile(dir.path() + "/segments/00000050.seg", "FSH");  // crashed while creating
  testing::WriteFile(dir.path() + "/segments/00000051.seg", "");     // crashed right after
  testing::WriteFile(dir.path() + "/segments/notes.txt", "hello");
  auto store = OpenStore(options);
  ExpectMatchesReference(*store, reference);
  // Bytes with no valid record are moved aside, never deleted; an empty file
  // holds nothing and is removed.
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/segments/00000050.seg"));
  EXPECT_EQ(testing::ReadFile(dir.path() + "/quarantine/00000050.seg"), "FSH");
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/segments/00000051.seg"));
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/segments/00000052.seg"));
  EXPECT_EQ(store->Stats().quarantined_segments, 1u);
  EXPECT_EQ(store->Problems().size(), 3u);
}

TEST(DurableStoreTest, RetentionBySizeDropsOldestSegments) {
  ScratchDir dir;
  DurableStoreOptions options = SmallOptions(dir.path());
  options.segment_bytes = 4 << 10;
  options.retention_max_bytes = 32 << 10;
  options.cache_points_per_series = 16;
  const SeriesKey key = Key("r", "loss");
  {
    auto store = OpenStore(options);
    for (int64_t step = 0; step < 5000; ++step) {
      store->AppendBatch({{key, Point{step, std::sqrt(double(step)), step}},
                          {Key("r", "grad_norm"), Point{step, 1.0 / (1 + step), step}}});
    }
    const DurableStoreStats stats = store->Stats();
    EXPECT_GT(stats.retention_deleted_segments, 0u);
    EXPECT_GT(stats.retention_deleted_bytes, 0u);
    EXPECT_LE(stats.segment_bytes_on_disk, options.retention_max_bytes + options.segment_bytes);
    uint64_t on_disk = 0;
    for (const auto& f : SegmentFiles(dir.path())) on_disk += std::filesystem::file_size(f);
    EXPECT_EQ(on_disk, stats.segment_bytes_on_disk);
    // What remains is the most recent steps, without holes.
    const auto points = store->Range(key, kAllFrom, kAllTo);
    ASSERT_FALSE(points.empty());
    EXPECT_GT(points.front().step, 0);
    EXPECT_EQ(points.back().step, 4999);
    EXPECT_EQ(static_cast<int64_t>(points.size()), 5000 - points.front().step);
    const auto series = store->ListSeries("r");
    ASSERT_EQ(series.size(), 2u);
    EXPECT_EQ(series[1].key.signal, "loss");
    EXPECT_EQ(series[1].first_step, points.front().step);
    EXPECT_EQ(series[1].points, points.size());
  }
  auto store = OpenStore(options);
  const auto points = store->Range(key, kAllFrom, kAllTo);
  EXPECT_EQ(points.back().step, 4999);
  EXPECT_EQ(static_cast<int64_t>(points.size()), 5000 - points.front().step);
}

TEST(DurableStoreTest, RetentionByAgeUsesTheInjectedClock) {
  ScratchDir dir;
  auto now = std::make_shared<std::atomic<int64_t>>(kWallStart);
  DurableStoreOptions options = SmallOptions(dir.path());
  options.segment_bytes = 256;
  options.retention_max_age = std::chrono::seconds(100);
  options.clock = [now] { return now->load(); };
  const SeriesKey key = Key("r", "loss");
  auto store = OpenStore(options);
  for (int64_t step = 0; step < 300; ++step) {
    *now += 10'000;  // ten seconds per step
    store->AppendBatch({{key, Point{step, double(step), now->load()}},
                        {Key("r", "grad_norm"), Point{step, 0.5, now->load()}}});
  }
  const int64_t cutoff = now->load() - 100'000;
  const auto points = store->Range(key, kAllFrom, kAllTo);
  EXPECT_GT(store->Stats().retention_deleted_segments, 0u);
  // Everything newer than the cutoff is there; older points only share a
  // segment with newer ones.
  size_t newer = 0;
  for (const Point& p : points) newer += p.wall_time_ms >= cutoff;
  EXPECT_EQ(newer, 11u);
  EXPECT_LT(points.size(), 40u);

  // Much later, with no writes: everything goes but the active segment.
  *now += 1'000'000;
  EXPECT_GT(store->EnforceRetention(), 0u);
  EXPECT_EQ(store->Stats().segments, 1u);
  EXPECT_EQ(SegmentFiles(dir.path()).size(), 1u);
  store->Append(key, Point{1000, 1.0, now->load()});
  const auto after = store->Range(key, kAllFrom, kAllTo);
  ASSERT_FALSE(after.empty());
  EXPECT_EQ(after.back().step, 1000);
  EXPECT_LE(after.size(), points.size() + 1);
  // (grad_norm may have no point left: then only loss is listed.)
  const auto listed = store->ListSeries("r");
  const auto loss = std::find_if(listed.begin(), listed.end(),
                                 [&](const SeriesInfo& info) { return info.key == key; });
  ASSERT_NE(loss, listed.end());
  EXPECT_EQ(loss->points, after.size());
}

TEST(DurableStoreTest, CheckpointsAreAtomicAndChecked) {
  ScratchDir dir;
  DurableStoreOptions options = SmallOptions(dir.path());
  {
    auto store = OpenStore(options);
    EXPECT_FALSE(store->ReadCheckpoint("alerts").has_value());
    EXPECT_TRUE(store->WriteCheckpoint("alerts", "state v1"));
    EXPECT_TRUE(store->WriteCheckpoint("alerts", std::string("state v2\0", 9)));
    EXPECT_EQ(store->ReadCheckpoint("alerts"), std::string("state v2\0", 9));
    EXPECT_FALSE(store->WriteCheckpoint("../escape", "x"));
    EXPECT_FALSE(store->ReadCheckpoint("../escape").has_value());
    EXPECT_EQ(store->Stats().checkpoints_written, 2u);
  }
  const std::string path = dir.path() + "/checkpoints/alerts.ckpt";
  // A crash between writing the temporary file and the rename leaves the
  // previous checkpoint in place.
  testing::WriteFile(path + ".tmp", "half-written garbage");
  {
    auto store = OpenStore(options);
    EXPECT_EQ(store->ReadCheckpoint("alerts"), std::string("state v2\0", 9));
    EXPECT_TRUE(store->WriteCheckpoint("alerts", "state v3"));
    EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  }
  const std::string good = testing::ReadFile(path);
  for (size_t i = 0; i < good.size(); ++i) {
    testing::WriteFile(path, good);
    FlipByte(path, i, 0x04);
    auto store = OpenStore(options);
    EXPECT_FALSE(store->ReadCheckpoint("alerts").has_value()) << "flipped byte " << i;
    EXPECT_FALSE(store->ReadLargeCheckpoint("alerts").has_value()) << "flipped byte " << i;
    EXPECT_EQ(store->Stats().corrupt_checkpoints, 2u);
    ASSERT_FALSE(store->Problems().empty());
    EXPECT_NE(store->Problems().back().find("alerts.ckpt"), std::string::npos);
  }
  testing::WriteFile(path, good.substr(0, good.size() - 1));
  auto store = OpenStore(options);
  EXPECT_FALSE(store->ReadCheckpoint("alerts").has_value());
  EXPECT_FALSE(store->ReadLargeCheckpoint("alerts").has_value());
  testing::WriteFile(path, "");  // shorter than a header: nothing to map
  EXPECT_FALSE(store->ReadLargeCheckpoint("alerts").has_value());
  testing::WriteFile(path, good);
  EXPECT_EQ(store->ReadCheckpoint("alerts"), "state v3");
  // Mapped (the detector checkpoint at startup): the same bytes, also once
  // moved; missing is missing.
  std::optional<CheckpointBytes> mapped = store->ReadLargeCheckpoint("alerts");
  ASSERT_TRUE(mapped.has_value());
  EXPECT_EQ(mapped->view(), "state v3");
  CheckpointBytes moved = std::move(*mapped);
  EXPECT_EQ(moved.view(), "state v3");
  EXPECT_FALSE(store->ReadLargeCheckpoint("detectors").has_value());
  EXPECT_FALSE(store->ReadLargeCheckpoint("../escape").has_value());
  // A store in memory hands its bytes over as they are.
  InMemorySeriesStore memory(16);
  ASSERT_TRUE(memory.WriteCheckpoint("alerts", "in memory"));
  EXPECT_EQ(memory.ReadLargeCheckpoint("alerts")->view(), "in memory");
}

// Issue 28: a checkpoint streamed piece by piece (the detector state, without
// a copy of it) is the same file as one written whole, with nested length
// fields filled in afterwards; an abandoned one leaves the previous in place.
TEST(DurableStoreTest, StreamedCheckpointsAreTheSameFileAsWholeOnes) {
  ScratchDir dir;
  DurableStoreOptions options = SmallOptions(dir.path());
  auto store = OpenStore(options);
  // "head" | U64 len | ("inner" | U64 len | 3 MiB of bytes | "!") | "tail".
  const std::string big(3 << 20, 'x');
  auto le64 = [](uint64_t v) {
    std::string out;
    for (int i = 0; i < 8; ++i, v >>= 8) out.push_back(static_cast<char>(v & 0xff));
    return out;
  };
  const std::string inner = "inner" + le64(big.size() + 1) + big + "!";
  const std::string whole = "head" + le64(inner.size()) + inner + "tail";
  ASSERT_TRUE(store->WriteCheckpoint("whole", whole));
  ASSERT_TRUE(store->WriteCheckpointStreamed("streamed", [&](codec::StateSink& out) {
    out.Append("head");
    out.BeginLengthPrefixed();
    out.Append("inner");
    out.BeginLengthPrefixed();
    for (size_t at = 0; at < big.size(); at += 1 << 16) out.Append(std::string_view(big).substr(at, 1 << 16));
    out.Append("!");
    out.EndLengthPrefixed();
    out.EndLengthPrefixed();
    out.Append("tail");
    return true;
  }));
  EXPECT_EQ(store->ReadCheckpoint("streamed"), whole);
  const std::string checkpoints = dir.path() + "/checkpoints/";
  EXPECT_EQ(testing::ReadFile(checkpoints + "streamed.ckpt"), testing::ReadFile(checkpoints + "whole.ckpt"));
  // Given up half way (or a length field left open): the old one stays, no temporary file.
  EXPECT_FALSE(store->WriteCheckpointStreamed("streamed", [](codec::StateSink& out) {
    out.Append("partial");
    return false;
  }));
  EXPECT_FALSE(store->WriteCheckpointStreamed("streamed", [](codec::StateSink& out) {
    out.BeginLengthPrefixed();
    out.Append("unterminated");
    return true;
  }));
  EXPECT_EQ(store->ReadCheckpoint("streamed"), whole);
  EXPECT_FALSE(std::filesystem::exists(checkpoints + "streamed.ckpt.tmp"));
  EXPECT_FALSE(store->WriteCheckpointStreamed("../escape", [](codec::StateSink&) { return true; }));
  // The in-memory store collects the same bytes.
  InMemorySeriesStore memory(8);
  ASSERT_TRUE(memory.WriteCheckpointStreamed("s", [&](codec::StateSink& out) {
    out.Append("head");
    out.BeginLengthPrefixed();
    out.Append(inner);
    out.EndLengthPrefixed();
    out.Append("tail");
    return true;
  }));
  EXPECT_EQ(memory.ReadCheckpoint("s"), whole);
}

TEST(DurableStoreTest, ConcurrentAppendersAndReaders) {
  ScratchDir dir;
  DurableStoreOptions options = SmallOptions(dir.path());
  options.fsync = FsyncPolicy::kEvery;  // exercises group commit
  options.segment_bytes = 64 << 10;
  constexpr int kWriters = 4, kSteps = 300;
  std::atomic<bool> done{false};
  auto store = OpenStore(options);
  std::vector<std::thread> threads;
  for (int w = 0; w < kWriters; ++w) {
    threads.emplace_back([&, w] {
      std::mt19937_64 rng(100 + w);
      for (int64_t step = 0; step < kSteps; ++step) {
        store->AppendBatch(MakeBatch(step, 10, rng, "run-" + std::to_string(w)));
        if (step % 50 == 0) store->AppendEvent("alert", std::to_string(w));
      }
    });
  }
  std::atomic<uint64_t> reads{0};
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      while (!done) {
        const auto points = store->Range(Key("run-" + std::to_string(r), "loss", 0, -1), kAllFrom, kAllTo);
        for (size_t i = 0; i < points.size(); ++i) ASSERT_EQ(points[i].step, static_cast<int64_t>(i));
        store->ListRuns();
        ++reads;
      }
    });
  }
  for (int w = 0; w < kWriters; ++w) threads[w].join();
  done = true;
  for (size_t t = kWriters; t < threads.size(); ++t) threads[t].join();
  EXPECT_GT(reads.load(), 0u);
  const DurableStoreStats stats = store->Stats();
  EXPECT_EQ(stats.points_appended, uint64_t{kWriters} * kSteps * 10);
  EXPECT_LE(stats.fsyncs, stats.batches_appended + stats.events_appended + stats.segments_created + 1);
  for (int w = 0; w < kWriters; ++w) {
    const auto series = store->ListSeries("run-" + std::to_string(w));
    ASSERT_EQ(series.size(), 10u);
    for (const SeriesInfo& info : series) {
      const auto points = store->Range(info.key, kAllFrom, kAllTo);
      ASSERT_EQ(points.size(), size_t{kSteps});
      for (int64_t step = 0; step < kSteps; ++step) ASSERT_EQ(points[step].step, step);
    }
  }
  EXPECT_EQ(store->Events("alert").size(), size_t{kWriters} * 6);
}

TEST(DurableStoreTest, ASecondOpenOfTheSameDirectoryFails) {
  ScratchDir dir;
  auto store = OpenStore(SmallOptions(dir.path()));
  auto second = DurableSeriesStore::Open(SmallOptions(dir.path()));
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(DurableStoreTest, MemoryIsBoundedByTheCacheNotTheHistory) {
  ScratchDir dir;
  DurableStoreOptions options = SmallOptions(dir.path());
  options.cache_points_per_series = 64;
  options.block_bytes = 64 << 10;
  auto store = OpenStore(options);
  std::mt19937_64 rng(8);
  int64_t step = 0;
  for (; step < 200; ++step) store->AppendBatch(MakeBatch(step, 100, rng));
  const size_t early = store->ApproxMemoryBytes();
  for (; step < 4000; ++step) store->AppendBatch(MakeBatch(step, 100, rng));
  const size_t late = store->ApproxMemoryBytes();
  EXPECT_GE(late, 100u * 64 * 32);  // the full caches
  EXPECT_LT(late, early * 12 / 10) << early << " -> " << late;
}

TEST(DurableStoreTest, FsyncPolicyNames) {
  EXPECT_EQ(ParseFsyncPolicy("every"), FsyncPolicy::kEvery);
  EXPECT_EQ(ParseFsyncPolicy("interval"), FsyncPolicy::kInterval);
  EXPECT_EQ(ParseFsyncPolicy("none"), FsyncPolicy::kNone);
  EXPECT_FALSE(ParseFsyncPolicy("sometimes").has_value());
  EXPECT_EQ(FsyncPolicyName(FsyncPolicy::kInterval), "interval");
}

TEST(DurableStoreTest, IntervalPolicySyncsInTheBackground) {
  ScratchDir dir;
  DurableStoreOptions options = SmallOptions(dir.path());
  options.fsync = FsyncPolicy::kInterval;
  options.fsync_interval = std::chrono::milliseconds(10);
  auto store = OpenStore(options);
  store->Append(Key("r", "loss"), Point{1, 1.0, 1});
  const uint64_t before = store->Stats().fsyncs;
  for (int i = 0; i < 200 && store->Stats().fsyncs == before; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_GT(store->Stats().fsyncs, before);
  EXPECT_TRUE(store->Sync());
  EXPECT_TRUE(store->healthy());
}

}  // namespace
}  // namespace foreshock::store
