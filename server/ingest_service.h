// foreshock.v1.Ingest: one bidirectional stream per training rank, served
// with gRPC's callback API. The service validates, admits and dispatches;
// it computes nothing.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "foreshock/v1/ingest.grpc.pb.h"
#include "server/admission.h"
#include "server/metrics.h"
#include "server/validation.h"
#include "server/worker_pool.h"

namespace foreshock::server {

// Called once per accepted Hello (run registry, run_info metric).
using HelloObserver = std::function<void(const foreshock::v1::Hello&)>;

class IngestService final : public foreshock::v1::Ingest::CallbackService {
 public:
  IngestService(const IngestLimits& limits, AdmissionGate& gate, WorkerPool& pool,
                DaemonMetrics& metrics, HelloObserver on_hello, std::string record_dir = "");

  grpc::ServerBidiReactor<foreshock::v1::StreamRequest, foreshock::v1::StreamResponse>* Stream(
      grpc::CallbackServerContext* context) override;

 private:
  friend class IngestReactor;
  const IngestLimits limits_;
  AdmissionGate& gate_;
  WorkerPool& pool_;
  DaemonMetrics& metrics_;
  HelloObserver on_hello_;
  const std::string record_dir_;  // empty: streams are not recorded
  std::atomic<uint64_t> next_session_{1};
};

}  // namespace foreshock::server
