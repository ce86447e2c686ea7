// --max_state_mb_per_run (server/ingest/state_budget.h): a probe that would
// grow its run's detector state past the budget is refused, one that
// replaces state of its size is not, other runs are not affected, and the
// count goes back down when the run's state is dropped or recounted.
#include "server/ingest/state_budget.h"

#include <gtest/gtest.h>

#include <string>

namespace foreshock::server {
namespace {

using detectors::RetainedFootprint;
using detectors::SampleKind;

RetainedFootprint Layer(int layer, int heads, int64_t bytes_per_head, bool whole = true,
                        int first_head = 0) {
  RetainedFootprint f{SampleKind::kQK, layer, "p", whole, {}};
  for (int h = 0; h < heads; ++h) f.heads.emplace_back(first_head + h, bytes_per_head);
  return f;
}

TEST(StateBudgetTest, NewLayersBeyondTheBudgetAreRefusedReplacementsAreNot) {
  StateBudget budget(1000);
  EXPECT_FALSE(budget.Admit("run", Layer(0, 4, 100)));
  EXPECT_FALSE(budget.Admit("run", Layer(1, 4, 100)));
  EXPECT_EQ(budget.RunBytes("run"), 800);
  // A third layer would make 1,200 bytes: refused, nothing counted.
  auto refusal = budget.Admit("run", Layer(2, 4, 100));
  ASSERT_TRUE(refusal);
  EXPECT_NE(refusal->find("run 'run' holds 800 bytes"), std::string::npos) << *refusal;
  EXPECT_NE(refusal->find("--max_state_mb_per_run"), std::string::npos) << *refusal;
  EXPECT_EQ(budget.RunBytes("run"), 800);
  // The same layers again, same size: admitted at the budget's edge too.
  EXPECT_FALSE(budget.Admit("run", Layer(0, 4, 100)));
  EXPECT_FALSE(budget.Admit("run", Layer(1, 4, 100)));
  // A larger shape of a held layer grows the state: refused.
  EXPECT_TRUE(budget.Admit("run", Layer(1, 4, 151)));
  EXPECT_EQ(budget.RunBytes("run"), 800);
  // A smaller one is admitted but frees nothing: a probe with a NaN is
  // dropped by the detector, which keeps the larger state it had, so a run
  // cannot shrink its count that way and then take new layers.
  EXPECT_FALSE(budget.Admit("run", Layer(1, 1, 10)));
  EXPECT_EQ(budget.RunBytes("run"), 800);
  EXPECT_TRUE(budget.Admit("run", Layer(2, 4, 100)));
  // Another run has its own budget.
  EXPECT_FALSE(budget.Admit("other", Layer(0, 4, 250)));
  EXPECT_EQ(budget.RunBytes("other"), 1000);
  EXPECT_EQ(budget.RunBytes("run"), 800);
}

TEST(StateBudgetTest, RotatingHeadsAddUpAndAFullSampleReplacesThemAll) {
  StateBudget budget(1000);
  // Heads 0-1, then 2-3 of one layer: both pairs are held.
  EXPECT_FALSE(budget.Admit("run", Layer(0, 2, 200, /*whole=*/false, 0)));
  EXPECT_FALSE(budget.Admit("run", Layer(0, 2, 200, /*whole=*/false, 2)));
  EXPECT_EQ(budget.RunBytes("run"), 800);
  EXPECT_TRUE(budget.Admit("run", Layer(0, 2, 200, /*whole=*/false, 4)));
  // A full sample of 2 heads replaces them: admitted, nothing more counted.
  EXPECT_FALSE(budget.Admit("run", Layer(0, 2, 200)));
  EXPECT_EQ(budget.RunBytes("run"), 800);
  // A router series is its own (kind, layer, probe_id).
  RetainedFootprint router{SampleKind::kRouter, 0, "p", true, {{-1, 150}}};
  EXPECT_FALSE(budget.Admit("run", router));
  EXPECT_EQ(budget.RunBytes("run"), 950);
  router.heads[0].second = 250;
  EXPECT_TRUE(budget.Admit("run", router));
}

TEST(StateBudgetTest, ZeroCountsWithoutRefusing) {
  StateBudget budget(0);
  for (int layer = 0; layer < 100; ++layer) EXPECT_FALSE(budget.Admit("run", Layer(layer, 8, 1 << 20)));
  EXPECT_EQ(budget.RunBytes("run"), int64_t{800} << 20);
}

TEST(StateBudgetTest, ForgetAndRebuildSetTheCount) {
  StateBudget budget(1000);
  EXPECT_FALSE(budget.Admit("a", Layer(0, 4, 250)));
  EXPECT_FALSE(budget.Admit("b", Layer(0, 1, 10)));
  EXPECT_TRUE(budget.Admit("a", Layer(1, 1, 1)));
  budget.ForgetRun("a");
  EXPECT_EQ(budget.RunBytes("a"), 0);
  EXPECT_FALSE(budget.Admit("a", Layer(1, 4, 250)));
  EXPECT_EQ((budget.Runs()), (std::vector<std::pair<std::string, int64_t>>{{"a", 1000}, {"b", 10}}));
  // What the detectors report replaces the count: here run b holds a full
  // budget and run a nothing.
  budget.Rebuild([](const detectors::RetainedVisitor& visit) {
    for (int head = 0; head < 4; ++head) visit("b", SampleKind::kQK, 3, "p", head, 250);
  });
  EXPECT_EQ(budget.RunBytes("a"), 0);
  EXPECT_EQ(budget.RunBytes("b"), 1000);
  EXPECT_TRUE(budget.Admit("b", Layer(4, 1, 1)));
  EXPECT_FALSE(budget.Admit("b", Layer(3, 4, 250)));  // the restored layer, same size
}

}  // namespace
}  // namespace foreshock::server
