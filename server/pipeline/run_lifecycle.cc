#include "server/pipeline/run_lifecycle.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "codec/state_codec.h"
#include "server/common/clock.h"
#include "server/pipeline/run_tracker.h"

namespace foreshock::server {

namespace {
constexpr std::string_view kStateMagic = "FSLC";
// v2: the run's tenant (events and checkpoint). v3: the declared world size
// (joins, checkpoint) and which senders sent records. Older ones are read.
constexpr uint32_t kStateVersion = 3;
constexpr uint8_t kEventVersion = 3;
}  // namespace

RunLifecycle::RunLifecycle(SeriesStore* store, RunAlertEffects* alerts, RunTracker* runs)
    : store_(store), alerts_(alerts), tracker_(runs) {}

void RunLifecycle::RestartedForOwners(const std::string& run) const {
  for (RunStateOwner* owner : owners_) owner->OnRunRestarted(run);
}

void RunLifecycle::EndedForOwners(const std::string& run) const {
  for (RunStateOwner* owner : owners_) owner->OnRunEnded(run);
}

void RunLifecycle::ForgottenForOwners(const std::string& run) const {
  for (RunStateOwner* owner : owners_) owner->OnRunForgotten(run);
}

void RunLifecycle::Touch(Run& run) {
  run.active_ms = NowUnixMillis();
  run.forgotten = false;
}

// ---------------------------------------------------------------------------
// Events: U8 version, U8 type, U64 seq, String run, I32 attempt, I32 rank,
// U64 sender, I64 step, I64 wall_ms, from v2 String tenant, from v3 I32
// world_size (codec, codec/state_codec.h).

// An event's fields after its version and type, listed once for Encode and
// Decode; `version` says which fields an older event has (2 added the tenant,
// 3 the world size).
template <typename Io, typename E>
bool EventFields(Io& io, E& e, uint8_t version) {
  return io(e.seq) && io(e.run) && io(e.attempt) && io(e.rank) && io(e.sender) && io(e.step) &&
         io(e.wall_ms) && (version < 2 || io(e.tenant)) && (version < 3 || io(e.world_size));
}

std::string RunLifecycle::Encode(const Event& e) {
  codec::StateWriter w;
  w.PutU8(kEventVersion);
  w.PutU8(static_cast<uint8_t>(e.type));
  codec::FieldWriter io(w);
  EventFields(io, e, kEventVersion);
  return w.Take();
}

std::optional<RunLifecycle::Event> RunLifecycle::Decode(std::string_view bytes) {
  codec::StateReader r(bytes);
  Event e;
  uint8_t version = 0, type = 0;
  codec::FieldReader io(r);
  if (!r.GetU8(version) || version < 1 || version > kEventVersion || !r.GetU8(type) ||
      !EventFields(io, e, version) || !r.ExpectEnd()) {
    return std::nullopt;
  }
  if (type < static_cast<uint8_t>(EventType::kJoin) || type > static_cast<uint8_t>(EventType::kSent)) {
    return std::nullopt;
  }
  e.type = static_cast<EventType>(type);
  return e;
}

// The state change of one event; the same live and when replayed.
void RunLifecycle::Apply(std::map<std::string, Run, std::less<>>& runs, const Event& e) {
  Run& run = runs[e.run];
  switch (e.type) {
    case EventType::kAttempt:
      if (e.attempt <= run.attempt) return;
      run.attempt = e.attempt;
      run.senders.clear();
      run.world_size = -1;  // the new attempt's first Hello declares it
      run.rewind_pending = true;
      run.ended = false;
      run.ended_ms = 0;
      run.ended_step = -1;
      return;
    case EventType::kJoin:
      if (e.attempt != run.attempt) return;
      run.senders.try_emplace({e.rank, e.sender});
      if (run.world_size < 0 && e.world_size >= 0) run.world_size = e.world_size;
      return;
    case EventType::kRankResume:
      // The rank's new process replaces its predecessors in the attempt.
      if (e.attempt != run.attempt) return;
      std::erase_if(run.senders, [&](const auto& entry) {
        return entry.first.first == e.rank && entry.first.second != e.sender;
      });
      run.senders.try_emplace({e.rank, e.sender});
      if (run.world_size < 0 && e.world_size >= 0) run.world_size = e.world_size;
      return;
    case EventType::kSent:
      if (e.attempt == run.attempt) run.senders[{e.rank, e.sender}].sent = true;
      return;
    case EventType::kGoodbye:
      if (e.attempt == run.attempt) run.senders[{e.rank, e.sender}].goodbye = true;
      return;
    case EventType::kRewind:
      if (e.attempt != run.attempt || !run.rewind_pending) return;
      run.rewind_pending = false;
      run.boundaries.push_back(Boundary{e.attempt, e.step, e.wall_ms});
      return;
    case EventType::kEnd:
      if (e.attempt != run.attempt) return;
      run.ended = true;
      run.ended_ms = e.wall_ms;
      run.ended_step = e.step;
      return;
    case EventType::kTenant:
      if (run.tenant.empty()) run.tenant = e.tenant;
      return;
  }
}

void RunLifecycle::RecordLocked(Event event) {
  event.seq = next_seq_++;
  if (store_ != nullptr) {
    // Logged before it takes effect; a failed write is reported, and the
    // next checkpoint still carries the change.
    if (absl::Status status = store_->AppendEvent(kEventKind, Encode(event)); !status.ok()) {
      spdlog::warn("run {}: could not log a lifecycle event: {}", event.run,
                   std::string(status.message()));
    }
  }
  Apply(runs_, event);
  ++events_since_checkpoint_;
}

alerts::LifecycleMark RunLifecycle::MarkOf(const Run& run) {
  alerts::LifecycleMark mark;
  mark.attempt = run.attempt;
  if (!run.boundaries.empty() && run.boundaries.back().attempt == run.attempt) {
    mark.rewound_to = run.boundaries.back().from_step;
  }
  mark.ended = run.ended;
  return mark;
}

// ---------------------------------------------------------------------------
// Ingest.

RunLifecycle::HelloKind RunLifecycle::Classify(const Run& run, int32_t rank, uint64_t sender) {
  if (run.senders.contains({rank, sender})) return HelloKind::kReconnect;
  // The rank's previous process is gone if none of its senders has a stream
  // open or said goodbye; the run's other ranks are there if one of theirs has.
  bool rank_known = false, rank_alive = false, others_alive = false;
  for (const auto& [k, s] : run.senders) {
    const bool alive = s.open > 0 || s.goodbye;
    if (k.first == rank) {
      rank_known = true;
      rank_alive |= alive;
    } else {
      others_alive |= alive;
    }
  }
  const bool rank_restarted = sender != 0 && rank_known && !rank_alive;
  // A new attempt of the whole run: after its end, or when every process of
  // the attempt is gone (the job restarted; a one-rank job is the usual
  // case). One rank's new process while the others stream on resumes that
  // rank only: the run's alerts, detectors and series stay as they are.
  if (run.ended || (rank_restarted && !others_alive)) return HelloKind::kNewAttempt;
  return rank_restarted ? HelloKind::kRankResume : HelloKind::kJoin;
}

std::optional<std::string> RunLifecycle::WorldSizeConflict(const std::string& run_id,
                                                           int32_t rank, uint64_t sender,
                                                           int32_t world_size) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = runs_.find(run_id);
  if (it == runs_.end()) return std::nullopt;
  const Run& run = it->second;
  if (run.world_size < 0 || Classify(run, rank, sender) == HelloKind::kNewAttempt) {
    return std::nullopt;
  }
  // A label of 1 is the same as none: the end waits for ranks only above 1.
  if (world_size > std::max(run.world_size, 1)) {
    return absl::StrCat("the Hello of rank ", rank, " says world_size ", world_size,
                        ", but attempt ", run.attempt, " of run '", run_id,
                        "' declared world_size ", run.world_size,
                        " with its first Hello; a later Hello cannot raise it (a second client "
                        "of the run, or two jobs under one run_id)");
  }
  if (run.world_size > 0 && rank >= run.world_size) {
    return absl::StrCat("rank ", rank, " is outside the world_size ", run.world_size,
                        " that attempt ", run.attempt, " of run '", run_id,
                        "' declared with its first Hello");
  }
  return std::nullopt;
}

