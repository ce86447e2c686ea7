#include "wire/validation.h"

#include <gtest/gtest.h>

#include <limits>

#include <cmath>

#include <string>

namespace foreshock::wire {
namespace {

namespace v1 = foreshock::v1;

v1::Tensor Tensor(v1::DType dtype, std::vector<int64_t> shape, int64_t bytes) {
  v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  t.set_data(std::string(static_cast<size_t>(bytes), '\0'));
  return t;
}

class ValidationTest : public ::testing::Test {
 protected:
  ValidationTest() {
    context_.run_id = "run";
    context_.model.set_n_layers(4);
    context_.model.set_n_heads(2);
    context_.model.set_n_experts(8);
    context_.model.add_moe_layers(1);
    limits_.max_tokens = 64;
    limits_.max_head_dim = 32;
  }

  v1::Record QK(std::vector<int64_t> q_shape, std::vector<int64_t> k_shape,
                v1::DType dtype = v1::BFLOAT16) {
    v1::Record record;
    record.set_step(5);
    auto* qk = record.mutable_qk();
    qk->set_layer(2);
    // Byte lengths of well-formed tensors; a shape with non-positive dims gets 16 bytes.
    int64_t qn = 2, kn = 2;
    for (int64_t d : q_shape) qn *= d;
    for (int64_t d : k_shape) kn *= d;
    if (qn <= 0) qn = 16;
    if (kn <= 0) kn = 16;
    *qk->mutable_q() = Tensor(dtype, q_shape, qn);
    *qk->mutable_k() = Tensor(dtype, k_shape, kn);
    return record;
  }

  std::optional<Rejection> Validate(v1::Record record) {
    detectors::Sample sample;
    return ValidateRecord(record, context_, limits_, sample);
  }

  StreamContext context_;
  RecordLimits limits_;
};

TEST_F(ValidationTest, AcceptsWellFormedQKAndMovesBytes) {
  v1::Record record = QK({2, 16, 8}, {2, 16, 8});
  detectors::Sample sample;
  ASSERT_FALSE(ValidateRecord(record, context_, limits_, sample).has_value());
  const auto& qk = std::get<detectors::QKSample>(sample.payload);
  EXPECT_EQ(sample.run, "run");
  EXPECT_EQ(sample.step, 5);
  EXPECT_EQ(qk.layer, 2);
  EXPECT_EQ(qk.q.dtype, detectors::DType::kBFloat16);
  EXPECT_EQ(qk.q.data.size(), 2u * 16 * 8 * 2);
  EXPECT_EQ(qk.q.shape, (std::vector<int64_t>{2, 16, 8}));
  EXPECT_GT(SampleBytes(sample), qk.q.data.size() + qk.k.data.size());
}

TEST_F(ValidationTest, RejectsByteLengthMismatch) {
  v1::Record record = QK({2, 16, 8}, {2, 16, 8});
  record.mutable_qk()->mutable_q()->mutable_data()->pop_back();
  auto r = Validate(record);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->code, reason::kByteLengthMismatch);
  EXPECT_NE(r->detail.find("511 bytes"), std::string::npos) << r->detail;
}

TEST_F(ValidationTest, RejectsShapeMismatch) {
  auto r = Validate(QK({2, 16, 8}, {2, 8, 8}));
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->code, reason::kShapeMismatch);
}

TEST_F(ValidationTest, GroupedQueryKPairsEachQueryHeadWithItsKHead) {
  context_.model.set_n_heads(8);
  auto pairing = [&](v1::Record record) {
    detectors::Sample sample;
    EXPECT_FALSE(ValidateRecord(record, context_, limits_, sample).has_value());
    const auto* qk = std::get_if<detectors::QKSample>(&sample.payload);
    return qk != nullptr ? qk->kv_head_of : std::vector<int32_t>{-1};
  };
  // Contiguous groups (HF's repeat_kv): 8 query heads over 2 K heads.
  EXPECT_EQ(pairing(QK({8, 16, 8}, {2, 16, 8})), (std::vector<int32_t>{0, 0, 0, 0, 1, 1, 1, 1}));
  EXPECT_EQ(pairing(QK({8, 16, 8}, {1, 16, 8})), std::vector<int32_t>(8, 0));  // multi-query
  // K broadcast to every head (clients before kv_head_of): no pairing needed.
  EXPECT_TRUE(pairing(QK({8, 16, 8}, {8, 16, 8})).empty());
  // An explicit mapping, e.g. interleaved groups.
  v1::Record interleaved = QK({8, 16, 8}, {2, 16, 8});
  for (int h = 0; h < 8; ++h) interleaved.mutable_qk()->add_kv_head_of(h % 2);
  EXPECT_EQ(pairing(interleaved), (std::vector<int32_t>{0, 1, 0, 1, 0, 1, 0, 1}));
  v1::Record identity = QK({8, 16, 8}, {8, 16, 8});
  for (int h = 0; h < 8; ++h) identity.mutable_qk()->add_kv_head_of(h);
  EXPECT_TRUE(pairing(identity).empty());
}

