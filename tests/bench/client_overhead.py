#!/usr/bin/env python3
"""Overhead of the Foreshock client on the training step (torch 2.x, CPU).

One HF Llama-style model (LlamaForCausalLM from a config, random init, nothing
downloaded) trains with AdamW; every round runs a block of steps for each
configuration in turn (rotating the order), all on the same model and
optimizer, so a shared, noisy machine slows all configurations alike:

  baseline         no monitor
  probe/100        Monitor(every=100), the default probe interval
  probe/10         Monitor(every=10)
  probe/100+curv   Monitor(every=100) with CurvatureEstimator defaults (every 50)

and, when named in --configs: probe/50 (the README's cadence), probe/10-nocheck
(every=10 without the attention output check: its cost is the difference to
probe/10). --size picks the model (tiny, small, base: the default); --autocast
bf16 runs every step (and the probes) under CPU bf16 autocast, where the
output check has work to do.

Each monitor streams to a real foreshockd (started here, at nice 10 so that
the daemon, which in production runs elsewhere, competes less with training).
Per step it records wall time and the training thread's CPU time
(time.thread_time: immune to other processes taking the core). Reported per
configuration: the overhead of the mean step over the whole window against
the baseline, and its decomposition into the per-step cost (median over
rounds of the ratio on steps without a probe or estimate) plus the measured
cost of each probe / estimate divided by its interval.

    OMP_NUM_THREADS=1 build/venv-pypi/bin/python tests/bench/client_overhead.py
    OMP_NUM_THREADS=1 build/venv-pypi/bin/python tests/bench/client_overhead.py --quick
    OMP_NUM_THREADS=1 build/venv-pypi/bin/python tests/bench/client_overhead.py --size tiny \
        --configs scalars,probe/50,probe/10 --rounds 10
    OMP_NUM_THREADS=1 build/venv-pypi/bin/python tests/bench/client_overhead.py --hvp-timing

--hvp-timing instead times one Hessian-vector product by torch.func
(forward-over-reverse) and by double backward on the same model, interleaved.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if not os.environ.get("FORESHOCK_INSTALLED_CLIENT"):
    sys.path.insert(0, os.path.join(ROOT, "client", "python"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import foreshock  # noqa: E402
from foreshock.curvature import CurvatureEstimator  # noqa: E402

# Model shape, batch (sequences x seq), probe and curvature batches (sequences),
# interleaved rounds, steps per configuration per round, unmonitored steps before.
FULL = dict(hidden=384, layers=6, intermediate=1024, vocab=8000, seq=128, batch=4, probe=2,
            curv=1, rounds=20, block=10, pretrain=100)
QUICK = dict(hidden=128, layers=2, intermediate=344, vocab=2000, seq=64, batch=4, probe=2,
             curv=1, rounds=6, block=10, pretrain=20)
# Model sizes for --size (the rest as FULL): tiny is the issue-36 user's
# tiny Llama (hidden 64, 4 layers), small the --quick model, base FULL's.
SIZES = dict(tiny=dict(hidden=64, layers=4, intermediate=172, vocab=2000, seq=64),
             small=dict(hidden=128, layers=2, intermediate=344, vocab=2000, seq=64),
             base=dict(hidden=384, layers=6, intermediate=1024, vocab=8000, seq=128))
DEFAULT_CONFIGS = ["scalars", "probe/100", "probe/10", "probe/100+curv"]


def build(cfg, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
                         num_hidden_layers=cfg["layers"], num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=cfg["vocab"],
                         max_position_embeddings=cfg["seq"])
    return LlamaForCausalLM(config)


def corpus(vocab, n_seqs, seq, seed=1):
    """Token sequences of a random sparse bigram language (each token has 4
    successors, Zipf-weighted unigram start): learnable, so training moves
    the curvature as real training does; every token of the vocabulary occurs."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 4), generator=g)
    zipf = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    tokens = torch.empty(n_seqs, seq, dtype=torch.long)
    tokens[:, 0] = torch.multinomial(zipf, n_seqs, replacement=True, generator=g)
    for t in range(1, seq):
        pick = torch.randint(0, 4, (n_seqs,), generator=g)
        tokens[:, t] = successors[tokens[:, t - 1], pick]
    return tokens


