"""The natural-instability benchmark (issue 33, section 1): no injected fault.

Small models are trained at peak learning rates from sane to about an order of
magnitude past the largest stable one, with and without the mitigations that
small-scale proxies of large-run instabilities identify (Wortsman et al. 2023):
QK-layernorm against attention-logit growth, a z-loss against output-logit
drift, the MoE balance loss against router collapse; attention in fp32 or
emulated bf16. A run that diverges, or ends degraded against its
QK-layernorm twin (same everything, QK-layernorm on), has the configuration
as its cause: the LR is too high for this architecture.

Outcome of a run (classify):
  diverged  demo/train.py's rule (docs/DESIGN.md §6.3) fired; onset = that step
  healthy   its last-100-step mean loss is within HEALTHY_MARGIN of the best
            cell's at the same architecture (the best LR); an alert is a false
            alarm (outcome rule 2; rule 1 judged degraded first)
  degraded  not diverged nor healthy, and its 20-step mean loss exceeds its
            twin's by DAMAGE_MARGIN at some step after warm-up; onset = the
            first such step
  unclear   none of these (neither damaged nor as good as the best LR): not scored

  # the loss-vs-LR curve, unmonitored (no daemon): what diverges where
  OPENBLAS_NUM_THREADS=1 nice -n 19 /usr/bin/python3 tests/eval/natural.py pilot \\
      --out /work/natural-pilot --jobs 2 [--cells moe-fp32 ...] [--seeds 0 1 2]

Writes OUT/pilot.json (one row per run: cell, lr, seed, divergence step,
final loss, max loss, steps, wall seconds, the per-step losses) and prints the
table per cell.

  # monitored: the same runs streaming to a recording foreshockd (probes every
  # 10 steps by default, --every N; curvature every max(50, N)), then replayed with the mechanism signals
  # alone and scored against each run's outcome
  OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/eval/natural.py record \
      --out /work/natural --cells moe-fp32 --lrs 3e-3 1e-1 --seeds 0
  /usr/bin/python3 tests/eval/natural.py score /work/natural

  # drawn cells, preregistered: the groups (architecture, cadence, probe,
  # curvature, data from preregistered.SPACE; one per mitigation) seeded by the
  # freeze commit, each at DRAWN_LRS with its QK-layernorm twin
  /usr/bin/python3 tests/eval/natural.py draw            # at the freeze commit
  OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/eval/natural.py record \
      --out /work/natural-draw --plan tests/eval/preregistered/natural-SHA.json
  /usr/bin/python3 tests/eval/natural.py score /work/natural-draw [--signals no_lr]

Scoring (per run, from `foreshockctl backtest --signals mechanism`: no LR
streamed, no curvature ratio, no output check): a diverged or degraded run is
warned when an alert fired before its onset; its lead is onset - first alert
in steps and as a fraction of (onset - max(WARMUP, 100)), at most 100% (an
alert before the end of warm-up); the cause is the
first alert's probable cause. Any alert on a healthy run, its QK-layernorm
twin included, is a false alarm."""
import argparse
import concurrent.futures
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "client", "python")]

DAMAGE_MARGIN = 0.10   # degraded: 20-step mean loss > (1 + this) x the twin's
HEALTHY_MARGIN = 0.05  # healthy: final loss <= (1 + this) x the best LR's
STEPS = 800
WARMUP = 100

# The base shape: the demo's tiny MoE GPT (4 layers, d_model 64, 4 heads of 16,
# MoE in layers 1 and 3), character-level text, batch 16 of 64 tokens,
# AdamW(0.9, 0.95), clipping at 1 (the demo's default), probes every 10 steps.
BASE = ["--n-layer", "4", "--d-model", "64", "--n-head", "4", "--moe", "default",
        "--block-size", "64", "--batch-size", "16", "--beta2", "0.95",
        "--warmup", str(WARMUP), "--data", "text"]

