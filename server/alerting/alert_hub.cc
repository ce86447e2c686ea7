#include "server/alerting/alert_hub.h"

#include <algorithm>

#include <spdlog/spdlog.h>

#include "codec/state_codec.h"
#include "server/common/clock.h"

namespace foreshock::server {
namespace {

namespace v1 = foreshock::v1;


// Wall times are kept per episode: ListAlerts lists every episode.
std::string AlertKey(const alerts::Alert& alert) {
  return alert.alertname + '\x1f' + alert.run + '\x1f' + alert.layer + '\x1f' +
         std::to_string(alert.attempt) + '\x1f' + std::to_string(alert.episode);
}
// Version 1 of the hub state kept them per alertname/run/layer.
std::string AlertKeyV1(const alerts::Alert& alert) {
  return alert.alertname + '\x1f' + alert.run + '\x1f' + alert.layer;
}

}  // namespace

AlertHub::AlertHub(alerts::AlertConfig config, DaemonMetrics& metrics,
                   std::unique_ptr<AlertmanagerNotifier> notifier)
    : metrics_(metrics), notifier_(std::move(notifier)), engine_(std::move(config)) {
  // Known label values at 0 from the start (server/common/metrics.h): every alert
  // this configuration can raise, in every state it can move to.
  const alerts::AlertConfig& active = engine_.config();
  std::set<std::string> alertnames;
  for (const auto& [signal, signal_config] : active.signals) {
    if (signal_config.enabled) alertnames.insert(signal_config.alertname);
  }
  if (active.nonfinite.enabled) alertnames.insert(std::string(alerts::kNonFinite));
  for (const std::string& alertname : alertnames) {
    for (alerts::AlertState to : {alerts::AlertState::kInactive, alerts::AlertState::kPending,
                                  alerts::AlertState::kFiring, alerts::AlertState::kResolved}) {
      metrics_.alert_transitions_total.Add(
          {{"alertname", alertname}, {"to", std::string(alerts::AlertStateName(to))}});
    }
  }
  if (notifier_) {
    for (std::string_view result : kAlertmanagerPostResults) {
      metrics_.alertmanager_posts_total.Add({{"result", std::string(result)}});
    }
  }
}

AlertHub::~AlertHub() = default;

void AlertHub::OnObservation(const detectors::Sample& sample,
                             const detectors::Observation& observation) {
  // Layer aggregates and run-level values drive alerts, and the per-head
  // values of the signals the configuration judges per head
  // (alerts::SignalConfig::per_head); the engine decides what to score.
  if (!observation.for_detection) return;
  if (observation.head != detectors::kAllHeads) {
    const auto& signals = engine_.config().signals;  // const after construction
    const auto it = signals.find(observation.signal);
    if (it == signals.end() || !it->second.per_head) return;
  }
  alerts::SignalPoint point;
  point.run = sample.run;
  point.step = sample.step;
  point.signal = observation.signal;
  point.layer = observation.layer;
  point.head = observation.head;
  point.value = observation.value;
  point.for_detection = observation.for_detection;
  std::lock_guard<std::mutex> lock(mu_);
  DeliverLocked(engine_.Observe(point));
}

void AlertHub::OnNonFinite(const detectors::Sample& sample, detectors::SampleKind kind,
                           int64_t count) {
  alerts::NonFiniteEvent event;
  event.run = sample.run;
  event.step = sample.step;
  event.kind = kind;
  event.count = count;
  event.layer = sample.layer();
  std::lock_guard<std::mutex> lock(mu_);
  DeliverLocked(engine_.ObserveNonFinite(event));
}

void AlertHub::DeliverLocked(const std::vector<alerts::AlertTransition>& transitions) {
  for (const alerts::AlertTransition& t : transitions) {
    const alerts::Alert& alert = t.alert;
    alerted_runs_.insert(alert.run);
    if (times_.size() > times_prune_at_) PruneTimesLocked();
    Times& times = times_[AlertKey(alert)];
    if (t.to == alerts::AlertState::kFiring && t.from != alerts::AlertState::kFiring) {
      times = Times{NowUnixMillis(), 0};
    } else if (t.to == alerts::AlertState::kResolved) {
      times.ends_ms = NowUnixMillis();
    }

    metrics_.alert_active
        .Add({{"alertname", alert.alertname}, {"run", alert.run}, {"layer", alert.layer},
              {"severity", alert.severity}})
        .Set(t.to == alerts::AlertState::kFiring ? 1.0 : 0.0);
    metrics_.alert_transitions_total
        .Add({{"alertname", alert.alertname}, {"to", std::string(alerts::AlertStateName(t.to))}})
        .Increment();
    // One structured line per transition (key=value, values quoted).
    spdlog::info(
        "alert transition alertname={} run=\"{}\" layer={} signal={} severity={} from={} to={} "
        "step={} first_step={} probable_cause={} cause_status={} value={} baseline={} z={}",
        alert.alertname, alert.run, alert.layer, alert.signal, alert.severity,
        alerts::AlertStateName(t.from), alerts::AlertStateName(t.to), t.step, alert.first_step,
        alert.probable_cause, alert.probable_cause_settled ? "settled" : "provisional",
        alert.value, alert.baseline, alert.z);

    const bool deliver = t.to == alerts::AlertState::kFiring ||
                         (t.to == alerts::AlertState::kResolved && t.from == alerts::AlertState::kFiring);
    if (notifier_ && deliver) {
      AlertmanagerAlert out;
      out.labels = alert.Labels();
      out.annotations = alert.Annotations();
      out.starts_at_ms = times.starts_ms;
      out.ends_at_ms = t.to == alerts::AlertState::kResolved ? times.ends_ms : 0;
      notifier_->Notify(std::move(out));
    }

    if (!watchers_.empty() || event_log_) {
      v1::AlertEvent event;
      *event.mutable_alert() = ToProtoLocked(alert);
      event.set_from_state(std::string(alerts::AlertStateName(t.from)));
      event.set_to_state(std::string(alerts::AlertStateName(t.to)));
      event.set_step(t.step);
      for (auto& [id, watcher] : watchers_) {
        if (watcher.run.empty() || watcher.run == alert.run) watcher.subscriber(event);
      }
      if (event_log_) event_log_(event);
    }
  }
}

v1::Alert AlertHub::ToProtoLocked(const alerts::Alert& alert) const {
  v1::Alert out;
  out.set_alertname(alert.alertname);
  out.set_run(alert.run);
  out.set_layer(alert.layer);
  out.set_signal(alert.signal);
  out.set_severity(alert.severity);
  out.set_state(std::string(alerts::AlertStateName(alert.state)));
  for (const auto& [k, v] : alert.Labels()) (*out.mutable_labels())[k] = v;
  for (const auto& [k, v] : alert.Annotations()) (*out.mutable_annotations())[k] = v;
  out.set_summary(alert.summary);
  out.set_description(alert.description);
  out.set_probable_cause(alert.probable_cause);
  out.set_probable_cause_settled(alert.probable_cause_settled);
  out.set_probable_cause_evidence(alert.probable_cause_evidence);
  out.set_resolved_reason(alert.resolved_reason);
  out.set_attempt(alert.attempt);
  out.set_episode(alert.episode);
  out.set_pending_step(alert.pending_step);
  out.set_suggested_action(alert.suggested_action);
  out.set_first_step(alert.first_step);
  out.set_firing_step(alert.firing_step);
  out.set_resolved_step(alert.resolved_step);
  out.set_value(alert.value);
  out.set_baseline(alert.baseline);
  out.set_z(alert.z);
  auto it = times_.find(AlertKey(alert));
  if (it != times_.end()) {
    out.set_starts_at_unix_ms(it->second.starts_ms);
    out.set_ends_at_unix_ms(it->second.ends_ms);
  }
  return out;
}

void AlertHub::PruneTimesLocked() {
  std::set<std::string> listed;
  for (const std::string& run : alerted_runs_) {
    for (const alerts::Alert& alert : engine_.AllAlerts(run)) listed.insert(AlertKey(alert));
  }
  std::erase_if(times_, [&](const auto& entry) { return !listed.count(entry.first); });
  // Amortized: the next prune after as many new episodes again.
  times_prune_at_ = std::max<size_t>(4096, 2 * times_.size());
}

std::vector<v1::Alert> AlertHub::Alerts(const std::string& run, bool include_resolved) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<v1::Alert> out;
  if (include_resolved) {
    const std::vector<std::string> runs =
        run.empty() ? std::vector<std::string>(alerted_runs_.begin(), alerted_runs_.end())
                    : std::vector<std::string>{run};
    for (const std::string& r : runs)
      for (const alerts::Alert& alert : engine_.AllAlerts(r)) out.push_back(ToProtoLocked(alert));
  } else {
    for (const alerts::Alert& alert : engine_.ActiveAlerts())
      if (run.empty() || alert.run == run) out.push_back(ToProtoLocked(alert));
  }
  return out;
}

