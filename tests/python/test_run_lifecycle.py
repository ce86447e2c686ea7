"""Run lifecycle (docs/DESIGN.md §3.4, §5.3) against a real foreshockd.

- monitor.close() ends the run: its firing alert resolves (resolved_reason
  run_ended) in ListAlerts, /api/v1/alerts, foreshock_alert_active and a real
  Alertmanager, ListRuns says ended, and a daemon restart, even a SIGKILL
  right after the end, does not bring the alert back.
- A training job SIGKILLed after a fault fired and resumed from an earlier
  checkpoint under the same run_id: every series shows one point per step,
  the resumed attempt's where the attempts overlap; the old attempt's alert
  resolves (run_resumed) and is not delivered to the resumed job's on_alert;
  the alert engine scores the resumed steps instead of dropping them as stale.
- The client side: Sender.close(goodbye=True) ends with exactly one goodbye
  batch, resent like any batch until acked; a daemon that does not know a
  Batch field acks the batch (why the goodbye is a field: older daemons).
"""
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
import torch
import torch.nn.functional as F

from conftest import AlertWatch as Watch, Daemon, foreshockd_binary, free_port, wait_until
from fake_ingest import FakeServer
from demo import tiny_moe_gpt as tmg
from foreshock import Monitor, prometheus
from foreshock.sender import RecordQueue, Sender
from foreshock.v1 import ingest_pb2 as pb
from foreshock.v1 import ingest_pb2_grpc as pb_grpc
from foreshock.v1 import query_pb2, query_pb2_grpc
from test_alertmanager_e2e import Alertmanager, alertmanager  # noqa: F401 (fixture)

HERE = os.path.dirname(os.path.abspath(__file__))
TRAINER = os.path.join(HERE, "resumable_train.py")


def query(daemon):
    channel = grpc.insecure_channel(daemon.endpoint)
    return channel, query_pb2_grpc.QueryStub(channel)


def list_alerts(daemon, run, include_resolved=True):
    channel, stub = query(daemon)
    with channel:
        return list(stub.ListAlerts(query_pb2.ListAlertsRequest(
            run=run, include_resolved=include_resolved), timeout=10).alerts)


def run_info(daemon, run):
    channel, stub = query(daemon)
    with channel:
        runs = [r for r in stub.ListRuns(query_pb2.ListRunsRequest(), timeout=10).runs
                if r.run == run]
    return runs[0] if runs else None


def series(daemon, run, signal_name, layer=-1):
    channel, stub = query(daemon)
    with channel:
        response = stub.GetSeries(query_pb2.GetSeriesRequest(run=run, signal=signal_name,
                                                             layer=layer), timeout=10)
    return [(p.step, p.value) for p in response.points]


def series_head(daemon, run, signal_name, head):
    channel, stub = query(daemon)
    with channel:
        response = stub.GetSeries(query_pb2.GetSeriesRequest(run=run, signal=signal_name,
                                                             layer=-1, head=head), timeout=10)
    return [(p.step, p.value) for p in response.points]


def http_json(daemon, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}{path}", timeout=5) as r:
        return json.load(r)


def alert_active(daemon, alertname, run):
    return prometheus.value(daemon.scrape(), "foreshock_alert_active", alertname=alertname,
                            run=run)


def in_alertmanager(am, alertname, run):
    return [a for a in am.alerts() if a["labels"].get("alertname") == alertname
            and a["labels"].get("run") == run]


def demo_model():
    torch.manual_seed(0)
    text = tmg.load_text("gnu")
    vocab = tmg.CharVocab([text])
    cfg = tmg.GPTConfig(vocab_size=len(vocab), block_size=32)
    data = tmg.CharDataset(vocab.encode(text), cfg.block_size)
    return tmg.TinyMoEGPT(cfg), data


# -- monitor.close() ends the run ---------------------------------------------