# cell -> extra train.py flags. Each cell without QK-layernorm has a twin with it
# (the same flags plus --qk-norm): "<cell>+qkln".
CELLS = {
    "moe-fp32": ["--attention-dtype", "fp32"],
    "moe-bf16": ["--attention-dtype", "bf16"],
    "moe-fp32-zloss": ["--attention-dtype", "fp32", "--z-loss", "1e-4"],
    "moe-fp32-nobalance": ["--attention-dtype", "fp32", "--no-balance-loss"],
}
LRS = [3e-3, 1e-2, 3e-2, 1e-1, 3e-1]


# The shape of the runs shipped for CI (tests/eval/natural/): small enough that
# a recording is about a megabyte (2 layers, d_model 32, MoE in layer 1, 32
# tokens, one probe sequence) and 300 steps train in seconds.
CI_SHAPE = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--moe", "alternate",
            "--block-size", "32", "--batch-size", "16", "--beta2", "0.95",
            "--warmup", str(WARMUP), "--data", "text"]
SHAPES = {"base": BASE, "ci": CI_SHAPE}


def cell_flags(cell, shape="base"):
    base, twin = (cell[:-len("+qkln")], True) if cell.endswith("+qkln") else (cell, False)
    return SHAPES[shape] + CELLS[base] + (["--qk-norm"] if twin else [])


def all_cells(names=None):
    out = []
    for name in names or CELLS:
        out += [name, name + "+qkln"]
    return out


def mean20(losses, step):
    window = losses[max(0, step - 19):step + 1]
    return sum(window) / len(window)


def damage_onset(losses, twin_losses, warmup=WARMUP, margin=DAMAGE_MARGIN):
    """First step after warm-up whose 20-step mean loss exceeds the twin's by margin."""
    for step in range(max(warmup, 19), min(len(losses), len(twin_losses))):
        a, b = mean20(losses, step), mean20(twin_losses, step)
        if not math.isfinite(a) or a > (1 + margin) * b:
            return step
    return None


def final_loss(losses, last=100):
    tail = [x for x in losses[-last:] if math.isfinite(x)]
    return sum(tail) / len(tail) if len(tail) == len(losses[-last:]) else math.inf


# Outcome rules. 1: seeds 1-5 and natural draw 1. 2 (preregistered for
# natural draw 2 on): a run that ends within HEALTHY_MARGIN of its cell's best
# loss is healthy even if it trailed its twin by DAMAGE_MARGIN for a while: a
# transient gap at the best LR is not damage (seed 4's two misses at 3e-3 and
# natural draw 1's g0 at 3e-3 ended as well as any run of their cell).
OUTCOME_RULE = 2


def classify(row, twin, best_final, rule=OUTCOME_RULE):
    """diverged / degraded / healthy / unclear, with the onset step (see the module doc)."""
    if row["divergence_step"] is not None:
        return "diverged", row["divergence_step"]
    healthy = final_loss(row["losses"]) <= (1 + HEALTHY_MARGIN) * best_final
    if rule >= 2 and healthy:
        return "healthy", None
    if twin is not None and twin is not row:
        onset = damage_onset(row["losses"], twin["losses"], row.get("warmup", WARMUP))
        if onset is not None:
            return "degraded", onset
    if healthy:
        return "healthy", None
    return "unclear", None


