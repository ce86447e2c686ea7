#include "alerts/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "alerts/text.h"

namespace foreshock::alerts {

// ---------------------------------------------------------------------------
// Field table shared by validation and YAML parsing.
// ---------------------------------------------------------------------------
namespace {

constexpr int kMaxCount = 1'000'000;
// Window-like counts bound the memory of every series.
constexpr int kMaxWindow = 10'000;

struct IntField {
  std::string_view key;
  int ChangeDetectorOptions::*member;
  int min;
  int max;
};
struct DoubleField {
  std::string_view key;
  double ChangeDetectorOptions::*member;
  double min;
  bool min_exclusive;
};
struct BoolField {
  std::string_view key;
  bool ChangeDetectorOptions::*member;
};

constexpr std::array<IntField, 10> kIntFields = {{
    {"warmup", &ChangeDetectorOptions::warmup, 0, kMaxCount},
    {"reference_interval_steps", &ChangeDetectorOptions::reference_interval_steps, 0, 1'000'000},
    {"warmup_steps", &ChangeDetectorOptions::warmup_steps, 0, 1'000'000'000},
    {"window", &ChangeDetectorOptions::window, 4, kMaxWindow},
    {"min_baseline", &ChangeDetectorOptions::min_baseline, 0, kMaxWindow},
    {"gap", &ChangeDetectorOptions::gap, 0, kMaxWindow},
    {"persist_m", &ChangeDetectorOptions::persist_m, 1, kMaxWindow},
    {"persist_n", &ChangeDetectorOptions::persist_n, 1, kMaxWindow},
    {"clear_after", &ChangeDetectorOptions::clear_after, 1, kMaxCount},
    {"bound_growth_steps", &ChangeDetectorOptions::bound_growth_steps, 1, 1'000'000'000},
}};
constexpr std::array<DoubleField, 8> kDoubleFields = {{
    {"z_threshold", &ChangeDetectorOptions::z_threshold, 0, true},
    {"small_sample_inflation", &ChangeDetectorOptions::small_sample_inflation, 0, false},
    {"gate_inflation", &ChangeDetectorOptions::gate_inflation, 0, false},
    {"cusum_k", &ChangeDetectorOptions::cusum_k, 0, false},
    {"cusum_h", &ChangeDetectorOptions::cusum_h, 0, true},
    {"min_relative_change", &ChangeDetectorOptions::min_relative_change, 0, false},
    {"min_absolute_change", &ChangeDetectorOptions::min_absolute_change, 0, false},
    {"bound_growth", &ChangeDetectorOptions::bound_growth, 0, false},
}};
constexpr std::array<BoolField, 3> kBoolFields = {{
    {"change_detection", &ChangeDetectorOptions::change_detection},
    {"trend", &ChangeDetectorOptions::trend},
    {"log_scale", &ChangeDetectorOptions::log_scale},
}};

// Keys of a signal entry that are not detector fields.
constexpr std::array<std::string_view, 8> kSignalOnlyKeys = {
    "alert",    "direction", "enabled",           "severity", "bound", "bound_without_growth",
    "per_head", "head_z_correction"};

std::string IntRangeError(const IntField& field, int value) {
  if (value < field.min || value > field.max) {
    return internal::Cat("must be an integer in [", field.min, ", ", field.max, "], got ", value);
  }
  return "";
}

std::string DoubleRangeError(const DoubleField& field, double value) {
  const bool ok =
      std::isfinite(value) && (field.min_exclusive ? value > field.min : value >= field.min);
  if (ok) return "";
  return internal::Cat("must be a finite number ", field.min_exclusive ? "> " : ">= ", field.min,
                       ", got ", value);
}

bool IsKnownSignalAlert(std::string_view name) {
  return name != kNonFinite &&
         std::find(kAlertNames.begin(), kAlertNames.end(), name) != kAlertNames.end();
}
bool IsKnownSeverity(std::string_view s) {
  return std::find(kSeverities.begin(), kSeverities.end(), s) != kSeverities.end();
}

std::string SignalAlertChoices() {
  std::vector<std::string_view> names;
  for (std::string_view n : kAlertNames) {
    if (n != kNonFinite) names.push_back(n);
  }
  return internal::Join(names, ", ");
}

// Cross-field and range checks of one signal; "" when valid.
std::string SignalError(const SignalConfig& s) {
  if (!IsKnownSignalAlert(s.alertname)) {
    return internal::Cat("alert: unknown alert name '", s.alertname, "' (one of ",
                         SignalAlertChoices(), ")");
  }
  if (!IsKnownSeverity(s.severity)) {
    return internal::Cat("severity: must be one of ", internal::Join(kSeverities, ", "), ", got '",
                         s.severity, "'");
  }
  const ChangeDetectorOptions& o = s.detector;
  for (const IntField& f : kIntFields) {
    if (std::string e = IntRangeError(f, o.*f.member); !e.empty()) {
      return internal::Cat(f.key, ": ", e);
    }
  }
  for (const DoubleField& f : kDoubleFields) {
    if (std::string e = DoubleRangeError(f, o.*f.member); !e.empty()) {
      return internal::Cat(f.key, ": ", e);
    }
  }
  if (o.persist_m > o.persist_n) {
    return internal::Cat("persist_m: must not exceed persist_n (", o.persist_n, "), got ",
                         o.persist_m);
  }
  if (o.min_baseline > o.window) {
    return internal::Cat("min_baseline: must not exceed window (", o.window, "), got ",
                         o.min_baseline);
  }
  if (o.bound && !std::isfinite(*o.bound)) return "bound: must be a finite number or null";
  if (o.bound_without_growth && !std::isfinite(*o.bound_without_growth)) {
    return "bound_without_growth: must be a finite number or null";
  }
  if (o.bound_growth > 1.0) {
    // The growth is read from the history, which holds logs only with log_scale.
    if (!o.log_scale) return "bound_growth: needs log_scale: true";
    if (o.direction != Direction::kRise) return "bound_growth: needs direction rise";
  }
  if (!std::isfinite(s.head_z_correction) || s.head_z_correction < 0) {
    return internal::Cat("head_z_correction: must be a finite number >= 0, got ",
                         s.head_z_correction);
  }
  if (s.enabled && !o.change_detection && !o.bound) {
    return "change_detection is off and no bound is set: the signal could never fire "
           "(set enabled: false instead)";
  }
  return "";
}

}  // namespace

absl::Status ValidateAlertConfig(const AlertConfig& config) {
  for (const auto& [name, signal] : config.signals) {
    if (name.find('@') != std::string::npos) {
      // '@' separates a per-head series' signal and head in the engine's keys.
      return absl::InvalidArgumentError(
          internal::Cat("alerts.signals.", name, ": a signal name must not contain '@'"));
    }
    if (std::string e = SignalError(signal); !e.empty()) {
      return absl::InvalidArgumentError(internal::Cat("alerts.signals.", name, ".", e));
    }
  }
  if (!IsKnownSeverity(config.nonfinite.severity)) {
    return absl::InvalidArgumentError(internal::Cat("alerts.nonfinite.severity: must be one of ",
                                                    internal::Join(kSeverities, ", "), ", got '",
                                                    config.nonfinite.severity, "'"));
  }
  if (config.nonfinite.clear_after < 1 || config.nonfinite.clear_after > kMaxCount) {
    return absl::InvalidArgumentError(
        internal::Cat("alerts.nonfinite.clear_after: must be an integer in [1, ", kMaxCount,
                      "], got ", config.nonfinite.clear_after));
  }
  const ProbableCauseConfig& cause = config.probable_cause;
  if (cause.onset_window_steps < 0) {
    return absl::InvalidArgumentError(internal::Cat(
        "alerts.probable_cause.onset_window_steps: must be >= 0, got ", cause.onset_window_steps));
  }
  if (cause.settle_steps < cause.onset_window_steps) {
    return absl::InvalidArgumentError(
        internal::Cat("alerts.probable_cause.settle_steps: must be >= onset_window_steps (",
                      cause.onset_window_steps, "), got ", cause.settle_steps));
  }
  if (!(cause.lr_rise_factor > 1.0) || !std::isfinite(cause.lr_rise_factor)) {
    return absl::InvalidArgumentError(internal::Cat(
        "alerts.probable_cause.lr_rise_factor: must be a finite number > 1, got ",
        cause.lr_rise_factor));
  }
  if (cause.lr_baseline_gap_steps < 0 || cause.lr_baseline_steps <= cause.lr_baseline_gap_steps) {
    return absl::InvalidArgumentError(internal::Cat(
        "alerts.probable_cause.lr_baseline_steps: must be > lr_baseline_gap_steps >= 0, got ",
        cause.lr_baseline_steps, " and ", cause.lr_baseline_gap_steps));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// YAML
// ---------------------------------------------------------------------------
namespace {

// Thrown inside the parser, turned into an InvalidArgument status at the top.
struct ConfigError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class YamlReader {
 public:
  explicit YamlReader(std::string_view source) : source_(source) {}

  [[noreturn]] void Fail(const YAML::Node& node, std::string_view path,
                         std::string_view message) const {
    std::string where(source_);
    const YAML::Mark mark = node.Mark();
    if (!mark.is_null()) where += internal::Cat(":", mark.line + 1, ":", mark.column + 1);
    throw ConfigError(internal::Cat(where, ": ", path, ": ", message));
  }

  struct Entry {
    std::string key;
    YAML::Node key_node;  // where errors about the key itself point
    YAML::Node value;
  };
  // The entries of a mapping, in file order; a null node is an empty mapping.
  std::vector<Entry> Entries(const YAML::Node& node, std::string_view path) const {
    std::vector<Entry> entries;
    if (!node.IsDefined() || node.IsNull()) return entries;
    if (!node.IsMap()) Fail(node, path, "expected a mapping");
    for (auto it = node.begin(); it != node.end(); ++it) {
      if (!it->first.IsScalar()) Fail(it->first, path, "keys must be plain strings");
      entries.push_back(Entry{it->first.Scalar(), it->first, it->second});
    }
    return entries;
  }

  std::string Scalar(const YAML::Node& node, std::string_view path) const {
    if (!node.IsScalar()) Fail(node, path, "expected a single value");
    return node.Scalar();
  }

  template <typename T>
  T As(const YAML::Node& node, std::string_view path, std::string_view expected) const {
    const std::string text = Scalar(node, path);
    try {
      return node.as<T>();
    } catch (const YAML::Exception&) {
      Fail(node, path, internal::Cat("expected ", expected, ", got '", text, "'"));
    }
  }

  double Double(const YAML::Node& node, std::string_view path) const {
    const double value = As<double>(node, path, "a number");
    if (!std::isfinite(value)) Fail(node, path, "expected a finite number");
    return value;
  }
  int Int(const YAML::Node& node, std::string_view path) const {
    return As<int>(node, path, "an integer");
  }
  bool Bool(const YAML::Node& node, std::string_view path) const {
    return As<bool>(node, path, "true or false");
  }

 private:
  std::string_view source_;
};

[[noreturn]] void FailUnknownKey(const YamlReader& reader, const YAML::Node& node,
                                 std::string_view path, std::string_view key,
                                 const std::vector<std::string_view>& allowed) {
  reader.Fail(node, internal::Cat(path, ".", key),
              internal::Cat("unknown key (allowed: ", internal::Join(allowed, ", "), ")"));
}

std::vector<std::string_view> DetectorKeys() {
  std::vector<std::string_view> keys;
  for (const IntField& f : kIntFields) keys.push_back(f.key);
  for (const DoubleField& f : kDoubleFields) keys.push_back(f.key);
  for (const BoolField& f : kBoolFields) keys.push_back(f.key);
  return keys;
}

// Applies one key of a signal entry (or of alerts.defaults) to `signal`.
// `node` is the key's value; `key_node` marks errors about the key itself.
void ApplySignalKey(const YamlReader& reader, std::string_view path, const std::string& key,
                    const YAML::Node& key_node, const YAML::Node& node, bool in_defaults,
                    SignalConfig& signal) {
  const std::string key_path = internal::Cat(path, ".", key);
  for (const IntField& f : kIntFields) {
    if (key != f.key) continue;
    const int value = reader.Int(node, key_path);
    if (std::string e = IntRangeError(f, value); !e.empty()) reader.Fail(node, key_path, e);
    signal.detector.*f.member = value;
    return;
  }
  for (const DoubleField& f : kDoubleFields) {
    if (key != f.key) continue;
    const double value = reader.Double(node, key_path);
    if (std::string e = DoubleRangeError(f, value); !e.empty()) reader.Fail(node, key_path, e);
    signal.detector.*f.member = value;
    return;
  }
  for (const BoolField& f : kBoolFields) {
    if (key != f.key) continue;
    signal.detector.*f.member = reader.Bool(node, key_path);
    return;
  }
  if (key == "enabled") {
    signal.enabled = reader.Bool(node, key_path);
  } else if (key == "severity") {
    std::string value = reader.Scalar(node, key_path);
    if (!IsKnownSeverity(value)) {
      reader.Fail(node, key_path,
                  internal::Cat("expected one of ", internal::Join(kSeverities, ", "), ", got '",
                                value, "'"));
    }
    signal.severity = std::move(value);
  } else if (key == "per_head") {
    signal.per_head = reader.Bool(node, key_path);
  } else if (key == "head_z_correction") {
    const double value = reader.Double(node, key_path);
    if (!std::isfinite(value) || value < 0) {
      reader.Fail(node, key_path, internal::Cat("must be a finite number >= 0, got ", value));
    }
    signal.head_z_correction = value;
  } else if (key == "bound" || key == "bound_without_growth") {
    std::optional<double>& bound =
        key == "bound" ? signal.detector.bound : signal.detector.bound_without_growth;
    if (node.IsNull()) {
      bound.reset();
    } else {
      bound = reader.Double(node, key_path);
    }
  } else if (key == "direction" && !in_defaults) {
    const std::string value = reader.Scalar(node, key_path);
    if (value == "rise") {
      signal.detector.direction = Direction::kRise;
    } else if (value == "drop") {
      signal.detector.direction = Direction::kDrop;
    } else {
      reader.Fail(node, key_path, internal::Cat("expected rise or drop, got '", value, "'"));
    }
  } else if (key == "alert" && !in_defaults) {
    std::string value = reader.Scalar(node, key_path);
    if (!IsKnownSignalAlert(value)) {
      reader.Fail(
          node, key_path,
          internal::Cat("unknown alert name '", value, "' (one of ", SignalAlertChoices(), ")"));
    }
    signal.alertname = std::move(value);
  } else {
    std::vector<std::string_view> allowed = DetectorKeys();
    for (std::string_view k : kSignalOnlyKeys) {
      if (!in_defaults || (k != "alert" && k != "direction")) allowed.push_back(k);
    }
    FailUnknownKey(reader, key_node, path, key, allowed);
  }
}

void ParseAlertsSection(const YamlReader& reader, const YAML::Node& alerts, AlertConfig& config) {
  YAML::Node defaults, signals, nonfinite, cause;
  for (const auto& [key, key_node, node] : reader.Entries(alerts, "alerts")) {
    if (key == "defaults") {
      defaults = node;
    } else if (key == "signals") {
      signals = node;
    } else if (key == "nonfinite") {
      nonfinite = node;
    } else if (key == "probable_cause") {
      cause = node;
    } else {
      FailUnknownKey(reader, key_node, "alerts", key,
                     {"defaults", "signals", "nonfinite", "probable_cause"});
    }
  }

  // New signals need their alert and direction before anything else applies.
  const auto signal_entries = reader.Entries(signals, "alerts.signals");
  for (const auto& [name, name_node, node] : signal_entries) {
    const std::string path = internal::Cat("alerts.signals.", name);
    if (config.signals.contains(name)) continue;
    if (!node.IsMap() || !node["alert"] || !node["direction"]) {
      std::vector<std::string_view> known;
      for (const auto& entry : config.signals) known.push_back(entry.first);
      reader.Fail(name_node, path,
                  internal::Cat("unknown signal (known: ", internal::Join(known, ", "),
                                "); a new signal needs `alert` and `direction`"));
    }
    SignalConfig added;
    ApplySignalKey(reader, path, "alert", name_node, node["alert"], false, added);
    ApplySignalKey(reader, path, "direction", name_node, node["direction"], false, added);
    config.signals.emplace(name, std::move(added));
  }

  // Precedence: code default < alerts.defaults < alerts.signals.<name>.
  const auto default_entries = reader.Entries(defaults, "alerts.defaults");
  for (auto& [name, signal] : config.signals) {
    for (const auto& [key, key_node, node] : default_entries) {
      ApplySignalKey(reader, "alerts.defaults", key, key_node, node, true, signal);
    }
  }
  for (const auto& [name, name_node, node] : signal_entries) {
    const std::string path = internal::Cat("alerts.signals.", name);
    SignalConfig& signal = config.signals.find(name)->second;
    for (const auto& [key, key_node, value] : reader.Entries(node, path)) {
      ApplySignalKey(reader, path, key, key_node, value, false, signal);
    }
    if (std::string e = SignalError(signal); !e.empty()) reader.Fail(name_node, path, e);
  }

  for (const auto& [key, key_node, node] : reader.Entries(nonfinite, "alerts.nonfinite")) {
    const std::string path = internal::Cat("alerts.nonfinite.", key);
    if (key == "enabled") {
      config.nonfinite.enabled = reader.Bool(node, path);
    } else if (key == "severity") {
      config.nonfinite.severity = reader.Scalar(node, path);
      if (!IsKnownSeverity(config.nonfinite.severity)) {
        reader.Fail(node, path,
                    internal::Cat("expected one of ", internal::Join(kSeverities, ", "), ", got '",
                                  config.nonfinite.severity, "'"));
      }
    } else if (key == "clear_after") {
      config.nonfinite.clear_after = reader.Int(node, path);
      if (config.nonfinite.clear_after < 1) reader.Fail(node, path, "must be >= 1");
    } else {
      FailUnknownKey(reader, key_node, "alerts.nonfinite", key,
                     {"enabled", "severity", "clear_after"});
    }
  }
  for (const auto& [key, key_node, node] : reader.Entries(cause, "alerts.probable_cause")) {
    const std::string path = internal::Cat("alerts.probable_cause.", key);
    auto steps = [&](int64_t& field) {
      const int64_t value = reader.As<int64_t>(node, path, "an integer");
      if (value < 0) reader.Fail(node, path, internal::Cat("must be >= 0, got ", value));
      field = value;
    };
    if (key == "onset_window_steps") {
      steps(config.probable_cause.onset_window_steps);
    } else if (key == "settle_steps") {
      steps(config.probable_cause.settle_steps);
    } else if (key == "lr_baseline_steps") {
      steps(config.probable_cause.lr_baseline_steps);
    } else if (key == "lr_baseline_gap_steps") {
      steps(config.probable_cause.lr_baseline_gap_steps);
    } else if (key == "lr_rise_factor") {
      config.probable_cause.lr_rise_factor = reader.Double(node, path);
    } else if (key == "fp32_attention_needs_corroboration") {
      config.probable_cause.fp32_attention_needs_corroboration = reader.Bool(node, path);
    } else if (key == "curvature_needs_corroboration") {
      config.probable_cause.curvature_needs_corroboration = reader.Bool(node, path);
    } else if (key == "expert_deaths_need_corroboration") {
      config.probable_cause.expert_deaths_need_corroboration = reader.Bool(node, path);
    } else if (key == "imbalance_needs_corroboration") {
      config.probable_cause.imbalance_needs_corroboration = reader.Bool(node, path);
    } else if (key == "unbiased_output_rules_out_precision") {
      config.probable_cause.unbiased_output_rules_out_precision = reader.Bool(node, path);
    } else {
      FailUnknownKey(reader, key_node, "alerts.probable_cause", key,
                     {"onset_window_steps", "settle_steps", "lr_rise_factor", "lr_baseline_steps",
                      "lr_baseline_gap_steps", "fp32_attention_needs_corroboration",
                      "curvature_needs_corroboration", "unbiased_output_rules_out_precision",
                      "expert_deaths_need_corroboration", "imbalance_needs_corroboration"});
    }
  }
}

}  // namespace

absl::StatusOr<AlertConfig> ParseAlertConfig(std::string_view yaml_text, std::string_view source) {
  AlertConfig config = DefaultAlertConfig();
  const YamlReader reader(source);
  try {
    const YAML::Node root = YAML::Load(std::string(yaml_text));
    for (const auto& [key, key_node, node] : reader.Entries(root, "<top level>")) {
      if (key == "alerts") {
        ParseAlertsSection(reader, node, config);
      } else {
        reader.Fail(key_node, key, "unknown top-level key (allowed: alerts)");
      }
    }
  } catch (const ConfigError& error) {
    return absl::InvalidArgumentError(error.what());
  } catch (const YAML::Exception& error) {
    // Syntax errors: yaml-cpp's message carries line and column.
    return absl::InvalidArgumentError(internal::Cat(source, ": ", error.what()));
  }
  if (absl::Status status = ValidateAlertConfig(config); !status.ok()) {
    return absl::InvalidArgumentError(internal::Cat(source, ": ", status.message()));
  }
  return config;
}

absl::StatusOr<AlertConfig> LoadAlertConfigFile(const std::string& path) {
  std::ifstream file(path);
  if (!file) return absl::NotFoundError(internal::Cat("cannot read config file ", path));
  std::ostringstream text;
  text << file.rdbuf();
  return ParseAlertConfig(text.str(), path);
}

}  // namespace foreshock::alerts