def test_close_resolves_the_runs_alert_everywhere_and_for_good(tmp_path, alertmanager):  # noqa: F811
    run = "lifecycle-close"
    alertmanager.start()
    # No periodic checkpoint: what the alert checkpoint holds is decided below.
    daemon = Daemon(foreshockd_binary(), str(tmp_path),
                    [f"--alertmanager_url={alertmanager.url}", "--checkpoint_interval_s=0"])
    daemon.start()
    try:
        model, data = demo_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        batches = torch.Generator().manual_seed(0)
        monitor = Monitor(daemon.endpoint, run_id=run, job="lifecycle", model=model,
                          probe_batch=data.probe_batch(2), every=4,
                          backoff_initial_s=0.05, backoff_max_s=0.5)
        events = []
        monitor.on_alert(events.append)
        for step in range(12):
            if step == 6:  # a numerical fault: ForeshockNonFinite fires
                with torch.no_grad():
                    model.head.weight[0, 0] = float("nan")
            x, y = data.batch(8, batches)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            monitor.step(step, loss=loss.item())
        assert wait_until(lambda: in_alertmanager(alertmanager, "ForeshockNonFinite", run), 30), \
            daemon.log_tail()
        assert alert_active(daemon, "ForeshockNonFinite", run) == 1
        # A clean restart checkpoints the alert engine with the alert firing;
        # the monitor reconnects as the same sender.
        daemon.stop(signal.SIGTERM)
        daemon.start()
        assert wait_until(lambda: monitor.stats()["connected"], 20), monitor.stats()
        assert [a.state for a in list_alerts(daemon, run)] == ["firing"]

        monitor.close(timeout=20)
        stats = monitor.stats()
        assert stats["goodbye_acked"] and stats["acked_records"] == stats["enqueued"], stats

        def check_ended(where, gauge=(0,)):
            (alert,) = list_alerts(daemon, run)
            assert alert.alertname == "ForeshockNonFinite" and alert.state == "resolved", where
            assert alert.resolved_reason == "run_ended", (where, alert)
            assert alert.annotations["resolved_reason"] == "run_ended", where
            assert alert.first_step == 6 and alert.resolved_step == 11, (where, alert)
            assert alert.ends_at_unix_ms >= alert.starts_at_unix_ms > 0, (where, alert)
            assert list_alerts(daemon, run, include_resolved=False) == [], where
            (api,) = http_json(daemon, f"/api/v1/alerts?run={run}&include_resolved=true")["alerts"]
            assert api["state"] == "resolved" and api["annotations"]["resolved_reason"] == "run_ended"
            assert alert_active(daemon, "ForeshockNonFinite", run) in gauge, where
            info = run_info(daemon, run)
            assert info.ended and info.ended_unix_ms > 0 and info.attempt == 1, (where, info)
            assert info.active_alerts == 0 and info.attempt_start_step == -1, (where, info)
            # Alertmanager got endsAt: it stops listing the alert.
            assert wait_until(lambda: not in_alertmanager(alertmanager, "ForeshockNonFinite", run),
                              30), (where, alertmanager.alerts())

        check_ended("after close")
        # on_alert heard the fault, and the end before the watcher closed or not at all.
        firing = [e for e in events if e.to_state == "firing"]
        assert firing and firing[0].alert.alertname == "ForeshockNonFinite", events
        assert all(e.alert.resolved_reason == "run_ended" for e in events if e.to_state == "resolved")

        # A crash right after the end: the alert checkpoint still says firing,
        # the event log says the run ended; the restart re-applies the end.
        daemon.stop(signal.SIGKILL)
        daemon.start()
        log = open(daemon.log_path).read()
        assert "restored alert state from the checkpoint: 1 active alert(s)" in log, log[-3000:]
        assert "1 change(s) re-applied to the alert state" in log, log[-3000:]
        check_ended("after SIGKILL and restart")
        time.sleep(2)  # nothing brings it back (Alertmanager resends would)
        assert not in_alertmanager(alertmanager, "ForeshockNonFinite", run)

        # And after a clean restart, from the checkpoints alone.
        daemon.stop(signal.SIGTERM)
        daemon.start()
        assert "0 change(s) re-applied" in open(daemon.log_path).read()
        # The gauge: 0, or not exported at all when nothing was resolved since the start.
        check_ended("after a clean restart", gauge=(0, None))
    finally:
        daemon.stop()