def _pilot_one(spec):
    cell, lr, seed, steps = spec
    argv = [sys.executable, os.path.join(ROOT, "demo", "train.py"), "--endpoint", "",
            "--steps", str(steps), "--lr", repr(lr), "--seed", str(seed), "--threads", "1",
            "--log-every", "0", "--losses-out", "-"] + cell_flags(cell)
    t0 = time.monotonic()
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    out = subprocess.run(argv, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return dict(cell=cell, lr=lr, seed=seed, error=out.stderr[-2000:])
    losses = [math.nan if x is None else x
              for x in json.loads(out.stdout.strip().splitlines()[-1])["losses"]]
    from demo.train import divergence_step
    finite = [x for x in losses if math.isfinite(x)]
    return dict(cell=cell, lr=lr, seed=seed, steps=len(losses),
                divergence_step=divergence_step(losses, WARMUP),
                final_loss=final_loss(losses), max_loss=max(finite) if finite else None,
                wall_s=round(time.monotonic() - t0, 1), losses=losses)


def cmd_pilot(args):
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "pilot.json")
    done = json.load(open(path)) if os.path.exists(path) else []
    have = {(r["cell"], r["lr"], r["seed"]) for r in done if "error" not in r}
    specs = [(c, lr, s, args.steps) for c in all_cells(args.cells) for lr in args.lrs
             for s in args.seeds if (c, lr, s) not in have]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for row in pool.map(_pilot_one, specs):
            done = [r for r in done if (r["cell"], r["lr"], r["seed"]) !=
                    (row["cell"], row["lr"], row["seed"])] + [row]
            with open(path, "w") as f:
                json.dump(done, f)
            print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    print_table(done)


# Drawn cells (issue 33: "its cells are drawn like the others"). A natural
# draw is seeded by a freeze commit's hash, as preregistered.py's draws are:
# each group draws an architecture, optimizer, probe cadence, curvature
# estimator and data from preregistered.SPACE (the attention dtype and, for
# the no-balance mitigation, MoE pinned by its mitigation) and is recorded at
# every LR of DRAWN_LRS, with and without QK-layernorm. A group is a cell of
# its own: its best LR, healthy margin and twins are its own.
MITIGATIONS = {
    "fp32": (["--attention-dtype", "fp32"], {"attention_dtype": "fp32"}),
    "bf16": (["--attention-dtype", "bf16"], {"attention_dtype": "bf16"}),
    "fp32-zloss": (["--attention-dtype", "fp32", "--z-loss", "1e-4"], {"attention_dtype": "fp32"}),
    "fp32-nobalance": (["--attention-dtype", "fp32", "--no-balance-loss"],
                       {"attention_dtype": "fp32", "moe": ["default", "alternate", "all"]}),
}
DRAWN_LRS = [3e-3, 3e-2, 1e-1]
DRAWN_GROUPS = 4  # one per mitigation, in a drawn order
# Knobs a group does not take from the space: the ladder sets the LR, and the
# attention dtype comes with the mitigation.
_SET_BY_THE_GROUP = ("--lr", "--attention-dtype")


def draw_groups(commit, groups=DRAWN_GROUPS, seed_count=1):
    """The drawn plan: {groups: [{cell, mitigation, flags, warmup, every}], lrs,
    seeds}, a function of `commit` alone."""
    import random
    sys.path.insert(0, HERE)
    import preregistered  # noqa: E402
    rng = random.Random(f"natural-{preregistered.seed_of(commit)}")
    names = list(MITIGATIONS)
    rng.shuffle(names)
    out = []
    for g in range(groups):
        mitigation = names[g % len(names)]
        extra, pins = MITIGATIONS[mitigation]
        flags, _ = preregistered.draw_config(rng, pins)
        kept = []
        i = 0
        while i < len(flags):
            if flags[i] in _SET_BY_THE_GROUP:
                i += 2
                continue
            kept.append(flags[i])
            i += 1
        warmup = int(kept[kept.index("--warmup") + 1])
        every = int(kept[kept.index("--every") + 1])
        out.append(dict(cell=f"g{g}-{mitigation}", mitigation=mitigation, flags=kept + extra,
                        warmup=warmup, every=every))
    seeds = [rng.randrange(1000) for _ in range(seed_count)]
    return dict(freeze_commit=commit, groups=out, lrs=DRAWN_LRS, seeds=seeds, steps=STEPS)


