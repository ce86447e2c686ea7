// Several ranks' step scalars -> the run's series (wire/rank_scalars.h): the
// mean over the ranks that reported a step, when the step is complete,
// independent of the order the ranks' reports arrive in. Through the worker
// pool: tests/server/pipeline/worker_pool_rank_scalars_test.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <map>
#include <optional>
#include <mutex>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "wire/rank_scalars.h"
#include "tests/wire/scalar_reports.h"

namespace foreshock::wire {
namespace {

using detectors::Sample;
using detectors::ScalarsSample;
using testing::Report;


// A deterministic loss per (rank, step), different per rank.
double LossOf(int32_t rank, int64_t step) {
  return 2.0 + 0.1 * rank + 1.0 / (1.0 + step) + 1e-7 * rank * step;
}

// (step, loss bits, has grad_norm, grad_norm bits, lr bits) of what came out.
using Emitted = std::tuple<int64_t, uint64_t, bool, uint64_t, uint64_t>;

Emitted Key(const Sample& s) {
  const auto& x = std::get<ScalarsSample>(s.payload);
  return {s.step, x.has_loss ? std::bit_cast<uint64_t>(x.loss) : 0, x.has_grad_norm,
          x.has_grad_norm ? std::bit_cast<uint64_t>(x.grad_norm) : 0,
          x.has_lr ? std::bit_cast<uint64_t>(x.lr) : 0};
}

std::vector<Sample> Feed(RankScalars& merge, const std::vector<Sample>& reports,
                         std::vector<bool>* per_rank = nullptr) {
  std::vector<Sample> out;
  for (const Sample& r : reports) {
    RankScalars::Result result = merge.Offer(r);
    if (per_rank) per_rank->push_back(result.per_rank);
    for (Sample& s : result.ready) out.push_back(std::move(s));
  }
  return out;
}

double Loss(const Sample& s) { return std::get<ScalarsSample>(s.payload).loss; }

TEST(RankScalars, OneRankPassesThroughUnchangedAndAtOnce) {
  RankScalars merge;
  std::vector<Sample> reports;
  for (int64_t step : {0, 1, 2, 3, 2, 3, 4}) {  // a resume from step 2 included
    reports.push_back(Report("solo", 5, step, LossOf(5, step), 1.5, 3e-4));
  }
  std::vector<bool> per_rank;
  RankScalars::Result first = merge.Offer(reports[0]);
  ASSERT_EQ(first.ready.size(), 1u);
  EXPECT_EQ(first.ready[0].rank, 5);  // the sample itself
  std::vector<Sample> out = Feed(merge, {reports.begin() + 1, reports.end()}, &per_rank);
  ASSERT_EQ(out.size(), reports.size() - 1);
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(Key(out[i]), Key(reports[i + 1]));
    EXPECT_FALSE(per_rank[i]);
  }
  EXPECT_EQ(merge.OpenSteps(), 0u);
  // A world_size label of 1 is one rank too.
  RankScalars one;
  EXPECT_EQ(one.Offer(Report("w1", 0, 0, 1.0, {}, {}, 1)).ready.size(), 1u);
}

TEST(RankScalars, MeanOverRanksOncePerStepWhenEveryRankReported) {
  RankScalars merge;
  constexpr int kRanks = 3;
  std::vector<Sample> out;
  for (int64_t step = 0; step < 5; ++step) {
    for (int32_t rank = 0; rank < kRanks; ++rank) {
      RankScalars::Result r =
          merge.Offer(Report("r", rank, step, LossOf(rank, step), 1.0 + rank, 1e-3, kRanks));
      EXPECT_TRUE(r.per_rank);
      // Only the last rank's report completes the step.
      EXPECT_EQ(r.ready.size(), rank == kRanks - 1 ? 1u : 0u) << step << " " << rank;
      for (Sample& s : r.ready) out.push_back(std::move(s));
    }
  }
  ASSERT_EQ(out.size(), 5u);
  for (int64_t step = 0; step < 5; ++step) {
    const auto& s = std::get<ScalarsSample>(out[step].payload);
    EXPECT_EQ(out[step].step, step);
    EXPECT_EQ(out[step].rank, -1);
    double sum = 0;
    for (int32_t rank = 0; rank < kRanks; ++rank) sum += LossOf(rank, step);
    EXPECT_DOUBLE_EQ(s.loss, sum / kRanks);
    EXPECT_DOUBLE_EQ(s.grad_norm, 2.0);
    EXPECT_EQ(s.lr, 1e-3);  // equal values: exactly that value
  }
}

TEST(RankScalars, EqualValuesGiveThatValueExactly) {
  // 0.1 * 3 / 3 != 0.1 in doubles; the merged lr must be the lr every rank sent.
  RankScalars merge;
  const double lr = 0.1;
  ASSERT_NE((lr + lr + lr) / 3, lr);
  std::vector<Sample> out;
  for (int32_t rank = 0; rank < 3; ++rank) {
    for (Sample& s : merge.Offer(Report("r", rank, 0, {}, {}, lr, 3)).ready) out.push_back(s);
  }
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(std::get<ScalarsSample>(out[0].payload).lr, lr);
  EXPECT_FALSE(std::get<ScalarsSample>(out[0].payload).has_loss);
}

TEST(RankScalars, EachFieldAveragesOverTheRanksThatReportedIt) {
  // Pipeline parallel: only the last stage has the loss; every stage the lr.
  RankScalars merge;
  std::vector<Sample> out;
  for (Sample& s : merge.Offer(Report("pp", 0, 7, {}, 3.0, 1e-3, 2)).ready) out.push_back(s);
  for (Sample& s : merge.Offer(Report("pp", 1, 7, 4.25, 5.0, 1e-3, 2)).ready) out.push_back(s);
  ASSERT_EQ(out.size(), 1u);
  const auto& m = std::get<ScalarsSample>(out[0].payload);
  EXPECT_TRUE(m.has_loss);
  EXPECT_EQ(m.loss, 4.25);
  EXPECT_EQ(m.grad_norm, 4.0);
  EXPECT_EQ(m.lr, 1e-3);
}

TEST(RankScalars, NonFiniteOnOneRankMakesTheMeanNonFinite) {
  RankScalars merge;
  std::vector<Sample> out;
  for (Sample& s : merge.Offer(Report("nan", 0, 0, 2.0, {}, {}, 2)).ready) out.push_back(s);
  for (Sample& s : merge.Offer(Report("nan", 1, 0, NAN, {}, {}, 2)).ready) out.push_back(s);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_TRUE(std::isnan(Loss(out[0])));
}

// Reports of `ranks` ranks for `steps` steps, each rank in step order, the
// ranks interleaved at random with each rank at most `max_lead` steps ahead
// of the slowest (stream batching, connect times).
std::vector<Sample> Interleaved(int ranks, int steps, int max_lead, std::mt19937& rng,
                                int32_t world_size) {
  std::vector<int64_t> next(ranks, 0);
  std::vector<Sample> out;
  while (true) {
    const int64_t slowest = *std::min_element(next.begin(), next.end());
    std::vector<int> can;
    for (int r = 0; r < ranks; ++r) {
      if (next[r] < steps && next[r] < slowest + max_lead) can.push_back(r);
    }
    if (can.empty()) break;
    const int r = can[std::uniform_int_distribution<size_t>(0, can.size() - 1)(rng)];
    out.push_back(Report("run", r, next[r], LossOf(r, next[r]), 1.0 + 0.5 * r, 3e-4, world_size));
    ++next[r];
  }
  return out;
}

TEST(RankScalars, SameSeriesForAnyArrivalOrderWithinTheWindow) {
  // Live and replayed streams interleave differently: the run's series must
  // not depend on it, bit for bit, while no rank runs `window` steps ahead.
  std::mt19937 rng(7);
  for (int ranks : {2, 3, 8}) {
    std::vector<Emitted> reference;
    for (int trial = 0; trial < 20; ++trial) {
      RankScalars merge(RankScalars::kDefaultWindow);
      const std::vector<Sample> reports =
          Interleaved(ranks, 60, RankScalars::kDefaultWindow, rng, ranks);
      const std::vector<Sample> out = Feed(merge, reports);
      ASSERT_EQ(out.size(), 60u) << ranks << " ranks, trial " << trial;
      std::vector<Emitted> keys;
      for (const Sample& s : out) keys.push_back(Key(s));
      for (size_t i = 0; i < keys.size(); ++i) ASSERT_EQ(std::get<0>(keys[i]), int64_t(i));
      if (trial == 0) {
        reference = keys;
        // And it is the mean of the ranks' values (summed in rank order).
        for (int64_t step = 0; step < 60; ++step) {
          double sum = 0;
          for (int r = 0; r < ranks; ++r) sum += LossOf(r, step);
          EXPECT_EQ(std::bit_cast<double>(std::get<1>(keys[step])), sum / ranks);
        }
      } else {
        EXPECT_EQ(keys, reference) << ranks << " ranks, trial " << trial;
      }
      EXPECT_EQ(merge.OpenSteps(), 0u);
    }
  }
}

TEST(RankScalars, WithoutTheWorldSizeHintRanksAreLearned) {
  // Older clients send no world_size: rank 0's steps pass through alone; the
  // second rank, new to a run with a series, joins it late: its first
  // kLateJoinSteps reports are its own only, then the run is multi-rank;
  // steps the first rank completed alone stay as they were.
  constexpr int64_t kJoin = RankScalars::kLateJoinSteps;
  RankScalars merge(4);
  std::vector<bool> per_rank;
  std::vector<Sample> reports = {Report("r", 0, 0, 1.0), Report("r", 0, 1, 1.0)};
  for (int64_t step = 0; step < kJoin; ++step) {  // rank 1's reports: steps 0..kJoin-1
    reports.push_back(Report("r", 1, step, 3.0));
    if (step >= 2) reports.push_back(Report("r", 0, step, 1.0));
  }
  std::vector<Sample> out = Feed(merge, reports, &per_rank);
  ASSERT_EQ(out.size(), size_t(kJoin));
  for (int64_t step = 0; step < kJoin - 1; ++step) {
    EXPECT_EQ(out[step].step, step);
    EXPECT_EQ(Loss(out[step]), 1.0) << step;  // rank 0 alone, passed through
  }
  EXPECT_EQ(out[kJoin - 1].step, kJoin - 1);
  EXPECT_EQ(Loss(out[kJoin - 1]), 2.0);  // rank 1's kLateJoinSteps-th report: in the mean
  EXPECT_TRUE(per_rank[2]);          // rank 1's values are kept as its own throughout
}

TEST(RankScalars, ALateJoinerCannotPutANaNIntoTheRunsSeries) {
  // Issue 34 item 4: a second client joins a live run as a free rank and
  // sends NaN losses; the run's series (what ForeshockNonFinite reads) stays
  // the job's, with or without a world_size hint, until the joiner has a
  // history of its own.
  for (int32_t world_size : {0, 2}) {
    const std::string run = "victim-" + std::to_string(world_size);
    RankScalars merge(4);
    for (int64_t step = 0; step < 40; ++step) {
      for (int32_t rank = 0; rank < std::max(world_size, 1); ++rank) {
        Feed(merge, {Report(run, rank, step, 1.0, {}, {}, world_size)});
      }
    }
    const double nan = std::nan("");
    std::vector<Sample> out;
    for (int64_t step = 40; step < 40 + RankScalars::kLateJoinSteps - 1; ++step) {
      RankScalars::Result joiner = merge.Offer(Report(run, 7, step, nan));
      EXPECT_TRUE(joiner.per_rank);
      EXPECT_TRUE(joiner.ready.empty());
      for (int32_t rank = 0; rank < std::max(world_size, 1); ++rank) {
        for (Sample& s : merge.Offer(Report(run, rank, step, 1.0, {}, {}, world_size)).ready) {
          out.push_back(s);
        }
      }
    }
    ASSERT_EQ(out.size(), size_t(RankScalars::kLateJoinSteps - 1)) << world_size;
    for (const Sample& s : out) EXPECT_EQ(Loss(s), 1.0) << world_size << " step " << s.step;
    // A state saved meanwhile remembers the joiner's count.
    codec::StateWriter writer;
    merge.SaveState(writer);
    RankScalars restored(4);
    codec::StateReader reader(writer.data());
    ASSERT_TRUE(restored.RestoreState(reader, [](std::string_view) { return true; }));
    // Its kLateJoinSteps-th report is in the mean: a NaN from a rank with a
    // history is the run's, as from any rank.
    const int64_t step = 40 + RankScalars::kLateJoinSteps - 1;
    for (RankScalars* m : {&merge, &restored}) {
      EXPECT_TRUE(m->Offer(Report(run, 7, step, nan)).ready.empty());
      std::vector<Sample> merged;
      for (int32_t rank = 0; rank < std::max(world_size, 1); ++rank) {
        for (Sample& s : m->Offer(Report(run, rank, step, 1.0, {}, {}, world_size)).ready) {
          merged.push_back(s);
        }
      }
      ASSERT_EQ(merged.size(), 1u) << world_size;
      EXPECT_TRUE(std::isnan(Loss(merged[0]))) << world_size;
    }
  }
}

TEST(RankScalars, ADeadRankDelaysTheSeriesByTheWindowThenIsNoLongerWaitedFor) {
  constexpr int kWindow = 4;
  RankScalars merge(kWindow);
  std::vector<std::pair<int64_t, int64_t>> completed;  // (step, at the report of step)
  auto offer = [&](int32_t rank, int64_t step) {
    for (const Sample& s : merge.Offer(Report("dead", rank, step, 1.0 + rank, {}, {}, 2)).ready) {
      completed.push_back({s.step, step});
    }
  };
  for (int64_t step = 0; step < 10; ++step) {
    offer(0, step);
    offer(1, step);
  }
  ASSERT_EQ(completed.size(), 10u);
  // Rank 1 dies after step 9.
  completed.clear();
  for (int64_t step = 10; step < 30; ++step) offer(0, step);
  // Steps 10..13 wait until 4 newer steps are open; then rank 1 has missed
  // kWindow steps and is dropped: the rest complete at once.
  ASSERT_EQ(completed.size(), 20u);
  for (size_t i = 0; i < completed.size(); ++i) EXPECT_EQ(completed[i].first, int64_t(10 + i));
  EXPECT_EQ(completed[0].second, 14);
  EXPECT_EQ(completed.back().second, 29);
  EXPECT_EQ(completed.back().first, 29);
  EXPECT_EQ(merge.OpenSteps(), 0u);
  // Its steps are rank 0's value alone.
  completed.clear();
  // Rank 1 comes back at the front: it is waited for again.
  offer(1, 30);
  EXPECT_TRUE(completed.empty());
  offer(0, 30);
  ASSERT_EQ(completed.size(), 1u);
}

TEST(RankScalars, OnlyRankZeroReportingWithAWorldSizeHintDelaysOnlyTheFirstSteps) {
  // The hint says 2 ranks, but only rank 0 created a Monitor.
  constexpr int kWindow = 8;
  RankScalars merge(kWindow);
  std::vector<std::pair<int64_t, int64_t>> completed;
  for (int64_t step = 0; step < 40; ++step) {
    for (const Sample& s : merge.Offer(Report("r0", 0, step, 1.0, {}, {}, 2)).ready) {
      completed.push_back({s.step, step});
    }
  }
  ASSERT_EQ(completed.size(), 40u);
  for (size_t i = 0; i < completed.size(); ++i) {
    EXPECT_EQ(completed[i].first, int64_t(i));
    EXPECT_LE(completed[i].second, int64_t(i) + kWindow);
  }
  EXPECT_EQ(completed.back().second, 39);  // caught up: immediate after the first window
}

TEST(RankScalars, LateReportsAreTheRanksOwnOnly) {
  // Rank 1's stream connects late: the first kWindow steps wait for it (the
  // world_size hint), later ones go on with rank 0 alone, and what rank 1
  // then sends for completed steps is its own value only.
  constexpr int kWindow = 4;
  RankScalars merge(kWindow);
  std::vector<Sample> out;
  for (int64_t step = 0; step < 6; ++step) {
    RankScalars::Result r = merge.Offer(Report("late", 0, step, 1.0, {}, {}, 2));
    EXPECT_EQ(r.ready.size(), step < 4 ? 0u : step == 4 ? 5u : 1u) << step;
    for (Sample& s : r.ready) out.push_back(s);
  }
  ASSERT_EQ(out.size(), 6u);
  for (int64_t step = 0; step < 6; ++step) EXPECT_EQ(out[step].step, step);
  for (int64_t step = 0; step < 6; ++step) {
    RankScalars::Result late = merge.Offer(Report("late", 1, step, 5.0, {}, {}, 2));
    EXPECT_TRUE(late.per_rank);
    EXPECT_TRUE(late.ready.empty());
    EXPECT_TRUE(late.corrected.empty());  // a slow rank's late report is no replay
  }
  // A rank new to a run with a series joins late: its reports are its own
  // until its kLateJoinSteps-th (its late reports above count too)...
  static_assert(RankScalars::kLateJoinSteps == 8);
  EXPECT_TRUE(merge.Offer(Report("late", 1, 6, 5.0, {}, {}, 2)).ready.empty());
  RankScalars::Result alone = merge.Offer(Report("late", 0, 6, 1.0, {}, {}, 2));
  ASSERT_EQ(alone.ready.size(), 1u);
  EXPECT_EQ(Loss(alone.ready[0]), 1.0);
  // ... from which on rank 1 is waited for.
  EXPECT_TRUE(merge.Offer(Report("late", 1, 7, 5.0, {}, {}, 2)).ready.empty());
  RankScalars::Result both = merge.Offer(Report("late", 0, 7, 1.0, {}, {}, 2));
  ASSERT_EQ(both.ready.size(), 1u);
  EXPECT_EQ(Loss(both.ready[0]), 3.0);
}

TEST(RankScalars, ACompletedStepCompletesOlderOpenStepsFirst) {
  RankScalars merge(16);
  std::vector<Sample> out;
  auto offer = [&](int32_t rank, int64_t step, double loss) {
    for (Sample& s : merge.Offer(Report("gap", rank, step, loss, {}, {}, 2)).ready) {
      out.push_back(s);
    }
  };
  offer(0, 0, 1.0);
  offer(0, 1, 1.0);
  offer(1, 1, 3.0);  // rank 1 skipped step 0
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].step, 0);
  EXPECT_EQ(Loss(out[0]), 1.0);
  EXPECT_EQ(out[1].step, 1);
  EXPECT_EQ(Loss(out[1]), 2.0);
}

