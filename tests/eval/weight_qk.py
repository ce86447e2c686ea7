"""Evaluates the weight-side QK spectrum on the corpus (issue 13, section 3):
does the spectrum of W_Q^h W_K^hT, or of its step increment, earn a place
beside the probe-side signals?

    /usr/bin/python3 tests/eval/weight_qk.py --corpus /work/corpus [--json OUT] [--report OUT.md]

Needs a corpus made with `make_corpus.py --weight-qk`: every run then also
streamed run RUN-wqk, whose "probe" is the weights themselves (demo/train.py
WeightQKView: Q = W_Q^hT, K = W_K^hT per head, so Q K^T = W_Q^hT W_K^h), and
wrote logs/RUN.wqk.jsonl with the singular values of each head's W_Q^hT W_K^h.

Two signals are scored, both with the daemon's defaults and without tuning:
- the increment: the RUN-wqk streams replayed by `foreshockctl backtest`, so
  the daemon's own QK-increment detector (baseline, gates, persistence)
  scores the spectral entropy of the weights' step increment;
- the level: the normalized spectral entropy of W_Q^hT W_K^h (per layer, the
  mean over heads), scored offline by a simpler rule than the daemon's
  (LEVEL_RULE: the daemon's warm-up, small-sample inflation, z threshold and
  relative-change gate, against every earlier sample, without its window, gap,
  trend or CUSUM), in either direction.

Per fault scenario it reports which comes first: the weight-side signal, the
probe-side QK alert, or the training run's first alert; and on controls and
before injections, whether the weight-side signal alarms.
"""
import argparse
import json
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import evaluate  # noqa: E402
import configs  # noqa: E402

# deploy/foreshock.yaml's defaults where they apply: scored from the 13th sample
# against a median/MAD baseline of every earlier sample, its scale inflated by
# (1 + 25/n) for n samples; anomalous at |z| >= 5 and a change of at least 10%
# of the baseline; an alarm after 3 anomalous samples in a row.
LEVEL_RULE = dict(warmup=12, inflation=25.0, z=5.0, min_relative_change=0.10, persistence=3)


def robust_z_alarm(values, rule=LEVEL_RULE):
    """Index of the first sample of the first rule.persistence anomalous samples
    in a row (LEVEL_RULE); None if never."""
    run = 0
    for i in range(rule["warmup"], len(values)):
        base = values[:i]
        med = statistics.median(base)
        mad = 1.4826 * statistics.median(abs(v - med) for v in base)
        scale = max(mad, 1e-12) * (1.0 + rule["inflation"] / len(base))
        z = (values[i] - med) / scale
        big = abs(values[i] - med) >= rule["min_relative_change"] * abs(med)
        run = run + 1 if abs(z) >= rule["z"] and big else 0
        if run >= rule["persistence"]:
            return i - rule["persistence"] + 1
    return None


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


