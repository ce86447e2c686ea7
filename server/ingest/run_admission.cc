// IngestService's admission of runs, ranks and tenants across streams:
// --max_runs and its per-tenant share, rank ownership and takeover, the
// per-run probe ids and highest step, late joiners, and the per-tenant
// stream count (docs/OPERATIONS.md).
#include <algorithm>
#include <chrono>
#include <mutex>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "server/ingest/ingest_reactor.h"
#include "server/ingest/ingest_service.h"

namespace foreshock::server {

std::string IngestService::RunTenantOfJob(const std::string& job) {
  return absl::StrCat("job '", job, "'");
}

std::string IngestService::ReleaseRule() const {
  using std::chrono::duration_cast;
  using std::chrono::seconds;
  return absl::StrCat("A run stops counting once it has no stream open for ",
                      duration_cast<seconds>(limits_.empty_run_release).count(),
                      " s without a sample stored, or for ",
                      duration_cast<seconds>(limits_.forget_runs_idle).count(),
                      " s (--forget_runs_idle_s)");
}

std::optional<wire::Rejection> IngestService::AdmitRun(const std::string& run_id,
                                                 const std::string& tenant,
                                                 std::string& counted_in) {
  std::lock_guard<std::mutex> lock(runs_mu_);
  const auto now = std::chrono::steady_clock::now();
  if (auto it = runs_.find(run_id); it != runs_.end()) {
    ++it->second.open_streams;
    it->second.last_seen = now;
    if (it->second.tenant.empty()) it->second.tenant = tenant;
    counted_in = it->second.tenant;
    return std::nullopt;
  }
  auto tenant_runs = [&] {
    return std::count_if(runs_.begin(), runs_.end(),
                         [&](const auto& entry) { return entry.second.tenant == tenant; });
  };
  const bool total_full =
      limits_.max_runs > 0 && static_cast<int64_t>(runs_.size()) >= limits_.max_runs;
  if (total_full || (tenant_run_limit_ > 0 && tenant_runs() >= tenant_run_limit_)) {
    PruneRunsLocked(now);
  }
  // The tenant's share first: a tenant at its share is told so, whatever the total.
  if (tenant_run_limit_ > 0) {
    if (const int64_t held = tenant_runs(); held >= tenant_run_limit_) {
      return wire::Rejection{reason::kTooManyRunsForTenant,
                       absl::StrCat(tenant, " already has ", held, " runs (--max_runs_per_tenant=",
                                    tenant_run_limit_, "); run '", run_id,
                                    "' is refused. ", ReleaseRule())};
    }
  }
  if (limits_.max_runs > 0 && static_cast<int64_t>(runs_.size()) >= limits_.max_runs) {
    return wire::Rejection{reason::kTooManyRuns,
                     absl::StrCat("the daemon already serves ", limits_.max_runs,
                                  " runs (--max_runs); run '", run_id,
                                  "' is refused. ", ReleaseRule())};
  }
  RunSlot slot;
  slot.open_streams = 1;
  slot.last_seen = now;
  slot.tenant = tenant;
  counted_in = tenant;
  runs_.emplace(run_id, std::move(slot));
  return std::nullopt;
}

void IngestService::ReleaseRun(const std::string& run_id) {
  std::lock_guard<std::mutex> lock(runs_mu_);
  if (auto it = runs_.find(run_id); it != runs_.end()) {
    it->second.open_streams = std::max(0, it->second.open_streams - 1);
    it->second.last_seen = std::chrono::steady_clock::now();
  }
}

void IngestService::PruneRunsLocked(std::chrono::steady_clock::time_point now) {
  std::erase_if(runs_, [&](const auto& entry) {
    const RunSlot& run = entry.second;
    if (run.open_streams > 0) return false;
    const auto idle = now - run.last_seen;
    return (run.max_step < 0 && idle >= limits_.empty_run_release) ||
           idle >= limits_.forget_runs_idle;
  });
}

void IngestService::OnRunForgotten(const std::string& run_id) {
  std::lock_guard<std::mutex> lock(runs_mu_);
  if (auto it = runs_.find(run_id); it != runs_.end() && it->second.open_streams == 0) {
    runs_.erase(it);
  }
}

std::optional<std::string> IngestService::ClaimRank(IngestReactor* stream,
                                                    const std::string& run_id, int32_t rank,
                                                    uint64_t sender, const std::string& grant,
                                                    std::vector<RevokedSender>& revoked) {
  std::lock_guard<std::mutex> lock(ranks_mu_);
  const auto now = std::chrono::steady_clock::now();
  const auto key = std::make_pair(run_id, rank);
  auto it = rank_holders_.find(key);
  if (it != rank_holders_.end()) {
    RankHolder& holder = it->second;
    const std::optional<std::chrono::steady_clock::time_point> active = holder.stream->ActiveAt(now);
    const bool live = active && now - *active < limits_.rank_takeover_grace;
    if (live && (holder.sender != sender || holder.grant != grant)) {
      const int64_t idle_ms =
          std::chrono::duration_cast<std::chrono::milliseconds>(now - *active).count();
      return absl::StrCat("rank ", rank, " of run '", run_id,
                          "' is held by another sender's open stream (last active ", idle_ms,
                          " ms ago); it is free once that stream ends or is idle for ",
                          limits_.rank_takeover_grace.count(),
                          " ms (--rank_takeover_grace_ms). Two processes with one rank, or a "
                          "restarted process whose predecessor's connection has not ended yet");
    }
    // The holder's own reconnect, or a holder that is gone: the rank changes hands.
    const bool new_sender = holder.sender != sender || holder.grant != grant;
    if (auto closed = holder.stream->Revoke()) revoked.push_back(*closed);
    // A new process after the holder's host vanished: the run's other holders
    // idle past the grace are gone too (the whole job restarted).
    for (auto& [other_key, other] : rank_holders_) {
      if (!new_sender) break;
      if (other_key.first != run_id || other_key.second == rank) continue;
      const auto other_active = other.stream->ActiveAt(now);
      if (other_active && now - *other_active < limits_.rank_takeover_grace) continue;
      if (auto closed = other.stream->Revoke()) revoked.push_back(*closed);
    }
  }
  rank_holders_[key] = RankHolder{stream, sender, grant};
  return std::nullopt;
}

void IngestService::ReleaseRank(IngestReactor* stream, const std::string& run_id, int32_t rank) {
  std::lock_guard<std::mutex> lock(ranks_mu_);
  auto it = rank_holders_.find({run_id, rank});
  if (it != rank_holders_.end() && it->second.stream == stream) rank_holders_.erase(it);
}

bool IngestService::AdmitProbeId(const std::string& run_id, const std::string& probe_id) {
  if (limits_.max_probe_ids_per_run <= 0) return true;
  std::lock_guard<std::mutex> lock(runs_mu_);
  std::unordered_set<std::string>& ids = runs_[run_id].probe_ids;
  if (ids.count(probe_id)) return true;
  if (static_cast<int64_t>(ids.size()) >= limits_.max_probe_ids_per_run) return false;
  ids.insert(probe_id);
  return true;
}

void IngestService::NoteKnownRun(const std::string& run_id, int64_t last_step,
                                 const std::string& job, const std::string& tenant) {
  std::lock_guard<std::mutex> lock(runs_mu_);
  auto [it, _] = runs_.try_emplace(run_id, RunSlot{0, std::chrono::steady_clock::now(), {}});
  it->second.max_step = std::max(it->second.max_step, last_step);
  if (!it->second.tenant.empty()) return;
  // The tenant stored with the run (its lifecycle); for runs from before it
  // was stored, without tokens, the job of a recovered Hello.
  if (!tenant.empty()) {
    it->second.tenant = tenant;
  } else if (authorizer_ == nullptr && !job.empty()) {
    it->second.tenant = RunTenantOfJob(job);
  }
}

int64_t IngestService::RunMaxStep(const std::string& run_id) {
  std::lock_guard<std::mutex> lock(runs_mu_);
  auto it = runs_.find(run_id);
  return it == runs_.end() ? -1 : it->second.max_step;
}

void IngestService::NoteStep(const std::string& run_id, int64_t step, bool established) {
  std::lock_guard<std::mutex> lock(runs_mu_);
  RunSlot& slot = runs_[run_id];
  slot.max_step = std::max(slot.max_step, step);
  if (established) slot.established_max_step = std::max(slot.established_max_step, step);
}

std::optional<wire::Rejection> IngestService::AdmitLateJoinerStep(const std::string& run_id,
                                                            int32_t rank, int64_t step,
                                                            bool& established) {
  std::lock_guard<std::mutex> lock(runs_mu_);
  RunSlot& slot = runs_[run_id];
  RunSlot::RankHistory& own = slot.rank_history[rank];
  if (own.steps < kLateJoinSteps && slot.established_max_step >= 0 &&
      step > slot.established_max_step + kLateJoinLeadSteps) {
    return wire::Rejection{reason::kStepAheadOfRun,
                     absl::StrCat("step ", step, " of rank ", rank, " is more than ",
                                  kLateJoinLeadSteps, " beyond run '", run_id, "' (at step ",
                                  slot.established_max_step, ") while the rank has ", own.steps,
                                  " of the ", kLateJoinSteps,
                                  " steps of its own a rank joining a live run needs first")};
  }
  if (step > own.last_step) {
    own.last_step = step;
    ++own.steps;
  }
  if (own.steps >= kLateJoinSteps) {
    established = true;
    slot.established_max_step = std::max(slot.established_max_step, own.last_step);
  }
  return std::nullopt;
}

bool IngestService::AcquireTenant(const std::string& tenant) {
  if (tenant_limit_ <= 0) return true;
  std::lock_guard<std::mutex> lock(tenants_mu_);
  int64_t& open = tenant_streams_[tenant];
  if (open >= tenant_limit_) {
    if (open == 0) tenant_streams_.erase(tenant);
    return false;
  }
  ++open;
  return true;
}

void IngestService::ReleaseTenant(const std::string& tenant) {
  if (tenant_limit_ <= 0) return;
  std::lock_guard<std::mutex> lock(tenants_mu_);
  auto it = tenant_streams_.find(tenant);
  if (it != tenant_streams_.end() && --it->second <= 0) tenant_streams_.erase(it);
}

}  // namespace foreshock::server
