"""Alerts reach a real Alertmanager (Debian's prometheus-alertmanager on
loopback): labels and annotations as docs/DESIGN.md §5.4 fixes them, resolve
sets endsAt, and an Alertmanager started only after the alert fired still
receives it. Also the gRPC Query service: ListAlerts and WatchAlerts."""
import json
import shutil
import subprocess
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest

from conftest import free_port, wait_until
from foreshock.v1 import ingest_pb2, ingest_pb2_grpc, query_pb2, query_pb2_grpc

ALERTMANAGER = shutil.which("prometheus-alertmanager") or "/usr/bin/prometheus-alertmanager"
CONFIG = """
route:
  receiver: blackhole
  group_wait: 0s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: blackhole
"""


class Alertmanager:
    def __init__(self, tmp_path, port=None):
        self.port = port or free_port()
        self.tmp_path = tmp_path
        self.process = None

    def start(self):
        config = self.tmp_path / "alertmanager.yml"
        config.write_text(CONFIG)
        self.log = open(self.tmp_path / "alertmanager.log", "ab")
        self.process = subprocess.Popen(
            [ALERTMANAGER, f"--config.file={config}", f"--storage.path={self.tmp_path / 'am-data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address="],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        assert wait_until(self._ready, timeout_s=30), (self.tmp_path / "alertmanager.log").read_text()
        return self

    def _ready(self):
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def alerts(self):
        with urllib.request.urlopen(f"{self.url}/api/v2/alerts", timeout=5) as r:
            return json.load(r)

    def stop(self):
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process:
            self.log.close()


@pytest.fixture
def alertmanager(tmp_path):
    assert shutil.which("prometheus-alertmanager") or shutil.os.access(ALERTMANAGER, shutil.os.X_OK), \
        "Debian's prometheus-alertmanager is required (scripts/test installs it)"
    am = Alertmanager(tmp_path)
    yield am
    am.stop()


def qk_record(step, values):
    record = ingest_pb2.Record(step=step)
    record.qk.layer = 0
    record.qk.causal = True
    for tensor in (record.qk.q, record.qk.k):
        tensor.dtype = ingest_pb2.FLOAT32
        tensor.shape.extend(values.shape)
        tensor.data = values.astype("<f4").tobytes()
    return record


def send(endpoint, run, steps_and_values):
    """One stream: Hello, then one Batch per (step, values)."""
    hello = ingest_pb2.Hello(run_id=run, job="alert-test",
                             model=ingest_pb2.ModelInfo(n_layers=2, n_heads=2, head_dim=4))
    requests = [ingest_pb2.StreamRequest(hello=hello)] + [
        ingest_pb2.StreamRequest(batch=ingest_pb2.Batch(seq=i + 1, records=[qk_record(step, v)]))
        for i, (step, v) in enumerate(steps_and_values)]
    with grpc.insecure_channel(endpoint) as channel:
        responses = list(ingest_pb2_grpc.IngestStub(channel).Stream(iter(requests), timeout=30))
    assert all(r.ack.accepted == 1 for r in responses if r.HasField("ack"))


def nan_values():
    v = np.random.default_rng(0).normal(size=(2, 8, 4))
    v[1, 3, 2] = np.nan
    return v


def finite_values(seed):
    return np.random.default_rng(seed).normal(size=(2, 8, 4))


def find(alerts, alertname, run):
    return [a for a in alerts if a["labels"].get("alertname") == alertname
            and a["labels"].get("run") == run]


def test_nonfinite_alert_reaches_alertmanager_and_resolves(start_foreshockd, alertmanager):
    alertmanager.start()
    daemon = start_foreshockd(f"--alertmanager_url={alertmanager.url}", "--alertmanager_resend_s=60")
    send(daemon.endpoint, "am-run", [(10, nan_values())])

    assert wait_until(lambda: find(alertmanager.alerts(), "ForeshockNonFinite", "am-run"), 20)
    (alert,) = find(alertmanager.alerts(), "ForeshockNonFinite", "am-run")
    labels, annotations = alert["labels"], alert["annotations"]
    assert labels["layer"] == "all" and labels["signal"] and labels["severity"]
    assert "job" not in labels  # Prometheus owns `job`
    for key in ("summary", "description", "probable_cause", "suggested_action", "first_step"):
        assert annotations.get(key), (key, annotations)
    assert annotations["first_step"] == "10"
    assert annotations["probable_cause"] in ("low_precision_attention", "learning_rate_too_high",
                                             "combined", "unknown")
    assert alert["status"]["state"] == "active"
    samples, ok = daemon.wait_for(lambda s: any(
        n == "foreshock_alert_active" and l.get("alertname") == "ForeshockNonFinite" and v == 1
        for n, l, v in s))
    assert ok

    # Finite samples at later steps resolve it: Alertmanager gets endsAt and
    # stops listing it (a firing alert would stay listed: its endsAt is 3 min out).
    send(daemon.endpoint, "am-run", [(20 + i, finite_values(i)) for i in range(20)])
    assert wait_until(lambda: not find(alertmanager.alerts(), "ForeshockNonFinite", "am-run"), 20), \
        alertmanager.alerts()
    samples, ok = daemon.wait_for(lambda s: any(
        n == "foreshock_alert_active" and l.get("alertname") == "ForeshockNonFinite" and v == 0
        for n, l, v in s))
    assert ok


def test_alertmanager_started_after_the_alert_still_receives_it(start_foreshockd, tmp_path):
    am = Alertmanager(tmp_path)  # port chosen, nothing listening yet
    daemon = start_foreshockd(f"--alertmanager_url={am.url}")
    try:
        send(daemon.endpoint, "late-am", [(5, nan_values())])
        samples, ok = daemon.wait_for(lambda s: any(
            n == "foreshock_alertmanager_posts_total" and l.get("result") == "error" and v >= 1
            for n, l, v in s))
        assert ok, "the daemon should have tried and failed to deliver"
        am.start()
        assert wait_until(lambda: find(am.alerts(), "ForeshockNonFinite", "late-am"), 45)
    finally:
        am.stop()


def test_alertmanager_killed_and_restarted_gets_every_firing_alert_back(start_foreshockd,
                                                                       alertmanager):
    am = alertmanager.start()
    daemon = start_foreshockd(f"--alertmanager_url={am.url}", "--alertmanager_resend_s=1")
    send(daemon.endpoint, "am-before", [(5, nan_values())])
    assert wait_until(lambda: find(am.alerts(), "ForeshockNonFinite", "am-before"), 30)
    # kill -9: Alertmanager keeps alerts in memory only, so they are gone with it.
    am.process.kill()
    am.process.wait()
    am.log.close()
    send(daemon.endpoint, "am-during", [(7, nan_values())])  # fires while it is down
    samples, ok = daemon.wait_for(lambda s: any(
        n == "foreshock_alertmanager_posts_total" and l.get("result") == "error" and v >= 1
        for n, l, v in s))
    assert ok, "the daemon should have tried and failed to deliver"
    am.start()  # same port, fresh memory
    assert wait_until(lambda: find(am.alerts(), "ForeshockNonFinite", "am-during")
                      and find(am.alerts(), "ForeshockNonFinite", "am-before"), 45), am.alerts()


def test_query_service_lists_and_streams_alerts(foreshockd):
    events = []
    with grpc.insecure_channel(foreshockd.endpoint) as channel:
        stub = query_pb2_grpc.QueryStub(channel)
        call = stub.WatchAlerts(query_pb2.WatchAlertsRequest(run="watched"))
        def read():
            try:
                for event in call:
                    events.append(event)
            except grpc.RpcError as error:  # the cancel below ends the stream
                assert error.code() == grpc.StatusCode.CANCELLED

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        time.sleep(0.3)  # the watch is registered before the alert happens
        send(foreshockd.endpoint, "other-run", [(1, nan_values())])
        send(foreshockd.endpoint, "watched", [(7, nan_values())])
        assert wait_until(lambda: any(e.to_state == "firing" for e in events), 20)
        call.cancel()
        reader.join(5)
        assert all(e.alert.run == "watched" for e in events)  # the run filter holds
        firing = [e for e in events if e.to_state == "firing"][0]
        assert firing.alert.alertname == "ForeshockNonFinite" and firing.step == 7
        assert firing.alert.labels["alertname"] == "ForeshockNonFinite"
        assert firing.alert.annotations["first_step"] == "7"

        listed = stub.ListAlerts(query_pb2.ListAlertsRequest(), timeout=5).alerts
        assert {a.run for a in listed} >= {"watched", "other-run"}
        only = stub.ListAlerts(query_pb2.ListAlertsRequest(run="watched"), timeout=5).alerts
        assert [a.alertname for a in only] == ["ForeshockNonFinite"]
        assert only[0].state == "firing" and only[0].starts_at_unix_ms > 0


def test_faulted_training_run_alert_reaches_alertmanager(start_foreshockd, alertmanager):
    """A real training run of the demo model with a numerical fault injected."""
    from demo import train
    alertmanager.start()
    daemon = start_foreshockd(f"--alertmanager_url={alertmanager.url}")
    args = train.parse_args(["--endpoint", daemon.endpoint, "--run-id", "am-training",
                             "--steps", "40", "--every", "5", "--fault", "nan", "--fault-step",
                             "25", "--curvature-every", "0", "--no-alerts", "--log-every", "0"])
    seen = {}

    def tap(record):  # on the training thread: step 35 waits until Alertmanager has the alert
        if record.step == 35 and "alerts" not in seen:
            wait_until(lambda: find(alertmanager.alerts(), "ForeshockNonFinite", "am-training"), 20)
            seen["alerts"] = find(alertmanager.alerts(), "ForeshockNonFinite", "am-training")

    train.run(args, tap=tap, out=lambda *_: None)
    assert seen["alerts"], "the alert did not reach Alertmanager while the run trained"
    (alert,) = seen["alerts"]
    assert alert["annotations"]["first_step"] == "25"
    assert alert["labels"]["run"] == "am-training" and alert["labels"]["layer"] == "all"
    # train.run closed its monitor, which ended the run: Alertmanager got the resolution.
    assert wait_until(lambda: not find(alertmanager.alerts(), "ForeshockNonFinite", "am-training"),
                      20), alertmanager.alerts()
