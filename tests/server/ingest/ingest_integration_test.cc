// The daemon in process on ephemeral ports, fed by the real C++ client over
// loopback gRPC. Values are read back from the metrics registry and checked
// against an independent dense computation.
#include <gtest/gtest.h>

#include <Eigen/Dense>
#include <cmath>
#include <random>
#include <thread>

#include "foreshock/client.h"
#include "server/daemon.h"
#include "server/pipeline/series_store.h"
#include "tests/server/metric_reader.h"

namespace foreshock::server {
namespace {

namespace v1 = foreshock::v1;
using foreshock::testing::CounterValue;
using foreshock::testing::MetricValue;
using Matrix = Eigen::MatrixXd;

constexpr int kHeads = 3, kTokens = 24, kHeadDim = 8, kLayers = 2;

// Independent reference: forms the n x n increment and takes a dense SVD.
struct DenseQK {
  double increment_entropy, effective_rank, top1_share, second_order_ratio;
};
DenseQK DenseIncrement(const Matrix& q0, const Matrix& k0, const Matrix& q1, const Matrix& k1) {
  const Matrix dq = q1 - q0, dk = k1 - k0;
  const Matrix ds1 = (dq * k0.transpose() + q0 * dk.transpose()) / std::sqrt(double(kHeadDim));
  const Eigen::VectorXd s = Eigen::BDCSVD<Matrix>(ds1).singularValues();
  const double sum = s.sum();
  double h = 0;
  for (int i = 0; i < s.size(); ++i) {
    const double p = s[i] / sum;
    if (p > 0) h -= p * std::log(p);
  }
  const Matrix second = dq * dk.transpose() / std::sqrt(double(kHeadDim));
  return {h / std::log(2.0 * kHeadDim), std::exp(h), s[0] * s[0] / s.squaredNorm(),
          second.norm() / ds1.norm()};
}

// Mean over queries of the causal softmax entropy, and the max unmasked logit.
std::pair<double, double> DenseAttention(const Matrix& q, const Matrix& k) {
  const Matrix s = q * k.transpose() / std::sqrt(double(kHeadDim));
  double entropy = 0, max_logit = -INFINITY;
  for (int i = 0; i < s.rows(); ++i) {
    const double m = s.row(i).head(i + 1).maxCoeff();
    max_logit = std::max(max_logit, m);
    double z = 0;
    for (int j = 0; j <= i; ++j) z += std::exp(s(i, j) - m);
    double h = 0;
    for (int j = 0; j <= i; ++j) {
      const double p = std::exp(s(i, j) - m) / z;
      if (p > 0) h -= p * std::log(p);
    }
    entropy += h;
  }
  return {entropy / s.rows(), max_logit};
}

// One layer's Q or K for all heads, [heads, tokens, head_dim] row-major.
struct HeadTensors {
  std::vector<Matrix> heads;
  std::vector<float> Flat() const {
    std::vector<float> out;
    for (const Matrix& m : heads)
      for (int t = 0; t < m.rows(); ++t)
        for (int d = 0; d < m.cols(); ++d) out.push_back(static_cast<float>(m(t, d)));
    return out;
  }
  // Rounds every value to what the wire dtype carries.
  void RoundTo(v1::DType dtype) {
    for (Matrix& m : heads)
      for (int i = 0; i < m.size(); ++i) {
        const float f = static_cast<float>(m.data()[i]);
        if (dtype == v1::BFLOAT16) {
          const uint32_t bits = uint32_t{foreshock::client::FloatToBFloat16(f)} << 16;
          m.data()[i] = std::bit_cast<float>(bits);
        } else {
          m.data()[i] = f;
        }
      }
  }
};

HeadTensors Random(std::mt19937& rng, double scale) {
  std::normal_distribution<double> normal(0.0, scale);
  HeadTensors t;
  for (int h = 0; h < kHeads; ++h) {
    Matrix m(kTokens, kHeadDim);
    for (int i = 0; i < m.size(); ++i) m.data()[i] = normal(rng);
    t.heads.push_back(m);
  }
  return t;
}

HeadTensors Perturb(const HeadTensors& base, std::mt19937& rng, double scale) {
  HeadTensors t = base;
  std::normal_distribution<double> normal(0.0, scale);
  for (Matrix& m : t.heads)
    for (int i = 0; i < m.size(); ++i) m.data()[i] += normal(rng);
  return t;
}

v1::Record QKRecord(int64_t step, int layer, const HeadTensors& q, const HeadTensors& k,
                    v1::DType dtype) {
  v1::Record record;
  record.set_step(step);
  auto* qk = record.mutable_qk();
  qk->set_layer(layer);
  qk->set_causal(true);
  const std::vector<float> qf = q.Flat(), kf = k.Flat();
  *qk->mutable_q() = client::MakeTensor(dtype, {kHeads, kTokens, kHeadDim}, qf.data(), qf.size());
  *qk->mutable_k() = client::MakeTensor(dtype, {kHeads, kTokens, kHeadDim}, kf.data(), kf.size());
  return record;
}

class IngestIntegrationTest : public ::testing::Test {
 protected:
  void SetUp() override { StartDaemon(DaemonOptions()); }

