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
  degraded  not diverged, and its 20-step mean loss exceeds its twin's by
            DAMAGE_MARGIN at some step after warm-up; onset = the first such step
  healthy   its last-100-step mean loss is within HEALTHY_MARGIN of the best
            cell's at the same architecture (the best LR); an alert is a false alarm
  unclear   none of these (neither damaged nor as good as the best LR): not scored

  # the loss-vs-LR curve, unmonitored (no daemon): what diverges where
  OPENBLAS_NUM_THREADS=1 nice -n 19 /usr/bin/python3 tests/eval/natural.py pilot \\
      --out /work/natural-pilot --jobs 2 [--cells moe-fp32 ...] [--seeds 0 1 2]

Writes OUT/pilot.json (one row per run: cell, lr, seed, divergence step,
final loss, max loss, steps, wall seconds, the per-step losses) and prints the
table per cell."""
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


def cell_flags(cell):
    base, twin = (cell[:-len("+qkln")], True) if cell.endswith("+qkln") else (cell, False)
    return BASE + CELLS[base] + (["--qk-norm"] if twin else [])


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


def classify(row, twin, best_final):
    """diverged / degraded / healthy / unclear, with the onset step (see the module doc)."""
    if row["divergence_step"] is not None:
        return "diverged", row["divergence_step"]
    if twin is not None and twin is not row:
        onset = damage_onset(row["losses"], twin["losses"])
        if onset is not None:
            return "degraded", onset
    if final_loss(row["losses"]) <= (1 + HEALTHY_MARGIN) * best_final:
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


def outcomes(rows):
    """Each row with its outcome and onset (rows: one per cell, lr, seed)."""
    by_key = {(r["cell"], r["lr"], r["seed"]): r for r in rows if "error" not in r}
    best = {}
    for r in by_key.values():
        arch = r["cell"]
        best[arch] = min(best.get(arch, math.inf), r["final_loss"])
    out = []
    for (cell, lr, seed), r in sorted(by_key.items()):
        twin = by_key.get((cell + "+qkln", lr, seed)) if not cell.endswith("+qkln") else None
        outcome, onset = classify(r, twin, best[cell])
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
    t = sub.add_parser("table", help="the outcome table of a pilot.json")
    t.add_argument("path")
    args = parser.parse_args()
    if args.cmd == "pilot":
        cmd_pilot(args)
    else:
        print_table(json.load(open(args.path)))


if __name__ == "__main__":
    main()
