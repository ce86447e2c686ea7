// foreshockctl backtest, in process: recordings written by hand (a fault run
// whose learning rate jumps, split over two streams with a resent batch; a
// control; a corrupt file) are replayed through the real validation,
// detectors and alert engine, and scored.
#include "ctl/backtest.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "alerts/config.h"
#include "foreshock/v1/ingest.pb.h"
#include "record/recording.h"

namespace foreshock::ctl {
namespace {

namespace fs = std::filesystem;
namespace v1 = foreshock::v1;

TEST(DivergenceStep, TwentyStepMeanAboveOnePointThreeTimesItsRunningMinimum) {
  std::vector<std::pair<int64_t, double>> losses;
  for (int64_t s = 0; s < 300; ++s) losses.emplace_back(s, s < 150 ? 1.0 : 2.0);
  // 6 of 20 at 2.0: mean 1.3, not above; 7 of 20: 1.35.
  EXPECT_EQ(DivergenceStep(losses, 100), 156);
  // Before the warm-up nothing counts: the running minimum starts there.
  EXPECT_EQ(DivergenceStep(losses, 200), std::nullopt);
  losses[40].second = NAN;  // non-finite counts at once, warm-up or not
  EXPECT_EQ(DivergenceStep(losses, 100), 40);
  EXPECT_EQ(DivergenceStep({}, 0), std::nullopt);
}

class BacktestTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("foreshock_backtest_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    // The curvature rule of this test, independent of the shipped defaults.
    options_.config = alerts::DefaultAlertConfig();
    alerts::ChangeDetectorOptions& c = options_.config.signals.at("curvature_eos_ratio").detector;
    c.bound.reset();
    c.warmup = 5;
    c.window = 8;
    c.gap = 2;
    c.persist_m = 3;
    c.persist_n = 3;
    c.min_relative_change = 0.5;
    // These runs' LR jumps 10x: the learning-rate alert would come first
    // (its own test below); here the curvature is what is scored.
    options_.config.signals.erase("lr_over_held_max");
    // The curvature alone is scored: no hold for another kind of alert.
    options_.config.probable_cause.curvature_needs_corroboration = false;
  }
  void TearDown() override { fs::remove_all(dir_); }

  static constexpr double kBaseLr = 1e-3;

  static double Loss(int64_t step, bool fault) {
    const double noise = 0.002 * std::sin(0.7 * static_cast<double>(step));
    return 2.0 + noise + (fault && step >= 700 ? 0.01 * static_cast<double>(step - 699) : 0.0);
  }
  static double Lr(int64_t step, bool fault) { return fault && step >= 500 ? 10 * kBaseLr : kBaseLr; }

  // One batch per step: scalars, and a curvature estimate every 10 steps
  // whose lambda is steady (rho = lambda lr / 2 ~ 0.5), so rho jumps with the LR.
  // With sharpening_, the fault is the model's: lambda itself grows 10x from
  // step 500 and the LR never moves.
  std::string Batch(uint64_t seq, int64_t step, bool fault) const {
    const double lr = sharpening_ ? kBaseLr : Lr(step, fault);
    const double lambda_scale = sharpening_ && fault && step >= 500 ? 10.0 : 1.0;
    v1::StreamRequest request;
    v1::Batch* batch = request.mutable_batch();
    batch->set_seq(seq);
    v1::Record* r = batch->add_records();
    r->set_step(step);
    r->mutable_scalars()->set_loss(Loss(step, fault));
    r->mutable_scalars()->set_grad_norm(1.0 + 0.01 * std::cos(0.3 * static_cast<double>(step)));
    r->mutable_scalars()->set_lr(lr);
    if (step % 10 == 0) {
      v1::Record* c = batch->add_records();
      c->set_step(step);
      v1::CurvatureSample* k = c->mutable_curvature();
      k->set_lambda_max(lambda_scale * (1000.0 + 50.0 * std::sin(1.3 * static_cast<double>(step))));
      k->set_residual(0.01);
      k->set_hvps(10);
      k->set_preconditioned(false);
      k->set_lr(lr);
      k->set_beta1(0.0);
    }
    return request.SerializeAsString();
  }

