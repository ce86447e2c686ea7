// The read side of foreshock.v1.Query, shared by the gRPC service and the
// HTTP JSON API (/api/v1/...): both answer with the same protobuf messages,
// so a script sees one schema whichever way it asks.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "foreshock/v1/query.pb.h"
#include "server/alerting/alert_hub.h"
#include "server/security/auth.h"
#include "server/pipeline/run_lifecycle.h"
#include "server/pipeline/run_tracker.h"
#include "server/pipeline/series_store.h"
#include "server/query/query_budget.h"

namespace foreshock::server {

class QueryBackend {
 public:
  // A GetSeries answer never carries more than this many raw points; a
  // larger range must ask for max_points (downsampling) or a narrower range.
  static constexpr uint32_t kMaxRawPoints = 1'000'000;
  // A downsampled answer over a range of more points than this is read
  // window by window of about this many points (DownsampleInWindows).
  static constexpr int64_t kWindowPoints = 65'536;

  QueryBackend(const SeriesStore& store, const AlertHub& alerts, const RunTracker& runs)
      : store_(store), alerts_(alerts), runs_(runs) {}

  // Run lifecycle (server/pipeline/run_lifecycle.h): ListRuns reports each
  // run's end and attempt, GetSeries shows a resumed run's latest attempt.
  // Null: neither.
  void SetLifecycle(const RunLifecycle* lifecycle) { lifecycle_ = lifecycle; }
  // --max_query_mb, --max_query_total_mb: GetSeries leases what it will
  // hold before building it (server/query/query_budget.h). Null: no bound.
  void SetBudget(QueryBudget* budget) { budget_ = budget; }

  foreshock::v1::ListRunsResponse ListRuns() const;
  // NOT_FOUND for a run the store does not hold.
  absl::StatusOr<foreshock::v1::ListSeriesResponse> ListSeries(
      const foreshock::v1::ListSeriesRequest& request) const;
  // INVALID_ARGUMENT for a missing run/signal or from_step > to_step;
  // NOT_FOUND for an unknown series (the message names the run's signals or
  // the layers the signal has); RESOURCE_EXHAUSTED for an undownsampled
  // range over kMaxRawPoints, or for an answer over --max_query_mb (the
  // message says how to page it); UNAVAILABLE when the queries in progress
  // hold --max_query_total_mb. The memory the answer holds stays leased in
  // `lease` (null: released on return) until the caller has sent it.
  absl::StatusOr<foreshock::v1::GetSeriesResponse> GetSeries(
      const foreshock::v1::GetSeriesRequest& request, QueryBudget::Lease* lease = nullptr) const;
  // Alerts of every run, or of request.run; NOT_FOUND for a named run the
  // daemon has never seen (no series in the store, no alerts, no Hello), as
  // ListSeries and GetSeries answer. A known run without alerts: an empty
  // list.
  absl::StatusOr<foreshock::v1::ListAlertsResponse> ListAlerts(
      const foreshock::v1::ListAlertsRequest& request) const;

  // The same, as `access` (--token_file) allows: UNAUTHENTICATED without a
  // valid token; PERMISSION_DENIED for a named run the token may not query;
  // lists over every run (ListRuns, ListAlerts without a run) are filtered to
  // the runs it may query.
  absl::StatusOr<foreshock::v1::ListRunsResponse> ListRuns(const AccessCheck& access) const;
  absl::StatusOr<foreshock::v1::ListSeriesResponse> ListSeries(
      const foreshock::v1::ListSeriesRequest& request, const AccessCheck& access) const;
  absl::StatusOr<foreshock::v1::GetSeriesResponse> GetSeries(
      const foreshock::v1::GetSeriesRequest& request, const AccessCheck& access,
      QueryBudget::Lease* lease = nullptr) const;
  absl::StatusOr<foreshock::v1::ListAlertsResponse> ListAlerts(
      const foreshock::v1::ListAlertsRequest& request, const AccessCheck& access) const;

 private:
  // The store holds series of `run`, the alert hub has alerts of it, or the
  // run tracker has seen its Hello.
  bool KnownRun(const std::string& run) const;
  // GetSeries with max_points over a long range: the query holds one window
  // of points and the buckets, never the range, so that the loss chart of a
  // million-step run is an ordinary request.
  absl::StatusOr<foreshock::v1::GetSeriesResponse> DownsampleInWindows(
      const store::SeriesInfo& info, int64_t from, int64_t to, uint32_t max_points,
      const std::string& what, QueryBudget::Lease& lease,
      foreshock::v1::GetSeriesResponse response) const;
  // Stored points of `key` in [from, to], as a query shows them: a resumed
  // run's latest attempt, and for step scalars the latest point per step.
  // `stored`: how many points were read before that.
  std::vector<Point> ReadShown(const SeriesKey& key, int64_t from, int64_t to,
                               const std::vector<RunLifecycle::Boundary>& boundaries,
                               size_t* stored = nullptr) const;

  const SeriesStore& store_;
  const AlertHub& alerts_;
  const RunTracker& runs_;
  const RunLifecycle* lifecycle_ = nullptr;
  QueryBudget* budget_ = nullptr;
};

}  // namespace foreshock::server
