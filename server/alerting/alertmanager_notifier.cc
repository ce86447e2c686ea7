#include "server/alerting/alertmanager_notifier.h"

#include <curl/curl.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <ctime>
#include <nlohmann/json.hpp>

#include "server/alerting/alertmanager_url.h"
#include "server/common/clock.h"

namespace foreshock::server {
namespace {


// RFC 3339 in UTC with milliseconds, as Alertmanager expects.
std::string Rfc3339(int64_t unix_ms) {
  const std::time_t seconds = static_cast<std::time_t>(unix_ms / 1000);
  std::tm utc{};
  gmtime_r(&seconds, &utc);
  char buffer[40];
  const size_t n = std::strftime(buffer, sizeof(buffer), "%Y-%m-%dT%H:%M:%S", &utc);
  std::snprintf(buffer + n, sizeof(buffer) - n, ".%03dZ", static_cast<int>(unix_ms % 1000));
  return buffer;
}

size_t DiscardBody(char*, size_t size, size_t count, void*) { return size * count; }

}  // namespace

AlertmanagerNotifier::AlertmanagerNotifier(AlertmanagerOptions options, DaemonMetrics& metrics)
    : options_(std::move(options)),
      log_url_(RedactUrlUserinfo(options_.url)),
      metrics_(metrics) {
  curl_global_init(CURL_GLOBAL_DEFAULT);
  metrics_.alertmanager_dropped_total.Add({});
  thread_ = std::thread([this] { Run(); });
}

AlertmanagerNotifier::~AlertmanagerNotifier() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

std::string AlertmanagerNotifier::Fingerprint(const AlertmanagerAlert& alert) {
  std::string key;
  for (const auto& [name, value] : alert.labels) {
    if (name == "signal") continue;  // an episode may be reopened by another signal
    key += name + '\x1f' + value + '\x1e';
  }
  return key;
}

void AlertmanagerNotifier::Notify(AlertmanagerAlert alert) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    const std::string key = Fingerprint(alert);
    auto it = alerts_.find(key);
    if (it == alerts_.end() && alerts_.size() >= options_.max_alerts) {
      metrics_.alertmanager_dropped_total.Add({}).Increment();
      spdlog::error("alertmanager: {} alerts already waiting; dropping one (counted in "
                    "foreshock_alertmanager_dropped_total)", alerts_.size());
      return;
    }
    alerts_[key] = Tracked{std::move(alert), true};
    metrics_.alertmanager_tracked_alerts.Add({}).Set(static_cast<double>(alerts_.size()));
  }
  wake_.notify_all();
}

bool AlertmanagerNotifier::WaitDelivered(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return delivered_.wait_for(lock, timeout, [this] {
    for (const auto& [key, tracked] : alerts_)
      if (tracked.dirty) return false;
    return true;
  });
}

std::string AlertmanagerNotifier::RenderBody(const std::vector<AlertmanagerAlert>& alerts,
                                             int64_t now_ms) const {
  nlohmann::json body = nlohmann::json::array();
  for (const AlertmanagerAlert& alert : alerts) {
    nlohmann::json labels = nlohmann::json::object(), annotations = nlohmann::json::object();
    for (const auto& [k, v] : alert.labels) labels[k] = v;
    for (const auto& [k, v] : alert.annotations) annotations[k] = v;
    const int64_t ends = alert.ends_at_ms > 0
                             ? alert.ends_at_ms
                             : now_ms + 3 * static_cast<int64_t>(options_.resend_interval.count());
    body.push_back({{"labels", labels},
                    {"annotations", annotations},
                    {"startsAt", Rfc3339(alert.starts_at_ms)},
                    {"endsAt", Rfc3339(ends)},
                    {"generatorURL", options_.generator_url}});
  }
  return body.dump();
}

