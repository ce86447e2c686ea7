// foreshock.v1.Query: what users, dashboards and training loops read back.
// ListRuns, ListSeries, GetSeries and ListAlerts answer from the QueryBackend
// (the same answers the HTTP JSON API gives); WatchAlerts streams every transition
// to the caller, with a bounded per-stream queue so that a slow reader can
// never hold up the workers that produce alerts.
#pragma once

#include "foreshock/v1/query.grpc.pb.h"
#include "server/alerting/alert_hub.h"
#include "server/security/auth.h"
#include "server/common/metrics.h"
#include "server/query/query_backend.h"

namespace foreshock::server {

class QueryService final : public foreshock::v1::Query::CallbackService {
 public:
  // A watcher more than this many events behind is disconnected (RESOURCE_EXHAUSTED).
  static constexpr size_t kMaxWatchBacklog = 4096;

  QueryService(AlertHub& alerts, DaemonMetrics& metrics, const QueryBackend& backend)
      : alerts_(alerts), metrics_(metrics), backend_(backend) {}

  grpc::ServerUnaryReactor* ListAlerts(grpc::CallbackServerContext* context,
                                       const foreshock::v1::ListAlertsRequest* request,
                                       foreshock::v1::ListAlertsResponse* response) override;
  grpc::ServerWriteReactor<foreshock::v1::AlertEvent>* WatchAlerts(
      grpc::CallbackServerContext* context,
      const foreshock::v1::WatchAlertsRequest* request) override;
  grpc::ServerUnaryReactor* ListRuns(grpc::CallbackServerContext* context,
                                     const foreshock::v1::ListRunsRequest* request,
                                     foreshock::v1::ListRunsResponse* response) override;
  grpc::ServerUnaryReactor* ListSeries(grpc::CallbackServerContext* context,
                                       const foreshock::v1::ListSeriesRequest* request,
                                       foreshock::v1::ListSeriesResponse* response) override;
  grpc::ServerUnaryReactor* GetSeries(grpc::CallbackServerContext* context,
                                      const foreshock::v1::GetSeriesRequest* request,
                                      foreshock::v1::GetSeriesResponse* response) override;

  // --token_file: calls need a token with the query right for the runs they
  // read (QueryBackend's authorized variants). Null: no authorization.
  void SetAuthorizer(const Authorizer* authorizer, AuthMetrics* metrics) {
    authorizer_ = authorizer;
    auth_metrics_ = metrics;
  }

 private:
  AccessCheck Access(grpc::CallbackServerContext* context) const;
  const Authorizer* authorizer_ = nullptr;
  AuthMetrics* auth_metrics_ = nullptr;
  AlertHub& alerts_;
  DaemonMetrics& metrics_;
  const QueryBackend& backend_;
};

}  // namespace foreshock::server
