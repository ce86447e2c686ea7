"""The durable store end to end (issue 6): a real foreshockd with --data_dir is
killed with SIGKILL in the middle of ingest and restarted on the same
directory. Every point the daemon acknowledged is there afterwards, a torn
tail is cut, detection continues from the checkpoint instead of re-learning,
and a corrupt older segment is reported and skipped while the daemon starts.
"""
import glob
import os
import re
import signal
import threading
import time
import urllib.request

import grpc
import numpy as np

from conftest import Daemon, foreshockd_binary
from foreshock.v1 import ingest_pb2, ingest_pb2_grpc, query_pb2, query_pb2_grpc


def _loss(step, spike_from=None):
    """A healthy loss with a little noise; 10 from `spike_from` on."""
    if spike_from is not None and step >= spike_from:
        return 10.0
    return 2.0 + 0.01 * np.sin(step * 0.7)


def _scalar_batch(seq, steps, spike_from=None):
    batch = ingest_pb2.Batch(seq=seq)
    for step in steps:
        record = batch.records.add(step=step)
        record.scalars.loss = _loss(step, spike_from)
        record.scalars.grad_norm = 1.0
    return batch


class Streamer:
    """Streams scalar batches on one stream and remembers what was acknowledged."""

    def __init__(self, endpoint, run, first_step, steps_per_batch=5, spike_from=None):
        self.endpoint, self.run_id = endpoint, run
        self.next_step, self.per_batch, self.spike_from = first_step, steps_per_batch, spike_from
        self.sent = {}  # seq -> steps
        self.acked_steps = []
        self.error = None
        self.stop = threading.Event()

    def requests(self, n_batches=None):
        yield ingest_pb2.StreamRequest(hello=ingest_pb2.Hello(run_id=self.run_id, job="durability"))
        seq = 0
        while not self.stop.is_set() and (n_batches is None or seq < n_batches):
            seq += 1
            steps = list(range(self.next_step, self.next_step + self.per_batch))
            self.next_step += self.per_batch
            self.sent[seq] = steps
            yield ingest_pb2.StreamRequest(batch=_scalar_batch(seq, steps, self.spike_from))
            time.sleep(0.002)

    def stream(self, n_batches=None):
        try:
            with grpc.insecure_channel(self.endpoint) as channel:
                for response in ingest_pb2_grpc.IngestStub(channel).Stream(
                        self.requests(n_batches), timeout=120):
                    if response.HasField("ack"):
                        assert not response.ack.rejections, response.ack
                        self.acked_steps.extend(self.sent[response.ack.seq])
        except grpc.RpcError as e:  # expected when the daemon is killed
            self.error = e


def _query(daemon):
    channel = grpc.insecure_channel(daemon.endpoint)
    return channel, query_pb2_grpc.QueryStub(channel)


def _loss_points(daemon, run):
    channel, query = _query(daemon)
    with channel:
        response = query.GetSeries(query_pb2.GetSeriesRequest(run=run, signal="loss"), timeout=30)
    return {p.step: p.value for p in response.points}


def _newest_segment(data_dir):
    return sorted(glob.glob(os.path.join(data_dir, "segments", "*.seg")))[-1]


def test_sigkill_mid_ingest_keeps_every_acknowledged_point_and_cuts_the_torn_tail(tmp_path):
    data_dir = str(tmp_path / "data")
    daemon = Daemon(foreshockd_binary(), str(tmp_path),
                    [f"--data_dir={data_dir}", "--fsync=every", "--workers=2"])
    daemon.start()
    streamer = Streamer(daemon.endpoint, "crash", first_step=0)
    thread = threading.Thread(target=streamer.stream)
    thread.start()
    deadline = time.monotonic() + 60
    while len(streamer.acked_steps) < 400 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(streamer.acked_steps) >= 400, "the daemon acknowledged too little"
    daemon.stop(sig=signal.SIGKILL)  # mid-ingest: the streamer is still sending
    streamer.stop.set()
    thread.join(timeout=30)
    acked = list(streamer.acked_steps)

    # A torn write at the tail: half a record's worth of garbage.
    with open(_newest_segment(data_dir), "ab") as segment:
        segment.write(b"\x17\x00\x00\x00\xde\xad\xbe\xef partial record")

    daemon.start()
    log = open(daemon.log_path).read()
    assert re.search(r"truncated a torn tail of (2[3-9]|[3-9][0-9]|[0-9]{3,}) bytes at offset [0-9]+ \(an interrupted write\)", log), log[-3000:]
    points = _loss_points(daemon, "crash")
    missing = [s for s in acked if s not in points]
    assert not missing, f"{len(missing)} acknowledged steps lost after SIGKILL, e.g. {missing[:5]}"
    for step in acked:
        assert points[step] == np.float64(_loss(step)), step  # exact: stored as sent
    # The truncated garbage is gone: the daemon appends after the last good record
    # and everything reads back after a second (clean) restart too.
    daemon.stop()
    daemon.start()
    assert set(acked) <= set(_loss_points(daemon, "crash"))
    daemon.stop()


