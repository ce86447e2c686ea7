"""Alert history (issue 36): every episode of every alert is kept and listed.

A run's loss spikes twice (steps 300-309 and 420-429), so ForeshockLossSpike
and ForeshockLossDiverging each fire, resolve and fire again. What
WatchAlerts delivered as it happened is the reference: ListAlerts with
include_resolved (gRPC), /api/v1/alerts and `foreshockctl alerts --all` must
list one entry per episode with the steps the stream announced, the run's
first alert must be the first firing step, and a restarted daemon (SIGTERM,
then SIGKILL after a checkpoint) must list the same.
"""
import json
import math
import random
import signal
import subprocess
import time
import urllib.request

import grpc

from conftest import AlertWatch, Daemon, foreshockd_binary, wait_until
from foreshock.v1 import ingest_pb2, ingest_pb2_grpc, query_pb2, query_pb2_grpc
from test_foreshockctl import foreshockctl_binary
from test_web_ui import Chromium, chromium_binary

RUN = "flap"
SPIKES = ((300, 310), (420, 430))
STEPS = 560
FLAPPING = ("ForeshockLossSpike", "ForeshockLossDiverging")


def loss(step):
    if any(lo <= step < hi for lo, hi in SPIKES):
        return 10.0
    return 2.0 + 0.01 * math.sin(step * 0.7)


def stream(endpoint, run, steps, value=loss, per_batch=10):
    """One Ingest stream of scalar records; every record must be accepted."""
    def requests():
        yield ingest_pb2.StreamRequest(hello=ingest_pb2.Hello(run_id=run, job="history"))
        for seq, first in enumerate(range(steps[0], steps[-1] + 1, per_batch), start=1):
            batch = ingest_pb2.Batch(seq=seq)
            for step in range(first, min(first + per_batch, steps[-1] + 1)):
                record = batch.records.add(step=step)
                record.scalars.loss = value(step)
                record.scalars.grad_norm = 1.0
            yield ingest_pb2.StreamRequest(batch=batch)
    with grpc.insecure_channel(endpoint) as channel:
        acks = [r.ack for r in ingest_pb2_grpc.IngestStub(channel).Stream(requests(), timeout=60)
                if r.HasField("ack")]
    assert sum(a.accepted for a in acks) == len(steps), acks


def list_alerts(daemon, run=RUN):
    with grpc.insecure_channel(daemon.endpoint) as channel:
        return list(query_pb2_grpc.QueryStub(channel).ListAlerts(
            query_pb2.ListAlertsRequest(run=run, include_resolved=True), timeout=30).alerts)


def episode_key(alert):
    return (alert.alertname, alert.layer, alert.attempt, alert.episode)


def episode_row(alert):
    """What must not change: which episode, its state and its steps."""
    return (alert.alertname, alert.layer, alert.attempt, alert.episode, alert.state,
            alert.pending_step, alert.first_step, alert.firing_step, alert.resolved_step,
            alert.starts_at_unix_ms, alert.ends_at_unix_ms)


def test_every_episode_is_listed_and_agrees_with_the_stream(tmp_path):
    daemon = Daemon(foreshockd_binary(), str(tmp_path), ["--checkpoint_interval_s=1"])
    try:
        check_history(daemon, tmp_path)
    finally:
        daemon.stop()