void RunLifecycle::OnHello(const std::string& run_id, int32_t rank, uint64_t sender,
                           int32_t world_size, const std::string& tenant) {
  std::lock_guard<std::mutex> lock(mu_);
  Run& run = runs_[run_id];
  Touch(run);
  if (run.tenant.empty() && !tenant.empty()) {
    Event event{EventType::kTenant, 0, run_id, run.attempt, rank, sender, 0, NowUnixMillis()};
    event.tenant = tenant;
    RecordLocked(std::move(event));
  }
  const std::pair<int32_t, uint64_t> key{rank, sender};
  auto join = [&](EventType type) {
    Event event{type, 0, run_id, run.attempt, rank, sender, 0, NowUnixMillis()};
    event.world_size = world_size;  // declares it if this is the attempt's first Hello
    RecordLocked(std::move(event));
  };
  switch (Classify(run, rank, sender)) {
    case HelloKind::kReconnect:
      ++run.senders[key].open;  // a reconnect (or a resent goodbye): nothing changes
      // State from before the world size was stored: the job's own Hello says it again.
      if (run.world_size < 0) run.world_size = world_size;
      return;
    case HelloKind::kNewAttempt: {
      const bool was_ended = run.ended;
      RecordLocked(Event{EventType::kAttempt, 0, run_id, run.attempt + 1, rank, sender, 0,
                         NowUnixMillis()});
      spdlog::info("run {}: attempt {} starts ({} of rank {}); {}", run_id, run.attempt,
                   was_ended ? "a new stream after the run ended" : "a new process", rank,
                   was_ended ? "its alerts were resolved at the end"
                             : "the previous attempt's open alerts resolve (run_resumed)");
      if (alerts_ != nullptr) {
        alerts_->CloseRunEpisodes(run_id, alerts::kRunResumed, MarkOf(run));
      }
      join(EventType::kJoin);
      break;
    }
    case HelloKind::kRankResume:
      join(EventType::kRankResume);
      spdlog::info("run {}: rank {} resumes with a new process (sender {}) while other ranks "
                   "stream on; the run's attempt {}, its alerts and its series are unchanged",
                   run_id, rank, sender, run.attempt);
      break;
    case HelloKind::kJoin:
      join(EventType::kJoin);
      break;
  }
  run.senders[key].open = 1;
  MaybeCheckpointLocked();
}

