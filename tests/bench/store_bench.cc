// Series store microbenchmarks: append throughput per fsync policy, bytes per
// point on disk for several kinds of values and block sizes, range reads from
// the cache and from the segment files, recovery speed, and memory per
// series. Run single-threaded; see docs/PERFORMANCE.md ("Series store").
#include <benchmark/benchmark.h>
#include <malloc.h>
#include <stdlib.h>

#include <cmath>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "store/durable_store.h"

namespace foreshock::store {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kWallStart = 1'700'000'000'000;

class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "store_bench_XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) std::abort();
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::unique_ptr<DurableSeriesStore> OpenOrDie(const DurableStoreOptions& options) {
  auto store = DurableSeriesStore::Open(options);
  if (!store.ok()) {
    std::fprintf(stderr, "%s\n", store.status().ToString().c_str());
    std::abort();
  }
  return std::move(*store);
}

enum ValueKind : int64_t {
  kFloatSignals = 0,  // detector output: computed in float, stored as double
  kDoubleWalk = 1,    // full-precision doubles, every mantissa bit noisy
  kSmallIntegers = 2, // counts that rarely change (dead experts, flags)
};

const char* ValueKindName(int64_t kind) {
  switch (kind) {
    case kFloatSignals: return "float_signals";
    case kDoubleWalk: return "double_walk";
    case kSmallIntegers: return "small_integers";
  }
  return "?";
}

// One daemon sample per batch: `series` observations of the same step (10
// signals x layers), one shared wall time, 4 steps per second.
class BatchGenerator {
 public:
  BatchGenerator(ValueKind kind, int series, const std::string& run = "run-bench")
      : kind_(kind), rng_(42), level_(series, 1.0) {
    static const char* kSignals[] = {"qk_increment_entropy", "qk_increment_effective_rank",
                                     "qk_increment_top1_share", "qk_second_order_ratio",
                                     "attention_entropy", "attention_max_logit",
                                     "router_entropy", "router_load_cv", "router_flip_rate",
                                     "router_dead_experts"};
    for (int s = 0; s < series; ++s) {
      batch_.push_back({SeriesKey{run, kSignals[s % 10], s / 10, -1}, Point{}});
      level_[s] = 1.0 + s;
    }
  }

  const std::vector<KeyedPoint>& Next() {
    std::normal_distribution<double> noise(0, 1e-3);
    for (size_t s = 0; s < batch_.size(); ++s) {
      Point& p = batch_[s].second;
      p.step = step_;
      p.wall_time_ms = kWallStart + step_ * 250;
      switch (kind_) {
        case kFloatSignals:
          level_[s] += noise(rng_) * level_[s];
          p.value = static_cast<float>(level_[s]);
          break;
        case kDoubleWalk:
          level_[s] += noise(rng_) * level_[s];
          p.value = level_[s];
          break;
        case kSmallIntegers:
          if (rng_() % 200 == 0) level_[s] += (rng_() % 2) ? 1 : -1;
          p.value = std::round(level_[s]);
          break;
      }
    }
    ++step_;
    return batch_;
  }

  int64_t step() const { return step_; }

