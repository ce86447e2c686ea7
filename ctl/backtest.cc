#include "ctl/backtest.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <queue>
#include <set>
#include <sstream>
#include <tuple>

#include <nlohmann/json.hpp>

#include "alerts/alert_engine.h"
#include "ctl/cli.h"
#include "detectors/detector.h"
#include "foreshock/v1/ingest.pb.h"
#include "record/recording.h"
#include "wire/validation.h"
#include "wire/rank_scalars.h"

namespace foreshock::ctl {
namespace {

namespace v1 = foreshock::v1;
using alerts::AlertState;
using alerts::AlertTransition;

constexpr std::string_view kBaselineNames[] = {"olmo", "megatron", "nan", "gradnorm_z"};

// The detector signal behind each daemon-side baseline (scalar_baselines_detector.cc).
std::optional<std::string_view> BaselineOfSignal(std::string_view signal) {
  if (signal == "baseline_olmo_spike") return "olmo";
  if (signal == "baseline_megatron_spiky_loss") return "megatron";
  if (signal == "baseline_nonfinite") return "nan";
  return std::nullopt;
}

std::optional<int64_t> LabelInt(const std::map<std::string, std::string>& labels,
                                const std::string& key) {
  auto it = labels.find(key);
  if (it == labels.end()) return std::nullopt;
  return ParseInt(it->second);
}

std::string Label(const std::map<std::string, std::string>& labels, const std::string& key) {
  auto it = labels.find(key);
  return it == labels.end() ? std::string() : it->second;
}

// One file of a run, read frame by frame for the merge.
struct Stream {
  std::string path;
  record::RecordingReader reader;
  record::Frame frame;  // the next frame, valid while `has_frame`
  bool has_frame = false;
  std::optional<wire::StreamContext> context;
  uint64_t sender_id = 0;
  void Advance(std::string* error) {
    const record::ReadStatus status = reader.Next(&frame);
    has_frame = status == record::ReadStatus::kFrame;
    if (status == record::ReadStatus::kError && error->empty()) *error = reader.error();
  }
};

// Everything one run's replay keeps.
class RunReplay final : public detectors::Emitter {
 public:
  RunReplay(BacktestRun& run, const BacktestOptions& options)
      : run_(run), options_(options), engine_(options.config) {
    detectors::DetectorOptions detector_options;
    for (const detectors::DetectorInfo& info : detectors::DetectorRegistry::Instance().detectors()) {
      detectors_.emplace_back(&info, info.create(detector_options));
    }
  }

  void Process(const detectors::Sample& sample) {
    if (sample.kind() != detectors::SampleKind::kScalars) {
      RunDetectors(sample);
      return;
    }
    wire::RankScalars::Result merged = rank_scalars_.Offer(sample);
    for (const detectors::Sample& run_level : merged.ready) {
      const auto& s = std::get<detectors::ScalarsSample>(run_level.payload);
      if (s.has_loss) losses_.emplace_back(run_level.step, s.loss);
      if (s.has_grad_norm) grad_norms_.emplace_back(run_level.step, s.grad_norm);
      RunDetectors(run_level);
    }
  }

  void Emit(const detectors::Observation& observation) override {
    if (auto baseline = BaselineOfSignal(observation.signal);
        baseline && observation.head == detectors::kAllHeads && observation.value >= 1.0) {
      baseline_alarms_[std::string(*baseline)].push_back(current_->step);
    }
    if (options_.dump_signals.contains(observation.signal)) {
      run_.series[std::string(observation.signal)].push_back(
          SeriesValue{current_->step, observation.layer, observation.head, observation.value});
    }
    if (!BacktestDelivers(options_.signals, observation.signal)) return;
    Deliver(engine_.Observe(alerts::SignalPoint{current_->run, current_->step, observation.signal,
                                                observation.layer, observation.head,
                                                observation.value, observation.for_detection}));
  }

