#include "alerts/change_detector.h"

#include <algorithm>
#include <cmath>

namespace foreshock::alerts {
namespace {

// 1.4826 * MAD estimates sigma for Gaussian data.
constexpr double kMadToSigma = 1.4826;
// A flat series (MAD = 0) must still give a finite z.
constexpr double kRelativeScaleFloor = 1e-6;
constexpr double kAbsoluteScaleFloor = 1e-12;
// Fewer samples than this in the window give no trend estimate.
constexpr size_t kMinTrendSamples = 6;
// log_scale: values at or below this are scored as this.
constexpr double kLogScaleFloor = 1e-30;
// The CUSUM input is clipped here (or at z_threshold if lower): one outlier
// adds at most 3 - k, so with heavy-tailed noise two spikes in a row cannot
// reach h on their own.
constexpr double kCusumClip = 3.0;

// Median of `values`, which it reorders. `values` must not be empty.
double MedianInPlace(std::vector<double>& values) {
  const size_t mid = values.size() / 2;
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(mid), values.end());
  const double upper = values[mid];
  if (values.size() % 2 == 1) return upper;
  const double lower =
      *std::max_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(mid));
  return 0.5 * (lower + upper);
}

template <typename T>
void PushBounded(std::vector<T>& values, T value, size_t capacity) {
  values.push_back(value);
  // More than one when the capacity shrank (the sampling interval grew).
  if (values.size() > capacity) {
    values.erase(values.begin(), values.end() - static_cast<std::ptrdiff_t>(capacity));
  }
}

// Cadence scaling (ChangeDetectorOptions::reference_interval_steps).
constexpr double kMaxCountScale = 4.0;
constexpr double kMinCountScale = 1.0 / 16;
// Samples of the recent past whose step distances give the interval.
constexpr size_t kIntervalSamples = 9;

}  // namespace

SampleCounts CountsForInterval(const ChangeDetectorOptions& o, double interval_steps) {
  SampleCounts c{o.warmup, o.window, o.gap, o.min_baseline, o.persist_m, o.persist_n,
                 o.clear_after};
  if (o.reference_interval_steps <= 0 || !(interval_steps > 0)) return c;
  const double scale = std::clamp(o.reference_interval_steps / interval_steps, kMinCountScale,
                                  kMaxCountScale);
  // A count shrinks no lower than `floor` (nor than it was configured).
  auto scaled = [scale](int count, int floor) {
    if (count <= 0) return count;
    return std::max(std::min(count, floor), static_cast<int>(std::lround(count * scale)));
  };
  c.warmup = scaled(o.warmup, 3);
  c.window = scaled(o.window, 8);
  c.persist_m = scaled(o.persist_m, 2);
  c.persist_n = std::max(c.persist_m, scaled(o.persist_n, 2));
  c.gap = scaled(o.gap, 1);
  // A collapse still confirms before it can enter its own baseline.
  if (o.gap >= o.persist_n) c.gap = std::max(c.gap, c.persist_n);
  c.min_baseline = std::min(scaled(o.min_baseline, 3), c.window);
  c.clear_after = scaled(o.clear_after, 2);
  return c;
}

std::string_view DirectionName(Direction direction) {
  return direction == Direction::kRise ? "rise" : "drop";
}

std::string_view SeriesStateName(SeriesState state) {
  switch (state) {
    case SeriesState::kNormal: return "normal";
    case SeriesState::kPending: return "pending";
    case SeriesState::kAnomalous: return "anomalous";
  }
  return "?";
}

ChangeDetector::ChangeDetector(const ChangeDetectorOptions& options)
    : options_(options),
      counts_(CountsForInterval(options, 0)),
      sign_(options.direction == Direction::kRise ? 1.0 : -1.0) {
  core_.history.reserve(static_cast<size_t>(options_.window + options_.gap + 1));
  core_.flags.reserve(static_cast<size_t>(options_.persist_n + 1));
}

ChangeAssessment ChangeDetector::Update(int64_t step, double value) {
  if (step < options_.warmup_steps) {
    // Not part of the series yet (early training's transient): nothing is
    // recorded, so a later sample is never stale against it.
    ChangeAssessment ignored;
    ignored.disposition = ChangeAssessment::Disposition::kWarmup;
    ignored.step = step;
    ignored.value = value;
    ignored.state = core_.state;
    return ignored;
  }
  const bool seen_any = core_.samples_seen > 0;
  if (seen_any && step < core_.last_step) {
    ChangeAssessment stale = last_;
    stale.disposition = ChangeAssessment::Disposition::kStale;
    stale.step = step;
    stale.value = value;
    return stale;
  }
  if (seen_any && step == core_.last_step) {
    // Another source (rank) for a step already scored: only a worse value
    // matters, and it replaces the first one.
    if (!(sign_ * (value - last_.value) > 0)) {
      ChangeAssessment duplicate = last_;
      duplicate.disposition = ChangeAssessment::Disposition::kDuplicate;
      duplicate.value = value;
      return duplicate;
    }
    core_ = before_last_step_;
  } else {
    before_last_step_ = core_;
  }
  last_ = Score(step, value);
  return last_;
}

