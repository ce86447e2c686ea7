// CPU workers that run the detectors. Samples are sharded by (run, layer) so
// that each series is processed in order by one worker, which owns its own
// detector instances: detectors need no locks of their own. (A per-worker,
// uncontended lock around each item lets checkpoints read detector state
// between items; see SaveDetectorState.)
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "store/series_store.h"

#include "detectors/detector.h"
#include "wire/rank_scalars.h"
#include "server/pipeline/run_state_owner.h"

namespace foreshock::server {

// Where detector output goes: metrics, the series store, later the alert
// engine. Called from worker threads; implementations must be thread-safe.
class ObservationSink {
 public:
  virtual ~ObservationSink() = default;
  virtual void OnObservation(const detectors::Sample& sample,
                             const detectors::Observation& observation) = 0;
  virtual void OnNonFinite(const detectors::Sample& sample, detectors::SampleKind kind,
                           int64_t count) = 0;
  // After every detector has seen `sample`.
  virtual void OnSampleDone(const detectors::Sample& sample) = 0;
  // A revised value of a step whose value was observed before (a replaying
  // rank's part of a run-level mean, rank_scalars.h): stored as the step's
  // latest value; no detector, alert or gauge sees it.
  virtual void OnCorrection(const detectors::Sample& sample,
                            const detectors::Observation& observation) {}
  // How long detector `name` took on one sample.
  virtual void OnDetectorTime(std::string_view detector, double seconds) {}
  // A detector threw; the sample is skipped by that detector only.
  virtual void OnDetectorError(std::string_view detector, const detectors::Sample& sample,
                               const char* what) {}
};

// Forwards everything to several sinks, in order.
class FanoutSink final : public ObservationSink {
 public:
  explicit FanoutSink(std::vector<ObservationSink*> sinks) : sinks_(std::move(sinks)) {}
  void OnObservation(const detectors::Sample& sample,
                     const detectors::Observation& observation) override {
    for (ObservationSink* sink : sinks_) sink->OnObservation(sample, observation);
  }
  void OnNonFinite(const detectors::Sample& sample, detectors::SampleKind kind,
                   int64_t count) override {
    for (ObservationSink* sink : sinks_) sink->OnNonFinite(sample, kind, count);
  }
  void OnSampleDone(const detectors::Sample& sample) override {
    for (ObservationSink* sink : sinks_) sink->OnSampleDone(sample);
  }
  void OnCorrection(const detectors::Sample& sample,
                    const detectors::Observation& observation) override {
    for (ObservationSink* sink : sinks_) sink->OnCorrection(sample, observation);
  }
  void OnDetectorTime(std::string_view detector, double seconds) override {
    for (ObservationSink* sink : sinks_) sink->OnDetectorTime(detector, seconds);
  }
  void OnDetectorError(std::string_view detector, const detectors::Sample& sample,
                       const char* what) override {
    for (ObservationSink* sink : sinks_) sink->OnDetectorError(detector, sample, what);
  }

 private:
  std::vector<ObservationSink*> sinks_;
};

// Runs `done` once every item of a batch has been processed (and so stored):
// the ingest stream acknowledges the batch only then.
struct BatchCompletion {
  BatchCompletion(int items, std::function<void()> on_all_done)
      : remaining(items), done(std::move(on_all_done)) {}
  std::atomic<int> remaining;
  std::function<void()> done;
  // With collect_points, the store sink hands each sample's points to
  // `points` instead of appending them, and `done` stores the whole batch at
  // once (server/ingest/delivery.h: points and dedup mark in one write).
  bool collect_points = false;
  std::mutex points_mu;
  std::vector<store::KeyedPoint> points;

  // A sample whose points the store refused (a full disk, an I/O error): the
  // batch must not be acknowledged. The first failure is kept.
  void Fail(absl::Status status) {
    std::lock_guard<std::mutex> lock(points_mu);
    if (failure.ok()) failure = std::move(status);
  }
  absl::Status Failure() {
    std::lock_guard<std::mutex> lock(points_mu);
    return failure;
  }

 private:
  absl::Status failure;  // guarded by points_mu
};

// The batch of the sample the calling worker thread is processing (null
// outside WorkerPool::Run or for a sample without one).
BatchCompletion* CurrentBatchCompletion();

struct WorkItem {
  detectors::Sample sample;
  size_t bytes = 0;  // admission budget to release once processed
  std::shared_ptr<BatchCompletion> completion;  // may be null
};

class WorkerPool : public RunStateOwner {
 public:
  // `on_done(bytes)` is called after each item is processed.
  WorkerPool(int workers, const detectors::DetectorOptions& options, ObservationSink& sink,
             std::function<void(size_t)> on_done);
  ~WorkerPool();  // drains and joins

  void Dispatch(std::vector<WorkItem> items);
  // Processes everything queued, then stops the workers. Idempotent.
  void DrainAndStop();