def plan_runs(plan):
    """(cell, lr, seed, flags, warmup, every) of every run of a drawn plan,
    each group with its QK-layernorm twin."""
    runs = []
    for g in plan["groups"]:
        for twin in (False, True):
            cell = g["cell"] + ("+qkln" if twin else "")
            flags = g["flags"] + (["--qk-norm"] if twin else [])
            for lr in plan["lrs"]:
                for seed in plan["seeds"]:
                    runs.append((cell, lr, seed, flags, g["warmup"], g["every"]))
    return runs


def cmd_draw(args):
    commit = args.commit or subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"],
                                           capture_output=True, text=True,
                                           check=True).stdout.strip()
    plan = draw_groups(commit, args.groups)
    path = args.plan or os.path.join(HERE, "preregistered", f"natural-{commit[:12]}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(plan, f, indent=1)
    print(f"{len(plan_runs(plan))} runs in {len(plan['groups'])} drawn groups: {path}")


def run_id_of(cell, lr, seed):
    return f"natural-{cell.replace('+', '-')}-lr{lr:g}-s{seed}"


def _record_one(spec):
    cell, lr, seed, steps, endpoint, out_dir, shape, every, drawn = spec
    run_id = run_id_of(cell, lr, seed)
    losses_path = os.path.join(out_dir, "losses", run_id + ".json")
    warmup = drawn["warmup"] if drawn else WARMUP
    if drawn:  # the drawn group's own cadence, probe and curvature flags
        model = drawn["flags"]
    else:
        model = ["--every", str(every), "--probe-seqs", "2" if shape == "base" else "1",
                 "--curvature-every", str(max(50, every))] + cell_flags(cell, shape)
    argv = [sys.executable, os.path.join(ROOT, "demo", "train.py"), "--endpoint", endpoint,
            "--run-id", run_id, "--job", "foreshock-natural", "--steps", str(steps),
            "--lr", repr(lr), "--seed", str(seed), "--threads", "1", "--log-every", "0",
            "--no-alerts", "--losses-out", losses_path,
            "--label", f"cell={cell}", "--label", f"every={every}",
            "--label", f"lr={lr:g}", "--label", f"warmup_steps={warmup}"] + model
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    out = subprocess.run(argv, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return dict(cell=cell, lr=lr, seed=seed, run_id=run_id, error=out.stderr[-2000:])
    losses = [math.nan if x is None else x for x in json.load(open(losses_path))["losses"]]
    from demo.train import divergence_step
    finite = [x for x in losses if math.isfinite(x)]
    return dict(cell=cell, lr=lr, seed=seed, run_id=run_id, steps=len(losses), every=every,
                warmup=warmup, divergence_step=divergence_step(losses, warmup),
                final_loss=final_loss(losses), max_loss=max(finite) if finite else None,
                wall_s=round(time.monotonic() - t0, 1), losses=losses)


def cmd_record(args):
    sys.path.insert(0, HERE)
    from make_corpus import Daemon  # noqa: E402
    for sub in ("recordings", "losses", "logs"):
        os.makedirs(os.path.join(args.out, sub), exist_ok=True)
    path = os.path.join(args.out, "runs.json")
    done = json.load(open(path)) if os.path.exists(path) else []
    have = {(r["cell"], r["lr"], r["seed"]) for r in done if "error" not in r}
    if args.plan:
        plan = json.load(open(args.plan))
        specs = [(c, lr, s, dict(flags=f, warmup=w), e) for c, lr, s, f, w, e in plan_runs(plan)
                 if (c, lr, s) not in have]
        steps = plan["steps"]
    else:
        specs = [(c, lr, s, None, args.every) for c in all_cells(args.cells) for lr in args.lrs
                 for s in args.seeds if (c, lr, s) not in have]
        steps = args.steps
    daemon = Daemon(os.path.abspath(args.foreshockd), os.path.join(args.out, "recordings"),
                    os.path.join(args.out, "logs", "foreshockd.log")).start()
    try:
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            for row in pool.map(_record_one, [(c, lr, s, steps, daemon.endpoint, args.out,
                                               args.shape, every, drawn)
                                              for c, lr, s, drawn, every in specs]):
                done = [r for r in done if (r["cell"], r["lr"], r["seed"]) !=
                        (row["cell"], row["lr"], row["seed"])] + [row]
                with open(path, "w") as f:
                    json.dump(done, f)
                print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    finally:
        daemon.stop()
    print_table(done)


def replay_mechanism(ctl, recordings, signals="mechanism"):
    """run_id -> the backtest row of the mechanism-only replay (or of another
    --signals row), with the QK-increment entropy's points for the per-head
    reference."""
    out = subprocess.run([ctl, "backtest", recordings, "--json", "--signals", signals,
                          "--dump_series", "qk_increment_entropy"],
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return {r["run_id"]: r for r in json.loads(out.stdout)["runs"]}


def lead_fraction(run, alert_step):
    """The lead of an alert at `alert_step` on a damaged run, as a fraction of
    the span from the end of its warm-up (or from step 100, for an onset inside
    it) to its onset; an alert before that span leads by all of it: 1.0."""
    warmup = run.get("warmup", WARMUP)
    start = warmup if run["onset"] > warmup else 100
    if run["onset"] <= start:
        return 1.0
    return min(1.0, (run["onset"] - alert_step) / (run["onset"] - start))


def score(rows, replay, rule=OUTCOME_RULE):
    """Per run: outcome, onset, first alert (step, name, cause), warned, lead, false alarm."""
    scored = []
    for r in outcomes(rows, rule):
        fired = sorted(replay.get(r["run_id"], {}).get("alerts", []), key=lambda a: a["step"])
        first = fired[0] if fired else None
        row = dict(run_id=r["run_id"], cell=r["cell"], lr=r["lr"], seed=r["seed"],
                   outcome=r["outcome"], onset=r["onset"], final_loss=r["final_loss"],
                   recorded=r["run_id"] in replay, alerts=len(fired),
                   first_step=first["step"] if first else None,
                   first_alert=first["alertname"] if first else None,
                   first_signal=first["signal"] if first else None,
                   cause=first["probable_cause"] if first else None)
        if r["outcome"] in ("diverged", "degraded"):
            row["warned"] = first is not None and first["step"] < r["onset"]
            if row["warned"]:
                row["lead_steps"] = r["onset"] - first["step"]
                row["lead_fraction"] = lead_fraction(r, first["step"])
                row["cause_lr"] = first["probable_cause"] == "learning_rate_too_high"
        elif r["outcome"] == "healthy":
            row["false_alarm"] = first is not None
        scored.append(row)
    return scored


# The two reference baselines of docs/EVALUATION.md (tests/eval/reference.py,
# unchanged since issue 25), on the same replays: the first step each alarms.
REFERENCES = ("qk_head_z", "gradnorm_z")


def reference_first_alarms(run):
    """{reference: its first alarm step or None} for one replayed run."""
    import reference  # noqa: E402
    warmup = int(run.get("labels", {}).get("warmup_steps", WARMUP))
    qk = reference.qk_head_alarms(run.get("series", {}).get("qk_increment_entropy", []), warmup)
    grad = run.get("baselines", {}).get("gradnorm_z", {}).get("first_step")
    return dict(qk_head_z=qk[0] if qk else None, gradnorm_z=grad)


def score_references(scored, replay):
    """Per reference: damaged runs warned before onset, healthy runs and
    QK-layernorm twins alarmed, on the runs `score` scored."""
    out = {}
    for name in REFERENCES:
        warned = faults = healthy = healthy_alarmed = twins = twins_alarmed = 0
        leads = []
        for r in scored:
            first = reference_first_alarms(replay.get(r["run_id"], {})).get(name)
            if r["outcome"] in ("diverged", "degraded"):
                faults += 1
                if first is not None and first < r["onset"]:
                    warned += 1
                    leads.append(lead_fraction(r, first))
            elif r["outcome"] == "healthy":
                healthy += 1
                healthy_alarmed += first is not None
            if r["cell"].endswith("+qkln"):
                twins += 1
                twins_alarmed += first is not None
        leads.sort()
        out[name] = dict(warned=warned, damaged=faults, healthy=healthy,
                         healthy_alarmed=healthy_alarmed, twins=twins, twins_alarmed=twins_alarmed,
                         median_lead_fraction=leads[len(leads) // 2] if leads else None)
    return out


def score_table(scored):
    lines = ["| run | outcome | onset | first alert (signal) | step | lead (steps, fraction) | cause |",
             "|---|---|---|---|---|---|---|"]
    for r in scored:
        lead = ""
        if r.get("warned"):
            frac = r["lead_fraction"]
            lead = f"{r['lead_steps']}, {'—' if frac is None else f'{100 * frac:.0f}%'}"
        elif r["outcome"] in ("diverged", "degraded"):
            lead = "not warned"
        alert = f"{r['first_alert']} ({r['first_signal']})" if r["first_alert"] else "—"
        lines.append(f"| {r['run_id']} | {r['outcome']} | {r['onset'] if r['onset'] is not None else '—'} "
                     f"| {alert} | {r['first_step'] if r['first_step'] is not None else '—'} "
                     f"| {lead} | {r['cause'] or '—'} |")
    faults = [r for r in scored if r["outcome"] in ("diverged", "degraded")]
    healthy = [r for r in scored if r["outcome"] == "healthy"]
    twins = [r for r in scored if r["cell"].endswith("+qkln")]
    warned = [r for r in faults if r.get("warned")]
    fractions = sorted(r["lead_fraction"] for r in warned if r.get("lead_fraction") is not None)
    median = fractions[len(fractions) // 2] if fractions else None
    lines.append("")
    lines.append(f"diverged or degraded: {len(faults)}; warned before onset: {len(warned)}; "
                 f"median lead fraction: {'—' if median is None else f'{100 * median:.0f}%'}; "
                 f"LR named: {sum(bool(r.get('cause_lr')) for r in warned)}/{len(warned)}; "
                 f"healthy: {len(healthy)}, alarmed: {sum(r['false_alarm'] for r in healthy)}; "
                 f"QK-layernorm twins (any outcome) alarmed: "
                 f"{sum(r['alerts'] > 0 for r in twins)}/{len(twins)}; "
                 f"unclear (not scored): {sum(r['outcome'] == 'unclear' for r in scored)}")
    return "\n".join(lines)


def cmd_score(args):
    rows = json.load(open(os.path.join(args.out, "runs.json")))
    replay = replay_mechanism(args.foreshockctl, os.path.join(args.out, "recordings"),
                              args.signals)
    scored = score(rows, replay, args.outcome_rule)
    name = "scored.json" if args.signals == "mechanism" else f"scored-{args.signals}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(scored, f, indent=1)
    print(score_table(scored))
    print()
    for name, v in score_references(scored, replay).items():
        lead = v["median_lead_fraction"]
        print(f"reference {name}: warned {v['warned']}/{v['damaged']}, median lead "
              f"{'—' if lead is None else f'{100 * lead:.0f}%'}; healthy alarmed "
              f"{v['healthy_alarmed']}/{v['healthy']}; QK-layernorm twins alarmed "
              f"{v['twins_alarmed']}/{v['twins']}")


def outcomes(rows, rule=OUTCOME_RULE):
    """Each row with its outcome and onset (rows: one per cell, lr, seed)."""
    by_key = {(r["cell"], r["lr"], r["seed"]): r for r in rows if "error" not in r}
    best = {}
    for r in by_key.values():
        arch = r["cell"]
        best[arch] = min(best.get(arch, math.inf), r["final_loss"])
    out = []
    for (cell, lr, seed), r in sorted(by_key.items()):
        twin = by_key.get((cell + "+qkln", lr, seed)) if not cell.endswith("+qkln") else None
        outcome, onset = classify(r, twin, best[cell], rule)
        out.append(dict(r, outcome=outcome, onset=onset))
    return out


def print_table(rows):
    table = outcomes(rows)
    print(f"{'cell':28s} {'lr':>7s}  seed  outcome   onset  final   max")
    for r in table:
        print(f"{r['cell']:28s} {r['lr']:7.0e}  {r['seed']:4d}  {r['outcome']:8s} "
              f"{str(r['onset']):>6s}  {r['final_loss']:6.3f}  {r['max_loss'] or 0:6.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pilot", help="the loss-vs-LR sweep without a daemon")
    p.add_argument("--out", required=True)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--cells", nargs="*", choices=sorted(CELLS))
    p.add_argument("--lrs", nargs="*", type=float, default=LRS)
    p.add_argument("--seeds", nargs="*", type=int, default=[0])
    p.add_argument("--steps", type=int, default=STEPS)
    r = sub.add_parser("record", help="the runs, monitored by a recording foreshockd")
    r.add_argument("--out", required=True)
    r.add_argument("--jobs", type=int, default=2)
    r.add_argument("--cells", nargs="*", choices=sorted(CELLS))
    r.add_argument("--lrs", nargs="*", type=float, default=LRS)
    r.add_argument("--seeds", nargs="*", type=int, default=[0])
    r.add_argument("--steps", type=int, default=STEPS)
    r.add_argument("--shape", choices=sorted(SHAPES), default="base",
                   help="base: the demo's model; ci: the small runs shipped for CI")
    r.add_argument("--every", type=int, default=10,
                   help="the probe cadence in training steps (curvature every max(50, this))")
    r.add_argument("--foreshockd", default=os.path.join(ROOT, "build", "server", "foreshockd"))
    d = sub.add_parser("draw", help="draw the cells (architecture, cadence, mitigation) of a "
                                    "preregistered natural draw, seeded by the freeze commit")
    d.add_argument("--commit", default=None, help="the freeze commit (default: HEAD)")
    d.add_argument("--groups", type=int, default=DRAWN_GROUPS)
    d.add_argument("--plan", default=None, help="where to write it (default: "
                                                "tests/eval/preregistered/natural-<commit>.json)")
    r.add_argument("--plan", default=None,
                   help="a drawn plan (`draw`): its groups, LRs, seeds and steps replace "
                        "--cells, --lrs, --seeds, --steps, --shape and --every")
    c = sub.add_parser("score", help="replay a record's recordings, mechanism signals alone")
    c.add_argument("out")
    c.add_argument("--foreshockctl", default=os.path.join(ROOT, "build", "ctl", "foreshockctl"))
    c.add_argument("--outcome-rule", type=int, choices=[1, 2], default=OUTCOME_RULE,
                   help="1: seeds 1-5 and natural draw 1 as scored; 2 (default): a run that "
                        "ends within the healthy margin of its cell's best loss is healthy, "
                        "whatever a transient gap to its twin")
    c.add_argument("--signals", choices=["mechanism", "no_lr"], default="mechanism",
                   help="the backtest row: mechanism (the benchmark's) or no_lr (the mechanism "
                        "signals and the attention output check; reads no LR either)")
    t = sub.add_parser("table", help="the outcome table of a pilot.json or runs.json")
    t.add_argument("path")
    args = parser.parse_args()
    if args.cmd == "pilot":
        cmd_pilot(args)
    elif args.cmd == "draw":
        cmd_draw(args)
    elif args.cmd == "record":
        cmd_record(args)
    elif args.cmd == "score":
        cmd_score(args)
    else:
        print_table(json.load(open(args.path)))


if __name__ == "__main__":
    main()
