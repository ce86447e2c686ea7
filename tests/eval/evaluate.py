"""Scores the evaluation corpus by replay (`foreshockctl backtest`) and writes
docs/evaluation/ci-corpus.md (issue 13; protocol: docs/DESIGN.md §6).

    /usr/bin/python3 tests/eval/evaluate.py --corpus /work/corpus \\
        [--config deploy/foreshock.yaml] [--json docs/evaluation/corpus.json] \\
        [--report docs/evaluation/ci-corpus.md] [--calibrate]

Every run of the corpus (tests/eval/make_corpus.py) is a recording of a real
training streamed by the real client; `foreshockctl backtest` replays each
through the daemon's own validation, detectors and alert engine with the
given configuration (default: the built-in defaults, identical to
deploy/foreshock.yaml) and scores it. Configurations are split into
calibration and held-out ones (tests/eval/configs.py): the held-out ones
never enter a tuning decision. --calibrate also replays a grid of candidate
settings (CANDIDATES) and reports, per left-out configuration, what the
setting chosen on the others does on it (leave-one-configuration-out).
"""
import argparse
import concurrent.futures
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DEFAULT_CTL = os.path.join(ROOT, "build", "ctl", "foreshockctl")

CAUSES = ("low_precision_attention", "learning_rate_too_high", "combined")


# ------------------------------------------------------------------ replay

def backtest(ctl, files, config=None, timeout=3600, extra=()):
    """foreshockctl backtest --json over `files` (and `extra` options): its document."""
    cmd = [ctl, "backtest", *files, "--json", *extra]
    if config:
        cmd += ["--config", config]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode not in (0, 1) or not out.stdout.strip():
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def backtest_parallel(ctl, files, config=None, jobs=2, extra=()):
    """The same, with the files of each run kept together, over `jobs` processes."""
    by_run = {}
    for f in files:
        by_run.setdefault(run_of_file(f), []).append(f)
    groups = [[] for _ in range(max(1, jobs))]
    for i, run in enumerate(sorted(by_run)):
        groups[i % len(groups)].extend(by_run[run])
    groups = [g for g in groups if g]
    with concurrent.futures.ThreadPoolExecutor(len(groups)) as pool:
        docs = list(pool.map(lambda g: backtest(ctl, g, config, extra=extra), groups))
    runs = sorted((r for d in docs for r in d["runs"]), key=lambda r: r["run_id"])
    errors = [e for d in docs for e in d["errors"]]
    return dict(runs=runs, errors=errors)


def run_of_file(path):
    """The run id in a recording's file name (<time>-<run>-rank<r>-s<n>.fsrec)."""
    base = os.path.basename(path)
    stem = base.split("-", 1)[1] if "-" in base else base
    return stem.rsplit("-rank", 1)[0]


def recordings(corpus, weight_side=False):
    """The corpus's recordings: the training runs' own, or (weight_side) the
    RUN-wqk streams of make_corpus.py --weight-qk (tests/eval/weight_qk.py)."""
    out = []
    for dirpath, _, names in os.walk(os.path.join(corpus, "recordings")):
        out += [os.path.join(dirpath, n) for n in names
                if n.endswith(".fsrec") and ("-wqk-rank" in n) == weight_side]
    return sorted(out)


# ------------------------------------------------------------------ scoring

def split_of(run, splits):
    return splits.get(run["config"], run["labels"].get("split", "calibration"))


