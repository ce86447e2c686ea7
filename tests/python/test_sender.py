"""The background sender against an in-process Ingest server, and against no server.

Whatever the network does, monitor.step must return at once, and every record
must be accounted for: sent = acked + rejected + duplicates + still unacked
(unacked batches are resent with their seqs on the next stream).
"""
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import free_port, wait_until
from fake_ingest import FakeServer
from foreshock import ModelInfo, Monitor
from foreshock.sender import RecordQueue


@pytest.fixture
def server():
    srv = FakeServer(free_port()).start()
    try:
        yield srv
    finally:
        srv.stop()


def scalar_monitor(endpoint, **kwargs):
    return Monitor(endpoint, run_id="run-a", job="unit", rank=3, labels={"team": "x"},
                   model_info=ModelInfo(n_layers=2, n_heads=4, head_dim=8),
                   backoff_initial_s=0.02, backoff_max_s=0.2, **kwargs)


# A liveness guard, not a latency bound: whatever the code under test could
# wait on (an ack, a HelloAck, a TCP handshake) is held for longer than this,
# so code that waited on it could not finish within the guard at all.
LIVENESS_GUARD_S = 60


def finishes_while_held(fn, still_held):
    """Runs fn in a thread; True when it returned while still_held() was true."""
    done = threading.Event()
    errors = []

    def run():
        try:
            fn()
        except BaseException as e:  # reported by the assertion below
            errors.append(e)
        finally:
            done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    finished = done.wait(LIVENESS_GUARD_S)
    held = still_held()
    assert not errors, errors
    return finished and held


def settled(stats):
    return (stats["acked_records"] + sum(stats["rejected"].values()) + stats["duplicates"]
            + stats["unacked"])


def test_hello_then_batches_with_increasing_seq_and_all_records_acked(server):
    n = 300
    monitor = scalar_monitor(server.endpoint, max_batch_bytes=400)
    for step in range(n):
        monitor.step(step, loss=float(step), grad_norm=1.0, lr=0.1)
    monitor.close(timeout=10)
    stats = monitor.stats()
    assert stats["enqueued"] == stats["sent"] == stats["acked_records"] == n
    assert stats["resent"] == 0 and stats["rejected"] == {} and stats["unsent_at_close"] == 0
    assert stats["dropped_unacked"] == 0 and stats["unacked"] == 0

    (stream,) = server.servicer.streams
    hello = stream["hello"]
    assert (hello.run_id, hello.job, hello.rank, dict(hello.labels)) == ("run-a", "unit", 3,
                                                                         {"team": "x"})
    assert (hello.model.n_layers, hello.model.n_heads, hello.model.head_dim) == (2, 4, 8)
    seqs = [b.seq for b in stream["batches"]]
    # seq is per sender: it starts at the Unix time in microseconds.
    assert hello.first_seq == seqs[0] and abs(seqs[0] / 1e6 - time.time()) < 60
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert len(seqs) > 1  # the byte budget split the records into several batches
    for batch in stream["batches"]:
        assert len(batch.records) == 1 or sum(r.ByteSize() for r in batch.records) <= 400
    assert [r.step for r in server.servicer.records()] == list(range(n))
    assert stats["batches_sent"] == len(seqs)