void RunLifecycle::OnStreamClosed(const std::string& run_id, int32_t rank, uint64_t sender) {
  std::lock_guard<std::mutex> lock(mu_);
  auto run = runs_.find(run_id);
  if (run == runs_.end()) return;
  run->second.active_ms = NowUnixMillis();
  auto it = run->second.senders.find({rank, sender});
  if (it != run->second.senders.end() && it->second.open > 0) --it->second.open;
}

void RunLifecycle::BeforeRecords(const std::string& run_id, int32_t rank, uint64_t sender,
                                 int64_t min_step, int64_t /*max_step*/) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = runs_.find(run_id);
  if (it == runs_.end()) return;
  Run& run = it->second;
  Touch(run);
  if (auto sender_it = run.senders.find({rank, sender});
      sender_it == run.senders.end() || !sender_it->second.sent) {
    RecordLocked(Event{EventType::kSent, 0, run_id, run.attempt, rank, sender, 0, NowUnixMillis()});
    MaybeCheckpointLocked();
  }
  if (!run.rewind_pending) return;
  const int64_t wall_ms = NowUnixMillis();
  RecordLocked(Event{EventType::kRewind, 0, run_id, run.attempt, 0, 0, min_step, wall_ms});
  spdlog::info("run {}: attempt {} resumes at step {}; earlier attempts' points from that step "
               "on are superseded",
               run_id, run.attempt, min_step);
  RestartedForOwners(run_id);
  if (alerts_ != nullptr) alerts_->RewindRun(run_id, min_step, MarkOf(run));
  if (tracker_ != nullptr && tracker_->LastStep(run_id) >= min_step) {
    tracker_->ResetLastStep(run_id, min_step - 1);
  }
  // LatestAttempt tells the attempts apart by the wall time points are stored
  // with (NowUnixMillis when processed): the new attempt's must come after
  // wall_ms. A millisecond at most, once per attempt.
  while (NowUnixMillis() <= wall_ms) std::this_thread::sleep_for(std::chrono::microseconds(200));
  MaybeCheckpointLocked();
}

