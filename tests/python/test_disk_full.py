"""A full disk never costs an acknowledged record (issue 16, finding 1).

Reproduces the finding on a real, small tmpfs as --data_dir with
--fsync=every: many streams of scalar records fill it. Before the fix every
Ack said "accepted" while most points were never stored, and the daemon would
not start again on the full directory. Now:
  - a batch the store cannot write is refused (RESOURCE_EXHAUSTED disk_full,
    retry-after-ms), counted, and never acked; clients keep and resend it;
  - every record a client saw acked is stored;
  - the daemon restarts on the full disk and serves what it has;
  - once space returns (the tmpfs is grown), ingest resumes by itself and
    every record ends up stored exactly once.
Needs root to mount the tmpfs (CI runs as root).
"""
import collections
import os
import signal
import subprocess
import threading
import time

import grpc
import pytest

from conftest import Daemon, foreshockd_binary, wait_until
from foreshock.sender import RecordQueue, Sender
from foreshock.v1 import ingest_pb2 as pb
from foreshock.v1 import query_pb2, query_pb2_grpc

N_CLIENTS = 10
RECORDS = 5000


@pytest.fixture
def small_tmpfs(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip("mounting a tmpfs needs root: " + result.stderr.strip())
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def loss_of(rank, step):
    return rank * 100000.0 + step


class Client:
    def __init__(self, endpoint, rank):
        self.rank = rank
        self.run = f"full-{rank}"
        self.queue = RecordQueue(1 << 16, 64 << 20)
        self.lock = threading.Lock()
        self.acked = collections.Counter()
        self.sender = Sender(endpoint, pb.Hello(run_id=self.run, job="disk", rank=rank),
                             self.queue, max_batch_bytes=1024, backoff_initial_s=0.05,
                             backoff_max_s=0.5, on_settled=self.on_settled)

    def on_settled(self, records, ack):
        assert not ack.rejections, ack
        with self.lock:
            for record in records:
                self.acked[record.step] += 1

    def enqueue_all(self):
        for step in range(RECORDS):
            record = pb.Record(step=step, scalars=pb.StepScalars(
                loss=loss_of(self.rank, step), grad_norm=1.0, lr=1e-3))
            assert self.queue.put_nowait(record, record.ByteSize())

    def acked_steps(self):
        with self.lock:
            return set(self.acked)


def stored_loss(daemon, run):
    with grpc.insecure_channel(daemon.endpoint) as channel:
        query = query_pb2_grpc.QueryStub(channel)
        try:
            response = query.GetSeries(query_pb2.GetSeriesRequest(
                run=run, signal="loss", layer=-1, head=-1), timeout=30)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return []
            raise
        return [(p.step, p.value) for p in response.points]


def rejected(samples, reason):
    return sum(value for name, labels, value in samples
               if name == "foreshock_ingest_rejected_total" and labels.get("reason") == reason)


def check_acked_are_stored(daemon, clients):
    for client in clients:
        acked = client.acked_steps()
        stored = dict(stored_loss(daemon, client.run))
        missing = acked - set(stored)
        assert not missing, f"{client.run}: {len(missing)} acked records not stored, e.g. " \
                            f"{sorted(missing)[:5]}"
        assert all(stored[s] == loss_of(client.rank, s) for s in acked)


def test_full_disk_refuses_instead_of_losing_and_resumes(small_tmpfs, tmp_path):
    data_dir = small_tmpfs / "data"
    daemon = Daemon(foreshockd_binary(), str(tmp_path),
                    ["--workers=2", "--fsync=every", "--segment_mb=1", f"--data_dir={data_dir}"])
    daemon.start()
    clients = [Client(daemon.endpoint, rank) for rank in range(N_CLIENTS)]
    try:
        for client in clients:
            client.enqueue_all()
            client.sender.start()
        # The disk fills: refusals are counted, and acks stop short of the total.
        samples, full = daemon.wait_for(lambda s: rejected(s, "disk_full") > 0, timeout_s=120)
        assert full, "the tmpfs never filled:\n" + daemon.log_tail()
        time.sleep(2.0)
        total_acked = sum(len(c.acked_steps()) for c in clients)
        assert total_acked < N_CLIENTS * RECORDS, "everything was acked on a full disk"
        check_acked_are_stored(daemon, clients)
        assert "disk_full" in daemon.log_tail(20000)

        # A restart on the full disk: it starts and serves what it holds.
        daemon.stop(sig=signal.SIGTERM)
        daemon.start()
        check_acked_are_stored(daemon, clients)

        # Space returns: ingest resumes by itself and every record is stored once.
        subprocess.run(["mount", "-o", "remount,size=64m", str(small_tmpfs)], check=True)
        assert wait_until(lambda: all(len(c.acked_steps()) == RECORDS for c in clients),
                          timeout_s=180, interval_s=0.5), \
            [len(c.acked_steps()) for c in clients]
        for client in clients:
            steps = [s for s, _ in stored_loss(daemon, client.run)]
            doubled = [s for s, n in collections.Counter(steps).items() if n > 1]
            assert not doubled, f"{client.run}: stored twice: {doubled[:10]}"
            assert sorted(steps) == list(range(RECORDS))
    finally:
        for client in clients:
            client.sender.close(timeout=30)
        daemon.stop()
    for client in clients:
        stats = client.sender.stats()
        assert stats["dropped_unacked"] == 0 and stats["unsent_at_close"] == 0, stats