def test_the_run_ends_when_its_last_rank_closes(foreshockd):
    run = "lifecycle-ranks"
    monitors = [Monitor(foreshockd.endpoint, run_id=run, job="lifecycle", rank=rank)
                for rank in (0, 1)]
    for step in range(4):
        for monitor in monitors:
            monitor.step(step, loss=float("nan") if step == 2 else 1.0)
    assert wait_until(lambda: run_info(foreshockd, run) is not None
                      and [a.state for a in list_alerts(foreshockd, run)] == ["firing"], 20)
    monitors[0].close(timeout=10)
    assert monitors[0].stats()["goodbye_acked"]
    info = run_info(foreshockd, run)
    assert not info.ended and info.active_alerts == 1, info  # rank 1 still trains
    monitors[1].close(timeout=10)
    info = run_info(foreshockd, run)
    assert info.ended and info.active_alerts == 0, info
    (alert,) = list_alerts(foreshockd, run)
    assert alert.state == "resolved" and alert.resolved_reason == "run_ended"
    assert alert.resolved_step == 3  # the run's last step


def test_close_without_end_leaves_the_run_open(foreshockd):
    run = "lifecycle-no-end"
    monitor = Monitor(foreshockd.endpoint, run_id=run, job="lifecycle")
    monitor.step(0, loss=float("nan"))
    monitor.close(timeout=10, end=False)
    assert not monitor.stats()["goodbye_acked"]
    assert [a.state for a in list_alerts(foreshockd, run)] == ["firing"]
    assert not run_info(foreshockd, run).ended


# -- a job killed and resumed from a checkpoint -------------------------------

def start_trainer(daemon, run, out, tmp_path, *extra):
    log = open(f"{out}.log", "wb")
    return subprocess.Popen(
        [sys.executable, TRAINER, "--endpoint", daemon.endpoint, "--run-id", run,
         "--checkpoint", str(tmp_path / "ckpt.pt"), "--out", out, *extra],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env=dict(os.environ, OMP_NUM_THREADS="1"))


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