  static std::string Hello(const std::string& run, bool fault, bool labeled) {
    v1::StreamRequest request;
    v1::Hello* hello = request.mutable_hello();
    hello->set_run_id(run);
    hello->set_job("backtest-test");
    hello->set_first_seq(1);
    hello->set_sender_id(7);
    if (labeled) {
      (*hello->mutable_labels())["scenario"] = fault ? "lr" : "healthy";
      (*hello->mutable_labels())["config"] = "handmade";
      if (fault) {
        (*hello->mutable_labels())["injection_step"] = "500";
        (*hello->mutable_labels())["expected_cause"] = "learning_rate_too_high";
      }
    }
    return request.SerializeAsString();
  }

  // Steps [from, to) as one stream (a Hello, then a batch per step),
  // received 1 ms apart from `time_us`.
  std::string Write(const std::string& name, const std::string& run, bool fault, int64_t from,
                    int64_t to, int64_t time_us, bool resend_one = false, bool labeled = true) {
    const std::string path = (dir_ / name).string();
    record::RecordingWriter writer;
    std::string error;
    EXPECT_TRUE(writer.Create(path, &error)) << error;
    EXPECT_TRUE(writer.Append(Hello(run, fault, labeled), time_us, &error)) << error;
    for (int64_t step = from; step < to; ++step) {
      const std::string batch = Batch(static_cast<uint64_t>(step + 1), step, fault);
      EXPECT_TRUE(writer.Append(batch, time_us + 1000 * (step + 1), &error)) << error;
      if (resend_one && step == from + 3) {  // a reconnect resends an unacked batch
        EXPECT_TRUE(writer.Append(batch, time_us + 1000 * (step + 1) + 1, &error)) << error;
      }
    }
    EXPECT_TRUE(writer.Close(&error)) << error;
    return path;
  }

