#!/usr/bin/python3
"""/metrics size and scrape time for one maximal run: a run at every limit.

Starts a foreshockd, sends one run whose Hello declares --max_layers layers
(all MoE), two QK probes and two router probes of every layer (so that the
increment and flip signals exist too), a curvature sample with one
layer_rayleigh value per layer and a step's scalars, then scrapes /metrics
--scrapes times and prints a JSON report: series and bytes of /metrics, scrape
time (median and max), and the daemon's resident memory before and after.

    tests/load/metrics_cardinality.py --foreshockd build/server/foreshockd
    tests/load/metrics_cardinality.py --foreshockd build/server/foreshockd \
        --heads 256 --daemon_args=--per_head_metrics

Without --per_head_metrics /metrics carries the per-layer series, so the
maximum is reached with few heads (the per-head series still count toward
--max_series_per_run in the store). With it, --max_series_per_run bounds what
one run can export.
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
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
sys.path.insert(0, ROOT)
import generate_stubs  # noqa: E402

generate_stubs.ensure()

import grpc  # noqa: E402
import numpy as np  # noqa: E402

from foreshock.v1 import ingest_pb2 as pb  # noqa: E402
from foreshock.v1 import ingest_pb2_grpc as pb_grpc  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


def tensor(rng, shape):
    return pb.Tensor(dtype=pb.FLOAT32, shape=list(shape),
                     data=rng.standard_normal(shape).astype(np.float32).tobytes())


def batches(args, rng):
    """Batches of about 4 MB: every layer's QK and router probes, twice, then the rest."""
    records = []
    for step in (100, 200):
        for layer in range(args.layers):
            q = tensor(rng, (args.heads, args.tokens, args.head_dim))
            k = tensor(rng, (args.heads, args.tokens, args.head_dim))
            records.append(pb.Record(step=step, qk=pb.QKSample(layer=layer, probe_id="p", q=q, k=k,
                                                               causal=True)))
            records.append(pb.Record(step=step, router=pb.RouterSample(
                layer=layer, probe_id="p", top_k=2,
                logits=tensor(rng, (args.tokens, args.experts)))))
    records.append(pb.Record(step=200, curvature=pb.CurvatureSample(
        lambda_max=10.0, residual=0.01, hvps=20, preconditioned=True, lr=1e-3, beta1=0.9,
        overlap=0.9, layer_rayleigh=[0.5] * args.layers)))
    records.append(pb.Record(step=200, scalars=pb.StepScalars(loss=2.0, grad_norm=1.0, lr=1e-3)))
    batch, size = [], 0
    for record in records:
        batch.append(record)
        size += record.ByteSize()
        if size > 4 << 20:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--foreshockd", default=os.path.join(ROOT, "build", "server", "foreshockd"))
    parser.add_argument("--layers", type=int, default=1024, help="n_layers (--max_layers)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head_dim", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--experts", type=int, default=1024, help="n_experts (--max_experts)")
    parser.add_argument("--scrapes", type=int, default=10)
    parser.add_argument("--daemon_args", action="append", default=[])
    args = parser.parse_args()

    grpc_port, http_port = free_port(), free_port()
    with tempfile.TemporaryDirectory() as tmp:
        log = open(os.path.join(tmp, "foreshockd.log"), "wb")
        daemon = subprocess.Popen(
            [args.foreshockd, f"--listen=127.0.0.1:{grpc_port}",
             f"--metrics_listen=127.0.0.1:{http_port}", f"--data_dir={tmp}/data",
             *args.daemon_args], stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{http_port}/metrics"
        try:
            for _ in range(200):
                try:
                    urllib.request.urlopen(url, timeout=1).read()
                    break
                except OSError:
                    time.sleep(0.05)
            rss_idle = rss_mb(daemon.pid)
            rng = np.random.default_rng(0)
            hello = pb.Hello(run_id="maximal", job="cardinality", model=pb.ModelInfo(
                n_layers=args.layers, n_heads=args.heads, head_dim=args.head_dim,
                n_experts=args.experts, top_k=2, moe_layers=list(range(args.layers))))
            requests = [pb.StreamRequest(hello=hello)] + [
                pb.StreamRequest(batch=pb.Batch(seq=i + 1, records=b))
                for i, b in enumerate(batches(args, rng))]
            sent = time.monotonic()
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=[
                    ("grpc.max_send_message_length", 64 << 20)]) as channel:
                responses = list(pb_grpc.IngestStub(channel).Stream(iter(requests), timeout=600))
            acks = [r.ack for r in responses if r.WhichOneof("kind") == "ack"]
            rejected = sum(len(a.rejections) for a in acks)
            if rejected:
                raise SystemExit(f"{rejected} records rejected: {acks[0].rejections[0].reason}")
            # Wait until every accepted sample went through the detectors.
            accepted = sum(a.accepted for a in acks)
            while True:
                text = urllib.request.urlopen(url, timeout=60).read().decode()
                processed = sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines()
                                if l.startswith("foreshock_samples_processed_total{"))
                if processed >= accepted:
                    break
                time.sleep(0.5)
            ingest_s = time.monotonic() - sent
            times = []
            for _ in range(args.scrapes):
                start = time.monotonic()
                text = urllib.request.urlopen(url, timeout=60).read()
                times.append(time.monotonic() - start)
            lines = [l for l in text.decode().splitlines() if l and not l.startswith("#")]
            families = {}
            for l in lines:
                if 'run="maximal"' in l:
                    name = l.split("{", 1)[0]
                    families[name] = families.get(name, 0) + 1
            report = dict(
                layers=args.layers, heads=args.heads, experts=args.experts,
                daemon_args=args.daemon_args,
                records_accepted=sum(a.accepted for a in acks),
                ingest_and_processing_s=round(ingest_s, 1),
                metrics_series=len(lines),
                run_series=sum(1 for l in lines if 'run="maximal"' in l),
                metrics_bytes=len(text),
                scrape_ms_median=round(1000 * statistics.median(times), 1),
                scrape_ms_max=round(1000 * max(times), 1),
                rss_mb_idle=round(rss_idle, 1),
                rss_mb_after=round(rss_mb(daemon.pid), 1),
                run_series_by_family=dict(sorted(families.items(), key=lambda kv: -kv[1])))
            print(json.dumps(report, indent=1))
        finally:
            daemon.terminate()
            daemon.wait(30)


if __name__ == "__main__":
    main()
