"""The preregistered held-out evaluation (issue 25, item 3).

Protocol (docs/EVALUATION.md, "Preregistered held-out draw"):
1. The detectors, the alert rules and their defaults are frozen in a commit
   (FREEZE below names what "frozen" covers).
2. Only then are the held-out runs drawn: configurations at random from SPACE,
   the random generator seeded by that commit's hash, CELLS x PER_CELL runs.
   The draw is written to tests/eval/preregistered/draw-<commit>.json before
   anything is trained.
3. The draw is recorded (make_corpus.py --plan) by a build of the freeze
   commit, and scored once (`score`), with the three rows and the two
   reference baselines of evaluate.py.
4. Any decision taken after looking at a draw's results is listed in
   docs/EVALUATION.md; after it a fresh draw (a new freeze commit) is recorded
   and scored.

    /usr/bin/python3 tests/eval/preregistered.py draw [--commit SHA]
    OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/eval/make_corpus.py --out DIR \\
        --plan tests/eval/preregistered/draw-SHA.json --jobs 2
    /usr/bin/python3 tests/eval/preregistered.py score --corpus DIR \\
        --draw tests/eval/preregistered/draw-SHA.json --report OUT.md

Every cell is a fault a rule reading the job's knobs cannot reveal, or a
control with a benign event such a rule must not alarm on. The job still
streams its LR (the shipped row reads it); the mechanism row ignores it.
"""
import argparse
import json
import math
import os
import random
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE]

# What the freeze covers: a change under these paths after the freeze commit
# invalidates the draw (score refuses to score a build whose tree differs).
# Every path that decides what a recording holds or how it is scored: the
# daemon and the client, the model and its fault code (demo/tiny_moe_gpt.py;
# draws 1-4 named a demo/model.py that never existed, so the model was not
# guarded), and the evaluation code that plans, records and scores a draw.
FREEZE = ("codec", "detectors", "alerts", "server", "ctl", "deploy/foreshock.yaml", "proto",
          "client/python/foreshock", "demo/train.py", "demo/tiny_moe_gpt.py",
          "tests/eval/make_corpus.py", "tests/eval/configs.py", "tests/eval/evaluate.py",
          "tests/eval/reference.py", "tests/eval/preregistered.py")

PER_CELL = 3
STEPS_AFTER_INJECTION = 1200  # a fault run that never diverges ends here
CONTROL_STEPS = 1500

# The documented space. Each run draws every architecture, optimizer, probe,
# curvature and data knob independently (a cell may pin one, e.g. MoE for the
# router fault, bf16 attention for the precision faults).
SPACE = dict(
    n_layer=[2, 3, 4, 6],
    d_model=[32, 48, 64],
    head_dim=[8, 16],              # n_head = d_model / head_dim
    gqa=[False, True],             # K/V heads = n_head / 2 when n_head >= 4
    moe=["none", "default", "alternate", "all"],
    n_experts=[4, 8],
    top_k=[1, 2],
    block_size=[32, 48, 64],
    batch_size=[8, 16],
    lr=(1.5e-3, 4e-3),             # log-uniform
    warmup=[50, 100, 200],
    beta2=[0.95, 0.99, 0.999],
    every=[5, 10, 20, 25, 50],     # the probe cadence, in steps
    probe_seqs=[1, 2, 4],
    curvature_every=[20, 50, 100],
    curvature_seqs=[1, 2, 3],
    curvature_hvps=[2, 3, 4],
    data=["text", "copy"],
    attention_dtype=["bf16", "fp32"],
    injection=(300, 800),          # uniform, a multiple of 10, for faults and benign events
)

