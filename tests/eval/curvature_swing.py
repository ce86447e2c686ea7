#!/usr/bin/python3
"""Curvature on converged estimates, on a natural draw's runs (issue 33, post hoc).

The curvature estimate the client sends by default (3 Lanczos products) is
within the daemon's residual bound on a quarter to half of the estimates
(docs/PERFORMANCE.md, "Estimator error against the exact eigenvalue"), so
the recorded natural draws cannot say whether lambda itself tells an LR too
high for the architecture. This re-records a spent draw's plan with
converging estimates and asks two questions of its runs:

  - does the daemon's lambda rule (`curvature_lambda_max`, a surge against
    the run's own history) fire, on healthy runs or damaged ones;
  - does lambda's *swing* tell them apart: the factor by which lambda moves
    between consecutive converged estimates. At a stable LR the sharpness
    drifts (the exact eigenvalue moved a median 1.3x per probe on the
    exact-Hessian model); past the edge of stability the iterate bounces
    and the sharpness moves by factors (4-6x there). Per run, the median
    swing over the run (from step 100), and an online rule: the median of
    the last K swings at or above B, on P estimates in a row, from step S.

    tests/eval/curvature_swing.py plan PLAN --out CONVERGING_PLAN [--factor 3]
    OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/eval/natural.py record \\
        --out DIR --plan CONVERGING_PLAN --jobs 2
    tests/eval/curvature_swing.py score DIR [--foreshockctl PATH] [--json OUT]

`plan` writes PLAN's groups with `--curvature-max-hvps` set to factor x
their `--curvature-hvps` (Lanczos continues to a residual of 0.05); the
training itself is unchanged, so outcomes and onsets are the spent draw's.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import natural  # noqa: E402

MAX_RESIDUAL = 0.1  # the daemon's bound (CurvatureDetectorOptions::max_residual)
RUN_FROM_STEP = 100
# Online rules tried: K swings in the median, bound B, from step S, P in a row.
ONLINE_RULES = [(k, b, s, p) for k in (3, 4, 5) for b in (2.0, 2.5, 3.0)
                for s in (100, 200) for p in (1, 2)]
CURVATURE_SERIES = "curvature_lambda_max,curvature_residual"


def converging_plan(plan, factor):
    """PLAN with each group's curvature estimates allowed factor x the products."""
    plan = json.loads(json.dumps(plan))
    for group in plan["groups"]:
        flags = group["flags"]
        hvps = int(flags[flags.index("--curvature-hvps") + 1])
        if "--curvature-max-hvps" in flags:
            flags[flags.index("--curvature-max-hvps") + 1] = str(factor * hvps)
        else:
            flags += ["--curvature-max-hvps", str(factor * hvps)]
    return plan


def converged_estimates(lambdas, residuals, from_step=0, max_residual=MAX_RESIDUAL):
    """(step, lambda) of the estimates the daemon judges: positive, within the bound."""
    residual_at = dict(residuals)
    return [(step, value) for step, value in lambdas
            if value > 0 and step >= from_step and residual_at.get(step, math.inf) <= max_residual]


def swings(estimates):
    """(step, factor) between consecutive estimates: max(l1/l0, l0/l1) >= 1."""
    return [(b[0], math.exp(abs(math.log(b[1] / a[1])))) for a, b in zip(estimates, estimates[1:])]


def median_swing(estimates):
    """The median swing (of an even count, the geometric mean of the middle two)."""
    logs = [math.log(f) for _, f in swings(estimates)]
    return math.exp(statistics.median(logs)) if logs else None


def first_online_step(estimates, k, bound, in_a_row):
    """First step where the median of the last k swings has been >= bound
    on in_a_row estimates in a row; None if never."""
    factors = swings(estimates)
    run = 0
    for i in range(k - 1, len(factors)):
        window = [math.log(f) for _, f in factors[i - k + 1:i + 1]]
        run = run + 1 if math.exp(statistics.median(window)) >= bound else 0
        if run >= in_a_row:
            return factors[i][0]
    return None


def replay(ctl, recordings):
    out = subprocess.run([ctl, "backtest", recordings, "--json", "--signals", "mechanism",
                          "--dump_series", CURVATURE_SERIES],
                         capture_output=True, text=True, check=True)
    return {r["run_id"]: r for r in json.loads(out.stdout)["runs"]}


