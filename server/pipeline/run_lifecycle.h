// Run lifecycle: when a run has ended, restarted from a checkpoint under the
// same run_id (a new attempt), or had one rank resumed; the contract (end,
// world size, restart, rank resume, rewind, durability) is docs/DESIGN.md
// §3.4, and each method below says which ingest event calls it.
//
// A sender is the (rank, Hello.sender_id) of an ingest stream (sender_id 0
// for clients without Hello.first_seq, whose restarts cannot be told from
// reconnects). Per run the lifecycle keeps the current attempt's senders:
// streams open, goodbye said, records sent. Which stream may speak for a rank
// at all is decided before this, by the ingest service's rank ownership.
//
// Each change is appended to the store's event log before it takes effect,
// and the state is checkpointed with the daemon's others and every
// kCheckpointEvery events; Restore replays the newer events and re-applies to
// the alerts (RunAlertEffects) and detectors what their own checkpoints missed.
//
// Thread-safe. Lock order: an ingest stream's lock, then this one, then the
// alert hub's, the worker pool's detector locks, the run tracker's and the
// store's, and the state owners'; none of those calls back in here.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "alerts/alert_engine.h"
#include "server/pipeline/run_alert_effects.h"
#include "server/pipeline/run_state_owner.h"
#include "server/pipeline/series_store.h"

namespace foreshock::server {

class RunTracker;

class RunLifecycle {
 public:
  static constexpr std::string_view kEventKind = "lifecycle";
  static constexpr std::string_view kCheckpointName = "lifecycle";
  static constexpr int kCheckpointEvery = 256;

  // Every collaborator may be null (then that effect is skipped: tests).
  // `runs` gives the run's last step (its end, a rewind) and is rewound with it.
  RunLifecycle(SeriesStore* store, RunAlertEffects* alerts, RunTracker* runs);
  // Registers a component that keeps per-run state (run_state_owner.h), told
  // in registration order. Before ingest starts and before Restore.
  void AddStateOwner(RunStateOwner* owner) { owners_.push_back(owner); }

  // Ingest: an accepted Hello, before its HelloAck.
  // `world_size` (Hello label world_size, 0 when absent): with it, the run
  // ends only once that many distinct ranks said goodbye, so a rank that
  // finishes before another rank's stream opened does not end the run.
  // `tenant`: whose --max_runs_per_tenant share the run counts in (the
  // ingest service's name for it); the run's first one is kept, and stored,
  // so that after a restart the recovered run still counts in that share.
  void OnHello(const std::string& run, int32_t rank, uint64_t sender, int32_t world_size = 0,
               const std::string& tenant = "");
  // Ingest, before OnHello: why a Hello for (rank, sender) with this
  // world_size label conflicts with the world size the run's attempt
  // declared (it raises it above max(declared, 1), or its rank is outside a
  // declared one); nullopt when it does not, or when it starts a new attempt.
  std::optional<std::string> WorldSizeConflict(const std::string& run, int32_t rank,
                                                uint64_t sender, int32_t world_size) const;
  // Ingest: a stream whose Hello went to OnHello ended.
  void OnStreamClosed(const std::string& run, int32_t rank, uint64_t sender);
  // Ingest: before a batch's accepted records of sender (rank, sender) are
  // dispatched; `min_step` and `max_step` are their smallest and largest step.
  // From then on the run's end waits for this sender's goodbye.
  void BeforeRecords(const std::string& run, int32_t rank, uint64_t sender, int64_t min_step,
                     int64_t max_step);
  // Ingest: a Batch with goodbye, once it and every earlier batch of its
  // stream were processed, before its Ack. Idempotent (resends).
  void OnGoodbye(const std::string& run, int32_t rank, uint64_t sender);

  // The one rule for forgetting a run: no stream of it open, and nothing
  // from it (a Hello, records, a goodbye, a stream's end) for `idle_ms` of
  // wall time (a run restored from a checkpoint counts from its end, or
  // from the restore). Each such run not forgotten yet is forgotten now:
  // its open alert episodes close (run_idle), its baselines go, and every
  // state owner is told (OnRunForgotten). Its lifecycle stays, small, so a
  // later stream under the same run id is still told apart as a reconnect,
  // a rank's resume or a new attempt. Returns the runs forgotten.
  std::vector<std::string> ForgetIdleRuns(int64_t now_ms, int64_t idle_ms);
  // Forgotten by ForgetIdleRuns, and nothing of it came since.
  bool IsForgotten(const std::string& run) const;

