// Every metric the daemon exports, declared once. The tables below generate
// the families and their HELP text; signal gauges come from the detector
// registry, so a new detector needs no change here.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "detectors/detector.h"

namespace foreshock::server {

// X(member, metric name without prefix, help)
#define FORESHOCK_DAEMON_COUNTERS(X)                                                          \
  X(ingest_records_total, "ingest_records_total",                                             \
    "Records accepted by ingest, by sample kind (label kind).")                               \
  X(ingest_rejected_total, "ingest_rejected_total",                                           \
    "Records and streams rejected, by reason code (label reason). The Ack or gRPC status "    \
    "carries the same code with a detail.")                                                   \
  X(ingest_bytes_total, "ingest_bytes_total", "Bytes of Batch messages received.")            \
  X(ingest_duplicate_batches_total, "ingest_duplicate_batches_total",                         \
    "Resent batches (Hello.first_seq streams) already stored: acked again, not reprocessed.") \
  X(nonfinite_values_total, "nonfinite_values_total",                                         \
    "Non-finite values (NaN, +-Inf) found in samples, by run and sample kind. Such a sample " \
    "is counted and not used for computation.")                                               \
  X(ingest_streams_total, "ingest_streams_total", "Ingest streams opened since start.")       \
  X(samples_processed_total, "samples_processed_total",                                       \
    "Samples run through the detectors, by sample kind (label kind).")                        \
  X(detector_errors_total, "detector_errors_total",                                           \
    "Samples a detector failed on (it skipped them), by detector (label detector).")           \
  X(alert_transitions_total, "alert_transitions_total",                                       \
    "Alert lifecycle transitions, by alert name and new state (labels alertname, to).")      \
  X(alertmanager_posts_total, "alertmanager_posts_total",                                     \
    "POSTs to Alertmanager's /api/v2/alerts, by result (ok, error).")                         \
  X(alertmanager_dropped_total, "alertmanager_dropped_total",                                 \
    "Alert notifications dropped because too many alerts were waiting for delivery.")        \
  X(alert_points_total, "alert_points_total",                                                 \
    "Signal points offered to the alert engine, by outcome: scored, stale (an older step than "\
    "the series has seen, e.g. a run resumed from a checkpoint), duplicate (another rank's "  \
    "copy of a step), nonfinite.")                                                             \
  X(alert_episodes_dropped_total, "alert_episodes_dropped_total",                             \
    "Closed alert episodes no longer listed (ListAlerts with include_resolved, the UI): past " \
    "4,096 in their run, or past --max_alert_episodes over all runs (then from the run that "  \
    "keeps the most); episodes that never fired go first.")                                    \
  X(watch_events_dropped_total, "watch_events_dropped_total",                                 \
    "WatchAlerts events dropped for a subscriber that did not keep up (its stream ends).")     \
  X(record_frames_total, "record_frames_total",                                               \
    "Received StreamRequests recorded with --record_dir, by outcome: written (handed to the "  \
    "kernel) or dropped (the recorder fell behind, or a file could not be created or "        \
    "written; logged once per stream).")                                                   \
  X(record_files_deleted_total, "record_files_deleted_total",                               \
    "Closed recordings deleted from --record_dir by retention, by reason: size (over "       \
    "--record_max_mb, oldest first) or age (older than --record_max_age_h).")              \
  X(series_limited_total, "series_limited_total",                                           \
    "Detector observations dropped (not exported, stored or alerted on) because they would " \
    "open a new series for a run that already has --max_series_per_run series.")          \
  X(metrics_series_dropped_total, "metrics_series_dropped_total",                           \
    "Detector observations not exported to /metrics because --max_metrics_series signal "   \
    "series exist (they are still stored and alerted on; the Query API and the web UI show " \
    "them).")                                                                                \
  X(query_refused_total, "query_refused_total",                                             \
    "Query requests (GetSeries over gRPC, /api/v1/points) refused for memory, by reason: "   \
    "too_large (the answer would be over --max_query_mb, or over --max_query_total_mb; the " \
    "message says how to page or downsample it) or busy (the queries in progress hold "     \
    "--max_query_total_mb; retry).")                                                         \
  X(runs_forgotten_total, "runs_forgotten_total",                                           \
    "Runs forgotten: no stream open and nothing sent for --forget_runs_idle_s. Their "      \
    "baselines, detector state and /metrics series were dropped; stored points and alert "  \
    "records stay.")

#define FORESHOCK_DAEMON_GAUGES(X)                                                              \
  X(ingest_active_streams, "ingest_active_streams", "Ingest streams open now.")                 \
  X(record_bytes, "record_bytes",                                                               \
    "Bytes of recordings in --record_dir (closed and open), bounded by --record_max_mb.")       \
  X(data_dir_bytes, "data_dir_bytes",                                                           \
    "Bytes of the files under --data_dir (store segments, checkpoints, event logs), summed "  \
    "at scrape time at most every 5 s; bounded by --retention_max_gb. 0 without a data "     \
    "directory.")                                                                               \
  X(queue_bytes, "queue_bytes",                                                                 \
    "Bytes of accepted samples waiting for or in a worker. Bounded by --max_queue_mb; at "   \
    "the bound, streams stop reading and gRPC flow control pushes back on clients.")            \
  X(queue_depth, "queue_depth", "Samples waiting in each worker's queue (label worker).")       \
  X(streams_waiting_for_queue, "streams_waiting_for_queue",                                     \
    "Ingest streams paused because the work queue is full.")                                    \
  X(memory_resident_bytes, "memory_resident_bytes",                                             \
    "Resident memory of the daemon, sampled every 100 ms.")                                     \
  X(memory_limit_bytes, "memory_limit_bytes",                                                   \
    "--max_memory_mb in bytes (0: no bound). At it, ingest refuses probes (QK, router) with "  \
    "reason memory_limit, scalars still accepted, until memory falls below 90% of it or "     \
    "settles with nothing queued.")                                                             \
  X(memory_reserved_bytes, "memory_reserved_bytes",                                             \
    "Room set aside for the next batch of each open stream that sends batches of 256 KiB or "  \
    "more (its last batch's size); counted with resident memory against --max_memory_mb, "  \
    "since a batch is resident before ingest can refuse it.")                                   \
  X(run_state_bytes, "run_state_bytes",                                                         \
    "Detector state the run's probes retain (previous QK and router samples), by run; a "      \
    "probe that would grow it past --max_state_mb_per_run is rejected with reason "            \
    "state_limit.")                                                                             \
  X(query_bytes, "query_bytes",                                                                 \
    "Bytes the query requests in progress hold (leased from --max_query_total_mb).")          \
  X(metrics_signal_series, "metrics_signal_series",                                             \
    "Signal series (detector values by run, layer, head) in /metrics; at most "              \
    "--max_metrics_series.")                                                                    \
  X(run_info, "run_info",                                                                       \
    "Always 1; labels carry the run's job name (job_name) and model shape from its Hello.")     \
  X(last_step, "last_step", "Highest training step processed for the run.")                   \
  X(alert_active, "alert_active",                                                               \
    "1 while an alert fires (labels alertname, run, layer, severity), 0 once resolved.")         \
  X(alertmanager_tracked_alerts, "alertmanager_tracked_alerts",                                 \
    "Alerts waiting for delivery to Alertmanager or kept for re-sending while they fire.")       \
  X(alert_episodes_kept, "alert_episodes_kept",                                                 \
    "Closed alert episodes kept for the record of what fired, over all runs (about 1 KiB "      \
    "each; at most --max_alert_episodes).")                                                    \
  X(alert_baseline_series, "alert_baseline_series",                                             \
    "Series (signal, layer, head) the alert engine keeps a baseline for, over all runs; a "     \
    "forgotten run's go (--forget_runs_idle_s).")

#define FORESHOCK_DAEMON_HISTOGRAMS(X)                                    \
  X(detector_seconds, "detector_seconds",                                 \
    "Time a detector spent on one sample, by detector (label detector).")

inline constexpr std::string_view kMetricPrefix = "foreshock_";

// Known label values. Their series are exported at 0 before the first event
// (Prometheus practice), so that rate(), increase() and absent() see a 0 from
// the daemon's start instead of nothing, and an alert on the first event
// fires. docs/DESIGN.md §4.5 says which series exist when.
// foreshock_ingest_rejected_total{reason}: the codes ingest declares
// (DeclareRejectionReasons below).
// foreshock_alertmanager_posts_total{result}, with --alertmanager_url.
inline constexpr std::array<std::string_view, 2> kAlertmanagerPostResults = {"ok", "error"};
// foreshock_alert_points_total{outcome}.
inline constexpr std::array<std::string_view, 4> kAlertPointOutcomes = {"scored", "stale",
                                                                        "duplicate", "nonfinite"};

class DaemonMetrics {
 public:
  // `max_signal_series` (--max_metrics_series) bounds the detector signal
  // series in /metrics over all runs; 0: no bound.
  DaemonMetrics(prometheus::Registry& registry, bool per_head_metrics,
                int64_t max_signal_series = 0);

#define FORESHOCK_DECLARE_FAMILY(member, name, help) prometheus::Family<prometheus::Counter>& member;
  FORESHOCK_DAEMON_COUNTERS(FORESHOCK_DECLARE_FAMILY)
#undef FORESHOCK_DECLARE_FAMILY
#define FORESHOCK_DECLARE_FAMILY(member, name, help) prometheus::Family<prometheus::Gauge>& member;
  FORESHOCK_DAEMON_GAUGES(FORESHOCK_DECLARE_FAMILY)
#undef FORESHOCK_DECLARE_FAMILY
#define FORESHOCK_DECLARE_FAMILY(member, name, help) prometheus::Family<prometheus::Histogram>& member;
  FORESHOCK_DAEMON_HISTOGRAMS(FORESHOCK_DECLARE_FAMILY)
#undef FORESHOCK_DECLARE_FAMILY