TEST(RankScalars, ARestartedRanksReplayAddsNoOneRankPoints) {
  // Issue 34 item 4: two ranks; rank 1's process dies after step 99 while
  // rank 0 goes on to 104, and its new process replays from its checkpoint
  // at step 95. Steps 95-99 were complete: the replay revises their mean
  // with rank 1's new value in place of its old (a correction, not a second
  // one-rank point). Steps 100-104 waited for rank 1: each is completed
  // once, with both ranks.
  RankScalars merge(8);
  std::vector<Sample> out, corrected;
  auto offer = [&](int32_t rank, int64_t step, double loss) {
    RankScalars::Result r = merge.Offer(Report("resume", rank, step, loss, {}, {}, 2));
    EXPECT_TRUE(r.per_rank);
    for (Sample& s : r.ready) out.push_back(s);
    for (Sample& s : r.corrected) corrected.push_back(s);
  };
  for (int64_t step = 90; step < 100; ++step) {
    offer(0, step, 1.0);
    offer(1, step, 3.0);
  }
  for (int64_t step = 100; step < 105; ++step) offer(0, step, 1.0);
  ASSERT_EQ(out.size(), 10u);
  for (int64_t step = 95; step < 100; ++step) offer(1, step, 5.0);  // the replay
  EXPECT_EQ(out.size(), 10u);
  ASSERT_EQ(corrected.size(), 5u);
  for (size_t i = 0; i < corrected.size(); ++i) {
    EXPECT_EQ(corrected[i].step, int64_t(95 + i));
    EXPECT_EQ(corrected[i].rank, -1);
    EXPECT_EQ(Loss(corrected[i]), 3.0);  // (1 + 5) / 2: rank 1's old 3.0 replaced
  }
  // A step older than the last `window` completed ones keeps its mean.
  offer(1, 90, 5.0);
  EXPECT_EQ(corrected.size(), 5u);
  for (int64_t step = 100; step < 105; ++step) offer(1, step, 5.0);
  ASSERT_EQ(out.size(), 15u);
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(out[i].step, int64_t(90 + i));  // one point per step, in order
    EXPECT_EQ(Loss(out[i]), i < 10 ? 2.0 : 3.0) << out[i].step;
  }
  EXPECT_EQ(merge.OpenSteps(), 0u);
}