  struct Boundary {
    int32_t attempt = 0;
    int64_t from_step = 0;  // the attempt's first step
    int64_t wall_ms = 0;    // points stored before this time at steps >= from_step are superseded
  };
  struct Status {
    int32_t attempt = 1;
    int64_t attempt_start_step = -1;  // the current attempt's boundary step; -1: none
    bool ended = false;
    int64_t ended_ms = 0;
    int64_t ended_step = -1;  // the run's last step when it ended
    int32_t world_size = -1;  // declared by the attempt's first Hello; -1: none
  };
  std::optional<Status> GetStatus(const std::string& run) const;  // nullopt: never seen
  std::vector<Boundary> Boundaries(const std::string& run) const;
  // The tenant the run's first Hello counted in ("": none known), restored
  // with the rest of the state.
  std::string TenantOf(const std::string& run) const;

  // Leaves out of `points` (sorted by step, as SeriesStore::Range returns
  // them) every point a later attempt superseded: step >= b.from_step and
  // stored at or before b.wall_ms, for some boundary b.
  static void LatestAttempt(std::vector<Point>& points, const std::vector<Boundary>& boundaries);

  // The whole state, for the checkpoint kCheckpointName (format in the .cc).
  std::string SaveState() const;
  // Writes it to the store. False if the write failed.
  bool Checkpoint();
  // At startup, after the alert and detector checkpoints were restored and
  // before ingest starts: reads the checkpoint and the newer events, then
  // brings the alert engine, the detectors and the run tracker up to it.
  void Restore();

 private:
  struct Sender {
    int open = 0;  // streams open now (not stored: none survive a restart)
    bool goodbye = false;
    bool sent = false;  // records of it were accepted in this attempt
  };
  struct Run {
    int32_t attempt = 1;
    std::map<std::pair<int32_t, uint64_t>, Sender> senders;  // of the current attempt
    bool rewind_pending = false;  // a new attempt whose first records have not come yet
    // The world size the attempt's first Hello declared; -1: none declared yet.
    int32_t world_size = -1;
    bool ended = false;
    int64_t ended_ms = 0;
    int64_t ended_step = -1;
    std::vector<Boundary> boundaries;  // oldest first
    std::string tenant;                // see OnHello; "": none known
    // Not stored: the wall time of its latest Hello, records, goodbye or
    // stream end (after a restore, its end or the restore), and whether
    // ForgetIdleRuns forgot it since.
    int64_t active_ms = 0;
    bool forgotten = false;
  };
  // Something of `run` came now: it is active, and no longer forgotten.
  static void Touch(Run& run);
  enum class EventType : uint8_t {
    kJoin = 1,
    kGoodbye = 2,
    kAttempt = 3,
    kRewind = 4,
    kEnd = 5,
    kRankResume = 6,  // a rank's new process replaces its senders in the attempt
    kTenant = 7,      // the run's tenant (Event::tenant), once per run
    kSent = 8,        // the sender's first accepted records of the attempt
  };
  // What a Hello of a sender means for the run (OnHello).
  enum class HelloKind { kReconnect, kJoin, kRankResume, kNewAttempt };
  static HelloKind Classify(const Run& run, int32_t rank, uint64_t sender);
  struct Event {
    EventType type = EventType::kJoin;
    uint64_t seq = 0;
    std::string run;
    int32_t attempt = 0;
    int32_t rank = 0;
    uint64_t sender = 0;
    int64_t step = 0;
    int64_t wall_ms = 0;
    std::string tenant;  // kTenant only
    // kJoin, kRankResume: the Hello's world_size label; -1: not known (an
    // event from before it was stored, or a join counted at a goodbye).
    int32_t world_size = -1;
  };

  // Appends `event` (numbered here) to the store's log, then applies it to
  // the state. Effects on other components are the caller's.
  void RecordLocked(Event event);
  static void Apply(std::map<std::string, Run, std::less<>>& runs, const Event& event);
  static std::string Encode(const Event& event);
  static std::optional<Event> Decode(std::string_view bytes);
  static alerts::LifecycleMark MarkOf(const Run& run);
  std::string SaveStateLocked() const;
  bool LoadState(std::string_view bytes);
  void MaybeCheckpointLocked();
  // The highest step of `run` in its latest attempt (superseded points left out).
  int64_t VisibleLastStep(const std::string& run, const std::vector<Boundary>& boundaries) const;

  // Tells every registered owner (OnRunRestarted / OnRunEnded / OnRunForgotten).
  void RestartedForOwners(const std::string& run) const;
  void EndedForOwners(const std::string& run) const;
  void ForgottenForOwners(const std::string& run) const;

  SeriesStore* const store_;
  RunAlertEffects* const alerts_;
  RunTracker* const tracker_;
  std::vector<RunStateOwner*> owners_;

  mutable std::mutex mu_;
  std::map<std::string, Run, std::less<>> runs_;
  uint64_t next_seq_ = 1;
  uint64_t checkpoint_seq_ = 0;  // the last event seq the stored checkpoint includes
  int events_since_checkpoint_ = 0;
};

}  // namespace foreshock::server
