#include "server/ingest/admission.h"

#include <vector>

namespace foreshock::server {

bool AdmissionGate::Acquire(size_t bytes, std::function<void()> on_admitted) {
  std::lock_guard<std::mutex> lock(mu_);
  if (waiters_.empty() && FitsLocked(bytes)) {
    in_flight_ += bytes;
    return true;
  }
  waiters_.push_back(Waiter{bytes, std::move(on_admitted)});
  return false;
}

void AdmissionGate::Release(size_t bytes) {
  std::vector<std::function<void()>> admitted;
  {
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_ -= bytes;
    while (!waiters_.empty() && FitsLocked(waiters_.front().bytes)) {
      in_flight_ += waiters_.front().bytes;
      admitted.push_back(std::move(waiters_.front().on_admitted));
      waiters_.pop_front();
    }
    if (in_flight_ == 0 && waiters_.empty()) idle_.notify_all();
  }
  // Outside the lock: a resumed stream dispatches work, which may re-enter.
  for (auto& resume : admitted) resume();
}

void AdmissionGate::WaitIdle() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_.wait(lock, [this] { return in_flight_ == 0 && waiters_.empty(); });
}

size_t AdmissionGate::in_flight_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_flight_;
}

size_t AdmissionGate::waiting() const {
  std::lock_guard<std::mutex> lock(mu_);
  return waiters_.size();
}

}  // namespace foreshock::server