TEST_F(ValidationTest, RejectsKHeadsThatDoNotPairWithTheQueryHeads) {
  context_.model.set_n_heads(8);
  auto rejected = [&](v1::Record record, const std::string& detail) {
    auto r = Validate(std::move(record));
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(r->code, reason::kShapeMismatch);
    EXPECT_NE(r->detail.find(detail), std::string::npos) << r->detail;
  };
  rejected(QK({8, 16, 8}, {3, 16, 8}), "8 query heads cannot share 3 K heads");
  rejected(QK({8, 16, 8}, {16, 16, 8}), "kv_heads <= heads");
  v1::Record short_map = QK({8, 16, 8}, {2, 16, 8});
  short_map.mutable_qk()->add_kv_head_of(0);
  rejected(short_map, "kv_head_of has 1 entries for 8 query heads");
  v1::Record out_of_range = QK({8, 16, 8}, {2, 16, 8});
  for (int h = 0; h < 8; ++h) out_of_range.mutable_qk()->add_kv_head_of(h == 5 ? 2 : 0);
  rejected(out_of_range, "kv_head_of[5] = 2 is not a K head");
  v1::Record negative = QK({8, 16, 8}, {3, 16, 8});
  for (int h = 0; h < 8; ++h) negative.mutable_qk()->add_kv_head_of(h == 0 ? -1 : 0);
  rejected(negative, "kv_head_of[0] = -1");
}

TEST_F(ValidationTest, ASubsetOfHeadsNamesThem) {
  context_.model.set_n_heads(8);
  // Without names, q must hold every head.
  EXPECT_EQ(Validate(QK({2, 16, 8}, {2, 16, 8}))->code, reason::kHeadsMismatch);
  v1::Record named = QK({2, 16, 8}, {1, 16, 8});
  named.mutable_qk()->add_heads(5);
  named.mutable_qk()->add_heads(6);
  detectors::Sample sample;
  ASSERT_FALSE(ValidateRecord(named, context_, limits_, sample).has_value());
  EXPECT_EQ(std::get<detectors::QKSample>(sample.payload).heads, (std::vector<int32_t>{5, 6}));
  // The first heads of a larger model are a subset too (a rotation window at
  // head 0), not "every head": their names stay.
  v1::Record first = QK({2, 16, 8}, {1, 16, 8});
  first.mutable_qk()->add_heads(0);
  first.mutable_qk()->add_heads(1);
  ASSERT_FALSE(ValidateRecord(first, context_, limits_, sample).has_value());
  EXPECT_EQ(std::get<detectors::QKSample>(sample.payload).heads, (std::vector<int32_t>{0, 1}));
  // Every head, named in order, is the same as no names.
  v1::Record all = QK({8, 16, 8}, {2, 16, 8});
  for (int h = 0; h < 8; ++h) all.mutable_qk()->add_heads(h);
  ASSERT_FALSE(ValidateRecord(all, context_, limits_, sample).has_value());
  EXPECT_TRUE(std::get<detectors::QKSample>(sample.payload).heads.empty());
  auto rejected = [&](std::vector<int32_t> heads, const std::string& detail) {
    v1::Record record = QK({2, 16, 8}, {2, 16, 8});
    for (int32_t h : heads) record.mutable_qk()->add_heads(h);
    auto r = Validate(std::move(record));
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(r->code, reason::kHeadsMismatch);
    EXPECT_NE(r->detail.find(detail), std::string::npos) << r->detail;
  };
  rejected({3}, "heads names 1 heads for 2 rows of q");
  rejected({3, 3}, "strictly ascending in [0, 8)");
  rejected({4, 2}, "heads[1] = 2");
  rejected({7, 8}, "heads[1] = 8");
  rejected({-1, 2}, "heads[0] = -1");
}

TEST_F(ValidationTest, RejectsUnknownDType) {
  v1::Record record = QK({2, 16, 8}, {2, 16, 8});
  record.mutable_qk()->mutable_k()->set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(Validate(record)->code, reason::kUnknownDType);
  record.mutable_qk()->mutable_k()->set_dtype(static_cast<v1::DType>(42));
  EXPECT_EQ(Validate(record)->code, reason::kUnknownDType);
}