@pytest.mark.parametrize("crash", ["sigkill", "vanished_host"])
def test_a_job_killed_after_a_fault_and_resumed_from_a_checkpoint(start_foreshockd, tmp_path,
                                                                  crash):
    """sigkill: the daemon sees the stream end. vanished_host: the process is
    stopped (SIGSTOP) and its stream stays open, as when a host disappears
    without closing its connections: the rank belongs to that stream until it
    has been idle for --rank_takeover_grace_ms (here 2 s, less than the new
    process takes to start), then the new process takes it over, and the
    restart shows at its Hello."""
    run = "lifecycle-resume-" + crash
    daemon = start_foreshockd("--checkpoint_interval_s=1", "--rank_takeover_grace_ms=2000")
    watch = Watch(daemon.endpoint, run)
    first = None
    first_out, second_out = str(tmp_path / "attempt1.json"), str(tmp_path / "attempt2.json")
    try:
        # Attempt 1: checkpoint after step 29, a NaN from step 35 (the alert
        # fires), killed at step 45.
        first = start_trainer(daemon, run, first_out, tmp_path, "--steps", "60",
                              "--save-after", "29", "--nan-at", "35", "--stall-at", "45")
        try:
            def stalled():
                result = read_json(first_out)
                return (result and result.get("stalled") and prometheus.value(
                    daemon.scrape(), "foreshock_last_step", run=run) == 45)
            assert wait_until(stalled, 180, 0.2), open(first_out + ".log").read()[-3000:]
            assert wait_until(lambda: [a.state for a in list_alerts(daemon, run)] == ["firing"], 20)
        finally:
            if crash == "sigkill" or first.poll() is not None:
                first.send_signal(signal.SIGKILL)
                first.wait(30)
            else:
                first.send_signal(signal.SIGSTOP)
        attempt1 = read_json(first_out)
        assert attempt1["start"] == 0 and len(attempt1["losses"]) == 46

        # Attempt 2: the same run_id, from the checkpoint (step 30 on), no fault.
        second = start_trainer(daemon, run, second_out, tmp_path, "--steps", "60", "--resume")
        assert second.wait(180) == 0, open(second_out + ".log").read()[-3000:]
        attempt2 = read_json(second_out)
        assert attempt2["start"] == 30 and attempt2["stats"]["goodbye_acked"], attempt2
        assert attempt2["stats"]["acked_records"] == attempt2["stats"]["enqueued"], attempt2

        def loss_of(attempt, step):
            return attempt["losses"][str(step)]

        # The fault was real in attempt 1, and attempt 2 resumed the same
        # training: before the fault both computed the same losses.
        assert all(math.isnan(loss_of(attempt1, s)) for s in range(36, 46))
        for step in range(30, 35):
            assert math.isclose(loss_of(attempt2, step), loss_of(attempt1, step), rel_tol=1e-5)

        def check(where):
            # One point per step, the resumed attempt's where they overlap.
            points = series(daemon, run, "loss")
            assert [s for s, _ in points] == list(range(60)), (where, points)
            for step, value in points:
                expected = loss_of(attempt1 if step < 30 else attempt2, step)
                assert value == expected, (where, step, value, expected)
            # A layer-level series of the probe (every 5 steps), likewise.
            probe_steps = [s for s, _ in series(daemon, run, "attention_entropy", layer=0)]
            assert probe_steps == list(range(0, 60, 5)), (where, probe_steps)
            # The old attempt's alert resolved because the run resumed; nothing else alerted.
            (alert,) = list_alerts(daemon, run)
            assert alert.alertname == "ForeshockNonFinite" and alert.state == "resolved", where
            assert alert.resolved_reason == "run_resumed" and alert.first_step == 35, (where, alert)
            assert alert.attempt == 1, (where, alert)  # the crashed attempt's, kept as such
            info = run_info(daemon, run)
            assert info.attempt == 2 and info.attempt_start_step == 30, (where, info)
            assert info.ended and info.active_alerts == 0, (where, info)
            assert prometheus.value(daemon.scrape(), "foreshock_last_step", run=run) == 59, where

        check("after the resumed job ended")
        if crash == "sigkill":
            # The resumed job's on_alert was not handed the old alert (as firing or at all).
            assert attempt2["events"] == [], attempt2["events"]
        else:
            # Its watch began before the restart was known: at most the old alert as it
            # was (a snapshot, not a transition), then its resolution; nothing fired.
            assert not [e for e in attempt2["events"]
                        if e["to"] in ("firing", "pending") and e["from"] != e["to"]], attempt2
            assert all(e["resolved_reason"] == "run_resumed"
                       for e in attempt2["events"] if e["to"] == "resolved"), attempt2
        # Any watcher saw it fire, then resolve when the new process connected.
        assert [(e.alert.alertname, e.from_state, e.to_state, e.alert.resolved_reason)
                for e in watch.events] == [
            ("ForeshockNonFinite", "inactive", "firing", ""),
            ("ForeshockNonFinite", "firing", "resolved", "run_resumed")], watch.events
        # The engine scored the replayed steps: none was dropped as stale.
        samples = daemon.scrape()
        assert prometheus.value(samples, "foreshock_alert_points_total", outcome="stale") == 0
        assert prometheus.value(samples, "foreshock_alert_points_total", outcome="scored") > 0

        # The attempt boundary is durable: a crash and restart shows the same
        # (the alerts come from the alert checkpoint, which the crash may not
        # lose: they are not rebuilt from the event log).
        time.sleep(2)
        daemon.stop(signal.SIGKILL)
        daemon.start()
        check("after SIGKILL and restart")
    finally:
        watch.close()
        if first is not None and first.poll() is None:
            first.send_signal(signal.SIGKILL)
            first.wait(30)


# -- the client side ------------------------------------------------------------

def scalars(step):
    record = pb.Record(step=step)
    record.scalars.loss = 1.0
    return record