# cell -> (kind, expected cause or None, pins, flags(rng, injection))
CELLS = {
    # LR faults the LR rule cannot see.
    "lr_peak": ("fault", "learning_rate_too_high", {},
                lambda r, inj: ["--fault", "lr_peak", "--lr-factor", r.choice([8, 10, 15])]),
    "lr_hidden": ("fault", "learning_rate_too_high", {},
                  lambda r, inj: ["--fault", "lr_hidden", "--lr-factor", 300,
                                  "--lr-ramp-steps", r.choice([300, 500, 800])]),
    # Precision faults: truncation, and the published round-to-nearest P-bar V
    # with row-max ties, at the strengths where they hurt the demo model.
    "lowprec": ("fault", "low_precision_attention", {"attention_dtype": "bf16"},
                lambda r, inj: ["--fault", "lowprec", "--fault-strength", r.choice([24, 32]),
                                "--lowprec-on", "both"]),
    "lowprec_rtn": ("fault", "low_precision_attention", {"attention_dtype": "bf16"},
                    lambda r, inj: ["--fault", "lowprec_rtn", "--fault-strength",
                                    r.choice([48, 128]), "--rtn-tie-window", 0.1]),
    # Other mechanisms, whose cause the rule table has no name for.
    "no_balance": ("fault", "unknown", {"moe": ["default", "alternate", "all"]},
                   lambda r, inj: ["--no-balance-loss"]),
    "adam_eps": ("fault", "unknown", {},
                 lambda r, inj: ["--adam-eps", 1e-12, "--beta2", 0.9]),
    # Controls.
    "healthy": ("control", None, {}, lambda r, inj: []),
    "rewarm_x2": ("control", None, {},
                  lambda r, inj: ["--lr-restart-step", inj, "--lr-restart-warmup", 100,
                                  "--lr-restart-peak-factor", 2.0]),
    "lr_raise": ("control", None, {},
                 lambda r, inj: ["--lr-raise-step", inj, "--lr-raise-factor", 2.0]),
    "data_switch": ("control", None, {"data": "text"},
                    lambda r, inj: ["--text-switch-step", inj, "--text-switch-to", "permissive"]),
}
# The powered design (issue 33): a draw whose fault runs mostly diverge, so
# that it holds at least 20 diverging faults beside 12 controls. Only the
# fault cells with a strength that makes a run diverge by the §6.3 rule, at
# strengths calibrated on calibration draws 3-7, never on a held-out one
# (docs/EVALUATION.md, "Draw 5"). Left out: lr_peak (an LR too high from the
# start stalls the loss under clipping, or blows it up inside the warm-up,
# where the rule does not look: 3 of 12 diverged in draws 1-4 at x8-15, 2 of
# 11 in calibration draws 3-4 at x10-50, also with a 400-600-step warm-up;
# the natural benchmark scores that fault as a degraded run), no_balance
# and adam_eps (1 of 24 diverged, and no strength knob).
POWERED_CELLS = {"lr_hidden": 10, "lowprec": 7, "lowprec_rtn": 7,
                 "healthy": 3, "rewarm_x2": 3, "lr_raise": 3, "data_switch": 3}
# cell -> the strengths a run draws from: the hidden LR's factor (diverged
# 6 of 6 at x30-100 in calibration 7, 12 of 12 at x300 in draws 1-4), the
# precision faults' --fault-strength (truncation: 8 of 9 at x48-96 in
# calibrations 3, 5, 6, against 8 of 12 at x24-32 in draws 1-4; x128
# diverged 7 of 7, most 7-39 steps after the injection, faster than many
# probe cadences; round-to-nearest: 11 of 12 at x48-128 in draws 1-4).
POWERED_STRENGTHS = {"lr_peak": [8, 10, 15], "lr_hidden": [30, 100, 300],
                     "lowprec": [48, 64, 96], "lowprec_rtn": [48, 128]}
CALIBRATION_RUNS_PER_CELL = 6
# Calibration draw 4 tried lr_peak with a long warm-up (its plan records it).
POWERED_LR_PEAK_WARMUP = [400, 600]


