#!/usr/bin/python3
"""Peak RSS during detector checkpoints against the steady state
(docs/PERFORMANCE.md#memory-under-a-probe-flood): a daemon with LAYERS x 4 MiB
of QK state, a checkpoint every second; prints the least RSS over 2 s and
VmHWM over the next three checkpoints.

    tests/load/checkpoint_memory.py build/server/foreshockd 48
"""
import os, sys, time, tempfile, subprocess, socket
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "tests", "python"), os.path.join(ROOT, "client", "python"), ROOT]
import test_memory_bound as t
from conftest import Daemon, wait_until
binary, layers = sys.argv[1], int(sys.argv[2])
tmp = tempfile.mkdtemp(prefix="ckpt.")
d = Daemon(binary, tmp, ["--checkpoint_interval_s=1", "--workers=2"]).start()
heads, tokens, head_dim = 128, 32, 256
for chunk in range(0, layers, 24):
    t._stream(d.endpoint, "ckpt", [[t._qk_record(1, l, heads, tokens, head_dim, seed=2*l)] for l in range(chunk, min(layers, chunk+24))], heads=heads)
state = layers * 2 * heads * tokens * head_dim * 2
ck = os.path.join(tmp, "data", "checkpoints", "detectors.ckpt")
size = lambda: os.path.exists(ck) and os.stat(ck).st_size or 0
assert wait_until(lambda: size() >= state, timeout_s=120)
pid = d.process.pid
samples = []
for _ in range(100):
    samples.append(t._status_kb(pid, "VmRSS")); time.sleep(0.02)
steady = min(samples)
open(f"/proc/{pid}/clear_refs", "w").write("5")
t0 = time.monotonic()
for _ in range(3):
    before = os.stat(ck).st_mtime_ns
    wait_until(lambda: os.stat(ck).st_mtime_ns != before and size() >= state, timeout_s=60, interval_s=0.05)
peak = t._status_kb(pid, "VmHWM")
print(f"{binary}: state {state>>20} MiB, checkpoint file {size()>>20} MiB, steady RSS {steady>>10} MiB, peak over 3 checkpoints {peak>>10} MiB, ratio {peak/steady:.2f}")
d.stop()