def first_alert(alerts, names=None, after=None):
    steps = [a["step"] for a in alerts
             if (names is None or a["alertname"] in names) and (after is None or a["step"] >= after)]
    return min(steps) if steps else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True)
    p.add_argument("--foreshockctl", default=evaluate.DEFAULT_CTL)
    p.add_argument("--config", default=None)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--report", default=None, help="markdown table of the comparison")
    args = p.parse_args(argv)

    with open(os.path.join(args.corpus, "manifest.json")) as f:
        manifest = {r["run_id"]: r for r in json.load(f)["runs"]}
    main_files = evaluate.recordings(args.corpus)
    weight_files = evaluate.recordings(args.corpus, weight_side=True)
    if not weight_files:
        raise SystemExit("no RUN-wqk recordings: make the corpus with make_corpus.py --weight-qk")
    main_rows = {r["run_id"]: r for r in evaluate.backtest_parallel(
        args.foreshockctl, main_files, args.config, args.jobs)["runs"]}
    weight_rows = {r["labels"].get("main_run", r["run_id"][:-4]): r for r in
                   evaluate.backtest_parallel(args.foreshockctl, weight_files, args.config,
                                              args.jobs)["runs"]}

    rows = []
    for run_id, m in sorted(manifest.items()):
        if run_id not in main_rows or run_id not in weight_rows:
            continue
        main, weight = main_rows[run_id], weight_rows[run_id]
        inj = m["injection_step"] if m["kind"] == "fault" else None
        div = main["divergence_step"]
        level_path = os.path.join(args.corpus, "logs", run_id + ".wqk.jsonl")
        level_step = None
        if os.path.exists(level_path):
            steps, per_layer = level_series(level_path)
            hits = [robust_z_alarm(series) for series in per_layer]
            hits = [steps[i] for i in hits if i is not None]
            level_step = min(hits) if hits else None
        rows.append(dict(
            run_id=run_id, config=m["config"], split=m.get("split", "?"),
            scenario=m["scenario"], fault=m["kind"] == "fault", injection=inj, divergence=div,
            main_first=main["first_alert_step"],
            main_first_name=main["first_alert"]["alertname"] if main["first_alert"] else None,
            probe_qk=first_alert(main["alerts"], {"ForeshockQKIncrementCollapse"}),
            lr_surge=first_alert(main["alerts"], {"ForeshockLearningRateSurge"}),
            main_cause=main["cause"], expected_cause=main["expected_cause"],
            weight_increment=weight["first_alert_step"],
            weight_increment_name=weight["first_alert"]["alertname"] if weight["first_alert"] else None,
            weight_level=level_step))
    report = render(rows)
    print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.report:
        with open(args.report, "w") as f:
            f.write(report + "\n")
    return rows


def false_alarm(step, row):
    """An alarm on a control, or before the injection of a fault run."""
    return step is not None and (not row["fault"] or step < row["injection"])


def lead_fraction(step, row):
    if step is None or not row["fault"] or row["divergence"] is None or step < row["injection"]:
        return None
    span = row["divergence"] - row["injection"]
    return (row["divergence"] - step) / span if span > 0 and step <= row["divergence"] else None


def render(rows):
    def cell(v):
        return "-" if v is None else str(v)

    out = ["| run | split | injection | divergence | first alert (training run) | probe QK "
           "| LR surge | weight increment | weight level |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        first = f"{cell(r['main_first'])} {r['main_first_name'] or ''}".strip()
        out.append(f"| {r['run_id']} | {r['split']} | {cell(r['injection'])} | {cell(r['divergence'])} "
                   f"| {first} | {cell(r['probe_qk'])} | {cell(r['lr_surge'])} "
                   f"| {cell(r['weight_increment'])} | {cell(r['weight_level'])} |")
    out += ["", "| signal | controls alarmed | fault runs alarmed before injection "
            "| fault runs alarmed before divergence | median lead % | first of all (strictly) "
            "| before the LR surge (combined faults) |", "|---|---|---|---|---|---|---|"]
    controls = [r for r in rows if not r["fault"]]
    faults = [r for r in rows if r["fault"]]
    diverged = [r for r in faults if r["divergence"] is not None]
    combined = [r for r in faults if r["scenario"] == "both"]
    for key, name in (("probe_qk", "probe-side QK increment (training run)"),
                      ("weight_increment", "weight-side increment"),
                      ("weight_level", "weight-side level")):
        ctl = sum(r[key] is not None for r in controls)
        early = sum(false_alarm(r[key], r) for r in faults)
        before = [r for r in diverged if r[key] is not None and not false_alarm(r[key], r)
                  and r[key] <= r["divergence"]]
        leads = [lead_fraction(r[key], r) for r in before]
        leads = [x for x in leads if x is not None]
        first = sum(1 for r in faults if r[key] is not None and not false_alarm(r[key], r)
                    and (r["main_first"] is None or r[key] < r["main_first"]))
        before_lr = sum(1 for r in combined if r[key] is not None and not false_alarm(r[key], r)
                        and (r["lr_surge"] is None or r[key] < r["lr_surge"]))
        out.append(f"| {name} | {ctl}/{len(controls)} | {early}/{len(faults)} "
                   f"| {len(before)}/{len(diverged)} "
                   f"| {round(100 * statistics.median(leads)) if leads else '-'} "
                   f"| {first}/{len(faults)} | {before_lr}/{len(combined)} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
