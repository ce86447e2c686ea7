"""Generates the evaluation corpus (issue 13, section 1): every (configuration,
scenario, seed) of tests/eval/configs.py trained by demo/train.py while one
foreshockd records every ingest stream (--record_dir), plus a manifest.

    OPENBLAS_NUM_THREADS=1 nice -n 19 /usr/bin/python3 tests/eval/make_corpus.py \\
        --out /work/corpus --jobs 2 [--only CONFIG...] [--seeds 0 1] [--smoke]

Writes, under --out:
  recordings/*.fsrec   one file per ingest stream (foreshockctl replay / backtest)
  manifest.json        one row per run: run_id, config, split, scenario, seed, the
                       train.py flags, injection_step, expected_cause, the trainer's
                       own divergence step (demo/train.py divergence_step), steps run,
                       wall seconds
  logs/                the daemon's log and each run's training log
Resumable: runs already in the manifest (without an error) are skipped; a rerun
run's earlier recording files are deleted first. The daemon is started on free
loopback ports with a temporary --data_dir and stopped by PID at the end.

Runs are self-describing: each Hello carries the labels config, split, scenario,
seed, fault, attention_dtype, and (for fault and benign runs) injection_step and,
for faults, expected_cause.
"""
import argparse
import concurrent.futures
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE]

import configs  # noqa: E402

STOP_AFTER_DIVERGENCE = 150
FAULT_WINDOW = 1500  # a fault run lasts injection + this (+ the stop margin) if it never diverges
MAX_STEPS = 3000
CONTROL_CAP = 2500
CHILDREN = set()  # running train.py subprocesses
STOPPING = threading.Event()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """One foreshockd on free loopback ports, recording into record_dir; stopped by PID."""

    def __init__(self, binary, record_dir, log_path):
        self.binary, self.record_dir, self.log_path = binary, record_dir, log_path
        self.data_dir = tempfile.mkdtemp(prefix="foreshock-corpus-data-")
        self.grpc_port, self.metrics_port = free_port(), free_port()
        self.process = None

    @property
    def endpoint(self):
        return f"127.0.0.1:{self.grpc_port}"

    def start(self, timeout_s=30.0):
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [self.binary, f"--listen={self.endpoint}",
                 f"--metrics_listen=127.0.0.1:{self.metrics_port}",
                 f"--data_dir={self.data_dir}", f"--record_dir={self.record_dir}",
                 "--checkpoint_interval_s=0", "--fsync=none"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"foreshockd exited with {self.process.returncode}; "
                                   f"see {self.log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.grpc_port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"foreshockd did not listen within {timeout_s}s; see {self.log_path}")

    def stop(self, timeout_s=20.0):
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.data_dir, ignore_errors=True)


# -- the plan -------------------------------------------------------------------

def plan(config_names, seeds, smoke=False, frozen=False, knob_blind=False, fault_window=None):
    """The runs: dicts with run_id, config, scenario, seed, injection_step,
    expected_cause and the train.py flags (without endpoint)."""
    if smoke:
        return smoke_plan()
    if frozen:
        return frozen_plan()
    runs = []
    for name in config_names:
        c = configs.CONFIGS[name]
        window = fault_window or c.get("fault_window", FAULT_WINDOW)
        fault_steps = {s: min(MAX_STEPS, inj + window) for s, (inj, _) in c["faults"].items()}
        control_steps = c.get("control_steps") or min(CONTROL_CAP, max(fault_steps.values()))
        for seed in seeds:
            # Controls run their whole length: a benign event may trip the divergence
            # rule (e.g. a text switch raises the loss), which must not cut them short.
            runs.append(make_run(c, "healthy", seed, control_steps, None, [], stop=None))
            inj, flags = c["benign"]
            runs.append(make_run(c, "benign", seed, control_steps, inj, flags, stop=None))
            for scenario, (inj, flags) in c["faults"].items():
                runs.append(make_run(c, scenario, seed, fault_steps[scenario], inj,
                                     flags + ["--fault-step", str(inj)]))
            if knob_blind:
                runs += knob_blind_runs(c, seed, control_steps, window)
    return runs


