#include "server/query/query_budget.h"

#include <malloc.h>

#include <utility>

#include "absl/strings/str_cat.h"

namespace foreshock::server {

QueryBudget::Lease& QueryBudget::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    Release();
    budget_ = std::exchange(other.budget_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void QueryBudget::Lease::Release() {
  if (budget_ == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(budget_->mu_);
    budget_->in_use_ -= bytes_;
  }
  // A large answer was freed on this thread, into its own malloc arena,
  // where only this thread would reuse it: eight threads that each answered
  // once held 4x the budget resident. Give it back to the kernel now.
  if (bytes_ >= kTrimBytes) malloc_trim(0);
  budget_->metrics_.query_bytes.Add({}).Set(static_cast<double>(budget_->in_use()));
  budget_ = nullptr;
  bytes_ = 0;
}

absl::Status QueryBudget::Grow(Lease& lease, int64_t bytes, const std::string& what) {
  const int64_t growth = bytes - lease.bytes_;
  if (growth <= 0) return absl::OkStatus();
  if (total_bytes_ > 0 && bytes > total_bytes_) {
    metrics_.query_refused_total.Add({{"reason", "too_large"}}).Increment();
    return absl::ResourceExhaustedError(absl::StrCat(
        what, " needs about ", bytes >> 20, " MiB, more than all queries together may hold (",
        total_bytes_ >> 20, " MiB, --max_query_total_mb): narrow the range (from_step and "
        "to_step; from and to in /api/v1/points) or set max_points"));
  }
  int64_t in_use = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (total_bytes_ > 0 && in_use_ + growth > total_bytes_) {
      in_use = in_use_;
    } else {
      in_use_ += growth;
      in_use = -1;
    }
  }
  if (in_use >= 0) {
    metrics_.query_refused_total.Add({{"reason", "busy"}}).Increment();
    return absl::UnavailableError(absl::StrCat(
        what, " needs about ", bytes >> 20, " MiB; the queries in progress hold ", in_use >> 20,
        " MiB of the ", total_bytes_ >> 20, " MiB they may share (--max_query_total_mb): retry "
        "after ", kRetryAfterMs, " ms"));
  }
  lease.budget_ = this;
  lease.bytes_ = bytes;
  metrics_.query_bytes.Add({}).Set(static_cast<double>(this->in_use()));
  return absl::OkStatus();
}

void QueryBudget::CountTooLarge() {
  metrics_.query_refused_total.Add({{"reason", "too_large"}}).Increment();
}

int64_t QueryBudget::in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_;
}

}  // namespace foreshock::server