TEST_F(ValidationTest, AttentionDtypeIsOptionalAndMustBeKnown) {
  auto attention_dtype = [&](int wire) -> std::optional<detectors::DType> {
    v1::Record record = QK({2, 16, 8}, {2, 16, 8});
    record.mutable_qk()->set_attention_dtype(static_cast<v1::DType>(wire));
    detectors::Sample sample;
    EXPECT_FALSE(ValidateRecord(record, context_, limits_, sample).has_value()) << wire;
    return std::get<detectors::QKSample>(sample.payload).attention_dtype;
  };
  EXPECT_EQ(attention_dtype(v1::DTYPE_UNSPECIFIED), std::nullopt);  // not said
  EXPECT_EQ(attention_dtype(v1::FLOAT32), detectors::DType::kFloat32);
  EXPECT_EQ(attention_dtype(v1::BFLOAT16), detectors::DType::kBFloat16);
  EXPECT_EQ(attention_dtype(v1::FLOAT16), detectors::DType::kFloat16);
  v1::Record record = QK({2, 16, 8}, {2, 16, 8});
  record.mutable_qk()->set_attention_dtype(static_cast<v1::DType>(42));
  const auto rejection = Validate(record);
  ASSERT_TRUE(rejection);
  EXPECT_EQ(rejection->code, reason::kUnknownDType);
  EXPECT_NE(rejection->detail.find("attention_dtype 42"), std::string::npos) << rejection->detail;
}

TEST_F(ValidationTest, OutputCheckIsOptionalAndMustBeConsistent) {
  auto with_check = [&](double mean_signed, double rms, double mean_abs, int64_t elements) {
    v1::Record record = QK({2, 16, 8}, {2, 16, 8});
    v1::AttentionOutputCheck* check = record.mutable_qk()->mutable_output_check();
    check->set_mean_signed_error(mean_signed);
    check->set_rms_error(rms);
    check->set_mean_abs_reference(mean_abs);
    check->set_elements(elements);
    return record;
  };
  {
    v1::Record record = QK({2, 16, 8}, {2, 16, 8});
    detectors::Sample sample;
    ASSERT_FALSE(ValidateRecord(record, context_, limits_, sample).has_value());
    EXPECT_FALSE(std::get<detectors::QKSample>(sample.payload).output_check.has_value());
  }
  {
    v1::Record record = with_check(-0.002, 0.003, 0.5, 256);
    detectors::Sample sample;
    ASSERT_FALSE(ValidateRecord(record, context_, limits_, sample).has_value());
    const auto& check = std::get<detectors::QKSample>(sample.payload).output_check;
    ASSERT_TRUE(check.has_value());
    EXPECT_EQ(check->mean_signed_error, -0.002);
    EXPECT_EQ(check->rms_error, 0.003);
    EXPECT_EQ(check->mean_abs_reference, 0.5);
    EXPECT_EQ(check->elements, 256);
  }
  // Every error the same (|mean| == rms), and a NaN (the kernel's output held
  // one: the detector reports it), pass.
  EXPECT_FALSE(Validate(with_check(0.003, 0.003, 0.5, 256)).has_value());
  EXPECT_FALSE(Validate(with_check(std::nan(""), 0.003, 0.5, 256)).has_value());
  for (const v1::Record& bad : {with_check(0, 0, 0.5, 0), with_check(0, 0, 0.5, -3),
                                with_check(0, -1e-3, 0.5, 256), with_check(0, 0, -0.5, 256),
                                with_check(0.004, 0.003, 0.5, 256)}) {
    const auto rejection = Validate(bad);
    ASSERT_TRUE(rejection) << bad.ShortDebugString();
    EXPECT_EQ(rejection->code, reason::kBadOutputCheck);
    EXPECT_NE(rejection->detail.find("output_check"), std::string::npos) << rejection->detail;
  }
}