def knob_blind_runs(c, seed, control_steps, window=FAULT_WINDOW):
    """configs.KNOB_BLIND's scenarios for configuration `c` (issue 25 item 2)."""
    runs = []
    for scenario, (inj, flags, cause) in configs.KNOB_BLIND.items():
        flags = [str(f) for f in flags]
        fault = cause is not None or scenario in configs.KNOB_BLIND_UNNAMED_FAULTS
        if scenario.startswith("lowprec") and c["attention_dtype"] != "bf16":
            continue
        if scenario == "no_balance" and "none" in c["flags"]:
            continue  # no MoE layer
        if fault:  # labelled expected_cause by make_run (configs.EXPECTED_CAUSE)
            steps = min(MAX_STEPS, inj + window)
            run = make_run(c, scenario, seed, steps, inj, flags + ["--fault-step", str(inj)])
            run["kind"] = "fault"
        else:
            run = make_run(c, scenario, seed, control_steps, inj, flags, stop=None)
            run["kind"] = "control"
        runs.append(run)
    return runs


def control_length(run, steps):
    """`run` (a control) cut to `steps` steps."""
    argv = list(run["train_flags"])
    argv[argv.index("--steps") + 1] = str(steps)
    return dict(run, steps=steps, train_flags=argv)


_BY_SCENARIO = object()


def make_run(c, scenario, seed, steps, inj, flags, stop=STOP_AFTER_DIVERGENCE,
             cause=_BY_SCENARIO):
    """One run; `cause` (the expected_cause label, None for none) defaults to
    configs.EXPECTED_CAUSE of the scenario."""
    run_id = f"{c['name']}-{scenario}-s{seed}"
    if cause is _BY_SCENARIO:
        cause = configs.EXPECTED_CAUSE.get(scenario)
    labels = {"config": c["name"], "split": c["split"], "scenario": scenario, "seed": str(seed),
              "attention_dtype": c["attention_dtype"]}
    if inj is not None:
        labels["injection_step"] = str(inj)
    events = benign_events(flags) if scenario == "benign" else []
    if events:
        labels["benign_events"] = ",".join(f"{k}@{v}" for k, v in events)
    if cause:
        labels["expected_cause"] = cause
    argv = ["--run-id", run_id, "--job", "foreshock-eval", "--seed", str(seed),
            "--steps", str(steps), "--log-every", "100", "--no-alerts"]
    if stop is not None:
        argv += ["--stop-after-divergence", str(stop)]
    argv += c["flags"] + flags
    for k, v in labels.items():
        argv += ["--label", f"{k}={v}"]
    return dict(run_id=run_id, config=c["name"], split=c["split"], scenario=scenario, seed=seed,
                kind="control" if scenario in ("healthy", "benign") else "fault",
                attention_dtype=c["attention_dtype"], injection_step=inj, expected_cause=cause,
                benign_events=[dict(event=k, step=v) for k, v in events],
                steps=steps, train_flags=argv)


BENIGN_FLAGS = {"--lr-decay-step": "lr_decay", "--lr-restart-step": "lr_restart",
                "--text-switch-step": "text_switch", "--data-switch-step": "data_switch",
                "--batch-size-change-step": "batch_size_change", "--lr-raise-step": "lr_raise"}


def benign_events(flags):
    """[(event, step)] of the benign flags in a train.py argv, by step."""
    events = [(BENIGN_FLAGS[f], int(flags[i + 1])) for i, f in enumerate(flags)
              if f in BENIGN_FLAGS]
    return sorted(events, key=lambda e: e[1])


def smoke_plan():
    """Two short runs of a tiny config (CI): healthy, and a constant too-high LR."""
    c = dict(name="smoke-tiny-bf16", split="smoke", attention_dtype="bf16",
             flags=["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--moe", "alternate",
                    "--block-size", "32", "--batch-size", "8", "--lr", "3e-3", "--warmup", "50",
                    "--every", "10", "--probe-seqs", "2", "--curvature-every", "50",
                    "--curvature-seqs", "1", "--curvature-hvps", "2", "--data", "text",
                    "--attention-dtype", "bf16"])
    return [make_run(c, "healthy", 0, 300, None, [], stop=None),
            make_run(c, "lr_const", 0, 300, 100,
                     ["--fault", "lr_const", "--lr-factor", "100", "--fault-step", "100"], stop=20)]