def test_sender_ends_with_one_goodbye_resent_until_acked():
    server = FakeServer(free_port()).start()
    try:
        queue = RecordQueue(100, 1 << 20)
        for step in range(3):
            queue.put_nowait(scalars(step), scalars(step).ByteSize())
        sender = Sender(server.endpoint, pb.Hello(run_id="r", job="j"), queue,
                        backoff_initial_s=0.05, backoff_max_s=0.2)
        sender.start()
        assert wait_until(lambda: sender.stats()["acked_records"] == 3)
        # The goodbye's ack is held, and its stream breaks: the next stream resends it.
        server.servicer.release_acks.clear()
        closer = threading.Thread(target=sender.close, args=(20,), kwargs=dict(goodbye=True))
        closer.start()
        assert wait_until(lambda: any(b.HasField("goodbye") for s in server.servicer.streams
                                      for b in s["batches"]))
        server.stop()
        server.servicer.release_acks.set()
        server.start()
        closer.join(30)
        assert not closer.is_alive()
        stats = sender.stats()
        assert stats["goodbye_acked"] and stats["unacked"] == 0, stats
        goodbyes = [b for s in server.servicer.streams for b in s["batches"] if b.HasField("goodbye")]
        assert len(goodbyes) == 2 and goodbyes[0].seq == goodbyes[1].seq, goodbyes
        assert all(not b.records for b in goodbyes)
        # It came last on its stream, after every record.
        for stream in server.servicer.streams:
            flags = [b.HasField("goodbye") for b in stream["batches"]]
            assert flags in ([], [True]) or flags[-1] and not any(flags[:-1]), flags
    finally:
        server.stop()


def test_sender_close_without_goodbye_sends_none():
    server = FakeServer(free_port()).start()
    try:
        queue = RecordQueue(100, 1 << 20)
        queue.put_nowait(scalars(0), scalars(0).ByteSize())
        sender = Sender(server.endpoint, pb.Hello(run_id="r", job="j"), queue)
        sender.start()
        sender.close(10)
        assert sender.stats()["acked_records"] == 1 and not sender.stats()["goodbye_acked"]
        assert not any(b.HasField("goodbye") for s in server.servicer.streams for b in s["batches"])
    finally:
        server.stop()


def test_a_batch_field_the_daemon_does_not_know_is_ignored(foreshockd):
    """Why Batch.goodbye is a field: a daemon older than a Batch field (here
    number 99, unknown to this one) acks the batch as if it were not there,
    while an unknown StreamRequest kind would end the stream (empty_request)."""
    batch = pb.Batch(seq=1, records=[scalars(0)]).SerializeToString() + b"\x9a\x06\x00"  # 99: {}
    hello = pb.StreamRequest(hello=pb.Hello(run_id="unknown-field", job="j")).SerializeToString()
    requests = [hello, b"\x12" + bytes([len(batch)]) + batch]  # StreamRequest.batch (2)
    with grpc.insecure_channel(foreshockd.endpoint) as channel:
        stream = channel.stream_stream("/foreshock.v1.Ingest/Stream",
                                       request_serializer=lambda b: b,
                                       response_deserializer=pb.StreamResponse.FromString)
        responses = list(stream(iter(requests), timeout=10))
    assert [r.WhichOneof("kind") for r in responses] == ["hello_ack", "ack"]
    assert responses[1].ack.seq == 1 and responses[1].ack.accepted == 1
    with grpc.insecure_channel(foreshockd.endpoint) as channel:
        stream = channel.stream_stream("/foreshock.v1.Ingest/Stream",
                                       request_serializer=lambda b: b,
                                       response_deserializer=pb.StreamResponse.FromString)
        with pytest.raises(grpc.RpcError) as error:
            list(stream(iter([hello, b"\x1a\x00"]), timeout=10))  # StreamRequest field 3: {}
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith("empty_request"), error.value.details()


# -- a run only its own job can end (issue 34 item 4) -------------------------