void AlertHub::ExportCounters() {
  std::lock_guard<std::mutex> lock(mu_);
  const alerts::AlertEngineCounters& now = engine_.counters();
  auto add = [&](std::string_view outcome, uint64_t current, uint64_t& exported) {
    metrics_.alert_points_total.Add({{"outcome", std::string(outcome)}})
        .Increment(static_cast<double>(current - exported));
    exported = current;
  };
  add(kAlertPointOutcomes[0], now.points_scored, exported_.points_scored);
  add(kAlertPointOutcomes[1], now.points_stale, exported_.points_stale);
  add(kAlertPointOutcomes[2], now.points_duplicate, exported_.points_duplicate);
  add(kAlertPointOutcomes[3], now.points_nonfinite, exported_.points_nonfinite);
  metrics_.alert_episodes_dropped_total.Add({}).Increment(
      static_cast<double>(now.episodes_dropped - exported_.episodes_dropped));
  exported_.episodes_dropped = now.episodes_dropped;
  metrics_.alert_episodes_kept.Add({}).Set(static_cast<double>(engine_.kept_episodes()));
  metrics_.alert_baseline_series.Add({}).Set(static_cast<double>(engine_.BaselineSeries()));
}

void AlertHub::SetKeptEpisodeLimit(size_t total) {
  std::lock_guard<std::mutex> lock(mu_);
  engine_.SetKeptEpisodeLimit(total);
}

