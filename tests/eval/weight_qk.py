"""Evaluates the weight-side QK spectrum on the corpus (issue 13, section 3):
does the spectrum of W_Q^h W_K^hT, or of its step increment, earn a place
beside the probe-side signals?

    /usr/bin/python3 tests/eval/weight_qk.py --corpus /work/corpus-w [--json OUT] [--report OUT.md]

Needs a corpus made with `make_corpus.py --weight-qk`: every run then also
streamed run RUN-wqk, whose "probe" is the weights themselves (demo/train.py
WeightQKView: Q = W_Q^hT, K = W_K^hT per head, so Q K^T = W_Q^hT W_K^h), and
wrote logs/RUN.wqk.jsonl with the singular values of each head's W_Q^hT W_K^h.

Two signals, both scored by the daemon's own rules:
- the increment: the RUN-wqk streams replayed by `foreshockctl backtest`, so
  the shipped QK-increment detector and alert rules score the spectral
  entropy (and top-1 share) of the weights' step increment, with the
  shipped configuration (without the fp32 hold: the weights are sent as fp32
  Q/K, and no other alert kind can corroborate in that stream) and with the
  INCREMENT_CANDIDATES (a smaller gate,
  no trend following: the weights' increment drifts slowly), one chosen on
  the calibration configurations as below;
- the level: per layer, the mean over heads of the normalized spectral
  entropy of W_Q^hT W_K^h, scored by the daemon's change detector
  (foreshock_series_alarm: ChangeDetectorOptions' defaults, direction drop,
  a spectrum concentrating as the QK-increment one does) with the effect-size
  gate chosen on the calibration configurations among LEVEL_GATES by
  evaluate.py's objective (fewest false alarms, then most faults alarmed
  before divergence, then the lead); the held-out configurations are reported
  with that choice.

Per fault scenario it reports which comes first: the weight-side signal, the
probe-side QK alert, or the training run's first alert; on controls and
before injections, whether it alarms; and for the cause rule, how often the
weight-side alarm comes before the LR surge in combined faults (it would make
them `combined`) and in learning-rate faults (it would make them wrong).
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import evaluate  # noqa: E402

DEFAULT_ALARM = os.path.join(ROOT, "build", "tests", "eval", "foreshock_series_alarm")
LEVEL_GATES = (0.02, 0.05, 0.10)  # min_relative_change candidates (0.10: the shipped QK gate)
INCREMENT_CANDIDATES = [{}] + [
    {"qk_increment_entropy.min_relative_change": gate, "qk.trend": trend}
    for gate in (0.02, 0.05, 0.10) for trend in (True, False) if (gate, trend) != (0.10, True)]


def candidate_name(knobs):
    return ", ".join(f"{k} {v}" for k, v in knobs.items()) or "shipped configuration"


def level_series(path):
    """(steps, per_layer) from a .wqk.jsonl file: per_layer[l][i] is layer l's
    mean over heads of the normalized spectral entropy of W_Q^hT W_K^h
    (-sum p log p / log(head_dim), p = sigma / sum sigma) at steps[i]."""
    steps, layers = [], []
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            steps.append(row["step"])
            per_layer = []
            for heads in row["singular_values"]:
                ents = []
                for sv in heads:
                    total = sum(sv)
                    p = [s / total for s in sv if s > 0]
                    ents.append(-sum(x * math.log(x) for x in p) / math.log(len(sv)))
                per_layer.append(sum(ents) / len(ents))
            layers.append(per_layer)
    return steps, [list(col) for col in zip(*layers)] if layers else []


def series_alarm(binary, series, gate):
    """{name: first alarm step} of the daemon's change detector (direction drop,
    min_relative_change gate) over {name: [(step, value)]}."""
    text = "".join(f"{name} {step} {value!r}\n" for name, points in series.items()
                   for step, value in points if math.isfinite(value))
    out = subprocess.run([binary, "--direction", "drop", "--min_relative_change", str(gate)],
                         input=text, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"{binary} failed: {out.stderr}")
    alarms = {}
    for line in out.stdout.splitlines():
        name, step, _onset = line.split()
        alarms[name] = int(step)
    return alarms


def first_alert(alerts, names=None):
    steps = [a["step"] for a in alerts if names is None or a["alertname"] in names]
    return min(steps) if steps else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True)
    p.add_argument("--foreshockctl", default=evaluate.DEFAULT_CTL)
    p.add_argument("--series_alarm", default=os.environ.get("FORESHOCK_SERIES_ALARM",
                                                             DEFAULT_ALARM))
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--report", default=None, help="markdown tables of the comparison")
    args = p.parse_args(argv)

    with open(os.path.join(args.corpus, "manifest.json")) as f:
        manifest = {r["run_id"]: r for r in json.load(f)["runs"]}
    main_files = evaluate.recordings(args.corpus)
    weight_files = evaluate.recordings(args.corpus, weight_side=True)
    if not weight_files:
        raise SystemExit("no RUN-wqk recordings: make the corpus with make_corpus.py --weight-qk")
    main_rows = {r["run_id"]: r for r in evaluate.backtest_parallel(
        args.foreshockctl, main_files, None, args.jobs)["runs"]}
    # Per increment candidate: {main run: backtest row of its RUN-wqk stream}.
    weight_by_candidate = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, knobs in enumerate(INCREMENT_CANDIDATES):
            # The weights travel as fp32 "attention" Q/K; the fp32 hold (attention
            # alerts wait for another kind) is about a run's attention, not this.
            config = os.path.join(tmp, f"c{i}.yaml")
            with open(config, "w") as f:
                f.write((evaluate.candidate_yaml(knobs) if knobs else "alerts:\n")
                        + "  probable_cause:\n    fp32_attention_needs_corroboration: false\n")
            weight_by_candidate.append(
                {r["labels"].get("main_run", r["run_id"][:-4]): r for r in
                 evaluate.backtest_parallel(args.foreshockctl, weight_files, config,
                                            args.jobs)["runs"]})
    weight_rows = weight_by_candidate[0]

    rows = []
    for run_id, m in sorted(manifest.items()):
        if run_id not in main_rows or run_id not in weight_rows:
            continue
        main, weight = main_rows[run_id], weight_rows[run_id]
        level = {}
        level_path = os.path.join(args.corpus, "logs", run_id + ".wqk.jsonl")
        if os.path.exists(level_path):
            steps, per_layer = level_series(level_path)
            series = {f"layer{l}": list(zip(steps, values)) for l, values in enumerate(per_layer)}
            for gate in LEVEL_GATES:
                alarms = series_alarm(args.series_alarm, series, gate)
                level[gate] = min(alarms.values()) if alarms else None
        rows.append(dict(
            run_id=run_id, config=m["config"], split=m.get("split", "?"),
            scenario=m["scenario"], fault=m["kind"] == "fault",
            injection=m["injection_step"] if m["kind"] == "fault" else None,
            divergence=main["divergence_step"],
            main_first=main["first_alert_step"],
            main_first_name=main["first_alert"]["alertname"] if main["first_alert"] else None,
            probe_qk=first_alert(main["alerts"], {"ForeshockQKIncrementCollapse"}),
            lr_surge=first_alert(main["alerts"], {"ForeshockLearningRateSurge"}),
            main_cause=main["cause"], expected_cause=main["expected_cause"],
            weight_increment=weight["first_alert_step"],
            weight_increment_candidates=[c[run_id]["first_alert_step"] if run_id in c else None
                                         for c in weight_by_candidate],
            weight_level={str(g): s for g, s in level.items()}))
    calibration = [r for r in rows if r["split"] != "held_out"]
    gate = choose(calibration, LEVEL_GATES, lambda r, g: r["weight_level"].get(str(g)))
    increment = choose(calibration, range(len(INCREMENT_CANDIDATES)),
                       lambda r, i: r["weight_increment_candidates"][i])
    for r in rows:
        r["weight_level_chosen"] = r["weight_level"].get(str(gate))
        r["weight_increment_chosen"] = r["weight_increment_candidates"][increment]
    report = render(rows, gate, increment)
    print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, level_gate=gate,
                           increment_candidate=INCREMENT_CANDIDATES[increment]), f, indent=1)
    if args.report:
        with open(args.report, "w") as f:
            f.write(report + "\n")
    return rows


def false_alarm(step, row):
    """An alarm on a control, or before the injection of a fault run."""
    return step is not None and (not row["fault"] or step < row["injection"])


def lead_fraction(step, row):
    span = row["divergence"] - row["injection"]
    return (row["divergence"] - step) / span if span > 0 else None


def scores(rows, step_of):
    """The evaluation's targets for one alarm step per run (step_of(row))."""
    controls = [r for r in rows if not r["fault"]]
    faults = [r for r in rows if r["fault"]]
    diverged = [r for r in faults if r["divergence"] is not None]
    before = [r for r in diverged if step_of(r) is not None and not false_alarm(step_of(r), r)
              and step_of(r) <= r["divergence"]]
    leads = [x for x in (lead_fraction(step_of(r), r) for r in before) if x is not None]
    combined = [r for r in faults if r["scenario"] == "both"]
    lr_faults = [r for r in faults if r["scenario"] in ("lr", "lr_const")]

    def before_lr(r):
        s = step_of(r)
        return s is not None and not false_alarm(s, r) and (r["lr_surge"] is None or s < r["lr_surge"])
    return dict(
        controls=(sum(step_of(r) is not None for r in controls), len(controls)),
        early=(sum(false_alarm(step_of(r), r) for r in faults), len(faults)),
        before_divergence=(len(before), len(diverged)),
        median_lead=statistics.median(leads) if leads else None,
        first=(sum(1 for r in faults if step_of(r) is not None and not false_alarm(step_of(r), r)
                   and (r["main_first"] is None or step_of(r) < r["main_first"])), len(faults)),
        combined_before_lr=(sum(before_lr(r) for r in combined), len(combined)),
        lr_before_lr=(sum(before_lr(r) for r in lr_faults), len(lr_faults)))