 private:
  ValueKind kind_;
  std::mt19937_64 rng_;
  std::vector<double> level_;
  std::vector<KeyedPoint> batch_;
  int64_t step_ = 0;
};

uint64_t SegmentBytesOnDisk(const std::string& dir) {
  uint64_t bytes = 0;
  for (const auto& entry : fs::directory_iterator(dir + "/segments")) bytes += entry.file_size();
  return bytes;
}

// Append throughput: batches of 50 points, as the daemon appends one sample.
// Arg 0: fsync policy (0 every, 1 interval, 2 none).
void BM_AppendBatch(benchmark::State& state) {
  TempDir dir;
  DurableStoreOptions options;
  options.data_dir = dir.path();
  options.fsync = static_cast<FsyncPolicy>(state.range(0));
  auto store = OpenOrDie(options);
  BatchGenerator batches(kFloatSignals, 50);
  for (auto _ : state) store->AppendBatch(batches.Next());
  const DurableStoreStats stats = store->Stats();
  state.SetItemsProcessed(static_cast<int64_t>(stats.points_appended));
  state.SetLabel(std::string("fsync=") + std::string(FsyncPolicyName(options.fsync)));
  state.counters["bytes_per_point"] =
      static_cast<double>(stats.bytes_written) / static_cast<double>(stats.points_appended);
  state.counters["fsyncs"] = static_cast<double>(stats.fsyncs);
}
BENCHMARK(BM_AppendBatch)->Arg(2)->Arg(1)->Arg(0)->UseRealTime();

// Appenders on several threads at once. With fsync=every they share fsyncs
// (group commit), so the total rate grows with the number of threads.
// Args: fsync policy, threads. Each thread appends its own run's batches.
void BM_ConcurrentAppenders(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(1));
  const int batches_per_thread = state.range(0) == 0 ? 200 : 20000;
  for (auto _ : state) {
    TempDir dir;
    DurableStoreOptions options;
    options.data_dir = dir.path();
    options.fsync = static_cast<FsyncPolicy>(state.range(0));
    auto store = OpenOrDie(options);
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] {
        BatchGenerator batches(kFloatSignals, 50, "run-" + std::to_string(t));
        for (int i = 0; i < batches_per_thread; ++i) store->AppendBatch(batches.Next());
      });
    }
    for (auto& w : workers) w.join();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const DurableStoreStats stats = store->Stats();
    state.SetIterationTime(seconds);
    state.counters["points_per_second"] = static_cast<double>(stats.points_appended) / seconds;
    state.counters["fsyncs"] = static_cast<double>(stats.fsyncs);
    state.counters["batches"] = static_cast<double>(stats.batches_appended);
  }
  state.SetLabel(std::string("fsync=") +
                 std::string(FsyncPolicyName(static_cast<FsyncPolicy>(state.range(0)))) +
                 " threads=" + std::to_string(threads));
}
BENCHMARK(BM_ConcurrentAppenders)
    ->ArgsProduct({{0, 2}, {1, 4}})
    ->Iterations(1)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

// Bytes per point on disk for 1M points (20,000 steps of 50 series, or 1,000
// steps of 1,000), everything included: segment headers, series definitions,
// block restarts, end records. Args: value kind, block_bytes, series.
void BM_BytesPerPoint(benchmark::State& state) {
  const int series = static_cast<int>(state.range(2));
  const int steps = 1'000'000 / series;
  for (auto _ : state) {
    TempDir dir;
    DurableStoreOptions options;
    options.data_dir = dir.path();
    options.fsync = FsyncPolicy::kNone;
    options.block_bytes = static_cast<uint64_t>(state.range(1));
    BatchGenerator batches(static_cast<ValueKind>(state.range(0)), series);
    {
      auto store = OpenOrDie(options);
      for (int step = 0; step < steps; ++step) store->AppendBatch(batches.Next());
    }
    const double points = double{1.0} * series * steps;
    state.counters["bytes_per_point"] = static_cast<double>(SegmentBytesOnDisk(dir.path())) / points;
    state.SetItemsProcessed(static_cast<int64_t>(points));
  }
  state.SetLabel(std::string(ValueKindName(state.range(0))) + " block=" +
                 std::to_string(state.range(1) >> 10) + "KiB series=" + std::to_string(series));
}
BENCHMARK(BM_BytesPerPoint)
    ->ArgsProduct({{kFloatSignals, kDoubleWalk, kSmallIntegers}, {64 << 10}, {50}})
    ->ArgsProduct({{kFloatSignals}, {16 << 10, 256 << 10, 1 << 20}, {50}})
    ->ArgsProduct({{kFloatSignals}, {64 << 10}, {1000}})
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);

// A store of 50 series x 20,000 steps (float signals) with the default
// 2048-point cache, shared by the read benchmarks. The segment files are in
// the page cache: "disk" reads below decode segment bytes, they do not wait
// for a device.
struct ReadFixture {
  static constexpr int kSeries = 50, kSteps = 20000;
  TempDir dir;
  std::unique_ptr<DurableSeriesStore> store;
  std::vector<SeriesKey> keys;

  explicit ReadFixture(uint64_t block_bytes) {
    DurableStoreOptions options;
    options.data_dir = dir.path();
    options.fsync = FsyncPolicy::kNone;
    options.block_bytes = block_bytes;
    store = OpenOrDie(options);
    BatchGenerator batches(kFloatSignals, kSeries);
    for (int step = 0; step < kSteps; ++step) {
      const auto& batch = batches.Next();
      if (step == 0) {
        for (const auto& [key, point] : batch) keys.push_back(key);
      }
      store->AppendBatch(batch);
    }
  }