  void NonFinite(detectors::SampleKind kind, int64_t count) override {
    Deliver(engine_.ObserveNonFinite(
        alerts::NonFiniteEvent{current_->run, current_->step, kind, count, current_->layer()}));
  }

  void Finish();

 private:
  void RunDetectors(const detectors::Sample& sample) {
    current_ = &sample;
    run_.last_step = std::max(run_.last_step, sample.step);
    for (auto& [info, detector] : detectors_) {
      if (info->kind != sample.kind()) continue;
      try {
        detector->Process(sample, *this);
      } catch (const std::exception& e) {
        ++run_.rejection_reasons[std::string("detector_error:") + std::string(info->name)];
      }
    }
    current_ = nullptr;
  }

  void Deliver(const std::vector<AlertTransition>& transitions) {
    for (const AlertTransition& t : transitions) {
      if (t.to != AlertState::kFiring) continue;
      causes_.push_back({t.step, t.alert.probable_cause, t.alert.probable_cause_settled});
      if (t.from == AlertState::kFiring) continue;  // re-annotated, not a new firing
      run_.fired.push_back(FiredAlert{t.step, t.alert.first_step, t.alert.alertname, t.alert.layer,
                                      t.alert.signal, t.alert.probable_cause});
    }
  }

  std::optional<int64_t> GradNormBaseline(int64_t from) const;

  struct CauseGiven {
    int64_t step;
    std::string cause;
    bool settled;
  };

