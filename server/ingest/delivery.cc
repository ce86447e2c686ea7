#include "server/ingest/delivery.h"

#include <spdlog/spdlog.h>

#include <sstream>

#include "absl/strings/str_cat.h"

namespace foreshock::server {

namespace {

int64_t NowUnixSeconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Event: "<rank> <sender id> <seq> <run>" (the run is the rest of the string).
std::string EncodeMark(const DeliveryTracker::Sender& sender, uint64_t seq) {
  return absl::StrCat(sender.rank, " ", sender.id, " ", seq, " ", sender.run);
}

bool DecodeMark(std::string_view bytes, DeliveryTracker::Sender* sender, uint64_t* seq) {
  std::istringstream in{std::string(bytes)};
  if (!(in >> sender->rank >> sender->id >> *seq) || in.get() != ' ') return false;
  std::getline(in, sender->run, '\0');
  return true;
}

}  // namespace

void DeliveryTracker::RaiseLocked(State& state, uint64_t high_water) {
  if (high_water > state.high_water) state.high_water = high_water;
  auto it = state.settled_above.begin();
  while (it != state.settled_above.end() && *it <= state.high_water + 1) {
    state.high_water = std::max(state.high_water, *it);
    it = state.settled_above.erase(it);
  }
}

void DeliveryTracker::SettleLocked(State& state, uint64_t seq) {
  if (seq <= state.high_water) return;
  state.settled_above.insert(seq);
  RaiseLocked(state, state.high_water);
}

DeliveryTracker::State& DeliveryTracker::TouchLocked(const Sender& sender) {
  State& state = states_[sender];
  state.last_active_s = NowUnixSeconds();
  return state;
}

void DeliveryTracker::OnHello(const Sender& sender, uint64_t first_seq) {
  if (first_seq == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  RaiseLocked(TouchLocked(sender), first_seq - 1);
}

DeliveryTracker::Admission DeliveryTracker::Begin(const Sender& sender, uint64_t seq,
                                                  std::function<void(bool)> on_settled) {
  std::lock_guard<std::mutex> lock(mu_);
  State& state = TouchLocked(sender);
  if (seq <= state.high_water || state.settled_above.contains(seq)) return Admission::kDuplicate;
  auto it = state.in_flight.find(seq);
  if (it != state.in_flight.end()) {
    it->second.push_back(std::move(on_settled));
    return Admission::kInFlight;
  }
  state.in_flight.emplace(seq, std::vector<std::function<void(bool)>>());
  return Admission::kNew;
}

absl::Status DeliveryTracker::Commit(const Sender& sender, uint64_t seq,
                                     const std::vector<KeyedPoint>& points) {
  // The points and the mark in one write: a crash keeps both or neither.
  if (absl::Status stored = store_.AppendBatchWithEvent(points, kEventKind, EncodeMark(sender, seq));
      !stored.ok()) {
    Abort(sender, seq);
    return stored;
  }
  std::vector<std::function<void(bool)>> waiters;
  bool checkpoint = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    State& state = TouchLocked(sender);
    auto it = state.in_flight.find(seq);
    if (it != state.in_flight.end()) {
      waiters = std::move(it->second);
      state.in_flight.erase(it);
    }
    SettleLocked(state, seq);
    if (++commits_since_checkpoint_ >= kCheckpointEvery && !checkpointing_) {
      checkpointing_ = true;
      checkpoint = true;
    }
  }
  for (auto& waiter : waiters) waiter(true);
  if (checkpoint) Checkpoint();
  return absl::OkStatus();
}

void DeliveryTracker::Abort(const Sender& sender, uint64_t seq) {
  std::vector<std::function<void(bool)>> waiters;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto state = states_.find(sender);
    if (state == states_.end()) return;
    auto it = state->second.in_flight.find(seq);
    if (it == state->second.in_flight.end()) return;
    waiters = std::move(it->second);
    state->second.in_flight.erase(it);
  }
  for (auto& waiter : waiters) waiter(false);
}

uint64_t DeliveryTracker::HighWater(const Sender& sender) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = states_.find(sender);
  return it == states_.end() ? 0 : it->second.high_water;
}

// "<run length>:<run> <rank> <sender id> <last active s> <high water> <n> <seq>...\n"
// per sender.
std::string DeliveryTracker::Save() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (const auto& [sender, state] : states_) {
    if (state.high_water == 0 && state.settled_above.empty()) continue;
    absl::StrAppend(&out, sender.run.size(), ":", sender.run, " ", sender.rank, " ", sender.id,
                    " ", state.last_active_s, " ", state.high_water, " ",
                    state.settled_above.size());
    for (uint64_t seq : state.settled_above) absl::StrAppend(&out, " ", seq);
    out += '\n';
  }
  return out;
}

bool DeliveryTracker::Load(std::string_view bytes) {
  std::istringstream in{std::string(bytes)};
  std::map<Sender, State> loaded;
  size_t length = 0;
  while (in >> length) {
    if (in.get() != ':') return false;
    Sender sender;
    sender.run.assign(length, '\0');
    if (!in.read(sender.run.data(), static_cast<std::streamsize>(length))) return false;
    State state;
    size_t n = 0;
    if (!(in >> sender.rank >> sender.id >> state.last_active_s >> state.high_water >> n)) {
      return false;
    }
    for (size_t i = 0; i < n; ++i) {
      uint64_t seq = 0;
      if (!(in >> seq)) return false;
      state.settled_above.insert(seq);
    }
    loaded[sender] = std::move(state);
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [sender, state] : loaded) {
    State& into = states_[sender];
    into.last_active_s = std::max(into.last_active_s, state.last_active_s);
    for (uint64_t seq : state.settled_above) SettleLocked(into, seq);
    RaiseLocked(into, state.high_water);
  }
  return true;
}

void DeliveryTracker::Restore() {
  if (auto bytes = store_.ReadCheckpoint(kCheckpointName)) {
    if (!Load(*bytes)) spdlog::warn("the ingest_seq checkpoint is unusable; ignoring it");
  }
  size_t marks = 0;
  for (const std::string& bytes : store_.Events(kEventKind)) {
    Sender sender;
    uint64_t seq = 0;
    if (!DecodeMark(bytes, &sender, &seq)) continue;
    std::lock_guard<std::mutex> lock(mu_);
    SettleLocked(TouchLocked(sender), seq);
    ++marks;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!states_.empty()) {
    spdlog::info("restored the delivery marks of {} sender(s) ({} recent mark events)",
                 states_.size(), marks);
  }
}

bool DeliveryTracker::Checkpoint() {
  std::lock_guard<std::mutex> write_lock(checkpoint_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    commits_since_checkpoint_ = 0;
    // Forget senders idle for long (nothing in flight): restarted client
    // processes are new senders, and the old ones would otherwise pile up.
    const int64_t cutoff =
        NowUnixSeconds() -
        std::chrono::duration_cast<std::chrono::seconds>(kForgetAfter).count();
    std::erase_if(states_, [cutoff](const auto& entry) {
      return entry.second.in_flight.empty() && entry.second.last_active_s < cutoff;
    });
  }
  const std::string bytes = Save();
  const bool ok = store_.WriteCheckpoint(kCheckpointName, bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    checkpointing_ = false;
  }
  if (!ok) spdlog::warn("writing the ingest_seq checkpoint failed");
  return ok;
}

}  // namespace foreshock::server