  static ReadFixture& Get(uint64_t block_bytes) {
    static std::map<uint64_t, std::unique_ptr<ReadFixture>> fixtures;
    auto& fixture = fixtures[block_bytes];
    if (!fixture) fixture = std::make_unique<ReadFixture>(block_bytes);
    return *fixture;
  }
};

const int64_t kDefaultBlockBytes = static_cast<int64_t>(DurableStoreOptions().block_bytes);

// Args: first step, last step, block bytes.
void BM_Range(benchmark::State& state) {
  ReadFixture& fixture = ReadFixture::Get(static_cast<uint64_t>(state.range(2)));
  const uint64_t read_before = fixture.store->Stats().disk_bytes_read;
  size_t points = 0, series = 0;
  for (auto _ : state) {
    const auto out = fixture.store->Range(fixture.keys[series++ % fixture.keys.size()],
                                          state.range(0), state.range(1));
    points += out.size();
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(static_cast<int64_t>(points));
  state.counters["points_per_read"] = static_cast<double>(points) / state.iterations();
  state.counters["disk_bytes_per_read"] =
      static_cast<double>(fixture.store->Stats().disk_bytes_read - read_before) / state.iterations();
  state.SetLabel("block=" + std::to_string(state.range(2) >> 10) + "KiB");
}
BENCHMARK(BM_Range)
    ->Args({19000, 19999, kDefaultBlockBytes})  // the last 1000 steps: in the cache
    ->Args({5000, 5999, kDefaultBlockBytes})    // 1000 old steps: from the segment
    ->Args({0, 19999, kDefaultBlockBytes})      // everything: 18,000 from disk, 2,048 cached
    ->Args({5000, 5999, 256 << 10})
    ->Args({5000, 5999, 16 << 10})
    ->Unit(benchmark::kMicrosecond);

void BM_DownsampleAll(benchmark::State& state) {
  ReadFixture& fixture = ReadFixture::Get(kDefaultBlockBytes);
  size_t series = 0;
  for (auto _ : state) {
    const auto buckets = fixture.store->Downsample(fixture.keys[series++ % fixture.keys.size()], 0,
                                                   ReadFixture::kSteps, 500);
    benchmark::DoNotOptimize(buckets.data());
  }
  state.SetItemsProcessed(state.iterations() * ReadFixture::kSteps);
}
BENCHMARK(BM_DownsampleAll)->Unit(benchmark::kMicrosecond);

// Open: scan and index 1M points (50 series x 20,000 steps).
void BM_Recover(benchmark::State& state) {
  TempDir dir;
  DurableStoreOptions options;
  options.data_dir = dir.path();
  options.fsync = FsyncPolicy::kNone;
  {
    auto store = OpenOrDie(options);
    BatchGenerator batches(kFloatSignals, 50);
    for (int step = 0; step < 20000; ++step) store->AppendBatch(batches.Next());
  }
  uint64_t points = 0;
  for (auto _ : state) {
    auto store = OpenOrDie(options);
    points += store->Stats().recovered_points;
  }
  state.SetItemsProcessed(static_cast<int64_t>(points));
}
BENCHMARK(BM_Recover)->Unit(benchmark::kMillisecond)->UseRealTime();

int64_t ResidentBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return 0;
}

// Memory per series with full caches: 1000 series x 4096 steps. Arg: cache
// points per series. Reports the store's own accounting and the growth of
// the resident set.
void BM_MemoryPerSeries(benchmark::State& state) {
  constexpr int kSeries = 1000, kSteps = 4096;
  for (auto _ : state) {
    TempDir dir;
    DurableStoreOptions options;
    options.data_dir = dir.path();
    options.fsync = FsyncPolicy::kNone;
    options.cache_points_per_series = static_cast<size_t>(state.range(0));
    ::malloc_trim(0);  // hand back what earlier benchmarks freed
    const int64_t rss_before = ResidentBytes();
    auto store = OpenOrDie(options);
    BatchGenerator batches(kFloatSignals, kSeries);
    for (int step = 0; step < kSteps; ++step) store->AppendBatch(batches.Next());
    state.counters["approx_bytes_per_series"] =
        static_cast<double>(store->ApproxMemoryBytes()) / kSeries;
    state.counters["rss_bytes_per_series"] =
        static_cast<double>(ResidentBytes() - rss_before) / kSeries;
  }
  state.SetLabel("cache=" + std::to_string(state.range(0)));
}
BENCHMARK(BM_MemoryPerSeries)->Arg(2048)->Arg(256)->Iterations(1)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace foreshock::store

BENCHMARK_MAIN();