def powered_flags(cell, strengths):
    """CELLS[cell]'s flags, with the cell's strength drawn from `strengths`."""
    kind, cause, pins, flags_of = CELLS[cell]
    if cell not in strengths:
        return CELLS[cell]
    choices = strengths[cell]
    if cell == "lr_peak":
        # A long warm-up, as large runs use: the model learns before the LR
        # passes what the architecture takes, and then diverges. With the
        # space's 50-200-step warm-ups a peak too high stalls the loss from
        # the start instead (1 of 5 diverged at x20-50, calibration draw 3).
        return kind, cause, dict(pins, warmup=POWERED_LR_PEAK_WARMUP), \
            lambda r, inj: ["--fault", "lr_peak", "--lr-factor", r.choice(choices)]
    if cell == "lowprec":
        return kind, cause, pins, lambda r, inj: ["--fault", "lowprec", "--fault-strength",
                                                  r.choice(choices), "--lowprec-on", "both"]
    if cell == "lr_hidden":
        return kind, cause, pins, lambda r, inj: ["--fault", "lr_hidden", "--lr-factor",
                                                  r.choice(choices), "--lr-ramp-steps",
                                                  r.choice([300, 500, 800])]
    return kind, cause, pins, lambda r, inj: ["--fault", "lowprec_rtn", "--fault-strength",
                                              r.choice(choices), "--rtn-tie-window", 0.1]


# Faults present from step 0 (their injection step is 0).
FROM_START = ("lr_peak", "no_balance", "adam_eps")
CATEGORY = {"lr_peak": "LR, knob-blind", "lr_hidden": "LR, knob-blind",
            "lowprec": "precision", "lowprec_rtn": "precision",
            "no_balance": "other mechanism", "adam_eps": "other mechanism",
            "healthy": "control", "rewarm_x2": "control", "lr_raise": "control",
            "data_switch": "control"}


def seed_of(commit):
    return int(commit[:16], 16)


def draw_config(rng, pins):
    """One configuration's train.py flags and attention dtype."""
    def pick(key):
        pinned = pins.get(key)
        if isinstance(pinned, list):
            return rng.choice(pinned)
        return pinned if pinned is not None else rng.choice(SPACE[key])
    n_layer, d_model, head_dim = pick("n_layer"), pick("d_model"), pick("head_dim")
    n_head = d_model // head_dim
    kv = n_head // 2 if (pick("gqa") and n_head >= 4) else n_head
    lo, hi = SPACE["lr"]
    lr = float(f"{math.exp(rng.uniform(math.log(lo), math.log(hi))):.2e}")
    moe, dtype, data = pick("moe"), pick("attention_dtype"), pick("data")
    flags = ["--n-layer", n_layer, "--d-model", d_model, "--n-head", n_head, "--n-kv-head", kv,
             "--moe", moe, "--n-experts", pick("n_experts"), "--top-k", pick("top_k"),
             "--block-size", pick("block_size"), "--batch-size", pick("batch_size"),
             "--lr", lr, "--warmup", pick("warmup"), "--beta2", pick("beta2"),
             "--every", pick("every"), "--probe-seqs", pick("probe_seqs"),
             "--curvature-every", pick("curvature_every"),
             "--curvature-seqs", pick("curvature_seqs"),
             "--curvature-hvps", pick("curvature_hvps"), "--data", data]
    if data == "copy":
        flags += ["--copy-period", rng.choice([6, 7, 8])]
    return [str(f) for f in flags] + ["--attention-dtype", dtype], dtype


def design_cells(design, per_cell=PER_CELL, strengths=None, only=None):
    """cell -> (runs, (kind, cause, pins, flags)) of a design ("classic":
    every cell, per_cell runs each; "powered": POWERED_CELLS at
    POWERED_STRENGTHS, or `strengths` for a calibration draw), less the cells
    not in `only`."""
    if design == "classic":
        cells = {cell: (per_cell, spec) for cell, spec in CELLS.items()}
    else:
        table = dict(POWERED_STRENGTHS, **(strengths or {}))
        # A calibration draw of chosen cells: CALIBRATION_RUNS_PER_CELL each.
        counts = {cell: CALIBRATION_RUNS_PER_CELL for cell in only} if only else POWERED_CELLS
        cells = {cell: (n, powered_flags(cell, table)) for cell, n in counts.items()}
    return {cell: v for cell, v in cells.items() if not only or cell in only}


