// Runs the alert engine on detector output and delivers every transition:
// the foreshock_alert_active gauge, one structured log line, Alertmanager
// (when configured) and the WatchAlerts subscribers. The engine is pure; the
// hub adds the clock, the locking and the delivery.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "alerts/alert_engine.h"
#include "foreshock/v1/query.pb.h"
#include "server/alerting/alertmanager_notifier.h"
#include "server/common/metrics.h"
#include "server/pipeline/run_alert_effects.h"
#include "server/pipeline/worker_pool.h"

namespace foreshock::server {

class AlertHub final : public ObservationSink, public RunAlertEffects {
 public:
  // `notifier` may be null (no --alertmanager_url).
  AlertHub(alerts::AlertConfig config, DaemonMetrics& metrics,
           std::unique_ptr<AlertmanagerNotifier> notifier);
  ~AlertHub() override;

  // ObservationSink: called from worker threads.
  void OnObservation(const detectors::Sample& sample,
                     const detectors::Observation& observation) override;
  void OnNonFinite(const detectors::Sample& sample, detectors::SampleKind kind,
                   int64_t count) override;
  void OnSampleDone(const detectors::Sample&) override {}

  // --max_alert_episodes (alerts::AlertEngine::SetKeptEpisodeLimit).
  void SetKeptEpisodeLimit(size_t total);

  // Alerts as the Query API shows them; `run` empty means every run.
  std::vector<foreshock::v1::Alert> Alerts(const std::string& run, bool include_resolved) const;

  // Subscribers receive every event of `run` (all runs if empty) from the
  // moment they subscribe, in order, on the thread that caused it: they must
  // not block. With send_active, the active alerts come first as events.
  using Subscriber = std::function<void(const foreshock::v1::AlertEvent&)>;
  uint64_t Subscribe(const std::string& run, bool send_active, Subscriber subscriber);
  void Unsubscribe(uint64_t id);

  AlertmanagerNotifier* notifier() { return notifier_.get(); }

  // RunAlertEffects (server/pipeline/run_alert_effects.h), for the run
  // lifecycle: the engine's CloseEpisodes / RewindRun for `run`, its
  // transitions delivered like any other (gauge, log, Alertmanager,
  // WatchAlerts, event log), and `mark` recorded with the change under one
  // lock, so that a checkpoint holds both or neither.
  void CloseRunEpisodes(const std::string& run, std::string_view reason,
                        const alerts::LifecycleMark& mark) override;
  void RewindRun(const std::string& run, int64_t from_step,
                 const alerts::LifecycleMark& mark) override;
  void ForgetRun(const std::string& run) override;
  alerts::LifecycleMark GetLifecycleMark(const std::string& run) const override;

  // Every transition, as its AlertEvent, also goes to `log` (the durable
  // store's event log); called in order, under the hub's lock.
  void SetEventLog(std::function<void(const foreshock::v1::AlertEvent&)> log);

  // The engine's state (baselines, alert lifecycles, probable cause) and the
  // alerts' wall times, for a checkpoint; RestoreState (before any
  // observation) continues from it: firing alerts are re-announced to
  // Alertmanager and the foreshock_alert_active gauge. False on a corrupt
  // blob (the hub then starts empty).
  std::string SaveState() const;
  bool RestoreState(std::string_view bytes);

  // Brings foreshock_alert_points_total up to the engine's counters (called
  // before each scrape).
  void ExportCounters();

 private:
  void DeliverLocked(const std::vector<alerts::AlertTransition>& transitions);
  foreshock::v1::Alert ToProtoLocked(const alerts::Alert& alert) const;
  // Drops the wall times of episodes the engine no longer lists (beyond its
  // per-run bound, or of a forgotten run), so times_ stays bounded by them.
  void PruneTimesLocked();

  struct Times {
    int64_t starts_ms = 0;
    int64_t ends_ms = 0;
  };
  struct Watcher {
    std::string run;
    Subscriber subscriber;
  };

  DaemonMetrics& metrics_;
  std::unique_ptr<AlertmanagerNotifier> notifier_;
  mutable std::mutex mu_;  // guards everything below; transitions are delivered in order
  alerts::AlertEngine engine_;
  std::map<std::string, Times> times_;  // by alertname/run/layer/attempt/episode
  size_t times_prune_at_ = 4096;        // PruneTimesLocked once times_ is larger
  std::set<std::string> alerted_runs_;  // runs with at least one transition
  std::map<uint64_t, Watcher> watchers_;
  std::function<void(const foreshock::v1::AlertEvent&)> event_log_;
  uint64_t next_watcher_ = 1;
  alerts::AlertEngineCounters exported_;  // counter values already exported
};

}  // namespace foreshock::server