class HelloOnly:
    """A second client of a run: one stream with a Hello (its own sender_id)
    and then nothing, held open until close()."""

    def __init__(self, endpoint, run, rank, world_size=None):
        self.release = threading.Event()
        labels = {"world_size": str(world_size)} if world_size else {}
        hello = pb.StreamRequest(hello=pb.Hello(run_id=run, job="intruder", rank=rank,
                                                labels=labels, first_seq=1,
                                                sender_id=0x5EC0ADC11E47))

        def requests():
            yield hello
            self.release.wait(60)

        self.channel = grpc.insecure_channel(endpoint)
        self.call = pb_grpc.IngestStub(self.channel).Stream(requests(), timeout=60)

    def first_response(self):
        """The HelloAck, or the RpcError that refused the stream."""
        try:
            return next(self.call)
        except grpc.RpcError as e:
            return e

    def close(self):
        self.release.set()
        self.call.cancel()
        self.channel.close()


def refused_world_size(daemon, run, rank, world_size):
    intruder = HelloOnly(daemon.endpoint, run, rank, world_size)
    try:
        response = intruder.first_response()
    finally:
        intruder.close()
    assert isinstance(response, grpc.RpcError), f"admitted: {response}"
    assert response.code() == grpc.StatusCode.FAILED_PRECONDITION, response
    assert response.details().startswith("world_size_conflict: "), response.details()


def rejected(daemon, reason):
    return prometheus.value(daemon.scrape(), "foreshock_ingest_rejected_total", reason=reason)


def test_another_clients_hello_cannot_raise_the_world_size_the_run_waits_for(foreshockd):
    # A 2-rank job; a second client of the same tenant says Hello for rank
    # 65535 of 65536 (within --max_ranks_per_run). Admitted, it made the run
    # wait for 65536 ranks' goodbyes: the job's own close never ended it.
    run = "ownership-world-size"
    monitors = [Monitor(foreshockd.endpoint, run_id=run, job="own", rank=rank,
                        labels={"world_size": "2"}) for rank in (0, 1)]
    for step in range(4):
        for monitor in monitors:
            monitor.step(step, loss=1.0)
    assert wait_until(lambda: all(m.stats()["acked_records"] >= 4 for m in monitors), 20)
    refused_world_size(foreshockd, run, rank=65535, world_size=65536)
    refused_world_size(foreshockd, run, rank=5, world_size=None)  # a rank outside it
    assert rejected(foreshockd, "world_size_conflict") == 2
    for monitor in monitors:
        monitor.close(timeout=10)
        assert monitor.stats()["goodbye_acked"]
    info = run_info(foreshockd, run)
    assert info.ended, info


def test_a_hello_that_never_sends_anything_does_not_hold_the_run_open(foreshockd):
    # A one-rank job (no world_size label) and a second client's Hello for a
    # free rank that then sends nothing and keeps its stream open: the job's
    # goodbye ends the run (the end waits for the senders that sent records).
    run = "ownership-idle-hello"
    monitor = Monitor(foreshockd.endpoint, run_id=run, job="own")
    for step in range(4):
        monitor.step(step, loss=1.0)
    assert wait_until(lambda: monitor.stats()["acked_records"] >= 4, 20)
    # Nor can it declare a world size the job never did.
    refused_world_size(foreshockd, run, rank=65535, world_size=65536)
    idle = HelloOnly(foreshockd.endpoint, run, rank=65535)
    try:
        assert idle.first_response().HasField("hello_ack")
        monitor.close(timeout=10)
        assert monitor.stats()["goodbye_acked"]
        info = run_info(foreshockd, run)
        assert info.ended, info
    finally:
        idle.close()


