// Damage to segment files costs only what it touches: a flipped byte anywhere
// in the newest or a sealed segment loses at most the points of its own block
// from the damaged record on (point encoding runs through a block), never
// what follows; nothing with valid data is deleted or truncated; only regular
// files are opened.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <set>

#include "store/durable_store.h"
#include "store/point_codec.h"
#include "store/record_format.h"
#include "tests/store/store_test_support.h"

namespace foreshock::store {
namespace {

using testing::CopyDir;
using testing::Key;
using testing::ScratchDir;
using testing::SegmentFiles;

constexpr int64_t kAllFrom = std::numeric_limits<int64_t>::min();
constexpr int64_t kAllTo = std::numeric_limits<int64_t>::max();

// The daemon's block sizes, a small cache (reads come from disk).
DurableStoreOptions DaemonLikeOptions(const std::string& dir) {
  DurableStoreOptions options;
  options.data_dir = dir;
  options.fsync = FsyncPolicy::kNone;
  options.cache_points_per_series = 4;
  return options;
}

// A point's identity: (series name, step).
using PointId = std::pair<std::string, int64_t>;

// The finding's segment: 10,000 points (20 series x 500 steps, one record
// per step, as the daemon writes them).
struct Written {
  std::map<std::string, SeriesKey> keys;
  std::map<PointId, Point> points;
};

Written WriteSegment(const std::string& dir, bool clean_close) {
  Written written;
  auto store = DurableSeriesStore::Open(DaemonLikeOptions(dir));
  EXPECT_TRUE(store.ok());
  for (int64_t step = 0; step < 500; ++step) {
    std::vector<KeyedPoint> batch;
    for (int s = 0; s < 20; ++s) {
      const SeriesKey key = Key("run", "signal" + std::to_string(s % 5), s / 5);
      const Point point{step, std::sin(0.01 * double(step) + s) * 3, 1'700'000'000'000 + step};
      written.keys.emplace(testing::KeyName(key), key);
      written.points.emplace(PointId{testing::KeyName(key), step}, point);
      batch.push_back({key, point});
    }
    EXPECT_TRUE((*store)->AppendBatch(batch).ok());
  }
  if (!clean_close) (*store)->AbandonForTesting();
  return written;
}

// The segment's layout, decoded independently of the store's recovery: every
// record's extent, and for each point the record and block it is in.
struct Layout {
  struct Rec {
    size_t begin, end;
    RecordType type;
    int block;  // index of the block it is in (-1 before the first)
  };
  std::vector<Rec> records;
  std::map<PointId, size_t> record_of_point;  // index into records
  std::map<PointId, uint32_t> local_id_of_point;
  bool sealed = false;
};

Layout ReadLayout(const std::string& file, const Written& written) {
  Layout layout;
  const std::string data = testing::ReadFile(file);
  size_t offset = kSegmentMagic.size();
  int block = -1;
  std::vector<std::string> names;  // by local id
  PointBlockCodec codec;
  std::vector<LocalPoint> points;
  Record record;
  while (ParseRecord(data, offset, &record) == ParseResult::kOk) {
    if (record.type == RecordType::kBlockStart) {
      ++block;
      codec.Reset();
    }
    layout.records.push_back({offset, offset + record.size, record.type, block});
    if (record.type == RecordType::kSeriesDef) {
      SeriesDef def;
      EXPECT_TRUE(DecodeSeriesDef(record.payload, &def));
      names.push_back(testing::KeyName(def.key));
    } else if (record.type == RecordType::kPoints) {
      EXPECT_TRUE(codec.Decode(record.payload, static_cast<uint32_t>(names.size()), &points));
      for (const LocalPoint& lp : points) {
        const PointId id{names[lp.local_id], lp.point.step};
        layout.record_of_point[id] = layout.records.size() - 1;
        layout.local_id_of_point[id] = lp.local_id;
      }
    } else if (record.type == RecordType::kSegmentEnd) {
      layout.sealed = true;
    }
    offset += record.size;
  }
  EXPECT_EQ(offset, data.size());
  EXPECT_EQ(layout.record_of_point.size(), written.points.size());
  EXPECT_GE(block, 2) << "the fixture must span several blocks";
  return layout;
}

// The points that damage to bytes [begin, end) may cost: the points of its
// block in records from the damaged one on (point encoding state runs through
// a block; a damaged block start costs the whole block). A damaged series
// definition in an unsealed segment also orphans that series' points in the
// rest of the segment (a sealed one repeats its definitions at its end).
std::set<PointId> MayLose(const Layout& layout, size_t begin, size_t end) {
  std::set<PointId> allowed;
  for (size_t r = 0; r < layout.records.size(); ++r) {
    const Layout::Rec& rec = layout.records[r];
    if (rec.end <= begin || rec.begin >= end) continue;
    for (const auto& [id, record] : layout.record_of_point) {
      const Layout::Rec& holder = layout.records[record];
      const bool rest_of_block = holder.block == rec.block && record >= r;
      const bool whole_block = rec.type == RecordType::kBlockStart && holder.block == rec.block;
      if (rest_of_block || whole_block) allowed.insert(id);
    }
    if (rec.type == RecordType::kSeriesDef) {
      // Local ids are given in order of first appearance.
      const uint32_t local_id = static_cast<uint32_t>(std::count_if(
          layout.records.begin(), layout.records.begin() + r,
          [](const Layout::Rec& x) { return x.type == RecordType::kSeriesDef; }));
      for (const auto& [id, lid] : layout.local_id_of_point) {
        if (lid == local_id && layout.record_of_point.at(id) > r) allowed.insert(id);
      }
    }
  }
  return allowed;
}

// Reads everything back: nothing invented or changed, nothing lost outside
// `allowed`. Returns the number of points missing.
size_t CheckSurvivors(const DurableSeriesStore& store, const Written& written,
                      const std::set<PointId>& allowed) {
  std::set<PointId> read;
  for (const auto& [name, key] : written.keys) {
    for (const Point& p : store.Range(key, kAllFrom, kAllTo)) {
      auto it = written.points.find({name, p.step});
      EXPECT_TRUE(it != written.points.end() && testing::SamePoint(it->second, p))
          << name << " step " << p.step << " was never written like this";
      EXPECT_TRUE(read.insert({name, p.step}).second) << name << " step " << p.step << " twice";
    }
  }
  size_t missing = 0, outside = 0;
  for (const auto& [id, point] : written.points) {
    if (read.count(id)) continue;
    ++missing;
    if (!allowed.count(id)) ++outside;
  }
  EXPECT_EQ(outside, 0u) << outside << " of " << missing
                         << " missing points lie outside the damaged block; the store says: "
                         << (store.Problems().empty() ? "" : store.Problems().back());
  return missing;
}

void DamageSweep(bool clean_close) {
  ScratchDir dir;
  const std::string original = dir.Sub("original");
  const Written written = WriteSegment(original, clean_close);
  const std::string name = std::filesystem::path(SegmentFiles(original).front()).filename();
  const Layout layout = ReadLayout(original + "/segments/" + name, written);
  ASSERT_EQ(layout.sealed, clean_close);
  const size_t size = std::filesystem::file_size(original + "/segments/" + name);

  const std::string work = dir.Sub("work");
  size_t worst = 0;
  for (size_t i = 0; i < 160; ++i) {
    const size_t position = (i * size) / 160 + i % 7;
    if (position >= size) continue;
    SCOPED_TRACE(::testing::Message() << "byte " << position << " of " << size);
    CopyDir(original, work);
    const std::string file = work + "/segments/" + name;
    testing::FlipByte(file, position, 0x5A);
    auto store = DurableSeriesStore::Open(DaemonLikeOptions(work));
    ASSERT_TRUE(store.ok()) << store.status();
    const size_t missing = CheckSurvivors(**store, written, MayLose(layout, position, position + 1));
    worst = std::max(worst, missing);
    const DurableStoreStats stats = (*store)->Stats();
    if (clean_close) {
      // The end record counts every point: the loss is reported exactly.
      EXPECT_EQ(stats.lost_points, missing);
    } else {
      EXPECT_LE(stats.lost_points, missing);
    }
    if (missing > 0) {
      EXPECT_FALSE((*store)->Problems().empty());
    }
    EXPECT_EQ(stats.quarantined_segments, 0u);
    EXPECT_TRUE(std::filesystem::exists(file));  // never deleted
  }
  // One damaged byte costs at most one block of this segment.
  EXPECT_LT(worst, written.points.size() / 3);
}

TEST(StoreDamageTest, FlippedByteInASealedSegmentLosesOnlyItsBlock) { DamageSweep(true); }

TEST(StoreDamageTest, FlippedByteInAnUnsealedNewestSegmentLosesOnlyItsBlock) {
  DamageSweep(false);
}

// Issue 27 (7): after a crash (no end record) a flipped byte inside a points
// record was reported as "at least 0 point(s) lost" while its points were
// gone. The damaged record's frame still says how many it held.
TEST(StoreDamageTest, AfterACrashTheReportCountsTheDamagedRecordsPoints) {
  ScratchDir dir;
  const std::string original = dir.Sub("original");
  const Written written = WriteSegment(original, /*clean_close=*/false);
  const std::string name = std::filesystem::path(SegmentFiles(original).front()).filename();
  const Layout layout = ReadLayout(original + "/segments/" + name, written);
  ASSERT_FALSE(layout.sealed);
  const std::string work = dir.Sub("work");
  int checked = 0;
  for (size_t r = 0; r < layout.records.size() && checked < 8; ++r) {
    const Layout::Rec& rec = layout.records[r];
    if (rec.type != RecordType::kPoints || rec.end - rec.begin < 64) continue;
    if (r % 7 != 3) continue;  // a spread of records, not all of them
    ++checked;
    CopyDir(original, work);
    const std::string file = work + "/segments/" + name;
    // A byte of the points, past the record's header and its point count.
    testing::FlipByte(file, (rec.begin + rec.end) / 2, 0x5A);
    auto store = DurableSeriesStore::Open(DaemonLikeOptions(work));
    ASSERT_TRUE(store.ok()) << store.status();
    const size_t missing = CheckSurvivors(**store, written, MayLose(layout, rec.begin, rec.end));
    EXPECT_GT(missing, 0u);
    // The counted loss stays a floor (a flipped byte can be a record's point
    // count: DamageSweep); the report states the frames' own count beside it.
    EXPECT_LE((*store)->Stats().lost_points, missing);
    ASSERT_FALSE((*store)->Problems().empty());
    const std::string report = (*store)->Problems().back();
    EXPECT_NE(report.find("by the damaged records' own counts " + std::to_string(missing) + ","),
              std::string::npos)
        << report;
  }
  EXPECT_GT(checked, 0);
}

TEST(StoreDamageTest, DamagedDefinitionInASealedSegmentCostsNothing) {
  ScratchDir dir;
  const Written written = WriteSegment(dir.path(), true);
  const std::string file = SegmentFiles(dir.path()).front();
  const Layout layout = ReadLayout(file, written);
  const auto def = std::find_if(layout.records.begin(), layout.records.end(), [](const auto& r) {
    return r.type == RecordType::kSeriesDef;
  });
  ASSERT_NE(def, layout.records.end());
  testing::FlipByte(file, def->end - 3, 0x20);  // a byte of the series name
  auto store = DurableSeriesStore::Open(DaemonLikeOptions(dir.path()));
  ASSERT_TRUE(store.ok());
  EXPECT_EQ(CheckSurvivors(**store, written, {}), 0u);
  EXPECT_EQ((*store)->Stats().corrupt_records, 1u);  // reported all the same
}

TEST(StoreDamageTest, OverwrittenSegmentHeaderKeepsTheSegment) {
  ScratchDir dir;
  const Written written = WriteSegment(dir.path(), true);
  const std::string file = SegmentFiles(dir.path()).front();
  const Layout layout = ReadLayout(file, written);
  std::string bytes = testing::ReadFile(file);
  for (size_t i = 0; i < 64; ++i) bytes[i] = static_cast<char>(0xA5 ^ i);
  testing::WriteFile(file, bytes);

  auto store = DurableSeriesStore::Open(DaemonLikeOptions(dir.path()));
  ASSERT_TRUE(store.ok()) << store.status();
  const size_t missing = CheckSurvivors(**store, written, MayLose(layout, 0, 64));
  EXPECT_LT(missing, written.points.size() / 3);
  EXPECT_EQ((*store)->Stats().lost_points, missing);
  EXPECT_TRUE(std::filesystem::exists(file));
}

TEST(StoreDamageTest, GarbageTailOfTheNewestSegmentIsCutAndEverythingBeforeKept) {
  ScratchDir dir;
  const Written written = WriteSegment(dir.path(), false);
  const std::string file = SegmentFiles(dir.path()).front();
  const uint64_t size = std::filesystem::file_size(file);
  std::string bytes = testing::ReadFile(file);
  bytes.append(100, '\x7f');  // a torn write: no valid record follows
  testing::WriteFile(file, bytes);
  auto store = DurableSeriesStore::Open(DaemonLikeOptions(dir.path()));
  ASSERT_TRUE(store.ok());
  EXPECT_EQ(CheckSurvivors(**store, written, {}), 0u);
  EXPECT_EQ((*store)->Stats().truncated_bytes, 100u);
  EXPECT_GT(std::filesystem::file_size(file), size);  // + the series table and end record
}

TEST(StoreDamageTest, OnlyRegularFilesAreOpened) {
  ScratchDir dir;
  const Written written = WriteSegment(dir.path(), true);
  // A FIFO named like a segment hung startup (open waited for a writer); a
  // link named like one could read a file outside the directory.
  ASSERT_EQ(::mkfifo((dir.path() + "/segments/00000007.seg").c_str(), 0644), 0);
  std::filesystem::create_directories(dir.Sub("outside"));
  const std::string outside = dir.Sub("outside") + "/00000001.seg";
  std::filesystem::copy_file(SegmentFiles(dir.path()).front(), outside);
  std::filesystem::create_symlink(outside, dir.path() + "/segments/00000008.seg");
  ASSERT_EQ(::mkfifo((dir.path() + "/checkpoints/engine.ckpt").c_str(), 0644), 0);

  auto store = DurableSeriesStore::Open(DaemonLikeOptions(dir.path()));
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ(CheckSurvivors(**store, written, {}), 0u);
  // Read once, not twice through the link.
  const auto& [name, key] = *written.keys.begin();
  EXPECT_EQ((*store)->Range(key, kAllFrom, kAllTo).size(), 500u);
  EXPECT_FALSE((*store)->ReadCheckpoint("engine").has_value());
  size_t not_regular = 0;
  for (const std::string& problem : (*store)->Problems()) {
    not_regular += problem.find("not a regular file") != std::string::npos;
  }
  EXPECT_EQ(not_regular, 3u);
  // New segments do not reuse the skipped names.
  EXPECT_TRUE((*store)->Append(key, Point{1000, 1, 1}).ok());
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/segments/00000009.seg"));
}

}  // namespace
}  // namespace foreshock::store
