#include "server/worker_pool.h"

#include <chrono>
#include <exception>
#include <functional>

namespace foreshock::server {
namespace {

// Forwards one sample's detector output to the sink.
class SinkEmitter final : public detectors::Emitter {
 public:
  SinkEmitter(ObservationSink& sink, const detectors::Sample& sample) : sink_(sink), sample_(sample) {}
  void Emit(const detectors::Observation& observation) override {
    sink_.OnObservation(sample_, observation);
  }
  void NonFinite(detectors::SampleKind kind, int64_t count) override {
    sink_.OnNonFinite(sample_, kind, count);
  }

 private:
  ObservationSink& sink_;
  const detectors::Sample& sample_;
};

}  // namespace

WorkerPool::WorkerPool(int workers, const detectors::DetectorOptions& options,
                       ObservationSink& sink, std::function<void(size_t)> on_done)
    : sink_(sink), on_done_(std::move(on_done)) {
  for (int i = 0; i < std::max(1, workers); ++i) {
    auto worker = std::make_unique<Worker>();
    for (const auto& info : detectors::DetectorRegistry::Instance().detectors()) {
      worker->detectors.emplace_back(&info, info.create(options));
    }
    workers_.push_back(std::move(worker));
  }
  for (auto& worker : workers_) {
    worker->thread = std::thread([this, w = worker.get()] { Run(*w); });
  }
}

WorkerPool::~WorkerPool() { DrainAndStop(); }

size_t WorkerPool::ShardOf(const detectors::Sample& sample, size_t shards) {
  const size_t h = std::hash<std::string>()(sample.run) * 1000003u +
                   std::hash<int>()(sample.layer());
  return h % shards;
}

void WorkerPool::Dispatch(std::vector<WorkItem> items) {
  for (WorkItem& item : items) {
    Worker& worker = *workers_[ShardOf(item.sample, workers_.size())];
    {
      std::lock_guard<std::mutex> lock(worker.mu);
      worker.queue.push_back(std::move(item));
    }
    worker.ready.notify_one();
  }
}

void WorkerPool::DrainAndStop() {
  for (auto& worker : workers_) {
    {
      std::lock_guard<std::mutex> lock(worker->mu);
      worker->stopping = true;
    }
    worker->ready.notify_all();
  }
  for (auto& worker : workers_) {
    if (worker->thread.joinable()) worker->thread.join();
  }
}

size_t WorkerPool::QueueDepth(int worker) const {
  std::lock_guard<std::mutex> lock(workers_[worker]->mu);
  return workers_[worker]->queue.size();
}

void WorkerPool::Run(Worker& worker) {
  for (;;) {
    WorkItem item;
    {
      std::unique_lock<std::mutex> lock(worker.mu);
      worker.ready.wait(lock, [&] { return worker.stopping || !worker.queue.empty(); });
      if (worker.queue.empty()) return;  // stopping and drained
      item = std::move(worker.queue.front());
      worker.queue.pop_front();
    }
    Process(worker, item.sample);
    on_done_(item.bytes);
  }
}

void WorkerPool::Process(Worker& worker, const detectors::Sample& sample) {
  SinkEmitter emitter(sink_, sample);
  const detectors::SampleKind kind = sample.kind();
  for (auto& [info, detector] : worker.detectors) {
    if (info->kind != kind) continue;
    const auto start = std::chrono::steady_clock::now();
    try {
      detector->Process(sample, emitter);
    } catch (const std::exception& e) {  // e.g. bad_alloc: never take the daemon down
      sink_.OnDetectorError(info->name, sample, e.what());
      continue;
    }
    sink_.OnDetectorTime(info->name,
                         std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  sink_.OnSampleDone(sample);
}

}  // namespace foreshock::server