double ChangeDetector::MeasuredInterval(int64_t step) const {
  if (options_.reference_interval_steps <= 0) return 0;
  const std::vector<int64_t>& steps = core_.history_steps;
  const size_t from = steps.size() > kIntervalSamples ? steps.size() - kIntervalSamples : 0;
  std::vector<double> distances;
  distances.reserve(kIntervalSamples);
  int64_t previous = std::numeric_limits<int64_t>::min();
  auto add = [&](int64_t s) {
    if (s == std::numeric_limits<int64_t>::min()) return;  // saved before steps were kept
    if (previous != std::numeric_limits<int64_t>::min() && s > previous) {
      distances.push_back(static_cast<double>(s - previous));
    }
    previous = s;
  };
  for (size_t i = from; i < steps.size(); ++i) add(steps[i]);
  // While anomalous the history is frozen: the distance to the current step
  // is the episode's length, not the cadence.
  if (core_.state != SeriesState::kAnomalous) add(step);
  if (distances.empty()) return 0;
  return MedianInPlace(distances);
}

ChangeAssessment ChangeDetector::Score(int64_t step, double value) {
  counts_ = CountsForInterval(options_, MeasuredInterval(step));
  const SampleCounts& n = counts_;
  Core& c = core_;
  c.last_step = step;
  ++c.samples_seen;
  const size_t history_capacity = static_cast<size_t>(n.window + n.gap);

  ChangeAssessment a;
  a.step = step;
  a.value = value;
  // The detector's own units: the value, or its log for multiplicative series.
  const double x = options_.log_scale ? std::log(std::max(value, kLogScaleFloor)) : value;
  if (c.samples_seen <= n.warmup) {
    PushBounded(c.history, x, history_capacity);
    PushBounded(c.history_steps, step, history_capacity);
    a.disposition = ChangeAssessment::Disposition::kWarmup;
    a.state = c.state;
    return a;
  }

  if (options_.change_detection) {
    if (const std::optional<Baseline> baseline = ComputeBaseline()) {
      const double delta = x - baseline->level;
      const double directed_z = sign_ * delta / baseline->scale;
      a.scale = baseline->scale;
      a.z = delta / baseline->scale;
      const double effect = sign_ * delta;
      // The gate, wider for a young baseline (gate_inflation, relative to the full window).
      const double in_window =
          static_cast<double>(core_.history.size() - static_cast<size_t>(n.gap));
      const double gate = options_.min_relative_change *
                          (1.0 + options_.gate_inflation / in_window) /
                          (1.0 + options_.gate_inflation / static_cast<double>(n.window));
      bool large_enough;
      if (options_.log_scale) {
        a.baseline = std::exp(baseline->level);
        a.relative_change = std::expm1(delta);
        // A rise by the factor 1 + gate, or a drop to 1 - gate (capped short of 0).
        const double min_effect = sign_ > 0 ? std::log1p(gate) : -std::log1p(-std::min(gate, 0.999));
        large_enough = effect > 0 && effect >= min_effect &&
                       sign_ * (value - a.baseline) >= options_.min_absolute_change;
      } else {
        a.baseline = baseline->level;
        if (baseline->level != 0) a.relative_change = delta / std::abs(baseline->level);
        const double min_effect =
            std::max(gate * std::abs(baseline->level), options_.min_absolute_change);
        large_enough = effect > 0 && effect >= min_effect;
      }
      // Only changes past the gate accumulate, so a long significant-but-small
      // shift (healthy drift) cannot charge the CUSUM for a later sample.
      const double clip = std::min(kCusumClip, options_.z_threshold);
      const double cusum_input =
          large_enough ? std::min(directed_z, clip) : std::min(directed_z, 0.0);
      c.cusum = std::max(0.0, c.cusum + cusum_input - options_.cusum_k);
      a.change_flag =
          large_enough && (directed_z >= options_.z_threshold || c.cusum >= options_.cusum_h);
    }
  }
  a.guard_flag = PastBound(step, value, x);
  const bool anomalous = a.anomalous();

  if (c.state == SeriesState::kAnomalous) {
    c.consecutive_normal = anomalous ? 0 : c.consecutive_normal + 1;
    if (c.consecutive_normal >= n.clear_after) {
      // Cleared: start the next episode from scratch.
      c.state = SeriesState::kNormal;
      c.onset_step = -1;
      c.cusum = 0;
      c.consecutive_normal = 0;
      c.flags.clear();
    }
  } else {
    PushBounded(c.flags, Flag{step, anomalous}, static_cast<size_t>(n.persist_n));
    int count = 0;
    int64_t earliest = -1;
    for (const Flag& flag : c.flags) {
      if (!flag.anomalous) continue;
      if (count++ == 0) earliest = flag.step;
    }
    a.anomalous_in_window = count;
    c.onset_step = earliest;
    if (count >= n.persist_m) {
      c.state = SeriesState::kAnomalous;
      c.consecutive_normal = 0;
      c.flags.clear();
    } else {
      c.state = count > 0 ? SeriesState::kPending : SeriesState::kNormal;
    }
  }
  // The history (hence the baseline) is frozen while the series is anomalous.
  if (c.state != SeriesState::kAnomalous) {
    PushBounded(c.history, x, history_capacity);
    PushBounded(c.history_steps, step, history_capacity);
  }

  a.cusum = c.cusum;
  a.state = c.state;
  a.onset_step = c.onset_step;
  return a;
}