  // Gauge family of a detector signal, e.g. "qk_increment_entropy" ->
  // foreshock_qk_increment_entropy; nullptr for an unknown signal.
  prometheus::Family<prometheus::Gauge>* signal(std::string_view name) const;
  // Exports one detector observation with the labels its scope calls for.
  // Per-head values are exported only with --per_head_metrics. False when
  // nothing was exported (an unknown signal, a head without the flag, or a
  // new series past --max_metrics_series: counted in
  // foreshock_metrics_series_dropped_total; existing series keep updating).
  bool ExportObservation(const std::string& run, const detectors::Observation& observation);

  // The rejection codes ingest can count (server/ingest/validation.h,
  // RejectionReasons()), exported at 0 from now on. Called once, by the
  // ingest service's constructor, before any CountRejection.
  void DeclareRejectionReasons(std::span<const std::string_view> codes);
  // Rejections are counted in one place so that reason codes stay consistent.
  // A code that was not declared is still counted (and logged once).
  void CountRejection(std::string_view reason_code, double n = 1);

  // The series of a run that exist from its first Hello, at 0:
  // foreshock_nonfinite_values_total{run, kind} for every sample kind.
  void AddRun(const std::string& run);
  // A forgotten run leaves /metrics: its nonfinite_values_total series and
  // every signal series it exported (their room under --max_metrics_series
  // is free again). Called with no stream of the run open; a value exported
  // meanwhile comes back as a new series.
  void RemoveRun(const std::string& run);

