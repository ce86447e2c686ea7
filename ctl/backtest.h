// `foreshockctl backtest`: replays recordings (foreshockd --record_dir) into
// an in-process pipeline (the daemon's validation, rank merge, every
// registered detector and the alert engine, with a given configuration) and
// scores each run: first alert, divergence, lead, probable cause, false
// alarms and the loss/grad-norm baselines (docs/DESIGN.md §6.3-6.4).
//
// One thread, records in the order the recording daemon received them (the
// files of a run are merged by receive time), so a backtest is
// deterministic. What it does not model: run lifecycle (a resumed attempt is
// replayed as one timeline; its replayed steps are stale), and the daemon's
// admission limits (records are validated with the default IngestLimits).
//
// Labels come from the recording: the Hello labels `injection_step` (the step
// a fault or a benign change starts), `expected_cause` (set on fault runs),
// `scenario`, `config` and `warmup_steps`. Without them a run that diverged
// counts as a fault run with no injection step and a run that did not as a
// control.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "alerts/config.h"

namespace foreshock::ctl {

struct BacktestOptions {
  alerts::AlertConfig config = alerts::DefaultAlertConfig();
  // The divergence rule's warm-up when the recording has no warmup_steps label.
  int64_t divergence_warmup = 100;
  // The calibrated grad-norm baseline: robust z (median/MAD of the trailing
  // `gradnorm_window` steps, `gradnorm_gap` steps back) above this, on
  // `gradnorm_persist` consecutive steps.
  double gradnorm_z = 8.0;
  int gradnorm_window = 200;
  int gradnorm_gap = 10;
  int gradnorm_persist = 3;
  // Which detector outputs reach the alert engine (docs/EVALUATION.md's rows):
  // kAll everything; kMechanism everything except what reads the knob (the
  // learning rate the job streams, signals lr and lr_over_held_max, so
  // neither the LR surge nor the probable cause's LR evidence sees it; and
  // the curvature ratio rho = lambda / tau(lr) with its threshold tau, whose
  // LR the client read from the optimizer: the mechanism row judges lambda)
  // and the output check (attention_output_bias / _error): as if the job
  // streamed no LR and sent no check; kDirect only those (and
  // attention_compute_bits, the dtype the cause reads); kNoLr everything but
  // what reads the LR (a job that does not stream it: a hand-written loop
  // without lr=), the output check included. Non-finite events reach the
  // engine in every mode.
  enum class Signals { kAll, kMechanism, kDirect, kNoLr };
  Signals signals = Signals::kAll;
  // Signals whose every value (per head and the layer aggregate) is kept per
  // run in BacktestRun::series, for offline reference detectors
  // (tests/eval/reference.py).
  std::set<std::string, std::less<>> dump_signals;
};

// "all", "mechanism", "direct"; nullopt for anything else.
std::optional<BacktestOptions::Signals> ParseBacktestSignals(std::string_view text);
// Whether a detector output of `signal` reaches the engine under `mode`.
bool BacktestDelivers(BacktestOptions::Signals mode, std::string_view signal);

// One value of a dumped signal (BacktestOptions::dump_signals).
struct SeriesValue {
  int64_t step = 0;
  int layer = 0;
  int head = 0;  // detectors::kAllHeads (-1) for the aggregate
  double value = 0;
};

// One alert episode that reached firing.
struct FiredAlert {
  int64_t step = 0;  // the step it fired at
  int64_t first_step = 0;
  std::string alertname;
  std::string layer;
  std::string signal;
  std::string probable_cause;  // as given when it fired (provisional or settled)
};

struct BacktestRun {
  std::string run_id;
  std::vector<std::string> files;
  std::map<std::string, std::string> labels;  // the first Hello's labels
  std::string scenario, config, expected_cause;
  std::optional<int64_t> injection_step;
  bool fault = false;  // expected_cause set, or (unlabeled) it diverged

  uint64_t records = 0, rejected = 0, duplicate_batches = 0;
  std::map<std::string, uint64_t> rejection_reasons;  // by code
  std::string error;  // a file that could not be read, or ended in corruption
  int64_t last_step = -1;

  std::optional<int64_t> divergence_step;
  std::vector<FiredAlert> fired;  // in the order they fired
  // The first firing alert at or after the injection (any alert, for an
  // unlabeled run), its lead over the divergence, and that lead as a
  // fraction of injection -> divergence.
  std::optional<FiredAlert> first_alert;
  std::optional<int64_t> lead;
  std::optional<double> lead_fraction;
  // The probable cause the engine gave last before the divergence (at the
  // end of the run when it did not diverge), and whether it was settled.
  std::string cause;
  bool cause_settled = false;
  // Alerts that fired in a control run, or before the injection in a fault
  // run, or (unlabeled fault run) never: counted per firing episode.
  int false_alarms = 0;
  // The first alarm step of each baseline at or after the injection, and
  // whether it alarmed before the injection (or at all, in a control).
  struct Baseline {
    std::optional<int64_t> first;  // at or after the injection (fault runs); any (controls)
    bool early = false;            // alarmed before the injection in a fault run
  };
  std::map<std::string, Baseline> baselines;  // olmo, megatron, nan, gradnorm_z
  // BacktestOptions::dump_signals' values, by signal, in the order emitted.
  std::map<std::string, std::vector<SeriesValue>> series;

  bool cause_correct() const { return fault && !expected_cause.empty() && cause == expected_cause; }
  bool first_cause_correct() const {
    return fault && !expected_cause.empty() && first_alert &&
           first_alert->probable_cause == expected_cause;
  }
};

struct BacktestResult {
  std::vector<BacktestRun> runs;  // by run_id
  std::vector<std::string> errors;  // files that could not be opened
};

// Replays `files` (any order; grouped by the run_id of their Hello).
BacktestResult RunBacktest(const std::vector<std::string>& files, const BacktestOptions& options);

// The per-run table and the summary, for humans.
std::string BacktestTable(const BacktestResult& result);
std::string BacktestSummary(const BacktestResult& result);
// One JSON document: {"runs": [...], "summary": {...}}.
std::string BacktestJson(const BacktestResult& result);

// docs/DESIGN.md §6.3: the first step at or after `warmup` where the 20-step
// mean loss exceeds 1.3x its running minimum, or the loss is not finite.
// `losses` are (step, loss) in step order.
std::optional<int64_t> DivergenceStep(const std::vector<std::pair<int64_t, double>>& losses,
                                      int64_t warmup);

}  // namespace foreshock::ctl