void RunLifecycle::OnGoodbye(const std::string& run_id, int32_t rank, uint64_t sender) {
  std::lock_guard<std::mutex> lock(mu_);
  Run& run = runs_[run_id];
  Touch(run);
  const std::pair<int32_t, uint64_t> key{rank, sender};
  auto it = run.senders.find(key);
  if (it != run.senders.end() && it->second.goodbye) return;  // a resend
  if (it == run.senders.end()) {
    // Its Hello predates what this daemon remembers (a lost event): count it now.
    RecordLocked(Event{EventType::kJoin, 0, run_id, run.attempt, rank, sender, 0, NowUnixMillis()});
  }
  RecordLocked(Event{EventType::kGoodbye, 0, run_id, run.attempt, rank, sender, 0, NowUnixMillis()});
  // Done: every sender that sent records said goodbye (one that only said
  // Hello is not waited for), and with a declared world size, that many ranks did.
  bool all_done = std::none_of(run.senders.begin(), run.senders.end(), [](const auto& entry) {
    return entry.second.sent && !entry.second.goodbye;
  });
  if (all_done && run.world_size > 1) {
    std::set<int32_t> ranks_done;
    for (const auto& [k, s] : run.senders) {
      if (s.goodbye) ranks_done.insert(k.first);
    }
    all_done = static_cast<int32_t>(ranks_done.size()) >= run.world_size;
  }
  if (all_done && !run.ended) {
    const int64_t last_step = tracker_ != nullptr ? tracker_->LastStep(run_id) : -1;
    RecordLocked(Event{EventType::kEnd, 0, run_id, run.attempt, rank, sender, last_step,
                       NowUnixMillis()});
    spdlog::info("run {} ended at step {}: every sender of attempt {} said goodbye; its open "
                 "alerts resolve (run_ended)",
                 run_id, last_step, run.attempt);
    if (alerts_ != nullptr) alerts_->CloseRunEpisodes(run_id, alerts::kRunEnded, MarkOf(run));
    // Every sample of the attempt is processed (each goodbye counts after
    // its sender's batches): its detector state has no further use (a new
    // attempt starts afresh), so it is freed now, not held for a day.
    EndedForOwners(run_id);
  }
  MaybeCheckpointLocked();
}

// ---------------------------------------------------------------------------
// Forgetting.

std::vector<std::string> RunLifecycle::ForgetIdleRuns(int64_t now_ms, int64_t idle_ms) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> forgotten;
  for (auto& [name, run] : runs_) {
    if (run.forgotten || now_ms - run.active_ms < idle_ms) continue;
    const bool streaming = std::any_of(run.senders.begin(), run.senders.end(),
                                       [](const auto& entry) { return entry.second.open > 0; });
    if (streaming) continue;
    run.forgotten = true;
    spdlog::info("run {} is forgotten: {} and no stream for {} s; its baselines and detector "
                 "state are dropped (stored points and alert records stay){}",
                 name, run.ended ? "ended" : "not ended", (now_ms - run.active_ms) / 1000,
                 run.ended ? "" : ", open alerts resolve (run_idle)");
    if (alerts_ != nullptr) alerts_->ForgetRun(name);
    ForgottenForOwners(name);
    forgotten.push_back(name);
  }
  return forgotten;
}

bool RunLifecycle::IsForgotten(const std::string& run_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = runs_.find(run_id);
  return it != runs_.end() && it->second.forgotten;
}

// ---------------------------------------------------------------------------
// Query.

std::optional<RunLifecycle::Status> RunLifecycle::GetStatus(const std::string& run_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = runs_.find(run_id);
  if (it == runs_.end()) return std::nullopt;
  const Run& run = it->second;
  Status status;
  status.attempt = run.attempt;
  const alerts::LifecycleMark mark = MarkOf(run);
  status.attempt_start_step = mark.rewound_to;
  status.ended = run.ended;
  status.ended_ms = run.ended_ms;
  status.ended_step = run.ended_step;
  status.world_size = run.world_size;
  return status;
}

std::vector<RunLifecycle::Boundary> RunLifecycle::Boundaries(const std::string& run_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = runs_.find(run_id);
  return it == runs_.end() ? std::vector<Boundary>{} : it->second.boundaries;
}

std::string RunLifecycle::TenantOf(const std::string& run_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = runs_.find(run_id);
  return it == runs_.end() ? std::string() : it->second.tenant;
}

void RunLifecycle::LatestAttempt(std::vector<Point>& points,
                                 const std::vector<Boundary>& boundaries) {
  if (boundaries.empty()) return;
  std::erase_if(points, [&](const Point& p) {
    return std::any_of(boundaries.begin(), boundaries.end(), [&](const Boundary& b) {
      return p.step >= b.from_step && p.wall_time_ms <= b.wall_ms;
    });
  });
}

