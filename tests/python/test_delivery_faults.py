"""Delivery under daemon crashes: kill -9 and restart foreshockd while several
clients ingest, then check that every record a client saw acknowledged is in
the store exactly once, that no client crashed and that the training loop's
queue never overflowed. (That enqueueing never waits on the network is
tested in test_sender.py by holding the network; its latency is measured by
tests/bench/enqueue_latency.py.)

Clients use the real background sender (foreshock.sender: unacked buffer,
reconnect with backoff, resend with the same seqs) with synthetic step scalars
and small QK samples. The daemon deduplicates resends by (run, rank, seq)
(server/ingest/delivery.h). Bounded: about 30-60 s.
"""
import collections
import random
import signal
import threading
import time

import grpc
import numpy as np

from conftest import Daemon, foreshockd_binary
from foreshock.sender import RecordQueue, Sender
from foreshock.v1 import ingest_pb2 as pb
from foreshock.v1 import query_pb2, query_pb2_grpc

N_CLIENTS = 3
KILL_CYCLES = 12
QK_EVERY = 10
STEP_S = 0.002

_QK = np.random.default_rng(0).standard_normal((2, 8, 4)).astype(np.float32)
_QK_TENSOR = pb.Tensor(dtype=pb.FLOAT32, shape=[2, 8, 4], data=_QK.tobytes())


def loss_of(rank, step):
    return rank * 1000.0 + step * 0.5


class Client:
    """One training rank: a loop that enqueues records, and the sender."""

    def __init__(self, endpoint, rank):
        self.rank = rank
        self.run = f"fault-{rank}"
        self.queue = RecordQueue(1 << 16, 64 << 20)
        self.lock = threading.Lock()
        self.acked = collections.Counter()  # (kind, step) -> acks seen (accepted or duplicate)
        self.sender = Sender(endpoint, pb.Hello(run_id=self.run, job="faults", rank=rank),
                             self.queue, max_batch_bytes=2048, backoff_initial_s=0.05,
                             backoff_max_s=0.5, on_settled=self.on_settled)
        self.stop = threading.Event()
        self.steps = 0
        self.error = None
        self.thread = threading.Thread(target=self.train, name=f"train-{rank}")

    def on_settled(self, records, ack):
        assert not ack.rejections, ack
        with self.lock:
            for record in records:
                self.acked[(record.WhichOneof("payload"), record.step)] += 1

    def train(self):
        try:
            step = 0
            while not self.stop.is_set():
                records = [pb.Record(step=step, scalars=pb.StepScalars(
                    loss=loss_of(self.rank, step), grad_norm=1.0 + step % 7, lr=1e-3))]
                if step % QK_EVERY == 0:
                    records.append(pb.Record(step=step, qk=pb.QKSample(
                        layer=0, probe_id="p", q=_QK_TENSOR, k=_QK_TENSOR, causal=True)))
                for record in records:
                    queued = self.queue.put_nowait(record, record.ByteSize())
                    assert queued, "the record queue overflowed"
                step += 1
                self.steps = step
                time.sleep(STEP_S)
        except Exception as e:  # reported by the test
            self.error = e


def _series(daemon, run):
    with grpc.insecure_channel(daemon.endpoint) as channel:
        query = query_pb2_grpc.QueryStub(channel)
        infos = query.ListSeries(query_pb2.ListSeriesRequest(run=run), timeout=30).series
        out = {}
        for info in infos:
            response = query.GetSeries(query_pb2.GetSeriesRequest(
                run=run, signal=info.signal, layer=info.layer, head=info.head), timeout=30)
            out[(info.signal, info.layer, info.head)] = [(p.step, p.value)
                                                         for p in response.points]
        return out


def test_kill9_restarts_lose_and_duplicate_nothing_acknowledged(tmp_path):
    rng = random.Random(7)
    daemon = Daemon(foreshockd_binary(), str(tmp_path), ["--workers=2", "--fsync=every"])
    daemon.start()
    clients = [Client(daemon.endpoint, rank) for rank in range(N_CLIENTS)]
    try:
        for client in clients:
            client.sender.start()
            client.thread.start()
        for _ in range(KILL_CYCLES):
            time.sleep(rng.uniform(0.3, 1.2))
            daemon.stop(sig=signal.SIGKILL)
            time.sleep(rng.uniform(0.0, 0.3))
            daemon.start()
        time.sleep(1.0)
    finally:
        for client in clients:
            client.stop.set()
        for client in clients:
            client.thread.join(10)
            client.sender.close(timeout=60)
    try:
        for client in clients:
            stats = client.sender.stats()
            assert client.error is None, client.error
            assert client.steps > 100, client.steps
            assert stats["unsent_at_close"] == 0 and stats["dropped_unacked"] == 0, stats
            assert stats["rejected"] == {}, stats
            # Every kill broke the stream; a restart that came back before the
            # client's next attempt is one reconnect, one that was killed again
            # first shows as failed attempts.
            assert stats["reconnects"] >= 1, stats
            assert stats["reconnects"] + stats["failed_connects"] >= KILL_CYCLES, stats

            series = _series(daemon, client.run)
            # Exactly once: no series holds two points of one step.
            for key, points in series.items():
                steps = collections.Counter(step for step, _ in points)
                doubled = [s for s, n in steps.items() if n > 1]
                assert not doubled, f"{client.run} {key}: steps stored twice: {doubled[:10]}"
            with client.lock:
                acked = dict(client.acked)
            scalar_steps = {step for (kind, step) in acked if kind == "scalars"}
            qk_steps = {step for (kind, step) in acked if kind == "qk"}
            # Everything enqueued was acked at close (the daemon ends up running).
            assert scalar_steps == set(range(client.steps)), (
                len(scalar_steps), client.steps)
            loss = dict(series[("loss", -1, -1)])
            assert set(loss) == scalar_steps
            assert all(loss[s] == loss_of(client.rank, s) for s in scalar_steps)
            grad = dict(series[("grad_norm", -1, -1)])
            assert set(grad) == scalar_steps
            qk_series = [dict(points) for (signal_, layer, _), points in series.items()
                         if layer == 0]
            assert qk_series, sorted(series)
            stored_qk = set().union(*(set(p) for p in qk_series))
            assert stored_qk <= qk_steps and len(stored_qk) >= len(qk_steps) - 1
        total = [c.sender.stats() for c in clients]
        print("resent records", sum(s["resent"] for s in total),
              "duplicate records", sum(s["duplicates"] for s in total),
              "steps", [c.steps for c in clients])
    finally:
        daemon.stop()