def check_history(daemon, tmp_path):
    daemon.start()
    watcher = AlertWatch(daemon.endpoint)
    try:
        # Subscribed once it sees an alert of a run streamed after it started:
        # a non-finite loss fires ForeshockNonFinite at once.
        for attempt in range(20):
            stream(daemon.endpoint, f"sync-{attempt}", [0], value=lambda _: float("nan"))
            if wait_until(lambda: any(e.alert.run == f"sync-{attempt}" for e in watcher.events),
                          timeout_s=3):
                break
        else:
            raise AssertionError("WatchAlerts delivered no alert of a run streamed after it")
        stream(daemon.endpoint, RUN, list(range(STEPS)))
        ended_by_signal = lambda: sum(  # noqa: E731
            1 for e in watcher.events if e.alert.run == RUN and e.to_state == "resolved") >= 4
        assert wait_until(ended_by_signal, timeout_s=30), [
            (e.alert.alertname, e.from_state, e.to_state, e.step) for e in watcher.events]
    finally:
        watcher.close()
    events = [e for e in watcher.events if e.alert.run == RUN]

    # The reference: the last event of each episode is its state now.
    streamed = {}
    for event in events:
        streamed[episode_key(event.alert)] = event.alert
    for name in FLAPPING:
        fired = sorted(e.step for e in events
                       if e.alert.alertname == name and e.to_state == "firing")
        assert len(fired) == 2 and SPIKES[0][0] <= fired[0] < SPIKES[1][0] <= fired[1], (name, fired)

    listed = list_alerts(daemon)
    by_key = {episode_key(a): a for a in listed}
    assert len(by_key) == len(listed), "two rows for one episode"
    assert set(by_key) == set(streamed), (sorted(by_key), sorted(streamed))
    for key, alert in streamed.items():
        assert episode_row(by_key[key]) == episode_row(alert), (key, by_key[key], alert)
    for name in FLAPPING:
        rows = [a for a in listed if a.alertname == name]
        assert [a.episode for a in rows] == [1, 2], rows  # ordered by episode
        for alert, event_steps in zip(rows, SPIKES):
            assert alert.state == "resolved" and event_steps[0] <= alert.firing_step < event_steps[1]
            assert alert.resolved_step > alert.firing_step and alert.ends_at_unix_ms > 0
            firing_event = [e for e in events if episode_key(e.alert) == episode_key(alert)
                            and e.to_state == "firing"]
            assert len(firing_event) == 1 and firing_event[0].step == alert.firing_step
    first_firing = min(a.firing_step for a in listed if a.firing_step >= 0)
    assert first_firing == min(e.step for e in events if e.to_state == "firing")
    assert SPIKES[0][0] <= first_firing < SPIKES[0][1]

    # The HTTP API lists the same episodes.
    url = (f"http://127.0.0.1:{daemon.metrics_port}/api/v1/alerts?run={RUN}"
           "&include_resolved=true")
    with urllib.request.urlopen(url, timeout=10) as response:
        api = json.load(response)["alerts"]
    assert sorted((a["alertname"], a["layer"], a["episode"], a["firing_step"]) for a in api) == \
        sorted((a.alertname, a.layer, a.episode, str(a.firing_step)) for a in listed)

    # foreshockctl: one row per episode, EPISODE 1 and 2 with their own steps.
    out = subprocess.run([foreshockctl_binary(), "alerts", "--all", "--run", RUN,
                          "--endpoint", daemon.endpoint], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out
    header, *lines = out.stdout.splitlines()
    columns = header.split()
    rows = [dict(zip(columns, line.split())) for line in lines]
    for name in FLAPPING:
        mine = [r for r in rows if r["ALERTNAME"] == name]
        expected = [a for a in listed if a.alertname == name]
        assert [(r["EPISODE"], r["FIRING_STEP"], r["RESOLVED_STEP"]) for r in mine] == \
            [(str(a.episode), str(a.firing_step), str(a.resolved_step)) for a in expected], out.stdout
    assert len(rows) == len(listed)

    # A restart: a clean stop, then SIGKILL after a checkpoint. Same record.
    before = sorted(episode_row(a) for a in listed)
    daemon.stop()
    daemon.start()
    assert sorted(episode_row(a) for a in list_alerts(daemon)) == before
    time.sleep(2.5)  # a checkpoint of the restarted daemon
    daemon.stop(sig=signal.SIGKILL)
    daemon.start()
    assert sorted(episode_row(a) for a in list_alerts(daemon)) == before

    # The web UI, after the restarts: a band per firing interval on the loss
    # chart, and the run's first alert at the first firing step.
    chromium = Chromium(chromium_binary(), tmp_path)
    dom = chromium.dom(f"http://127.0.0.1:{daemon.metrics_port}/#/run/{RUN}", "run")
    chart = dom.find(id="loss-chart")
    bands = {(b.attrs["data-alertname"], b.attrs["data-episode"], b.attrs["data-kind"]):
             (b.attrs["data-from"], b.attrs["data-to"])
             for b in chart.find_all("rect", cls="episode-band")}
    for alert in listed:
        if alert.firing_step >= 0:
            assert bands.get((alert.alertname, str(alert.episode), "firing")) == \
                (str(alert.firing_step), str(alert.resolved_step)), (alert.alertname, bands)
    assert chart.find(id="marker-first-alert").attrs["data-step"] == str(first_firing)
    rows = dom.find("table", id="alerts").find_all("tr", cls="alert-row")
    assert sorted((r.attrs["data-alertname"], r.attrs["data-episode"]) for r in rows) == \
        sorted((a.alertname, str(a.episode)) for a in listed)


def test_a_held_alert_is_a_hatched_band_with_its_reason(tmp_path):
    """A curvature surge with nothing to corroborate it stays pending, held
    (docs/DESIGN.md: a surge alone is often an edge-of-stability excursion);
    the UI draws its pending interval hatched, with the reason."""
    daemon = Daemon(foreshockd_binary(), str(tmp_path))
    daemon.start()
    try:
        rng = random.Random(5)

        def requests():
            yield ingest_pb2.StreamRequest(hello=ingest_pb2.Hello(run_id="held", job="history"))
            for seq, step in enumerate(range(0, 900, 10), start=1):
                batch = ingest_pb2.Batch(seq=seq)
                record = batch.records.add(step=step)
                record.scalars.loss = 2.0 + 0.01 * math.sin(step)
                level = 10.0 if step < 600 else 100.0  # a tenfold surge at step 600
                record.curvature.lambda_max = level * math.exp(rng.gauss(0, 0.1))
                record.curvature.residual = 0.01
                record.curvature.hvps = 9
                record.curvature.lr = 1e-3
                record.curvature.beta1 = 0.9
                yield ingest_pb2.StreamRequest(batch=batch)
        with grpc.insecure_channel(daemon.endpoint) as channel:
            acks = [r.ack for r in ingest_pb2_grpc.IngestStub(channel).Stream(requests(), timeout=60)
                    if r.HasField("ack")]
        assert sum(a.accepted for a in acks) == 90, acks

        def held_alert():
            held = [a for a in list_alerts(daemon, "held")
                    if a.signal == "curvature_lambda_max" and " Held: " in a.description]
            return held[0] if held else None
        assert wait_until(held_alert, timeout_s=30), list_alerts(daemon, "held")
        alert = held_alert()
        assert alert.state == "pending" and alert.firing_step == -1 and alert.pending_step >= 600
        reason = alert.description.split(" Held: ", 1)[1]

        chromium = Chromium(chromium_binary(), tmp_path)
        dom = chromium.dom(f"http://127.0.0.1:{daemon.metrics_port}/#/run/held", "run")
        (chart,) = [c for c in dom.find_all("div", cls="run-signal")
                    if c.attrs["data-signal"] == "curvature_lambda_max"]
        bands = chart.find_all("rect", cls="episode-band", data_alertname=alert.alertname)
        assert len(bands) == 1, [b.attrs for b in bands]
        band = bands[0]
        assert "held" in band.classes and "pending" in band.classes, band.attrs
        assert band.attrs["data-from"] == str(alert.pending_step)
        assert band.attrs["data-held"] == reason.strip()
    finally:
        daemon.stop()
