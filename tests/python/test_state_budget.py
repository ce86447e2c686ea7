"""The per-run detector state budget (--max_state_mb_per_run, issue 27)
against a real foreshockd over loopback: a run whose probes would grow its
retained detector state past the budget gets them refused in the Ack
(state_limit) while its scalars still get through, another run's probes are
accepted and its alerts fire, the state is freed when the run ends, and a
restart counts the restored state again instead of starting from zero."""
import random
import signal

import grpc
import numpy as np

from conftest import wait_until
from foreshock import prometheus
from foreshock.v1 import ingest_pb2, ingest_pb2_grpc

HEADS, TOKENS, HEAD_DIM = 8, 64, 64
# q and k of one layer in bf16: 128 KiB, so a 1 MiB budget holds 7 layers
# (with the per-head direction and overhead the daemon counts on top).
LAYER_BYTES = 2 * HEADS * TOKENS * HEAD_DIM * 2
BUDGET_MB = 1


def _bf16(shape, seed, nan=False):
    values = np.random.default_rng(seed).standard_normal(int(np.prod(shape)), dtype=np.float32)
    if nan:
        values[3] = np.nan
    return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def qk(step, layer, tokens=TOKENS, seed=0, nan=False, heads=HEADS, head_dim=HEAD_DIM,
       probe_id="p0"):
    shape = [heads, tokens, head_dim]
    record = ingest_pb2.Record(step=step)
    record.qk.layer = layer
    record.qk.probe_id = probe_id
    record.qk.causal = True
    for tensor, s in ((record.qk.q, seed), (record.qk.k, seed + 1)):
        tensor.dtype = ingest_pb2.BFLOAT16
        tensor.shape.extend(shape)
        tensor.data = _bf16(shape, s, nan=nan and tensor is record.qk.q)
    return record


def scalars(step, loss=2.0):
    record = ingest_pb2.Record(step=step)
    record.scalars.loss = loss
    return record


def stream(endpoint, run, batches, sender_id, first_seq=1, goodbye=False, heads=HEADS):
    """One stream: a Hello (sender_id, first_seq) and `batches` (lists of
    Records) numbered from first_seq, optionally a goodbye batch; the Acks."""
    def requests():
        yield ingest_pb2.StreamRequest(hello=ingest_pb2.Hello(
            run_id=run, job="state-budget", first_seq=first_seq, sender_id=sender_id,
            model=ingest_pb2.ModelInfo(n_heads=heads, n_layers=64)))
        seq = first_seq
        for records in batches:
            yield ingest_pb2.StreamRequest(batch=ingest_pb2.Batch(seq=seq, records=records))
            seq += 1
        if goodbye:
            yield ingest_pb2.StreamRequest(batch=ingest_pb2.Batch(seq=seq, goodbye=ingest_pb2.Goodbye()))

    with grpc.insecure_channel(endpoint) as channel:
        return [r.ack for r in ingest_pb2_grpc.IngestStub(channel).Stream(requests(), timeout=60)
                if r.HasField("ack")]


def refused(ack, index):
    return [r.reason for r in ack.rejections if r.index == index]


def state_bytes(daemon, run):
    return prometheus.value(daemon.scrape(), "foreshock_run_state_bytes", run=run)