def test_sender_ids_are_distinct_in_processes_that_seed_every_rng_alike(server):
    """A training script seeds random, numpy and torch (transformers.set_seed);
    two processes doing so must still get different sender ids, or the daemon
    takes a restarted job for a reconnect of the old one."""
    script = (
        "import random, numpy, torch\n"
        "random.seed(0); numpy.random.seed(0); torch.manual_seed(0)\n"
        "from foreshock import ModelInfo, Monitor\n"
        f"m = Monitor({server.endpoint!r}, run_id='run-seeded', job='seeded', model_info=ModelInfo(1, 1, 1))\n"
        "m.step(0, loss=1.0)\n"
        "m.close(timeout=10)\n")
    for _ in range(2):
        subprocess.run([sys.executable, "-c", script], check=True, timeout=120,
                       env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    ids = [stream["hello"].sender_id for stream in server.servicer.streams]
    assert len(ids) == 2 and ids[0] != ids[1] and all(ids), ids


def test_rejections_are_counted_by_reason_code(server):
    server.servicer.reject = lambda r: "bad_shape: odd step" if r.step % 2 else None
    monitor = scalar_monitor(server.endpoint)
    for step in range(10):
        monitor.step(step, loss=1.0)
    monitor.close(timeout=10)
    stats = monitor.stats()
    assert stats["acked_records"] == 5
    assert stats["rejected"] == {"bad_shape": 5}
    assert settled(stats) == stats["sent"] == 10


def test_reconnects_after_the_server_restarts_and_sends_hello_again(server):
    monitor = scalar_monitor(server.endpoint)
    try:
        monitor.step(0, loss=1.0)
        assert wait_until(lambda: monitor.stats()["acked_records"] == 1)
        assert monitor.stats()["connected"]
        server.stop()
        assert wait_until(lambda: not monitor.stats()["connected"])
        for step in range(1, 6):  # queued while the server is down
            monitor.step(step, loss=1.0)
        time.sleep(0.3)
        # Attempts while the server is down are failed_connects, not reconnects.
        assert monitor.stats()["failed_connects"] >= 1 and monitor.stats()["reconnects"] == 0
        server.start()
        for step in range(6, 10):
            monitor.step(step, loss=1.0)
        assert wait_until(lambda: monitor.stats()["acked_records"] == 10)
        assert monitor.stats()["reconnects"] == 1  # one restart, one reconnect
    finally:
        monitor.close(timeout=5)
    streams = [s for s in server.servicer.streams if s["batches"]]
    assert len(streams) == 2
    assert all(s["hello"].run_id == "run-a" for s in server.servicer.streams)
    # seq continues across streams; the new Hello names the next one.
    assert streams[1]["batches"][0].seq == streams[0]["batches"][-1].seq + 1
    assert streams[1]["hello"].first_seq == streams[1]["batches"][0].seq
    assert [r.step for r in server.servicer.records()] == list(range(10))
    assert monitor.stats()["resent"] == 0


def test_records_wait_in_the_queue_until_a_stream_is_accepted(server):
    # Two streams fail after reading the Hello; records must not go out on them.
    server.servicer.fail_hellos = 2
    server.servicer.hello_delay_s = 0.2
    monitor = scalar_monitor(server.endpoint)
    try:
        for step in range(5):
            monitor.step(step, loss=1.0)
        assert wait_until(lambda: monitor.stats()["acked_records"] == 5)
    finally:
        monitor.close(timeout=5)
    stats = monitor.stats()
    # Two refused attempts, then the first accepted stream: no reconnect yet.
    assert stats["failed_connects"] == 2 and stats["reconnects"] == 0, stats
    assert stats["resent"] == 0 and stats["sent"] == 5
    assert [len(s["batches"]) > 0 for s in server.servicer.streams] == [False, False, True]


def test_batches_unacked_when_the_stream_breaks_are_resent_with_their_seqs(server):
    server.servicer.release_acks.clear()  # hold every ack
    monitor = scalar_monitor(server.endpoint)
    try:
        for step in range(4):
            monitor.step(step, loss=1.0)
        assert wait_until(lambda: len(server.servicer.records()) == 4)
        assert monitor.stats()["acked_records"] == 0 and monitor.stats()["unacked"] == 4
        server.stop()
        assert wait_until(lambda: not monitor.stats()["connected"])
        server.servicer.release_acks.set()
        server.start()
        assert wait_until(lambda: monitor.stats()["acked_records"] == 4)
    finally:
        monitor.close(timeout=5)
    stats = monitor.stats()
    assert stats["sent"] == 4 and stats["resent"] == 4 and settled(stats) == 4
    assert stats["unacked"] == 0 and stats["unsent_at_close"] == 0
    first, second = [s for s in server.servicer.streams if s["batches"]]
    # The same seqs again; then close() ends with the goodbye batch (a new seq).
    resent = [b.seq for b in second["batches"] if not b.HasField("goodbye")]
    assert resent == [b.seq for b in first["batches"]]
    assert [b.HasField("goodbye") for b in second["batches"]][-1]
    assert second["hello"].first_seq == first["batches"][0].seq
    assert second["hello"].sender_id == first["hello"].sender_id != 0
    assert [r.step for r in server.servicer.records()] == [0, 1, 2, 3] * 2


def test_unacked_buffer_is_bounded_and_drops_the_oldest_without_blocking(server):
    server.servicer.release_acks.clear()  # hold every ack
    monitor = scalar_monitor(server.endpoint, max_batch_bytes=1, max_unacked_bytes=200)
    try:
        # The 50 steps finish while every ack is held: step() never waits on one.
        assert finishes_while_held(lambda: [monitor.step(s, loss=1.0) for s in range(50)],
                                   lambda: not server.servicer.release_acks.is_set())
        assert wait_until(lambda: monitor.stats()["sent"] == 50)
        stats = monitor.stats()
        assert stats["dropped_unacked"] > 0
        assert stats["dropped_unacked"] + stats["unacked"] == 50
        server.servicer.release_acks.set()
        assert wait_until(lambda: monitor.stats()["unacked"] == 0)
        # Acks of dropped batches settle nothing; the newest are acked.
        assert monitor.stats()["acked_records"] == 50 - stats["dropped_unacked"]
    finally:
        monitor.close(timeout=5)


def test_no_daemon_never_blocks_training_and_counts_what_close_left_unsent():
    monitor = scalar_monitor(f"127.0.0.1:{free_port()}")  # nobody listens there
    for step in range(200):
        monitor.step(step, loss=1.0)
        time.sleep(0.002)  # let the sender thread run its connection attempts meanwhile
    assert wait_until(lambda: monitor.stats()["failed_connects"] >= 2)
    stats = monitor.stats()
    assert stats["reconnects"] == 0
    assert not stats["connected"] and stats["sent"] == 0
    monitor.close(timeout=0.5)
    stats = monitor.stats()
    assert stats["unsent_at_close"] == stats["enqueued"] == 200
    monitor.step(200, loss=1.0)
    assert monitor.stats()["dropped_after_close"] == 1


def test_a_peer_that_never_speaks_http2_never_blocks_training_or_close():
    # A TCP listener that accepts and then says nothing: the sender's connection
    # attempt hangs in the handshake for as long as the peer stays silent.
    # Training steps and close(timeout) must finish while it does; a step or a
    # close that waited on the network could not.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        accepted = []
        stop = threading.Event()

        def accept_and_hold():
            silent.settimeout(0.05)
            while not stop.is_set():
                try:
                    accepted.append(silent.accept()[0])
                except OSError:
                    pass

        acceptor = threading.Thread(target=accept_and_hold, daemon=True)
        acceptor.start()
        monitor = scalar_monitor(f"127.0.0.1:{silent.getsockname()[1]}")
        try:
            assert finishes_while_held(lambda: [monitor.step(s, loss=1.0) for s in range(200)],
                                       lambda: not stop.is_set())
            assert wait_until(lambda: accepted)  # the sender did reach the silent peer
            assert finishes_while_held(lambda: monitor.close(timeout=0.5),
                                       lambda: not stop.is_set())
            stats = monitor.stats()
            assert stats["acked_records"] == 0 and stats["unsent_at_close"] == 200, stats
        finally:
            stop.set()
            acceptor.join(5)
            for conn in accepted:
                conn.close()
            monitor.close(timeout=0)


def test_a_daemon_that_does_not_answer_never_blocks_training(server):
    server.servicer.release_hellos.clear()  # the stream is open, the HelloAck held
    monitor = scalar_monitor(server.endpoint)
    try:
        assert finishes_while_held(lambda: [monitor.step(s, loss=1.0) for s in range(100)],
                                   lambda: not server.servicer.release_hellos.is_set())
        assert wait_until(lambda: server.servicer.streams)  # the Hello is out, unanswered
        assert monitor.stats()["sent"] == 0  # nothing goes out before the HelloAck
        server.servicer.release_hellos.set()
        assert wait_until(lambda: monitor.stats()["acked_records"] == 100)
    finally:
        monitor.close(timeout=5)


def test_full_queue_drops_and_counts_without_blocking():
    monitor = scalar_monitor(f"127.0.0.1:{free_port()}", queue_size=50)
    try:
        n = 5000
        for step in range(n):
            monitor.step(step, loss=1.0)
        stats = monitor.stats()
        # No stream ever opens, so nothing leaves the queue: exactly 50 fit.
        assert stats["enqueued"] == 50 and stats["queued"] == 50
        assert stats["dropped_queue_full"] == n - 50
    finally:
        monitor.close(timeout=0.2)


def test_record_queue_bounds_records_and_bytes_and_keeps_order():
    queue = RecordQueue(max_records=3, max_bytes=100)
    assert queue.put_nowait("a", 40) and queue.put_nowait("b", 40)
    assert not queue.put_nowait("c", 40)  # 120 bytes > 100
    assert queue.put_nowait("c", 20)
    assert not queue.put_nowait("d", 1)  # 3 records
    assert [r for r, _ in queue.take_batch(max_bytes=50, timeout=0)] == ["a"]
    batch = queue.take_batch(max_bytes=1000, timeout=0)
    assert [r for r, _ in batch] == ["b", "c"]
    queue.put_front(batch)
    assert [r for r, _ in queue.take_batch(max_bytes=10, timeout=0)] == ["b"]  # oversized alone
    assert queue.take_batch(max_bytes=10, timeout=0) == [("c", 20)]
    assert queue.take_batch(max_bytes=10, timeout=0.01) == [] and len(queue) == 0
    assert queue.put_nowait("e", 100)  # the byte budget was given back


def test_a_stream_the_daemon_ends_for_idleness_is_reopened_only_with_data(start_foreshockd):
    # Issue 16: foreshockd --stream_idle_timeout_ms ends streams that send
    # nothing. The sender must not lose anything, and must not reopen a stream
    # (to be ended again) while it has nothing to send.
    from foreshock import prometheus
    daemon = start_foreshockd("--stream_idle_timeout_ms=300")
    monitor = scalar_monitor(daemon.endpoint)
    try:
        monitor.step(0, loss=1.0)
        assert wait_until(lambda: monitor.stats()["acked_records"] == 1)
        # The daemon ends the stream 300 ms after its last Ack; on a loaded
        # machine the sender may see that later, so wait for it, then leave
        # five more timeouts' worth of nothing to send.
        assert wait_until(lambda: monitor.stats()["idle_closes"] >= 1), monitor.stats()
        time.sleep(1.5)
        stats = monitor.stats()
        assert stats["idle_closes"] == 1 and stats["reconnects"] == 0, stats
        assert not stats["connected"]
        assert prometheus.value(daemon.scrape(), "foreshock_ingest_rejected_total",
                                reason="stream_idle_timeout") == 1
        for step in range(1, 4):
            monitor.step(step, loss=1.0)
        assert wait_until(lambda: monitor.stats()["acked_records"] == 4)
        assert monitor.stats()["reconnects"] == 1
    finally:
        monitor.close(timeout=5)
    stats = monitor.stats()
    assert stats["unsent_at_close"] == 0 and stats["resent"] == 0, stats


def test_a_batch_sent_as_the_daemon_ends_an_idle_stream_is_resent(server):
    # The race: the daemon ends the stream for idleness just as a batch goes
    # out; that batch is never acked, so the sender resends it on a new stream.
    server.servicer.idle_end_on_batch = 1
    monitor = scalar_monitor(server.endpoint)
    try:
        monitor.step(0, loss=1.0)
        assert wait_until(lambda: monitor.stats()["acked_records"] == 1)
    finally:
        monitor.close(timeout=5)
    stats = monitor.stats()
    assert stats["idle_closes"] == 1 and stats["resent"] == 1 and stats["reconnects"] == 1, stats
    assert [r.step for r in server.servicer.records()] == [0, 0]  # sent, then resent


def test_a_rank_another_sender_holds_is_retried_counted_and_never_blocks(start_foreshockd):
    # Issue 27: a rank belongs to the live stream that holds it. A second
    # process with the same run and rank is refused (ALREADY_EXISTS
    # rank_in_use): its sender retries after the hint, counts it, and its
    # training thread never waits; once the holder's stream ends, it takes
    # the rank over and delivers everything it queued meanwhile.
    from foreshock import prometheus
    daemon = start_foreshockd()
    holder = scalar_monitor(daemon.endpoint)
    second = None
    try:
        holder.step(0, loss=1.0)
        assert wait_until(lambda: holder.stats()["acked_records"] == 1)
        second = scalar_monitor(daemon.endpoint)
        # Training never waits on the refusal: the steps finish while the
        # holder still holds the rank, so the second sender cannot connect.
        assert finishes_while_held(lambda: [second.step(s, loss=2.0) for s in range(1, 51)],
                                   lambda: holder.stats()["connected"])
        assert wait_until(lambda: second.stats()["rank_in_use"] >= 1, 10), second.stats()
        stats = second.stats()
        assert stats["acked_records"] == 0 and not stats["connected"], stats
        assert prometheus.value(daemon.scrape(), "foreshock_ingest_rejected_total",
                                reason="rank_in_use") >= 1
        holder.step(51, loss=1.0)  # the holder streams on, undisturbed
        assert wait_until(lambda: holder.stats()["acked_records"] == 2)
        holder.close(timeout=5, end=False)  # its stream ends without a goodbye
        # The retry hint is 1 s: the second sender takes the rank over after it.
        assert wait_until(lambda: second.stats()["acked_records"] == 50, 20), second.stats()
    finally:
        holder.close(timeout=5, end=False)
        if second is not None:
            second.close(timeout=5)
    assert second.stats()["unsent_at_close"] == 0, second.stats()


# A child process that leaves its client threads inside gRPC when it exits:
# a stream pending on a peer that never answers (a socket that listens and
# never accepts), a monitor never closed, or closed with no time to flush, and
# an alert watcher. The checker runs at exit after the client's own hook (it
# is registered first, and atexit runs last-registered first).
_EXIT_CHILD = r"""
import atexit, json, socket, sys, threading, time
def check():
    alive = sorted(t.name for t in threading.enumerate() if t.name.startswith("foreshock"))
    print(json.dumps(dict(alive=alive)), flush=True)
atexit.register(check)
from foreshock import ModelInfo, Monitor
hole = socket.socket()
hole.bind(("127.0.0.1", 0))
hole.listen(0)
mode = sys.argv[1]
endpoint = "127.0.0.1:%d" % (hole.getsockname()[1] if mode != "refused" else int(sys.argv[2]))
monitor = Monitor(endpoint, run_id="exit", job="unit", model_info=ModelInfo(2, 4, 8),
                  backoff_initial_s=0.02, backoff_max_s=0.05)
monitor.on_alert(lambda event: None)
for step in range(50):
    monitor.step(step, loss=1.0)
time.sleep(0.3)  # the stream attempts are in flight
if mode != "unclosed":
    monitor.close(timeout=0.0)
"""


@pytest.mark.parametrize("mode", ["unclosed", "closed_at_once", "refused"])
def test_client_threads_are_stopped_before_the_interpreter_finalizes(mode):
    # A daemon thread still inside gRPC when Python finalizes can abort the
    # training process after a clean run (the job then exits with a signal).
    import json
    import os
    import subprocess
    import sys
    from conftest import CLIENT, INSTALLED_CLIENT, ROOT
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    if not INSTALLED_CLIENT:
        env["PYTHONPATH"] = os.pathsep.join([CLIENT, ROOT])
    proc = subprocess.run([sys.executable, "-c", _EXIT_CHILD, mode, str(free_port())], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["alive"] == [], report