bool ChangeDetector::PastBound(int64_t step, double value, double x) const {
  if (!options_.bound || !(sign_ * (value - *options_.bound) > 0)) return false;
  if (options_.bound_growth <= 1.0) return true;
  if (options_.bound_without_growth && value > *options_.bound_without_growth) return true;
  // The growth reference: the newest history sample at least
  // bound_growth_steps older, else the oldest (history_steps is oldest first;
  // INT64_MIN marks a step a version-1 checkpoint did not keep).
  const std::vector<int64_t>& steps = core_.history_steps;
  std::optional<size_t> reference;
  for (size_t i = 0; i < steps.size(); ++i) {
    if (steps[i] == std::numeric_limits<int64_t>::min() || steps[i] >= step) continue;
    if (!reference || steps[i] <= step - options_.bound_growth_steps) reference = i;
  }
  // No earlier sample: the series' first value past the bound rose from a
  // random init's O(1) logits within the series' start (warmup_steps), far
  // faster than any growth asked here.
  if (!reference) return true;
  const double span = static_cast<double>(std::min<int64_t>(step - steps[*reference],
                                                            options_.bound_growth_steps));
  const double needed = std::log(options_.bound_growth) * span / options_.bound_growth_steps;
  return x - core_.history[*reference] >= needed;
}

void ChangeDetector::ResetEpisode() {
  core_.state = SeriesState::kNormal;
  core_.onset_step = -1;
  core_.cusum = 0;
  core_.consecutive_normal = 0;
  core_.flags.clear();
  // A worse value for the latest step must not bring the old episode back.
  before_last_step_ = core_;
  last_.state = SeriesState::kNormal;
  last_.onset_step = -1;
  last_.anomalous_in_window = 0;
  last_.cusum = 0;
}

void ChangeDetector::Rewind(int64_t from_step) {
  ResetEpisode();
  if (core_.samples_seen == 0 || core_.last_step < from_step) return;
  // Steps only grow along the history, so the replayed samples are its tail.
  size_t keep = core_.history.size();
  while (keep > 0 && core_.history_steps[keep - 1] >= from_step) --keep;
  const int64_t dropped = static_cast<int64_t>(core_.history.size() - keep);
  core_.history.resize(keep);
  core_.history_steps.resize(keep);
  core_.samples_seen = std::max<int64_t>(static_cast<int64_t>(keep), core_.samples_seen - dropped);
  // Steps before from_step were shared by both attempts and stay scored: a
  // value for one of them is stale (or, at from_step - 1, a duplicate: NaN
  // compares as not worse).
  core_.last_step = from_step - 1;
  before_last_step_ = core_;
  last_ = ChangeAssessment{};
  last_.step = core_.last_step;
  last_.value = std::numeric_limits<double>::quiet_NaN();
}