def test_a_run_over_its_state_budget_loses_new_probes_only_and_other_runs_go_on(
        start_foreshockd):
    daemon = start_foreshockd(f"--max_state_mb_per_run={BUDGET_MB}", "--checkpoint_interval_s=0")
    sender = random.getrandbits(63)
    # Each batch: a step's scalars and a QK probe of one more layer.
    acks = stream(daemon.endpoint, "greedy",
                  [[scalars(layer + 1), qk(layer + 1, layer, seed=layer)] for layer in range(16)],
                  sender)
    assert len(acks) == 16
    # Every scalar record was accepted; probes until the budget, none after.
    assert all(not refused(ack, 0) for ack in acks), acks
    accepted_layers = [layer for layer, ack in enumerate(acks) if ack.accepted == 2]
    held = len(accepted_layers)
    assert accepted_layers == list(range(held)) and 4 <= held <= 7, acks
    for ack in acks[held:]:
        assert ack.accepted == 1, ack
        (reason,) = refused(ack, 1)
        assert reason.startswith("state_limit: run 'greedy' holds"), reason
        assert "--max_state_mb_per_run" in reason, reason
    greedy_bytes = state_bytes(daemon, "greedy")
    assert held * LAYER_BYTES <= greedy_bytes <= BUDGET_MB << 20, greedy_bytes

    # At its budget the run still sends what replaces its state (the same
    # layers, same shape), but not a larger shape of a layer it holds.
    # A small probe with a NaN is accepted and dropped by the detector, which
    # keeps the layer's larger state: it must not make room for a new layer.
    acks = stream(daemon.endpoint, "greedy",
                  [[qk(20, 0, seed=50)], [qk(21, 1, seed=51)], [qk(22, 0, tokens=2 * TOKENS)],
                   [scalars(23)], [qk(24, 2, tokens=8, nan=True)], [qk(25, 16, seed=52)]],
                  sender, first_seq=17)
    assert [a.accepted for a in acks] == [1, 1, 0, 1, 1, 0], acks
    assert refused(acks[2], 0)[0].startswith("state_limit:"), acks[2]
    assert refused(acks[5], 0)[0].startswith("state_limit:"), acks[5]
    assert state_bytes(daemon, "greedy") == greedy_bytes

    # Another run: all its probes accepted, and a NaN in one fires its alert.
    good = [[qk(step, layer, seed=100 * step + layer) for layer in range(4)]
            for step in (1, 2)]
    good.append([scalars(3), qk(3, 0, seed=300, nan=True)])
    acks = stream(daemon.endpoint, "good", good, random.getrandbits(63))
    assert [a.accepted for a in acks] == [4, 4, 2], acks
    assert all(not a.rejections for a in acks), acks
    samples, fired = daemon.wait_for(lambda s: prometheus.value(
        s, "foreshock_alert_active", alertname="ForeshockNonFinite", run="good") == 1)
    assert fired, daemon.log_tail()
    assert prometheus.value(samples, "foreshock_run_state_bytes", run="good") >= 4 * LAYER_BYTES
    rejected = prometheus.value(samples, "foreshock_ingest_rejected_total", reason="state_limit")
    assert rejected == 16 - held + 2, rejected

    # The end of the run frees its state, and the gauge goes with it.
    stream(daemon.endpoint, "greedy", [], sender, first_seq=23, goodbye=True)
    assert wait_until(lambda: state_bytes(daemon, "greedy") is None, timeout_s=20), \
        daemon.log_tail()
    assert state_bytes(daemon, "good") >= 4 * LAYER_BYTES


def test_a_restart_counts_the_restored_state_against_the_budget(start_foreshockd):
    daemon = start_foreshockd(f"--max_state_mb_per_run={BUDGET_MB}", "--checkpoint_interval_s=0")
    sender = random.getrandbits(63)
    acks = stream(daemon.endpoint, "persist",
                  [[qk(1, layer, seed=layer)] for layer in range(10)], sender)
    held = sum(a.accepted for a in acks)
    assert 4 <= held <= 7 and all(a.accepted == 0 for a in acks[held:]), acks
    before = state_bytes(daemon, "persist")
    assert held * LAYER_BYTES <= before <= BUDGET_MB << 20, before

    # The shutdown checkpoint holds the detector state; the restarted daemon
    # counts it again (the same sender reconnects: no new attempt).
    daemon.stop(signal.SIGTERM)
    daemon.start()
    assert state_bytes(daemon, "persist") == before, daemon.log_tail()
    acks = stream(daemon.endpoint, "persist",
                  [[qk(2, 10, seed=10)], [qk(2, 0, seed=20)], [scalars(2)]], sender,
                  first_seq=11)
    assert [a.accepted for a in acks] == [0, 1, 1], acks
    assert refused(acks[0], 0)[0].startswith("state_limit:"), acks[0]