def test_a_rank_joining_a_live_run_cannot_alert_or_move_its_last_step(foreshockd):
    # A one-rank job streams 20 steps; a second client joins as the free rank
    # 1 and sends NaN losses and a step 10^7 ahead. Before it has a history of
    # its own (8 steps) its values stay its own: no ForeshockNonFinite on the
    # run, and the far step is refused (step_ahead_of_run), so
    # foreshock_last_step stays the job's.
    run = "ownership-late-joiner"
    monitor = Monitor(foreshockd.endpoint, run_id=run, job="own")
    for step in range(20):
        monitor.step(step, loss=1.0)
    assert wait_until(lambda: monitor.stats()["acked_records"] >= 20, 20)

    batch = pb.Batch(seq=1)
    for step, loss in ((20, float("nan")), (21, float("nan")), (20 + 10**7, 1.0)):
        batch.records.add(step=step).scalars.loss = loss
    hello = pb.Hello(run_id=run, job="intruder", rank=1, first_seq=1, sender_id=0x1A7E)
    with grpc.insecure_channel(foreshockd.endpoint) as channel:
        responses = list(pb_grpc.IngestStub(channel).Stream(
            iter([pb.StreamRequest(hello=hello), pb.StreamRequest(batch=batch)]), timeout=20))
    (ack,) = [r.ack for r in responses if r.HasField("ack")]  # processed when acked
    assert ack.accepted == 2, ack
    assert [r.index for r in ack.rejections] == [2], ack
    assert ack.rejections[0].reason.startswith("step_ahead_of_run: "), ack
    assert rejected(foreshockd, "step_ahead_of_run") == 1

    for step in range(20, 30):
        monitor.step(step, loss=1.0)
    assert wait_until(lambda: monitor.stats()["acked_records"] >= 30, 20)
    assert [a.alertname for a in list_alerts(foreshockd, run)] == []
    assert prometheus.value(foreshockd.scrape(), "foreshock_last_step", run=run) == 29
    # The job's own NaN is the run's: the same check sees it.
    monitor.step(30, loss=float("nan"))
    assert wait_until(lambda: "ForeshockNonFinite" in
                      [a.alertname for a in list_alerts(foreshockd, run)], 20)
    monitor.close(timeout=10)


def test_a_restarted_ranks_replay_adds_no_one_rank_points(foreshockd):
    # A 2-rank job; rank 1's process dies after step 9 (no goodbye) while
    # rank 0 goes on to step 14; rank 1's new process resumes from its
    # checkpoint at step 5 (a rank resume: the run's attempt is unchanged).
    # The run-level loss has one point per step: at the replayed steps 5-9
    # rank 1's new value replaces its old one in the mean, and steps 10-14,
    # which waited for rank 1, are the mean of both ranks, not rank 0 alone
    # followed by a rank-1-only point.
    run = "replay-rank"
    labels = {"world_size": "2"}
    rank0 = Monitor(foreshockd.endpoint, run_id=run, job="own", rank=0, labels=labels)
    rank1 = Monitor(foreshockd.endpoint, run_id=run, job="own", rank=1, labels=labels)
    for step in range(10):
        rank0.step(step, loss=1.0)
        rank1.step(step, loss=3.0)
    assert wait_until(lambda: rank1.stats()["acked_records"] >= 10, 20)
    rank1.close(timeout=10, end=False)  # the process dies: no goodbye
    for step in range(10, 15):
        rank0.step(step, loss=1.0)
    assert wait_until(lambda: rank0.stats()["acked_records"] >= 15, 20)
    restarted = Monitor(foreshockd.endpoint, run_id=run, job="own", rank=1, labels=labels)
    for step in range(5, 15):
        restarted.step(step, loss=5.0)
    assert wait_until(lambda: restarted.stats()["acked_records"] >= 10, 20)
    assert run_info(foreshockd, run).attempt == 1
    points = series(foreshockd, run, "loss")
    assert [s for s, _ in points] == list(range(15)), points
    assert [v for _, v in points] == [2.0] * 5 + [3.0] * 10, points
    # Rank 1's own series, too, is the replay's where it replayed.
    own = series_head(foreshockd, run, "loss", head=1)
    assert own == [(s, 3.0) for s in range(5)] + [(s, 5.0) for s in range(5, 15)], own
    rank0.close(timeout=10)
    restarted.close(timeout=10)
    assert run_info(foreshockd, run).ended