  void StartDaemon(DaemonOptions options) {
    options.listen = "127.0.0.1:0";
    options.metrics_listen = "127.0.0.1:0";
    options.workers = 2;
    options.limits.max_tokens = 256;
    options.limits.max_head_dim = 64;
    daemon_ = std::make_unique<Daemon>(options);
    ASSERT_TRUE(daemon_->Start().ok());
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(daemon_->grpc_port()),
                                   grpc::InsecureChannelCredentials());
  }

  v1::Hello MakeHello(const std::string& run) {
    v1::Hello hello;
    hello.set_run_id(run);
    hello.set_job("integration-test");
    hello.mutable_model()->set_n_layers(kLayers);
    hello.mutable_model()->set_n_heads(kHeads);
    hello.mutable_model()->set_head_dim(kHeadDim);
    return hello;
  }

  double Gauge(const std::string& name, std::map<std::string, std::string> labels) {
    return MetricValue(daemon_->registry(), name, labels);
  }
  double Rejected(const std::string& reason) {
    return CounterValue(daemon_->registry(), "foreshock_ingest_rejected_total", {{"reason", reason}});
  }

  std::unique_ptr<Daemon> daemon_;
  std::shared_ptr<grpc::Channel> channel_;
};


TEST_F(IngestIntegrationTest, QKSignalsMatchDenseComputation) {
  for (v1::DType dtype : {v1::FLOAT32, v1::BFLOAT16}) {
    SCOPED_TRACE(v1::DType_Name(dtype));
    const std::string run = "qk-" + v1::DType_Name(dtype);
    std::mt19937 rng(7);
    client::IngestStream stream(channel_);
    ASSERT_TRUE(stream.Open(MakeHello(run)).ok());
    EXPECT_FALSE(stream.session_id().empty());

    std::vector<HeadTensors> q0(kLayers), k0(kLayers), q1(kLayers), k1(kLayers);
    v1::Batch first, second;
    for (int layer = 0; layer < kLayers; ++layer) {
      q0[layer] = Random(rng, 1.0);
      k0[layer] = Random(rng, 1.0);
      q1[layer] = Perturb(q0[layer], rng, 0.05);
      k1[layer] = Perturb(k0[layer], rng, 0.05);
      *first.add_records() = QKRecord(100, layer, q0[layer], k0[layer], dtype);
      *second.add_records() = QKRecord(110, layer, q1[layer], k1[layer], dtype);
      for (HeadTensors* t : {&q0[layer], &k0[layer], &q1[layer], &k1[layer]}) t->RoundTo(dtype);
    }
    v1::Record scalars;
    scalars.set_step(110);
    scalars.mutable_scalars()->set_loss(3.25);
    scalars.mutable_scalars()->set_grad_norm(0.5);
    *second.add_records() = scalars;

    auto ack1 = stream.SendAndWait(first);
    ASSERT_TRUE(ack1.has_value());
    EXPECT_EQ(ack1->accepted(), static_cast<uint32_t>(kLayers));
    EXPECT_EQ(ack1->rejections_size(), 0);
    auto ack2 = stream.SendAndWait(second);
    ASSERT_TRUE(ack2.has_value());
    EXPECT_EQ(ack2->accepted(), static_cast<uint32_t>(kLayers + 1));
    EXPECT_TRUE(stream.Close().ok());
    daemon_->WaitIdle();

    for (int layer = 0; layer < kLayers; ++layer) {
      double min_entropy = INFINITY, min_rank = INFINITY, max_share = 0, max_second = 0;
      double min_attention = INFINITY, max_logit = -INFINITY;
      for (int h = 0; h < kHeads; ++h) {
        const DenseQK d = DenseIncrement(q0[layer].heads[h], k0[layer].heads[h],
                                         q1[layer].heads[h], k1[layer].heads[h]);
        min_entropy = std::min(min_entropy, d.increment_entropy);
        min_rank = std::min(min_rank, d.effective_rank);
        max_share = std::max(max_share, d.top1_share);
        max_second = std::max(max_second, d.second_order_ratio);
        auto [entropy, logit] = DenseAttention(q1[layer].heads[h], k1[layer].heads[h]);
        min_attention = std::min(min_attention, entropy);
        max_logit = std::max(max_logit, logit);
      }
      const std::map<std::string, std::string> labels{{"run", run}, {"layer", std::to_string(layer)}};
      // The detector computes in float on bf16/fp32 inputs: agree to ~1e-4 relative.
      EXPECT_NEAR(Gauge("foreshock_qk_increment_entropy", labels), min_entropy, 1e-4 * min_entropy);
      EXPECT_NEAR(Gauge("foreshock_qk_increment_effective_rank", labels), min_rank, 1e-3 * min_rank);
      EXPECT_NEAR(Gauge("foreshock_qk_increment_top1_share", labels), max_share, 1e-3 * max_share);
      EXPECT_NEAR(Gauge("foreshock_qk_second_order_ratio", labels), max_second, 1e-3 * max_second);
      EXPECT_NEAR(Gauge("foreshock_attention_entropy", labels), min_attention, 1e-4 * min_attention);
      EXPECT_NEAR(Gauge("foreshock_attention_max_logit", labels), max_logit, 1e-4 * std::abs(max_logit));
      // Per-head values are not exported without --per_head_metrics ...
      auto head_labels = labels;
      head_labels["head"] = "0";
      EXPECT_TRUE(std::isnan(Gauge("foreshock_qk_increment_entropy", head_labels)));
      // ... but the store keeps every head's series.
      auto points = daemon_->store().Range(SeriesKey{run, "qk_increment_entropy", layer, 0}, 0, 1000);
      ASSERT_EQ(points.size(), 1u);
      EXPECT_EQ(points[0].step, 110);
    }
    EXPECT_DOUBLE_EQ(Gauge("foreshock_loss", {{"run", run}}), 3.25);
    EXPECT_DOUBLE_EQ(Gauge("foreshock_grad_norm", {{"run", run}}), 0.5);
    EXPECT_DOUBLE_EQ(Gauge("foreshock_last_step", {{"run", run}}), 110);
    EXPECT_DOUBLE_EQ(Gauge("foreshock_run_info", {{"run", run},
                                                  {"job_name", "integration-test"},
                                                  {"n_layers", "2"},
                                                  {"n_heads", "3"},
                                                  {"head_dim", "8"},
                                                  {"n_experts", "0"}}),
                     1.0);
  }
  EXPECT_EQ(CounterValue(daemon_->registry(), "foreshock_ingest_records_total", {{"kind", "qk"}}),
            4 * kLayers);
}

TEST_F(IngestIntegrationTest, PerHeadMetricsCarryTheHeadLabel) {
  daemon_.reset();
  DaemonOptions options;
  options.per_head_metrics = true;
  StartDaemon(options);
  std::mt19937 rng(3);
  client::IngestStream stream(channel_);
  ASSERT_TRUE(stream.Open(MakeHello("heads")).ok());
  const HeadTensors q = Random(rng, 1), k = Random(rng, 1);
  v1::Batch batch;
  *batch.add_records() = QKRecord(1, 0, q, k, v1::FLOAT32);
  ASSERT_TRUE(stream.SendAndWait(batch).has_value());
  daemon_->WaitIdle();
  double min_head = INFINITY;
  for (int h = 0; h < kHeads; ++h) {
    const double v = Gauge("foreshock_attention_entropy", {{"run", "heads"}, {"layer", "0"}, {"head", std::to_string(h)}});
    ASSERT_FALSE(std::isnan(v)) << "head " << h;
    min_head = std::min(min_head, v);
  }
  EXPECT_DOUBLE_EQ(Gauge("foreshock_attention_entropy", {{"run", "heads"}, {"layer", "0"}}), min_head);
}

TEST_F(IngestIntegrationTest, BadRecordsAreRejectedWithReasonsWhileGoodOnesFlow) {
  client::IngestStream stream(channel_);
  ASSERT_TRUE(stream.Open(MakeHello("bad")).ok());
  std::mt19937 rng(11);
  const HeadTensors q = Random(rng, 1), k = Random(rng, 1);

  struct Case {
    std::string reason;
    v1::Record record;
  };
  std::vector<Case> cases;
  {
    v1::Record r = QKRecord(1, 0, q, k, v1::BFLOAT16);
    r.mutable_qk()->mutable_q()->mutable_data()->resize(10);
    cases.push_back({"byte_length_mismatch", r});
  }
  {
    v1::Record r = QKRecord(1, 0, q, k, v1::BFLOAT16);
    r.mutable_qk()->mutable_k()->set_shape(1, kTokens / 2);
    cases.push_back({"shape_mismatch", r});
  }
  {
    v1::Record r = QKRecord(1, 0, q, k, v1::BFLOAT16);
    r.mutable_qk()->mutable_q()->set_dtype(v1::DTYPE_UNSPECIFIED);
    cases.push_back({"unknown_dtype", r});
  }
  {
    v1::Record r = QKRecord(1, 0, q, k, v1::BFLOAT16);
    for (auto* t : {r.mutable_qk()->mutable_q(), r.mutable_qk()->mutable_k()}) {
      t->set_shape(1, 512);  // above --max_tokens 256
      t->mutable_data()->resize(size_t{kHeads} * 512 * kHeadDim * 2);
    }
    cases.push_back({"shape_over_limit", r});
  }
  {
    v1::Record r = QKRecord(1, 0, q, k, v1::BFLOAT16);
    for (auto* t : {r.mutable_qk()->mutable_q(), r.mutable_qk()->mutable_k()}) {
      t->set_shape(2, 128);  // above --max_head_dim 64
      t->mutable_data()->resize(size_t{kHeads} * kTokens * 128 * 2);
    }
    cases.push_back({"shape_over_limit", r});
  }
  {
    v1::Record r = QKRecord(1, kLayers, q, k, v1::BFLOAT16);  // layer == n_layers
    cases.push_back({"layer_out_of_range", r});
  }

  v1::Batch batch;
  for (const Case& c : cases) *batch.add_records() = c.record;
  *batch.add_records() = QKRecord(1, 1, q, k, v1::BFLOAT16);  // a good one, last
  std::map<std::string, double> before;
  for (const Case& c : cases) before[c.reason] = Rejected(c.reason);

  auto ack = stream.SendAndWait(batch);
  ASSERT_TRUE(ack.has_value());
  EXPECT_EQ(ack->accepted(), 1u);
  ASSERT_EQ(ack->rejections_size(), static_cast<int>(cases.size()));
  std::map<std::string, int> expected_increments;
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(ack->rejections(i).index(), i);
    EXPECT_EQ(ack->rejections(i).reason().rfind(cases[i].reason + ": ", 0), 0u)
        << ack->rejections(i).reason();
    expected_increments[cases[i].reason]++;
  }
  for (const auto& [reason, n] : expected_increments) {
    EXPECT_EQ(Rejected(reason), before[reason] + n) << reason;
  }

