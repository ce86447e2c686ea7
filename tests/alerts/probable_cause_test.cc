// The probable-cause rule table, row by row (probable_cause.h).
#include "alerts/probable_cause.h"

#include <gtest/gtest.h>

#include <ostream>
#include <string>

#include "alerts/config.h"

namespace foreshock::alerts {
namespace {

struct Row {
  bool attention, router_collapse, router_imbalance, curvature;
  ProbableCause expected;
};

void PrintTo(const Row& row, std::ostream* os) {
  *os << "{attention " << row.attention << ", router_collapse " << row.router_collapse
      << ", router_imbalance " << row.router_imbalance << ", curvature " << row.curvature << " -> "
      << ProbableCauseName(row.expected) << "}";
}

class ProbableCauseTableTest : public ::testing::TestWithParam<Row> {};

TEST_P(ProbableCauseTableTest, ClassifiesTheRow) {
  const Row& row = GetParam();
  CauseEvidence evidence;
  evidence.attention = row.attention;
  evidence.router_collapse = row.router_collapse;
  evidence.router_imbalance = row.router_imbalance;
  evidence.curvature = row.curvature;
  EXPECT_EQ(ProbableCauseName(ClassifyProbableCause(evidence)), ProbableCauseName(row.expected));
}

// Every combination of the four families, grouped by the table's rows.
INSTANTIATE_TEST_SUITE_P(
    Rows, ProbableCauseTableTest,
    ::testing::Values(
        // attention + (curvature or router collapse) -> combined, imbalance irrelevant
        Row{true, true, false, false, ProbableCause::kCombined},
        Row{true, false, false, true, ProbableCause::kCombined},
        Row{true, true, true, true, ProbableCause::kCombined},
        Row{true, true, true, false, ProbableCause::kCombined},
        Row{true, false, true, true, ProbableCause::kCombined},
        Row{true, true, false, true, ProbableCause::kCombined},
        // curvature or router collapse alone -> learning rate
        Row{false, false, false, true, ProbableCause::kLearningRateTooHigh},
        Row{false, true, false, false, ProbableCause::kLearningRateTooHigh},
        Row{false, true, false, true, ProbableCause::kLearningRateTooHigh},
        Row{false, true, true, false, ProbableCause::kLearningRateTooHigh},
        Row{false, false, true, true, ProbableCause::kLearningRateTooHigh},
        Row{false, true, true, true, ProbableCause::kLearningRateTooHigh},
        // attention with router collapse and curvature quiet -> low-precision
        // attention, whether or not the load is imbalanced
        Row{true, false, false, false, ProbableCause::kLowPrecisionAttention},
        Row{true, false, true, false, ProbableCause::kLowPrecisionAttention},
        // nothing mechanistic, or only imbalance
        Row{false, false, false, false, ProbableCause::kUnknown},
        Row{false, false, true, false, ProbableCause::kUnknown}),
    // e.g. "attention_curvature", "none"
    [](const ::testing::TestParamInfo<Row>& info) {
      std::string name;
      auto add = [&](bool present, const char* family) {
        if (!present) return;
        if (!name.empty()) name += "_";
        name += family;
      };
      add(info.param.attention, "attention");
      add(info.param.router_collapse, "router_collapse");
      add(info.param.router_imbalance, "router_imbalance");
      add(info.param.curvature, "curvature");
      return name.empty() ? std::string("none") : name;
    });

TEST(ProbableCauseTest, AnnotationValuesAreTheDesignNames) {
  EXPECT_EQ(ProbableCauseName(ProbableCause::kLowPrecisionAttention), "low_precision_attention");
  EXPECT_EQ(ProbableCauseName(ProbableCause::kLearningRateTooHigh), "learning_rate_too_high");
  EXPECT_EQ(ProbableCauseName(ProbableCause::kCombined), "combined");
  EXPECT_EQ(ProbableCauseName(ProbableCause::kUnknown), "unknown");
}

TEST(ProbableCauseTest, EveryAlertNameHasItsFamily) {
  EXPECT_EQ(FamilyOfAlert(kQKIncrementCollapse), AlertFamily::kAttention);
  EXPECT_EQ(FamilyOfAlert(kAttentionLogitGrowth), AlertFamily::kAttention);
  EXPECT_EQ(FamilyOfAlert(kAttentionEntropyCollapse), AlertFamily::kAttention);
  EXPECT_EQ(FamilyOfAlert(kRouterCollapse), AlertFamily::kRouterCollapse);
  EXPECT_EQ(FamilyOfAlert(kRouterImbalance), AlertFamily::kRouterImbalance);
  EXPECT_EQ(FamilyOfAlert(kCurvatureAboveEdge), AlertFamily::kCurvature);
  EXPECT_EQ(FamilyOfAlert(kLossSpike), AlertFamily::kConsequence);
  EXPECT_EQ(FamilyOfAlert(kNonFinite), AlertFamily::kConsequence);
}

TEST(ProbableCauseTest, SuggestedActionsNameTheFixAndTheRollbackStep) {
  const std::string lowprec = SuggestedAction(ProbableCause::kLowPrecisionAttention, 1234);
  EXPECT_NE(lowprec.find("fp32"), std::string::npos);
  EXPECT_NE(lowprec.find("QK-norm or QK-clip"), std::string::npos);
  EXPECT_NE(lowprec.find("before step 1234"), std::string::npos);
  const std::string lr = SuggestedAction(ProbableCause::kLearningRateTooHigh, 99);
  EXPECT_NE(lr.find("Lower the learning rate"), std::string::npos);
  EXPECT_NE(lr.find("before step 99"), std::string::npos);
  EXPECT_EQ(lr.find("fp32"), std::string::npos);
  const std::string combined = SuggestedAction(ProbableCause::kCombined, 7);
  EXPECT_NE(combined.find("learning rate"), std::string::npos);
  EXPECT_NE(combined.find("fp32"), std::string::npos);
  EXPECT_NE(SuggestedAction(ProbableCause::kUnknown, 5).find("before step 5"), std::string::npos);
}

}  // namespace
}  // namespace foreshock::alerts
