#include "server/pipeline/worker_pool.h"

#include <chrono>
#include <cmath>
#include <exception>
#include <functional>
#include <map>
#include <set>

#include "codec/state_codec.h"

namespace foreshock::server {
namespace {

// Forwards one sample's detector output to the sink.
class SinkEmitter final : public detectors::Emitter {
 public:
  SinkEmitter(ObservationSink& sink, const detectors::Sample& sample) : sink_(sink), sample_(sample) {}
  // A derived value that is not finite (a ratio over a vanishing reference,
  // an overflow) is a non-finite value like one in the sample itself: counted
  // in foreshock_nonfinite_values_total{kind} (ForeshockNonFinite), and not
  // exported, stored or scored (docs/DESIGN.md §3.2).
  void Emit(const detectors::Observation& observation) override {
    if (!std::isfinite(observation.value)) {
      sink_.OnNonFinite(sample_, sample_.kind(), 1);
      return;
    }
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
    : options_(options), sink_(sink), on_done_(std::move(on_done)) {
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
  return ShardOfSeries(sample.run, sample.layer(), shards);
}

size_t WorkerPool::ShardOfSeries(std::string_view run, int layer, size_t shards) {
  // std::hash<std::string_view> equals std::hash<std::string> on the same characters.
  const size_t h = std::hash<std::string_view>()(run) * 1000003u + std::hash<int>()(layer);
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

void WorkerPool::ForgetRun(const std::string& run) {
  for (auto& worker : workers_) {
    std::lock_guard<std::mutex> lock(worker->detectors_mu);
    for (auto& [info, detector] : worker->detectors) detector->ForgetRun(run);
    worker->rank_scalars.ForgetRun(run);  // steps still open belong to the abandoned attempt
  }
}

void WorkerPool::RecoverRankScalars(const std::string& run, int32_t world_size,
                                    int64_t merged_through, const std::vector<int32_t>& ranks,
                                    const std::vector<detectors::Sample>& reports) {
  Worker& worker = *workers_[ShardOfSeries(run, detectors::kNoLayer, workers_.size())];
  std::lock_guard<std::mutex> lock(worker.detectors_mu);
  wire::RankScalars::Result merged =
      worker.rank_scalars.Recover(run, world_size, merged_through, ranks, reports);
  for (const detectors::Sample& sample : merged.ready) {
    RunDetectors(worker, sample);
    sink_.OnSampleDone(sample);
  }
}

void WorkerPool::ReleaseRunState(const std::string& run) {
  for (auto& worker : workers_) {
    std::lock_guard<std::mutex> lock(worker->detectors_mu);
    for (auto& [info, detector] : worker->detectors) detector->ForgetRun(run);
  }
}

void WorkerPool::VisitRetained(const detectors::RetainedVisitor& visit) const {
  for (const auto& worker : workers_) {
    std::lock_guard<std::mutex> lock(worker->detectors_mu);
    for (const auto& [info, detector] : worker->detectors) detector->VisitRetained(visit);
  }
}

size_t WorkerPool::QueueDepth(int worker) const {
  std::lock_guard<std::mutex> lock(workers_[worker]->mu);
  return workers_[worker]->queue.size();
}

namespace {
thread_local BatchCompletion* current_batch = nullptr;
}  // namespace

BatchCompletion* CurrentBatchCompletion() { return current_batch; }

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
    {
      std::lock_guard<std::mutex> lock(worker.detectors_mu);
      current_batch = item.completion.get();
      Process(worker, item.sample);
      current_batch = nullptr;
    }
    on_done_(item.bytes);
    if (item.completion && item.completion->remaining.fetch_sub(1) == 1) item.completion->done();
  }
}

namespace {

constexpr std::string_view kPoolStateMagic = "FSDP";
constexpr uint32_t kPoolStateVersion = 1;
// The worker's wire::RankScalars, saved beside its detectors under a name no
// detector has (a daemon that does not know it ignores it).
constexpr std::string_view kRankScalarsEntry = "server.rank_scalars";

}  // namespace

std::string WorkerPool::SaveDetectorState() const {
  codec::StateWriter writer;
  SaveDetectorState(writer);
  return writer.Take();
}

void WorkerPool::SaveDetectorState(codec::StateWriter& writer) const {
  writer.PutHeader(kPoolStateMagic, kPoolStateVersion);
  writer.PutU32(static_cast<uint32_t>(workers_.size()));
  for (const auto& worker : workers_) {
    std::lock_guard<std::mutex> lock(worker->detectors_mu);
    writer.PutU32(static_cast<uint32_t>(worker->detectors.size() + 1));
    // Each detector's state in place (BeginBytes): streamed to the
    // checkpoint file as it is serialized, never copied whole.
    for (const auto& [info, detector] : worker->detectors) {
      writer.PutString(info->name);
      writer.BeginBytes();
      detector->SaveState(writer);
      writer.EndBytes();
    }
    writer.PutString(kRankScalarsEntry);
    writer.BeginBytes();
    worker->rank_scalars.SaveState(writer);
    writer.EndBytes();
    // What this worker's part left buffered goes out before its lock is
    // released.
    writer.Flush();
  }
}

bool WorkerPool::RestoreDetectorState(std::string_view bytes, std::string* error) {
  // Saved blobs by detector name, over all saved workers (views into `bytes`).
  std::map<std::string, std::vector<std::string_view>, std::less<>> blobs;
  codec::StateReader reader(bytes);
  auto read_framing = [&]() -> bool {
    uint32_t version = 0, saved_workers = 0;
    if (!reader.GetHeader(kPoolStateMagic, kPoolStateVersion, kPoolStateVersion, version) ||
        !reader.GetU32(saved_workers)) {
      return false;
    }
    for (uint32_t w = 0; w < saved_workers; ++w) {
      uint32_t count = 0;
      if (!reader.GetU32(count)) return false;
      std::set<std::string_view> names;
      for (uint32_t d = 0; d < count; ++d) {
        std::string_view name, state;
        if (!reader.GetStringView(name) || !reader.GetStringView(state)) return false;
        if (!names.insert(name).second) return reader.Fail("a worker saved a detector twice");
        blobs[std::string(name)].push_back(state);
      }
    }
    return reader.ExpectEnd();
  };
  // A detector as newly created.
  auto reset = [this](DetectorList::value_type& entry) {
    entry.second = entry.first->create(options_);
  };

  if (!read_framing()) {
    for (auto& worker : workers_) {
      std::lock_guard<std::mutex> lock(worker->detectors_mu);
      for (auto& entry : worker->detectors) reset(entry);
      worker->rank_scalars.Clear();
    }
    if (error) *error = "detector checkpoint unreadable: " + reader.error();
    return false;
  }

  std::map<std::string, std::string, std::less<>> refused;  // detector name -> why
  const size_t shards = workers_.size();
  // The open steps of multi-rank runs: all of a run's scalars go to one worker.
  std::string rank_scalars_error;
  for (size_t w = 0; w < shards && rank_scalars_error.empty(); ++w) {
    Worker& worker = *workers_[w];
    std::lock_guard<std::mutex> lock(worker.detectors_mu);
    worker.rank_scalars.Clear();
    const auto it = blobs.find(kRankScalarsEntry);
    if (it == blobs.end()) continue;  // a checkpoint from before they were saved
    for (std::string_view state : it->second) {
      codec::StateReader open_reader(state);
      const auto in_shard = [w, shards](std::string_view run) {
        return ShardOfSeries(run, detectors::kNoLayer, shards) == w;
      };
      if (!worker.rank_scalars.RestoreState(open_reader, in_shard) || !open_reader.ExpectEnd()) {
        rank_scalars_error = open_reader.error();
        break;
      }
    }
  }
  if (!rank_scalars_error.empty()) {
    for (auto& worker : workers_) {
      std::lock_guard<std::mutex> lock(worker->detectors_mu);
      worker->rank_scalars.Clear();
    }
  }
  for (size_t w = 0; w < shards; ++w) {
    Worker& worker = *workers_[w];
    std::lock_guard<std::mutex> lock(worker.detectors_mu);
    const detectors::SeriesFilter in_shard = [w, shards](std::string_view run, int layer) {
      return ShardOfSeries(run, layer, shards) == w;
    };
    for (auto& entry : worker.detectors) {
      reset(entry);
      const std::string_view name = entry.first->name;
      const auto it = blobs.find(name);
      if (it == blobs.end() || refused.contains(name)) continue;
      for (std::string_view state : it->second) {
        codec::StateReader detector_reader(state);
        if (!entry.second->RestoreState(detector_reader, in_shard) ||
            !detector_reader.ExpectEnd()) {
          refused.emplace(std::string(name), detector_reader.error());
          break;
        }
      }
    }
  }
  if (refused.empty() && rank_scalars_error.empty()) return true;
  // A refused detector starts empty everywhere, also in the workers that
  // restored it before another worker's blob of it failed.
  for (auto& worker : workers_) {
    std::lock_guard<std::mutex> lock(worker->detectors_mu);
    for (auto& entry : worker->detectors) {
      if (refused.contains(entry.first->name)) reset(entry);
    }
  }
  if (error) {
    error->clear();
    for (const auto& [name, why] : refused) {
      if (!error->empty()) *error += "; ";
      *error += "detector " + name + " state refused (starts empty): " + why;
    }
    if (!rank_scalars_error.empty()) {
      if (!error->empty()) *error += "; ";
      *error += "open multi-rank steps refused (dropped): " + rank_scalars_error;
    }
  }
  return false;
}

void WorkerPool::Process(Worker& worker, const detectors::Sample& sample) {
  if (sample.kind() != detectors::SampleKind::kScalars) {
    RunDetectors(worker, sample);
    sink_.OnSampleDone(sample);
    return;
  }
  // Step scalars: the detectors see the run's series (the mean over ranks,
  // rank_scalars.h), possibly for older steps this sample completed; the
  // rank's own finite values are kept in the head slot (head = rank), which
  // no alert reads.
  wire::RankScalars::Result merged = worker.rank_scalars.Offer(sample);
  if (merged.per_rank && sample.rank >= 0) {
    const auto& s = std::get<detectors::ScalarsSample>(sample.payload);
    auto own = [&](bool present, std::string_view signal, double value) {
      if (present && std::isfinite(value)) {
        sink_.OnObservation(sample, detectors::Observation{signal, detectors::kNoLayer,
                                                           sample.rank, value, false});
      }
    };
    own(s.has_loss, "loss", s.loss);
    own(s.has_grad_norm, "grad_norm", s.grad_norm);
    own(s.has_lr, "lr", s.lr);
  }
  for (const detectors::Sample& run_level : merged.ready) RunDetectors(worker, run_level);
  for (const detectors::Sample& revised : merged.corrected) {
    const auto& s = std::get<detectors::ScalarsSample>(revised.payload);
    auto correct = [&](bool present, std::string_view signal, double value) {
      if (present && std::isfinite(value)) {
        sink_.OnCorrection(revised, detectors::Observation{signal, detectors::kNoLayer,
                                                           detectors::kAllHeads, value, false});
      }
    };
    correct(s.has_loss, "loss", s.loss);
    correct(s.has_grad_norm, "grad_norm", s.grad_norm);
    correct(s.has_lr, "lr", s.lr);
  }
  sink_.OnSampleDone(sample);
}

void WorkerPool::RunDetectors(Worker& worker, const detectors::Sample& sample) {
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
}

}  // namespace foreshock::server
