#include "wire/rank_scalars.h"

#include <algorithm>
#include <type_traits>

namespace foreshock::wire {
namespace {

using detectors::Sample;
using detectors::ScalarsSample;

// Mean of one field over the ranks that reported it, summed in rank order
// (deterministic whatever order the reports came in). Equal values give that
// value exactly: (x + x + x) / 3 need not be x in floating point.
template <typename Has, typename Get>
void MeanOf(const std::vector<std::pair<int32_t, ScalarsSample>>& by_rank, Has has, Get get,
            bool& present, double& value) {
  int n = 0;
  double sum = 0, first = 0;
  bool equal = true;
  for (const auto& [rank, s] : by_rank) {
    if (!has(s)) continue;
    const double v = get(s);
    if (n == 0) first = v;
    equal = equal && v == first;
    sum += v;
    ++n;
  }
  present = n > 0;
  value = n == 0 ? 0.0 : equal ? first : sum / n;
}

ScalarsSample Mean(const std::vector<std::pair<int32_t, ScalarsSample>>& by_rank) {
  ScalarsSample out;
  MeanOf(by_rank, [](const ScalarsSample& s) { return s.has_loss; },
         [](const ScalarsSample& s) { return s.loss; }, out.has_loss, out.loss);
  MeanOf(by_rank, [](const ScalarsSample& s) { return s.has_grad_norm; },
         [](const ScalarsSample& s) { return s.grad_norm; }, out.has_grad_norm, out.grad_norm);
  MeanOf(by_rank, [](const ScalarsSample& s) { return s.has_lr; },
         [](const ScalarsSample& s) { return s.lr; }, out.has_lr, out.lr);
  return out;
}

}  // namespace

size_t RankScalars::OpenSteps() const {
  size_t n = 0;
  for (const auto& [name, run] : runs_) n += run.open.size();
  return n;
}

bool RankScalars::Complete(const Run& run, const OpenStep& step) const {
  size_t required = run.ranks.size();
  if (step.index < window_) required = std::max<size_t>(required, std::max(run.world_size, 0));
  size_t have = 0;
  for (const auto& [rank, s] : step.by_rank) have += run.ranks.contains(rank) ? 1 : 0;
  return have == run.ranks.size() && have >= required;
}

bool RankScalars::CompleteThrough(const std::string& name, Run& run, int64_t through,
                                  Result& out) {
  bool dropped = false;
  while (!run.open.empty() && run.open.begin()->first <= through) {
    auto node = run.open.extract(run.open.begin());
    const int64_t step = node.key();
    const OpenStep& open = node.mapped();
    for (auto it = run.ranks.begin(); it != run.ranks.end();) {
      const bool reported = std::binary_search(
          open.by_rank.begin(), open.by_rank.end(), std::make_pair(it->first, ScalarsSample{}),
          [](const auto& a, const auto& b) { return a.first < b.first; });
      if (!reported && ++it->second.missed >= window_) {
        it = run.ranks.erase(it);  // gone (or far behind): stop waiting for it
        dropped = true;
      } else {
        ++it;
      }
    }
    Sample merged;
    merged.run = name;
    merged.rank = -1;  // all ranks
    merged.world_size = run.world_size;
    merged.step = step;
    merged.payload = Mean(open.by_rank);
    out.ready.push_back(std::move(merged));
    run.emitted = step;
    run.recent[step] = open.by_rank;
    while (static_cast<int>(run.recent.size()) > window_) run.recent.erase(run.recent.begin());
  }
  return dropped;
}

RankScalars::Result RankScalars::Offer(const Sample& sample) {
  Result out;
  auto [run_it, inserted] = runs_.try_emplace(sample.run);
  Run& run = run_it->second;
  run.world_size = std::max(run.world_size, sample.world_size);
  const int32_t rank = sample.rank;
  if (run.emitted >= 0 && !run.ranks.contains(rank)) {
    // A late joiner: its own values only until it has a history of its own.
    JoiningRank& joining = run.joining[rank];
    if (sample.step > joining.last_step) {
      joining.last_step = sample.step;
      ++joining.steps;
    }
    if (joining.steps < kLateJoinSteps) {
      out.per_rank = true;
      return out;
    }
    run.joining.erase(rank);  // this report is its first in the run's series
  }
  if (!run.several &&
      (run.world_size > 1 || (!run.ranks.empty() && !run.ranks.contains(rank)))) {
    run.several = true;
  }
  if (!run.several) {
    // One rank: exactly what the detectors saw before ranks were merged.
    run.ranks[rank].last_step = sample.step;
    run.emitted = std::max(run.emitted, sample.step);
    out.ready.push_back(sample);
    return out;
  }
  out.per_rank = true;

  // A rank may go back (its process restarted from a checkpoint while the
  // others stream on): its replayed steps that are complete stay as they
  // are (below), and an open one gets its new value in place of its old.
  auto rank_it = run.ranks.try_emplace(rank).first;
  const bool replay = sample.step <= std::max(rank_it->second.high, rank_it->second.last_step);
  rank_it->second.high = std::max({rank_it->second.high, rank_it->second.last_step, sample.step});
  rank_it->second.last_step = sample.step;
  rank_it->second.missed = 0;
  if (sample.step <= run.emitted) {
    // Late: kept as the rank's own value. A replay of a recent step it was
    // part of revises that step's mean (a slow rank's late report does not).
    auto recent = run.recent.find(sample.step);
    if (!replay || recent == run.recent.end()) return out;
    auto& by_rank = recent->second;
    auto mine = std::lower_bound(by_rank.begin(), by_rank.end(), rank,
                                 [](const auto& entry, int32_t r) { return entry.first < r; });
    if (mine == by_rank.end() || mine->first != rank) return out;
    mine->second = std::get<ScalarsSample>(sample.payload);
    Sample revised;
    revised.run = sample.run;
    revised.rank = -1;
    revised.world_size = run.world_size;
    revised.step = sample.step;
    revised.payload = Mean(by_rank);
    out.corrected.push_back(std::move(revised));
    return out;
  }

  auto [open_it, opened] = run.open.try_emplace(sample.step);
  OpenStep& open = open_it->second;
  if (opened) open.index = run.steps++;
  const auto pos = std::lower_bound(open.by_rank.begin(), open.by_rank.end(), rank,
                                    [](const auto& entry, int32_t r) { return entry.first < r; });
  if (pos != open.by_rank.end() && pos->first == rank) {
    pos->second = std::get<ScalarsSample>(sample.payload);  // a replay replaces its earlier value
  } else {
    open.by_rank.emplace(pos, rank, std::get<ScalarsSample>(sample.payload));
  }

  bool dropped = false;
  if (Complete(run, open)) dropped |= CompleteThrough(sample.run, run, sample.step, out);
  while (static_cast<int>(run.open.size()) > window_) {
    dropped |= CompleteThrough(sample.run, run, run.open.begin()->first, out);
  }
  while (dropped) {
    // Fewer ranks to wait for: open steps may be complete now.
    dropped = false;
    int64_t through = -1;
    for (const auto& [step, o] : run.open) {
      if (Complete(run, o)) through = step;
    }
    if (through >= 0) dropped = CompleteThrough(sample.run, run, through, out);
  }
  return out;
}

RankScalars::Result RankScalars::Recover(const std::string& name, int32_t world_size,
                                         int64_t merged_through,
                                         const std::vector<int32_t>& ranks,
                                         const std::vector<Sample>& reports) {
  Run& run = runs_[name];
  run.world_size = std::max(run.world_size, world_size);
  run.several = true;  // only a multi-rank run stores reports of its own
  if (merged_through > run.emitted) {
    run.emitted = merged_through;
    std::erase_if(run.open, [&](const auto& entry) { return entry.first <= merged_through; });
  }
  for (int32_t rank : ranks) {
    run.ranks.try_emplace(rank);
    run.joining.erase(rank);
  }
  Result out;
  for (const Sample& report : reports) {
    for (Sample& s : Offer(report).ready) out.ready.push_back(std::move(s));
  }
  return out;
}

namespace {
constexpr std::string_view kRankScalarsMagic = "FSRS";
constexpr uint32_t kRankScalarsVersion = 2;  // v2: joining ranks

// Each record's fields, listed once for SaveState and RestoreState (the
// format in rank_scalars.h).
template <typename Io, typename R>
bool RunFields(Io& io, R& run) {
  return io(run.world_size) && io(run.several) && io(run.emitted) && io(run.steps);
}
template <typename Io, typename S>
bool RankFields(Io& io, S& state) {
  return io(state.last_step) && io(state.missed);
}
template <typename Io, typename J>
bool JoiningFields(Io& io, J& joining) {
  return io(joining.last_step) && io(joining.steps);
}
// One rank's report of an open step: a bit per field it has (loss 1,
// grad_norm 2, lr 4), then every field's value. False on a read that failed
// or bits no field has.
template <typename Io, typename S>
bool ReportFields(Io& io, S& s) {
  uint8_t fields = static_cast<uint8_t>((s.has_loss ? 1 : 0) | (s.has_grad_norm ? 2 : 0) |
                                        (s.has_lr ? 4 : 0));
  if (!io(fields) || !io(s.loss) || !io(s.grad_norm) || !io(s.lr) || fields > 7) return false;
  if constexpr (!std::is_const_v<S>) {
    s.has_loss = fields & 1;
    s.has_grad_norm = fields & 2;
    s.has_lr = fields & 4;
  }
  return true;
}
}  // namespace

void RankScalars::SaveState(codec::StateWriter& writer) const {
  codec::FieldWriter io(writer);
  writer.PutHeader(kRankScalarsMagic, kRankScalarsVersion);
  writer.PutU64(runs_.size());
  for (const auto& [name, run] : runs_) {
    writer.PutString(name);
    RunFields(io, run);
    writer.PutU64(run.ranks.size());
    for (const auto& [rank, state] : run.ranks) {
      writer.PutI32(rank);
      RankFields(io, state);
    }
    writer.PutU64(run.open.size());
    for (const auto& [step, open] : run.open) {
      writer.PutI64(step);
      writer.PutI64(open.index);
      writer.PutU64(open.by_rank.size());
      for (const auto& [rank, s] : open.by_rank) {
        writer.PutI32(rank);
        ReportFields(io, s);
      }
    }
    writer.PutU64(run.joining.size());
    for (const auto& [rank, joining] : run.joining) {
      writer.PutI32(rank);
      JoiningFields(io, joining);
    }
  }
}

bool RankScalars::RestoreState(codec::StateReader& reader,
                               const std::function<bool(std::string_view run)>& keep) {
  codec::FieldReader io(reader);
  uint32_t version = 0;
  uint64_t n_runs = 0;
  if (!reader.GetHeader(kRankScalarsMagic, 1, kRankScalarsVersion, version) ||
      !reader.GetCount(n_runs)) {
    return false;
  }
  std::map<std::string, Run, std::less<>> restored;
  for (uint64_t r = 0; r < n_runs; ++r) {
    std::string name;
    Run run;
    uint64_t n_ranks = 0, n_open = 0;
    if (!reader.GetString(name) || !RunFields(io, run) || !reader.GetCount(n_ranks)) {
      return false;
    }
    for (uint64_t i = 0; i < n_ranks; ++i) {
      int32_t rank = 0;
      RankState state;
      if (!reader.GetI32(rank) || !RankFields(io, state)) {
        return false;
      }
      state.high = state.last_step;
      if (!run.ranks.emplace(rank, state).second) return reader.Fail("a rank saved twice");
    }
    if (!reader.GetCount(n_open)) return false;
    for (uint64_t i = 0; i < n_open; ++i) {
      int64_t step = 0;
      OpenStep open;
      uint64_t n_reports = 0;
      if (!reader.GetI64(step) || !reader.GetI64(open.index) || !reader.GetCount(n_reports)) {
        return false;
      }
      if (step <= run.emitted) return reader.Fail("an open step at or below the emitted one");
      for (uint64_t k = 0; k < n_reports; ++k) {
        int32_t rank = 0;
        ScalarsSample s;
        if (!reader.GetI32(rank)) return false;
        if (!ReportFields(io, s)) return reader.ok() && reader.Fail("unknown scalar fields");
        if (!open.by_rank.empty() && open.by_rank.back().first >= rank) {
          return reader.Fail("an open step's ranks out of order");
        }
        open.by_rank.emplace_back(rank, s);
      }
      if (!run.open.emplace(step, std::move(open)).second) return reader.Fail("a step saved twice");
    }
    uint64_t n_joining = 0;
    if (version >= 2 && !reader.GetCount(n_joining)) return false;
    for (uint64_t i = 0; i < n_joining; ++i) {
      int32_t rank = 0;
      JoiningRank joining;
      if (!reader.GetI32(rank) || !JoiningFields(io, joining)) {
        return false;
      }
      if (!run.joining.emplace(rank, joining).second) return reader.Fail("a joining rank saved twice");
    }
    if (!restored.emplace(std::move(name), std::move(run)).second) {
      return reader.Fail("a run saved twice");
    }
  }
  for (auto& [name, run] : restored) {
    if (keep(name)) runs_.insert_or_assign(name, std::move(run));
  }
  return true;
}

}  // namespace foreshock::wire
