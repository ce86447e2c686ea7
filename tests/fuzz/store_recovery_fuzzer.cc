// libFuzzer target: the store's recovery from mutated segment files. Each
// input either edits a real segment (xor bytes at chosen offsets, then maybe
// cut it) or is a segment file of its own; the store must open it without
// crashing, read back only points that decode, and a second open must agree.
// Built by tests/fuzz/run.sh (FORESHOCK_FUZZ_TARGET=store_recovery).
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "store/durable_store.h"

namespace {

using foreshock::store::DurableSeriesStore;
using foreshock::store::DurableStoreOptions;
using foreshock::store::FsyncPolicy;
using foreshock::store::KeyedPoint;
using foreshock::store::Point;
using foreshock::store::SeriesKey;

std::string ScratchRoot() {
  std::string pattern = (std::filesystem::exists("/dev/shm") ? "/dev/shm" : "/tmp") +
                        std::string("/foreshock_store_fuzz_XXXXXX");
  if (::mkdtemp(pattern.data()) == nullptr) std::abort();
  return pattern;
}

DurableStoreOptions Options(const std::string& dir) {
  DurableStoreOptions options;
  options.data_dir = dir;
  options.fsync = FsyncPolicy::kNone;
  options.block_bytes = 512;
  options.block_bytes_per_series = 0;
  options.cache_points_per_series = 2;
  return options;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A real sealed segment: 6 series, 120 steps, some events.
std::string BaseSegment(const std::string& root) {
  const std::string dir = root + "/base";
  {
    auto store = DurableSeriesStore::Open(Options(dir));
    if (!store.ok()) std::abort();
    for (int64_t step = 0; step < 120; ++step) {
      std::vector<KeyedPoint> batch;
      for (int s = 0; s < 6; ++s) {
        batch.push_back({SeriesKey{"run", "signal" + std::to_string(s % 3), s / 3, -1},
                         Point{step, double(step * s) / 7.0, step}});
      }
      (void)(*store)->AppendBatch(batch);
      if (step % 25 == 0) (void)(*store)->AppendEvent("alert", "at " + std::to_string(step));
    }
  }
  return ReadAll(dir + "/segments/00000001.seg");
}

void ReadEverything(DurableSeriesStore& store) {
  for (const auto& run : store.ListRuns()) {
    for (const auto& series : store.ListSeries(run.run)) {
      const auto points = store.Range(series.key, series.first_step, series.last_step);
      if (points.size() > series.points) std::abort();  // more than the index says
    }
  }
  store.Events("alert");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string root = ScratchRoot();
  static const std::string base = BaseSegment(root);
  if (size == 0) return 0;
  std::string file;
  if (data[0] % 4 != 0) {
    file = base;
    size_t i = 1;
    for (; i + 2 < size; i += 3) {
      const size_t offset = (size_t{data[i]} | size_t{data[i + 1]} << 8) % file.size();
      file[offset] = static_cast<char>(file[offset] ^ data[i + 2]);
    }
    if (data[0] % 4 == 3 && i + 1 < size) {
      file.resize((size_t{data[i]} | size_t{data[i + 1]} << 8) % (file.size() + 1));
    }
  } else {
    file.assign(reinterpret_cast<const char*>(data) + 1, size - 1);
  }
  const std::string dir = root + "/work";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir + "/segments");
  {
    std::ofstream out(dir + "/segments/00000001.seg", std::ios::binary);
    out.write(file.data(), static_cast<std::streamsize>(file.size()));
  }
  for (int open = 0; open < 2; ++open) {
    auto store = DurableSeriesStore::Open(Options(dir));
    if (!store.ok()) std::abort();  // segment contents never fail an open
    ReadEverything(**store);
    if (open == 1 && (*store)->Stats().truncated_bytes != 0) std::abort();  // repaired once
  }
  return 0;
}
