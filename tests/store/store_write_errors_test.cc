// Write errors never cost an acknowledged point: an append that could not be
// written or made durable returns an error (and is not in the store), every
// append that returned OK is read back after a reopen, and the store resumes
// by itself once writes succeed again. Faults come from the store's
// fault-injecting file layer (DurableStoreOptions::inject_fault) and, for a
// real full disk, from a small tmpfs (tests/python/test_disk_full.py).
#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <filesystem>

#include "store/durable_store.h"
#include "tests/store/store_test_support.h"

namespace foreshock::store {
namespace {

using testing::Key;
using testing::ReferenceModel;
using testing::ScratchDir;

constexpr int64_t kAllFrom = std::numeric_limits<int64_t>::min();
constexpr int64_t kAllTo = std::numeric_limits<int64_t>::max();

// Fails the chosen operation with `error` while armed.
struct FaultSwitch {
  std::atomic<int> error{0};
  std::atomic<int> op{-1};
  std::atomic<int> hits{0};
  std::function<int(StoreFileOp)> Hook() {
    return [this](StoreFileOp o) {
      if (error.load() != 0 && static_cast<int>(o) == op.load()) {
        ++hits;
        return error.load();
      }
      return 0;
    };
  }
  void Arm(StoreFileOp o, int e) {
    op = static_cast<int>(o);
    error = e;
  }
  void Disarm() { error = 0; }
};

DurableStoreOptions FaultOptions(const std::string& dir, FaultSwitch& faults, FsyncPolicy fsync) {
  DurableStoreOptions options;
  options.data_dir = dir;
  options.fsync = fsync;
  options.block_bytes = 1024;
  options.block_bytes_per_series = 0;
  options.cache_points_per_series = 8;
  options.write_retry_interval = std::chrono::milliseconds(0);  // retry at once
  options.inject_fault = faults.Hook();
  return options;
}

std::vector<KeyedPoint> Batch(int64_t step) {
  std::vector<KeyedPoint> batch;
  for (int s = 0; s < 6; ++s) {
    batch.push_back({Key("run", "signal", s), Point{step, double(step * 10 + s), step}});
  }
  return batch;
}

// Appends steps [from, to); what returned OK goes into `acked`.
void AppendSteps(DurableSeriesStore& store, int64_t from, int64_t to, ReferenceModel* acked,
                 int* refused) {
  for (int64_t step = from; step < to; ++step) {
    const auto batch = Batch(step);
    if (store.AppendBatch(batch).ok()) {
      acked->Add(batch);
    } else {
      ++*refused;
    }
  }
}

// Exactly the acknowledged points, nothing else.
void ExpectExactly(const SeriesStore& store, const ReferenceModel& acked) {
  for (int s = 0; s < 6; ++s) {
    const SeriesKey key = Key("run", "signal", s);
    EXPECT_TRUE(testing::SamePoints(acked.Range(key, kAllFrom, kAllTo),
                                    store.Range(key, kAllFrom, kAllTo)))
        << "series " << s;
  }
}

struct ErrorCase {
  const char* name;
  StoreFileOp op;
  int error;
  FsyncPolicy fsync;
  absl::StatusCode code;
};

class StoreWriteErrorTest : public ::testing::TestWithParam<ErrorCase> {};

TEST_P(StoreWriteErrorTest, RefusedAppendsAreNotStoredAndAckedOnesSurvive) {
  const ErrorCase& c = GetParam();
  ScratchDir dir;
  FaultSwitch faults;
  ReferenceModel acked;
  int refused = 0;
  {
    auto store = DurableSeriesStore::Open(FaultOptions(dir.path(), faults, c.fsync));
    ASSERT_TRUE(store.ok()) << store.status();
    AppendSteps(**store, 0, 50, &acked, &refused);
    EXPECT_EQ(refused, 0);

    faults.Arm(c.op, c.error);
    const absl::Status status = (*store)->AppendBatch(Batch(50));
    EXPECT_EQ(status.code(), c.code) << status;
    EXPECT_FALSE((*store)->healthy());
    AppendSteps(**store, 51, 60, &acked, &refused);
    EXPECT_EQ(refused, 9);
    EXPECT_GT(faults.hits.load(), 0);
    // A refused write is not readable; a write whose fsync failed may be (it
    // reached the page cache), but was refused all the same.
    if (c.op != StoreFileOp::kSync) ExpectExactly(**store, acked);

    faults.Disarm();  // space returns: the store resumes by itself
    AppendSteps(**store, 60, 120, &acked, &refused);
    EXPECT_EQ(refused, 9);
    EXPECT_TRUE((*store)->healthy());
    EXPECT_TRUE((*store)->WriteHealth().ok());
    if (c.op != StoreFileOp::kSync) ExpectExactly(**store, acked);
    const DurableStoreStats stats = (*store)->Stats();
    EXPECT_EQ(stats.appends_refused, 10u);
    EXPECT_GE(stats.write_errors, 1u);
    EXPECT_EQ(stats.disk_full_errors > 0, c.error == ENOSPC);
  }
  // After a reopen: every acknowledged point, and none of the refused ones
  // (a refused write was cut back; a segment whose fsync failed was left, its
  // refused batches may be on disk: they are resent, and dedup drops them).
  FaultSwitch none;
  auto store = DurableSeriesStore::Open(FaultOptions(dir.path(), none, c.fsync));
  ASSERT_TRUE(store.ok());
  if (c.op == StoreFileOp::kSync) {
    for (int s = 0; s < 6; ++s) {
      const SeriesKey key = Key("run", "signal", s);
      const auto got = (*store)->Range(key, kAllFrom, kAllTo);
      for (const Point& p : acked.Range(key, kAllFrom, kAllTo)) {
        EXPECT_TRUE(std::any_of(got.begin(), got.end(),
                                [&](const Point& q) { return testing::SamePoint(p, q); }))
            << "acked step " << p.step << " lost";
      }
    }
  } else {
    ExpectExactly(**store, acked);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Faults, StoreWriteErrorTest,
    ::testing::Values(
        ErrorCase{"enospc_on_write", StoreFileOp::kWrite, ENOSPC, FsyncPolicy::kEvery,
                  absl::StatusCode::kResourceExhausted},
        ErrorCase{"eio_on_write", StoreFileOp::kWrite, EIO, FsyncPolicy::kInterval,
                  absl::StatusCode::kUnavailable},
        ErrorCase{"erofs_on_write", StoreFileOp::kWrite, EROFS, FsyncPolicy::kEvery,
                  absl::StatusCode::kUnavailable},
        ErrorCase{"eio_on_fsync", StoreFileOp::kSync, EIO, FsyncPolicy::kEvery,
                  absl::StatusCode::kUnavailable},
        ErrorCase{"enospc_on_fsync", StoreFileOp::kSync, ENOSPC, FsyncPolicy::kEvery,
                  absl::StatusCode::kResourceExhausted}),
    [](const ::testing::TestParamInfo<ErrorCase>& info) { return std::string(info.param.name); });

TEST(StoreWriteErrorTest, FullDiskWhenRollingKeepsWritingTheActiveSegment) {
  ScratchDir dir;
  FaultSwitch faults;
  DurableStoreOptions options = FaultOptions(dir.path(), faults, FsyncPolicy::kEvery);
  options.segment_bytes = 2048;
  auto store = DurableSeriesStore::Open(options);
  ASSERT_TRUE(store.ok());
  ReferenceModel acked;
  int refused = 0;
  faults.Arm(StoreFileOp::kCreate, ENOSPC);
  AppendSteps(**store, 0, 200, &acked, &refused);
  EXPECT_EQ(refused, 0);  // a segment past its size takes more while no new one can be made
  faults.Disarm();
  AppendSteps(**store, 200, 210, &acked, &refused);
  EXPECT_GE((*store)->Stats().segments_created, 2u);
  ExpectExactly(**store, acked);
}

TEST(StoreWriteErrorTest, OpensOnAFullDiskServesWhatItHoldsAndResumes) {
  ScratchDir dir;
  ReferenceModel acked;
  int refused = 0;
  {
    FaultSwitch none;
    auto store = DurableSeriesStore::Open(FaultOptions(dir.path(), none, FsyncPolicy::kEvery));
    ASSERT_TRUE(store.ok());
    AppendSteps(**store, 0, 30, &acked, &refused);
  }
  FaultSwitch faults;
  faults.Arm(StoreFileOp::kCreate, ENOSPC);
  DurableStoreOptions options = FaultOptions(dir.path(), faults, FsyncPolicy::kEvery);
  options.write_retry_interval = std::chrono::hours(1);
  auto store = DurableSeriesStore::Open(options);
  ASSERT_TRUE(store.ok()) << store.status();  // before: exit 1, nothing served
  ExpectExactly(**store, acked);
  EXPECT_EQ((*store)->WriteHealth().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*store)->AppendBatch(Batch(30)).code(), absl::StatusCode::kResourceExhausted);
  faults.Disarm();
  // WriteHealth keeps saying so for the retry interval; an append tries anyway.
  EXPECT_FALSE((*store)->WriteHealth().ok());
  AppendSteps(**store, 31, 40, &acked, &refused);
  EXPECT_EQ(refused, 0);
  EXPECT_TRUE((*store)->WriteHealth().ok());
  ExpectExactly(**store, acked);
}

}  // namespace
}  // namespace foreshock::store