def test_the_merge_of_ranks_is_recovered_after_kill_9_as_acknowledged(start_foreshockd):
    # A 2-rank run with rank 0 ten acknowledged steps ahead (steps 5-14 wait
    # for rank 1), then kill -9, with no detector checkpoint since (a long
    # --checkpoint_interval_s). After the restart rank 1 sends steps 5-15
    # and rank 0 step 15: the run-level loss at 5-14 is the mean of both
    # ranks, as acknowledged, not rank 1's value alone.
    daemon = start_foreshockd("--checkpoint_interval_s=3600")
    run = "merge-kill9"
    labels = {"world_size": "2"}
    monitors = [Monitor(daemon.endpoint, run_id=run, job="own", rank=rank, labels=labels,
                        backoff_initial_s=0.05, backoff_max_s=0.5) for rank in (0, 1)]
    rank0, rank1 = monitors
    for step in range(5):
        rank0.step(step, loss=1.0)
        rank1.step(step, loss=3.0)
    assert wait_until(lambda: rank1.stats()["acked_records"] >= 5, 20)
    for step in range(5, 15):
        rank0.step(step, loss=1.0)
    assert wait_until(lambda: rank0.stats()["acked_records"] >= 15, 20)
    daemon.stop(sig=signal.SIGKILL)
    daemon.start()
    for step in range(5, 16):
        rank1.step(step, loss=3.0)
    rank0.step(15, loss=1.0)
    assert wait_until(lambda: rank0.stats()["acked_records"] >= 16
                      and rank1.stats()["acked_records"] >= 16, 30)
    points = series(daemon, run, "loss")
    assert [s for s, _ in points] == list(range(16)), points
    assert [v for _, v in points] == [2.0] * 16, points
    for monitor in monitors:
        monitor.close(timeout=10)


# -- forgetting (--forget_runs_idle_s) ------------------------------------------

def test_many_runs_that_stopped_streaming_are_forgotten_and_memory_follows(start_foreshockd):
    """A long-lived sidecar sees run after run. Each run here streams enough
    losses for the alert engine to keep baselines, then stops: half end with
    monitor.close(), half vanish (close without the goodbye) with an alert
    firing. After --forget_runs_idle_s every one is forgotten: the engine
    keeps no baseline, /metrics holds none of their series and their run
    slots are free, while ListAlerts and ListRuns still hold them."""
    daemon = start_foreshockd("--forget_runs_idle_s=1", "--max_runs=12",
                              "--max_runs_per_tenant=0")
    runs = [f"forget-{i}" for i in range(12)]
    for i, run in enumerate(runs):
        monitor = Monitor(daemon.endpoint, run_id=run, job="forgetting")
        for step in range(40):
            monitor.step(step, loss=float("nan") if step == 39 and i % 2 else 2.0 - 0.01 * step)
        monitor.close(timeout=10, end=i % 2 == 0)

    def metric(samples, name, **labels):
        return sum(v for n, l, v in samples
                   if n == name and all(l.get(k) == x for k, x in labels.items()))

    samples, ok = daemon.wait_for(
        lambda s: metric(s, "foreshock_runs_forgotten_total") == len(runs), timeout_s=60)
    assert ok, daemon.log_tail()
    assert metric(samples, "foreshock_alert_baseline_series") == 0
    assert metric(samples, "foreshock_metrics_signal_series") == 0
    assert not [(n, l) for n, l, _ in samples if l.get("run", "").startswith("forget-")]
    for i, run in enumerate(runs):
        assert run_info(daemon, run) is not None  # still listed
        alerts = list_alerts(daemon, run)
        if i % 2:
            assert [(a.alertname, a.state, a.resolved_reason) for a in alerts] == [
                ("ForeshockNonFinite", "resolved", "run_idle")], alerts
        assert len(series(daemon, run, "loss")) in (39, 40)  # the stored points stay
    # Every slot of --max_runs is free again: a new run is admitted.
    fresh = Monitor(daemon.endpoint, run_id="after-forgetting", job="forgetting")
    fresh.step(0, loss=1.0)
    fresh.close(timeout=10)
    assert fresh.stats()["goodbye_acked"], fresh.stats()
    assert "is forgotten" in daemon.log_tail(200000)
