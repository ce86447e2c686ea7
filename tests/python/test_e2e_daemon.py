"""End to end: the real foreshockd, the real client, a real (short) torch training.

The QK signals the daemon exports are checked against a direct numpy
computation (tests/python/qk_reference.py) from the very bytes the client sent,
kept by the monitor's `tap`.
"""
import collections
import math
import signal

import numpy as np

from conftest import wait_until
from demo import train
from foreshock import ModelInfo, Monitor, encoding, prometheus
from foreshock.sender import RecordQueue, Sender
from foreshock.v1 import ingest_pb2 as pb
from qk_reference import AGGREGATION, layer_signals

RUN = "e2e"
STEPS, EVERY = 41, 10  # probes at steps 0, 10, 20, 30, 40


def qk_samples_by_layer(records):
    """{layer: [(step, q, k, causal, seq_len)]} decoded from the sent bytes, in send order."""
    by_layer = collections.defaultdict(list)
    for record in records:
        if record.WhichOneof("payload") == "qk":
            s = record.qk
            by_layer[s.layer].append((record.step, encoding.decode_tensor(s.q),
                                      encoding.decode_tensor(s.k), s.causal, s.seq_len))
    return by_layer


def close(actual, expected, rtol=1e-4, atol=1e-5):
    return actual is not None and math.isclose(actual, expected, rel_tol=rtol, abs_tol=atol)


def test_training_run_signals_match_numpy_from_the_sent_bytes(foreshockd):
    sent = []
    args = train.parse_args(["--endpoint", foreshockd.endpoint, "--run-id", RUN,
                             "--steps", str(STEPS), "--every", str(EVERY), "--warmup", "10",
                             "--log-every", "0"])
    result = train.run(args, tap=sent.append, out=lambda *_: None)

    stats = result["stats"]
    assert stats["enqueued"] == len(sent) and stats["dropped_queue_full"] == 0
    assert stats["acked_records"] == stats["sent"] == len(sent), stats
    assert stats["rejected"] == {} and stats["resent"] == 0

    by_layer = qk_samples_by_layer(sent)
    assert sorted(by_layer) == [0, 1, 2, 3]
    expected = {}
    for layer, samples in by_layer.items():
        assert [s[0] for s in samples] == list(range(0, STEPS, EVERY))
        (_, q0, k0, _, _), (_, q1, k1, causal, seq_len) = samples[-2:]
        assert q1.shape == (4, 4 * 64, 16) and causal and seq_len == 64
        expected[layer] = layer_signals(q0, k0, q1, k1, causal, seq_len)
    last_scalars = [r for r in sent if r.WhichOneof("payload") == "scalars"][-1]
    assert last_scalars.step == STEPS - 1

    def mismatches(samples):
        bad = []
        for name in AGGREGATION:
            got = prometheus.by_layer(samples, f"foreshock_{name}", RUN)
            for layer, want in expected.items():
                if not close(got.get(layer), want[name]):
                    bad.append(f"{name}[layer {layer}]: daemon {got.get(layer)}, "
                               f"numpy {want[name]:.6g}")
        for name, want in (("loss", last_scalars.scalars.loss),
                           ("grad_norm", last_scalars.scalars.grad_norm),
                           ("last_step", STEPS - 1)):
            got = prometheus.value(samples, f"foreshock_{name}", run=RUN)
            if not close(got, want, rtol=1e-6, atol=0):
                bad.append(f"{name}: daemon {got}, sent {want}")
        return bad

    # The daemon computes asynchronously: poll until the last increment shows.
    samples, _ = foreshockd.wait_for(lambda s: not mismatches(s), timeout_s=30)
    assert not mismatches(samples), "\n".join(mismatches(samples)) + "\n" + foreshockd.log_tail()

    # The daemon counted exactly what this run sent, by kind.
    kinds = collections.Counter(r.WhichOneof("payload") for r in sent)
    for kind, count in kinds.items():
        assert prometheus.value(samples, "foreshock_ingest_records_total", kind=kind) == count


def test_client_reconnects_after_the_daemon_is_killed_and_restarted(foreshockd):
    monitor = Monitor(foreshockd.endpoint, run_id="restart", job="e2e",
                      model_info=ModelInfo(n_layers=1, n_heads=1, head_dim=1),
                      backoff_initial_s=0.05, backoff_max_s=0.5)
    try:
        for step in range(5):
            monitor.step(step, loss=1.0 + step)
        assert wait_until(lambda: monitor.stats()["acked_records"] == 5)
        foreshockd.stop(signal.SIGKILL)  # a crash: no goodbye on the stream
        # Records taken before the client notices would be lost in flight; wait.
        assert wait_until(lambda: not monitor.stats()["connected"])
        for step in range(5, 10):
            monitor.step(step, loss=1.0 + step)  # queued while the daemon is down
        foreshockd.start()
        monitor.step(10, loss=11.0)
        samples, ok = foreshockd.wait_for(
            lambda s: prometheus.value(s, "foreshock_last_step", run="restart") == 10)
        assert ok, foreshockd.log_tail()
        assert prometheus.value(samples, "foreshock_loss", run="restart") == 11.0
    finally:
        monitor.close(timeout=5)
    stats = monitor.stats()
    assert stats["reconnects"] >= 1 and stats["connected"] is False
    assert stats["resent"] == 0
    assert stats["acked_records"] == stats["enqueued"] == 11


def test_invalid_record_is_rejected_with_a_reason_the_daemon_also_counts(foreshockd):
    good = np.zeros((2, 8, 4), dtype=np.float32)
    tensor = pb.Tensor(dtype=pb.FLOAT32, shape=[2, 8, 4], data=good.tobytes())
    bad = pb.Tensor(dtype=pb.FLOAT32, shape=[2, 8, 4], data=good.tobytes()[:-4])  # short
    queue = RecordQueue(10, 1 << 20)
    for step, k in ((0, tensor), (1, bad)):
        record = pb.Record(step=step)
        record.qk.CopyFrom(pb.QKSample(layer=0, probe_id="p", q=tensor, k=k, causal=True))
        queue.put_nowait(record, record.ByteSize())
    sender = Sender(foreshockd.endpoint, pb.Hello(run_id="reject", job="e2e"), queue)
    sender.start()
    sender.close(timeout=10)
    stats = sender.stats()
    assert stats["acked_records"] == 1 and sum(stats["rejected"].values()) == 1, stats
    (reason,) = stats["rejected"]
    samples, ok = foreshockd.wait_for(
        lambda s: prometheus.value(s, "foreshock_ingest_rejected_total", reason=reason) == 1)
    assert ok, f"foreshock_ingest_rejected_total{{reason={reason!r}}} is not 1"
