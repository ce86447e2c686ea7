// Opening never crashes on any bytes: random damage to a real log (flipped
// bytes, cuts, garbage, deleted files) and well-framed records with garbage
// payloads. After each open, every point read back must be one that was
// written, and every batch in an undamaged segment must be complete.
#include <gtest/gtest.h>

#include <random>
#include <set>

#include "store/durable_store.h"
#include "store/record_format.h"
#include "tests/store/store_test_support.h"

namespace foreshock::store {
namespace {

using testing::CopyDir;
using testing::Key;
using testing::ReferenceModel;
using testing::ScratchDir;
using testing::SegmentFiles;

constexpr int64_t kAllFrom = std::numeric_limits<int64_t>::min();
constexpr int64_t kAllTo = std::numeric_limits<int64_t>::max();

DurableStoreOptions FuzzOptions(const std::string& dir) {
  DurableStoreOptions options;
  options.data_dir = dir;
  options.fsync = FsyncPolicy::kNone;
  options.segment_bytes = 1024;
  options.block_bytes = 256;
  options.block_bytes_per_series = 0;
  options.cache_points_per_series = 4;
  return options;
}

struct Fixture {
  ReferenceModel reference;
  std::vector<std::string> segment_of_batch;  // file name, by step
  std::vector<SeriesKey> keys;
};

Fixture WriteFixture(const std::string& dir) {
  Fixture fixture;
  std::mt19937_64 rng(9);
  for (int s = 0; s < 5; ++s) fixture.keys.push_back(Key("run", "signal" + std::to_string(s), s));
  auto store = DurableSeriesStore::Open(FuzzOptions(dir));
  EXPECT_TRUE(store.ok());
  for (int64_t step = 0; step < 400; ++step) {
    std::vector<KeyedPoint> batch;
    for (const SeriesKey& key : fixture.keys) {
      if (rng() % 4 != 0) batch.push_back({key, Point{step, double(rng() % 1000) / 8, step * 7}});
    }
    if (batch.empty()) batch.push_back({fixture.keys[0], Point{step, 0.0, step * 7}});
    (*store)->AppendBatch(batch);
    fixture.reference.Add(batch);
    char name[32];
    std::snprintf(name, sizeof(name), "%08llu.seg",
                  static_cast<unsigned long long>((*store)->Stats().segments_created));
    fixture.segment_of_batch.push_back(name);
    if (step % 37 == 0) (*store)->AppendEvent("alert", "event at " + std::to_string(step));
  }
  return fixture;
}

// Damages one segment file at random; returns its name, or "" if none.
std::string Damage(const std::string& dir, std::mt19937_64& rng) {
  const auto files = SegmentFiles(dir);
  const std::string victim = files[rng() % files.size()];
  std::string bytes = testing::ReadFile(victim);
  switch (rng() % 6) {
    case 0:
    case 1: {  // flip a few bytes
      const int flips = 1 + static_cast<int>(rng() % 8);
      for (int i = 0; i < flips && !bytes.empty(); ++i) {
        bytes[rng() % bytes.size()] ^= static_cast<char>(1 + rng() % 255);
      }
      break;
    }
    case 2:  // cut at a random offset
      bytes.resize(bytes.empty() ? 0 : rng() % bytes.size());
      break;
    case 3: {  // append garbage
      const size_t n = 1 + rng() % 64;
      for (size_t i = 0; i < n; ++i) bytes.push_back(static_cast<char>(rng()));
      break;
    }
    case 4: {  // overwrite a random range with garbage
      if (bytes.empty()) break;
      const size_t begin = rng() % bytes.size();
      const size_t end = std::min(bytes.size(), begin + 1 + rng() % 40);
      for (size_t i = begin; i < end; ++i) bytes[i] = static_cast<char>(rng());
      break;
    }
    case 5:  // the file disappears
      std::filesystem::remove(victim);
      return std::filesystem::path(victim).filename();
  }
  testing::WriteFile(victim, bytes);
  return std::filesystem::path(victim).filename();
}

void CheckRecovered(const SeriesStore& store, const Fixture& fixture, const std::string& damaged) {
  for (const SeriesKey& key : fixture.keys) {
    std::map<int64_t, Point> written;
    for (const Point& p : fixture.reference.Range(key, kAllFrom, kAllTo)) written[p.step] = p;
    std::set<int64_t> seen;
    for (const Point& p : store.Range(key, kAllFrom, kAllTo)) {
      auto it = written.find(p.step);
      ASSERT_TRUE(it != written.end()) << "step " << p.step << " was never written";
      ASSERT_TRUE(testing::SamePoint(it->second, p)) << "step " << p.step << " changed";
      ASSERT_TRUE(seen.insert(p.step).second) << "step " << p.step << " twice";
    }
    for (const auto& [step, point] : written) {
      if (fixture.segment_of_batch[step] != damaged) {
        ASSERT_TRUE(seen.count(step)) << testing::KeyName(key) << " lost step " << step
                                      << " from undamaged " << fixture.segment_of_batch[step];
      }
    }
  }
}

TEST(DurableStoreFuzzTest, RandomDamageNeverCrashesAndLosesOnlyTheDamagedSegment) {
  ScratchDir dir;
  const std::string original = dir.Sub("original");
  const Fixture fixture = WriteFixture(original);
  ASSERT_GE(SegmentFiles(original).size(), 8u);
  std::mt19937_64 rng(10);
  const std::string work = dir.Sub("work");
  for (int iteration = 0; iteration < 300; ++iteration) {
    SCOPED_TRACE(::testing::Message() << "iteration " << iteration);
    CopyDir(original, work);
    const std::string damaged = Damage(work, rng);
    {
      auto store = DurableSeriesStore::Open(FuzzOptions(work));
      ASSERT_TRUE(store.ok()) << store.status();
      CheckRecovered(**store, fixture, damaged);
      (*store)->Events("alert");
      (*store)->ListRuns();
    }
    // The first open repaired or reported; the second must agree with it.
    auto store = DurableSeriesStore::Open(FuzzOptions(work));
    ASSERT_TRUE(store.ok()) << store.status();
    EXPECT_EQ((*store)->Stats().truncated_bytes, 0u);
    CheckRecovered(**store, fixture, damaged);
  }
}

TEST(DurableStoreFuzzTest, WellFramedGarbageRecordsNeverCrash) {
  ScratchDir dir;
  std::mt19937_64 rng(12);
  for (int iteration = 0; iteration < 150; ++iteration) {
    std::string name = "d";  // (not "d" + ...: GCC 12 warns falsely, -Wrestrict)
    name += std::to_string(iteration);
    const std::string data_dir = dir.Sub(name);
    std::filesystem::create_directories(data_dir + "/segments");
    for (uint64_t sequence = 1; sequence <= 3; ++sequence) {
      std::string bytes(kSegmentMagic);
      AppendRecord(&bytes, RecordType::kSegmentHeader,
                   EncodeSegmentHeader({kSegmentFormatVersion, sequence, 0}));
      AppendRecord(&bytes, RecordType::kBlockStart, "");
      AppendRecord(&bytes, RecordType::kSeriesDef, EncodeSeriesDef({0, Key("r", "s")}));
      const int records = static_cast<int>(rng() % 20);
      for (int r = 0; r < records; ++r) {
        std::string payload(rng() % 48, '\0');
        for (char& c : payload) c = static_cast<char>(rng());
        if (rng() % 3 == 0 && !payload.empty()) payload[0] = static_cast<char>(rng() % 4);
        AppendRecord(&bytes, static_cast<RecordType>(1 + rng() % 8), payload);
      }
      char file[32];
      std::snprintf(file, sizeof(file), "/segments/%08llu.seg",
                    static_cast<unsigned long long>(sequence));
      testing::WriteFile(data_dir + file, bytes);
    }
    auto store = DurableSeriesStore::Open(FuzzOptions(data_dir));
    ASSERT_TRUE(store.ok()) << store.status();
    (*store)->Range(Key("r", "s"), kAllFrom, kAllTo);
    (*store)->ListSeries("r");
    (*store)->Append(Key("r", "s"), Point{1, 1, 1});
    EXPECT_FALSE((*store)->Range(Key("r", "s"), kAllFrom, kAllTo).empty());
  }
}

}  // namespace
}  // namespace foreshock::store
