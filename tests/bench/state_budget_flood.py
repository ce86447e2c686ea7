"""One or more runs flood a daemon with QK probes of ever more layers (each a
new piece of retained detector state) while another run probes 4 layers:
who gets through, each run's retained state, and the daemon's peak RSS.
docs/OPERATIONS.md ("Memory") quotes its figures.

  python3 tests/bench/state_budget_flood.py --foreshockd build/server/foreshockd \\
      --max_memory_mb=320 --hostile_runs=1 --layers_per_run=160

Each probe is 16 heads x 256 tokens x d128 in bf16 (q and k: 2 MiB of state);
--layers_per_run beyond 64 go to further probe_ids. Prints one JSON object."""
import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "python"), os.path.join(HERE, "..", "..", "client", "python")]
from conftest import Daemon  # noqa: E402
import test_state_budget as tsb  # noqa: E402

HEADS, TOKENS, HEAD_DIM = 16, 256, 128


def probe(step, i, seed):
    return tsb.qk(step, i % 64, tokens=TOKENS, seed=seed, heads=HEADS, head_dim=HEAD_DIM,
                  probe_id=f"p{i // 64}")


def count(acks, prefix, index=None):
    return sum(1 for a in acks for r in a.rejections
               if r.reason.startswith(prefix) and (index is None or r.index == index))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--foreshockd", required=True)
    parser.add_argument("--max_memory_mb", type=int, default=320)
    parser.add_argument("--hostile_runs", type=int, default=1)
    parser.add_argument("--layers_per_run", type=int, default=160)
    parser.add_argument("--extra_flag", action="append", default=[])
    args = parser.parse_args()
    log_dir = tempfile.mkdtemp(prefix="state-budget-flood-")
    daemon = Daemon(args.foreshockd, log_dir,
                    [f"--max_memory_mb={args.max_memory_mb}", "--checkpoint_interval_s=0",
                     "--workers=2", *args.extra_flag])
    daemon.start()
    pid = daemon.process.pid

    def status_mb(field):
        with open(f"/proc/{pid}/status") as f:
            return int(f.read().split(field + ":")[1].split()[0]) >> 10

    result = {"max_memory_mb": args.max_memory_mb, "idle_rss_mb": status_mb("VmRSS"), "hostile": {}}

    def hostile(i):
        acks = tsb.stream(daemon.endpoint, f"hostile{i}",
                          [[tsb.scalars(l + 1), probe(l + 1, l, l)] for l in range(args.layers_per_run)],
                          random.getrandbits(63), heads=HEADS)
        result["hostile"][f"hostile{i}"] = {
            "probes_accepted": sum(a.accepted for a in acks) - len(acks),
            "state_limit": count(acks, "state_limit"), "memory_limit": count(acks, "memory_limit"),
            "scalars_refused": sum(1 for a in acks for r in a.rejections if r.index == 0)}

    threads = [threading.Thread(target=hostile, args=(i,)) for i in range(args.hostile_runs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    time.sleep(2)
    acks = tsb.stream(daemon.endpoint, "good",
                      [[tsb.scalars(s)] + [probe(s, l, 100 * s + l) for l in range(4)] for s in (1, 2, 3)],
                      random.getrandbits(63), heads=HEADS)
    result["good"] = {"records_accepted": sum(a.accepted for a in acks), "records_sent": 15,
                      "state_limit": count(acks, "state_limit"),
                      "memory_limit": count(acks, "memory_limit")}
    result["run_state_mib"] = {l["run"]: round(v / 2**20, 1) for n, l, v in daemon.scrape()
                               if n == "foreshock_run_state_bytes"}
    result["peak_rss_mb"] = status_mb("VmHWM")
    result["rss_after_mb"] = status_mb("VmRSS")
    daemon.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
