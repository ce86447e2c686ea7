#!/usr/bin/python3
"""The output logits' log-partition on QK-layernorm twins (issue 33, post hoc).

Natural draws 1-5 hold QK-layernorm twins that diverged with nothing in
their attention or router for a mechanism signal to see (docs/EVALUATION.md,
"Where the targets stand"). Their attention is held by the layernorm; what a
too-high LR can still drive is the output logits' absolute level, which the
cross-entropy does not constrain and a z-loss does (Wortsman et al. 2023).
This re-trains chosen runs of those draws' plans without a daemon
(demo/train.py --output-stats-out) and prints, per run, the loss and the
mean log-partition log Z = logsumexp(z) of the training batch over training,
how far log Z rose above its value at step 0 (log V at initialisation), the
first step it was 10 nats above it, its largest rise over 100 steps and the
first step that rise reached 6 nats, against the run's divergence step.

    tests/eval/output_logits.py [--out DIR] [--jobs 2] [PLAN:GROUP:TWIN:LR ...]

PLAN is a tests/eval/preregistered/natural-<freeze>.json, GROUP one of its
cells, TWIN 1 for the QK-layernorm twin, LR the peak LR. Without specs: the
seven twins of draws 1, 3, 4 and 5 that diverged, fifteen healthy twins,
three unclear ones, and eight runs of draw 4 without QK-layernorm.
"""
import argparse
import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLANS = os.path.join(ROOT, "tests", "eval", "preregistered")
RISE_NATS = 10.0  # the first step log Z is this far above its step-0 value
GROWTH_NATS, GROWTH_STEPS = 6.0, 100  # the first step log Z rose this much over these steps
STEPS_SHOWN = (0, 100, 200, 300, 400, 500, 600, 700, 799)

D1, D2, D3, D4, D5 = ("natural-4b49e7616203.json", "natural-69368599bb2a.json",
                      "natural-d9060f0fa946.json", "natural-90041835440d.json",
                      "natural-187b130d595d.json")
DEFAULT_SPECS = [
    f"{D1}:g0-fp32-nobalance:1:0.003", f"{D1}:g0-fp32-nobalance:1:0.03",
    f"{D3}:g0-bf16:1:0.003", f"{D3}:g0-bf16:1:0.03", f"{D3}:g0-bf16:1:0.1",
    f"{D4}:g5-fp32-nobalance:1:0.003", f"{D4}:g5-fp32-nobalance:1:0.1",
    f"{D5}:g4-bf16:1:0.003", f"{D5}:g4-bf16:1:0.03", f"{D5}:g4-bf16:1:0.1",
    f"{D5}:g7-fp32:1:0.003", f"{D5}:g7-fp32:1:0.03", f"{D5}:g7-fp32:1:0.1",
    f"{D5}:g0-bf16:1:0.03", f"{D5}:g2-fp32-zloss:1:0.03", f"{D5}:g3-fp32:1:0.03",
    f"{D5}:g6-fp32-zloss:1:0.03",
    # Added after the first seventeen: a healthy twin at 3e-2 on the copy
    # task, and runs without QK-layernorm (draw 4: three healthy runs the
    # max-logit bound alarmed on, four damaged ones, one at the best LR).
    f"{D4}:g5-fp32-nobalance:1:0.03",
    f"{D4}:g2-bf16:0:0.03", f"{D4}:g5-fp32-nobalance:0:0.03", f"{D4}:g0-fp32-zloss:0:0.03",
    f"{D4}:g3-fp32:0:0.03", f"{D4}:g7-fp32:0:0.03", f"{D4}:g2-bf16:0:0.1",
    f"{D4}:g6-bf16:0:0.03", f"{D4}:g5-fp32-nobalance:0:0.003",
    # Then every other copy-task twin at 3e-2 of draws 2-4: four healthy,
    # three unclear.
    f"{D2}:g1-fp32-nobalance:1:0.03", f"{D4}:g7-fp32:1:0.03", f"{D3}:g2-fp32:1:0.03",
    f"{D3}:g3-fp32-zloss:1:0.03", f"{D4}:g3-fp32:1:0.03", f"{D3}:g1-fp32-nobalance:1:0.03",
    f"{D2}:g2-fp32-zloss:1:0.03",
]


def run_spec(spec, out_dir):
    plan_name, group, twin, lr = spec.split(":")
    plan = json.load(open(os.path.join(PLANS, plan_name)))
    cell = [g for g in plan["groups"] if g["cell"] == group][0]
    flags = cell["flags"] + (["--qk-norm"] if twin == "1" else [])
    seed = plan["seeds"][0]
    name = f"{plan_name[8:15]}-{group}{'-qkln' if twin == '1' else ''}-lr{float(lr):g}-s{seed}"
    path = os.path.join(out_dir, name + ".json")
    if not os.path.exists(path):
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        subprocess.run([sys.executable, os.path.join(ROOT, "demo", "train.py"), "--endpoint", "",
                        "--steps", str(plan["steps"]), "--lr", lr, "--seed", str(seed),
                        "--threads", "1", "--log-every", "0", "--no-alerts",
                        "--output-stats-out", path] + flags,
                       check=True, capture_output=True, env=env, cwd=ROOT)
    return name, json.load(open(path))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/foreshock-output-logits")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("specs", nargs="*", default=DEFAULT_SPECS)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    sys.path[:0] = [ROOT, os.path.join(ROOT, "client", "python")]
    from demo.train import divergence_step
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda s: run_spec(s, args.out), args.specs))
    print("| run | diverged at | log Z at steps " + ", ".join(map(str, STEPS_SHOWN))
          + f" | highest rise | first {RISE_NATS:g} nats up | largest rise in {GROWTH_STEPS} "
          f"steps | first {GROWTH_NATS:g} nats in {GROWTH_STEPS} steps |")
    print("|---|---|---|---|---|---|---|")
    for name, data in results:
        losses = [math.nan if x is None else x for x in data["losses"]]
        log_z = [math.nan if m is None else m for m, _ in data["log_partition"]]
        diverged = divergence_step(losses, 50)
        rise = [z - log_z[0] for z in log_z]
        first = next((s for s, r in enumerate(rise) if r >= RISE_NATS), None)
        growth = [log_z[s] - min(log_z[max(0, s - GROWTH_STEPS):s + 1])
                  for s in range(len(log_z))]
        grew = next((s for s, g in enumerate(growth) if g >= GROWTH_NATS), None)
        shown = " ".join(f"{log_z[s]:.1f}" if s < len(log_z) else "-" for s in STEPS_SHOWN)
        print(f"| {name} | {diverged if diverged is not None else '—'} | {shown} | "
              f"{max(r for r in rise if math.isfinite(r)):.1f} | "
              f"{first if first is not None else '—'} | "
              f"{max(g for g in growth if math.isfinite(g)):.1f} | "
              f"{grew if grew is not None else '—'} |")


if __name__ == "__main__":
    main()
