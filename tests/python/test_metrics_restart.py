"""Per-run gauges across a daemon restart (issue 17): a run that does not
stream again keeps, on /metrics, every gauge it had before the restart with
the same value (signal gauges re-exported from the store, run_info and
last_step from the store, foreshock_alert_active from the alert checkpoint),
so that dashboards and the firing alerts they show stay consistent. Its
counters start again from 0, as every Prometheus counter does after a restart.
"""
import math
import re
import signal

import grpc
import numpy as np

from conftest import Daemon, foreshockd_binary
from foreshock import prometheus
from foreshock.v1 import ingest_pb2 as pb
from foreshock.v1 import ingest_pb2_grpc

RUN = "kept"
HEADS, TOKENS, DIM = 2, 8, 4


def qk(step, layer):
    n = HEADS * TOKENS * DIM
    values = np.sin(np.arange(n) * 0.37 + step + 3 * layer).astype("<f4")
    record = pb.Record(step=step)
    record.qk.layer = layer
    record.qk.causal = True
    record.qk.seq_len = TOKENS
    for tensor, data in ((record.qk.q, values), (record.qk.k, values[::-1].copy())):
        tensor.dtype = pb.FLOAT32
        tensor.shape.extend([HEADS, TOKENS, DIM])
        tensor.data = data.tobytes()
    return record


def scalars(step, loss):
    record = pb.Record(step=step)
    record.scalars.loss = loss
    record.scalars.grad_norm = 1.0
    return record


def send(endpoint, records, run=RUN, goodbye=False):
    hello = pb.Hello(run_id=run, job="restart",
                     model=pb.ModelInfo(n_layers=2, n_heads=HEADS, head_dim=DIM))
    requests = [pb.StreamRequest(hello=hello), pb.StreamRequest(batch=pb.Batch(
        seq=1, records=records, goodbye=pb.Goodbye() if goodbye else None))]
    with grpc.insecure_channel(endpoint) as channel:
        responses = list(ingest_pb2_grpc.IngestStub(channel).Stream(iter(requests), timeout=30))
    acks = [r.ack for r in responses if r.HasField("ack")]
    assert len(acks) == 1 and acks[0].accepted == len(records), responses


def run_series(daemon):
    """{(name, labels): value} of the run's series, and the type of each family."""
    text = daemon.metrics_text()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    series = {(name, tuple(sorted(labels.items()))): value
              for name, labels, value in prometheus.parse(text) if labels.get("run") == RUN}
    return series, types


def same(a, b):
    return a == b or (math.isnan(a) and math.isnan(b))


def test_a_restored_run_keeps_its_gauges_and_firing_alerts(tmp_path):
    daemon = Daemon(foreshockd_binary(), str(tmp_path),
                    [f"--data_dir={tmp_path / 'data'}", "--workers=2", "--per_head_metrics"])
    daemon.start()
    try:
        records = [qk(0, 0), qk(0, 1)] + [scalars(s, 2.0 + 0.001 * s) for s in range(10)]
        records += [qk(10, 0), qk(10, 1), scalars(10, float("nan"))]  # ForeshockNonFinite fires
        send(daemon.endpoint, records)
        samples, ok = daemon.wait_for(lambda s: prometheus.value(
            s, "foreshock_alert_active", alertname="ForeshockNonFinite", run=RUN) == 1
            and prometheus.value(s, "foreshock_last_step", run=RUN) == 10)
        assert ok, daemon.log_tail()
        before, types = run_series(daemon)
        gauges = {k: v for k, v in before.items() if types[k[0]] == "gauge"}
        names = {name for name, _ in gauges}
        # The scenario covers every kind of per-run gauge.
        assert {"foreshock_run_info", "foreshock_last_step", "foreshock_alert_active",
                "foreshock_loss", "foreshock_qk_increment_entropy"} <= names, sorted(names)
        assert any(("head", "1") in labels for _, labels in gauges), "no per-head series"
        assert sum(1 for name, _ in gauges if name == "foreshock_qk_increment_entropy") == 2 + 2 * HEADS

        daemon.stop(signal.SIGTERM)  # a clean stop checkpoints the alert engine
        daemon.start()
        after, _ = run_series(daemon)  # no stream since the restart
        signals = sum(1 for name, _ in gauges if name not in
                      ("foreshock_run_info", "foreshock_last_step", "foreshock_alert_active",
                       "foreshock_run_state_bytes"))
        assert f"restored {signals} signal gauge(s) from the store" in open(daemon.log_path).read()
        after_gauges = {k: v for k, v in after.items() if types.get(k[0]) == "gauge"}
        lost = sorted(set(gauges) - set(after_gauges))
        extra = sorted(set(after_gauges) - set(gauges))
        assert not lost and not extra, f"lost {lost}, extra {extra}"
        changed = [(k, gauges[k], after_gauges[k]) for k in gauges
                   if not same(gauges[k], after_gauges[k])]
        assert not changed, changed
        # Counters are this process's: the run's start again at 0.
        assert before[("foreshock_nonfinite_values_total", (("kind", "scalars"), ("run", RUN)))] == 1
        assert after[("foreshock_nonfinite_values_total", (("kind", "scalars"), ("run", RUN)))] == 0

        # A run that streams again overwrites its restored gauges.
        send(daemon.endpoint, [scalars(11, 3.5)])
        _, ok = daemon.wait_for(lambda s: prometheus.value(s, "foreshock_loss", run=RUN) == 3.5
                                and prometheus.value(s, "foreshock_last_step", run=RUN) == 11)
        assert ok, daemon.log_tail()
    finally:
        daemon.stop()


def test_a_resolved_alert_keeps_its_gauge_at_zero_after_a_restart(tmp_path):
    # The gauge of an alert that resolved before the restart read 0; after it,
    # it still reads 0 (not absent: a panel or rule on it sees no gap).
    daemon = Daemon(foreshockd_binary(), str(tmp_path), [f"--data_dir={tmp_path / 'data'}"])
    daemon.start()
    try:
        send(daemon.endpoint, [scalars(s, 2.0) for s in range(5)] + [scalars(5, float("nan"))],
             run="ended")
        _, ok = daemon.wait_for(lambda s: prometheus.value(
            s, "foreshock_alert_active", alertname="ForeshockNonFinite", run="ended") == 1)
        assert ok, daemon.log_tail()
        send(daemon.endpoint, [scalars(6, 2.0)], run="ended", goodbye=True)  # the run ends
        _, ok = daemon.wait_for(lambda s: prometheus.value(
            s, "foreshock_alert_active", alertname="ForeshockNonFinite", run="ended") == 0)
        assert ok, daemon.log_tail()
        daemon.stop(signal.SIGTERM)
        daemon.start()
        samples = prometheus.parse(daemon.metrics_text())
        assert prometheus.value(samples, "foreshock_alert_active", alertname="ForeshockNonFinite",
                                run="ended") == 0, daemon.metrics_text()
    finally:
        daemon.stop()
