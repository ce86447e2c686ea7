// Exactly-once delivery of resent batches: dedup by (run_id, rank, sender_id, seq).
//
// Streams whose Hello carries first_seq (ingest.proto) number batches per
// sender, so a new stream (after a broken one, or a daemon restart) resends
// its unacknowledged batches with their old seqs. The tracker keeps, per
// sender (run_id, rank, sender_id: two processes that share a rank by mistake
// stay apart):
//   - the high-water mark: every seq <= it is settled (stored, or below a
//     Hello's first_seq, i.e. never to be sent again);
//   - the seqs above the mark that are settled (batches finish out of order);
//   - the seqs being processed now, with the resends waiting on them.
//
// Durability: a batch's points and its mark go to the store in ONE append
// (SeriesStore::AppendBatchWithEvent: one log write, mark last, closed by a
// commit record), before its Ack. After a process crash (kill -9, which can
// stop a write() part-way) recovery keeps the write whole or drops it
// (store/record_format.h, kCommit), so a resend is either a duplicate (acked,
// not stored again) or stored for the first time. Only a write torn by power
// loss with --fsync=none or interval, whose later pages reached the disk
// before earlier ones, could break that (then records may be stored twice). Marks are
// events of kind "ingest_seq"; the whole table is also checkpointed
// ("ingest_seq" checkpoint) every kCheckpointEvery commits and with the
// daemon's checkpoints, since the store keeps only the newest events of a kind.
// Restore = checkpoint + the events retained after it. A sender not heard
// from (no Hello, no batch) for kForgetAfter is dropped at a checkpoint: a
// restarted client process is a new sender, so old ones would pile up.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "server/pipeline/series_store.h"

namespace foreshock::server {

class DeliveryTracker {
 public:
  static constexpr std::string_view kEventKind = "ingest_seq";
  static constexpr std::string_view kCheckpointName = "ingest_seq";
  static constexpr int kCheckpointEvery = 256;
  static constexpr std::chrono::hours kForgetAfter{24 * 7};

  struct Sender {
    std::string run;
    int rank = 0;
    uint64_t id = 0;  // Hello.sender_id
    bool operator<(const Sender& o) const {
      return std::tie(run, rank, id) < std::tie(o.run, o.rank, o.id);
    }
  };

  explicit DeliveryTracker(SeriesStore& store) : store_(store) {}

  // Reads the checkpoint and the retained events. Call before serving.
  void Restore();
  // Writes the checkpoint now. False on failure.
  bool Checkpoint();

  // A Hello with first_seq: seqs below it will never come (again).
  void OnHello(const Sender& sender, uint64_t first_seq);

  enum class Admission {
    kNew,        // not seen: process it, then Commit (or Abort)
    kDuplicate,  // already settled: ack it as a duplicate now
    kInFlight,   // being processed for another stream: `on_settled` runs once
                 // it is committed (true) or aborted (false)
  };
  Admission Begin(const Sender& sender, uint64_t seq,
                  std::function<void(bool committed)> on_settled);
  // Appends the batch's points and its mark in one store write, then settles
  // the seq (waiters run, on this thread, after the lock is released). When
  // the store refuses the write (a full disk, an I/O error) the seq is
  // aborted instead (waiters get false) and the store's status returned: the
  // batch must not be acknowledged, and its resend is new.
  absl::Status Commit(const Sender& sender, uint64_t seq,
                      const std::vector<KeyedPoint>& points);
  // A batch that was begun but will not be stored (e.g. the daemon stops).
  void Abort(const Sender& sender, uint64_t seq);

  // Settled seq mark for tests: every seq <= it is settled.
  uint64_t HighWater(const Sender& sender) const;

  std::string Save() const;
  bool Load(std::string_view bytes);

 private:
  struct State {
    int64_t last_active_s = 0;  // Unix seconds of the last Hello or batch
    uint64_t high_water = 0;
    std::set<uint64_t> settled_above;
    std::map<uint64_t, std::vector<std::function<void(bool)>>> in_flight;
  };
  static void SettleLocked(State& state, uint64_t seq);
  static void RaiseLocked(State& state, uint64_t high_water);
  State& TouchLocked(const Sender& sender);

  SeriesStore& store_;
  mutable std::mutex mu_;
  std::map<Sender, State> states_;
  int commits_since_checkpoint_ = 0;
  bool checkpointing_ = false;
  std::mutex checkpoint_mu_;  // one checkpoint write at a time
};

}  // namespace foreshock::server
