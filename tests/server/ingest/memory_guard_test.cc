#include "server/ingest/memory_guard.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

namespace foreshock::server {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

TEST(MemoryGuardTest, RefusesAtTheBoundAndResumesBelowNinetyPercent) {
  int64_t resident = 50 * kMiB;
  MemoryGuard guard(100 * kMiB, [&] { return resident; });
  guard.Sample();
  EXPECT_FALSE(guard.over_limit());
  EXPECT_EQ(guard.resident_bytes(), 50 * kMiB);

  resident = 99 * kMiB;
  guard.Sample();
  EXPECT_FALSE(guard.over_limit());
  resident = 100 * kMiB;
  guard.Sample();
  EXPECT_TRUE(guard.over_limit());
  EXPECT_EQ(guard.times_over(), 1u);

  // Hysteresis: between 90% and the bound it stays over, so that ingest does
  // not flap on every sample.
  resident = 95 * kMiB;
  guard.Sample();
  EXPECT_TRUE(guard.over_limit());
  resident = 89 * kMiB;
  guard.Sample();
  EXPECT_FALSE(guard.over_limit());
  resident = 95 * kMiB;
  guard.Sample();
  EXPECT_FALSE(guard.over_limit());
  EXPECT_EQ(guard.times_over(), 1u);
}

// Issue 27: after a probe flood, retained detector state kept resident memory
// just above the resume mark, and ingest stayed refused for good. Once
// nothing is in flight and memory has stopped falling for kSettle, refusing
// cannot free anything more: probes are accepted again.
TEST(MemoryGuardTest, ResumesOnceMemoryHasSettledWithNothingInFlight) {
  int64_t resident = 120 * kMiB;
  int64_t in_flight = 30 * kMiB;
  MemoryGuard guard(100 * kMiB, [&] { return resident; });
  guard.SetInFlight([&] { return in_flight; });
  guard.Sample();
  ASSERT_TRUE(guard.over_limit());
  // The queue drains; memory falls to retained state above the resume mark.
  in_flight = 0;
  resident = 93 * kMiB;
  guard.Sample();
  EXPECT_TRUE(guard.over_limit()) << "not settled yet";
  // Still falling more than 1/64: the settle time starts over.
  std::this_thread::sleep_for(MemoryGuard::kSettle / 2);
  resident = 91 * kMiB;
  guard.Sample();
  std::this_thread::sleep_for(MemoryGuard::kSettle / 2 + std::chrono::milliseconds(50));
  guard.Sample();
  EXPECT_TRUE(guard.over_limit()) << "memory fell within the last kSettle";
  // Something in flight again: not settled.
  in_flight = 1;
  std::this_thread::sleep_for(MemoryGuard::kSettle / 2 + std::chrono::milliseconds(50));
  guard.Sample();
  EXPECT_TRUE(guard.over_limit());
  in_flight = 0;
  guard.Sample();
  std::this_thread::sleep_for(MemoryGuard::kSettle + std::chrono::milliseconds(50));
  guard.Sample();
  EXPECT_FALSE(guard.over_limit()) << "settled at 91 MiB with nothing in flight";
  EXPECT_EQ(guard.settled_resumes(), 1u);
  // Back at the bound: over again (the bound still holds).
  resident = 100 * kMiB;
  guard.Sample();
  EXPECT_TRUE(guard.over_limit());
  EXPECT_EQ(guard.times_over(), 2u);
}

// Large probes arriving between two samples: a big batch is checked against
// resident memory measured at its arrival, not only the last sample.
TEST(MemoryGuardTest, ALargeBatchIsCheckedAgainstMemoryNow) {
  int64_t resident = 50 * kMiB;
  MemoryGuard guard(100 * kMiB, [&] { return resident; });
  guard.Sample();
  EXPECT_TRUE(guard.AdmitProbes(40 * kMiB));
  resident = 70 * kMiB;  // not sampled yet
  EXPECT_FALSE(guard.over_limit());
  EXPECT_FALSE(guard.AdmitProbes(40 * kMiB)) << "70 + 40 MiB would pass the bound";
  EXPECT_TRUE(guard.AdmitProbes(20 * kMiB));
  EXPECT_TRUE(guard.AdmitProbes(MemoryGuard::kFreshCheckBytes - 1)) << "small: no fresh read";
  resident = 120 * kMiB;
  guard.Sample();
  EXPECT_FALSE(guard.AdmitProbes(1)) << "over the limit: no probes at all";
  MemoryGuard unbounded(0, [] { return int64_t{1} << 40; });
  EXPECT_TRUE(unbounded.AdmitProbes(int64_t{1} << 30));
}

// Issue 34: 12 streams of 32 MiB batches peaked at 1.25x the bound, since a
// batch is resident before ingest can refuse it. Room reserved for streams'
// next batches counts as if it were resident: retained state stops growing
// early enough that those batches still fit.
TEST(MemoryGuardTest, RoomReservedForStreamsNextBatchesCountsAgainstTheBound) {
  int64_t resident = 50 * kMiB;
  MemoryGuard guard(100 * kMiB, [&] { return resident; });
  guard.Sample();
  EXPECT_TRUE(guard.AdmitProbes(20 * kMiB));
  guard.AdjustReserved(40 * kMiB);
  EXPECT_EQ(guard.reserved_bytes(), 40 * kMiB);
  EXPECT_FALSE(guard.AdmitProbes(20 * kMiB)) << "50 + 20 + 40 MiB reserved passes the bound";
  EXPECT_TRUE(guard.AdmitProbes(5 * kMiB));
  resident = 60 * kMiB;
  guard.Sample();
  EXPECT_TRUE(guard.over_limit()) << "60 MiB resident + 40 reserved reaches 100";
  guard.AdjustReserved(-40 * kMiB);  // the streams ended
  guard.Sample();
  EXPECT_FALSE(guard.over_limit()) << "60 MiB is below the resume mark";
  EXPECT_TRUE(guard.AdmitProbes(20 * kMiB));
}

TEST(MemoryGuardTest, WithoutAnInFlightMeasureItResumesOnlyBelowTheMark) {
  int64_t resident = 120 * kMiB;
  MemoryGuard guard(100 * kMiB, [&] { return resident; });
  guard.Sample();
  resident = 93 * kMiB;
  guard.Sample();
  std::this_thread::sleep_for(MemoryGuard::kSettle + std::chrono::milliseconds(50));
  guard.Sample();
  EXPECT_TRUE(guard.over_limit());
}

TEST(MemoryGuardTest, NoBoundIsNeverOverButStillMeasures) {
  MemoryGuard guard(0, [] { return int64_t{1} << 40; });
  guard.Sample();
  EXPECT_FALSE(guard.over_limit());
  EXPECT_EQ(guard.resident_bytes(), int64_t{1} << 40);
}

TEST(MemoryGuardTest, AnUnreadableMeasurementKeepsTheLastState) {
  int64_t resident = 200 * kMiB;
  MemoryGuard guard(100 * kMiB, [&] { return resident; });
  guard.Sample();
  ASSERT_TRUE(guard.over_limit());
  resident = -1;
  guard.Sample();
  EXPECT_TRUE(guard.over_limit());
  EXPECT_EQ(guard.resident_bytes(), 200 * kMiB);
}

TEST(MemoryGuardTest, ReadsThisProcessAndFollowsAnAllocation) {
  const int64_t before = MemoryGuard::ReadResidentBytes();
  ASSERT_GT(before, 0);
  std::vector<char> block(64 * kMiB, 1);  // touched: resident
  const int64_t after = MemoryGuard::ReadResidentBytes();
  EXPECT_GE(after - before, 48 * kMiB) << "before " << before << " after " << after;
  EXPECT_GT(MemoryGuard::DefaultLimitBytes(), 0);
}

TEST(MemoryGuardTest, TheSamplingThreadNotices) {
  std::atomic<int64_t> resident{10 * kMiB};
  MemoryGuard guard(100 * kMiB, [&] { return resident.load(); }, std::chrono::milliseconds(5));
  guard.Start();
  EXPECT_FALSE(guard.over_limit());
  resident = 150 * kMiB;
  for (int i = 0; i < 400 && !guard.over_limit(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(guard.over_limit());
  guard.Stop();
}

}  // namespace
}  // namespace foreshock::server
