// --max_memory_mb: the daemon's resident memory, sampled, against a bound.
//
// The big consumers each have their own limit (--max_queue_mb for samples
// waiting for a worker, --max_message_mb per message, the store's per-series
// cache, --max_series_per_run), but their sum depends on how many streams,
// runs and series arrive. This guard watches the one number an operator (and
// the OOM killer) cares about, resident memory, as the OpenTelemetry
// Collector's memory_limiter does. At the bound, ingest refuses probes (QK
// and router records, rejected in the Ack with reason memory_limit) and keeps
// accepting everything else (step scalars), until memory falls below
// kResumeFraction of the bound, or until refusing can free nothing more:
// nothing is in flight (the work queue has drained) and memory has stayed
// put for kSettle. What is resident then is retained state (detector state,
// caches), not the flood; refusing longer would only latch probes shut. If
// that retained memory is still at the bound, the next sample is over again.
// Accepted data is still processed and stored; nothing acknowledged is
// dropped.
//
// What the guard cannot refuse is a message already read: a stream's next
// batch is resident (raw, then parsed) before ingest sees it. So each open
// stream that sends large batches reserves room for its next one (its last
// batch's size, while it waits to read it), and the guard compares
// resident memory plus those reservations with the bound: retained state
// stops growing early enough that the batches still to arrive fit under it,
// as the OpenTelemetry Collector's spike limit does, but measured per stream.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>

namespace foreshock::server {

class MemoryGuard {
 public:
  static constexpr double kResumeFraction = 0.9;
  static constexpr std::chrono::milliseconds kSettle{1000};

  // `limit_bytes` 0: never over the limit (the sampler still runs for the gauge).
  // `read_resident` is the measurement (tests inject one).
  explicit MemoryGuard(int64_t limit_bytes,
                       std::function<int64_t()> read_resident = &ReadResidentBytes,
                       std::chrono::milliseconds interval = std::chrono::milliseconds(100));
  ~MemoryGuard();
  MemoryGuard(const MemoryGuard&) = delete;
  MemoryGuard& operator=(const MemoryGuard&) = delete;

  // The bytes accepted and not yet processed (the work queue); without it
  // the guard resumes only below the resume mark. Call before Start.
  void SetInFlight(std::function<int64_t()> in_flight) { in_flight_ = std::move(in_flight); }

  void Start();  // the sampling thread
  void Stop();

  // One measurement; at the bound it first returns freed heap to the kernel
  // (malloc_trim) and measures again. Called by the thread, and by tests.
  void Sample();

  bool over_limit() const { return over_.load(std::memory_order_relaxed); }
  // Room set aside for batches that open streams may send next (see above);
  // `delta` is added (negative: released). Streams sending batches under
  // kFreshCheckBytes reserve nothing.
  void AdjustReserved(int64_t delta) { reserved_.fetch_add(delta, std::memory_order_relaxed); }
  int64_t reserved_bytes() const { return reserved_.load(std::memory_order_relaxed); }
  // Whether a batch of `incoming_bytes` may bring its probes in: not while
  // over the limit, and for a large batch (kFreshCheckBytes or more) not when
  // resident memory measured now plus the batch plus the reserved room would
  // reach the bound, so that big probes arriving between two samples cannot
  // overshoot it.
  bool AdmitProbes(int64_t incoming_bytes) const;
  static constexpr int64_t kFreshCheckBytes = int64_t{256} << 10;
  int64_t resident_bytes() const { return resident_.load(std::memory_order_relaxed); }
  int64_t limit_bytes() const { return limit_bytes_; }
  // Once over the limit, ingest resumes below this.
  int64_t resume_bytes() const { return static_cast<int64_t>(kResumeFraction * limit_bytes_); }
  uint64_t times_over() const { return times_over_.load(std::memory_order_relaxed); }
  // Times ingest resumed above the resume mark because memory had settled
  // with nothing in flight (retained state, not a flood).
  uint64_t settled_resumes() const { return settled_resumes_.load(std::memory_order_relaxed); }

  // VmRSS of this process from /proc/self/statm; -1 when unreadable.
  static int64_t ReadResidentBytes();
  // The default bound: 85% of the cgroup's memory limit (containers, systemd
  // MemoryMax), else half of the machine's memory.
  static int64_t DefaultLimitBytes();

 private:
  const int64_t limit_bytes_;
  const std::function<int64_t()> read_resident_;
  const std::chrono::milliseconds interval_;
  std::atomic<bool> over_{false};
  std::atomic<int64_t> resident_{0};
  std::atomic<int64_t> reserved_{0};
  std::atomic<uint64_t> times_over_{0};
  std::atomic<uint64_t> settled_resumes_{0};
  std::function<int64_t()> in_flight_;
  std::chrono::steady_clock::time_point last_trim_{};
  // While over: since when nothing has been in flight, and the least
  // resident memory seen since (memory that still falls has not settled).
  std::optional<std::chrono::steady_clock::time_point> idle_since_;
  int64_t idle_low_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace foreshock::server