def summarize(runs):
    """The issue's targets over `runs` (backtest rows)."""
    faults = [r for r in runs if r["fault"]]
    controls = [r for r in runs if not r["fault"]]
    diverged = [r for r in faults if r["divergence_step"] is not None]
    alerted = [r for r in diverged if r["lead"] is not None and r["lead"] > 0]
    fractions = [max(0.0, r["lead_fraction"] or 0.0) if r["lead"] and r["lead"] > 0 else 0.0
                 for r in diverged if r["injection_step"] is not None]
    labeled = [r for r in faults if r["expected_cause"]]
    return dict(
        fault_runs=len(faults), diverged=len(diverged), alerted_before_divergence=len(alerted),
        median_lead_fraction=statistics.median(fractions) if fractions else None,
        median_lead=statistics.median([r["lead"] if r["lead"] and r["lead"] > 0 else 0
                                       for r in diverged]) if diverged else None,
        cause_correct=sum(r["cause_correct"] for r in labeled),
        first_cause_correct=sum(r["first_cause_correct"] for r in labeled), cause_labeled=len(labeled),
        control_runs=len(controls), controls_alerted=sum(1 for r in controls if r["alerts"]),
        faults_alerted_early=sum(1 for r in faults if r["false_alarms"] > 0),
        false_alarms=sum(r["false_alarms"] for r in runs))


def targets_met(s):
    """(all met, per-target (name, met, text))."""
    rows = [
        ("every fault alerted before divergence",
         s["diverged"] > 0 and s["alerted_before_divergence"] == s["diverged"],
         f"{s['alerted_before_divergence']}/{s['diverged']}"),
        ("median lead >= 50% of injection -> divergence",
         s["median_lead_fraction"] is not None and s["median_lead_fraction"] >= 0.5,
         pct(s["median_lead_fraction"])),
        ("zero alerts on healthy and benign runs, none before the injection",
         s["controls_alerted"] == 0 and s["faults_alerted_early"] == 0,
         f"{s['controls_alerted']}/{s['control_runs']} controls alerted, "
         f"{s['faults_alerted_early']}/{s['fault_runs']} faults alerted before injection"),
        ("probable cause right on >= 90% of fault runs",
         s["cause_labeled"] > 0 and s["cause_correct"] >= 0.9 * s["cause_labeled"],
         f"{s['cause_correct']}/{s['cause_labeled']}"),
        ("first alert's provisional cause right on >= 75%",
         s["cause_labeled"] > 0 and s["first_cause_correct"] >= 0.75 * s["cause_labeled"],
         f"{s['first_cause_correct']}/{s['cause_labeled']}"),
    ]
    return all(r[1] for r in rows), rows


def pct(x):
    return "-" if x is None else f"{100 * x:.0f}%"


def objective(s):
    """How calibration ranks settings: false alarms first (fewer is better),
    then faults alerted before divergence, then causes, then the median lead."""
    return (-(s["controls_alerted"] + s["faults_alerted_early"]), s["alerted_before_divergence"],
            s["cause_correct"], s["median_lead_fraction"] or 0.0)


# ------------------------------------------------------------------ report

