// --max_memory_mb: the daemon's resident memory, sampled, against a bound.
//
// The big consumers each have their own limit (--max_queue_mb for samples
// waiting for a worker, --max_message_mb per message, the store's per-series
// cache, --max_series_per_run), but their sum depends on how many streams,
// runs and series arrive. This guard watches the one number an operator (and
// the OOM killer) cares about, resident memory, as the OpenTelemetry
// Collector's memory_limiter does: at the bound, ingest stops taking data
// (new streams and new batches end with RESOURCE_EXHAUSTED memory_limit and a
// retry hint; clients keep their unacknowledged batches and resend them later)
// until memory falls below kResumeFraction of the bound. Accepted data is
// still processed and stored; nothing acknowledged is dropped.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>

namespace foreshock::server {

class MemoryGuard {
 public:
  static constexpr double kResumeFraction = 0.9;

  // `limit_bytes` 0: never over the limit (the sampler still runs for the gauge).
  // `read_resident` is the measurement (tests inject one).
  explicit MemoryGuard(int64_t limit_bytes,
                       std::function<int64_t()> read_resident = &ReadResidentBytes,
                       std::chrono::milliseconds interval = std::chrono::milliseconds(100));
  ~MemoryGuard();
  MemoryGuard(const MemoryGuard&) = delete;
  MemoryGuard& operator=(const MemoryGuard&) = delete;

  void Start();  // the sampling thread
  void Stop();

  // One measurement; at the bound it first returns freed heap to the kernel
  // (malloc_trim) and measures again. Called by the thread, and by tests.
  void Sample();

  bool over_limit() const { return over_.load(std::memory_order_relaxed); }
  int64_t resident_bytes() const { return resident_.load(std::memory_order_relaxed); }
  int64_t limit_bytes() const { return limit_bytes_; }
  // Once over the limit, ingest resumes below this.
  int64_t resume_bytes() const { return static_cast<int64_t>(kResumeFraction * limit_bytes_); }
  uint64_t times_over() const { return times_over_.load(std::memory_order_relaxed); }

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
  std::atomic<uint64_t> times_over_{0};
  std::chrono::steady_clock::time_point last_trim_{};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace foreshock::server