// ---------------------------------------------------------------------------
// Checkpoint: Header "FSLC" v2, U64 last event seq included, U64 runs, per
// run (by name): String name, I32 attempt, Bool rewind_pending, Bool ended,
// I64 ended_ms, I64 ended_step, U64 senders each (I32 rank, U64 sender, Bool
// goodbye, v3: Bool sent), U64 boundaries each (I32 attempt, I64 from_step,
// I64 wall_ms), v2: String tenant, v3: I32 world_size (-1: not declared).
// Read from v1 and v2, senders count as having sent records (they were
// waited for then) and no world size is declared.

std::string RunLifecycle::SaveState() const {
  std::lock_guard<std::mutex> lock(mu_);
  return SaveStateLocked();
}

std::string RunLifecycle::SaveStateLocked() const {
  codec::StateWriter w;
  w.PutHeader(kStateMagic, kStateVersion);
  w.PutU64(next_seq_ - 1);
  w.PutU64(runs_.size());
  for (const auto& [name, run] : runs_) {
    w.PutString(name);
    w.PutI32(run.attempt);
    w.PutBool(run.rewind_pending);
    w.PutBool(run.ended);
    w.PutI64(run.ended_ms);
    w.PutI64(run.ended_step);
    w.PutU64(run.senders.size());
    for (const auto& [key, sender] : run.senders) {
      w.PutI32(key.first);
      w.PutU64(key.second);
      w.PutBool(sender.goodbye);
      w.PutBool(sender.sent);
    }
    w.PutU64(run.boundaries.size());
    for (const Boundary& b : run.boundaries) {
      w.PutI32(b.attempt);
      w.PutI64(b.from_step);
      w.PutI64(b.wall_ms);
    }
    w.PutString(run.tenant);
    w.PutI32(run.world_size);
  }
  return w.Take();
}

bool RunLifecycle::LoadState(std::string_view bytes) {
  codec::StateReader r(bytes);
  std::map<std::string, Run, std::less<>> runs;
  uint32_t version = 0;
  uint64_t seq = 0, count = 0;
  bool ok = r.GetHeader(kStateMagic, 1, kStateVersion, version) && r.GetU64(seq) &&
            r.GetCount(count, 30);
  for (uint64_t i = 0; ok && i < count; ++i) {
    std::string name;
    Run run;
    uint64_t senders = 0, boundaries = 0;
    ok = r.GetString(name) && r.GetI32(run.attempt) && r.GetBool(run.rewind_pending) &&
         r.GetBool(run.ended) && r.GetI64(run.ended_ms) && r.GetI64(run.ended_step) &&
         r.GetCount(senders, 13);
    for (uint64_t j = 0; ok && j < senders; ++j) {
      int32_t rank = 0;
      uint64_t sender = 0;
      bool goodbye = false, sent = true;
      ok = r.GetI32(rank) && r.GetU64(sender) && r.GetBool(goodbye) &&
           (version < 3 || r.GetBool(sent));
      run.senders[{rank, sender}].goodbye = goodbye;
      run.senders[{rank, sender}].sent = sent;
    }
    ok = ok && r.GetCount(boundaries, 20);
    for (uint64_t j = 0; ok && j < boundaries; ++j) {
      Boundary b;
      ok = r.GetI32(b.attempt) && r.GetI64(b.from_step) && r.GetI64(b.wall_ms);
      run.boundaries.push_back(b);
    }
    ok = ok && (version < 2 || r.GetString(run.tenant));
    ok = ok && (version < 3 || r.GetI32(run.world_size));
    ok = ok && run.attempt >= 1 && runs.emplace(std::move(name), std::move(run)).second;
  }
  if (!ok || !r.ExpectEnd()) {
    spdlog::warn("the run lifecycle checkpoint is unusable ({}); rebuilding it from the event log",
                 r.error().empty() ? std::string("inconsistent") : r.error());
    return false;
  }
  runs_ = std::move(runs);
  checkpoint_seq_ = seq;
  next_seq_ = seq + 1;
  return true;
}

bool RunLifecycle::Checkpoint() {
  std::lock_guard<std::mutex> lock(mu_);
  if (store_ == nullptr) return true;
  const uint64_t seq = next_seq_ - 1;
  if (!store_->WriteCheckpoint(kCheckpointName, SaveStateLocked())) return false;
  checkpoint_seq_ = seq;
  events_since_checkpoint_ = 0;
  return true;
}

