#include "server/query/query_backend.h"

#include <algorithm>
#include <limits>
#include <map>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "detectors/detector.h"

namespace foreshock::server {

namespace v1 = foreshock::v1;

namespace {
// Step scalars of the run or of one rank: a rank's replay revises the
// run-level value of a recent step (wire/rank_scalars.h), and a
// rank reports one value per step, so such a series shows one point per
// step, the latest stored. (Other series may hold several points per step.)
bool OnePointPerStep(const SeriesKey& key) {
  return key.layer == detectors::kNoLayer &&
         (key.signal == "loss" || key.signal == "grad_norm" || key.signal == "lr");
}

// `points` sorted by step: of the points of one step, the last stored.
void KeepLatestPerStep(std::vector<Point>& points) {
  std::vector<Point> kept;
  kept.reserve(points.size());
  for (const Point& p : points) {
    if (!kept.empty() && kept.back().step == p.step) {
      if (p.wall_time_ms >= kept.back().wall_time_ms) kept.back() = p;
      continue;
    }
    kept.push_back(p);
  }
  points = std::move(kept);
}
void AddPoints(const std::vector<Point>& points, v1::GetSeriesResponse& response) {
  for (const Point& p : points) {
    v1::SeriesPoint* out = response.add_points();
    out->set_step(p.step);
    out->set_value(p.value);
    out->set_wall_time_unix_ms(p.wall_time_ms);
  }
}

void AddBuckets(const std::vector<store::Bucket>& buckets, v1::GetSeriesResponse& response) {
  response.set_downsampled(true);
  for (const store::Bucket& b : buckets) {
    v1::SeriesBucket* out = response.add_buckets();
    out->set_first_step(b.first_step);
    out->set_last_step(b.last_step);
    out->set_min(b.min);
    out->set_max(b.max);
    out->set_mean(b.mean);
    out->set_count(b.count);
    out->set_last(b.last_value);
  }
}

// Steps from a to b (a <= b), without overflow at int64's ends.
uint64_t Distance(int64_t a, int64_t b) {
  return static_cast<uint64_t>(b) - static_cast<uint64_t>(a);
}
}  // namespace

v1::ListRunsResponse QueryBackend::ListRuns() const {
  std::map<std::string, std::string> jobs;
  for (const RunTracker::RunSummary& run : runs_.Runs()) jobs[run.run] = run.job;
  std::map<std::string, int64_t> active;
  for (const v1::Alert& alert : alerts_.Alerts("", /*include_resolved=*/false)) {
    ++active[alert.run()];
  }
  std::vector<store::RunInfo> runs = store_.ListRuns();
  // Newest activity first: what a user opening the UI wants to see.
  std::stable_sort(runs.begin(), runs.end(), [](const store::RunInfo& a, const store::RunInfo& b) {
    return a.last_wall_time_ms > b.last_wall_time_ms;
  });
  v1::ListRunsResponse response;
  for (const store::RunInfo& info : runs) {
    v1::RunInfo* out = response.add_runs();
    out->set_run(info.run);
    if (auto it = jobs.find(info.run); it != jobs.end()) out->set_job_name(it->second);
    out->set_first_step(info.first_step);
    out->set_last_step(info.last_step);
    out->set_series(static_cast<int64_t>(info.series));
    out->set_last_seen_unix_ms(info.last_wall_time_ms);
    if (auto it = active.find(info.run); it != active.end()) out->set_active_alerts(it->second);
    out->set_attempt(1);
    out->set_attempt_start_step(-1);
    if (lifecycle_ == nullptr) continue;
    if (const std::optional<RunLifecycle::Status> status = lifecycle_->GetStatus(info.run)) {
      out->set_ended(status->ended);
      out->set_ended_unix_ms(status->ended_ms);
      out->set_attempt(status->attempt);
      out->set_attempt_start_step(status->attempt_start_step);
    }
  }
  return response;
}

absl::StatusOr<v1::ListSeriesResponse> QueryBackend::ListSeries(
    const v1::ListSeriesRequest& request) const {
  if (request.run().empty()) return absl::InvalidArgumentError("run is required");
  const std::vector<store::SeriesInfo> series = store_.ListSeries(request.run());
  if (series.empty()) {
    return absl::NotFoundError(absl::StrCat("no run '", request.run(), "' in the store"));
  }
  v1::ListSeriesResponse response;
  response.set_run(request.run());
  for (const store::SeriesInfo& info : series) {
    v1::SeriesInfo* out = response.add_series();
    out->set_signal(info.key.signal);
    out->set_layer(info.key.layer);
    out->set_head(info.key.head);
    out->set_first_step(info.first_step);
    out->set_last_step(info.last_step);
    out->set_points(static_cast<int64_t>(info.points));
  }
  return response;
}

namespace {
// Points of `series` with from <= step <= to, estimated from its step span
// (before reading them): all of them when the range covers the series.
int64_t EstimatePoints(const store::SeriesInfo& series, int64_t from, int64_t to) {
  const int64_t lo = std::max(from, series.first_step), hi = std::min(to, series.last_step);
  if (hi < lo) return 0;
  if (lo == series.first_step && hi == series.last_step) return static_cast<int64_t>(series.points);
  const double span = static_cast<double>(series.last_step) - static_cast<double>(series.first_step) + 1;
  const double fraction = (static_cast<double>(hi) - static_cast<double>(lo) + 1) / span;
  return static_cast<int64_t>(fraction * static_cast<double>(series.points)) + 1;
}
}  // namespace

absl::StatusOr<v1::GetSeriesResponse> QueryBackend::GetSeries(
    const v1::GetSeriesRequest& request, QueryBudget::Lease* lease) const {
  if (request.run().empty() || request.signal().empty()) {
    return absl::InvalidArgumentError("run and signal are required");
  }
  const SeriesKey key{request.run(), request.signal(),
                      request.has_layer() ? request.layer() : -1,
                      request.has_head() ? request.head() : -1};
  const int64_t from = request.has_from_step() ? request.from_step()
                                               : std::numeric_limits<int64_t>::min();
  const int64_t to = request.has_to_step() ? request.to_step()
                                           : std::numeric_limits<int64_t>::max();
  if (from > to) {
    return absl::InvalidArgumentError(
        absl::StrCat("from_step ", from, " is after to_step ", to));
  }
  // An unknown series: say what the run does have, so a typo is easy to fix.
  const std::vector<store::SeriesInfo> series = store_.ListSeries(request.run());
  const auto info = std::find_if(series.begin(), series.end(),
                                 [&](const store::SeriesInfo& s) { return s.key == key; });
  if (info == series.end()) {
    if (series.empty()) {
      return absl::NotFoundError(absl::StrCat("no run '", request.run(), "' in the store"));
    }
    std::set<int> layers;
    std::set<std::string> signals;
    for (const store::SeriesInfo& s : series) {
      signals.insert(s.key.signal);
      if (s.key.signal == key.signal && s.key.head == key.head) layers.insert(s.key.layer);
    }
    if (!layers.empty()) {
      std::vector<std::string> names;
      for (int layer : layers) names.push_back(layer < 0 ? "run-level" : std::to_string(layer));
      return absl::NotFoundError(absl::StrCat("run '", key.run, "' has no ", key.signal,
                                              key.layer < 0 ? " run-level series" : " series for layer ",
                                              key.layer < 0 ? "" : std::to_string(key.layer),
                                              "; its layers: ", absl::StrJoin(names, ", ")));
    }
    return absl::NotFoundError(absl::StrCat("run '", key.run, "' has no series '", key.signal,
                                            "' (head ", key.head, "); its signals: ",
                                            absl::StrJoin(signals, ", ")));
  }

  v1::GetSeriesResponse response;
  response.set_run(key.run);
  response.set_signal(key.signal);
  response.set_layer(key.layer);
  response.set_head(key.head);
  QueryBudget::Lease local;
  if (lease == nullptr) lease = &local;
  const std::string what = absl::StrCat("GetSeries of run '", key.run, "' ", key.signal,
                                        " (layer ", key.layer, ", head ", key.head, ")");
  const uint32_t max_points = request.max_points();
  if (max_points > 0 &&
      EstimatePoints(*info, from, to) > std::max<int64_t>(max_points, kWindowPoints)) {
    return DownsampleInWindows(*info, from, to, max_points, what, *lease, std::move(response));
  }
  if (budget_ != nullptr) {
    // Before the read: what the store's read of the range will hold.
    if (absl::Status leased = budget_->Grow(
            *lease, EstimatePoints(*info, from, to) * QueryBudget::kRangePointBytes, what);
        !leased.ok()) {
      return leased;
    }
  }
  std::vector<Point> points = ReadShown(
      key, from, to,
      lifecycle_ != nullptr ? lifecycle_->Boundaries(key.run) : std::vector<RunLifecycle::Boundary>{});
  response.set_total_points(points.size());
  if (budget_ != nullptr) {
    // The request's size is known now: within --max_query_mb, or how to page.
    const int64_t n = static_cast<int64_t>(points.size());
    const bool raw = max_points == 0 || n <= max_points;
    const int64_t answer = raw ? n * QueryBudget::kRawPointBytes
                               : std::min<int64_t>(n, max_points) * QueryBudget::kBucketBytes;
    const int64_t cost = n * QueryBudget::kRangePointBytes + answer;
    const int64_t limit = budget_->per_request_bytes();
    if (limit > 0 && cost > limit) {
      budget_->CountTooLarge();
      const std::string over = absl::StrCat("about ", cost >> 20, " MiB, over --max_query_mb=",
                                            limit >> 20);
      if (!raw) {
        return absl::ResourceExhaustedError(absl::StrCat(
            what, ": downsampling the ", n, " points of the range to ", max_points,
            " takes ", over, ": narrow the range (from_step and to_step; from and to in "
            "/api/v1/points) or ask for fewer points"));
      }
      const size_t page = static_cast<size_t>(std::max<int64_t>(
          1, limit / (QueryBudget::kRangePointBytes + QueryBudget::kRawPointBytes)));
      return absl::ResourceExhaustedError(absl::StrCat(
          what, ": the ", n, " points of the range make an answer of ", over,
          ". Page through it at most ", page, " points at a time: steps ", points[0].step,
          " to ", points[page - 1].step, " first, then from step ", points[page].step,
          " on (GetSeriesRequest from_step and to_step; from and to in /api/v1/points); or "
          "set max_points to downsample it"));
    }
    if (absl::Status leased = budget_->Grow(*lease, cost, what); !leased.ok()) return leased;
  }
  if (max_points == 0 || points.size() <= max_points) {
    if (points.size() > kMaxRawPoints) {
      return absl::ResourceExhaustedError(
          absl::StrCat(points.size(), " points in the range, over the ", kMaxRawPoints,
                       " a response may carry: set max_points or narrow the range"));
    }
    AddPoints(points, response);
    return response;
  }
  AddBuckets(store::DownsamplePoints(points, max_points), response);
  return response;
}

std::vector<Point> QueryBackend::ReadShown(
    const SeriesKey& key, int64_t from, int64_t to,
    const std::vector<RunLifecycle::Boundary>& boundaries, size_t* stored) const {
  std::vector<Point> points = store_.Range(key, from, to);
  if (stored != nullptr) *stored = points.size();
  // A run resumed from a checkpoint: one point per step, the latest attempt's.
  RunLifecycle::LatestAttempt(points, boundaries);
  if (OnePointPerStep(key)) KeepLatestPerStep(points);
  return points;
}

absl::StatusOr<v1::GetSeriesResponse> QueryBackend::DownsampleInWindows(
    const store::SeriesInfo& info, int64_t from, int64_t to, uint32_t max_points,
    const std::string& what, QueryBudget::Lease& lease, v1::GetSeriesResponse response) const {
  const SeriesKey& key = info.key;
  const int64_t lo = std::max(from, info.first_step), hi = std::min(to, info.last_step);
  const int64_t estimate = EstimatePoints(info, from, to);
  // Held at once: one window (read, then filtered), and the answer: at most
  // max_points buckets, or as many raw points when filtering leaves no more.
  const int64_t answer = std::min<int64_t>(estimate, max_points) * QueryBudget::kBucketBytes;
  // A window point is held twice at most (as read, then filtered).
  constexpr int64_t kWindowPointBytes = 2 * QueryBudget::kRangePointBytes;
  constexpr int64_t kLeastWindowPoints = 1024;
  int64_t window_points = kWindowPoints;
  if (budget_ != nullptr) {
    // The window shrinks to what --max_query_mb leaves beside the answer.
    const int64_t limit = budget_->per_request_bytes();
    if (limit > 0) window_points = std::min(window_points, (limit - answer) / kWindowPointBytes);
    if (window_points < kLeastWindowPoints) {
      budget_->CountTooLarge();
      return absl::ResourceExhaustedError(absl::StrCat(
          what, ": ", max_points, " buckets take about ", answer >> 20,
          " MiB, too much of --max_query_mb=", limit >> 20, ": ask for fewer points"));
    }
  }
  int64_t window_bytes = window_points * kWindowPointBytes;
  if (budget_ != nullptr) {
    if (absl::Status leased = budget_->Grow(lease, answer + window_bytes, what); !leased.ok()) {
      return leased;
    }
  }
  const std::vector<RunLifecycle::Boundary> boundaries =
      lifecycle_ != nullptr ? lifecycle_->Boundaries(key.run) : std::vector<RunLifecycle::Boundary>{};
  // Steps per window, from the series' density, then from each window read.
  const double span = static_cast<double>(info.last_step) - static_cast<double>(info.first_step) + 1;
  double steps_per_point = std::max(1.0, span / static_cast<double>(std::max<uint64_t>(info.points, 1)));
  auto window_steps = [&] {
    return static_cast<uint64_t>(std::clamp(static_cast<double>(window_points) * steps_per_point,
                                            1.0, 9.0e18));
  };
  // Reads [a, b] and adapts the window to what it held (an empty one doubles
  // it); a window denser than leased (a resumed run's overlapping attempts)
  // is leased as it is.
  auto read = [&](int64_t a, int64_t b) -> absl::StatusOr<std::vector<Point>> {
    size_t stored = 0;
    std::vector<Point> shown = ReadShown(key, a, b, boundaries, &stored);
    const int64_t held = static_cast<int64_t>(stored) * kWindowPointBytes;
    if (budget_ != nullptr && held > window_bytes) {
      if (absl::Status leased = budget_->Grow(lease, held - window_bytes, what); !leased.ok()) {
        return leased;
      }
      window_bytes = held;
    }
    if (stored > 0) {
      steps_per_point = std::max(1.0, (static_cast<double>(Distance(a, b)) + 1) /
                                          static_cast<double>(stored));
    } else {
      steps_per_point *= 2;  // a gap in the steps: crossed in a few windows
    }
    return shown;
  };
  // The last shown step, from the end backwards: it fixes the buckets (and
  // points appended after it, by a run still training, are not this answer's).
  std::optional<int64_t> last;
  for (int64_t b = hi; b >= lo && !last;) {
    const int64_t a = Distance(lo, b) < window_steps()
                          ? lo : static_cast<int64_t>(static_cast<uint64_t>(b) - window_steps() + 1);
    absl::StatusOr<std::vector<Point>> points = read(a, b);
    if (!points.ok()) return points.status();
    if (!points->empty()) last = points->back().step;
    if (a == lo) break;
    b = a - 1;
  }
  std::optional<store::StepDownsampler> downsampler;
  std::vector<Point> kept;  // the points while there are no more than max_points
  int64_t shown = 0;
  for (int64_t a = lo; last && a <= *last;) {
    const int64_t b = Distance(a, *last) < window_steps()
                          ? *last : static_cast<int64_t>(static_cast<uint64_t>(a) + window_steps() - 1);
    absl::StatusOr<std::vector<Point>> points = read(a, b);
    if (!points.ok()) return points.status();
    for (const Point& p : *points) {
      if (!downsampler) downsampler.emplace(p.step, *last, max_points);
      downsampler->Add(p);
      if (++shown <= max_points) {
        kept.push_back(p);
      } else if (!kept.empty()) {
        kept = {};
      }
    }
    if (b == *last) break;
    a = b + 1;
  }
  response.set_total_points(shown);
  if (shown <= max_points) {  // filtering left few enough to send them raw
    AddPoints(kept, response);
    return response;
  }
  AddBuckets(downsampler->Finish(), response);
  return response;
}

bool QueryBackend::KnownRun(const std::string& run) const {
  if (!alerts_.Alerts(run, /*include_resolved=*/true).empty()) return true;
  for (const RunTracker::RunSummary& summary : runs_.Runs()) {
    if (summary.run == run) return true;
  }
  return !store_.ListSeries(run).empty();
}

absl::StatusOr<v1::ListAlertsResponse> QueryBackend::ListAlerts(
    const v1::ListAlertsRequest& request) const {
  std::vector<v1::Alert> alerts = alerts_.Alerts(request.run(), request.include_resolved());
  // A named run the daemon has never seen is NOT_FOUND, as in ListSeries and
  // GetSeries; a known run without alerts answers an empty list.
  if (alerts.empty() && !request.run().empty() && !KnownRun(request.run())) {
    return absl::NotFoundError(absl::StrCat("no run '", request.run(), "' in the store"));
  }
  v1::ListAlertsResponse response;
  for (v1::Alert& alert : alerts) *response.add_alerts() = std::move(alert);
  return response;
}

}  // namespace foreshock::server

