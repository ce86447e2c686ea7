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
