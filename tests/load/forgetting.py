#!/usr/bin/python3
"""What a long-lived daemon keeps as runs come and go, with and without
forgetting (docs/PERFORMANCE.md#forgetting-runs, docs/DESIGN.md §3.4).

Two daemons, one after the other, with the same load: ROUNDS rounds, each
RUNS new runs streaming QK, router and scalar samples for a few seconds
(tests/load/load_gen.cc, `foreshock_load`), then silence. One daemon forgets
a run after 3 s without a stream (--forget_runs_idle_s=3), the other keeps
the default (a day). After each round and a short wait, a scrape reads the
alert baselines kept, the signal series in /metrics, the runs forgotten and
the resident memory; the ratios between the two daemons after the last round
are the figures to read (the machine is shared and noisy).

    tests/load/forgetting.py build/server/foreshockd build/tests/load/foreshock_load [ROUNDS] [RUNS]
"""
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "tests", "python"), os.path.join(ROOT, "client", "python"), ROOT]
from conftest import Daemon  # noqa: E402
from foreshock import prometheus  # noqa: E402

binary, load = sys.argv[1], sys.argv[2]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 6
runs = int(sys.argv[4]) if len(sys.argv) > 4 else 8


def gauge(samples, name):
    return sum(v for n, _, v in samples if n == name)


def measure(forget_s):
    daemon = Daemon(binary, tempfile.mkdtemp(prefix="forget."),
                    ["--workers=1", f"--forget_runs_idle_s={forget_s}"]).start()
    rows = []
    try:
        for r in range(rounds):
            subprocess.run([load, f"--target={daemon.endpoint}", f"--runs={runs}",
                            "--ranks_per_run=2", "--layers_per_rank=2", "--duration_s=6",
                            "--steps_per_s=10", "--probe_every=10",
                            f"--run_prefix=round{r}-"],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=300)
            time.sleep(5)  # past the 3 s forgetting period and a sweep
            samples = daemon.scrape()
            rss_kb = int(open(f"/proc/{daemon.process.pid}/status").read()
                         .split("VmRSS:")[1].split()[0])
            rows.append((r + 1, gauge(samples, "foreshock_alert_baseline_series"),
                         gauge(samples, "foreshock_metrics_signal_series"),
                         gauge(samples, "foreshock_runs_forgotten_total"), rss_kb / 1024))
    finally:
        daemon.stop()
    return rows


results = {}
for label, forget_s in (("forgets after 3 s", 3), ("default (a day)", 86400)):
    results[label] = measure(forget_s)
    print(f"\n{label}: {runs} runs per round")
    print("| rounds | alert baseline series | /metrics signal series | runs forgotten | RSS MiB |")
    print("|---|---|---|---|---|")
    for row in results[label]:
        print("| {} | {:.0f} | {:.0f} | {:.0f} | {:.1f} |".format(*row))
forget, keep = results["forgets after 3 s"][-1], results["default (a day)"][-1]
print(f"\nafter {rounds} rounds, forgetting / default: baselines {forget[1]:.0f} / {keep[1]:.0f}, "
      f"signal series {forget[2]:.0f} / {keep[2]:.0f}, RSS {forget[4] / keep[4]:.2f}")