# -- one run (a subprocess: python3 make_corpus.py --worker SPEC OUT) -----------

# The frozen CI corpus (tests/eval/frozen/, recorded once; test_frozen_detection.py
# replays it): a tiny bf16 model (2 layers of 4 heads of 8, MoE in layer 1,
# ~10 ms a step alone), probes every 10 steps of 2 sequences (~1.3 MB a run).
FROZEN_FLAGS = ["--n-layer", "2", "--d-model", "32", "--n-head", "4", "--moe", "alternate",
                "--block-size", "32", "--batch-size", "8", "--lr", "3e-3", "--warmup", "50",
                "--every", "10", "--probe-seqs", "2", "--curvature-every", "50",
                "--curvature-seqs", "1", "--curvature-hvps", "2", "--data", "text",
                "--attention-dtype", "bf16"]
FROZEN_RUNS = {  # scenario -> (steps, injection, flags); tuned without a monitor, seed 0
    "healthy": (900, None, []),
    "benign": (900, 400, ["--lr-decay-step", "400", "--lr-decay-factor", "0.3"]),
    "lr": (1000, 300, ["--fault", "lr", "--lr-factor", "300", "--lr-ramp-steps", "500"]),
    # x128 (x32 and x512 @200: no divergence by step 1000 and 400; x128 ~ step 900).
    "lowprec": (1100, 200, ["--fault", "lowprec", "--fault-strength", "128",
                            "--lowprec-on", "both"]),
}


# A precision fault that diverges: the tiny model's loss only degrades under
# lowprec (above), so gpt4-text-bf16's shape and x32 @300 (it diverged at 823 in
# the corpus), probing 1 sequence every 20 steps to keep the recording small.
FROZEN_GPT4_FLAGS = ["--n-layer", "4", "--d-model", "64", "--n-head", "4", "--moe", "default",
                     "--block-size", "64", "--batch-size", "16", "--lr", "3e-3", "--warmup", "100",
                     "--beta2", "0.95", "--every", "20", "--probe-seqs", "1",
                     "--curvature-every", "50", "--curvature-seqs", "2", "--curvature-hvps", "3",
                     "--data", "text", "--attention-dtype", "bf16"]
FROZEN_GPT4_RUNS = {
    "lowprec": (1100, 300, ["--fault", "lowprec", "--fault-strength", "32", "--lowprec-on", "both"]),
}


def frozen_plan():
    """The frozen CI corpus's runs (FROZEN_RUNS, FROZEN_GPT4_RUNS)."""
    runs = []
    for name, flags_of, table in (("frozen-tiny-bf16", FROZEN_FLAGS, FROZEN_RUNS),
                                  ("frozen-gpt4-bf16", FROZEN_GPT4_FLAGS, FROZEN_GPT4_RUNS)):
        c = dict(name=name, split="frozen", attention_dtype="bf16", flags=flags_of)
        for scenario, (steps, inj, flags) in table.items():
            fault = scenario not in ("healthy", "benign")
            runs.append(make_run(c, scenario, 0, steps, inj,
                                 flags + (["--fault-step", str(inj)] if fault else []),
                                 stop=STOP_AFTER_DIVERGENCE if fault else None))
    return runs


def worker(spec_path, out_path):
    sys.path[:0] = [ROOT, os.path.join(ROOT, "client", "python")]
    from demo import train
    with open(spec_path) as f:
        spec = json.load(f)
    args = train.parse_args(["--endpoint", spec["endpoint"]] + spec["train_flags"])
    t0 = time.monotonic()
    result = train.run(args)
    stats = result["stats"] or {}
    out = dict(divergence_step=result["divergence_step"], steps_run=len(result["losses"]),
               train_wall_s=round(time.monotonic() - t0, 2),
               mean_step_ms=round(1e3 * result["mean_step_s"], 2),
               mean_probe_ms=round(1e3 * result["mean_probe_s"], 2),
               final_loss=result["losses"][-1] if result["losses"] else None,
               rtn_tie_share=result.get("rtn_tie_share"),
               client_stats={k: v for k, v in stats.items() if isinstance(v, (int, float))})
    with open(out_path, "w") as f:
        json.dump(out, f)