uint64_t AlertHub::Subscribe(const std::string& run, bool send_active, Subscriber subscriber) {
  std::lock_guard<std::mutex> lock(mu_);
  if (send_active) {
    for (const alerts::Alert& alert : engine_.ActiveAlerts()) {
      if (!run.empty() && alert.run != run) continue;
      v1::AlertEvent event;
      *event.mutable_alert() = ToProtoLocked(alert);
      event.set_from_state(std::string(alerts::AlertStateName(alert.state)));
      event.set_to_state(std::string(alerts::AlertStateName(alert.state)));
      event.set_step(alert.firing_step >= 0 ? alert.firing_step : alert.first_step);
      subscriber(event);
    }
  }
  const uint64_t id = next_watcher_++;
  watchers_.emplace(id, Watcher{run, std::move(subscriber)});
  return id;
}

void AlertHub::CloseRunEpisodes(const std::string& run, std::string_view reason,
                                const alerts::LifecycleMark& mark) {
  std::lock_guard<std::mutex> lock(mu_);
  DeliverLocked(engine_.CloseEpisodes(run, reason));
  engine_.SetLifecycleMark(run, mark);
}

void AlertHub::RewindRun(const std::string& run, int64_t from_step,
                         const alerts::LifecycleMark& mark) {
  std::lock_guard<std::mutex> lock(mu_);
  DeliverLocked(engine_.RewindRun(run, from_step));
  engine_.SetLifecycleMark(run, mark);
}

void AlertHub::ForgetRun(const std::string& run) {
  std::lock_guard<std::mutex> lock(mu_);
  DeliverLocked(engine_.ReleaseBaselines(run));
  // Every episode is closed: the run's foreshock_alert_active series (all 0)
  // leave /metrics; its alerts stay listed.
  for (const alerts::Alert& alert : engine_.AllAlerts(run)) {
    const prometheus::Labels labels{{"alertname", alert.alertname}, {"run", alert.run},
                                    {"layer", alert.layer}, {"severity", alert.severity}};
    if (metrics_.alert_active.Has(labels)) {
      metrics_.alert_active.Remove(&metrics_.alert_active.Add(labels));
    }
  }
}

