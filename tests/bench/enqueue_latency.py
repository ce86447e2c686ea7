"""What a training step pays to hand a record to the client: the latency of
Monitor.step(loss=...) (one scalar record into the bounded queue) under four
network conditions, measured in one run so that they compare as ratios:

  offline   nothing listens on the port: connection attempts fail at once
  silent    a peer accepts TCP and never speaks: the sender hangs in the handshake
  live      a real foreshockd acknowledges everything
  kill9     the same daemon, killed with SIGKILL and restarted every ~0.5 s

The functional tests assert only that a step never waits on the network
(tests/python/test_sender.py holds the network and checks the steps finish);
the figures live here and in docs/PERFORMANCE.md ("Client enqueue latency").

  OPENBLAS_NUM_THREADS=1 PYTHONPATH=client/python:tests/python \\
      /usr/bin/python3 tests/bench/enqueue_latency.py --foreshockd build/server/foreshockd

Prints one JSON object: per condition, steps, p50/p99/max in microseconds, and
each p99 against the offline p99."""
import argparse
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "python"), os.path.join(HERE, "..", "..", "client", "python")]
from conftest import Daemon, free_port  # noqa: E402
from foreshock import ModelInfo, Monitor  # noqa: E402


def measure(endpoint, steps, step_s, during=None):
    monitor = Monitor(endpoint, run_id=f"bench-{endpoint}-{time.monotonic_ns()}", job="bench",
                      model_info=ModelInfo(n_layers=2, n_heads=4, head_dim=8),
                      backoff_initial_s=0.02, backoff_max_s=0.2)
    durations = []
    try:
        for step in range(steps):
            if during is not None:
                during(step)
            start = time.perf_counter()
            monitor.step(step, loss=1.0 + step * 1e-3)
            durations.append(time.perf_counter() - start)
            time.sleep(step_s)
    finally:
        monitor.close(timeout=0)
    durations.sort()
    pick = lambda q: durations[min(len(durations) - 1, int(q * len(durations)))] * 1e6  # noqa: E731
    return {"steps": steps, "p50_us": round(pick(0.50), 1), "p99_us": round(pick(0.99), 1),
            "max_us": round(durations[-1] * 1e6, 1)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--foreshockd", required=True)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--step_ms", type=float, default=1.0, help="sleep between steps")
    args = parser.parse_args()
    step_s = args.step_ms / 1e3
    results = {"offline": measure(f"127.0.0.1:{free_port()}", args.steps, step_s)}

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        held, stop = [], threading.Event()

        def accept():
            silent.settimeout(0.05)
            while not stop.is_set():
                try:
                    held.append(silent.accept()[0])
                except OSError:
                    pass
        acceptor = threading.Thread(target=accept, daemon=True)
        acceptor.start()
        results["silent"] = measure(f"127.0.0.1:{silent.getsockname()[1]}", args.steps, step_s)
        stop.set()
        acceptor.join(5)
        for conn in held:
            conn.close()

    with tempfile.TemporaryDirectory() as data:
        daemon = Daemon(args.foreshockd, data, ["--workers=1", "--fsync=every"])
        daemon.start()
        try:
            results["live"] = measure(daemon.endpoint, args.steps, step_s)
            kill_every = max(1, int(0.5 / max(step_s, 1e-4)))

            def chaos(step):
                if step and step % kill_every == 0:
                    daemon.stop(sig=signal.SIGKILL)
                    daemon.start()
            results["kill9"] = measure(daemon.endpoint, args.steps, step_s, during=chaos)
        finally:
            daemon.stop()
    base = results["offline"]["p99_us"]
    for name, r in results.items():
        r["p99_vs_offline"] = round(r["p99_us"] / base, 2) if base else None
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
