#!/usr/bin/env python3
"""End to end: one 70B-shaped probe through the real client and a real foreshockd.

Synthetic Q/K of a 70B-class model's real shapes (80 layers, 64 query heads,
8 KV heads, head_dim 128; a probe batch of 2 sequences x 512 tokens; bf16 on
the wire) go through `foreshock.Monitor` into two foreshockd processes on
loopback, one with --workers=1 and one with --workers=2, probes alternating
between them (same run, so a noisy machine slows both alike). The "model" is a
module whose forward only hands precomputed tensors to
`monitor.capture_qk(layer, q, k)` for every layer (q [2, 64, 512, 128],
k [2, 8, 512, 128], bf16; three slightly different variants rotate, so that
consecutive samples of a head differ as after a training step): the time
measured on the training thread is the client's, not a model's.

Per probe (a Monitor.step that probes):
  - training thread: wall and thread CPU time of monitor.step (capture, the
    per-layer copies, sampling, encoding, enqueue);
  - the other threads of the training process (the sender thread, gRPC's
    request-consuming and polling threads), CPU from the step until the last
    record is acked (/proc/self/task/*/schedstat);
  - a training-loop stand-in on the main thread while the sender ships the
    probe (pure-Python arithmetic, then small torch matmuls, timed per
    iteration) against the same loop right after with the sender idle; the
    main thread's time off the CPU is split (schedstat) into waiting for a
    CPU (runnable: other threads and processes on the cores) and blocked
    (not runnable: the GIL, the only thing this loop can block on);
  - bytes: the encoded QK records (Record.ByteSize) and the daemon's
    foreshock_ingest_bytes_total;
  - daemon: from the step's end, and from the last ack, until
    foreshock_samples_processed_total covers every ingested record and
    foreshock_queue_bytes is 0; its CPU (/proc/<pid>/stat) and its QK
    detector seconds (foreshock_detector_seconds_sum) over the probe;
  - peak RSS (VmHWM) of the training process (reset per configuration
    through /proc/self/clear_refs) and of each daemon (reset after the
    warm-up: the peak over the measured probes); with --rss-window-s, each
    daemon's steady RSS, the least VmRSS over that window after each probe.

--variant runs further daemons per --workers value with other flags or
another binary, in the same run: e.g. checkpoints every second against none
(--variant 'ckpt --checkpoint_interval_s=1' --variant 'nockpt
--checkpoint_interval_s=0' --rss-window-s 1.5).

Configurations: default (max_probe_bytes 48 MiB: 8 rotating heads x 256
tokens per layer), mid (probe_heads=16, probe_tokens=512: 16 heads x one
512-token sequence) and full (max_probe_bytes=None: every head, 2 x 512
tokens, ~1.5 GB at 80 layers; run at --full-layers, 8 by default, and scaled).
Before the measured probes each daemon gets enough probes for every head to
have a previous sample (one rotation of the head window).

The daemon's figures (ack, drain, CPU) are taken from the probes whose head
window starts at head 0 (every probe when all heads are sent). foreshockd
(wire/validation.cc) turns a QKSample.heads of [0, 1, ..., n-1] into
"no head names", i.e. a full sample, and the QK detector then forgets every
head >= n, so today the other probes of a rotation find no previous sample for
their heads and compute attention statistics only; the window-0 probes cost
what every probe of a rotation is meant to cost. The other probes' daemon
figures are reported on one line.

    OMP_NUM_THREADS=1 build/venv-pypi/bin/python tests/bench/probe_70b.py
    OMP_NUM_THREADS=1 build/venv-pypi/bin/python tests/bench/probe_70b.py --quick
    OMP_NUM_THREADS=1 build/venv-pypi/bin/python tests/bench/probe_70b.py \\
        --configs full --full-layers 8 --probes 3 --json /tmp/full.json
"""
import argparse
import itertools
import json
import math
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if not os.environ.get("FORESHOCK_INSTALLED_CLIENT"):
    sys.path.insert(0, os.path.join(ROOT, "client", "python"))

import torch  # noqa: E402

import foreshock  # noqa: E402
from foreshock import capture, prometheus, sampling  # noqa: E402