TEST(RankScalars, AReplayedReportOfAnOpenStepReplacesTheRanksEarlierOne) {
  // Three ranks; step 10 waits for rank 2 when rank 1 restarts and reports
  // it again: the step's mean has rank 1's new value once, not both.
  RankScalars merge(8);
  for (int32_t rank = 0; rank < 3; ++rank) merge.Offer(Report("open", rank, 9, 1.0, {}, {}, 3));
  EXPECT_TRUE(merge.Offer(Report("open", 0, 10, 1.0, {}, {}, 3)).ready.empty());
  EXPECT_TRUE(merge.Offer(Report("open", 1, 10, 100.0, {}, {}, 3)).ready.empty());
  EXPECT_TRUE(merge.Offer(Report("open", 1, 10, 4.0, {}, {}, 3)).ready.empty());  // the replay
  RankScalars::Result r = merge.Offer(Report("open", 2, 10, 4.0, {}, {}, 3));
  ASSERT_EQ(r.ready.size(), 1u);
  EXPECT_EQ(Loss(r.ready[0]), 3.0);  // (1 + 4 + 4) / 3
}

TEST(RankScalars, ForgetRunDropsOpenStepsOfTheAbandonedAttempt) {
  RankScalars merge;
  EXPECT_TRUE(merge.Offer(Report("f", 0, 10, 1.0, {}, {}, 2)).ready.empty());
  EXPECT_EQ(merge.OpenSteps(), 1u);
  merge.ForgetRun("f");  // the run resumed from a checkpoint (run lifecycle rewind)
  EXPECT_EQ(merge.OpenSteps(), 0u);
  // The new attempt starts over: its step 6 waits for both ranks, and rank 0's
  // abandoned step 10 value is in no mean.
  EXPECT_TRUE(merge.Offer(Report("f", 0, 6, 5.0, {}, {}, 2)).ready.empty());
  RankScalars::Result r = merge.Offer(Report("f", 1, 6, 7.0, {}, {}, 2));
  ASSERT_EQ(r.ready.size(), 1u);
  EXPECT_EQ(r.ready[0].step, 6);
  EXPECT_EQ(Loss(r.ready[0]), 6.0);
}