std::optional<ChangeDetector::Baseline> ChangeDetector::ComputeBaseline() const {
  const size_t history_size = core_.history.size();
  const size_t gap = static_cast<size_t>(counts_.gap);
  if (history_size <= gap) return std::nullopt;
  const size_t length = history_size - gap;  // the window: history[0, length)
  const size_t min_length =
      std::max<size_t>(3, counts_.min_baseline > 0 ? static_cast<size_t>(counts_.min_baseline)
                                                   : static_cast<size_t>(counts_.window) / 2);
  if (length < min_length) return std::nullopt;

  Baseline baseline = FitWindow(0, length);
  const size_t recent = length / 2;
  if (options_.trend && recent >= kMinTrendSamples) {
    // Healthy drift often accelerates away from its start (entropies leave
    // their initial plateau): the newer half's trend counts too, and the
    // baseline further along the alert direction wins.
    const Baseline recent_fit = FitWindow(length - recent, length);
    if (sign_ * (recent_fit.level - baseline.level) > 0) baseline.level = recent_fit.level;
    baseline.scale = std::max(baseline.scale, recent_fit.scale);
  }
  baseline.scale *= 1.0 + options_.small_sample_inflation / static_cast<double>(length);
  return baseline;
}

ChangeDetector::Baseline ChangeDetector::FitWindow(size_t begin, size_t end) const {
  const std::vector<double>& history = core_.history;
  const size_t length = end - begin;
  double slope = 0;
  if (options_.trend && length >= kMinTrendSamples) {
    // Medians of the older and newer halves; their centres are `length - half` apart.
    const size_t half = length / 2;
    const auto first = history.begin() + static_cast<std::ptrdiff_t>(begin);
    scratch_.assign(first, first + static_cast<std::ptrdiff_t>(half));
    const double older = MedianInPlace(scratch_);
    scratch_.assign(first + static_cast<std::ptrdiff_t>(length - half),
                    first + static_cast<std::ptrdiff_t>(length));
    const double newer = MedianInPlace(scratch_);
    slope = (newer - older) / static_cast<double>(length - half);
    // Follow only drifts in the alert direction.
    slope = sign_ > 0 ? std::max(0.0, slope) : std::min(0.0, slope);
  }

  const double centre = 0.5 * static_cast<double>(length - 1);
  residuals_.resize(length);
  for (size_t i = 0; i < length; ++i) {
    residuals_[i] = history[begin + i] - slope * (static_cast<double>(i) - centre);
  }
  scratch_ = residuals_;
  const double level_at_centre = MedianInPlace(scratch_);
  for (double& r : residuals_) r = std::abs(r - level_at_centre);
  const double mad = MedianInPlace(residuals_);

  Baseline baseline;
  // Extrapolate from the centre of the fitted span to the sample after the history.
  const double distance = static_cast<double>(history.size() - begin) - centre;
  baseline.level = level_at_centre + slope * distance;
  baseline.scale = std::max(kMadToSigma * mad,
                            kRelativeScaleFloor * std::abs(baseline.level) + kAbsoluteScaleFloor);
  return baseline;
}

// ---------------------------------------------------------------------------
// Checkpointing.
//
// Core: Vector<double> history, [v2: U64 count + I64 step per history
// value], U64 flags + per flag (I64 step, Bool anomalous), I64 samples_seen,
// I64 last_step, Double cusum, I32 consecutive_normal, U8 state, I64
// onset_step.
// Assessment: U8 disposition, I64 step, Double value, baseline, scale, z,
// cusum, relative_change, Bool change_flag, guard_flag, U8 state, I64
// onset_step, I32 anomalous_in_window.

namespace {

constexpr uint8_t kChangeDetectorStateVersion = 2;
constexpr uint8_t kChangeDetectorFirstVersion = 1;  // no history steps

// The runs of plain fields in the state, each listed once for SaveState and
// RestoreState (codec::FieldWriter / FieldReader): a core's between its flags
// and its consecutive-normal count, an assessment's between its disposition
// and its state.
template <typename Io, typename C>
bool CoreCounters(Io& io, C& c) {
  return io(c.samples_seen) && io(c.last_step) && io(c.cusum);
}
template <typename Io, typename A>
bool AssessmentFields(Io& io, A& a) {
  return io(a.step) && io(a.value) && io(a.baseline) && io(a.scale) && io(a.z) && io(a.cusum) &&
         io(a.relative_change) && io(a.change_flag) && io(a.guard_flag);
}

}  // namespace

void ChangeDetector::SaveState(codec::StateWriter& writer) const {
  codec::FieldWriter io(writer);
  auto put_core = [&](const Core& c) {
    writer.PutVector(c.history);
    writer.PutU64(c.history_steps.size());
    for (int64_t step : c.history_steps) writer.PutI64(step);
    writer.PutU64(c.flags.size());
    for (const Flag& flag : c.flags) {
      writer.PutI64(flag.step);
      writer.PutBool(flag.anomalous);
    }
    CoreCounters(io, c);
    writer.PutI32(c.consecutive_normal);
    writer.PutU8(static_cast<uint8_t>(c.state));
    writer.PutI64(c.onset_step);
  };
  writer.PutU8(kChangeDetectorStateVersion);
  put_core(core_);
  put_core(before_last_step_);
  const ChangeAssessment& a = last_;
  writer.PutU8(static_cast<uint8_t>(a.disposition));
  AssessmentFields(io, a);
  writer.PutU8(static_cast<uint8_t>(a.state));
  writer.PutI64(a.onset_step);
  writer.PutI32(a.anomalous_in_window);
}

