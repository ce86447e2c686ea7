// Worker pool detector checkpoints: SaveDetectorState / RestoreDetectorState,
// across pool sizes, while workers run, and on corrupt input.
#include <gtest/gtest.h>

#include <atomic>
#include <bit>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "codec/state_codec.h"
#include "server/pipeline/worker_pool.h"
#include "tests/detectors/sample_streams.h"
#include "detectors/router_detector.h"
#include "detectors/scalar_baselines_detector.h"

namespace foreshock::server {
namespace {

using detectors::Sample;
using detectors::testing::QKStream;
using detectors::testing::RouterStream;
using detectors::testing::Scalars;

// Records detector output per (run, layer): the order within a series is
// fixed (one worker, in order), the interleaving across series is not.
class RecordingSink final : public ObservationSink {
 public:
  using Series = std::pair<std::string, int>;
  using Records = std::map<Series, std::vector<std::string>>;

  void OnObservation(const Sample& sample, const detectors::Observation& o) override {
    Add(sample, std::to_string(sample.step) + " " + std::string(o.signal) + " " +
                    std::to_string(o.layer) + " " + std::to_string(o.head) + " " +
                    std::to_string(std::bit_cast<uint64_t>(o.value)) + " " +
                    (o.for_detection ? "d" : "x"));
  }
  void OnNonFinite(const Sample& sample, detectors::SampleKind kind, int64_t count) override {
    Add(sample, std::to_string(sample.step) + " nonfinite " + std::to_string(count));
  }
  void OnSampleDone(const Sample&) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++done_;
    cv_.notify_all();
  }
  void OnDetectorError(std::string_view detector, const Sample&, const char* what) override {
    ADD_FAILURE() << detector << " threw " << what;
  }

  void WaitFor(size_t samples) {
    std::unique_lock<std::mutex> lock(mu_);
    ASSERT_TRUE(cv_.wait_for(lock, std::chrono::seconds(60), [&] { return done_ >= samples; }));
  }
  Records records() const {
    std::lock_guard<std::mutex> lock(mu_);
    return records_;
  }
  void Clear() {
    std::lock_guard<std::mutex> lock(mu_);
    records_.clear();
    done_ = 0;
  }

