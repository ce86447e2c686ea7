// foreshock.v1.Query: what users, dashboards and training loops read back.
// ListAlerts answers from the alert hub; WatchAlerts streams every transition
// to the caller, with a bounded per-stream queue so that a slow reader can
// never hold up the workers that produce alerts.
#pragma once

#include "foreshock/v1/query.grpc.pb.h"
#include "server/alert_hub.h"
#include "server/metrics.h"

namespace foreshock::server {

class QueryService final : public foreshock::v1::Query::CallbackService {
 public:
  // A watcher more than this many events behind is disconnected (RESOURCE_EXHAUSTED).
  static constexpr size_t kMaxWatchBacklog = 4096;

  QueryService(AlertHub& alerts, DaemonMetrics& metrics) : alerts_(alerts), metrics_(metrics) {}

  grpc::ServerUnaryReactor* ListAlerts(grpc::CallbackServerContext* context,
                                       const foreshock::v1::ListAlertsRequest* request,
                                       foreshock::v1::ListAlertsResponse* response) override;
  grpc::ServerWriteReactor<foreshock::v1::AlertEvent>* WatchAlerts(
      grpc::CallbackServerContext* context,
      const foreshock::v1::WatchAlertsRequest* request) override;

 private:
  AlertHub& alerts_;
  DaemonMetrics& metrics_;
};

}  // namespace foreshock::server