  // A batch whose seq does not increase is rejected record by record.
  v1::Batch replay;
  *replay.add_records() = QKRecord(2, 0, q, k, v1::BFLOAT16);
  auto seq_ack = stream.SendAndWait(replay, /*seq=*/1);
  ASSERT_TRUE(seq_ack.has_value());
  EXPECT_EQ(seq_ack->accepted(), 0u);
  ASSERT_EQ(seq_ack->rejections_size(), 1);
  EXPECT_EQ(seq_ack->rejections(0).reason().rfind("non_increasing_seq: ", 0), 0u);
  EXPECT_EQ(Rejected("non_increasing_seq"), 1);

  // The stream keeps serving after all of that.
  v1::Batch good;
  *good.add_records() = QKRecord(3, 0, q, k, v1::BFLOAT16);
  auto good_ack = stream.SendAndWait(good);
  ASSERT_TRUE(good_ack.has_value());
  EXPECT_EQ(good_ack->accepted(), 1u);
  EXPECT_TRUE(stream.Close().ok());
}

TEST_F(IngestIntegrationTest, MalformedStreamsEndWithInvalidArgumentAndDaemonKeepsServing) {
  {  // Batch before Hello.
    grpc::ClientContext context;
    auto stub = v1::Ingest::NewStub(channel_);
    auto stream = stub->Stream(&context);
    v1::StreamRequest request;
    request.mutable_batch()->set_seq(1);
    ASSERT_TRUE(stream->Write(request));
    stream->WritesDone();
    v1::StreamResponse response;
    EXPECT_FALSE(stream->Read(&response));
    grpc::Status status = stream->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(status.error_message().find("batch_before_hello"), std::string::npos);
  }
  {  // A second Hello.
    grpc::ClientContext context;
    auto stub = v1::Ingest::NewStub(channel_);
    auto stream = stub->Stream(&context);
    v1::StreamRequest request;
    *request.mutable_hello() = MakeHello("twice");
    v1::StreamResponse response;
    ASSERT_TRUE(stream->Write(request));
    ASSERT_TRUE(stream->Read(&response));
    EXPECT_TRUE(response.has_hello_ack());
    ASSERT_TRUE(stream->Write(request));
    EXPECT_FALSE(stream->Read(&response));
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {  // A Hello without a run id.
    client::IngestStream stream(channel_);
    v1::Hello hello = MakeHello("");
    grpc::Status status = stream.Open(hello);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  EXPECT_EQ(Rejected("batch_before_hello"), 1);
  EXPECT_EQ(Rejected("duplicate_hello"), 1);
  EXPECT_EQ(Rejected("bad_hello"), 1);

  client::IngestStream good(channel_);
  ASSERT_TRUE(good.Open(MakeHello("after")).ok());
  v1::Batch batch;
  batch.add_records()->mutable_scalars()->set_loss(1.0);
  auto ack = good.SendAndWait(batch);
  ASSERT_TRUE(ack.has_value());
  EXPECT_EQ(ack->accepted(), 1u);
}

TEST_F(IngestIntegrationTest, NonFiniteValuesAreCountedAndNotUsed) {
  client::IngestStream stream(channel_);
  ASSERT_TRUE(stream.Open(MakeHello("nan")).ok());
  std::mt19937 rng(5);
  HeadTensors q = Random(rng, 1), k = Random(rng, 1);
  v1::Batch clean;
  *clean.add_records() = QKRecord(1, 0, q, k, v1::FLOAT32);
  ASSERT_TRUE(stream.SendAndWait(clean).has_value());
  daemon_->WaitIdle();
  const std::map<std::string, std::string> labels{{"run", "nan"}, {"layer", "0"}};
  const double entropy_before = Gauge("foreshock_attention_entropy", labels);
  ASSERT_FALSE(std::isnan(entropy_before));

  HeadTensors bad_q = Perturb(q, rng, 1.0);
  bad_q.heads[1](3, 2) = std::numeric_limits<double>::quiet_NaN();
  bad_q.heads[2](0, 0) = std::numeric_limits<double>::infinity();
  v1::Batch dirty;
  *dirty.add_records() = QKRecord(2, 0, bad_q, k, v1::BFLOAT16);
  auto ack = stream.SendAndWait(dirty);
  ASSERT_TRUE(ack.has_value());
  EXPECT_EQ(ack->accepted(), 1u);  // non-finite is a signal, not a contract violation
  daemon_->WaitIdle();
  EXPECT_EQ(CounterValue(daemon_->registry(), "foreshock_nonfinite_values_total",
                         {{"run", "nan"}, {"kind", "qk"}}),
            2);
  EXPECT_EQ(Gauge("foreshock_attention_entropy", labels), entropy_before);
  EXPECT_TRUE(std::isnan(Gauge("foreshock_qk_increment_entropy", labels)));
}

// Issue 27 (7): an output_check against a vanishing reference (1e-300) gives
// attention_output_bias = +Inf; derived values that are not finite count as
// non-finite and are neither exported nor stored nor scored.
TEST_F(IngestIntegrationTest, NonFiniteDerivedSignalsAreCountedAndNotUsed) {
  client::IngestStream stream(channel_);
  ASSERT_TRUE(stream.Open(MakeHello("tiny-ref")).ok());
  std::mt19937 rng(7);
  const HeadTensors q = Random(rng, 1), k = Random(rng, 1);
  v1::Batch batch;
  v1::Record record = QKRecord(1, 0, q, k, v1::FLOAT32);
  record.mutable_qk()->set_attention_dtype(v1::BFLOAT16);
  v1::AttentionOutputCheck* check = record.mutable_qk()->mutable_output_check();
  // Errors of 1e6 against a reference of 1e-300 (unit roundoff 2^-8): both
  // ratios overflow to +Inf.
  check->set_mean_signed_error(1e6);
  check->set_rms_error(1e6);
  check->set_mean_abs_reference(1e-300);
  check->set_elements(4096);
  *batch.add_records() = record;
  auto ack = stream.SendAndWait(batch);
  ASSERT_TRUE(ack.has_value());
  EXPECT_EQ(ack->accepted(), 1u);
  daemon_->WaitIdle();
  EXPECT_EQ(CounterValue(daemon_->registry(), "foreshock_nonfinite_values_total",
                         {{"run", "tiny-ref"}, {"kind", "qk"}}),
            2);  // the bias and the error, both +Inf
  const std::map<std::string, std::string> labels{{"run", "tiny-ref"}, {"layer", "0"}};
  for (const char* gauge : {"foreshock_attention_output_bias", "foreshock_attention_output_error"}) {
    const double value = Gauge(gauge, labels);
    EXPECT_FALSE(std::isinf(value)) << gauge << " = " << value;
  }
  // The sample's own signals are still computed.
  EXPECT_TRUE(std::isfinite(Gauge("foreshock_attention_entropy", labels)));
}

TEST_F(IngestIntegrationTest, TinyQueueBudgetParksStreamsWithoutLosingRecords) {
  daemon_.reset();
  DaemonOptions options;
  options.max_queue_bytes = 4096;  // smaller than one QK sample: every batch waits its turn
  StartDaemon(options);
  std::mt19937 rng(9);
  const HeadTensors q = Random(rng, 1), k = Random(rng, 1);
  constexpr int kStreams = 4, kBatches = 25;
  std::vector<std::thread> senders;
  std::atomic<int> accepted{0};
  for (int s = 0; s < kStreams; ++s) {
    senders.emplace_back([&, s] {
      client::IngestStream stream(channel_);
      ASSERT_TRUE(stream.Open(MakeHello("queue-" + std::to_string(s))).ok());
      for (int b = 0; b < kBatches; ++b) {
        v1::Batch batch;
        *batch.add_records() = QKRecord(b, b % kLayers, q, k, v1::FLOAT32);
        ASSERT_TRUE(stream.Send(batch));
      }
      for (int b = 0; b < kBatches; ++b) {
        auto ack = stream.ReadAck();
        ASSERT_TRUE(ack.has_value());
        EXPECT_EQ(ack->seq(), static_cast<uint64_t>(b + 1));
        accepted += ack->accepted();
      }
      EXPECT_TRUE(stream.Close().ok());
    });
  }
  for (auto& t : senders) t.join();
  daemon_->WaitIdle();
  EXPECT_EQ(accepted.load(), kStreams * kBatches);
  EXPECT_EQ(Gauge("foreshock_streams_waiting_for_queue", {}), 0);
  EXPECT_EQ(CounterValue(daemon_->registry(), "foreshock_samples_processed_total", {{"kind", "qk"}}),
            kStreams * kBatches);
  for (int s = 0; s < kStreams; ++s) {
    EXPECT_DOUBLE_EQ(Gauge("foreshock_last_step", {{"run", "queue-" + std::to_string(s)}}), kBatches - 1);
  }
}

}  // namespace
}  // namespace foreshock::server