def run_table(runs):
    lines = ["| run | config | scenario | inject | diverge | first alert (step, alert/layer/signal) "
             "| lead | lead % | cause (first alert → before divergence) | expected | false alarms "
             "| OLMo | Megatron | NaN | grad-norm z |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        fa = r["first_alert"]
        first = f"{r['first_alert_step']}, {fa['alertname'].replace('Foreshock', '')}/{fa['layer']}/" \
                f"{fa['signal']}" if fa else "—"
        if not r["fault"] and r["alerts"]:
            a = r["alerts"][0]
            first = f"(false) {a['step']}, {a['alertname'].replace('Foreshock', '')}/{a['layer']}/{a['signal']}"
        cause = f"{fa['probable_cause'] if fa else '—'} → {r['cause'] or '—'}" if r["fault"] else "—"

        def base(name):
            b = r["baselines"].get(name, {})
            text = "—" if b.get("first_step") is None else str(b["first_step"])
            return text + (" (early)" if b.get("before_injection") else "")
        lines.append(
            f"| {r['run_id']} | {r['config']} | {r['scenario']} | {opt(r['injection_step'])} | "
            f"{opt(r['divergence_step'])} | {first} | {opt(r['lead'])} | {pct(r['lead_fraction'])} | "
            f"{cause} | {r['expected_cause'] or '—'} | {r['false_alarms']} | {base('olmo')} | "
            f"{base('megatron')} | {base('nan')} | {base('gradnorm_z')} |")
    return "\n".join(lines)


def opt(v):
    return "—" if v is None else str(v)


def summary_row(name, s):
    return (f"| {name} | {s['fault_runs']} | {s['alerted_before_divergence']}/{s['diverged']} | "
            f"{pct(s['median_lead_fraction'])} | {opt(s['median_lead'])} | "
            f"{s['cause_correct']}/{s['cause_labeled']} | {s['first_cause_correct']}/{s['cause_labeled']} | "
            f"{s['controls_alerted']}/{s['control_runs']} | {s['faults_alerted_early']}/{s['fault_runs']} |")


SUMMARY_HEADER = ("| configurations | fault runs | alerted before divergence | median lead % | "
                  "median lead (steps) | cause right | first alert's cause right | controls alerted | "
                  "faults alerted before injection |\n|---|---|---|---|---|---|---|---|---|")


def baselines_summary(runs):
    out = []
    for name, title in (("olmo", "OLMo 6σ/128"), ("megatron", "Megatron 10×"), ("nan", "NaN check"),
                        ("gradnorm_z", "grad-norm robust z")):
        noisy = [r["run_id"] for r in runs
                 if (not r["fault"] and r["baselines"].get(name, {}).get("first_step") is not None)
                 or r["baselines"].get(name, {}).get("before_injection")]
        faults = [r for r in runs if r["fault"] and r["divergence_step"] is not None]
        before = sum(1 for r in faults
                     if r["baselines"].get(name, {}).get("first_step") is not None
                     and r["baselines"][name]["first_step"] < r["divergence_step"])
        beaten = sum(1 for r in faults
                     if r["baselines"].get(name, {}).get("first_step") is not None
                     and r["first_alert_step"] is not None
                     and r["first_alert_step"] < r["baselines"][name]["first_step"])
        out.append(f"| {title} | {'noisy (' + str(len(noisy)) + ' runs)' if noisy else 'competes'} | "
                   f"{before}/{len(faults)} | {beaten} |")
    return ("| baseline | on controls / before injection | alarmed before divergence | "
            "Foreshock's first alert earlier |\n|---|---|---|---|\n" + "\n".join(out))


# ------------------------------------------------------------------ the three rows

# Issue 25: what reads the mechanism apart from what reads the knob. Each row is
# a replay of the same recordings (`foreshockctl backtest --signals`), plus the
# two reference baselines (tests/eval/reference.py).
ROWS = (("mechanism", "mechanism signals alone (no LR streamed, no output check)"),
        ("direct", "direct checks alone (LR surge, output check)"),
        ("shipped", "shipped defaults"),
        ("qk_head_z", "reference: per-head robust z, QK-increment entropy"),
        ("gradnorm_z", "reference: robust z, grad norm"))


def three_rows(ctl, files, config=None, jobs=2):
    """{row name: backtest-shaped rows} for ROWS."""
    sys.path.insert(0, HERE)
    import reference  # noqa: E402
    mech = backtest_parallel(ctl, files, config, jobs,
                             extra=("--signals", "mechanism",
                                    "--dump_series", "qk_increment_entropy"))["runs"]
    direct = backtest_parallel(ctl, files, config, jobs, extra=("--signals", "direct"))["runs"]
    shipped = backtest_parallel(ctl, files, config, jobs)["runs"]
    return dict(mechanism=mech, direct=direct, shipped=shipped,
                qk_head_z=reference.qk_head_rows(mech), gradnorm_z=reference.gradnorm_rows(shipped))


def wilson(k, n, z=1.96):
    """The Wilson score interval of k successes in n, as 'lo-hi%'."""
    if n == 0:
        return "—"
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return f"{100 * max(0.0, c - h):.0f}-{100 * min(1.0, c + h):.0f}%"


ROWS_HEADER = ("| group | row | warned before divergence (95% CI) | median lead % | "
               "median lead (steps) | controls alarmed (95% CI) | faults alarmed before injection "
               "| cause right | first alarm (runs) |\n|---|---|---|---|---|---|---|---|---|")


def rows_table(rows_by_name, group_of, row_titles=ROWS):
    """The rows named in `row_titles` for every configuration group
    (group_of(run) -> group name)."""
    groups = sorted({group_of(r) for r in rows_by_name["shipped"]}) + ["all"]
    lines = [ROWS_HEADER]
    for g in groups:
        for name, title in row_titles:
            chosen = [r for r in rows_by_name[name] if g == "all" or group_of(r) == g]
            s = summarize(chosen)
            reference_row = name in ("qk_head_z", "gradnorm_z")
            firsts = {}
            for r in chosen:
                fa = r.get("first_alert") if not reference_row else None
                if fa:
                    fam = FAMILIES.get(fa["alertname"], fa["alertname"])
                    firsts[fam] = firsts.get(fam, 0) + 1
            first = ", ".join(f"{k} ×{v}" for k, v in sorted(firsts.items(), key=lambda kv: -kv[1]))
            lines.append(
                f"| {g} | {title} | {s['alerted_before_divergence']}/{s['diverged']} "
                f"({wilson(s['alerted_before_divergence'], s['diverged'])}) | "
                f"{pct(s['median_lead_fraction'])} | {opt(s['median_lead'])} | "
                f"{s['controls_alerted']}/{s['control_runs']} "
                f"({wilson(s['controls_alerted'], s['control_runs'])}) | "
                f"{s['faults_alerted_early']}/{s['fault_runs']} | "
                f"{'—' if reference_row else str(s['cause_correct']) + '/' + str(s['cause_labeled'])} | "
                f"{first or '—'} |")
    return "\n".join(lines)


# ------------------------------------------------------------------ calibration

# The signals read from the probe (QK and router samples), whose warm-up and
# baseline the calibration varies; the loss and curvature keep theirs.
PROBE_SIGNALS = ("qk_increment_entropy", "qk_increment_top1_share", "attention_max_logit",
                 "attention_entropy", "router_entropy", "router_flip_rate", "router_z_loss",
                 "router_load_cv", "router_max_violation")
GROUPS = {"probe": PROBE_SIGNALS, "qk": ("qk_increment_entropy", "qk_increment_top1_share")}


def candidate_yaml(knobs):
    """An alert configuration (YAML) that sets `knobs` on top of the built-in
    defaults: probe.<key> on every probe signal, <signal>.<key> on one."""
    per_signal = {}
    knobs = dict(knobs)
    # attention.mode: "change" (the attention signals alert on changes) or
    # "bound_only" (the max logit alerts on its absolute bound only, the
    # attention entropy not at all).
    if "attention.mode" in knobs:
        change = knobs.pop("attention.mode") == "change"
        knobs["attention_max_logit.change_detection"] = change
        knobs["attention_entropy.enabled"] = change
    for key, value in knobs.items():
        target, _, field = key.partition(".")
        names = GROUPS.get(target, (target,))
        for name in names:
            per_signal.setdefault(name, {})[field] = value
    lines = ["alerts:", "  signals:"]
    for name in sorted(per_signal):
        lines.append(f"    {name}:")
        for field, value in sorted(per_signal[name].items()):
            lines.append(f"      {field}: {json.dumps(value)}")
    return "\n".join(lines) + "\n"


def grid(axes):
    """Every combination of the axes {key: [values]}, as dicts."""
    combos = [{}]
    for key, values in axes.items():
        combos = [dict(c, **{key: v}) for c in combos for v in values]
    return combos


def replay_candidates(ctl, files, candidates, jobs):
    """{index: runs} for every candidate (a dict of knobs)."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, knobs in enumerate(candidates):
            path = os.path.join(tmp, f"c{i}.yaml")
            with open(path, "w") as f:
                f.write(candidate_yaml(knobs))
            out[i] = backtest_parallel(ctl, files, path, jobs)["runs"]
            s = summarize(out[i])
            print(f"  candidate {i}: {knobs}: faults alerted {s['alerted_before_divergence']}/"
                  f"{s['diverged']}, controls alerted {s['controls_alerted']}/{s['control_runs']}, "
                  f"early {s['faults_alerted_early']}, cause {s['cause_correct']}/{s['cause_labeled']}, "
                  f"median lead {pct(s['median_lead_fraction'])}", flush=True)
    return out


def choose(candidates, results, configs):
    """The candidate that ranks best (objective) over the runs of `configs`."""
    def score(i):
        return objective(summarize([r for r in results[i] if r["config"] in configs]))
    return max(range(len(candidates)), key=lambda i: (score(i), -i))


def leave_one_out(candidates, results, all_configs):
    """Per configuration c: the candidate chosen on every other configuration,
    and what it gives on c."""
    rows = []
    for c in sorted(all_configs):
        i = choose(candidates, results, set(all_configs) - {c})
        rows.append((c, i, summarize([r for r in results[i] if r["config"] == c])))
    return rows


# ------------------------------------------------------------------ main

# The axes --calibrate searches (every combination is replayed once).
CALIBRATION_AXES = {
    # Fixed by the protocol: scoring by the 15th sample of a series at the latest.
    "probe.warmup": [12],
    "probe.min_baseline": [4],
    "router_dead_experts.warmup": [12],
    "loss.warmup": [14],
    "loss.min_baseline": [4],
    # Searched.
    # Chosen on a first pass over the calibration configurations recorded first
    # (gpt4, deep6, part of gqa), where 0 and 0 alarmed on more controls.
    "probe.small_sample_inflation": [25.0],
    "probe.gate_inflation": [20.0],
    "attention_max_logit.log_scale": [True],
    "attention_max_logit.min_relative_change": [0.25, 1.0],
    "attention_entropy.min_relative_change": [0.2, 0.4],
    "attention.mode": ["change", "bound_only"],
    "qk.trend": [True, False],
    "loss.min_relative_change": [0.25, 0.5],
    "curvature_eos_ratio.min_relative_change": [1.0, 2.0],
    # The learning-rate surge: above twice (or three times) the highest LR held.
    "lr_over_held_max.bound": [2.0, 3.0],
}

FAMILIES = {
    "ForeshockQKIncrementCollapse": "QK spectrum", "ForeshockAttentionLogitGrowth": "attention logits",
    "ForeshockAttentionEntropyCollapse": "attention logits", "ForeshockRouterCollapse": "router collapse",
    "ForeshockRouterImbalance": "router imbalance", "ForeshockCurvatureAboveEdge": "curvature",
    "ForeshockLearningRateSurge": "learning rate", "ForeshockAttentionRoundingBias": "rounding bias",
    "ForeshockLossSpike": "loss spike",
    "ForeshockNonFinite": "non-finite",
}


def leading_signals(runs):
    """Per fault scenario: per alert family, in how many runs it fired at or
    after the injection, and its median delay after the injection (steps)."""
    out = {}
    for r in runs:
        if not r["fault"] or r["injection_step"] is None:
            continue
        first = {}
        for a in r["alerts"]:
            if a["step"] >= r["injection_step"]:
                fam = FAMILIES.get(a["alertname"], a["alertname"])
                first.setdefault(fam, a["step"] - r["injection_step"])
        lead_family = FAMILIES.get(r["first_alert"]["alertname"]) if r["first_alert"] else None
        entry = out.setdefault(r["scenario"], dict(runs=0, families={}, first={}))
        entry["runs"] += 1
        if lead_family:
            entry["first"][lead_family] = entry["first"].get(lead_family, 0) + 1
        for fam, delay in first.items():
            entry["families"].setdefault(fam, []).append(delay)
    return out


def write_report(path, result, corpus, notes_path):
    runs = result["runs"]
    lines = ["# The CI corpus: the shipped defaults on its runs (generated)", "",
             "Generated by `tests/eval/evaluate.py` from `foreshockctl backtest` over the evaluation "
             "corpus (`tests/eval/make_corpus.py`; protocol: docs/DESIGN.md §6). Every number below "
             "is computed from the replay; the hand-written reading at the end (tests/eval/READING.md) "
             "is the only prose that is not. This corpus predates the preregistered draws; today's "
             "held-out results are in [docs/EVALUATION.md](../EVALUATION.md).", "",
             "## How to reproduce", "",
             "```",
             "OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/eval/make_corpus.py --out CORPUS --jobs 2",
             "/usr/bin/python3 tests/eval/evaluate.py --corpus CORPUS --report docs/evaluation/ci-corpus.md"
             + (" --calibrate" if result.get("calibration_search") else ""),
             "```", "",
             f"Corpus: {result['files']} recordings, {len(runs)} runs "
             f"({sum(1 for r in runs if r['fault'])} fault runs, "
             f"{sum(1 for r in runs if not r['fault'])} healthy or benign), "
             f"replayed in {result['seconds']:.0f} s "
             f"({'the built-in defaults, identical to deploy/foreshock.yaml' if not result.get('config') else result['config']}).",
             ""]
    if result.get("rows"):
        lines += ["## Mechanism signals, direct checks, shipped defaults (issue 25)", "",
                  "Three replays of the same recordings (`foreshockctl backtest --signals "
                  "mechanism|direct|all`) and the two reference baselines "
                  "(tests/eval/reference.py). Mechanism: every detector output except the learning "
                  "rate the job streams (so neither the LR surge nor the cause's LR evidence reads "
                  "it) and the attention output check. Direct: only those. Intervals: Wilson 95%.",
                  "", rows_table(result["rows"], lambda r: r.get("split", "?")), ""]
    lines += ["## Held-out configurations", "",
              "Configurations the calibration never saw (other architectures and probe cadences "
              "than every calibration configuration). Decisions taken after looking at them are "
              "listed in the reading at the end.", "", SUMMARY_HEADER,
              summary_row("held out", result["held_out"]),
              summary_row("calibration", result["calibration"]),
              summary_row("all", result["all"]), "",
              "| target (held-out configurations) | met | result |", "|---|---|---|"]
    for name, met, text in targets_met(result["held_out"])[1]:
        lines.append(f"| {name} | {'yes' if met else '**no**'} | {text} |")
    lines += ["", "## Per configuration", "", SUMMARY_HEADER]
    for c, s in result["per_config"].items():
        lines.append(summary_row(f"{c} ({result['splits'].get(c, '?')})", s))
    if result.get("leave_one_out"):
        lines += ["", "## Leave one configuration out", "",
                  "For each configuration, the setting chosen (by the calibration objective: fewest "
                  "false alarms, then most faults alerted before divergence, then causes, then the "
                  "median lead) on every *other* configuration, and what it gives on the one left "
                  "out. Candidates: " + ", ".join(f"`{k}` ∈ {v}" for k, v in CALIBRATION_AXES.items())
                  + ".", "",
                  "| left out | chosen on the others |" + SUMMARY_HEADER.split("\n")[0].split("|", 2)[2],
                  "|---|---|" + SUMMARY_HEADER.split("\n")[1].split("|", 2)[2]]
        searched = [k for k, v in CALIBRATION_AXES.items() if len(v) > 1]
        for c, knobs, s in result["leave_one_out"]:
            row = summary_row(c, s)
            chosen = ", ".join(f"{k}={knobs[k]}" for k in searched)
            lines.append(f"| {c} | {chosen} " + row[row.index("|", 2):])
    lines += ["", "## Which signal leads, per fault", "",
              "Per fault scenario: which alert family fired first after the injection (runs), and "
              "per family the runs in which it fired at all after the injection with its median "
              "delay (steps after the injection).", "",
              "| fault | runs | first alert (runs) | family: fired in runs, median delay |", "|---|---|---|---|"]
    for scenario, e in sorted(leading_signals(runs).items()):
        first = ", ".join(f"{k} ×{v}" for k, v in sorted(e["first"].items(), key=lambda kv: -kv[1]))
        fams = "; ".join(f"{k}: {len(v)}, {statistics.median(v):g}" for k, v in sorted(e["families"].items()))
        lines.append(f"| {scenario} | {e['runs']} | {first or '—'} | {fams or '—'} |")
    lines += ["", "## Baselines", "",
              "On the same per-step series (docs/DESIGN.md §6.4). A baseline that alarms on a control "
              "or before the injection is noisy and does not compete.", "", baselines_summary(runs),
              "", "## Every run", "", run_table(runs), ""]
    if result["errors"]:
        lines += ["Replay errors: " + "; ".join(result["errors"]), ""]
    if notes_path and os.path.exists(notes_path):
        with open(notes_path) as f:
            lines += [f.read().rstrip(), ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True, help="make_corpus.py's --out")
    p.add_argument("--foreshockctl", default=DEFAULT_CTL)
    p.add_argument("--config", default=None, help="alert configuration (default: built-in)")
    p.add_argument("--json", default=None, help="write the backtest rows and summaries here")
    p.add_argument("--report", default=None, help="write the markdown report here")
    p.add_argument("--notes", default=os.path.join(HERE, "READING.md"),
                   help="hand-written reading appended to the report")
    p.add_argument("--calibrate", action="store_true",
                   help="also replay CALIBRATION_AXES: choice on the calibration configurations "
                        "and a leave-one-configuration-out table")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--no-rows", action="store_true",
                   help="skip the mechanism / direct / reference rows (two more replays)")
    args = p.parse_args(argv)

    sys.path.insert(0, HERE)
    import configs  # noqa: E402  (tests/eval/configs.py: the configuration table and its split)
    splits = {name: c["split"] for name, c in configs.CONFIGS.items()}

    files = recordings(args.corpus)
    t0 = time.monotonic()
    doc = backtest_parallel(args.foreshockctl, files, args.config, args.jobs)
    seconds = time.monotonic() - t0
    runs = doc["runs"]
    for r in runs:
        r["split"] = split_of(r, splits)
    held = [r for r in runs if r["split"] == "held_out"]
    cal = [r for r in runs if r["split"] != "held_out"]
    result = dict(seconds=seconds, files=len(files), errors=doc["errors"], runs=runs,
                  config=args.config, splits=splits,
                  held_out=summarize(held), calibration=summarize(cal), all=summarize(runs),
                  per_config={c: summarize([r for r in runs if r["config"] == c])
                              for c in sorted({r["config"] for r in runs})})
    print(f"{len(runs)} runs from {len(files)} files replayed in {seconds:.0f} s")
    if not args.no_rows:
        result["rows"] = three_rows(args.foreshockctl, files, args.config, args.jobs)
        for rows in result["rows"].values():
            for r in rows:
                r["split"] = split_of(r, splits)
                r.pop("series", None)
        print(rows_table(result["rows"], lambda r: r["split"]))
    if args.calibrate:
        candidates = grid(CALIBRATION_AXES)
        print(f"calibration: {len(candidates)} candidates")
        results = replay_candidates(args.foreshockctl, files, candidates, args.jobs)
        calibration_configs = {c for c, split in splits.items() if split != "held_out"}
        chosen = choose(candidates, results, calibration_configs)
        result["calibration_search"] = dict(candidates=candidates, chosen=candidates[chosen],
                                            chosen_yaml=candidate_yaml(candidates[chosen]))
        print(f"chosen on the calibration configurations: {candidates[chosen]}")
        print(candidate_yaml(candidates[chosen]))
        result["leave_one_out"] = [
            (c, candidates[i], s) for c, i, s in leave_one_out(candidates, results, set(splits))]
    print(SUMMARY_HEADER)
    print(summary_row("held out", result["held_out"]))
    print(summary_row("calibration", result["calibration"]))
    for c, s in result["per_config"].items():
        print(summary_row(f"{c} ({splits.get(c, '?')})", s))
    for name, met, text in targets_met(result["held_out"])[1]:
        print(f"  held out: {'MET ' if met else 'not met'}  {name}: {text}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.report:
        write_report(args.report, result, args.corpus, args.notes)
    return result


if __name__ == "__main__":
    main()