void RunLifecycle::MaybeCheckpointLocked() {
  // The store keeps only the newest events of a kind: checkpoint well before
  // the oldest one still needed could fall out.
  if (store_ == nullptr || events_since_checkpoint_ < kCheckpointEvery) return;
  if (store_->WriteCheckpoint(kCheckpointName, SaveStateLocked())) {
    checkpoint_seq_ = next_seq_ - 1;
    events_since_checkpoint_ = 0;
  }
}

void RunLifecycle::Restore() {
  std::lock_guard<std::mutex> lock(mu_);
  if (store_ == nullptr) return;
  if (auto blob = store_->ReadCheckpoint(kCheckpointName)) LoadState(*blob);
  const uint64_t from_checkpoint = checkpoint_seq_;
  uint64_t replayed = 0, oldest = 0;
  for (const std::string& bytes : store_->Events(kEventKind)) {
    std::optional<Event> event = Decode(bytes);
    if (!event) {
      spdlog::warn("skipping an unreadable run lifecycle event ({} bytes)", bytes.size());
      continue;
    }
    if (oldest == 0) oldest = event->seq;
    next_seq_ = std::max(next_seq_, event->seq + 1);
    if (event->seq <= from_checkpoint) continue;
    Apply(runs_, *event);
    ++replayed;
  }
  if (oldest > from_checkpoint + 1) {
    spdlog::warn("run lifecycle events {}..{} are no longer in the store; runs changed by them "
                 "may show an older state",
                 from_checkpoint + 1, oldest - 1);
  }
  events_since_checkpoint_ = static_cast<int>(replayed);

  // Bring the restored alert engine, detectors and run tracker up to date:
  // their checkpoints may predate changes the events carry.
  size_t reapplied = 0;
  const int64_t restored_ms = NowUnixMillis();
  for (auto& [name, run] : runs_) {
    // Idle time counts from the end, or (not stored) from now.
    run.active_ms = run.ended ? run.ended_ms : restored_ms;
    const alerts::LifecycleMark want = MarkOf(run);
    if (alerts_ != nullptr) {
      alerts::LifecycleMark have = alerts_->GetLifecycleMark(name);
      if (want.attempt > have.attempt) {
        RestartedForOwners(name);
        have = alerts::LifecycleMark{want.attempt, -1, false};
        alerts_->CloseRunEpisodes(name, alerts::kRunResumed, have);
        ++reapplied;
      }
      if (want.attempt == have.attempt && want.rewound_to >= 0 &&
          have.rewound_to != want.rewound_to) {
        RestartedForOwners(name);
        have.rewound_to = want.rewound_to;
        alerts_->RewindRun(name, want.rewound_to, have);
        ++reapplied;
      }
      if (want.attempt == have.attempt && want.ended && !have.ended) {
        have.ended = true;
        alerts_->CloseRunEpisodes(name, alerts::kRunEnded, have);
        ++reapplied;
      }
    }
    // A checkpoint taken before the end still holds the run's detector state.
    if (run.ended) EndedForOwners(name);
    if (tracker_ != nullptr && !run.boundaries.empty()) {
      // The tracker restored the highest step stored, superseded or not.
      const int64_t visible = VisibleLastStep(name, run.boundaries);
      if (visible < tracker_->LastStep(name)) tracker_->ResetLastStep(name, visible);
    }
  }
  if (!runs_.empty()) {
    spdlog::info("restored the lifecycle of {} run(s) ({} event(s) after the checkpoint); {} "
                 "change(s) re-applied to the alert state",
                 runs_.size(), replayed, reapplied);
  }
}

int64_t RunLifecycle::VisibleLastStep(const std::string& run,
                                      const std::vector<Boundary>& boundaries) const {
  int64_t first_boundary = std::numeric_limits<int64_t>::max();
  for (const Boundary& b : boundaries) first_boundary = std::min(first_boundary, b.from_step);
  int64_t last = -1;
  for (const store::SeriesInfo& series : store_->ListSeries(run)) {
    if (series.last_step < first_boundary) {
      last = std::max(last, series.last_step);
      continue;
    }
    std::vector<Point> tail =
        store_->Range(series.key, first_boundary, std::numeric_limits<int64_t>::max());
    LatestAttempt(tail, boundaries);
    if (!tail.empty()) {
      last = std::max(last, tail.back().step);
      continue;
    }
    std::vector<Point> head = store_->Range(series.key, std::numeric_limits<int64_t>::min(),
                                            first_boundary - 1);
    if (!head.empty()) last = std::max(last, head.back().step);
  }
  return last;
}

}  // namespace foreshock::server
