// Alert configuration: the defaults, YAML overrides and their precedence,
// clear errors for unknown keys and bad values, and the checked-in
// deploy/foreshock.yaml staying equal to the code defaults.
#include "alerts/config.h"

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <set>

namespace foreshock::alerts {
namespace {

// The error message of a config that must not parse.
std::string ParseError(std::string_view yaml) {
  const absl::StatusOr<AlertConfig> config = ParseAlertConfig(yaml, "test.yaml");
  EXPECT_FALSE(config.ok()) << "parsed:\n" << yaml;
  if (config.ok()) return "";
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(config.status().message());
}

AlertConfig Parse(std::string_view yaml) {
  absl::StatusOr<AlertConfig> config = ParseAlertConfig(yaml, "test.yaml");
  EXPECT_TRUE(config.ok()) << config.status();
  return config.ok() ? *std::move(config) : AlertConfig{};
}

void ExpectSameDetector(const ChangeDetectorOptions& a, const ChangeDetectorOptions& b,
                        const std::string& where) {
  EXPECT_EQ(a.direction, b.direction) << where;
  EXPECT_EQ(a.change_detection, b.change_detection) << where;
  EXPECT_EQ(a.warmup, b.warmup) << where;
  EXPECT_EQ(a.warmup_steps, b.warmup_steps) << where;
  EXPECT_EQ(a.window, b.window) << where;
  EXPECT_EQ(a.gap, b.gap) << where;
  EXPECT_EQ(a.min_baseline, b.min_baseline) << where;
  EXPECT_DOUBLE_EQ(a.small_sample_inflation, b.small_sample_inflation) << where;
  EXPECT_DOUBLE_EQ(a.gate_inflation, b.gate_inflation) << where;
  EXPECT_EQ(a.log_scale, b.log_scale) << where;
  EXPECT_EQ(a.trend, b.trend) << where;
  EXPECT_DOUBLE_EQ(a.z_threshold, b.z_threshold) << where;
  EXPECT_DOUBLE_EQ(a.cusum_k, b.cusum_k) << where;
  EXPECT_DOUBLE_EQ(a.cusum_h, b.cusum_h) << where;
  EXPECT_DOUBLE_EQ(a.min_relative_change, b.min_relative_change) << where;
  EXPECT_DOUBLE_EQ(a.min_absolute_change, b.min_absolute_change) << where;
  EXPECT_EQ(a.persist_m, b.persist_m) << where;
  EXPECT_EQ(a.persist_n, b.persist_n) << where;
  EXPECT_EQ(a.clear_after, b.clear_after) << where;
  EXPECT_EQ(a.bound.has_value(), b.bound.has_value()) << where;
  if (a.bound && b.bound) {
    EXPECT_DOUBLE_EQ(*a.bound, *b.bound) << where;
  }
  EXPECT_DOUBLE_EQ(a.bound_growth, b.bound_growth) << where;
  EXPECT_EQ(a.bound_growth_steps, b.bound_growth_steps) << where;
  EXPECT_EQ(a.bound_without_growth.has_value(), b.bound_without_growth.has_value()) << where;
  if (a.bound_without_growth && b.bound_without_growth) {
    EXPECT_DOUBLE_EQ(*a.bound_without_growth, *b.bound_without_growth) << where;
  }
}

void ExpectSameConfig(const AlertConfig& a, const AlertConfig& b) {
  std::set<std::string> names_a, names_b;
  for (const auto& [name, s] : a.signals) names_a.insert(name);
  for (const auto& [name, s] : b.signals) names_b.insert(name);
  EXPECT_EQ(names_a, names_b);
  for (const auto& [name, sa] : a.signals) {
    const auto it = b.signals.find(name);
    if (it == b.signals.end()) continue;
    const SignalConfig& sb = it->second;
    EXPECT_EQ(sa.alertname, sb.alertname) << name;
    EXPECT_EQ(sa.enabled, sb.enabled) << name;
    EXPECT_EQ(sa.severity, sb.severity) << name;
    EXPECT_EQ(sa.per_head, sb.per_head) << name;
    EXPECT_DOUBLE_EQ(sa.head_z_correction, sb.head_z_correction) << name;
    ExpectSameDetector(sa.detector, sb.detector, name);
  }
  EXPECT_EQ(a.nonfinite.enabled, b.nonfinite.enabled);
  EXPECT_EQ(a.nonfinite.severity, b.nonfinite.severity);
  EXPECT_EQ(a.nonfinite.clear_after, b.nonfinite.clear_after);
  EXPECT_EQ(a.probable_cause.onset_window_steps, b.probable_cause.onset_window_steps);
  EXPECT_EQ(a.probable_cause.settle_steps, b.probable_cause.settle_steps);
  EXPECT_DOUBLE_EQ(a.probable_cause.lr_rise_factor, b.probable_cause.lr_rise_factor);
  EXPECT_EQ(a.probable_cause.lr_baseline_steps, b.probable_cause.lr_baseline_steps);
  EXPECT_EQ(a.probable_cause.lr_baseline_gap_steps, b.probable_cause.lr_baseline_gap_steps);
}

TEST(AlertConfigTest, DefaultsAreValidAndCoverEverySignalAlert) {
  const AlertConfig config = DefaultAlertConfig();
  EXPECT_TRUE(ValidateAlertConfig(config).ok()) << ValidateAlertConfig(config);
  std::set<std::string> alerts;
  for (const auto& [name, signal] : config.signals) alerts.insert(signal.alertname);
  for (std::string_view name : kAlertNames) {
    if (name == kNonFinite) continue;  // fed by non-finite events, not signals
    EXPECT_TRUE(alerts.contains(std::string(name))) << name;
  }
  // The directions docs/DESIGN.md §5.1 gives.
  EXPECT_EQ(config.signals.at("qk_increment_entropy").detector.direction, Direction::kDrop);
  EXPECT_EQ(config.signals.at("qk_increment_top1_share").detector.direction, Direction::kRise);
  EXPECT_EQ(config.signals.at("attention_entropy").detector.direction, Direction::kDrop);
  EXPECT_EQ(config.signals.at("router_entropy").detector.direction, Direction::kDrop);
  EXPECT_EQ(config.signals.at("router_flip_rate").detector.direction, Direction::kRise);
  EXPECT_EQ(config.signals.at("curvature_eos_ratio").detector.direction, Direction::kRise);
  // Healthy Adam sits at the edge of stability: a surge rule, no absolute bound.
  EXPECT_FALSE(config.signals.at("curvature_eos_ratio").detector.bound.has_value());
  EXPECT_TRUE(config.signals.at("attention_max_logit").detector.bound.has_value());
  // Experts that died during training fire, not the dead-expert count.
  EXPECT_FALSE(config.signals.at("router_dead_experts").enabled);
  EXPECT_TRUE(config.signals.at("router_experts_died").enabled);
}

TEST(AlertConfigTest, EmptyDocumentIsTheDefaults) {
  ExpectSameConfig(Parse(""), DefaultAlertConfig());
  ExpectSameConfig(Parse("alerts:\n"), DefaultAlertConfig());
}

TEST(AlertConfigTest, CheckedInExampleIsTheDefaults) {
  const absl::StatusOr<AlertConfig> config =
      LoadAlertConfigFile(std::string(FORESHOCK_SOURCE_DIR) + "/deploy/foreshock.yaml");
  ASSERT_TRUE(config.ok()) << config.status();
  ExpectSameConfig(*config, DefaultAlertConfig());
}

TEST(AlertConfigTest, OverridesApplyWithPrecedence) {
  const AlertConfig config = Parse(R"(
alerts:
  defaults:
    warmup: 50
    min_relative_change: 0.3
  signals:
    loss:
      warmup: 200          # the signal beats alerts.defaults
      warmup_steps: 1000
      z_threshold: 7.5
      severity: critical
    attention_max_logit:
      change_detection: true  # alert on changes too ...
      bound: null             # ... and drop the absolute guard
    router_flip_rate:
      enabled: no
    grad_norm:             # a new signal
      alert: ForeshockLossSpike
      direction: rise
      min_absolute_change: 2
  nonfinite:
    clear_after: 5
  probable_cause:
    onset_window_steps: 1000
    settle_steps: 1200
    lr_rise_factor: 5
)");
  const SignalConfig& loss = config.signals.at("loss");
  EXPECT_EQ(loss.detector.warmup, 200);
  EXPECT_EQ(loss.detector.warmup_steps, 1000);
  // The probe signals start at step 200 by default (early training's transient).
  EXPECT_EQ(config.signals.at("qk_increment_entropy").detector.warmup_steps, 200);
  EXPECT_EQ(config.signals.at("router_experts_died").detector.warmup_steps, 200);
  EXPECT_EQ(DefaultAlertConfig().signals.at("loss").detector.warmup_steps, 0);
  EXPECT_EQ(DefaultAlertConfig().signals.at("attention_output_bias").detector.warmup_steps, 0);
  EXPECT_DOUBLE_EQ(loss.detector.z_threshold, 7.5);
  EXPECT_EQ(loss.severity, "critical");
  EXPECT_DOUBLE_EQ(loss.detector.min_relative_change, 0.3);  // from alerts.defaults
  EXPECT_EQ(loss.detector.window, 100);                      // its built-in default
  // alerts.defaults beats a signal's built-in default.
  EXPECT_EQ(config.signals.at("qk_increment_entropy").detector.warmup, 50);
  EXPECT_DOUBLE_EQ(config.signals.at("qk_increment_top1_share").detector.min_relative_change, 0.3);
  EXPECT_FALSE(config.signals.at("attention_max_logit").detector.bound.has_value());
  EXPECT_TRUE(config.signals.at("attention_max_logit").detector.change_detection);
  EXPECT_FALSE(config.signals.at("router_flip_rate").enabled);
  const SignalConfig& grad_norm = config.signals.at("grad_norm");
  EXPECT_EQ(grad_norm.alertname, kLossSpike);
  EXPECT_EQ(grad_norm.detector.direction, Direction::kRise);
  EXPECT_DOUBLE_EQ(grad_norm.detector.min_absolute_change, 2.0);
  EXPECT_EQ(grad_norm.detector.warmup, 50);
  EXPECT_EQ(config.nonfinite.clear_after, 5);
  EXPECT_EQ(config.probable_cause.onset_window_steps, 1000);
  EXPECT_EQ(config.probable_cause.settle_steps, 1200);
  EXPECT_DOUBLE_EQ(config.probable_cause.lr_rise_factor, 5.0);
  EXPECT_EQ(config.probable_cause.lr_baseline_steps, 1000);  // its built-in default
}

TEST(AlertConfigTest, UnknownKeysAreErrorsWithTheirLine) {
  const std::string misspelled = ParseError(R"(alerts:
  signals:
    loss:
      z_treshold: 6
)");
  EXPECT_NE(misspelled.find("test.yaml:4:7"), std::string::npos) << misspelled;
  EXPECT_NE(misspelled.find("alerts.signals.loss.z_treshold"), std::string::npos) << misspelled;
  EXPECT_NE(misspelled.find("unknown key"), std::string::npos) << misspelled;
  EXPECT_NE(misspelled.find("z_threshold"), std::string::npos) << "lists the allowed keys";

  EXPECT_NE(ParseError("alerts:\n  signal:\n    loss: {}\n").find("alerts.signal"),
            std::string::npos);
  EXPECT_NE(ParseError("alert:\n  signals: {}\n").find("unknown top-level key"), std::string::npos);
  EXPECT_NE(ParseError("alerts:\n  nonfinite:\n    clear: 3\n").find("alerts.nonfinite.clear"),
            std::string::npos);
  // `alert` and `direction` belong to a signal, not to the shared defaults.
  EXPECT_NE(ParseError("alerts:\n  defaults:\n    direction: rise\n").find("unknown key"),
            std::string::npos);
  // A misspelled signal is not silently a new one.
  const std::string unknown_signal = ParseError("alerts:\n  signals:\n    los:\n      warmup: 3\n");
  EXPECT_NE(unknown_signal.find("alerts.signals.los: unknown signal"), std::string::npos)
      << unknown_signal;
}

TEST(AlertConfigTest, BadValuesAreErrorsThatSayWhatIsExpected) {
  struct Case {
    const char* yaml;
    const char* expected;
  };
  for (const Case& c : {
           Case{"alerts:\n  signals:\n    loss:\n      z_threshold: abc\n",
                "test.yaml:4:20: alerts.signals.loss.z_threshold: expected a number, got 'abc'"},
           Case{"alerts:\n  signals:\n    loss:\n      z_threshold: -1\n",
                "alerts.signals.loss.z_threshold: must be a finite number > 0"},
           Case{"alerts:\n  signals:\n    loss:\n      warmup: 2.5\n",
                "alerts.signals.loss.warmup: expected an integer, got '2.5'"},
           Case{"alerts:\n  signals:\n    loss:\n      window: 2\n",
                "alerts.signals.loss.window: must be an integer in [4,"},
           Case{"alerts:\n  signals:\n    loss:\n      direction: sideways\n",
                "expected rise or drop, got 'sideways'"},
           Case{"alerts:\n  signals:\n    loss:\n      severity: page\n",
                "expected one of info, warning, critical, got 'page'"},
           Case{"alerts:\n  signals:\n    loss:\n      trend: maybe\n",
                "alerts.signals.loss.trend: expected true or false, got 'maybe'"},
           Case{"alerts:\n  signals:\n    loss:\n      persist_m: 6\n",
                "persist_m: must not exceed persist_n (5), got 6"},
           Case{"alerts:\n  signals:\n    loss:\n      min_baseline: 101\n",
                "alerts.signals.loss: min_baseline: must not exceed window (100), got 101"},
           Case{"alerts:\n  signals:\n    loss:\n      small_sample_inflation: -1\n",
                "alerts.signals.loss.small_sample_inflation: must be a finite number >= 0"},
           Case{"alerts:\n  signals:\n    loss:\n      bound: [1, 2]\n",
                "alerts.signals.loss.bound: expected a single value"},
           Case{"alerts:\n  signals:\n    loss:\n      bound: 5\n      bound_growth: 2\n",
                "alerts.signals.loss: bound_growth: needs log_scale: true"},
           Case{"alerts:\n  signals:\n    attention_max_logit:\n      bound_growth_steps: 0\n",
                "alerts.signals.attention_max_logit.bound_growth_steps: must be an integer in [1,"},
           Case{"alerts:\n  signals:\n    attention_max_logit:\n      bound_without_growth: x\n",
                "alerts.signals.attention_max_logit.bound_without_growth: expected a number"},
           Case{"alerts:\n  signals:\n    loss:\n      alert: ForeshockNonFinite\n",
                "unknown alert name 'ForeshockNonFinite'"},
           Case{"alerts:\n  signals:\n    loss:\n      change_detection: false\n",
                "could never fire"},
           Case{"alerts:\n  probable_cause:\n    onset_window_steps: -5\n",
                "alerts.probable_cause.onset_window_steps: must be >= 0"},
           Case{"alerts:\n  probable_cause:\n    settle_steps: 10\n",
                "alerts.probable_cause.settle_steps: must be >= onset_window_steps (50)"},
           Case{"alerts:\n  probable_cause:\n    lr_rise_factor: 0.5\n",
                "alerts.probable_cause.lr_rise_factor: must be a finite number > 1"},
           Case{"alerts:\n  probable_cause:\n    lr_baseline_steps: 50\n",
                "must be > lr_baseline_gap_steps >= 0"},
           Case{"alerts:\n  signals:\n    loss:\n      head_z_correction: -1\n",
                "alerts.signals.loss.head_z_correction: must be a finite number >= 0, got -1"},
           Case{"alerts:\n  signals:\n    loss:\n      per_head: 2\n",
                "alerts.signals.loss.per_head: expected true or false"},
           Case{"alerts:\n  signals:\n    a@h1:\n      alert: ForeshockLossSpike\n"
                "      direction: rise\n",
                "alerts.signals.a@h1: a signal name must not contain '@'"},
           Case{"alerts:\n  signals: [loss]\n", "alerts.signals: expected a mapping"},
           Case{"alerts: {signals: {loss: {warmup: 3}\n", "test.yaml"},  // YAML syntax error
       }) {
    const std::string error = ParseError(c.yaml);
    EXPECT_NE(error.find(c.expected), std::string::npos)
        << "expected '" << c.expected << "' in: " << error;
  }
}

TEST(AlertConfigTest, ValidateRejectsAHandBuiltBadConfig) {
  AlertConfig config = DefaultAlertConfig();
  config.signals.at("router_entropy").detector.cusum_h = 0;
  const absl::Status status = ValidateAlertConfig(config);
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("alerts.signals.router_entropy.cusum_h"), std::string::npos)
      << status;
}

TEST(AlertConfigTest, MissingFileIsNotFound) {
  const absl::StatusOr<AlertConfig> config = LoadAlertConfigFile("/nonexistent/foreshock.yaml");
  EXPECT_EQ(config.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(config.status().message().find("/nonexistent/foreshock.yaml"), std::string::npos);
}

}  // namespace
}  // namespace foreshock::alerts