 private:
  void Add(const Sample& sample, std::string entry) {
    std::lock_guard<std::mutex> lock(mu_);
    records_[{sample.run, sample.layer()}].push_back(std::move(entry));
  }
  mutable std::mutex mu_;
  std::condition_variable cv_;
  Records records_;
  size_t done_ = 0;
};

detectors::DetectorOptions Options() {
  detectors::DetectorOptions options;
  options.Mutable<detectors::ScalarBaselinesOptions>().spike_window = 16;
  options.Mutable<detectors::RouterDetectorOptions>().dead_window = 4;
  return options;
}

struct Scenario {
  std::vector<Sample> a, b;
};

// Several runs, layers and probes of every detector kind; A before the
// checkpoint, B after.
Scenario MakeScenario(int a_steps = 30, int b_steps = 12) {
  std::mt19937 rng(17);
  std::vector<QKStream> qk;
  std::vector<RouterStream> router;
  for (const char* run : {"r1", "r2", "run-3"}) {
    for (int layer = 0; layer < 4; ++layer) {
      qk.push_back({run, layer, "p0", 2, 8, 4});
      if (layer % 2 == 1) qk.push_back({run, layer, "p1", 1, 6, 4, detectors::DType::kBFloat16});
      if (layer >= 2) router.push_back({run, layer, "p0", 16, 8, 2});
    }
  }
  std::normal_distribution<double> noise(0.0, 0.02);
  auto step_samples = [&](int64_t step, std::vector<Sample>& out) {
    for (QKStream& s : qk) out.push_back(s.Next(step, rng));
    for (RouterStream& s : router) out.push_back(s.Next(step, rng));
    for (const char* run : {"r1", "r2", "run-3"}) {
      out.push_back(Scalars(run, step, 3 + noise(rng), 1 + noise(rng)));
      detectors::CurvatureSample c;
      c.lambda_max = 10 + noise(rng);
      c.lr = 1e-3;
      c.beta1 = 0.9;
      c.preconditioned = true;
      Sample curvature;
      curvature.run = run;
      curvature.step = step;
      curvature.payload = c;
      out.push_back(curvature);
    }
  };
  Scenario scenario;
  for (int64_t step = 0; step < a_steps; ++step) step_samples(step, scenario.a);
  for (int64_t step = a_steps; step < a_steps + b_steps; ++step) step_samples(step, scenario.b);
  return scenario;
}

std::vector<WorkItem> Items(const std::vector<Sample>& samples) {
  std::vector<WorkItem> items;
  for (const Sample& s : samples) {
    WorkItem item;
    item.sample = s;
    item.bytes = 1;
    items.push_back(std::move(item));
  }
  return items;
}

// A pool with its sink.
struct Pool {
  explicit Pool(int workers) : pool(workers, Options(), sink, [](size_t) {}) {}
  void Feed(const std::vector<Sample>& samples) {
    sink.Clear();
    pool.Dispatch(Items(samples));
    sink.WaitFor(samples.size());
  }
  RecordingSink sink;
  WorkerPool pool;
};

std::string EmptyState(int workers) {
  Pool fresh(workers);
  return fresh.pool.SaveDetectorState();
}

// Records of the signals that `keep(signal)` accepts.
RecordingSink::Records Select(const RecordingSink::Records& records,
                              const std::function<bool(const std::string&)>& keep) {
  RecordingSink::Records selected;
  for (const auto& [series, entries] : records) {
    for (const std::string& entry : entries) {
      const size_t begin = entry.find(' ') + 1;
      const std::string signal = entry.substr(begin, entry.find(' ', begin) - begin);
      if (keep(signal)) selected[series].push_back(entry);
    }
  }
  return selected;
}

bool IsQKSignal(const std::string& signal) {
  return signal.starts_with("qk_") || signal.starts_with("attention_");
}

TEST(WorkerPoolStateTest, ShardOfSeriesMatchesShardOf) {
  const Scenario scenario = MakeScenario(1, 0);
  for (size_t shards : {1u, 2u, 3u, 7u}) {
    for (const Sample& s : scenario.a) {
      EXPECT_EQ(WorkerPool::ShardOf(s, shards), WorkerPool::ShardOfSeries(s.run, s.layer(), shards));
    }
  }
}

class WorkerPoolResizeTest : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(WorkerPoolResizeTest, RestoredPoolContinuesExactlyLikeTheOriginal) {
  const auto [from, to] = GetParam();
  const Scenario scenario = MakeScenario();
  Pool original(from);
  original.Feed(scenario.a);
  const std::string state = original.pool.SaveDetectorState();
  EXPECT_EQ(original.pool.SaveDetectorState(), state) << "saving is deterministic";

  Pool restored(to);
  std::string error;
  ASSERT_TRUE(restored.pool.RestoreDetectorState(state, &error)) << error;
  EXPECT_NE(restored.pool.SaveDetectorState(), EmptyState(to));

  // Nothing lost or duplicated in the re-sharding: back to `from` workers,
  // every series lands where it was and the bytes are the original's.
  {
    Pool back(from);
    ASSERT_TRUE(back.pool.RestoreDetectorState(restored.pool.SaveDetectorState(), &error)) << error;
    EXPECT_EQ(back.pool.SaveDetectorState(), state);
  }

  original.Feed(scenario.b);
  restored.Feed(scenario.b);
  const auto expected = original.sink.records();
  const auto actual = restored.sink.records();
  ASSERT_EQ(expected.size(), actual.size());
  for (const auto& [series, entries] : expected) {
    const auto it = actual.find(series);
    ASSERT_NE(it, actual.end()) << series.first << " layer " << series.second;
    EXPECT_EQ(entries, it->second) << series.first << " layer " << series.second;
  }

