// Delivers alerts to Alertmanager's API v2 (POST /api/v2/alerts) from a
// background thread. Firing alerts are re-sent every resend interval (so that
// Alertmanager keeps them and a restarted Alertmanager learns them again);
// resolved alerts are sent once with endsAt, then forgotten. While
// Alertmanager is unreachable, deliveries are retried with exponential
// backoff; nothing is dropped silently: the tracked set is bounded and what
// does not fit is counted.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "server/common/metrics.h"

namespace foreshock::server {

struct AlertmanagerOptions {
  // Base URL, e.g. http://127.0.0.1:9093, checked by ParseAlertmanagerUrl
  // (alertmanager_url.h). May carry user:password@: never log it, log
  // RedactUrlUserinfo(url).
  std::string url;
  std::chrono::milliseconds resend_interval{60000};
  std::chrono::milliseconds request_timeout{5000};
  std::chrono::milliseconds max_backoff{30000};
  size_t max_alerts = 10000;   // alerts tracked for delivery at once
  std::string generator_url;   // where a human finds the source (the daemon's HTTP port)
};

// One alert as Alertmanager sees it.
struct AlertmanagerAlert {
  std::vector<std::pair<std::string, std::string>> labels;
  std::vector<std::pair<std::string, std::string>> annotations;
  int64_t starts_at_ms = 0;
  int64_t ends_at_ms = 0;  // 0 while firing
};

class AlertmanagerNotifier {
 public:
  AlertmanagerNotifier(AlertmanagerOptions options, DaemonMetrics& metrics);
  ~AlertmanagerNotifier();  // stops after one last delivery attempt

  // Queues the alert's current state; returns at once.
  void Notify(AlertmanagerAlert alert);
  // Blocks until nothing is waiting for delivery or `timeout` passes (tests).
  bool WaitDelivered(std::chrono::milliseconds timeout);

  // The JSON body Alertmanager receives for `alerts` at `now_ms` (firing
  // alerts get endsAt = now + 3 resend intervals, as Prometheus does).
  std::string RenderBody(const std::vector<AlertmanagerAlert>& alerts, int64_t now_ms) const;

 private:
  struct Tracked {
    AlertmanagerAlert alert;
    bool dirty = true;  // changed since the last successful delivery
  };
  void Run();
  bool Post(const std::string& body, std::string* error);
  static std::string Fingerprint(const AlertmanagerAlert& alert);

  const AlertmanagerOptions options_;
  const std::string log_url_;  // options_.url without its userinfo: the form that is logged
  DaemonMetrics& metrics_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable delivered_;
  std::map<std::string, Tracked> alerts_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace foreshock::server