  // Drops every detector's state of `run` in every worker (Detector::ForgetRun):
  // a run resumed from a checkpoint starts its increments and windows over
  // instead of pairing its first samples with the abandoned attempt's last.
  // Each worker finishes the item it is processing first; items still queued
  // are processed afterwards, so call it before dispatching the new samples.
  void ForgetRun(const std::string& run);
  // Drops the detectors' state of `run` (not the open steps of its ranks'
  // scalars): the run ended, so no later sample pairs with it. Called once
  // every sample of the run is processed.
  void ReleaseRunState(const std::string& run);
  // At startup, after RestoreDetectorState and before the first Dispatch:
  // wire::RankScalars::Recover on the run's worker; the steps it completes go
  // through the detectors and the sink as any merged step.
  void RecoverRankScalars(const std::string& run, int32_t world_size, int64_t merged_through,
                          const std::vector<int32_t>& ranks,
                          const std::vector<detectors::Sample>& reports);
  // RunStateOwner: a restart is ForgetRun, an end ReleaseRunState, and a
  // forgotten run ForgetRun (a rank's open steps of a run gone silent never
  // complete).
  void OnRunRestarted(const std::string& run) override { ForgetRun(run); }
  void OnRunEnded(const std::string& run) override { ReleaseRunState(run); }
  void OnRunForgotten(const std::string& run) override { ForgetRun(run); }
  // Every worker's detectors' retained probe state (Detector::VisitRetained),
  // one worker at a time under its detector lock.
  void VisitRetained(const detectors::RetainedVisitor& visit) const;
  const detectors::DetectorOptions& options() const { return options_; }

  int size() const { return static_cast<int>(workers_.size()); }
  size_t QueueDepth(int worker) const;
  static size_t ShardOf(const detectors::Sample& sample, size_t shards);
  // The shard of a series: ShardOf(sample) == ShardOfSeries(sample.run, sample.layer()).
  static size_t ShardOfSeries(std::string_view run, int layer, size_t shards);

  // Detector checkpoints (the daemon stores the bytes with
  // store.WriteCheckpoint and hands them back after a restart).
  //
  // SaveDetectorState may be called at any time, also while workers run and
  // after DrainAndStop. Each worker holds its detector lock while it
  // processes one item; the calling thread takes that lock in turn for each
  // worker and serializes that worker's detectors under it. So each worker's
  // part is a consistent snapshot between two items (items still queued are
  // not in it), and the workers are snapshotted one after the other, not at
  // one instant: fine, since their series are disjoint. A worker is paused
  // only while its own detectors are serialized.
  //
  // Format (codec, codec/state_codec.h), version 1:
  //   Header "FSDP" v1 | U32 workers | per worker: U32 detectors |
  //   per detector: String registered name, Bytes Detector::SaveState blob;
  //   last, String "server.rank_scalars", Bytes wire::RankScalars::SaveState blob
  //   (the open steps of multi-rank runs; absent in older checkpoints).
  std::string SaveDetectorState() const;
  // The same bytes into `writer`; with a streaming writer (a checkpoint
  // file's sink) they go out as each detector serializes its series, so a
  // checkpoint holds no copy of the detector state, only the writer's chunk.
  void SaveDetectorState(codec::StateWriter& writer) const;

  // Restores what SaveDetectorState wrote, from a pool of any size: every
  // worker's detector of a given name is rebuilt from the blobs of that name
  // of all saved workers, keeping the series of its own shard (ShardOfSeries
  // over this pool's size). Call it before the first Dispatch; it replaces
  // whatever the detectors hold. Returns true when everything was restored.
  // On false, *error (if given) says why, and:
  //  - unreadable framing (truncated, not a pool blob, unknown version):
  //    every detector is left empty, as newly created;
  //  - a detector that refuses its own state (corrupt, or a state version
  //    this build does not read): that detector is left empty in every
  //    worker, the other detectors are restored.
  // Saved detectors that this build no longer registers are ignored;
  // registered detectors absent from the blob start empty. Neither is an
  // error.
  bool RestoreDetectorState(std::string_view bytes, std::string* error = nullptr);

 private:
  using DetectorList =
      std::vector<std::pair<const detectors::DetectorInfo*, std::unique_ptr<detectors::Detector>>>;
  struct Worker {
    mutable std::mutex mu;
    std::condition_variable ready;
    std::deque<WorkItem> queue;
    bool stopping = false;
    // Held by the worker thread while it processes an item, and by
    // SaveDetectorState/RestoreDetectorState while they use `detectors`.
    mutable std::mutex detectors_mu;
    DetectorList detectors;
    // Several ranks' scalars of a run -> the run's series, before the
    // detectors (all of a run's scalars reach one worker). Under detectors_mu.
    wire::RankScalars rank_scalars;
    std::thread thread;
  };
  void Run(Worker& worker);
  void Process(Worker& worker, const detectors::Sample& sample);
  void RunDetectors(Worker& worker, const detectors::Sample& sample);

  const detectors::DetectorOptions options_;
  ObservationSink& sink_;
  std::function<void(size_t)> on_done_;
  std::vector<std::unique_ptr<Worker>> workers_;
};

}  // namespace foreshock::server