# Llama-3-70B's attention shape and the probe batch (sequences x tokens).
SHAPE = dict(layers=80, heads=64, kv_heads=8, head_dim=128, batch=2, seq=512)
# Monitor arguments per configuration (queue and unacked bounds are raised
# above one probe where a probe exceeds the defaults, see bounds()).
CONFIGS = {
    "default": dict(),
    "mid": dict(probe_heads=16, probe_tokens=512, max_probe_bytes=None),
    "full": dict(max_probe_bytes=None),
}
# Training-loop stand-in: pure-Python iterations and 128 x 128 matmuls per iteration.
PY_N, MM_N, MM_SIZE = 4000, 4, 128
MIB = 1 << 20


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """One foreshockd on free loopback ports; stop() ends it by PID."""

    def __init__(self, tmp, name, args, binary=None):
        binary = binary or os.environ.get("FORESHOCKD",
                                          os.path.join(ROOT, "build", "server", "foreshockd"))
        self.port, self.metrics_port = free_port(), free_port()
        self.log_path = os.path.join(tmp, f"foreshockd-{name}.log")
        self.args = args
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [binary, f"--listen=127.0.0.1:{self.port}",
                 f"--metrics_listen=127.0.0.1:{self.metrics_port}",
                 f"--data_dir={os.path.join(tmp, 'data-' + name)}", *args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                self.scrape()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("foreshockd did not start; see " + self.log_path)

    @property
    def endpoint(self):
        return f"127.0.0.1:{self.port}"

    def scrape(self):
        with urllib.request.urlopen(self.url, timeout=5) as r:
            return prometheus.parse(r.read().decode())

    def counters(self):
        s = self.scrape()

        def total(name, **labels):
            return sum(v for n, l, v in s if n == name
                       and all(l.get(k) == w for k, w in labels.items()))
        return dict(ingested=total("foreshock_ingest_records_total"),
                    processed=total("foreshock_samples_processed_total"),
                    queue_bytes=total("foreshock_queue_bytes"),
                    ingest_bytes=total("foreshock_ingest_bytes_total"),
                    rejected=total("foreshock_ingest_rejected_total"),
                    qk_seconds=total("foreshock_detector_seconds_sum", detector="qk"),
                    qk_count=total("foreshock_detector_seconds_count", detector="qk"),
                    errors=total("foreshock_detector_errors_total"))

    def cpu(self):
        return process_cpu(self.proc.pid)

    def hwm_mb(self):
        return status_kb(self.proc.pid, "VmHWM") / 1024

    def reset_hwm(self):
        with open(f"/proc/{self.proc.pid}/clear_refs", "w") as f:
            f.write("5")

    def least_rss_mb(self, seconds):
        """The least VmRSS over `seconds` (polled every 20 ms): the steady state
        between checkpoints, which at --checkpoint_interval_s=1 recur within it."""
        least, end = float("inf"), time.monotonic() + seconds
        while time.monotonic() < end:
            least = min(least, status_kb(self.proc.pid, "VmRSS") / 1024)
            time.sleep(0.02)
        return least

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def process_cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def status_kb(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def schedstat(tid):
    """(CPU ns, run-queue wait ns) of one thread of this process."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        cpu, wait, _ = f.read().split()
    return int(cpu), int(wait)


def threads_cpu():
    """{tid: (name, CPU s)} of this process's threads other than the main one
    (Python threads by their Python name, C threads by their OS name)."""
    main = threading.main_thread().native_id
    python_names = {t.native_id: t.name.split(" (")[0] for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == main:
            continue
        try:
            name = python_names.get(int(tid))
            if name is None:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
            out[int(tid)] = (name, schedstat(tid)[0] / 1e9)
        except OSError:
            pass  # the thread ended
    return out


def threads_delta(before, after):
    by_name = {}
    for tid, (name, cpu) in after.items():
        by_name[name] = by_name.get(name, 0.0) + cpu - before.get(tid, (name, 0.0))[1]
    return {k: v for k, v in by_name.items() if v > 0.0005}


class ProbeEmitter(torch.nn.Module):
    """A 'model' whose forward hands each layer's precomputed Q/K to the probing monitor."""

    def __init__(self, layers, pool):
        super().__init__()
        self.layers, self.pool = layers, pool
        self.monitor = None  # the monitor whose step() runs this forward
        self.calls = {}

    def forward(self, x):
        p = self.calls.get(id(self.monitor), 0)
        self.calls[id(self.monitor)] = p + 1
        for layer in range(self.layers):
            q, k = self.pool[(layer + p) % len(self.pool)]
            self.monitor.capture_qk(layer, q, k)
        return x


def make_pool(shape, variants=3, seed=0):
    """`variants` (q, k) pairs: one random base plus 5% of fresh noise each, bf16."""
    g = torch.Generator().manual_seed(seed)
    b, h, kv, t, d = shape["batch"], shape["heads"], shape["kv_heads"], shape["seq"], \
        shape["head_dim"]
    q0, k0 = torch.randn(b, h, t, d, generator=g), torch.randn(b, kv, t, d, generator=g)
    return [((q0 + 0.05 * torch.randn(b, h, t, d, generator=g)).bfloat16(),
             (k0 + 0.05 * torch.randn(b, kv, t, d, generator=g)).bfloat16())
            for _ in range(variants)]


def probe_plan(shape, layers, kwargs):
    """(heads per layer, tokens per head-sample, bytes of Q/K) the monitor will send."""
    n = shape["batch"] * shape["seq"]
    geometry = ((shape["heads"], shape["kv_heads"], n, shape["head_dim"], shape["seq"]),) * layers
    heads, tokens, size = sampling.plan(geometry, 2, kwargs.get("max_probe_bytes", 48 << 20),
                                        kwargs.get("probe_heads"), kwargs.get("probe_tokens"))
    return (heads or shape["heads"]), min(tokens or n, n), size


def bounds(size):
    """Client queue/unacked bounds: the defaults, or twice the probe when it exceeds them."""
    return dict(queue_bytes=max(256 * MIB, 2 * size), max_unacked_bytes=max(64 * MIB, 2 * size))


# -- the training-loop stand-in ----------------------------------------------

class Loop:
    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.a = torch.randn(MM_SIZE, MM_SIZE, generator=g)
        self.b = torch.randn(MM_SIZE, MM_SIZE, generator=g) / math.sqrt(MM_SIZE)

    def run(self, until=None, iters=None, max_s=120.0):
        """Iterations until until() (or `iters` of them). Per iteration: the
        pure-Python part's and the torch part's wall time; for the window: wall,
        main-thread CPU, run-queue wait and blocked (the rest: off the CPU and not
        runnable, i.e. waiting for the GIL)."""
        tid = threading.get_native_id()
        py, mm = [], []
        cpu0, wait0 = schedstat(tid)
        w0 = time.perf_counter()
        done = until or (lambda: len(py) >= iters)
        while True:
            t0 = time.perf_counter()
            s = 0
            for i in range(PY_N):
                s += i * i
            t1 = time.perf_counter()
            x = self.a
            for _ in range(MM_N):
                x = torch.mm(x, self.b)
            t2 = time.perf_counter()
            py.append(t1 - t0)
            mm.append(t2 - t1)
            if done() or t2 - w0 > max_s:
                break
        wall = time.perf_counter() - w0
        cpu1, wait1 = schedstat(tid)
        cpu, wait = (cpu1 - cpu0) / 1e9, (wait1 - wait0) / 1e9
        return dict(iters=len(py), py=py, mm=mm, wall=wall, cpu=cpu, runq=wait,
                    blocked=max(0.0, wall - cpu - wait))


# -- one configuration -------------------------------------------------------

def wait_drained(daemon, expected_ingested, t_ref, timeout_s=900.0, interval_s=0.05):
    """Polls /metrics until `expected_ingested` records are in and all are processed
    and the queue is empty; returns (seconds after t_ref, counters)."""
    deadline = time.monotonic() + timeout_s
    while True:
        c = daemon.counters()
        now = time.perf_counter()
        if (c["ingested"] >= expected_ingested and c["processed"] >= c["ingested"]
                and c["queue_bytes"] == 0):
            return now - t_ref, c
        if time.monotonic() > deadline:
            raise RuntimeError(f"daemon did not drain within {timeout_s} s: {c}")
        time.sleep(interval_s)


def wait_acked(monitor, target, timeout_s=900.0):
    sender = monitor._sender
    deadline = time.monotonic() + timeout_s
    while sender._counts["acked_records"] + sum(sender._rejected.values()) < target:
        if time.monotonic() > deadline:
            raise RuntimeError(f"not acked within {timeout_s} s: {monitor.stats()}")
        time.sleep(0.01)


def run_config(name, cfg, shape, layers, args, tmp, log):
    kwargs = dict(CONFIGS[name])
    if name == "default" and layers != shape["layers"]:
        # Fewer layers would fit more of each under max_probe_bytes: send what
        # the 80-layer plan sends per layer.
        heads, tokens, _ = probe_plan(shape, shape["layers"], kwargs)
        kwargs.update(probe_heads=heads if heads < shape["heads"] else None, probe_tokens=tokens)
    heads, tokens, plan_bytes = probe_plan(shape, layers, kwargs)
    kwargs.update(bounds(plan_bytes))
    warmup = sampling.probes_to_see_every_head(shape["heads"], heads)
    pool = make_pool(shape)
    module = ProbeEmitter(layers, pool)
    dummy = torch.zeros(1)
    loop = Loop()
    loop.run(iters=50)  # warm

    daemons, monitors, steps = {}, {}, {}
    info = capture.ModelInfo(n_layers=shape["layers"], n_heads=shape["heads"],
                             head_dim=shape["head_dim"])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets this process's VmHWM
    rss_base_mb = status_kb("self", "VmRSS") / 1024
    try:
        for w, (variant, binary, variant_args) in itertools.product(args.workers, args.variants):
            key = f"w{w}" + (f"-{variant}" if variant else "")
            daemons[key] = Daemon(tmp, f"{name}-{key}",
                                  [f"--workers={w}", *args.daemon_args, *variant_args], binary)
            sizes = []
            monitors[key] = foreshock.Monitor(
                daemons[key].endpoint, run_id=f"p70-{name}-{key}", job="bench", model=module,
                probe_batch=dummy, discover=False, discover_routers=False, every=1,
                model_info=info, tap=lambda r, sizes=sizes: sizes.append(
                    r.ByteSize() if r.HasField("qk") else 0), **kwargs)
            monitors[key].sizes = sizes
            steps[key] = 0
        records_per_probe = layers + 1  # QK samples and the step's scalars

        def probe(key):
            monitor, daemon = monitors[key], daemons[key]
            module.monitor = monitor
            before = daemon.counters()
            target = monitor._sender._counts["acked_records"] + records_per_probe
            n_sizes = len(monitor.sizes)
            th0, dcpu0 = threads_cpu(), daemon.cpu()
            w0, c0 = time.perf_counter(), time.thread_time()
            # Rotating heads: the window starting at head 0 (see the module docstring).
            window0 = monitor._counts["probes"] % warmup == 0
            monitor.step(steps[key])
            step_wall, step_cpu = time.perf_counter() - w0, time.thread_time() - c0
            steps[key] += 1
            t_sent = time.perf_counter()
            sender = monitor._sender
            active = loop.run(until=lambda: sender._counts["acked_records"]
                              + sum(sender._rejected.values()) >= target)
            t_acked = time.perf_counter()
            th1 = threads_cpu()
            done_s, after = wait_drained(daemon, before["ingested"] + records_per_probe, t_sent)
            dcpu = daemon.cpu() - dcpu0
            idle = loop.run(iters=active["iters"])
            # Steady RSS after the probe: the least over 1.5 checkpoint intervals
            # of 1 s (--rss-window-s), so that no checkpoint's transient is in it.
            steady_mb = daemon.least_rss_mb(args.rss_window_s) if args.rss_window_s else None
            sizes = monitor.sizes[n_sizes:]
            return dict(window0=window0, step_wall=step_wall, step_cpu=step_cpu, ack_s=t_acked - t_sent,
                        drain_from_send_s=done_s, drain_from_ack_s=done_s - (t_acked - t_sent),
                        daemon_cpu=dcpu,
                        qk_detector_s=after["qk_seconds"] - before["qk_seconds"],
                        qk_samples=after["qk_count"] - before["qk_count"],
                        ingest_bytes=after["ingest_bytes"] - before["ingest_bytes"],
                        rejected=after["rejected"] - before["rejected"],
                        errors=after["errors"] - before["errors"],
                        record_bytes=sum(sizes), records=sum(1 for s in sizes if s),
                        threads=threads_delta(th0, th1), active=active, idle=idle,
                        daemon_steady_rss_mb=steady_mb)

        # Warm-up: every head gets a previous sample in every daemon.
        for key in monitors:
            module.monitor = monitors[key]
            for i in range(warmup):  # one at a time: the client queue holds ~one probe
                monitors[key].step(steps[key])
                steps[key] += 1
                wait_acked(monitors[key], (i + 1) * records_per_probe)
        for key in monitors:
            wait_drained(daemons[key], warmup * records_per_probe, time.perf_counter())
        log(f"{name}: warm-up done ({warmup} probe(s) per daemon)")
        for d in daemons.values():
            d.reset_hwm()  # the peak over the measured probes only
        results = {key: [] for key in monitors}
        keys = list(monitors)
        n_probes = args.probes or (warmup * (1 if args.quick else 2) if warmup > 1
                                   else (2 if args.quick else 3))
        for i in range(n_probes):
            for key in keys[i % len(keys):] + keys[:i % len(keys)]:
                r = probe(key)
                results[key].append(r)
                log(f"{name} probe {i + 1}/{n_probes} {key}{' (window 0)' * r['window0']}: step {r['step_wall']:.3f} s "
                    f"wall / {r['step_cpu']:.3f} s CPU, acked +{r['ack_s']:.2f} s, drained "
                    f"+{r['drain_from_send_s']:.2f} s, daemon CPU {r['daemon_cpu']:.2f} s, "
                    f"loop {statistics.fmean(r['active']['py']) * 1e3:.2f} vs "
                    f"{statistics.fmean(r['idle']['py']) * 1e3:.2f} ms")
        stats = {}
        for key, monitor in monitors.items():
            monitor.close(timeout=60)
            stats[key] = {k: v for k, v in monitor.stats().items()
                          if isinstance(v, (int, float, dict))}
        client_hwm_mb = status_kb("self", "VmHWM") / 1024
        daemon_hwm = {key: d.hwm_mb() for key, d in daemons.items()}
    finally:
        for monitor in monitors.values():
            monitor.close(timeout=1)
        for d in daemons.values():
            d.stop()
    return dict(name=name, layers=layers, heads=heads, tokens=tokens, plan_bytes=plan_bytes,
                warmup=warmup, kwargs={k: v for k, v in kwargs.items()},
                client_rss_base_mb=rss_base_mb, client_hwm_mb=client_hwm_mb,
                daemon_hwm_mb=daemon_hwm, stats=stats, probes=results)


# -- report ------------------------------------------------------------------

def med(xs):
    return statistics.median(xs) if xs else float("nan")


def summarize(res, shape):
    name, layers = res["name"], res["layers"]
    scale = shape["layers"] / layers
    hs = layers * res["heads"]  # head-samples per probe
    lines = [f"### {name}: {res['heads']} query heads x {res['tokens']} tokens per layer, "
             f"{layers} layers (x{scale:g} to 80), plan {res['plan_bytes'] / 1e6:.1f} MB of Q/K, "
             f"{hs} head-samples per probe; client kwargs {res['kwargs']}",
             "",
             "| daemon | step wall (s) | step CPU (s) | other threads CPU (s) | record bytes (MB) "
             "| ingest bytes (MB) | acked after (s) | drained after send (s) | drained after "
             "last ack (s) | daemon CPU (s) | QK detector (s) | per head-sample, detector (ms) "
             "| per head-sample, daemon CPU (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    summary = {}
    for key, ps in res["probes"].items():
        w0 = [p for p in ps if p["window0"]]
        row = {k: med([p[k] for p in ps]) for k in (
            "step_wall", "step_cpu", "record_bytes", "ingest_bytes")}
        row.update({k: med([p[k] for p in w0]) for k in (
            "ack_s", "drain_from_send_s", "drain_from_ack_s", "daemon_cpu", "qk_detector_s")})
        others = [p for p in ps if not p["window0"]]
        row["others"] = {k: med([p[k] for p in others]) for k in (
            "ack_s", "drain_from_send_s", "daemon_cpu", "qk_detector_s")}
        row["threads_cpu"] = med([sum(p["threads"].values()) for p in ps])
        row["per_hs_detector_ms"] = 1e3 * row["qk_detector_s"] / hs
        row["per_hs_daemon_ms"] = 1e3 * row["daemon_cpu"] / hs
        summary[key] = row
        lines.append(
            f"| {key} | {row['step_wall']:.3f} | {row['step_cpu']:.3f} | {row['threads_cpu']:.3f} "
            f"| {row['record_bytes'] / 1e6:.1f} | {row['ingest_bytes'] / 1e6:.1f} | "
            f"{row['ack_s']:.2f} | {row['drain_from_send_s']:.2f} | {row['drain_from_ack_s']:.2f} "
            f"| {row['daemon_cpu']:.2f} | {row['qk_detector_s']:.2f} | "
            f"{row['per_hs_detector_ms']:.2f} | {row['per_hs_daemon_ms']:.2f} |")
    if any(r["others"]["daemon_cpu"] == r["others"]["daemon_cpu"] for r in summary.values()):
        lines += ["", "daemon columns: probes whose head window starts at head 0 (every sampled "
                  "head has its previous sample there); the other probes, as the daemon "
                  "handles them now (see the docstring), median: " + "; ".join(
                      f"{k} acked after {r['others']['ack_s']:.2f} s, daemon CPU "
                      f"{r['others']['daemon_cpu']:.2f} s, QK detector "
                      f"{r['others']['qk_detector_s']:.2f} s" for k, r in summary.items())]
    # Threads, by name, summed over daemons' probes (median per probe).
    names = sorted({n for ps in res["probes"].values() for p in ps for n in p["threads"]})
    all_probes = [p for ps in res["probes"].values() for p in ps]
    lines += ["", "other threads of the training process, CPU per probe (median): " + ", ".join(
        f"{n} {med([p['threads'].get(n, 0.0) for p in all_probes]):.3f} s" for n in names)]
    # The loop stand-in: ratios active/idle per probe, medians over the window-0
    # probes (the others are acked at once today: no window to measure).
    all_probes = [p for p in all_probes if p["window0"]]
    lines += ["", "| loop while the sender ships vs. idle (per-probe ratios, median [min, max]) "
              "| value |", "|---|---|"]
    loops = {}
    for label, part in (("pure-Python part, mean iteration", "py"),
                        ("torch matmul part, mean iteration", "mm")):
        ratios = [statistics.fmean(p["active"][part]) / statistics.fmean(p["idle"][part])
                  for p in all_probes]
        loops[part] = ratios
        lines.append(f"| {label} | {med(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}] |")
    p99 = [sorted(p["active"]["py"])[int(0.99 * (len(p["active"]["py"]) - 1))]
           / sorted(p["idle"]["py"])[int(0.99 * (len(p["idle"]["py"]) - 1))] for p in all_probes]
    mx = [max(p["active"]["py"]) * 1e3 for p in all_probes]
    mx_idle = [max(p["idle"]["py"]) * 1e3 for p in all_probes]
    lines.append(f"| pure-Python part, p99 iteration | {med(p99):.2f} [{min(p99):.2f}, "
                 f"{max(p99):.2f}] |")
    lines.append(f"| longest pure-Python iteration, active / idle (ms) | {med(mx):.1f} / "
                 f"{med(mx_idle):.1f} (median over probes) |")
    for kind in ("active", "idle"):
        w = [p[kind] for p in all_probes]
        share = {k: med([x[k] / x["wall"] for x in w]) for k in ("cpu", "runq", "blocked")}
        lines.append(f"| main thread, {kind} window ({med([x['wall'] for x in w]):.2f} s, "
                     f"{med([x['iters'] for x in w]):.0f} iterations): on CPU / waiting for a "
                     f"CPU / blocked (GIL) | {100 * share['cpu']:.0f}% / {100 * share['runq']:.0f}%"
                     f" / {100 * share['blocked']:.1f}% |")
        loops[kind] = share
    if scale != 1:
        r = summary[min(summary)]
        lines += ["", f"scaled x{scale:g} to 80 layers ({min(summary)}): step "
                  f"{scale * r['step_wall']:.2f} s wall / {scale * r['step_cpu']:.2f} s CPU, "
                  f"{scale * r['record_bytes'] / 1e6:.0f} MB, daemon CPU "
                  f"{scale * r['daemon_cpu']:.1f} s, {scale * hs:.0f} head-samples (estimates)"]
    if any(p["daemon_steady_rss_mb"] is not None for ps in res["probes"].values() for p in ps):
        lines += ["", "| daemon | steady RSS, median over probes [min, max] (MB) | peak RSS "
                  "(VmHWM) over the measured probes (MB) | peak / steady (median) |",
                  "|---|---|---|---|"]
        for key, ps in res["probes"].items():
            steady = [p["daemon_steady_rss_mb"] for p in ps]
            peak = res["daemon_hwm_mb"][key]
            summary[key].update(steady_rss_mb=med(steady), peak_rss_mb=peak)
            lines.append(f"| {key} | {med(steady):.0f} [{min(steady):.0f}, {max(steady):.0f}] "
                         f"| {peak:.0f} | {peak / med(steady):.2f} |")
    lines += ["", f"training process peak RSS {res['client_hwm_mb']:.0f} MB (before the "
              f"configuration {res['client_rss_base_mb']:.0f} MB); daemons' peak RSS (measured probes) " + ", ".join(
                  f"{k} {v:.0f} MB" for k, v in res["daemon_hwm_mb"].items())]
    for key, st in res["stats"].items():
        lines.append(f"{key}: client stats: acked {st.get('acked_records')}, dropped_queue_full "
                     f"{st.get('dropped_queue_full')}, dropped_unacked {st.get('dropped_unacked')}"
                     f", rejected {st.get('rejected')}, resent {st.get('resent')}, reconnects "
                     f"{st.get('reconnects')}")
    rej = sum(p["rejected"] + p["errors"] for p in all_probes)
    if rej:
        lines.append(f"WARNING: {rej} rejected records or detector errors during measured probes")
    return "\n".join(lines), dict(summary=summary, loops=loops, scale=scale, head_samples=hs)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="2 layers (1 for full), 2 probes per daemon (a smoke run, ~30 s)")
    p.add_argument("--configs", default="default,full",
                   help="comma-separated subset of default, mid, full (default: default,full)")
    p.add_argument("--layers", type=int, help="layers of the default and mid configurations "
                   "(default 80)")
    p.add_argument("--full-layers", type=int, help="layers of the full configuration (default 8)")
    p.add_argument("--probes", type=int, help="measured probes per daemon (default: two head "
                   "rotations, or 3 when every head is sent; --quick: one rotation, or 2)")
    p.add_argument("--workers", default="1,2", help="--workers of the daemons (default 1,2)")
    p.add_argument("--daemon-arg", action="append", default=[], dest="daemon_args",
                   help="extra foreshockd flag (repeatable)")
    p.add_argument("--variant", action="append", default=[], dest="variants",
                   metavar="'NAME [--binary=PATH] [FLAG ...]'",
                   help="one daemon per --workers value and variant, named wW-NAME, with these "
                   "extra flags and optionally another foreshockd binary (repeatable), e.g. "
                   "--variant 'ckpt --checkpoint_interval_s=1' --variant 'nockpt "
                   "--checkpoint_interval_s=0'")
    p.add_argument("--rss-window-s", type=float, default=0.0,
                   help="after each probe, poll each daemon's VmRSS for this long and keep the "
                   "least (its steady state); reported with its VmHWM over the measured probes "
                   "(default 0: off)")
    p.add_argument("--json", help="also write the raw figures here")
    args = p.parse_args()
    variants = []
    for spec in args.variants or [""]:
        name, *flags = spec.split() or [""]
        binary = next((f.split("=", 1)[1] for f in flags if f.startswith("--binary=")), None)
        variants.append((name, binary, [f for f in flags if not f.startswith("--binary=")]))
    args.variants = variants
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    args.workers = [int(w) for w in args.workers.split(",")]
    layers = args.layers or (2 if args.quick else SHAPE["layers"])
    full_layers = args.full_layers or (1 if args.quick else 8)
    shape = dict(SHAPE)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    log(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.2f}")
    tmp = tempfile.mkdtemp(prefix="foreshock-probe70b-")
    out, texts = {}, []
    try:
        for name in args.configs.split(","):
            n_layers = full_layers if name == "full" else layers
            start = time.perf_counter()
            res = run_config(name, CONFIGS[name], shape, n_layers, args, tmp, log)
            text, summary = summarize(res, shape)
            res["summary"] = summary
            res["seconds"] = time.perf_counter() - start
            out[name] = res
            texts.append(text)
            print(text + "\n", flush=True)
    finally:
        subprocess.run(["rm", "-rf", tmp], check=False)
    log(f"load average at the end {os.getloadavg()[0]:.2f}; peak RSS of this process "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
    if args.json:
        for res in out.values():  # per-iteration lists are long: keep the window summaries
            for ps in res["probes"].values():
                for r in ps:
                    for kind in ("active", "idle"):
                        w = r[kind]
                        w["py_mean"], w["mm_mean"] = statistics.fmean(w["py"]), \
                            statistics.fmean(w["mm"])
                        del w["py"], w["mm"]
        with open(args.json, "w") as f:
            json.dump(dict(shape=shape, configs=out), f, indent=1)


if __name__ == "__main__":
    main()