def run_one(run, endpoint, out_dir, python):
    log_dir = os.path.join(out_dir, "logs")
    rec_dir = os.path.join(out_dir, "recordings")
    for name in os.listdir(rec_dir):  # an interrupted earlier attempt's recording
        if f"-{run['run_id']}-rank" in name or f"-{run['run_id']}-wqk-rank" in name:
            os.remove(os.path.join(rec_dir, name))
    spec_path = os.path.join(log_dir, run["run_id"] + ".spec.json")
    res_path = os.path.join(log_dir, run["run_id"] + ".result.json")
    with open(spec_path, "w") as f:
        json.dump(dict(endpoint=endpoint, train_flags=run["train_flags"]), f)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    with open(os.path.join(log_dir, run["run_id"] + ".log"), "w") as log:
        if STOPPING.is_set():
            return dict(run, error="generation interrupted")
        proc = subprocess.Popen([python, os.path.abspath(__file__), "--worker", spec_path,
                                 res_path], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env)
        CHILDREN.add(proc)
        try:
            rc = proc.wait()
        finally:
            CHILDREN.discard(proc)
    row = dict(run)
    row["wall_s"] = round(time.monotonic() - t0, 1)
    if rc != 0 or not os.path.exists(res_path):
        row["error"] = f"train.py exited with {rc}; see logs/{run['run_id']}.log"
        return row
    with open(res_path) as f:
        row.update(json.load(f))
    os.remove(res_path)
    os.remove(spec_path)
    inj, div = run["injection_step"], row["divergence_step"]
    row["diverged"] = div is not None
    row["divergence_delay"] = div - inj if (div is not None and inj is not None) else None
    row["recordings"] = sorted(n for n in os.listdir(rec_dir) if f"-{run['run_id']}-rank" in n)
    weight_recordings = sorted(n for n in os.listdir(rec_dir) if f"-{run['run_id']}-wqk-rank" in n)
    if weight_recordings:
        row["weight_recordings"] = weight_recordings
    return row


def load_manifest(path):
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {"runs": []}