  // Not vacuous: a pool that starts from nothing says something else.
  Pool cold(to);
  cold.Feed(scenario.b);
  EXPECT_NE(cold.sink.records(), expected);
}

INSTANTIATE_TEST_SUITE_P(Sizes, WorkerPoolResizeTest,
                         ::testing::Values(std::pair{2, 3}, std::pair{3, 2}, std::pair{2, 2},
                                           std::pair{1, 4}, std::pair{4, 1}),
                         [](const auto& info) {
                           return std::to_string(info.param.first) + "_to_" +
                                  std::to_string(info.param.second);
                         });

TEST(WorkerPoolStateTest, SavingWhileWorkersRunGivesRestorableSnapshots) {
  const Scenario scenario = MakeScenario(60, 0);
  Pool pool(3);
  pool.pool.Dispatch(Items(scenario.a));
  std::vector<std::string> snapshots;
  for (int i = 0; i < 20; ++i) {
    snapshots.push_back(pool.pool.SaveDetectorState());
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  pool.sink.WaitFor(scenario.a.size());
  snapshots.push_back(pool.pool.SaveDetectorState());
  for (const std::string& snapshot : snapshots) {
    Pool restored(2);
    std::string error;
    EXPECT_TRUE(restored.pool.RestoreDetectorState(snapshot, &error)) << error;
  }
  // And after the workers stopped.
  pool.pool.DrainAndStop();
  EXPECT_EQ(pool.pool.SaveDetectorState(), snapshots.back());
}

TEST(WorkerPoolStateTest, UnreadableStateLeavesEveryDetectorEmpty) {
  const Scenario scenario = MakeScenario();
  Pool original(2);
  original.Feed(scenario.a);
  const std::string state = original.pool.SaveDetectorState();
  const std::string empty = EmptyState(3);
  Pool cold(3);
  cold.Feed(scenario.b);

  std::vector<size_t> lengths;
  for (size_t n = 0; n < 200; ++n) lengths.push_back(n);
  std::mt19937 rng(1);
  for (int i = 0; i < 60; ++i) {
    lengths.push_back(std::uniform_int_distribution<size_t>(200, state.size() - 1)(rng));
  }
  lengths.push_back(state.size() - 1);
  Pool restored(3);
  for (size_t length : lengths) {
    ASSERT_TRUE(restored.pool.RestoreDetectorState(state));  // state a failure must drop
    std::string error;
    EXPECT_FALSE(restored.pool.RestoreDetectorState(std::string_view(state).substr(0, length), &error))
        << length;
    EXPECT_FALSE(error.empty());
    ASSERT_EQ(restored.pool.SaveDetectorState(), empty) << "length " << length;
  }
  EXPECT_FALSE(restored.pool.RestoreDetectorState(state + "x"));  // trailing bytes
  EXPECT_FALSE(restored.pool.RestoreDetectorState("not a checkpoint at all"));
  restored.Feed(scenario.b);
  EXPECT_EQ(restored.sink.records(), cold.sink.records()) << "empty and usable";
}

// Rewrites a pool blob, letting `edit` change each (name, state) entry.
std::string Rewrite(const std::string& state,
                    const std::function<void(std::string& name, std::string& bytes)>& edit,
                    const std::vector<std::pair<std::string, std::string>>& extra = {}) {
  codec::StateReader reader(state);
  codec::StateWriter writer;
  uint32_t version = 0, workers = 0;
  EXPECT_TRUE(reader.GetHeader("FSDP", 1, 1, version) && reader.GetU32(workers));
  writer.PutHeader("FSDP", version);
  writer.PutU32(workers);
  for (uint32_t w = 0; w < workers; ++w) {
    uint32_t count = 0;
    EXPECT_TRUE(reader.GetU32(count));
    writer.PutU32(count + static_cast<uint32_t>(extra.size()));
    for (uint32_t d = 0; d < count; ++d) {
      std::string name, bytes;
      EXPECT_TRUE(reader.GetString(name) && reader.GetBytes(bytes));
      edit(name, bytes);
      writer.PutString(name);
      writer.PutBytes(bytes);
    }
    for (const auto& [name, bytes] : extra) {
      writer.PutString(name);
      writer.PutBytes(bytes);
    }
  }
  EXPECT_TRUE(reader.ExpectEnd()) << reader.error();
  return writer.Take();
}

TEST(WorkerPoolStateTest, ADetectorThatRefusesItsStateStartsEmptyAndTheOthersAreRestored) {
  const Scenario scenario = MakeScenario();
  Pool original(2);
  original.Feed(scenario.a);
  // The QK detector's state in a version this build does not read.
  const std::string state =
      Rewrite(original.pool.SaveDetectorState(), [](std::string& name, std::string& bytes) {
        if (name == "qk") bytes[0] = 42;
      });
  Pool restored(3);
  std::string error;
  EXPECT_FALSE(restored.pool.RestoreDetectorState(state, &error));
  EXPECT_NE(error.find("detector qk state refused"), std::string::npos) << error;
  EXPECT_NE(error.find("version 42"), std::string::npos) << error;

  Pool cold(3);
  cold.Feed(scenario.b);
  original.Feed(scenario.b);
  restored.Feed(scenario.b);
  const auto actual = restored.sink.records();
  EXPECT_EQ(Select(actual, IsQKSignal), Select(cold.sink.records(), IsQKSignal));
  const auto not_qk = [](const std::string& signal) { return !IsQKSignal(signal); };
  EXPECT_EQ(Select(actual, not_qk), Select(original.sink.records(), not_qk));
  EXPECT_NE(Select(actual, not_qk), Select(cold.sink.records(), not_qk));
}

TEST(WorkerPoolStateTest, RetiredDetectorsAreIgnoredAndMissingOnesStartEmpty) {
  const Scenario scenario = MakeScenario();
  Pool original(2);
  original.Feed(scenario.a);
  // A detector this build does not have, and no router state at all.
  const std::string state = Rewrite(
      original.pool.SaveDetectorState(),
      [](std::string& name, std::string& bytes) {
        if (name == "router") name = "router_v0";
      },
      {{"retired_detector", "whatever it kept"}});
  Pool restored(3);
  std::string error;
  EXPECT_TRUE(restored.pool.RestoreDetectorState(state, &error)) << error;

  Pool cold(3);
  cold.Feed(scenario.b);
  original.Feed(scenario.b);
  restored.Feed(scenario.b);
  const auto is_router = [](const std::string& signal) { return signal.starts_with("router_"); };
  const auto not_router = [&](const std::string& signal) { return !is_router(signal); };
  EXPECT_EQ(Select(restored.sink.records(), is_router), Select(cold.sink.records(), is_router));
  EXPECT_EQ(Select(restored.sink.records(), not_router),
            Select(original.sink.records(), not_router));
}

TEST(WorkerPoolStateTest, EmptyPoolStateRoundTrips) {
  Pool pool(2);
  const std::string state = pool.pool.SaveDetectorState();
  Pool restored(5);
  std::string error;
  EXPECT_TRUE(restored.pool.RestoreDetectorState(state, &error)) << error;
  EXPECT_EQ(restored.pool.SaveDetectorState(), EmptyState(5));
}

}  // namespace
}  // namespace foreshock::server