bool ChangeDetector::RestoreState(codec::StateReader& reader) {
  // The largest the counts can be at any interval.
  const SampleCounts largest =
      options_.reference_interval_steps > 0
          ? CountsForInterval(options_, options_.reference_interval_steps / kMaxCountScale)
          : CountsForInterval(options_, 0);
  const size_t history_capacity = static_cast<size_t>(largest.window + largest.gap);
  const size_t flags_capacity = static_cast<size_t>(largest.persist_n);
  codec::FieldReader io(reader);
  auto get_state = [&](SeriesState& state) {
    uint8_t byte = 0;
    if (!reader.GetU8(byte)) return false;
    if (byte > static_cast<uint8_t>(SeriesState::kAnomalous)) return reader.Fail("unknown series state");
    state = static_cast<SeriesState>(byte);
    return true;
  };
  uint8_t version = 0;
  auto get_core = [&](Core& c) {
    uint64_t flags = 0;
    if (!reader.GetVector(c.history)) return false;
    if (version >= 2) {
      uint64_t steps = 0;
      if (!reader.GetCount(steps, 8)) return false;
      if (steps != c.history.size()) return reader.Fail("history steps do not match the history");
      c.history_steps.resize(steps);
      for (int64_t& step : c.history_steps) {
        if (!reader.GetI64(step)) return false;
      }
    } else {
      c.history_steps.assign(c.history.size(), std::numeric_limits<int64_t>::min());
    }
    if (!reader.GetCount(flags, 9)) return false;
    if (c.history.size() > history_capacity) return reader.Fail("history longer than window + gap");
    if (flags > flags_capacity) return reader.Fail("persistence window longer than persist_n");
    c.flags.clear();
    for (uint64_t i = 0; i < flags; ++i) {
      Flag flag{};
      if (!reader.GetI64(flag.step) || !reader.GetBool(flag.anomalous)) return false;
      c.flags.push_back(flag);
    }
    int32_t consecutive_normal = 0;
    if (!CoreCounters(io, c) || !reader.GetI32(consecutive_normal) || !get_state(c.state) ||
        !reader.GetI64(c.onset_step)) {
      return false;
    }
    if (c.samples_seen < 0 || consecutive_normal < 0) return reader.Fail("negative count");
    // Update never accepts a non-finite value (and the medians must not see one).
    for (double v : c.history) {
      if (!std::isfinite(v)) return reader.Fail("non-finite value in the history");
    }
    if (!std::isfinite(c.cusum)) return reader.Fail("non-finite CUSUM");
    c.consecutive_normal = consecutive_normal;
    return true;
  };
  auto read = [&](Core& core, Core& before, ChangeAssessment& a) {
    uint8_t disposition = 0;
    int32_t anomalous_in_window = 0;
    if (!reader.GetU8(version)) return false;
    if (version < kChangeDetectorFirstVersion || version > kChangeDetectorStateVersion) {
      return reader.Fail("change detector state version " + std::to_string(version) +
                         " not supported");
    }
    if (!get_core(core) || !get_core(before) || !reader.GetU8(disposition) ||
        !AssessmentFields(io, a) || !get_state(a.state) || !reader.GetI64(a.onset_step) ||
        !reader.GetI32(anomalous_in_window)) {
      return false;
    }
    if (disposition > static_cast<uint8_t>(ChangeAssessment::Disposition::kDuplicate)) {
      return reader.Fail("unknown disposition");
    }
    a.disposition = static_cast<ChangeAssessment::Disposition>(disposition);
    a.anomalous_in_window = anomalous_in_window;
    return true;
  };
  Core core, before;
  ChangeAssessment assessment;
  if (!read(core, before, assessment)) {
    core_ = Core{};
    before_last_step_ = Core{};
    last_ = ChangeAssessment{};
    core_.history.reserve(history_capacity + 1);
    core_.flags.reserve(flags_capacity + 1);
    return false;
  }
  core_ = std::move(core);
  before_last_step_ = std::move(before);
  last_ = assessment;
  counts_ = CountsForInterval(options_, MeasuredInterval(core_.last_step));
  return true;
}

}  // namespace foreshock::alerts