def draw(commit, per_cell=PER_CELL, calibration_seed=None, design="classic", strengths=None,
         only=None):
    """The runs (make_corpus.make_run dicts) of the draw seeded by `commit`, or,
    for tuning, of a calibration draw seeded by `calibration_seed` (same space,
    never scored as held out)."""
    import make_corpus  # noqa: E402
    if calibration_seed is not None:
        rng, split = random.Random(f"calibration-{calibration_seed}"), \
            f"calibration-draw-{calibration_seed}"
    else:
        rng, split = random.Random(seed_of(commit)), f"preregistered-{commit[:12]}"
    runs = []
    for cell, (count, (kind, cause, pins, flags_of)) in design_cells(
            design, per_cell, strengths, only).items():
        for _ in range(count):
            flags, dtype = draw_config(rng, pins)
            seed = rng.randrange(1000)
            lo, hi = SPACE["injection"]
            inj = 0 if cell in FROM_START else 10 * rng.randrange(lo // 10, hi // 10 + 1)
            extra = [str(f) for f in flags_of(rng, inj)]
            if cell == "adam_eps":  # its own beta2 replaces the drawn one
                j = flags.index("--beta2")
                del flags[j:j + 2]
            c = dict(name=f"{'c' if calibration_seed is not None else 'd'}{len(runs):02d}",
                     split=split,
                     attention_dtype=dtype, flags=flags)
            if kind == "fault":
                steps = inj + STEPS_AFTER_INJECTION
                run = make_corpus.make_run(c, cell, seed, steps, inj,
                                           extra + ["--fault-step", str(inj)], cause=cause)
            else:
                run = make_corpus.make_run(c, cell, seed, CONTROL_STEPS,
                                           inj if extra else None, extra, stop=None, cause=None)
            run.update(kind=kind, cell=cell, category=CATEGORY[cell])
            run["train_flags"] += ["--label", f"cell={cell}"]
            runs.append(run)
    return runs


def head_commit():
    return subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()


def frozen_tree_matches(commit, paths=FREEZE):
    """True when the working tree's frozen paths (a draw's own list, which
    grew over time) equal the freeze commit's."""
    out = subprocess.run(["git", "-C", ROOT, "diff", "--quiet", commit, "--", *paths])
    return out.returncode == 0


def cmd_draw(args):
    commit = args.commit or head_commit()
    strengths = {}
    for item in args.strengths or []:
        cell, _, values = item.partition("=")
        if cell not in POWERED_STRENGTHS or not values:
            sys.exit(f"--strengths {item}: expected CELL=a,b,... with CELL one of "
                     f"{', '.join(POWERED_STRENGTHS)}")
        strengths[cell] = [float(v) if "." in v else int(v) for v in values.split(",")]
    if (strengths or args.cells) and args.calibration_seed is None:
        sys.exit("--strengths and --cells are for calibration draws: a held-out draw is "
                 "the design as frozen")
    runs = draw(commit, args.per_cell, args.calibration_seed, args.design, strengths, args.cells)
    name = (f"calibration-{args.calibration_seed}" if args.calibration_seed is not None
            else f"draw-{commit[:12]}")
    path = args.out or os.path.join(HERE, "preregistered", f"{name}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    doc = dict(freeze_commit=commit if args.calibration_seed is None else None,
               seed=seed_of(commit) if args.calibration_seed is None
               else f"calibration-{args.calibration_seed}", per_cell=args.per_cell,
               design=args.design,
               cell_counts={c: n for c, (n, _) in design_cells(
                   args.design, args.per_cell, strengths, args.cells).items()},
               strengths=dict(POWERED_STRENGTHS, **strengths) if args.design == "powered"
               else None,
               frozen_paths=list(FREEZE), space={k: v for k, v in SPACE.items()},
               cells={k: dict(kind=v[0], expected_cause=v[1], category=CATEGORY[k])
                      for k, v in CELLS.items()},
               runs=runs)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{len(runs)} runs drawn with seed {doc['seed']}: {path}")


def cmd_score(args):
    import evaluate  # noqa: E402
    with open(args.draw) as f:
        doc = json.load(f)
    commit = doc["freeze_commit"] or "calibration"
    if doc["freeze_commit"] and args.config:
        sys.exit("a held-out draw is scored with the frozen built-in defaults, not --config")
    paths = doc.get("frozen_paths") or FREEZE
    if doc["freeze_commit"] and not args.allow_unfrozen and not frozen_tree_matches(commit, paths):
        sys.exit(f"the tree's {', '.join(paths)} differ from the freeze commit {commit[:12]}: "
                 "score with a build of that commit (or record a fresh draw)")
    by_id = {r["run_id"]: r for r in doc["runs"]}
    files = evaluate.recordings(args.corpus)
    rows = evaluate.three_rows(args.foreshockctl, files, args.config, args.jobs)
    # Preregistered from draw 6 on: the row that reads no LR by any path but
    # keeps the attention output check (mechanism + output check), which tells
    # logit growth from an LR apart from a precision fault in bf16 jobs.
    rows["no_lr"] = evaluate.backtest_parallel(args.foreshockctl, files, args.config, args.jobs,
                                               extra=("--signals", "no_lr"))["runs"]
    for name in rows:
        rows[name] = [dict(r, category=by_id[r["run_id"]]["category"],
                           cell=by_id[r["run_id"]]["cell"])
                      for r in rows[name] if r["run_id"] in by_id]
    with open(os.path.join(args.corpus, "manifest.json")) as f:
        manifest = {r["run_id"]: r for r in json.load(f)["runs"]}
    lines = [f"Freeze commit `{commit}`, seed {doc['seed']}; {len(doc['runs'])} runs drawn, "
             f"{len(rows['shipped'])} scored.", "",
             without_all(evaluate.rows_table(rows, lambda r: "this draw",
                                             evaluate.ROWS + NO_LR_ROW)), "",
             controls_that_held(rows), "",
             "By fault category (each row's controls are all the draw's controls):", "",
             category_table(evaluate, rows), "", per_run_table(rows, manifest)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.report:
        with open(args.report, "w") as f:
            f.write(text)
    if args.json:
        for v in rows.values():
            for r in v:
                r.pop("series", None)
        with open(args.json, "w") as f:
            json.dump(dict(freeze_commit=commit, rows=rows), f, indent=1)


# The fourth row (draw 6 on): no LR read by any path, the output check kept.
NO_LR_ROW = (("no_lr", "no LR read (mechanism signals and the output check)"),)


def controls_that_held(rows):
    """Controls alarmed, counting only the controls that did not diverge
    themselves (preregistered from draw 6 on): a control that diverges by the
    §6.3 rule is an instability, and an alert on it is not a false alarm. The
    table above keeps every control."""
    import evaluate  # noqa: E402
    lines = ["Controls that did not diverge, alarmed:", "",
             "| row | controls alarmed (95% CI) | controls that diverged |", "|---|---|---|"]
    for name, title in evaluate.ROWS + NO_LR_ROW:
        controls = [r for r in rows[name] if not r["fault"]]
        held = [r for r in controls if r["divergence_step"] is None]
        alarmed = sum(1 for r in held if r["alerts"])
        lines.append(f"| {title} | {alarmed}/{len(held)} ({evaluate.wilson(alarmed, len(held))}) "
                     f"| {len(controls) - len(held)} |")
    return "\n".join(lines)


def category_table(evaluate, rows):
    controls = {name: [r for r in v if not r["fault"]] for name, v in rows.items()}
    cats = sorted({r["category"] for r in rows["shipped"] if r["fault"]})
    per_cat = {}
    for cat in cats:
        per_cat[cat] = {name: [r for r in v if r["fault"] and r["category"] == cat]
                        + controls[name] for name, v in rows.items()}
    lines = []
    for cat in cats:
        table = evaluate.rows_table(per_cat[cat], lambda r, c=cat: c,
                                    evaluate.ROWS + NO_LR_ROW).split("\n")
        lines += table if not lines else table[2:]
    return without_all("\n".join(lines))


def without_all(table):
    """rows_table's table less its rows for the group "all" (here: the same rows again)."""
    return "\n".join(line for line in table.split("\n") if not line.startswith("| all |"))


def fmt_alert(row):
    """The first alert after the injection (a fault), or the first at all (a
    control, whose every alert is false): 'step Name/signal Llayer'."""
    fa, step = row.get("first_alert"), row.get("first_alert_step")
    if not row.get("fault") and row.get("alerts"):
        fa = row["alerts"][0]
        step = fa.get("step")
    if not fa:
        return "none"
    return (f"{step} {fa['alertname'].replace('Foreshock', '')}/{fa.get('signal', '')} "
            f"L{fa.get('layer', '?')}")


def per_run_table(rows, manifest):
    mech = {r["run_id"]: r for r in rows["mechanism"]}
    ship = {r["run_id"]: r for r in rows["shipped"]}
    ref = {r["run_id"]: r for r in rows["qk_head_z"]}
    lines = ["| run | configuration | injection → divergence | mechanism: first alert (lead) "
             "| cause (mechanism) | shipped: first alert | early / control alarms (mech, shipped) "
             "| reference QK z first |",
             "|---|---|---|---|---|---|---|---|"]
    for run_id in sorted(ship):
        m, s, q = mech.get(run_id, {}), ship[run_id], ref.get(run_id, {})
        flags = manifest.get(run_id, {}).get("train_flags", [])
        def flag(name):
            return flags[flags.index(name) + 1] if name in flags else "?"
        cfg = (f"{flag('--n-layer')}L d{flag('--d-model')} h{flag('--n-head')}/{flag('--n-kv-head')} "
               f"moe {flag('--moe')} {flag('--attention-dtype')} {flag('--data')} "
               f"every {flag('--every')} β2 {flag('--beta2')}")
        inj, div = s["injection_step"], s["divergence_step"]
        lead = ""
        if m.get("lead") and m["lead"] > 0 and m.get("lead_fraction") is not None:
            lead = f" ({m['lead']} = {100 * m['lead_fraction']:.0f}%)"
        lines.append(f"| {run_id} | {cfg} | {inj if inj is not None else '—'} → "
                     f"{div if div is not None else '—'} | {fmt_alert(m)}{lead} | "
                     f"{m.get('cause') or '—'} | {fmt_alert(s)} | "
                     f"{m.get('false_alarms', 0)}, {s.get('false_alarms', 0)} | "
                     f"{q.get('first_alert_step') if q.get('first_alert_step') is not None else '—'} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("draw", help="draw the held-out runs, seeded by the freeze commit")
    d.add_argument("--commit", default=None, help="the freeze commit (default: HEAD)")
    d.add_argument("--per-cell", type=int, default=PER_CELL, help="runs per cell (classic)")
    d.add_argument("--design", choices=["classic", "powered"], default="classic",
                   help="classic: every cell, --per-cell runs each; powered: the diverging "
                        "fault cells at calibrated strengths, 6 runs each, and 12 controls")
    d.add_argument("--strengths", nargs="*", metavar="CELL=a,b",
                   help="calibration draws only: the strengths a powered cell draws from")
    d.add_argument("--cells", nargs="*", choices=sorted(CELLS),
                   help="calibration draws only: draw these cells alone")
    d.add_argument("--out", default=None)
    d.add_argument("--calibration-seed", type=int, default=None,
                   help="a calibration draw for tuning (same space, seeded by this number, "
                        "labelled calibration-draw-N; never a held-out result)")
    s = sub.add_parser("score", help="score a recorded draw once")
    s.add_argument("--corpus", required=True)
    s.add_argument("--draw", required=True)
    s.add_argument("--foreshockctl", default=os.path.join(ROOT, "build", "ctl", "foreshockctl"))
    s.add_argument("--jobs", type=int, default=2)
    s.add_argument("--config", default=None,
                   help="an alert configuration (YAML) instead of the built-in defaults "
                        "(calibration draws; a held-out draw is scored with the defaults)")
    s.add_argument("--report", default=None)
    s.add_argument("--json", default=None)
    s.add_argument("--allow-unfrozen", action="store_true",
                   help="score although the frozen paths changed (the report must say so)")
    args = p.parse_args(argv)
    return cmd_draw(args) if args.cmd == "draw" else cmd_score(args)


if __name__ == "__main__":
    sys.exit(main())
