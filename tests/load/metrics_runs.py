#!/usr/bin/python3
"""/metrics size and scrape time over many runs (docs/PERFORMANCE.md#metrics-cardinality):
RUNS runs, each a Hello with 1,024 layers and a curvature sample with 1,024
layer_rayleigh values plus a step's scalars, against a daemon with default
flags; ten scrapes.

    tests/load/metrics_runs.py build/server/foreshockd 200
"""
import os, sys, time, statistics, tempfile, urllib.request
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "tests", "python"), os.path.join(ROOT, "client", "python"), ROOT]
import grpc
from conftest import Daemon, wait_until
from foreshock.v1 import ingest_pb2 as pb, ingest_pb2_grpc as pbg
binary, runs = sys.argv[1], int(sys.argv[2])
d = Daemon(binary, tempfile.mkdtemp(prefix="mruns."), []).start()
def reqs(run):
    yield pb.StreamRequest(hello=pb.Hello(run_id=run, job="m", model=pb.ModelInfo(n_layers=1024, n_heads=8)))
    yield pb.StreamRequest(batch=pb.Batch(seq=1, records=[
        pb.Record(step=10, curvature=pb.CurvatureSample(lambda_max=10.0, residual=0.01, hvps=20,
                  preconditioned=True, lr=1e-3, beta1=0.9, overlap=0.9, layer_rayleigh=[0.5] * 1024)),
        pb.Record(step=10, scalars=pb.StepScalars(loss=2.0, grad_norm=1.0, lr=1e-3))]))
with grpc.insecure_channel(d.endpoint) as ch:
    stub = pbg.IngestStub(ch)
    for r in range(runs):
        acks = [x for x in stub.Stream(reqs(f"run-{r:04d}"), timeout=30) if x.HasField("ack")]
        assert acks[0].ack.accepted == 2, acks
def processed():
    for line in d.metrics_text().splitlines():
        if line.startswith('foreshock_samples_processed_total{kind="curvature"}'):
            return float(line.split()[-1]) >= runs
wait_until(processed, timeout_s=120, interval_s=0.5)
times, size, series = [], 0, 0
for _ in range(10):
    t0 = time.monotonic()
    body = urllib.request.urlopen(d.metrics_url, timeout=30).read()
    times.append(time.monotonic() - t0)
    size = len(body); series = sum(1 for l in body.splitlines() if l and not l.startswith(b"#"))
text = body.decode()
extra = [l for l in text.splitlines() if l.startswith("foreshock_metrics_")]
print(f"{binary}: runs {runs}: /metrics {size/1e6:.2f} MB, {series} samples, scrape median {statistics.median(times)*1000:.0f} ms max {max(times)*1000:.0f} ms, RSS {open(f'/proc/{d.process.pid}/status').read().split('VmRSS:')[1].split()[0]} kB {extra}")
d.stop()
