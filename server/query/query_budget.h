// --max_query_mb and --max_query_total_mb: the memory query answers may take.
//
// A raw GetSeries over a long run materializes every point (the store's read,
// the response message, its JSON or protobuf encoding): one raw query over
// 500k loss points took the daemon from its base to 787 MiB, and eight
// concurrent ones over 1M points to 10.9 GB. Each request now leases, before
// it builds anything, what it will hold (sized from the point count, at the
// per-point costs below), from one budget that concurrent queries share:
//  - a response larger than the per-request limit is refused
//    (RESOURCE_EXHAUSTED, HTTP 413) with a message saying how to page it
//    (from_step/to_step) or downsample it (max_points);
//  - a request the shared budget cannot hold now is refused (UNAVAILABLE,
//    HTTP 503) with a retry hint.
// Both are counted in foreshock_query_refused_total{reason}. The lease is
// held until the answer is written to the client.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "server/common/metrics.h"

namespace foreshock::server {

class QueryBudget {
 public:
  // Bytes a request holds per point: the store's read of the range (the
  // vector, its growth and the sort's buffer: 49-66 MB measured for 1M
  // points) and, for a raw answer, each point as a message and encoded (JSON
  // ~70 bytes, protobuf ~30; 80 MB measured for 500k points over HTTP); a
  // downsampled answer per bucket.
  static constexpr int64_t kRangePointBytes = 64;
  static constexpr int64_t kRawPointBytes = 160;
  static constexpr int64_t kBucketBytes = 320;
  static constexpr int kRetryAfterMs = 1000;
  // A lease at least this large returns freed heap to the kernel when it ends.
  static constexpr int64_t kTrimBytes = int64_t{8} << 20;

  // 0: no limit (each).
  QueryBudget(int64_t per_request_bytes, int64_t total_bytes, DaemonMetrics& metrics)
      : per_request_bytes_(per_request_bytes), total_bytes_(total_bytes), metrics_(metrics) {}

  // What one request holds; released when destroyed.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept { *this = std::move(other); }
    Lease& operator=(Lease&& other) noexcept;
    ~Lease() { Release(); }
    int64_t bytes() const { return bytes_; }

   private:
    friend class QueryBudget;
    void Release();
    QueryBudget* budget_ = nullptr;
    int64_t bytes_ = 0;
  };

  // Grows `lease` to `bytes` in all: UNAVAILABLE (counted busy) when the
  // requests in progress leave no room for it now, RESOURCE_EXHAUSTED
  // (counted too_large) when it is more than the whole shared budget. `what`
  // names the request in the message.
  absl::Status Grow(Lease& lease, int64_t bytes, const std::string& what);
  // Counts a response refused at the per-request limit (the caller explains it).
  void CountTooLarge();

  int64_t per_request_bytes() const { return per_request_bytes_; }
  int64_t total_bytes() const { return total_bytes_; }
  int64_t in_use() const;

 private:
  const int64_t per_request_bytes_;
  const int64_t total_bytes_;
  DaemonMetrics& metrics_;
  mutable std::mutex mu_;
  int64_t in_use_ = 0;
};

}  // namespace foreshock::server