  fs::path dir_;
  BacktestOptions options_;
  bool sharpening_ = false;
};

TEST_F(BacktestTest, ScoresAFaultRunSplitOverTwoStreamsAndAControl) {
  std::vector<std::pair<int64_t, double>> fault_losses;
  for (int64_t s = 0; s < 900; ++s) fault_losses.emplace_back(s, Loss(s, true));
  const std::optional<int64_t> divergence = DivergenceStep(fault_losses, 100);
  ASSERT_TRUE(divergence);
  ASSERT_GT(*divergence, 700);

  // The second stream's file sorts first: grouping and the merge go by the
  // Hello's run and by receive time, not by file name.
  const std::vector<std::string> files = {
      Write("b-fault-second.fsrec", "fault-run", true, 400, 900, 2'000'000, /*resend_one=*/true),
      Write("a-fault-first.fsrec", "fault-run", true, 0, 400, 1'000'000),
      Write("control.fsrec", "control-run", false, 0, 900, 1'000'000),
  };
  const BacktestResult result = RunBacktest(files, options_);
  EXPECT_TRUE(result.errors.empty());
  ASSERT_EQ(result.runs.size(), 2u);

  const BacktestRun& control = result.runs[0];
  EXPECT_EQ(control.run_id, "control-run");
  EXPECT_FALSE(control.fault);
  EXPECT_TRUE(control.fired.empty()) << control.fired.front().alertname;
  EXPECT_EQ(control.false_alarms, 0);
  EXPECT_EQ(control.divergence_step, std::nullopt);

  const BacktestRun& fault = result.runs[1];
  EXPECT_EQ(fault.run_id, "fault-run");
  EXPECT_EQ(fault.files.size(), 2u);
  EXPECT_TRUE(fault.error.empty()) << fault.error;
  EXPECT_TRUE(fault.fault);
  EXPECT_EQ(fault.duplicate_batches, 1u);
  EXPECT_EQ(fault.rejected, 0u);
  EXPECT_EQ(fault.records, 900u + 90u);
  EXPECT_EQ(fault.last_step, 899);
  EXPECT_EQ(fault.injection_step, 500);
  EXPECT_EQ(fault.divergence_step, divergence);
  // rho jumps 10x at step 500 with the LR; 3 of 3 estimates: fires at 520.
  ASSERT_TRUE(fault.first_alert);
  EXPECT_EQ(fault.first_alert->alertname, "ForeshockCurvatureAboveEdge");
  EXPECT_EQ(fault.first_alert->step, 520);
  EXPECT_EQ(fault.first_alert->first_step, 500);
  EXPECT_EQ(fault.lead, *divergence - 520);
  ASSERT_TRUE(fault.lead_fraction);
  EXPECT_DOUBLE_EQ(*fault.lead_fraction,
                   static_cast<double>(*divergence - 520) / static_cast<double>(*divergence - 500));
  EXPECT_EQ(fault.first_alert->probable_cause, "learning_rate_too_high");
  EXPECT_EQ(fault.cause, "learning_rate_too_high");
  EXPECT_TRUE(fault.cause_correct());
  EXPECT_EQ(fault.false_alarms, 0);
  // The loss baselines see the loss climbing only after the curvature alert.
  for (const char* name : {"olmo", "megatron", "nan", "gradnorm_z"}) {
    ASSERT_TRUE(fault.baselines.count(name)) << name;
    EXPECT_FALSE(fault.baselines.at(name).early) << name;
    if (fault.baselines.at(name).first) {
      EXPECT_GT(*fault.baselines.at(name).first, 520) << name;
    }
  }

  const nlohmann::json doc = nlohmann::json::parse(BacktestJson(result));
  ASSERT_EQ(doc["runs"].size(), 2u);
  const nlohmann::json& row = doc["runs"][1];
  EXPECT_EQ(row["run_id"], "fault-run");
  EXPECT_EQ(row["first_alert_step"], 520);
  EXPECT_EQ(row["divergence_step"], *divergence);
  EXPECT_EQ(row["lead"], *divergence - 520);
  EXPECT_EQ(row["cause"], "learning_rate_too_high");
  EXPECT_EQ(row["false_alarms"], 0);
  EXPECT_EQ(doc["summary"]["fault_runs"], 1);
  EXPECT_EQ(doc["summary"]["alerted_before_divergence"], 1);
  EXPECT_EQ(doc["summary"]["cause_correct"], 1);
  EXPECT_EQ(doc["summary"]["controls_alerted"], 0);

  const std::string table = BacktestTable(result);
  EXPECT_NE(table.find("fault-run"), std::string::npos);
  EXPECT_NE(BacktestSummary(result).find("alerted before divergence: 1/1"), std::string::npos);
}

TEST_F(BacktestTest, AlertsBeforeTheInjectionAreFalseAlarmsAndUnlabeledRunsAreJudgedByDivergence) {
  // The same fault, labeled as injected at step 600: the alert at 520 is early.
  BacktestOptions options = options_;
  BacktestResult result;
  {
    record::RecordingWriter writer;
    std::string error;
    const std::string path = (dir_ / "late.fsrec").string();
    ASSERT_TRUE(writer.Create(path, &error)) << error;
    v1::StreamRequest hello;
    hello.ParseFromString(Hello("late-run", true, true));
    (*hello.mutable_hello()->mutable_labels())["injection_step"] = "600";
    ASSERT_TRUE(writer.Append(hello.SerializeAsString(), 1, &error));
    for (int64_t step = 0; step < 900; ++step) {
      ASSERT_TRUE(writer.Append(Batch(static_cast<uint64_t>(step + 1), step, true), 2 + step, &error));
    }
    ASSERT_TRUE(writer.Close(&error));
    result = RunBacktest({path}, options);
  }
  ASSERT_EQ(result.runs.size(), 1u);
  EXPECT_GE(result.runs[0].false_alarms, 1);
  EXPECT_TRUE(result.runs[0].baselines.count("olmo"));

  // Unlabeled: a run that diverged is a fault run (no false alarms to judge),
  // one that did not is a control.
  const std::vector<std::string> files = {Write("u-fault.fsrec", "unlabeled-fault", true, 0, 900, 1, false, /*labeled=*/false),
           Write("u-ok.fsrec", "unlabeled-ok", false, 0, 900, 1, false, /*labeled=*/false)};
  result = RunBacktest(files, options);
  ASSERT_EQ(result.runs.size(), 2u);
  EXPECT_TRUE(result.runs[0].fault);
  EXPECT_EQ(result.runs[0].run_id, "unlabeled-fault");
  ASSERT_TRUE(result.runs[0].first_alert);
  EXPECT_EQ(result.runs[0].first_alert->step, 520);
  EXPECT_EQ(result.runs[0].false_alarms, 0);
  EXPECT_FALSE(result.runs[1].fault);
}

// With the shipped learning-rate rule, the 10x LR jump is the first alert,
// at the injection step itself: the whole injection -> divergence interval
// is lead, and the cause is the learning rate.
TEST_F(BacktestTest, TheLearningRateJumpIsAlertedAtTheInjection) {
  BacktestOptions options = options_;
  options.config.signals["lr_over_held_max"] =
      alerts::DefaultAlertConfig().signals.at("lr_over_held_max");
  const BacktestResult result =
      RunBacktest({Write("fault.fsrec", "fault-run", true, 0, 900, 1),
                   Write("control.fsrec", "control-run", false, 0, 900, 1)},
                  options);
  ASSERT_EQ(result.runs.size(), 2u);
  EXPECT_TRUE(result.runs[0].fired.empty());  // a constant LR: nothing
  const BacktestRun& fault = result.runs[1];
  ASSERT_TRUE(fault.first_alert);
  EXPECT_EQ(fault.first_alert->alertname, "ForeshockLearningRateSurge");
  EXPECT_EQ(fault.first_alert->step, 500);
  ASSERT_TRUE(fault.lead_fraction);
  EXPECT_DOUBLE_EQ(*fault.lead_fraction, 1.0);
  EXPECT_EQ(fault.first_alert->probable_cause, "learning_rate_too_high");
  EXPECT_EQ(fault.cause, "learning_rate_too_high");
  EXPECT_EQ(fault.false_alarms, 0);
}

// Issue 33: the mechanism row reads no learning rate by any path. rho and
// its threshold tau are computed from the LR the client read from the
// optimizer, so they are direct checks; lambda is the mechanism.
TEST_F(BacktestTest, TheMechanismRowJudgesLambdaAndTheDirectRowTheRatioThatReadsTheLearningRate) {
  options_.config.signals.at("curvature_lambda_max").detector =
      options_.config.signals.at("curvature_eos_ratio").detector;  // the test's rule
  options_.config.signals.at("curvature_lambda_max").detector.min_absolute_change = 0;
  // The first curvature alert the backtest saw fire.
  auto first_alert = [&](BacktestOptions::Signals mode, const std::vector<std::string>& files) {
    BacktestOptions options = options_;
    options.signals = mode;
    const BacktestResult result = RunBacktest(files, options);
    EXPECT_EQ(result.runs.size(), 1u);
    std::optional<FiredAlert> curvature;
    for (const BacktestRun& run : result.runs) {
      for (const FiredAlert& alert : run.fired) {
        if (alert.alertname == "ForeshockCurvatureAboveEdge" && !curvature) curvature = alert;
      }
    }
    return curvature;
  };
  // The LR jumps 10x and lambda stays: only what reads the LR sees it.
  const std::vector<std::string> lr_jump = {Write("lr.fsrec", "lr-run", true, 0, 900, 1)};
  EXPECT_FALSE(first_alert(BacktestOptions::Signals::kMechanism, lr_jump));
  const std::optional<FiredAlert> direct = first_alert(BacktestOptions::Signals::kDirect, lr_jump);
  ASSERT_TRUE(direct);
  EXPECT_EQ(direct->alertname, "ForeshockCurvatureAboveEdge");
  EXPECT_EQ(direct->signal, "curvature_eos_ratio");
  EXPECT_EQ(direct->step, 520);

  // lambda itself grows 10x at a constant LR: the mechanism row fires on it,
  // and names the learning rate (curvature is LR evidence) without reading it.
  sharpening_ = true;
  const std::vector<std::string> sharpening = {Write("sharp.fsrec", "sharp-run", true, 0, 900, 1)};
  const std::optional<FiredAlert> mechanism =
      first_alert(BacktestOptions::Signals::kMechanism, sharpening);
  ASSERT_TRUE(mechanism);
  EXPECT_EQ(mechanism->alertname, "ForeshockCurvatureAboveEdge");
  EXPECT_EQ(mechanism->signal, "curvature_lambda_max");
  EXPECT_EQ(mechanism->step, 520);
  EXPECT_EQ(mechanism->probable_cause, "learning_rate_too_high");

  // no_lr (a job that streams no LR): what reads the LR is held back, the
  // output check is not.
  EXPECT_FALSE(first_alert(BacktestOptions::Signals::kNoLr, lr_jump));
  sharpening_ = true;
  const std::optional<FiredAlert> no_lr = first_alert(BacktestOptions::Signals::kNoLr, sharpening);
  ASSERT_TRUE(no_lr);
  EXPECT_EQ(no_lr->signal, "curvature_lambda_max");
  EXPECT_EQ(ParseBacktestSignals("no_lr"), BacktestOptions::Signals::kNoLr);
  for (const char* signal : {"lr", "lr_over_held_max", "curvature_eos_ratio",
                             "curvature_eos_threshold"}) {
    EXPECT_FALSE(BacktestDelivers(BacktestOptions::Signals::kNoLr, signal)) << signal;
  }
  for (const char* signal : {"attention_output_bias", "attention_output_error",
                             "attention_max_logit", "curvature_lambda_max"}) {
    EXPECT_TRUE(BacktestDelivers(BacktestOptions::Signals::kNoLr, signal)) << signal;
    EXPECT_EQ(BacktestDelivers(BacktestOptions::Signals::kMechanism, signal),
              std::string_view(signal).rfind("attention_output", 0) != 0)
        << signal;
  }
}

TEST_F(BacktestTest, UnreadableAndCorruptFilesAreReportedAndTheRestIsScored) {
  const std::string good = Write("good.fsrec", "good-run", false, 0, 300, 1);
  const std::string torn = Write("torn.fsrec", "torn-run", false, 0, 300, 1);
  // Flip a payload byte near the end: a CRC mismatch there.
  {
    std::fstream f(torn, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-5, std::ios::end);
    f.put('\x55');
  }
  const std::string missing = (dir_ / "missing.fsrec").string();
  const std::string not_a_recording = (dir_ / "text.fsrec").string();
  std::ofstream(not_a_recording) << "hello";
  const BacktestResult result = RunBacktest({good, torn, missing, not_a_recording}, options_);
  EXPECT_EQ(result.errors.size(), 2u);
  ASSERT_EQ(result.runs.size(), 2u);
  EXPECT_EQ(result.runs[0].run_id, "good-run");
  EXPECT_TRUE(result.runs[0].error.empty());
  EXPECT_EQ(result.runs[1].run_id, "torn-run");
  EXPECT_NE(result.runs[1].error.find("CRC"), std::string::npos) << result.runs[1].error;
  EXPECT_GT(result.runs[1].records, 0u);  // frames before the corrupt one were scored
}

}  // namespace
}  // namespace foreshock::ctl