  // Per-detector series, resolved once (every sample bumps them). Null for a
  // detector that is not in the registry.
  prometheus::Histogram* detector_time(std::string_view detector) const;
  prometheus::Counter* detector_errors(std::string_view detector) const;
  // Buckets of foreshock_detector_seconds.
  static const prometheus::Histogram::BucketBoundaries& DetectorSecondsBuckets();

  // Per-kind counters resolved once: they are bumped for every record, and a
  // family lookup hashes the labels under a lock.
  prometheus::Counter& records_accepted(detectors::SampleKind kind) {
    return *records_accepted_[static_cast<size_t>(kind)];
  }
  prometheus::Counter& samples_processed(detectors::SampleKind kind) {
    return *samples_processed_[static_cast<size_t>(kind)];
  }

 private:
  struct SignalFamily {
    const detectors::SignalSpec* spec;
    prometheus::Family<prometheus::Gauge>* family;
  };
  static constexpr size_t kSampleKinds = 4;
  bool per_head_metrics_;
  const int64_t max_signal_series_;
  std::atomic<int64_t> signal_series_{0};
  prometheus::Gauge* signal_series_gauge_;
  prometheus::Counter* series_dropped_;
  struct DetectorSeries {
    prometheus::Histogram* time;
    prometheus::Counter* errors;
  };
  std::map<std::string, SignalFamily, std::less<>> signals_;
  // Filled in the constructor and never changed: read without a lock.
  std::map<std::string, DetectorSeries, std::less<>> detectors_;
  std::map<std::string, prometheus::Counter*, std::less<>> rejections_;
  prometheus::Counter* records_accepted_[kSampleKinds];
  prometheus::Counter* samples_processed_[kSampleKinds];
};

}  // namespace foreshock::server