TEST(RankScalars, RunsAreIndependent) {
  RankScalars merge;
  EXPECT_TRUE(merge.Offer(Report("a", 0, 0, 1.0, {}, {}, 2)).ready.empty());
  EXPECT_EQ(merge.Offer(Report("b", 0, 0, 1.0)).ready.size(), 1u);
  EXPECT_EQ(merge.Offer(Report("a", 1, 0, 3.0, {}, {}, 2)).ready.size(), 1u);
}


TEST(RankScalars, ARestoredStateCompletesTheOpenStepsAsTheOriginalWould) {
  // Cut an interleaved 3-rank stream anywhere (steps open at the cut), save,
  // restore into a fresh instance and feed the rest to both: the same series,
  // bit for bit. A second run rides along in the blob; keep() filters it.
  std::mt19937 rng(11);
  const std::vector<Sample> reports = Interleaved(3, 50, 8, rng, 3);
  for (size_t cut : {size_t{1}, size_t{7}, size_t{40}, reports.size() / 2, reports.size() - 3}) {
    RankScalars original(RankScalars::kDefaultWindow);
    Feed(original, {reports.begin(), reports.begin() + cut});
    original.Offer(Report("other", 0, 0, 1.0, {}, {}, 2));  // open: waits for rank 1
    ASSERT_GT(original.OpenSteps(), 0u) << cut;
    codec::StateWriter writer;
    original.SaveState(writer);

    RankScalars restored(RankScalars::kDefaultWindow);
    codec::StateReader reader(writer.data());
    ASSERT_TRUE(restored.RestoreState(reader, [](std::string_view run) { return run == "run"; }))
        << reader.error();
    EXPECT_TRUE(reader.ExpectEnd());
    const std::vector<Sample> rest(reports.begin() + cut, reports.end());
    std::vector<Emitted> want, got;
    for (const Sample& s : Feed(original, rest)) want.push_back(Key(s));
    for (const Sample& s : Feed(restored, rest)) got.push_back(Key(s));
    EXPECT_EQ(got, want) << "cut after " << cut << " reports";
    EXPECT_FALSE(want.empty());
    EXPECT_EQ(restored.OpenSteps(), 0u);  // "other" was not kept
    EXPECT_EQ(original.OpenSteps(), 1u);
  }
}