def test_detection_continues_from_the_checkpoint_after_sigkill(tmp_path):
    """A loss spike right after the restart fires at once: the engine did not start
    over (a fresh one needs 100 warm-up samples before it can alert on the loss)."""
    data_dir = str(tmp_path / "data")
    daemon = Daemon(foreshockd_binary(), str(tmp_path),
                    [f"--data_dir={data_dir}", "--checkpoint_interval_s=1"])
    daemon.start()
    healthy = Streamer(daemon.endpoint, "resume", first_step=0)
    healthy.stream(n_batches=60)  # steps 0..299, all acknowledged
    assert len(healthy.acked_steps) == 300
    time.sleep(2.5)  # at least one checkpoint after the last point
    daemon.stop(sig=signal.SIGKILL)

    daemon.start()
    assert "restored alert state from the checkpoint" in open(daemon.log_path).read()
    spike = Streamer(daemon.endpoint, "resume", first_step=300, steps_per_batch=1, spike_from=300)
    spike.stream(n_batches=8)
    channel, query = _query(daemon)
    with channel:
        alerts = query.ListAlerts(query_pb2.ListAlertsRequest(run="resume"), timeout=30).alerts
    firing = [a for a in alerts if a.alertname == "ForeshockLossSpike" and a.state == "firing"]
    assert firing, f"no loss-spike alert after the restart: {alerts}"
    assert firing[0].first_step == 300
    daemon.stop()


def test_a_corrupt_older_segment_is_reported_and_skipped(tmp_path):
    data_dir = str(tmp_path / "data")
    daemon = Daemon(foreshockd_binary(), str(tmp_path), [f"--data_dir={data_dir}"])
    daemon.start()
    Streamer(daemon.endpoint, "first", first_step=0).stream(n_batches=40)
    daemon.stop()
    older = _newest_segment(data_dir)  # sealed at the clean stop
    daemon.start()
    Streamer(daemon.endpoint, "second", first_step=0).stream(n_batches=40)
    daemon.stop()

    # Flip bytes in the middle of the older segment.
    size = os.path.getsize(older)
    with open(older, "r+b") as f:
        f.seek(size // 2)
        chunk = bytearray(f.read(16))
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))

    daemon.start()  # must still start
    log = open(daemon.log_path).read()
    assert "corrupt" in log.lower(), log[-2000:]
    second = _loss_points(daemon, "second")
    assert sorted(second) == list(range(200)), "the intact segment lost data"
    first = _loss_points(daemon, "first")
    assert 0 < len(first) < 200, "the corrupt part should be skipped, the rest kept"
    daemon.stop()


def test_data_dir_bytes_says_what_the_directory_holds(tmp_path):
    """foreshock_data_dir_bytes is the size of the files under --data_dir."""
    data_dir = tmp_path / "data"
    daemon = Daemon(foreshockd_binary(), str(tmp_path), [f"--data_dir={data_dir}"])
    daemon.start()
    try:
        Streamer(daemon.endpoint, "sized", first_step=0).stream(n_batches=200)
        time.sleep(0.5)
        with urllib.request.urlopen(daemon.metrics_url, timeout=10) as response:
            text = response.read().decode()
        (line,) = [l for l in text.splitlines() if l.startswith("foreshock_data_dir_bytes ")]
        reported = float(line.split()[1])
        on_disk = sum(p.stat().st_size for p in data_dir.rglob("*") if p.is_file())
        # The store may append (a checkpoint, an event) between the two reads.
        assert on_disk > 0 and abs(reported - on_disk) <= 0.1 * on_disk + 65536, (reported, on_disk)
    finally:
        daemon.stop()
