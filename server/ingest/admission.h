// Bounds the bytes of accepted samples that are queued or being processed.
// A stream that does not fit stops reading and parks; the worker that frees
// enough room resumes it. This is how a full queue turns into gRPC flow
// control on the client instead of unbounded memory.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>

namespace foreshock::server {

class AdmissionGate {
 public:
  explicit AdmissionGate(size_t max_bytes) : max_bytes_(max_bytes) {}

  // Takes `bytes` of budget now and returns true, or returns false and calls
  // `on_admitted` later, from the thread that frees enough budget, once the
  // budget is taken on the caller's behalf. Waiters are served in FIFO order.
  // A request larger than the whole budget is admitted when nothing else is
  // in flight, so an oversized batch cannot wedge a stream.
  bool Acquire(size_t bytes, std::function<void()> on_admitted);
  void Release(size_t bytes);

  // Blocks until nothing is in flight and no stream waits.
  void WaitIdle();
  size_t in_flight_bytes() const;
  size_t waiting() const;

 private:
  bool FitsLocked(size_t bytes) const { return in_flight_ == 0 || in_flight_ + bytes <= max_bytes_; }

  struct Waiter {
    size_t bytes;
    std::function<void()> on_admitted;
  };
  const size_t max_bytes_;
  mutable std::mutex mu_;
  std::condition_variable idle_;
  size_t in_flight_ = 0;
  std::deque<Waiter> waiters_;
};

}  // namespace foreshock::server