namespace foreshock::server {

namespace {
absl::Status RequireToken(const AccessCheck& access) {
  if (!access.authenticated().ok()) access.CountUnauthenticated();
  return access.authenticated();
}
}  // namespace

absl::StatusOr<foreshock::v1::ListRunsResponse> QueryBackend::ListRuns(
    const AccessCheck& access) const {
  if (absl::Status status = RequireToken(access); !status.ok()) return status;
  foreshock::v1::ListRunsResponse all = ListRuns();
  foreshock::v1::ListRunsResponse visible;
  for (auto& run : *all.mutable_runs()) {
    if (access.Allows(run.run(), Right::kQuery)) *visible.add_runs() = std::move(run);
  }
  return visible;
}

absl::StatusOr<foreshock::v1::ListSeriesResponse> QueryBackend::ListSeries(
    const foreshock::v1::ListSeriesRequest& request, const AccessCheck& access) const {
  if (absl::Status status = access.Check(request.run(), Right::kQuery); !status.ok()) {
    return status;
  }
  return ListSeries(request);
}

absl::StatusOr<foreshock::v1::GetSeriesResponse> QueryBackend::GetSeries(
    const foreshock::v1::GetSeriesRequest& request, const AccessCheck& access,
    QueryBudget::Lease* lease) const {
  if (absl::Status status = access.Check(request.run(), Right::kQuery); !status.ok()) {
    return status;
  }
  return GetSeries(request, lease);
}

absl::StatusOr<foreshock::v1::ListAlertsResponse> QueryBackend::ListAlerts(
    const foreshock::v1::ListAlertsRequest& request, const AccessCheck& access) const {
  if (!request.run().empty()) {
    if (absl::Status status = access.Check(request.run(), Right::kQuery); !status.ok()) {
      return status;
    }
    return ListAlerts(request);
  }
  if (absl::Status status = RequireToken(access); !status.ok()) return status;
  absl::StatusOr<foreshock::v1::ListAlertsResponse> all = ListAlerts(request);
  if (!all.ok()) return all.status();
  foreshock::v1::ListAlertsResponse visible;
  for (auto& alert : *all->mutable_alerts()) {
    if (access.Allows(alert.run(), Right::kQuery)) *visible.add_alerts() = std::move(alert);
  }
  return visible;
}

}  // namespace foreshock::server