  BacktestRun& run_;
  const BacktestOptions& options_;
  alerts::AlertEngine engine_;
  std::vector<std::pair<const detectors::DetectorInfo*, std::unique_ptr<detectors::Detector>>>
      detectors_;
  wire::RankScalars rank_scalars_;
  const detectors::Sample* current_ = nullptr;
  std::vector<std::pair<int64_t, double>> losses_, grad_norms_;
  std::map<std::string, std::vector<int64_t>> baseline_alarms_;
  std::vector<CauseGiven> causes_;
};

std::optional<int64_t> RunReplay::GradNormBaseline(int64_t from) const {
  const size_t window = static_cast<size_t>(options_.gradnorm_window);
  const size_t gap = static_cast<size_t>(options_.gradnorm_gap);
  int streak = 0;
  std::vector<double> scratch;
  for (size_t i = window + gap; i < grad_norms_.size(); ++i) {
    const double g = grad_norms_[i].second;
    bool alarm = !std::isfinite(g);
    if (!alarm) {
      scratch.clear();
      for (size_t j = i - gap - window; j < i - gap; ++j) {
        if (std::isfinite(grad_norms_[j].second)) scratch.push_back(grad_norms_[j].second);
      }
      if (scratch.size() < window / 2) continue;
      std::nth_element(scratch.begin(), scratch.begin() + scratch.size() / 2, scratch.end());
      const double median = scratch[scratch.size() / 2];
      for (double& v : scratch) v = std::abs(v - median);
      std::nth_element(scratch.begin(), scratch.begin() + scratch.size() / 2, scratch.end());
      const double scale = std::max(1.4826 * scratch[scratch.size() / 2], 1e-12 + 1e-6 * median);
      alarm = (g - median) / scale > options_.gradnorm_z;
    }
    streak = alarm ? streak + 1 : 0;
    if (streak >= options_.gradnorm_persist && grad_norms_[i].first >= from) {
      return grad_norms_[i].first;
    }
  }
  return std::nullopt;
}

void RunReplay::Finish() {
  const int64_t warmup =
      LabelInt(run_.labels, "warmup_steps").value_or(options_.divergence_warmup);
  run_.divergence_step = DivergenceStep(losses_, warmup);
  if (!run_.expected_cause.empty()) {
    run_.fault = true;
  } else if (!run_.injection_step) {
    run_.fault = run_.divergence_step.has_value() && run_.labels.count("scenario") == 0;
  }
  const bool labeled = !run_.expected_cause.empty() || run_.injection_step;
  const int64_t from = run_.fault ? run_.injection_step.value_or(0) : 0;

  for (const FiredAlert& alert : run_.fired) {
    const bool false_alarm = !run_.fault || alert.step < from;
    if (false_alarm && (labeled || !run_.fault)) ++run_.false_alarms;
    if (run_.fault && !false_alarm && !run_.first_alert) run_.first_alert = alert;
  }
  if (run_.first_alert && run_.divergence_step) {
    run_.lead = *run_.divergence_step - run_.first_alert->step;
    if (run_.injection_step && *run_.divergence_step > *run_.injection_step) {
      run_.lead_fraction = static_cast<double>(*run_.lead) /
                           static_cast<double>(*run_.divergence_step - *run_.injection_step);
    }
  }
  // The cause last given before the divergence (or by the end).
  for (const CauseGiven& given : causes_) {
    if (run_.divergence_step && given.step > *run_.divergence_step) break;
    run_.cause = given.cause;
    run_.cause_settled = given.settled;
  }

  auto score = [&](const std::string& name, const std::vector<int64_t>& alarms) {
    BacktestRun::Baseline& b = run_.baselines[name];
    for (int64_t step : alarms) {
      if (run_.fault && step < from) {
        b.early = true;
      } else if (!b.first) {
        b.first = step;
      }
    }
  };
  for (std::string_view name : kBaselineNames) {
    const std::string key(name);
    if (key == "gradnorm_z") {
      std::vector<int64_t> alarms;
      if (auto early = GradNormBaseline(0); early) alarms.push_back(*early);
      if (auto late = GradNormBaseline(from); late && (alarms.empty() || *late != alarms[0])) {
        alarms.push_back(*late);
      }
      score(key, alarms);
    } else {
      score(key, baseline_alarms_[key]);
    }
  }
}

std::string Opt(const std::optional<int64_t>& v) { return v ? std::to_string(*v) : "-"; }

double Median(std::vector<double> values) {
  if (values.empty()) return std::nan("");
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

struct Summary {
  int fault_runs = 0, diverged = 0, alerted_before_divergence = 0, cause_labeled = 0,
      cause_correct = 0, first_cause_correct = 0, control_runs = 0, controls_alerted = 0,
      faults_alerted_early = 0, false_alarms = 0;
  std::vector<double> lead_fractions, leads;
};

Summary Summarize(const BacktestResult& result) {
  Summary s;
  for (const BacktestRun& run : result.runs) {
    s.false_alarms += run.false_alarms;
    if (!run.fault) {
      ++s.control_runs;
      if (!run.fired.empty()) ++s.controls_alerted;
      continue;
    }
    ++s.fault_runs;
    if (run.false_alarms > 0) ++s.faults_alerted_early;
    if (run.divergence_step) ++s.diverged;
    if (run.lead && *run.lead > 0) ++s.alerted_before_divergence;
    if (run.divergence_step) {
      // A run that never alerted before diverging has lead 0 (fraction 0).
      s.leads.push_back(run.lead && *run.lead > 0 ? static_cast<double>(*run.lead) : 0.0);
      if (run.injection_step) {
        s.lead_fractions.push_back(run.lead_fraction && *run.lead_fraction > 0 ? *run.lead_fraction
                                                                               : 0.0);
      }
    }
    if (!run.expected_cause.empty()) {
      ++s.cause_labeled;
      if (run.cause_correct()) ++s.cause_correct;
      if (run.first_cause_correct()) ++s.first_cause_correct;
    }
  }
  return s;
}

}  // namespace

std::optional<int64_t> DivergenceStep(const std::vector<std::pair<int64_t, double>>& losses,
                                      int64_t warmup) {
  double running_min = INFINITY;
  double window_sum = 0;
  for (size_t i = 0; i < losses.size(); ++i) {
    const auto [step, loss] = losses[i];
    if (!std::isfinite(loss)) return step;
    window_sum += loss;
    if (i >= 20) window_sum -= losses[i - 20].second;
    if (i + 1 < 20 || step < warmup) continue;
    // Re-summed now and then: a long run's rolling sum would drift.
    if (i % 1024 == 0) {
      window_sum = 0;
      for (size_t j = i + 1 - 20; j <= i; ++j) window_sum += losses[j].second;
    }
    const double mean = window_sum / 20;
    running_min = std::min(running_min, mean);
    if (mean > 1.3 * running_min) return step;
  }
  return std::nullopt;
}

BacktestResult RunBacktest(const std::vector<std::string>& files, const BacktestOptions& options) {
  BacktestResult result;
  // Group the files by the run of their Hello.
  std::map<std::string, std::vector<std::string>> by_run;
  for (const std::string& path : files) {
    record::RecordingReader reader;
    if (!reader.Open(path)) {
      result.errors.push_back(reader.error());
      continue;
    }
    record::Frame frame;
    std::string run_id;
    while (reader.Next(&frame) == record::ReadStatus::kFrame) {
      v1::StreamRequest request;
      if (request.ParseFromString(frame.payload) && request.has_hello()) {
        run_id = request.hello().run_id();
        break;
      }
    }
    if (run_id.empty()) {
      result.errors.push_back(path + ": no Hello in the recording");
      continue;
    }
    by_run[run_id].push_back(path);
  }

  const wire::RecordLimits limits;
  for (auto& [run_id, paths] : by_run) {
    BacktestRun& run = result.runs.emplace_back();
    run.run_id = run_id;
    run.files = paths;
    std::vector<std::unique_ptr<Stream>> streams;
    for (const std::string& path : paths) {
      auto stream = std::make_unique<Stream>();
      stream->path = path;
      if (!stream->reader.Open(path)) {
        if (run.error.empty()) run.error = stream->reader.error();
        continue;
      }
      stream->Advance(&run.error);
      streams.push_back(std::move(stream));
    }
    RunReplay replay(run, options);
    bool have_labels = false;
    // Batches already processed per (rank, sender_id): resends after a
    // reconnect repeat their seqs.
    std::map<std::pair<int32_t, uint64_t>, std::set<uint64_t>> seen;
    // Merge the streams by receive time (ties: file order).
    using Entry = std::tuple<int64_t, size_t>;
    std::priority_queue<Entry, std::vector<Entry>, std::greater<>> next;
    for (size_t i = 0; i < streams.size(); ++i) {
      if (streams[i]->has_frame) next.emplace(streams[i]->frame.recv_unix_us, i);
    }
    while (!next.empty()) {
      const size_t i = std::get<1>(next.top());
      next.pop();
      Stream& stream = *streams[i];
      v1::StreamRequest request;
      if (request.ParseFromString(stream.frame.payload)) {
        if (request.has_hello()) {
          const v1::Hello& hello = request.hello();
          wire::StreamContext context;
          context.run_id = hello.run_id();
          context.job = hello.job();
          context.rank = hello.rank();
          context.world_size = wire::WorldSizeOf(hello);
          context.model = hello.model();
          stream.context = std::move(context);
          stream.sender_id = hello.first_seq() != 0 ? hello.sender_id() : 0;
          if (!have_labels) {
            have_labels = true;
            run.labels.insert(hello.labels().begin(), hello.labels().end());
          }
        } else if (request.has_batch() && stream.context) {
          v1::Batch& batch = *request.mutable_batch();
          const bool fresh = stream.sender_id == 0 ||
                             seen[{stream.context->rank, stream.sender_id}].insert(batch.seq()).second;
          if (!fresh) {
            ++run.duplicate_batches;
          } else {
            for (int r = 0; r < batch.records_size(); ++r) {
              detectors::Sample sample;
              ++run.records;
              if (auto rejection = wire::ValidateRecord(*batch.mutable_records(r), *stream.context,
                                                          limits, sample)) {
                ++run.rejected;
                ++run.rejection_reasons[rejection->code];
                continue;
              }
              replay.Process(sample);
            }
          }
        }
      }
      stream.Advance(&run.error);
      if (stream.has_frame) next.emplace(stream.frame.recv_unix_us, i);
    }
    run.scenario = Label(run.labels, "scenario");
    run.config = Label(run.labels, "config");
    run.expected_cause = Label(run.labels, "expected_cause");
    run.injection_step = LabelInt(run.labels, "injection_step");
    replay.Finish();
  }
  return result;
}

std::string BacktestTable(const BacktestResult& result) {
  Table table({"run", "kind", "inject", "diverge", "first_alert", "alert", "lead", "lead%",
               "first_cause", "cause", "expected", "false", "olmo", "megatron", "nan", "gradnorm_z"});
  for (const BacktestRun& run : result.runs) {
    auto baseline = [&](const char* name) {
      auto it = run.baselines.find(name);
      if (it == run.baselines.end()) return std::string("-");
      std::string text = Opt(it->second.first);
      if (it->second.early) text += "(early)";
      return text;
    };
    const FiredAlert* first = run.first_alert ? &*run.first_alert : nullptr;
    table.AddRow({run.run_id, run.fault ? "fault" : "control", Opt(run.injection_step),
                  Opt(run.divergence_step), first ? std::to_string(first->step) : "-",
                  first ? first->alertname + "/" + first->layer + "/" + first->signal : "-",
                  Opt(run.lead),
                  run.lead_fraction ? std::to_string(static_cast<int>(std::lround(
                                          100 * *run.lead_fraction))) : "-",
                  first ? first->probable_cause : "-", run.cause.empty() ? "-" : run.cause,
                  run.expected_cause.empty() ? "-" : run.expected_cause,
                  std::to_string(run.false_alarms), baseline("olmo"), baseline("megatron"),
                  baseline("nan"), baseline("gradnorm_z")});
  }
  return table.Render();
}

std::string BacktestSummary(const BacktestResult& result) {
  const Summary s = Summarize(result);
  std::ostringstream out;
  out << "fault runs: " << s.fault_runs << " (diverged " << s.diverged
      << "), alerted before divergence: " << s.alerted_before_divergence << "/" << s.diverged
      << ", median lead: " << ShortNumber(Median(s.leads)) << " steps, median lead fraction: "
      << ShortNumber(Median(s.lead_fractions)) << "\n";
  out << "probable cause right: " << s.cause_correct << "/" << s.cause_labeled
      << ", first alert's cause right: " << s.first_cause_correct << "/" << s.cause_labeled << "\n";
  out << "control runs with an alert: " << s.controls_alerted << "/" << s.control_runs
      << ", fault runs with an alert before the injection: " << s.faults_alerted_early << "/"
      << s.fault_runs << ", false alarms in all: " << s.false_alarms << "\n";
  for (const std::string& error : result.errors) out << "error: " << error << "\n";
  for (const BacktestRun& run : result.runs) {
    if (!run.error.empty()) out << "error: " << run.run_id << ": " << run.error << "\n";
  }
  return out.str();
}

std::optional<BacktestOptions::Signals> ParseBacktestSignals(std::string_view text) {
  if (text == "all") return BacktestOptions::Signals::kAll;
  if (text == "mechanism") return BacktestOptions::Signals::kMechanism;
  if (text == "direct") return BacktestOptions::Signals::kDirect;
  if (text == "no_lr") return BacktestOptions::Signals::kNoLr;
  return std::nullopt;
}

bool BacktestDelivers(BacktestOptions::Signals mode, std::string_view signal) {
  if (mode == BacktestOptions::Signals::kAll) return true;
  // What reads the knob or the injected perturbation itself. rho and tau are
  // computed from the LR the client read from the optimizer (issue 33): under
  // a hidden LR ramp they move with the ramp itself; lambda does not read it.
  const bool reads_lr = signal == "lr" || signal == "lr_over_held_max" ||
                        signal == "curvature_eos_ratio" || signal == "curvature_eos_threshold";
  if (mode == BacktestOptions::Signals::kNoLr) return !reads_lr;
  const bool direct = reads_lr || signal == "attention_output_bias" ||
                      signal == "attention_output_error";
  if (mode == BacktestOptions::Signals::kMechanism) return !direct;
  return direct || signal == "attention_compute_bits";
}

std::string BacktestJson(const BacktestResult& result) {
  using nlohmann::json;
  auto opt = [](const auto& v) { return v ? json(*v) : json(nullptr); };
  json runs = json::array();
  for (const BacktestRun& run : result.runs) {
    json fired = json::array();
    for (const FiredAlert& a : run.fired) {
      fired.push_back({{"step", a.step}, {"first_step", a.first_step}, {"alertname", a.alertname},
                       {"layer", a.layer}, {"signal", a.signal},
                       {"probable_cause", a.probable_cause}});
    }
    json baselines = json::object();
    for (const auto& [name, b] : run.baselines) {
      baselines[name] = {{"first_step", opt(b.first)}, {"before_injection", b.early}};
    }
    const FiredAlert* first = run.first_alert ? &*run.first_alert : nullptr;
    runs.push_back({
        {"run_id", run.run_id},
        {"config", run.config},
        {"scenario", run.scenario},
        {"fault", run.fault},
        {"expected_cause", run.expected_cause},
        {"injection_step", opt(run.injection_step)},
        {"divergence_step", opt(run.divergence_step)},
        {"first_alert_step", first ? json(first->step) : json(nullptr)},
        {"first_alert", first ? json{{"alertname", first->alertname}, {"layer", first->layer},
                                     {"signal", first->signal},
                                     {"probable_cause", first->probable_cause}}
                              : json(nullptr)},
        {"lead", opt(run.lead)},
        {"lead_fraction", opt(run.lead_fraction)},
        {"cause", run.cause},
        {"cause_settled", run.cause_settled},
        {"cause_correct", run.cause_correct()},
        {"first_cause_correct", run.first_cause_correct()},
        {"false_alarms", run.false_alarms},
        {"baselines", baselines},
        {"alerts", fired},
        {"records", run.records},
        {"rejected", run.rejected},
        {"rejection_reasons", run.rejection_reasons},
        {"duplicate_batches", run.duplicate_batches},
        {"last_step", run.last_step},
        {"labels", run.labels},
        {"files", run.files},
        {"error", run.error},
    });
    if (!run.series.empty()) {
      json series = json::object();
      for (const auto& [signal, values] : run.series) {
        json rows = json::array();
        for (const SeriesValue& v : values) rows.push_back({v.step, v.layer, v.head, v.value});
        series[signal] = std::move(rows);
      }
      runs.back()["series"] = std::move(series);
    }
  }
  const Summary s = Summarize(result);
  auto median = [](const std::vector<double>& v) {
    const double m = Median(v);
    return std::isfinite(m) ? json(m) : json(nullptr);
  };
  json summary = {
      {"fault_runs", s.fault_runs},
      {"diverged", s.diverged},
      {"alerted_before_divergence", s.alerted_before_divergence},
      {"median_lead", median(s.leads)},
      {"median_lead_fraction", median(s.lead_fractions)},
      {"cause_labeled", s.cause_labeled},
      {"cause_correct", s.cause_correct},
      {"first_cause_correct", s.first_cause_correct},
      {"control_runs", s.control_runs},
      {"controls_alerted", s.controls_alerted},
      {"faults_alerted_before_injection", s.faults_alerted_early},
      {"false_alarms", s.false_alarms},
  };
  return json{{"runs", runs}, {"summary", summary}, {"errors", result.errors}}.dump(1) + "\n";
}

}  // namespace foreshock::ctl