def build_info(foreshockd):
    """The commit of this checkout, whether its tree differs from it, and the
    daemon binary's hash."""
    def git(*argv):
        out = subprocess.run(["git", "-C", ROOT, *argv], capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else None
    digest = hashlib.sha256()
    with open(foreshockd, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return dict(commit=git("rev-parse", "HEAD"),
                tree_differs=bool(git("status", "--porcelain", "--untracked-files=no")),
                foreshockd=foreshockd, foreshockd_sha256=digest.hexdigest(),
                recorded_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def write_manifest(path, manifest):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, path)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1], argv[2])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="corpus directory (outside git)")
    p.add_argument("--jobs", type=int, default=2, help="trainings at once (one core each)")
    p.add_argument("--only", nargs="+", choices=list(configs.CONFIGS), default=None,
                   help="these configurations only")
    p.add_argument("--scenarios", nargs="+", default=None,
                   help="these scenarios only (healthy benign lr lr_const lowprec both)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--smoke", action="store_true",
                   help="two short runs of a tiny configuration (CI; ~1-2 minutes)")
    p.add_argument("--knob-blind", action="store_true",
                   help="also the faults the knob cannot reveal and the benign LR events of "
                        "configs.KNOB_BLIND (issue 25 item 2)")
    p.add_argument("--fault-window", type=int, default=None,
                   help="a fault run lasts its injection step + this many steps if it never "
                        f"diverges (default {FAULT_WINDOW}); --control-steps likewise for controls")
    p.add_argument("--control-steps", type=int, default=None,
                   help="healthy and benign runs' length (default: the configuration's)")
    p.add_argument("--frozen", action="store_true",
                   help="the frozen CI corpus's runs (FROZEN_RUNS; tests/eval/frozen/)")
    p.add_argument("--foreshockd", default=os.path.join(ROOT, "build", "server", "foreshockd"))
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--weight-qk", action="store_true",
                   help="train.py --weight-qk: each run also streams its weight-side QK factors "
                        "as run RUN_ID-wqk (tests/eval/weight_qk.py evaluates them)")
    p.add_argument("--plan", default=None,
                   help="record the runs of this draw file instead (tests/eval/preregistered.py draw)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    args = p.parse_args(argv)

    if args.plan:
        with open(args.plan) as f:
            runs = json.load(f)["runs"]
    else:
        runs = plan(args.only or list(configs.CONFIGS), args.seeds, smoke=args.smoke,
                    frozen=args.frozen, knob_blind=args.knob_blind,
                    fault_window=args.fault_window)
    if args.control_steps:
        runs = [control_length(r, args.control_steps) if r["kind"] == "control" else r
                for r in runs]
    if args.scenarios:
        runs = [r for r in runs if r["scenario"] in args.scenarios]
    if args.weight_qk:
        logs = os.path.join(os.path.abspath(args.out), "logs")
        runs = [dict(r, train_flags=r["train_flags"] + [
            "--weight-qk", "--weight-qk-log", os.path.join(logs, r["run_id"] + ".wqk.jsonl")])
            for r in runs]
    out_dir = os.path.abspath(args.out)
    manifest_path = os.path.join(out_dir, "manifest.json")
    if args.dry_run:
        for r in runs:
            print(r["run_id"], r["steps"], r["injection_step"])
        print(f"{len(runs)} runs, at most {sum(r['steps'] for r in runs)} steps")
        return 0
    for d in ("recordings", "logs"):
        os.makedirs(os.path.join(out_dir, d), exist_ok=True)
    manifest = load_manifest(manifest_path)
    done = {r["run_id"] for r in manifest["runs"] if "error" not in r}
    manifest["runs"] = [r for r in manifest["runs"] if "error" not in r]
    todo = [r for r in runs if r["run_id"] not in done]
    manifest.update(generator="tests/eval/make_corpus.py", stop_after_divergence=STOP_AFTER_DIVERGENCE,
                    divergence_rule="first step after warm-up where the 20-step mean loss exceeds "
                                    "1.3x its running minimum, or the loss is not finite "
                                    "(demo/train.py divergence_step)",
                    configs={name: {k: v for k, v in c.items() if k != "name"}
                             for name, c in configs.CONFIGS.items()}
                    if not (args.smoke or args.frozen or args.plan) else {})
    if args.plan:
        manifest["plan"] = os.path.relpath(os.path.abspath(args.plan), ROOT)
    # Which build made the recordings (a draw is recorded by a build of its
    # freeze commit): appended per invocation, since a corpus can be resumed.
    manifest.setdefault("builds", []).append(build_info(os.path.abspath(args.foreshockd)))
    print(f"{len(runs)} runs planned, {len(runs) - len(todo)} already done, {len(todo)} to run",
          flush=True)
    if not todo:
        write_manifest(manifest_path, manifest)
        return 0

    daemon = Daemon(os.path.abspath(args.foreshockd), os.path.join(out_dir, "recordings"),
                    os.path.join(out_dir, "logs", "foreshockd.log"))
    daemon.start()
    print(f"foreshockd pid {daemon.process.pid} on {daemon.endpoint}", flush=True)

    def on_term(signum, frame):  # SIGTERM: stop the trainings and the daemon, keep the manifest
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_term)
    lock = threading.Lock()
    t_start = time.monotonic()
    failures = 0
    try:
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs)
        futures = {pool.submit(run_one, r, daemon.endpoint, out_dir, args.python): r
                   for r in todo}
        for n, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            row = fut.result()
            failures += "error" in row
            with lock:
                manifest["runs"].append(row)
                manifest["runs"].sort(key=lambda r: r["run_id"])
                write_manifest(manifest_path, manifest)
            print(f"[{n}/{len(todo)} {time.monotonic() - t_start:6.0f}s] {row['run_id']}: "
                  + (row["error"] if "error" in row else
                     f"{row['steps_run']} steps, divergence {row['divergence_step']}"
                     f" (injection {row['injection_step']}), {row['wall_s']:.0f}s, "
                     f"{row['mean_step_ms']:.0f} ms/step"), flush=True)
        pool.shutdown()
    except KeyboardInterrupt:
        STOPPING.set()
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in list(CHILDREN):
            proc.terminate()
        for proc in list(CHILDREN):
            proc.wait()
        print("interrupted: the runs in progress are left out of the manifest", flush=True)
        raise
    finally:
        daemon.stop()
    print(f"done in {time.monotonic() - t_start:.0f}s; {failures} failed; {manifest_path}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