TEST_F(ValidationTest, TakesTheLogitSoftcapAndRejectsABadOne) {
  {
    v1::Record record = QK({2, 16, 8}, {2, 16, 8});
    record.mutable_qk()->set_logit_softcap(50.0f);
    detectors::Sample sample;
    ASSERT_FALSE(ValidateRecord(record, context_, limits_, sample).has_value());
    EXPECT_EQ(std::get<detectors::QKSample>(sample.payload).logit_softcap, 50.0);
  }
  for (float bad : {-1.0f, std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    v1::Record record = QK({2, 16, 8}, {2, 16, 8});
    record.mutable_qk()->set_logit_softcap(bad);
    const auto rejection = Validate(record);
    ASSERT_TRUE(rejection) << bad;
    EXPECT_EQ(rejection->code, reason::kBadSoftcap);
    EXPECT_NE(rejection->detail.find("logit_softcap"), std::string::npos) << rejection->detail;
  }
}

TEST_F(ValidationTest, RejectsShapesOverLimits) {
  EXPECT_EQ(Validate(QK({2, 65, 8}, {2, 65, 8}))->code, reason::kShapeOverLimit);
  EXPECT_EQ(Validate(QK({2, 16, 33}, {2, 16, 33}))->code, reason::kShapeOverLimit);
}

TEST_F(ValidationTest, RejectsTensorsOverTheElementLimit) {
  limits_.max_tensor_elements = 2 * 16 * 8 - 1;
  auto rejection = Validate(QK({2, 16, 8}, {2, 16, 8}));
  ASSERT_TRUE(rejection.has_value());
  EXPECT_EQ(rejection->code, reason::kTensorTooLarge);
  EXPECT_NE(rejection->detail.find("--max_tensor_elements"), std::string::npos);
  limits_.max_tensor_elements = 2 * 16 * 8;
  EXPECT_FALSE(Validate(QK({2, 16, 8}, {2, 16, 8})).has_value());

  v1::Record router;
  router.set_step(1);
  router.mutable_router()->set_layer(1);
  router.mutable_router()->set_top_k(2);
  *router.mutable_router()->mutable_logits() = Tensor(v1::FLOAT32, {32, 8}, 32 * 8 * 4);
  limits_.max_tensor_elements = 32 * 8 - 1;
  EXPECT_EQ(Validate(router)->code, reason::kTensorTooLarge);

  v1::Record curvature;
  curvature.set_step(1);
  for (int i = 0; i < 4; ++i) curvature.mutable_curvature()->add_layer_rayleigh(1.0);
  limits_.max_tensor_elements = 3;
  EXPECT_EQ(Validate(curvature)->code, reason::kTensorTooLarge);
  limits_.max_tensor_elements = 4;
  EXPECT_FALSE(Validate(curvature).has_value());
}

TEST_F(ValidationTest, RejectsBadRankAndNonPositiveDims) {
  EXPECT_EQ(Validate(QK({2, 16}, {2, 16}))->code, reason::kBadShape);
  EXPECT_EQ(Validate(QK({2, 0, 8}, {2, 0, 8}))->code, reason::kBadShape);
  EXPECT_EQ(Validate(QK({2, -4, 8}, {2, -4, 8}))->code, reason::kBadShape);
}

TEST_F(ValidationTest, HugeDimsDoNotOverflowTheLengthCheck) {
  v1::Record record = QK({1, 1, 1}, {1, 1, 1});
  auto* q = record.mutable_qk()->mutable_q();
  q->clear_shape();
  q->add_shape(int64_t{1} << 40);
  q->add_shape(int64_t{1} << 40);
  q->add_shape(int64_t{1} << 40);
  *record.mutable_qk()->mutable_k() = *q;
  EXPECT_EQ(Validate(record)->code, reason::kShapeOverLimit);
}

TEST_F(ValidationTest, RejectsLayerOutsideModel) {
  v1::Record record = QK({2, 16, 8}, {2, 16, 8});
  record.mutable_qk()->set_layer(4);
  EXPECT_EQ(Validate(record)->code, reason::kLayerOutOfRange);
  record.mutable_qk()->set_layer(-1);
  EXPECT_EQ(Validate(record)->code, reason::kLayerOutOfRange);
}

TEST_F(ValidationTest, RejectsHeadCountDisagreeingWithHello) {
  EXPECT_EQ(Validate(QK({3, 16, 8}, {3, 16, 8}))->code, reason::kHeadsMismatch);
}

TEST_F(ValidationTest, RejectsSeqLenThatDoesNotDivideTokens) {
  v1::Record record = QK({2, 16, 8}, {2, 16, 8});
  record.mutable_qk()->set_seq_len(5);
  EXPECT_EQ(Validate(record)->code, reason::kBadSeqLen);
  record.mutable_qk()->set_seq_len(8);
  EXPECT_FALSE(Validate(record).has_value());
}

TEST_F(ValidationTest, RejectsMissingPayloadAndNegativeStep) {
  v1::Record record;
  EXPECT_EQ(Validate(record)->code, reason::kMissingPayload);
  record.mutable_scalars()->set_loss(1.0);
  record.set_step(-1);
  EXPECT_EQ(Validate(record)->code, reason::kNegativeStep);
}

TEST_F(ValidationTest, ScalarsKeepPresence) {
  v1::Record record;
  record.mutable_scalars()->set_loss(2.5);
  detectors::Sample sample;
  ASSERT_FALSE(ValidateRecord(record, context_, limits_, sample).has_value());
  const auto& s = std::get<detectors::ScalarsSample>(sample.payload);
  EXPECT_TRUE(s.has_loss);
  EXPECT_FALSE(s.has_grad_norm);
  EXPECT_EQ(s.loss, 2.5);
}

TEST_F(ValidationTest, RouterChecks) {
  auto router = [&](int layer, int64_t tokens, int64_t experts, int top_k) {
    v1::Record record;
    auto* r = record.mutable_router();
    r->set_layer(layer);
    r->set_top_k(top_k);
    *r->mutable_logits() = Tensor(v1::FLOAT32, {tokens, experts}, tokens * experts * 4);
    return record;
  };
  EXPECT_FALSE(Validate(router(1, 16, 8, 2)).has_value());
  EXPECT_EQ(Validate(router(1, 16, 8, 8))->code, reason::kBadTopK);
  EXPECT_EQ(Validate(router(1, 16, 8, 0))->code, reason::kBadTopK);
  EXPECT_EQ(Validate(router(1, 16, 4, 2))->code, reason::kExpertsMismatch);
  EXPECT_EQ(Validate(router(2, 16, 8, 2))->code, reason::kNotMoeLayer);
}

TEST(ValidateHelloTest, ChecksIdsAndModelShape) {
  RecordLimits limits;
  v1::Hello hello;
  EXPECT_EQ(ValidateHello(hello, limits)->code, reason::kBadHello);
  hello.set_run_id("r");
  EXPECT_FALSE(ValidateHello(hello, limits).has_value());
  hello.set_run_id(std::string(limits.max_id_bytes + 1, 'x'));
  EXPECT_EQ(ValidateHello(hello, limits)->code, reason::kBadHello);
  hello.set_run_id("r");
  hello.mutable_model()->set_n_heads(-1);
  EXPECT_EQ(ValidateHello(hello, limits)->code, reason::kBadHello);
  hello.mutable_model()->set_n_heads(4);
  hello.mutable_model()->set_n_experts(4);
  hello.mutable_model()->set_top_k(4);
  EXPECT_EQ(ValidateHello(hello, limits)->code, reason::kBadHello);
}

TEST(ValidateHelloTest, MoeLayersAreLayersOfTheModel) {
  RecordLimits limits;
  limits.max_layers = 8;
  v1::Hello hello;
  hello.set_run_id("r");
  hello.mutable_model()->set_n_layers(4);
  for (int layer : {0, 3}) hello.mutable_model()->add_moe_layers(layer);
  EXPECT_FALSE(ValidateHello(hello, limits).has_value());
  hello.mutable_model()->add_moe_layers(4);  // == n_layers
  EXPECT_EQ(ValidateHello(hello, limits)->code, reason::kBadHello);
  hello.mutable_model()->set_moe_layers(2, 1);
  hello.mutable_model()->add_moe_layers(2);
  hello.mutable_model()->add_moe_layers(2);  // five entries for four layers
  EXPECT_EQ(ValidateHello(hello, limits)->code, reason::kBadHello);
  hello.mutable_model()->clear_moe_layers();
  hello.mutable_model()->set_n_layers(0);  // not declared: --max_layers bounds them
  hello.mutable_model()->add_moe_layers(7);
  EXPECT_FALSE(ValidateHello(hello, limits).has_value());
  hello.mutable_model()->add_moe_layers(8);
  EXPECT_EQ(ValidateHello(hello, limits)->code, reason::kBadHello);
}

TEST_F(ValidationTest, CurvatureHasAtMostOneValuePerLayer) {
  v1::Record curvature;
  curvature.set_step(1);
  for (int i = 0; i < 5; ++i) curvature.mutable_curvature()->add_layer_rayleigh(1.0);
  auto rejection = Validate(curvature);  // n_layers 4
  ASSERT_TRUE(rejection.has_value());
  EXPECT_EQ(rejection->code, reason::kTooManyLayers);
  EXPECT_NE(rejection->detail.find("n_layers from Hello"), std::string::npos);
  curvature.mutable_curvature()->mutable_layer_rayleigh()->RemoveLast();
  EXPECT_FALSE(Validate(curvature).has_value());
  context_.model.set_n_layers(0);
  limits_.max_layers = 3;
  rejection = Validate(curvature);
  ASSERT_TRUE(rejection.has_value());
  EXPECT_EQ(rejection->code, reason::kTooManyLayers);
  EXPECT_NE(rejection->detail.find("--max_layers"), std::string::npos);
}

}  // namespace
}  // namespace foreshock::wire