TEST(RankScalars, RecoveredReportsReopenTheStepsTheCheckpointMissed) {
  // Issue 34 item 4: rank 0 is ten acknowledged steps ahead when the daemon
  // is killed; the checkpoint predates them (or holds some of them). The
  // reports read back from the store reopen those steps, and rank 1's
  // reports complete them with the mean, once.
  for (bool checkpointed : {false, true}) {
    RankScalars live(RankScalars::kDefaultWindow);
    for (int64_t step = 0; step < 5; ++step) {
      live.Offer(Report("k", 0, step, 1.0, {}, {}, 2));
      live.Offer(Report("k", 1, step, 3.0, {}, {}, 2));
    }
    std::vector<Sample> ahead;
    for (int64_t step = 5; step < 15; ++step) {
      ahead.push_back(Report("k", 0, step, 1.0, {}, {}, 2));
      if (checkpointed && step < 10) live.Offer(ahead.back());
    }
    codec::StateWriter writer;
    live.SaveState(writer);
    RankScalars restarted(RankScalars::kDefaultWindow);
    codec::StateReader reader(writer.data());
    ASSERT_TRUE(restarted.RestoreState(reader, [](std::string_view) { return true; }));
    EXPECT_TRUE(restarted.Recover("k", 2, /*merged_through=*/4, {0, 1}, ahead).ready.empty());
    EXPECT_EQ(restarted.OpenSteps(), 10u) << checkpointed;
    std::vector<Sample> out;
    for (int64_t step = 5; step < 15; ++step) {
      for (Sample& s : restarted.Offer(Report("k", 1, step, 3.0, {}, {}, 2)).ready) {
        out.push_back(s);
      }
    }
    ASSERT_EQ(out.size(), 10u) << checkpointed;
    for (size_t i = 0; i < out.size(); ++i) {
      EXPECT_EQ(out[i].step, int64_t(5 + i));
      EXPECT_EQ(Loss(out[i]), 2.0) << checkpointed << " step " << out[i].step;
    }
  }
  // A run the checkpoint does not have at all: the ranks come from the store.
  RankScalars fresh(RankScalars::kDefaultWindow);
  fresh.Recover("new", 0, 40, {0, 1}, {Report("new", 0, 41, 1.0)});
  EXPECT_TRUE(fresh.Offer(Report("new", 0, 42, 1.0)).ready.empty());  // waits for rank 1
  RankScalars::Result r = fresh.Offer(Report("new", 1, 41, 3.0));
  ASSERT_EQ(r.ready.size(), 1u);
  EXPECT_EQ(r.ready[0].step, 41);
  EXPECT_EQ(Loss(r.ready[0]), 2.0);
}