def score(rows, replayed):
    """Per run: outcome, onset, estimates kept, lambda-rule alerts, the swing."""
    scored = []
    for row in natural.outcomes(rows):
        run = replayed.get(row["run_id"])
        if run is None:
            continue
        series = run.get("series", {})
        lambdas = sorted((step, v) for step, _, _, v in series.get("curvature_lambda_max", []))
        residuals = sorted((step, v) for step, _, _, v in series.get("curvature_residual", []))
        kept = converged_estimates(lambdas, residuals)
        judged = [e for e in kept if e[0] >= RUN_FROM_STEP]
        lambda_alerts = [a["step"] for a in run.get("alerts", [])
                         if a.get("signal") == "curvature_lambda_max"]
        scored.append(dict(
            run_id=row["run_id"], cell=row["cell"], lr=row["lr"], outcome=row["outcome"],
            onset=row["onset"], twin="+qkln" in row["cell"], estimates=len(lambdas),
            converged=len(kept), lambda_rule_first=min(lambda_alerts, default=None),
            median_swing=median_swing(judged),
            online={f"{k},{b},{s},{p}": first_online_step([e for e in kept if e[0] >= s], k, b, p)
                    for k, b, s, p in ONLINE_RULES}))
    return scored


def group_of(run):
    damaged = run["outcome"] in ("diverged", "degraded")
    kind = "damaged" if damaged else run["outcome"]
    return kind + (" QK-layernorm twin" if run["twin"] else "")


def report(scored):
    groups = {}
    for run in scored:
        groups.setdefault(group_of(run), []).append(run)
    print("Per run: outcome, onset, converged estimates, lambda rule, median swing from step "
          f"{RUN_FROM_STEP}")
    for run in sorted(scored, key=lambda r: (group_of(r), r["run_id"])):
        swing = run["median_swing"]
        print(f"  {run['run_id']:48s} {run['outcome']:9s} {str(run['onset']):>5s} "
              f"{run['converged']:3d}/{run['estimates']:<3d} "
              f"{str(run['lambda_rule_first']):>5s} "
              f"{'-' if swing is None else f'{swing:.2f}':>6s}")
    print("\nMedian swing per run, by outcome (sorted):")
    for name, runs in sorted(groups.items()):
        values = sorted(round(r["median_swing"], 2) for r in runs if r["median_swing"])
        fired = sum(r["lambda_rule_first"] is not None for r in runs)
        print(f"  {name:32s} n={len(runs):2d}  lambda rule fired {fired}  swings {values}")
    damaged = [r for r in scored if r["outcome"] in ("diverged", "degraded")]
    healthy = [r for r in scored if r["outcome"] == "healthy"]
    other = [r for r in scored if r not in damaged and r not in healthy]
    print("\nOnline rules (K swings, bound, from step, in a row): damaged warned before "
          "onset (alarmed at all), healthy alarmed, unclear alarmed")
    for key in scored[0]["online"] if scored else []:
        warned = sum(r["online"][key] is not None and r["online"][key] <= r["onset"]
                     for r in damaged)
        alarmed = sum(r["online"][key] is not None for r in damaged)
        print(f"  {key:14s} damaged {warned:2d}/{len(damaged)} ({alarmed:2d})  "
              f"healthy {sum(r['online'][key] is not None for r in healthy):2d}/{len(healthy)}  "
              f"unclear {sum(r['online'][key] is not None for r in other):2d}/{len(other)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="a plan's groups with converging curvature estimates")
    p.add_argument("plan")
    p.add_argument("--out", required=True)
    p.add_argument("--factor", type=int, default=3,
                   help="--curvature-max-hvps as a multiple of --curvature-hvps")
    s = sub.add_parser("score", help="replay a record's runs and report lambda and its swing")
    s.add_argument("out")
    s.add_argument("--foreshockctl", default=os.path.join(ROOT, "build", "ctl", "foreshockctl"))
    s.add_argument("--json", default=None, help="also write the per-run table here")
    args = parser.parse_args()
    if args.cmd == "plan":
        with open(args.out, "w") as f:
            json.dump(converging_plan(json.load(open(args.plan)), args.factor), f, indent=1)
        return
    rows = json.load(open(os.path.join(args.out, "runs.json")))
    scored = score(rows, replay(args.foreshockctl, os.path.join(args.out, "recordings")))
    report(scored)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(max_residual=MAX_RESIDUAL, run_from_step=RUN_FROM_STEP, runs=scored),
                      f, indent=1)


if __name__ == "__main__":
    main()
