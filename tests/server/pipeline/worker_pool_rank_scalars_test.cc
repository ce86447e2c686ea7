// Several ranks' step scalars through the worker pool (wire/rank_scalars.h in
// server/pipeline/worker_pool): the detectors see the run's series, the
// sinks each rank's own value too, and open steps survive a checkpoint.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "server/pipeline/worker_pool.h"
#include "tests/wire/scalar_reports.h"

namespace foreshock::server {
namespace {

using detectors::Sample;
using wire::testing::Report;

// Through the worker pool: the detectors see the run's series (the mean),
// the sinks also get each rank's own finite values in the head slot (not for
// detection), and every sample is done once.
class CollectingSink final : public ObservationSink {
 public:
  struct Obs {
    std::string run;
    int64_t step;
    int32_t sample_rank;
    std::string signal;
    int head;
    double value;
    bool for_detection;
  };
  void OnObservation(const Sample& sample, const detectors::Observation& o) override {
    std::lock_guard<std::mutex> lock(mu_);
    obs_.push_back({sample.run, sample.step, sample.rank, std::string(o.signal), o.head, o.value,
                    o.for_detection});
  }
  void OnNonFinite(const Sample& sample, detectors::SampleKind, int64_t count) override {
    std::lock_guard<std::mutex> lock(mu_);
    nonfinite_.push_back({sample.step, count});
  }
  void OnSampleDone(const Sample&) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++done_;
    cv_.notify_all();
  }
  void WaitFor(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    ASSERT_TRUE(cv_.wait_for(lock, std::chrono::seconds(30), [&] { return done_ >= n; }));
  }
  std::vector<Obs> obs() {
    std::lock_guard<std::mutex> lock(mu_);
    return obs_;
  }
  std::vector<std::pair<int64_t, int64_t>> nonfinite() {
    std::lock_guard<std::mutex> lock(mu_);
    return nonfinite_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Obs> obs_;
  std::vector<std::pair<int64_t, int64_t>> nonfinite_;
  size_t done_ = 0;
};

TEST(RankScalarsInWorkerPool, DetectorsSeeTheMeanAndSinksKeepEachRank) {
  CollectingSink sink;
  WorkerPool pool(3, detectors::DetectorOptions{}, sink, [](size_t) {});
  std::vector<WorkItem> items;
  for (int64_t step = 0; step < 4; ++step) {
    for (int32_t rank : {1, 0}) {
      WorkItem item;
      item.sample = Report("ddp", rank, step, step == 3 && rank == 1 ? NAN : 2.0 + rank,
                           0.5 * (rank + 1), 1e-3, 2);
      items.push_back(std::move(item));
    }
  }
  WorkItem solo;
  solo.sample = Report("solo", 0, 0, 9.0, 1.0, 1e-3);
  items.push_back(std::move(solo));
  pool.Dispatch(std::move(items));
  sink.WaitFor(9);
  pool.DrainAndStop();

  std::map<std::tuple<std::string, int, int64_t>, double> run_level;  // (signal, head, step)
  int solo_loss = 0;
  for (const auto& o : sink.obs()) {
    if (o.run == "solo") {
      // One rank: its own sample, unchanged, and no per-rank copy.
      EXPECT_EQ(o.sample_rank, 0);
      EXPECT_EQ(o.head, -1);
      solo_loss += o.signal == "loss" && o.value == 9.0;
      continue;
    }
    if (o.signal != "loss" && o.signal != "grad_norm" && o.signal != "lr") continue;
    if (o.head == -1) {
      EXPECT_EQ(o.sample_rank, -1);
      EXPECT_TRUE(o.for_detection);
    } else {
      EXPECT_EQ(o.sample_rank, o.head);  // a rank's own value, at its own report
      EXPECT_FALSE(o.for_detection);
    }
    EXPECT_TRUE(run_level.emplace(std::make_tuple(o.signal, o.head, o.step), o.value).second)
        << o.signal << " " << o.head << " " << o.step;
  }
  EXPECT_EQ(solo_loss, 1);
  for (int64_t step = 0; step < 3; ++step) {
    EXPECT_EQ(run_level.at({"loss", -1, step}), 2.5);
    EXPECT_EQ(run_level.at({"loss", 0, step}), 2.0);
    EXPECT_EQ(run_level.at({"loss", 1, step}), 3.0);
    EXPECT_EQ(run_level.at({"grad_norm", -1, step}), 0.75);
    EXPECT_EQ(run_level.at({"lr", -1, step}), 1e-3);
  }
  // Step 3: rank 1's NaN is not stored as its own value, and the run's loss
  // is non-finite (counted once, at the merged step), its grad_norm still there.
  EXPECT_FALSE(run_level.contains({"loss", 1, 3}));
  EXPECT_FALSE(run_level.contains({"loss", -1, 3}));
  EXPECT_EQ(run_level.at({"grad_norm", -1, 3}), 0.75);
  bool counted = false;
  for (const auto& [step, count] : sink.nonfinite()) counted |= step == 3 && count >= 1;
  EXPECT_TRUE(counted);
  // The baselines ran on the merged series, once per step.
  int olmo = 0;
  for (const auto& o : sink.obs()) olmo += o.run == "ddp" && o.signal == "baseline_nonfinite";
  EXPECT_EQ(olmo, 4);
}

TEST(RankScalarsInWorkerPool, OpenStepsSurviveACheckpointIntoAPoolOfAnotherSize) {
  // Rank 0 reported steps 0-3, rank 1 none yet; the daemon checkpoints and
  // restarts (with another worker count); then rank 1 reports. The run's
  // series is the mean of both ranks, as without the restart.
  std::string checkpoint;
  {
    CollectingSink sink;
    WorkerPool pool(3, detectors::DetectorOptions{}, sink, [](size_t) {});
    std::vector<WorkItem> items;
    for (int64_t step = 0; step < 4; ++step) {
      WorkItem item;
      item.sample = Report("ddp", 0, step, 2.0, {}, {}, 2);
      items.push_back(std::move(item));
    }
    pool.Dispatch(std::move(items));
    sink.WaitFor(4);
    pool.DrainAndStop();
    checkpoint = pool.SaveDetectorState();
  }
  CollectingSink sink;
  WorkerPool pool(2, detectors::DetectorOptions{}, sink, [](size_t) {});
  std::string error;
  ASSERT_TRUE(pool.RestoreDetectorState(checkpoint, &error)) << error;
  std::vector<WorkItem> items;
  for (int64_t step = 0; step < 4; ++step) {
    WorkItem item;
    item.sample = Report("ddp", 1, step, 3.0, {}, {}, 2);
    items.push_back(std::move(item));
  }
  pool.Dispatch(std::move(items));
  sink.WaitFor(4);
  pool.DrainAndStop();
  std::map<int64_t, double> run_loss;
  for (const auto& o : sink.obs()) {
    if (o.run == "ddp" && o.signal == "loss" && o.head == -1) run_loss[o.step] = o.value;
  }
  EXPECT_EQ(run_loss, (std::map<int64_t, double>{{0, 2.5}, {1, 2.5}, {2, 2.5}, {3, 2.5}}));

  // A checkpoint whose open steps are damaged: reported, and they are dropped
  // (the detectors' own states are restored).
  const size_t at = checkpoint.rfind("FSRS");
  ASSERT_NE(at, std::string::npos);
  std::string damaged = checkpoint;
  damaged[at + 3] = 'X';  // its magic
  WorkerPool other(2, detectors::DetectorOptions{}, sink, [](size_t) {});
  EXPECT_FALSE(other.RestoreDetectorState(damaged, &error));
  EXPECT_NE(error.find("open multi-rank steps refused"), std::string::npos) << error;
  EXPECT_EQ(error.find("detector "), std::string::npos) << error;  // the detectors restored
  other.DrainAndStop();
}

}  // namespace
}  // namespace foreshock::server