alerts::LifecycleMark AlertHub::GetLifecycleMark(const std::string& run) const {
  std::lock_guard<std::mutex> lock(mu_);
  return engine_.GetLifecycleMark(run);
}

void AlertHub::SetEventLog(std::function<void(const v1::AlertEvent&)> log) {
  std::lock_guard<std::mutex> lock(mu_);
  event_log_ = std::move(log);
}

namespace {
constexpr std::string_view kHubStateMagic = "FSHKHUB";
constexpr uint32_t kHubStateVersion = 2;  // 2: times per episode
}  // namespace

std::string AlertHub::SaveState() const {
  std::lock_guard<std::mutex> lock(mu_);
  codec::StateWriter out;
  out.PutHeader(kHubStateMagic, kHubStateVersion);
  out.PutBytes(engine_.SaveState());
  out.PutU64(times_.size());
  for (const auto& [key, times] : times_) {
    out.PutString(key);
    out.PutI64(times.starts_ms);
    out.PutI64(times.ends_ms);
  }
  out.PutU64(alerted_runs_.size());
  for (const std::string& run : alerted_runs_) out.PutString(run);
  return out.Take();
}

bool AlertHub::RestoreState(std::string_view bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  codec::StateReader in(bytes);
  std::string engine_state;
  uint64_t n = 0;
  std::map<std::string, Times> times;
  std::set<std::string> runs;
  uint32_t version = 0;
  bool ok = in.GetHeader(kHubStateMagic, 1, kHubStateVersion, version) &&
            in.GetBytes(engine_state) && in.GetCount(n, 20);
  for (uint64_t i = 0; ok && i < n; ++i) {
    std::string key;
    Times t;
    ok = in.GetString(key) && in.GetI64(t.starts_ms) && in.GetI64(t.ends_ms);
    if (ok) times.emplace(std::move(key), t);
  }
  ok = ok && in.GetCount(n, 4);
  for (uint64_t i = 0; ok && i < n; ++i) {
    std::string run;
    ok = in.GetString(run);
    if (ok) runs.insert(std::move(run));
  }
  if (!ok || !engine_.RestoreState(engine_state)) return false;
  if (version == 1) {
    // Per alert then: they belong to each alert's latest episode.
    std::map<std::string, Times> by_episode;
    for (const std::string& run : runs) {
      for (const alerts::Alert& alert : engine_.AllAlerts(run)) {
        const auto it = times.find(AlertKeyV1(alert));
        if (it != times.end()) by_episode[AlertKey(alert)] = it->second;
      }
    }
    times = std::move(by_episode);
  }
  times_ = std::move(times);
  alerted_runs_ = std::move(runs);
  // The point counters are this process's (Prometheus counters restart at 0).
  exported_ = engine_.counters();
  // The gauge as the previous process left it: 1 for a firing alert, 0 for
  // every other one it had exported (pending, resolved), so no series goes
  // missing across a restart.
  for (const std::string& run : alerted_runs_) {
    for (const alerts::Alert& alert : engine_.AllAlerts(run)) {
      metrics_.alert_active
          .Add({{"alertname", alert.alertname}, {"run", alert.run}, {"layer", alert.layer},
                {"severity", alert.severity}})
          .Set(alert.state == alerts::AlertState::kFiring ? 1.0 : 0.0);
    }
  }
  // Announce what fires again to Alertmanager (re-sent from now on).
  for (const alerts::Alert& alert : engine_.ActiveAlerts()) {
    if (notifier_ && alert.state == alerts::AlertState::kFiring) {
      AlertmanagerAlert out;
      out.labels = alert.Labels();
      out.annotations = alert.Annotations();
      out.starts_at_ms = times_[AlertKey(alert)].starts_ms;
      notifier_->Notify(std::move(out));
    }
  }
  return true;
}

void AlertHub::Unsubscribe(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  watchers_.erase(id);
}

}  // namespace foreshock::server
