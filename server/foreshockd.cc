// foreshockd: the Foreshock sidecar. Training ranks stream samples over gRPC;
// detectors run on worker threads; signals are exported to Prometheus.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <pthread.h>
#include <thread>

#include <spdlog/spdlog.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "server/daemon.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "HOST:PORT for the gRPC ingest service (foreshock.v1.Ingest), the gRPC health "
          "service and reflection. Port 0 picks a free port (logged at start).");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9464",
          "HOST:PORT for HTTP: Prometheus exposition at /metrics and a liveness probe at "
          "/-/healthy. Port 0 picks a free port (logged at start).");
ABSL_FLAG(int, workers, 0,
          "Detector worker threads. Samples are sharded by (run, layer), so each series is "
          "processed in order by one worker. 0 means one per CPU core.");
ABSL_FLAG(bool, per_head_metrics, false,
          "Also export per-head values with a `head` label. Per-layer values (aggregated over "
          "heads: min for entropies, max for logits and shares) are always exported. Per-head "
          "series multiply Prometheus cardinality by the head count.");
ABSL_FLAG(int64_t, series_capacity, 4096,
          "Points kept per (run, signal, layer, head) series in memory; older points are "
          "overwritten.");
ABSL_FLAG(int64_t, max_tokens, 4096,
          "Largest probe token count accepted in a QK or router sample; larger samples are "
          "rejected with reason shape_over_limit.");
ABSL_FLAG(int64_t, max_head_dim, 256,
          "Largest head_dim accepted in a QK sample (reason shape_over_limit above it).");
ABSL_FLAG(int64_t, max_heads, 256,
          "Largest head count accepted in a QK sample (reason shape_over_limit above it).");
ABSL_FLAG(int64_t, max_layers, 1024,
          "Largest layer count a Hello may declare; layers are checked against n_layers from "
          "the Hello, or against this limit when the Hello does not say.");
ABSL_FLAG(int64_t, max_experts, 1024,
          "Largest expert count accepted in a router sample (reason shape_over_limit above "
          "it).");
ABSL_FLAG(int64_t, max_queue_mb, 256,
          "Memory bound, in MiB, for accepted samples waiting for a worker. At the bound, "
          "streams stop reading and gRPC flow control slows the senders.");
ABSL_FLAG(int64_t, max_message_mb, 64,
          "Largest gRPC message accepted, in MiB; larger messages fail with "
          "RESOURCE_EXHAUSTED.");
ABSL_FLAG(int64_t, shutdown_grace_ms, 5000,
          "On SIGTERM or SIGINT, how long open streams may stay open before they are "
          "cancelled. Everything already accepted is processed before exit.");
ABSL_FLAG(std::string, config, "",
          "YAML file with the alert engine's per-signal thresholds, windows and persistence "
          "(see deploy/foreshock.yaml for every key and its default). Empty: the built-in "
          "defaults.");
ABSL_FLAG(std::string, alertmanager_url, "",
          "Base URL of an Alertmanager (e.g. http://127.0.0.1:9093). Alerts are POSTed to "
          "<url>/api/v2/alerts, re-sent while they fire, sent with endsAt when they resolve, "
          "and retried with backoff while Alertmanager is unreachable. Empty: no delivery "
          "(alerts still reach WatchAlerts and foreshock_alert_active).");
ABSL_FLAG(int64_t, alertmanager_resend_s, 60,
          "Seconds between re-sends of firing alerts to Alertmanager.");
ABSL_FLAG(std::string, record_dir, "",
          "Directory in which to record every ingest stream as received, for replay with "
          "`foreshockctl replay`: one file per stream, named "
          "<UTC yyyymmddThhmmss>-<run>-rank<rank>-<session>.fsrec, holding each StreamRequest "
          "(Hello and Batches, including ones that are then rejected) with its receive time. "
          "The directory is created if missing. Recording never fails or slows a stream: when "
          "the disk cannot keep up or a write fails, frames are dropped, logged once per stream "
          "and counted in foreshock_record_frames_total{outcome=\"dropped\"}. Empty: no "
          "recording.");
ABSL_FLAG(std::string, log_level, "info", "Log level: trace, debug, info, warn, error, off.");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "foreshockd: the Foreshock sidecar. Training ranks stream Q/K, router, curvature and "
      "step samples over gRPC; detectors compute instability signals; Prometheus scrapes "
      "/metrics.\n\nUsage: foreshockd [--listen=HOST:PORT] [--metrics_listen=HOST:PORT] "
      "[flags]");
  // Block the signals before any thread starts, so that only the waiter below
  // receives them: gRPC must never be shut down from a signal handler.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  absl::ParseCommandLine(argc, argv);
  spdlog::set_level(spdlog::level::from_str(absl::GetFlag(FLAGS_log_level)));

  foreshock::server::DaemonOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  options.workers = absl::GetFlag(FLAGS_workers);
  options.per_head_metrics = absl::GetFlag(FLAGS_per_head_metrics);
  options.series_capacity = static_cast<size_t>(std::max<int64_t>(1, absl::GetFlag(FLAGS_series_capacity)));
  options.limits.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  options.limits.max_head_dim = absl::GetFlag(FLAGS_max_head_dim);
  options.limits.max_heads = absl::GetFlag(FLAGS_max_heads);
  options.limits.max_layers = absl::GetFlag(FLAGS_max_layers);
  options.limits.max_experts = absl::GetFlag(FLAGS_max_experts);
  options.max_queue_bytes = static_cast<size_t>(std::max<int64_t>(1, absl::GetFlag(FLAGS_max_queue_mb))) << 20;
  options.max_message_bytes = static_cast<int>(std::clamp<int64_t>(absl::GetFlag(FLAGS_max_message_mb), 1, 2047)) << 20;

  options.record_dir = absl::GetFlag(FLAGS_record_dir);
  options.alertmanager_url = absl::GetFlag(FLAGS_alertmanager_url);
  options.alertmanager_resend_interval =
      std::chrono::seconds(std::max<int64_t>(1, absl::GetFlag(FLAGS_alertmanager_resend_s)));
  if (const std::string path = absl::GetFlag(FLAGS_config); !path.empty()) {
    auto config = foreshock::alerts::LoadAlertConfigFile(path);
    if (!config.ok()) {
      spdlog::critical("--config {}: {}", path, config.status().ToString());
      return 2;
    }
    options.alert_config = *std::move(config);
    spdlog::info("alert configuration loaded from {}", path);
  }

  foreshock::server::Daemon daemon(options);
  if (absl::Status status = daemon.Start(); !status.ok()) {
    spdlog::critical("{}", status.ToString());
    return 1;
  }

  int received = 0;
  sigwait(&stop_signals, &received);
  spdlog::info("received {}; draining", received == SIGTERM ? "SIGTERM" : "SIGINT");
  daemon.Shutdown(std::chrono::milliseconds(absl::GetFlag(FLAGS_shutdown_grace_ms)));
  return 0;
}