bool AlertmanagerNotifier::Post(const std::string& body, std::string* error) {
  CURL* curl = curl_easy_init();
  if (curl == nullptr) {
    *error = "curl_easy_init failed";
    return false;
  }
  const std::string url = options_.url + "/api/v2/alerts";
  curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(curl, CURLOPT_POSTFIELDS, body.c_str());
  curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE, static_cast<long>(body.size()));
  curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, static_cast<long>(options_.request_timeout.count()));
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, DiscardBody);
  const CURLcode code = curl_easy_perform(curl);
  long status = 0;
  curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &status);
  curl_slist_free_all(headers);
  curl_easy_cleanup(curl);
  if (code != CURLE_OK) {
    *error = curl_easy_strerror(code);
    return false;
  }
  if (status < 200 || status >= 300) {
    *error = "HTTP " + std::to_string(status);
    return false;
  }
  return true;
}

void AlertmanagerNotifier::Run() {
  using Clock = std::chrono::steady_clock;
  auto backoff = std::chrono::milliseconds(500);
  Clock::time_point last_sent = Clock::now();
  Clock::time_point next_attempt = Clock::now();
  bool failing = false;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    auto has_dirty = [this] {
      for (const auto& [key, tracked] : alerts_)
        if (tracked.dirty) return true;
      return false;
    };
    const Clock::time_point resend_at = last_sent + options_.resend_interval;
    Clock::time_point wake_at = Clock::time_point::max();  // nothing to do: wait for Notify
    if (failing) {
      wake_at = next_attempt;
    } else if (has_dirty()) {
      wake_at = Clock::now();
    } else if (!alerts_.empty()) {
      wake_at = resend_at;
    }
    auto woken = [&] { return stopping_ || (!failing && has_dirty()); };
    if (wake_at == Clock::time_point::max()) {
      wake_.wait(lock, woken);
    } else {
      wake_.wait_until(lock, wake_at, woken);
    }
    const bool due = has_dirty() || (!alerts_.empty() && Clock::now() >= resend_at);
    if (!due && stopping_) break;
    if (!due || (failing && Clock::now() < next_attempt && !stopping_)) continue;

    std::vector<AlertmanagerAlert> batch;
    for (const auto& [key, tracked] : alerts_) batch.push_back(tracked.alert);
    const std::string body = RenderBody(batch, NowUnixMillis());
    lock.unlock();
    std::string error;
    const bool ok = Post(body, &error);
    lock.lock();
    metrics_.alertmanager_posts_total.Add({{"result", ok ? "ok" : "error"}}).Increment();
    if (ok) {
      // Alerts sent resolved are done; firing ones stay for the next re-send.
      // An alert changed while the POST was in flight stays dirty.
      for (auto it = alerts_.begin(); it != alerts_.end();) {
        const bool sent_as_is = std::any_of(batch.begin(), batch.end(), [&](const auto& a) {
          return Fingerprint(a) == it->first && a.ends_at_ms == it->second.alert.ends_at_ms &&
                 a.annotations == it->second.alert.annotations;
        });
        if (sent_as_is) it->second.dirty = false;
        if (sent_as_is && it->second.alert.ends_at_ms > 0) {
          it = alerts_.erase(it);
        } else {
          ++it;
        }
      }
      metrics_.alertmanager_tracked_alerts.Add({}).Set(static_cast<double>(alerts_.size()));
      if (failing) spdlog::info("alertmanager: delivering again to {}", log_url_);
      failing = false;
      backoff = std::chrono::milliseconds(500);
      last_sent = Clock::now();
      delivered_.notify_all();
    } else {
      if (!failing) spdlog::warn("alertmanager: POST {}/api/v2/alerts failed: {}; retrying with backoff",
                                 log_url_, error);
      failing = true;
      next_attempt = Clock::now() + backoff;
      backoff = std::min(backoff * 2, options_.max_backoff);
      if (stopping_) break;  // one last attempt was made
    }
    if (stopping_ && !has_dirty()) break;
  }
}

}  // namespace foreshock::server