TEST(RankScalars, AMalformedStateIsRefusedAndAddsNothing) {
  RankScalars original;
  Feed(original, {Report("run", 0, 0, 1.0, 2.0, 3.0, 2), Report("run", 0, 1, 1.5, {}, {}, 2)});
  codec::StateWriter writer;
  original.SaveState(writer);
  const std::string blob = writer.data();
  for (size_t len = 0; len < blob.size(); ++len) {
    RankScalars restored;
    codec::StateReader reader(std::string_view(blob).substr(0, len));
    const bool ok = restored.RestoreState(reader, [](std::string_view) { return true; });
    EXPECT_FALSE(ok && reader.ExpectEnd()) << "truncated to " << len;
    if (!ok) {
      EXPECT_EQ(restored.OpenSteps(), 0u) << len;
    }
  }
  // Every single-byte flip is refused or restores a well-formed state (the
  // checkpoint store's CRC catches flips; this is the decoder's own guard).
  for (size_t i = 0; i < blob.size(); ++i) {
    std::string flipped = blob;
    flipped[i] = static_cast<char>(flipped[i] ^ 0x5a);
    RankScalars restored;
    codec::StateReader reader(flipped);
    restored.RestoreState(reader, [](std::string_view) { return true; });
    Feed(restored, {Report("run", 1, 0, 2.0, {}, {}, 2), Report("run", 1, 1, 2.5, {}, {}, 2)});
  }
}


}  // namespace
}  // namespace foreshock::wire