def lm_loss(model, batch):
    return model(input_ids=batch, labels=batch).loss


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemon(tmp):
    binary = os.environ.get("FORESHOCKD", os.path.join(ROOT, "build", "server", "foreshockd"))
    port, metrics = free_port(), free_port()
    log = open(os.path.join(tmp, "foreshockd.log"), "wb")
    proc = subprocess.Popen(["nice", "-n", "10", binary, f"--listen=127.0.0.1:{port}",
                             f"--metrics_listen=127.0.0.1:{metrics}",
                             f"--data_dir={os.path.join(tmp, 'data')}"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"127.0.0.1:{port}"
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("foreshockd did not start; see " + log.name)


def process_cpu(pid):
    """CPU seconds of a process (all threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sender_thread_cpu(monitor):
    """CPU seconds of a monitor's sender thread (gRPC's own C threads not included)."""
    thread = monitor._sender._thread
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (OSError, ProcessLookupError, TypeError):
        return 0.0


def median_iqr(xs):
    xs = sorted(xs)
    if not xs:
        return float("nan"), float("nan"), float("nan")
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return statistics.median(xs), q[0], q[2]


def run_overhead(cfg, out_path=None):
    model = build(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = corpus(cfg["vocab"], 64 * cfg["batch"] + cfg["probe"] + cfg["curv"], cfg["seq"])
    data = tokens[:64 * cfg["batch"]].reshape(64, cfg["batch"], cfg["seq"])
    probe = tokens[64 * cfg["batch"]:64 * cfg["batch"] + cfg["probe"]]  # held out
    curv_batch = tokens[-cfg["curv"]:]

    tmp = tempfile.mkdtemp(prefix="foreshock-overhead-")
    daemon, endpoint = start_daemon(tmp)
    daemon_cpu0 = process_cpu(daemon.pid)
    monitors = {}
    try:
        monitors["scalars"] = foreshock.Monitor(endpoint, run_id="oh-scalars", job="bench")
        monitors["probe/100"] = foreshock.Monitor(endpoint, run_id="oh-100", job="bench",
                                                  model=model, probe_batch=probe)
        monitors["probe/10"] = foreshock.Monitor(endpoint, run_id="oh-10", job="bench",
                                                 model=model, probe_batch=probe, every=10)
        monitors["probe/50"] = foreshock.Monitor(endpoint, run_id="oh-50", job="bench",
                                                 model=model, probe_batch=probe, every=50)
        monitors["probe/10-nocheck"] = foreshock.Monitor(
            endpoint, run_id="oh-10-nocheck", job="bench", model=model, probe_batch=probe,
            every=10, output_check=False)
        estimator = CurvatureEstimator(model, lm_loss, curv_batch, optimizer)
        estimates = []  # (monitor step, CurvatureEstimate)
        estimate = estimator.estimate

        def recorded_estimate():
            result = estimate()
            estimates.append((step_no["probe/100+curv"], result))
            return result

        estimator.estimate = recorded_estimate
        monitors["probe/100+curv"] = foreshock.Monitor(endpoint, run_id="oh-curv", job="bench",
                                                       model=model, probe_batch=probe,
                                                       curvature=estimator)
        for name in list(monitors):
            if name not in (cfg["configs"] or DEFAULT_CONFIGS):
                monitors.pop(name).close(timeout=1)
        names = ["baseline"] + list(monitors)
        step_no = {name: 0 for name in names}
        batch_no = [0]
        losses = []

        def train_step(name):
            batch = data[batch_no[0] % len(data)]
            batch_no[0] += 1
            wall, cpu = time.perf_counter(), time.thread_time()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.get("autocast") == "bf16"):
                loss = lm_loss(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            monitor = monitors.get(name)
            event = False
            if monitor is not None:
                s = step_no[name]
                event = (monitor.model is not None and s % monitor.every == 0) or (
                    monitor.curvature is not None and monitor.curvature.due(s))
                monitor.step(s, loss=losses[-1])
            step_no[name] += 1
            return time.perf_counter() - wall, time.thread_time() - cpu, event

        # Warm-up: training without a monitor (Adam's state and the curvature
        # settle past the first steps), then step 0 of every monitor (connection,
        # first probe, the first estimate with auto's one-time method choice).
        for _ in range(cfg["pretrain"]):
            train_step("baseline")
        for name in names:
            train_step(name)
        records = {name: [] for name in names}  # (round, wall, cpu, event)
        sender_cpu = {name: 0.0 for name in names}
        start = time.perf_counter()
        for r in range(cfg["rounds"]):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                before = {n: sender_thread_cpu(m) for n, m in monitors.items()}
                for _ in range(cfg["block"]):
                    wall, cpu, event = train_step(name)
                    records[name].append((r, wall, cpu, event))
                # The sender threads' CPU during this block is the block's configuration's.
                sender_cpu[name] += sum(sender_thread_cpu(m) - before[n]
                                        for n, m in monitors.items())
            print(f"round {r + 1}/{cfg['rounds']} done ({time.perf_counter() - start:.0f} s)",
                  file=sys.stderr, flush=True)
        for monitor in monitors.values():
            monitor.close(timeout=30)
        stats = {name: m.stats() for name, m in monitors.items()}
        daemon_cpu = process_cpu(daemon.pid) - daemon_cpu0
    finally:
        daemon.terminate()
        daemon.wait(10)
    return summarize(cfg, n_params, records, monitors, stats, estimates, estimator.hvp_choice,
                     sender_cpu, daemon_cpu, losses, out_path)


def summarize(cfg, n_params, records, monitors, stats, estimates, hvp_choice, sender_cpu,
              daemon_cpu, losses, out_path):
    rounds = sorted({x[0] for x in records["baseline"]})
    by_round = {name: {r: [x for x in xs if x[0] == r] for r in rounds}
                for name, xs in records.items()}
    base = records["baseline"]
    base_mean = [statistics.fmean(x[i] for x in base) for i in (1, 2)]  # wall, cpu
    base_round = [{r: statistics.median(x[i] for x in by_round["baseline"][r]) for r in rounds}
                  for i in (1, 2)]
    result = {"config": cfg, "params": n_params, "torch": torch.__version__,
              "steps_per_config": len(base), "baseline_step_s": base_mean, "configs": {}}
    lines = [f"autocast: {cfg.get('autocast') or 'off'}",
             f"model: LlamaForCausalLM {n_params / 1e6:.1f}M parameters (hidden {cfg['hidden']}, "
             f"{cfg['layers']} layers, 8 heads, 2 KV heads, vocab {cfg['vocab']}), batch "
             f"{cfg['batch']} x {cfg['seq']}, probe {cfg['probe']} x {cfg['seq']}, curvature "
             f"batch {cfg['curv']} x {cfg['seq']}, torch {torch.__version__}; {cfg['pretrain']} "
             f"steps before, then {len(base)} measured steps per configuration in {len(rounds)} "
             f"interleaved rounds of {cfg['block']}; loss {losses[0]:.2f} -> {losses[-1]:.2f}",
             f"baseline step: {1e3 * base_mean[1]:.1f} ms training-thread CPU, "
             f"{1e3 * base_mean[0]:.1f} ms wall (mean)",
             "",
             "| configuration | overhead, training-thread CPU | per-step part (CPU), median "
             "[IQR] over rounds | probes/estimates in window, CPU each | sender thread CPU "
             "per step | overhead, wall | per-step part (wall), median [IQR] |",
             "|---|---|---|---|---|---|---|"]
    for name, xs in records.items():
        if name == "baseline":
            continue
        row = {}
        for i, label in ((1, "wall"), (2, "cpu")):
            mean = statistics.fmean(x[i] for x in xs)
            # Steps without a probe or estimate, against the same round's baseline.
            ratios = [statistics.median(x[i] for x in by_round[name][r] if not x[3])
                      / base_round[i - 1][r] - 1
                      for r in rounds if any(not x[3] for x in by_round[name][r])]
            events = [x[i] - base_round[i - 1][x[0]] for x in xs if x[3]]
            row[label] = dict(overhead=mean / base_mean[i - 1] - 1, per_step=median_iqr(ratios),
                              events=len(events),
                              event_cost_s=statistics.fmean(events) if events else 0.0)
        sender_share = sender_cpu[name] / len(xs) / base_mean[1]
        row["sender_cpu_per_step_share"] = sender_share
        row["stats"] = {k: v for k, v in stats.get(name, {}).items() if not isinstance(v, dict)}
        result["configs"][name] = row
        c, w = row["cpu"], row["wall"]
        lines.append(
            f"| {name} | {100 * c['overhead']:+.2f}% | {100 * c['per_step'][0]:+.2f}% "
            f"[{100 * c['per_step'][1]:+.2f}, {100 * c['per_step'][2]:+.2f}] | "
            f"{c['events']}, {1e3 * c['event_cost_s']:.0f} ms | {100 * sender_share:.2f}% | "
            f"{100 * w['overhead']:+.2f}% | {100 * w['per_step'][0]:+.2f}% "
            f"[{100 * w['per_step'][1]:+.2f}, {100 * w['per_step'][2]:+.2f}] |")
    lines += ["",
              "curvature estimates (step: products, residual, seconds): " + ", ".join(
                  f"{s}: {e.hvps}, {e.residual:.3f}, {e.seconds:.2f}" for s, e in estimates),
              f"curvature method: {hvp_choice}",
              f"foreshockd (nice 10): {daemon_cpu:.1f} s CPU over the run"]
    for name, st in stats.items():
        lines.append(f"{name}: acked {st.get('acked_records')}, dropped_queue_full "
                     f"{st.get('dropped_queue_full')}, probes {st.get('probes')}, "
                     f"probe seconds {st.get('probe_seconds_total', 0):.2f}")
    result["curvature"] = [dict(step=s, hvps=e.hvps, residual=e.residual, seconds=e.seconds,
                                lambda_max=e.lambda_max) for s, e in estimates]
    result["daemon_cpu_s"] = daemon_cpu
    text = "\n".join(lines)
    print(text)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
    return result


def run_hvp_timing(cfg, rounds):
    """One HVP by torch.func (jvp of grad) and by double backward, interleaved,
    training-thread CPU time; double backward reported both as the first product
    of an estimate (gradient graph included) and as a further product."""
    model = build(cfg).eval()
    batch = torch.randint(0, cfg["vocab"], (cfg["curv"], cfg["seq"]),
                          generator=torch.Generator().manual_seed(1))
    func = CurvatureEstimator(model, lm_loss, batch, hvp_mode="func")
    double = CurvatureEstimator(model, lm_loss, batch, hvp_mode="double_backward")
    v = [torch.randn_like(p) for p in func.params]
    times = {"fwd+bwd": [], "func": [], "double, first (graph)": [], "double, further": []}

    def fb():
        torch.autograd.grad(lm_loss(model, batch), func.params)

    for r in range(rounds + 1):
        s = time.thread_time()
        fb()
        t_fb = time.thread_time() - s
        with func._products():
            s = time.thread_time()
            func._hvp_func(v)
            t_func = time.thread_time() - s
        with double._products():
            s = time.thread_time()
            double._hvp_double_backward(v)
            t_first = time.thread_time() - s
            s = time.thread_time()
            double._hvp_double_backward(v)
            t_more = time.thread_time() - s
        if r:  # round 0 warms up
            times["fwd+bwd"].append(t_fb)
            times["func"].append(t_func)
            times["double, first (graph)"].append(t_first)
            times["double, further"].append(t_more)
    n = sum(p.numel() for p in model.parameters())
    print(f"LlamaForCausalLM {n / 1e6:.1f}M, HVP batch {cfg['curv']} x {cfg['seq']}, "
          f"{rounds} rounds, training-thread CPU, torch {torch.__version__}")
    for name, xs in times.items():
        med, q1, q3 = median_iqr(xs)
        print(f"  {name:22s} median {1e3 * med:7.1f} ms  [IQR {1e3 * q1:.1f}, {1e3 * q3:.1f}]")
    f = statistics.median(times["func"])
    d1 = statistics.median(times["double, first (graph)"])
    d = statistics.median(times["double, further"])
    for k in (1, 3, 6, 9):
        print(f"  estimate of {k} products: torch.func {1e3 * k * f:.0f} ms, double backward "
              f"{1e3 * (d1 + (k - 1) * d):.0f} ms")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a small model and 4 rounds (a smoke run)")
    p.add_argument("--rounds", type=int, help="interleaved rounds")
    p.add_argument("--block", type=int, help="steps per configuration per round")
    p.add_argument("--configs", help="comma-separated subset of scalars, probe/100, probe/10, "
                   "probe/100+curv, probe/50, probe/10-nocheck (default: the first four)")
    p.add_argument("--size", choices=sorted(SIZES), help="model size (default: base; --quick: small)")
    p.add_argument("--autocast", choices=["bf16"], help="train and probe under CPU bf16 autocast")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--hvp-timing", action="store_true",
                   help="time torch.func against double backward per HVP instead")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = dict(QUICK if args.quick else FULL)
    if args.size:
        cfg.update(SIZES[args.size])
    cfg["autocast"] = args.autocast
    if args.rounds:
        cfg["rounds"] = args.rounds
    if args.block:
        cfg["block"] = args.block
    cfg["configs"] = args.configs.split(",") if args.configs else None
    if args.hvp_timing:
        run_hvp_timing(cfg, args.rounds or (3 if args.quick else 10))
    else:
        run_overhead(cfg, args.json)


if __name__ == "__main__":
    main()