def choose(rows, candidates, step_of):
    """evaluate.py's objective on these rows: fewest false alarms, then most
    faults alarmed before divergence, then the longest median lead; the
    first candidate listed on a tie."""
    def key(candidate):
        s = scores(rows, lambda r: step_of(r, candidate))
        return (s["controls"][0] + s["early"][0], -s["before_divergence"][0],
                -(s["median_lead"] or 0))
    return min(candidates, key=key)


def render(rows, gate, increment):
    def cell(v):
        return "-" if v is None else str(v)

    def frac(pair):
        return f"{pair[0]}/{pair[1]}"

    out = ["# The weight-side QK spectrum on the evaluation corpus", "",
           "Generated by `tests/eval/weight_qk.py` (issue 13, section 3) from a corpus made with "
           "`tests/eval/make_corpus.py --weight-qk`; the reading and the decision are in "
           "docs/EVALUATION.md. Steps are training steps; `-`: none. An alarm on a control, or "
           "before the injection of a fault run, is a false alarm.", "",
           f"Chosen on the calibration configurations: weight-side increment, "
           f"{candidate_name(INCREMENT_CANDIDATES[increment])}; weight-side level, the change "
           f"detector's gate (min_relative_change) {gate}.", "",
           "| run | split | injection | divergence | first alert (training run) | probe QK "
           "| LR surge | weight increment | weight level |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        first = f"{cell(r['main_first'])} {r['main_first_name'] or ''}".strip()
        out.append(f"| {r['run_id']} | {r['split']} | {cell(r['injection'])} | {cell(r['divergence'])} "
                   f"| {first} | {cell(r['probe_qk'])} | {cell(r['lr_surge'])} "
                   f"| {cell(r['weight_increment_chosen'])} | {cell(r['weight_level_chosen'])} |")
    out += ["", "| split | signal | controls alarmed | faults alarmed before injection "
            "| faults alarmed before divergence | median lead % | before every other alert "
            "| combined faults: before the LR surge | LR faults: before the LR surge |",
            "|---|---|---|---|---|---|---|---|---|"]
    signals = [("probe-side QK increment alert", lambda r: r["probe_qk"]),
               ("training run's first alert", lambda r: r["main_first"]),
               ]
    signals += [(f"weight-side increment, {candidate_name(k)}" + (" (chosen)" if i == increment else ""),
                 lambda r, i=i: r["weight_increment_candidates"][i])
                for i, k in enumerate(INCREMENT_CANDIDATES)]
    signals += [(f"weight-side level, gate {g}" + (" (chosen)" if g == gate else ""),
                 lambda r, g=g: r["weight_level"].get(str(g))) for g in LEVEL_GATES]
    for split in ("held_out", "calibration"):
        part = [r for r in rows if (r["split"] == "held_out") == (split == "held_out")]
        if not part:
            continue
        for name, step_of in signals:
            s = scores(part, step_of)
            lead = "-" if s["median_lead"] is None else round(100 * s["median_lead"])
            out.append(f"| {split} | {name} | {frac(s['controls'])} | {frac(s['early'])} "
                       f"| {frac(s['before_divergence'])} | {lead} | {frac(s['first'])} "
                       f"| {frac(s['combined_before_lr'])} | {frac(s['lr_before_lr'])} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
