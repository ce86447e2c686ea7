"""Fault-injection matrix (docs/DESIGN.md §6; issue 5).

Runs every scenario x seed as a real training of the tiny MoE GPT (demo/train.py)
with the real Python client streaming to its own real foreshockd (fresh daemon
per run, default flags = the daemon's built-in defaults), collects the alerts
through WatchAlerts, computes the loss/grad-norm baselines on the same per-step
series, and writes one JSON file. docs/evaluation/MATRIX.md is written from it by
report.py.

    OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/fault_injection/run_matrix.py \\
        --jobs 2 --out docs/evaluation/results.json.gz
    /usr/bin/python3 tests/fault_injection/report.py docs/evaluation/results.json.gz

At most --jobs trainings run at once (one torch thread each, one daemon each).
"""
import argparse
import gzip
import json
import math
import multiprocessing
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for _p in (os.path.join(ROOT, "tests", "python"), os.path.join(ROOT, "client", "python"), ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

T_INJ = 500  # after the detectors' ~40-probe warm-up (400 steps at --every 10)

# The knobs are documented here and recorded in the JSON with every run. Each
# fault is tuned to diverge roughly 300-3000 steps after t_inj (seeds 0-1 of the
# calibration runs), not in a handful of steps.
# lowprec: BF16 truncation toward zero of attention P and O, bias x32 (x64
# diverged only 133-271 steps after t_inj; x32 ~700, x24 ~900).
# lr: the LR ramped geometrically to 300x over 500 steps from t_inj (diverges
# ~330-360 steps after t_inj; x30 over 300 did not diverge in 1000).
# both: lowprec at x24 with a slower ramp, 100x over 800 steps (diverges ~330-350
# steps after t_inj; lowprec x16 with the lr ramp diverged in ~200).
LOWPREC = ["--fault-strength", "32", "--lowprec-on", "both"]
LR_FACTOR, LR_RAMP = "300", "500"
LR = ["--lr-factor", LR_FACTOR, "--lr-ramp-steps", LR_RAMP]
BOTH = ["--fault-strength", "24", "--lowprec-on", "both", "--lr-factor", "100",
        "--lr-ramp-steps", "800"]

# name -> (kind, expected probable cause, train.py flags; t_inj is added as --fault-step etc.)
SCENARIOS = {
    "healthy": ("control", None, []),
    "benign_lr_decay": ("control", None, ["--lr-decay-step", str(T_INJ), "--lr-decay-factor", "0.3"]),
    "benign_text_switch": ("control", None, ["--text-switch-step", str(T_INJ)]),
    "lowprec": ("fault", "low_precision_attention",
                ["--fault", "lowprec", "--fault-step", str(T_INJ)] + LOWPREC),
    "lr": ("fault", "learning_rate_too_high", ["--fault", "lr", "--fault-step", str(T_INJ)] + LR),
    "both": ("fault", "combined", ["--fault", "both", "--fault-step", str(T_INJ)] + BOTH),
}

# Baselines (docs/DESIGN.md §6.4).
OLMO_WINDOW, OLMO_SIGMAS = 128, 6.0
MEGATRON_FACTOR = 10.0


def olmo_first_alarm(values, window=OLMO_WINDOW, sigmas=OLMO_SIGMAS, start=0):
    """First step >= start where the value exceeds mean + 6 sigma of the trailing
    `window` steps (the window must be full; non-finite values are left out)."""
    for t in range(max(start, window), len(values)):
        x = values[t]
        if not math.isfinite(x):
            continue  # the NaN check's job
        win = [v for v in values[t - window:t] if math.isfinite(v)]
        if len(win) < 2:
            continue
        mean = sum(win) / len(win)
        sd = math.sqrt(sum((v - mean) ** 2 for v in win) / (len(win) - 1))
        if x > mean + sigmas * sd:
            return t
    return None


def megatron_first_alarm(losses, factor=MEGATRON_FACTOR, start=0):
    """First step >= start where the loss exceeds factor x the running maximum of the earlier losses."""
    running_max = -math.inf
    for t, x in enumerate(losses):
        if t >= start and t > 0 and math.isfinite(x) and x > factor * running_max:
            return t
        if math.isfinite(x):
            running_max = max(running_max, x)
    return None


def nan_first_alarm(losses, grad_norms, start=0):
    for t in range(start, len(losses)):
        if not (math.isfinite(losses[t]) and math.isfinite(grad_norms[t])):
            return t
    return None


def first_of(*steps):
    steps = [s for s in steps if s is not None]
    return min(steps) if steps else None


def baselines(losses, grad_norms, start=0):
    """First alarm per baseline at or after `start` (0: the whole run)."""
    return {
        "olmo_loss": olmo_first_alarm(losses, start=start),
        "olmo_grad_norm": olmo_first_alarm(grad_norms, start=start),
        "megatron_loss": megatron_first_alarm(losses, start=start),
        "nan_check": nan_first_alarm(losses, grad_norms, start=start),
    }


def _finite_or_none(x):
    """JSON-safe: None for non-finite values, 6 significant digits otherwise."""
    return float(f"{x:.6g}") if isinstance(x, (int, float)) and math.isfinite(x) else None


def one_run(job):
    """Runs one training against its own daemon; returns the JSON record."""
    import torch  # noqa: F401  (imported in the worker: spawn context)
    from conftest import Daemon, DEFAULT_FORESHOCKD
    from demo import train

    scenario, seed, steps, log_dir = job["scenario"], job["seed"], job["steps"], job["log_dir"]
    kind, expected_cause, flags = SCENARIOS[scenario]
    binary = os.environ.get("FORESHOCKD") or DEFAULT_FORESHOCKD
    run_log_dir = os.path.join(log_dir, f"{scenario}-s{seed}")
    os.makedirs(run_log_dir, exist_ok=True)
    daemon = Daemon(binary, run_log_dir)
    argv = ["--run-id", f"{scenario}-s{seed}", "--seed", str(seed), "--steps", str(steps),
            "--log-every", "0"] + flags
    t0 = time.monotonic()
    daemon.start()
    try:
        args = train.parse_args(["--endpoint", daemon.endpoint, "--metrics-url", daemon.metrics_url]
                                + argv)
        with open(os.path.join(run_log_dir, "train.log"), "w") as log:
            result = train.run(args, out=lambda *a: print(*a, file=log))
    finally:
        daemon.stop()
    wall = time.monotonic() - t0

    losses, grad_norms = result["losses"], result["grad_norms"]
    t_inj = T_INJ if kind == "fault" or len(flags) > 0 else None
    events = []
    for e in result["alert_events"]:
        a = e.alert
        events.append(dict(step=e.step, from_state=e.from_state, to_state=e.to_state,
                           alertname=a.alertname, layer=a.layer, signal=a.signal,
                           probable_cause=a.probable_cause, first_step=a.first_step,
                           cause_settled=a.probable_cause_settled,
                           cause_evidence=a.probable_cause_evidence))
    firing = sorted((e for e in events if e["to_state"] == "firing" and e["from_state"] != "firing"),
                    key=lambda e: e["step"])
    signals = []
    if result["recorder"] is not None:
        for step, values in result["recorder"].snapshots:
            signals.append([step, {m: {str(k): _finite_or_none(v) for k, v in layers.items()}
                                   for m, layers in values.items()}])
    return dict(
        scenario=scenario, kind=kind, seed=seed, steps=steps, t_inj=t_inj,
        expected_cause=expected_cause, train_flags=argv,
        divergence_step=result["divergence_step"],
        first_alert=firing[0] if firing else None,
        firing=firing, events=events,
        baselines_all=baselines(losses, grad_norms),
        baselines_after_inj=baselines(losses, grad_norms, start=t_inj or 0),
        losses=[_finite_or_none(x) for x in losses],
        grad_norms=[_finite_or_none(x) for x in grad_norms],
        signals=signals, wall_s=wall, mean_step_s=result["mean_step_s"],
        client_stats=result["stats"],
        curvature_failures=result["stats"].get("curvature_failures", 0),
    )


def safe_run(job):
    """one_run, with a crash recorded as an error row instead of ending the matrix."""
    try:
        return one_run(job)
    except Exception as e:  # noqa: BLE001
        import traceback
        return dict(scenario=job["scenario"], seed=job["seed"], kind=SCENARIOS[job["scenario"]][0],
                    error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3])
    p.add_argument("--holdout-seeds", nargs="*", type=int, default=[3],
                   help="seeds reported separately as held out from calibration")
    p.add_argument("--steps", type=int, default=1800, help="training steps of a fault run")
    p.add_argument("--control-steps", type=int, default=1300,
                   help="training steps of a control run (they must stay silent throughout)")
    p.add_argument("--jobs", type=int, default=2, help="trainings at once (one core each)")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "evaluation", "results.json.gz"))
    p.add_argument("--log-dir", default=os.path.join(ROOT, "build", "fault_injection", "logs"),
                   help="per-run daemon and training logs (not part of the results)")
    a = p.parse_args(argv)
    out_dir = os.path.dirname(os.path.abspath(a.out))
    os.makedirs(out_dir, exist_ok=True)
    log_dir = os.path.abspath(a.log_dir)
    # Faults first (they are the slow, interesting ones), seed-major.
    order = sorted(((s, seed) for seed in a.seeds for s in a.scenarios),
                   key=lambda j: (a.seeds.index(j[1]), SCENARIOS[j[0]][0] != "fault"))
    jobs = [dict(scenario=s, seed=seed, log_dir=log_dir,
                 steps=a.steps if SCENARIOS[s][0] == "fault" else a.control_steps)
            for s, seed in order]
    meta = dict(command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                t_inj=T_INJ, steps=a.steps, control_steps=a.control_steps, seeds=a.seeds, holdout_seeds=a.holdout_seeds,
                jobs=a.jobs, cpus=os.cpu_count(), host=platform.node(),
                scenarios={k: dict(kind=v[0], expected_cause=v[1], flags=v[2])
                           for k, v in SCENARIOS.items() if k in a.scenarios},
                baselines=dict(olmo_window=OLMO_WINDOW, olmo_sigmas=OLMO_SIGMAS,
                               megatron_factor=MEGATRON_FACTOR),
                started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    runs = []
    t0 = time.monotonic()

    def save():
        meta["wall_s"] = time.monotonic() - t0
        meta["complete"] = len(runs) == len(jobs)
        tmp = a.out + ".tmp"
        # Per-step series make the file large: compressed when the name ends in .gz.
        with (gzip.open(tmp, "wt") if a.out.endswith(".gz") else open(tmp, "w")) as f:
            json.dump(dict(meta=meta, runs=runs), f)
        os.replace(tmp, a.out)

    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(a.jobs, maxtasksperchild=1) as pool:
        for rec in pool.imap_unordered(safe_run, jobs):
            runs.append(rec)
            if "error" in rec:
                print(f"[{time.monotonic() - t0:6.0f}s] {rec['scenario']:18s} seed {rec['seed']}  "
                      f"ERROR {rec['error']}", flush=True)
                save()
                continue
            fa = rec["first_alert"]
            print(f"[{time.monotonic() - t0:6.0f}s] {rec['scenario']:18s} seed {rec['seed']}  "
                  f"divergence {rec['divergence_step']}  first alert "
                  f"{(fa['step'], fa['alertname'], fa['layer'], fa['probable_cause']) if fa else None}  "
                  f"baselines {rec['baselines_all']}  ({rec['wall_s']:.0f}s)", flush=True)
            save()
    save()
    print(f"wrote {a.out}: {len(runs)} runs in {meta['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
