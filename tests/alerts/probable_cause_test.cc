// The probable-cause rule table, row by row (probable_cause.h).
#include "alerts/probable_cause.h"

#include <gtest/gtest.h>

#include <ostream>
#include <string>

#include "alerts/config.h"

namespace foreshock::alerts {
namespace {

struct Row {
  bool qk_spectrum, attention_logits, router_collapse, router_imbalance, curvature, lr_rise;
  ProbableCause expected;
  // The attention evidence (QK spectrum, logits) began before the learning-rate evidence.
  bool attention_first = true;
};

void PrintTo(const Row& row, std::ostream* os) {
  *os << "{qk " << row.qk_spectrum << ", logits " << row.attention_logits << ", router_collapse "
      << row.router_collapse << ", router_imbalance " << row.router_imbalance << ", curvature "
      << row.curvature << ", lr_rise " << row.lr_rise << ", attention first "
      << row.attention_first << " -> " << ProbableCauseName(row.expected) << "}";
}

class ProbableCauseTableTest : public ::testing::TestWithParam<Row> {};

TEST_P(ProbableCauseTableTest, ClassifiesTheRow) {
  const Row& row = GetParam();
  CauseEvidence evidence;
  evidence.qk_spectrum = row.qk_spectrum;
  evidence.attention_logits = row.attention_logits;
  evidence.router_collapse = row.router_collapse;
  evidence.router_imbalance = row.router_imbalance;
  evidence.curvature = row.curvature;
  evidence.lr_rise = row.lr_rise;
  evidence.qk_before_learning_rate = row.qk_spectrum && row.attention_first;
  evidence.attention_before_learning_rate = row.attention_logits && row.attention_first;
  EXPECT_EQ(ProbableCauseName(ClassifyProbableCause(evidence)), ProbableCauseName(row.expected));
}

constexpr bool Y = true, N = false;
using PC = ProbableCause;

// Grouped by the table's rows (probable_cause.h). Columns: qk spectrum,
// attention logits, router collapse, router imbalance, curvature, LR rise.
INSTANTIATE_TEST_SUITE_P(
    Rows, ProbableCauseTableTest,
    ::testing::Values(
        // attention evidence that began first + any learning-rate evidence -> combined
        Row{Y, N, N, N, N, Y, PC::kCombined}, Row{Y, Y, N, N, N, Y, PC::kCombined},
        Row{Y, N, Y, N, N, N, PC::kCombined}, Row{Y, N, N, N, Y, N, PC::kCombined},
        Row{Y, Y, Y, Y, Y, Y, PC::kCombined}, Row{N, Y, N, N, N, Y, PC::kCombined},
        // learning-rate evidence with attention evidence that followed it ->
        // learning rate (a large update moves the attention too)
        Row{N, N, N, N, N, Y, PC::kLearningRateTooHigh},
        Row{N, N, N, N, Y, N, PC::kLearningRateTooHigh},
        Row{N, N, Y, N, Y, N, PC::kLearningRateTooHigh},
        Row{Y, N, N, N, N, Y, PC::kLearningRateTooHigh, false},
        Row{N, Y, N, N, N, Y, PC::kLearningRateTooHigh, false},
        Row{Y, Y, Y, N, Y, N, PC::kLearningRateTooHigh, false},
        Row{N, Y, Y, Y, Y, Y, PC::kLearningRateTooHigh, false},
        // attention evidence, learning-rate evidence quiet -> low-precision
        // attention, whether or not the load is imbalanced
        Row{Y, N, N, N, N, N, PC::kLowPrecisionAttention},
        Row{N, Y, N, N, N, N, PC::kLowPrecisionAttention},
        Row{Y, Y, N, N, N, N, PC::kLowPrecisionAttention},
        Row{Y, Y, N, Y, N, N, PC::kLowPrecisionAttention},
        // nothing mechanistic, or only imbalance
        Row{N, N, N, N, N, N, PC::kUnknown}, Row{N, N, N, Y, N, N, PC::kUnknown},
        // a router collapse alone (with or without imbalance) names no cause
        Row{N, N, Y, N, N, N, PC::kUnknown}, Row{N, N, Y, Y, N, N, PC::kUnknown}),
    // e.g. "qk_lr", "none"
    [](const ::testing::TestParamInfo<Row>& info) {
      std::string name;
      auto add = [&](bool present, const char* family) {
        if (!present) return;
        if (!name.empty()) name += "_";
        name += family;
      };
      add(info.param.qk_spectrum, "qk");
      add(info.param.attention_logits, "logits");
      add(info.param.router_collapse, "router_collapse");
      add(info.param.router_imbalance, "router_imbalance");
      add(info.param.curvature, "curvature");
      add(info.param.lr_rise, "lr");
      if (info.param.attention_first && (info.param.qk_spectrum || info.param.attention_logits)) {
        add(info.param.router_collapse || info.param.curvature || info.param.lr_rise, "attention_first");
      }
      return name.empty() ? std::string("none") : name;
    });

// A measured rounding bias is a precision fault whatever else fired and when,
// and whatever dtype the client declared.
TEST(ProbableCauseTest, ARoundingBiasIsPrecisionEvidenceInAnyOrder) {
  CauseEvidence bias;
  bias.rounding_bias = true;
  EXPECT_EQ(ClassifyProbableCause(bias), ProbableCause::kLowPrecisionAttention);
  CauseEvidence declared_fp32 = bias;
  declared_fp32.precision_ruled_out = true;
  EXPECT_EQ(ClassifyProbableCause(declared_fp32), ProbableCause::kLowPrecisionAttention);
  CauseEvidence with_lr = bias;
  with_lr.lr_rise = true;
  with_lr.qk_spectrum = true;  // the QK collapse came after the LR rose: not evidence itself
  EXPECT_EQ(ClassifyProbableCause(with_lr), ProbableCause::kCombined);
  CauseEvidence with_curvature = bias;
  with_curvature.curvature = true;
  EXPECT_EQ(ClassifyProbableCause(with_curvature), ProbableCause::kCombined);
}

// Router logits growing (z-loss up, routing entropy down) are the update
// size's mark on their own; the router collapse's other signals are not.
TEST(ProbableCauseTest, RouterLogitGrowthNamesTheLearningRateOnItsOwn) {
  EXPECT_EQ(EvidenceFamilyOf(kRouterCollapse, "router_z_loss"), AlertFamily::kRouterLogitGrowth);
  EXPECT_EQ(EvidenceFamilyOf(kRouterCollapse, "router_entropy"), AlertFamily::kRouterLogitGrowth);
  EXPECT_EQ(EvidenceFamilyOf(kRouterCollapse, "router_experts_died"), AlertFamily::kRouterCollapse);
  EXPECT_EQ(EvidenceFamilyOf(kRouterCollapse, "router_flip_rate"), AlertFamily::kRouterCollapse);
  EXPECT_EQ(EvidenceFamilyOf(kAttentionLogitGrowth, "router_z_loss"),
            AlertFamily::kAttentionLogits);
  CauseEvidence logits;
  logits.router_logit_growth = true;
  EXPECT_EQ(ClassifyProbableCause(logits), ProbableCause::kLearningRateTooHigh);
  CauseEvidence after_qk = logits;  // the QK spectrum collapsed first: both at fault
  after_qk.qk_spectrum = after_qk.qk_before_learning_rate = true;
  EXPECT_EQ(ClassifyProbableCause(after_qk), ProbableCause::kCombined);
  CauseEvidence before_qk = logits;  // the QK spectrum followed: the update size
  before_qk.qk_spectrum = true;
  EXPECT_EQ(ClassifyProbableCause(before_qk), ProbableCause::kLearningRateTooHigh);
  CauseEvidence died;  // dead experts alone: no cause
  died.router_collapse = true;
  EXPECT_EQ(ClassifyProbableCause(died), ProbableCause::kUnknown);
}

TEST(ProbableCauseTest, AnnotationValuesAreTheDesignNames) {
  EXPECT_EQ(ProbableCauseName(ProbableCause::kLowPrecisionAttention), "low_precision_attention");
  EXPECT_EQ(ProbableCauseName(ProbableCause::kLearningRateTooHigh), "learning_rate_too_high");
  EXPECT_EQ(ProbableCauseName(ProbableCause::kCombined), "combined");
  EXPECT_EQ(ProbableCauseName(ProbableCause::kUnknown), "unknown");
}

TEST(ProbableCauseTest, EveryAlertNameHasItsFamily) {
  EXPECT_EQ(FamilyOfAlert(kQKIncrementCollapse), AlertFamily::kQKSpectrum);
  EXPECT_EQ(FamilyOfAlert(kAttentionLogitGrowth), AlertFamily::kAttentionLogits);
  EXPECT_EQ(FamilyOfAlert(kAttentionEntropyCollapse), AlertFamily::kAttentionLogits);
  EXPECT_EQ(FamilyOfAlert(kRouterCollapse), AlertFamily::kRouterCollapse);
  EXPECT_EQ(FamilyOfAlert(kRouterImbalance), AlertFamily::kRouterImbalance);
  EXPECT_EQ(FamilyOfAlert(kCurvatureAboveEdge), AlertFamily::kCurvature);
  EXPECT_EQ(FamilyOfAlert(kLearningRateSurge), AlertFamily::kLearningRate);
  EXPECT_EQ(FamilyOfAlert(kAttentionRoundingBias), AlertFamily::kRoundingBias);
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