namespace foreshock::server {
namespace {

// Per run, the bytes of probe state the pool's detectors report (VisitRetained).
std::map<std::string, int64_t> RetainedByRun(const WorkerPool& pool) {
  std::map<std::string, int64_t> runs;
  pool.VisitRetained([&](std::string_view run, detectors::SampleKind, int, std::string_view, int,
                         int64_t bytes) { runs[std::string(run)] += bytes; });
  return runs;
}

TEST(WorkerPoolStateTest, RetainedStateIsReportedAcrossARestoreAndDroppedWithItsRun) {
  const Scenario scenario = MakeScenario(3, 0);
  Pool original(3);
  original.Feed(scenario.a);
  const auto before = RetainedByRun(original.pool);
  ASSERT_EQ(before.size(), 3u);  // r1, r2, run-3: QK and router series each
  for (const auto& [run, bytes] : before) EXPECT_GT(bytes, 0) << run;

  // A restarted daemon, another pool size: the same state, so the same count.
  Pool restored(2);
  std::string error;
  ASSERT_TRUE(restored.pool.RestoreDetectorState(original.pool.SaveDetectorState(), &error)) << error;
  EXPECT_EQ(RetainedByRun(restored.pool), before);

  // A run that ended frees its state; one that starts a new attempt too (as
  // the run lifecycle tells its state owners: run_lifecycle_test.cc).
  original.pool.OnRunEnded("r1");
  original.pool.OnRunRestarted("run-3");
  EXPECT_EQ(RetainedByRun(original.pool), (std::map<std::string, int64_t>{{"r2", before.at("r2")}}));
}

}  // namespace
}  // namespace foreshock::server
