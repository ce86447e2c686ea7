"""Replay determinism: a short real training with the low-precision attention
fault streams to a foreshockd that records its ingest stream (--record_dir);
`foreshockctl replay` then streams the recording into fresh daemons, which
must raise the same alerts (name, layer, state, first, firing and resolved
step, probable cause and whether it is settled, value) and hold the same
series values at every step.

The live daemon and the first replay run one worker, so that samples are
processed in arrival order, which a replay reproduces: everything matches. A
replay into a daemon with several workers must still give the same series
(each series is processed in order by one worker) and the same alerts that
fired, with the same settled probable cause (the engine settles the cause on
the slowest layer's progress, counting only what fired by the settle step).
Episodes that went pending and never fired match in name, layer and first
step; their provisional annotations may differ, since the layers reach the
engine in a different order."""
import glob
import json
import math
import os
import re
import subprocess
import sys

import grpc
import pytest

from conftest import ROOT, Daemon, foreshockd_binary, wait_until
from foreshock import prometheus
from foreshock.v1 import query_pb2, query_pb2_grpc
from test_foreshockctl import ctl

RUN = "replay-det"
# The demo's detectors warm up for 40 probes: probing every 5 steps, the
# low-precision fault (x64) at step 250 fires alerts by ~step 300 and the
# loss diverges by ~step 380.
TRAIN_ARGS = ["--run-id", RUN, "--steps", "400", "--warmup", "50", "--every", "5",
              "--fault", "lowprec", "--fault-step", "250", "--fault-strength", "64",
              "--log-every", "100", "--seed", "0",
              # For foreshockctl backtest: what was injected, and when.
              "--label", "injection_step=250", "--label", "expected_cause=low_precision_attention"]


def wait_processed(daemon, timeout_s=60):
    """Until every accepted record has run through the detectors (and so
    through the alert engine) and nothing is queued."""
    def done(samples):
        accepted = sum(v for n, l, v in samples if n == "foreshock_ingest_records_total")
        processed = sum(v for n, l, v in samples if n == "foreshock_samples_processed_total")
        queued = prometheus.value(samples, "foreshock_queue_bytes")
        return accepted > 0 and processed >= accepted and queued == 0
    samples, ok = daemon.wait_for(done, timeout_s=timeout_s)
    assert ok, "the daemon did not finish processing"
    return samples


def alerts_of(endpoint):
    out = ctl("alerts", "--all", "--json", "--run", RUN, "--endpoint", endpoint)
    assert out.returncode == 0, out
    return sorted(
        (a["alertname"], a["layer"], a["signal"], a["severity"], a["state"], int(a["first_step"]),
         int(a["firing_step"]), int(a["resolved_step"]), a["probable_cause"],
         a["probable_cause_settled"], repr(a["value"]))
        for a in json.loads(out.stdout)["alerts"])


def series_of(endpoint):
    """{(signal, layer, head): [(step, value), ...]} for every series of the run."""
    with grpc.insecure_channel(endpoint) as channel:
        stub = query_pb2_grpc.QueryStub(channel)
        listed = stub.ListSeries(query_pb2.ListSeriesRequest(run=RUN), timeout=10).series
        out = {}
        for s in listed:
            response = stub.GetSeries(query_pb2.GetSeriesRequest(
                run=RUN, signal=s.signal, layer=s.layer, head=s.head), timeout=10)
            assert not response.downsampled
            out[(s.signal, s.layer, s.head)] = [
                (p.step, "nan" if math.isnan(p.value) else p.value) for p in response.points]
        return out



def replay_into(tmp_path, name, recording, *flags):
    """A fresh daemon with `flags`, the recording replayed into it, its
    alerts, series and loss CSV once everything is processed."""
    daemon = Daemon(foreshockd_binary(), str(tmp_path / name),
                    [f"--data_dir={tmp_path / (name + '-data')}", *flags])
    os.makedirs(daemon.log_dir)
    daemon.start()
    try:
        out = ctl("replay", recording["file"], "--to", daemon.endpoint, "--json", timeout=120)
        assert out.returncode == 0, out
        (result,) = json.loads(out.stdout)
        assert result["ok"] and result["tail"] == "end" and result["hellos"] == 1
        assert result["frames"] == recording["frames"]
        assert result["acks"] == result["batches"] > 400 and result["rejected"] == 0
        assert result["accepted"] == result["records"]
        samples = wait_processed(daemon)
        assert sum(v for n, l, v in samples if n == "foreshock_ingest_records_total") == \
            result["accepted"]
        return dict(alerts=alerts_of(daemon.endpoint), series=series_of(daemon.endpoint),
                    loss_csv=ctl("series", RUN, "loss", "--csv", "--endpoint",
                                 daemon.endpoint).stdout)
    finally:
        daemon.stop()


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    """The live run: a faulted training into a recording one-worker daemon."""
    tmp_path = tmp_path_factory.mktemp("live")
    record_dir = tmp_path / "recordings"
    live = Daemon(foreshockd_binary(), str(tmp_path / "live"),
                  ["--workers=1", f"--record_dir={record_dir}", f"--data_dir={tmp_path / 'data'}"])
    os.makedirs(live.log_dir)
    live.start()
    try:
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "client", "python"), ROOT]))
        train = subprocess.run(
            [sys.executable, os.path.join(ROOT, "demo", "train.py"), "--endpoint", live.endpoint,
             *TRAIN_ARGS], capture_output=True, text=True, timeout=240, env=env)
        assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
        wait_processed(live)
        alerts = alerts_of(live.endpoint)
        series = series_of(live.endpoint)
        loss_csv = ctl("series", RUN, "loss", "--csv", "--endpoint", live.endpoint).stdout
        # The stream has ended: every message it received is on disk.
        samples, ok = live.wait_for(lambda s: (prometheus.value(
            s, "foreshock_record_frames_total", outcome="written") or 0) > 400)
        assert ok, "the recorder did not write the stream's messages"
        frames = prometheus.value(samples, "foreshock_record_frames_total", outcome="written")
        assert prometheus.value(samples, "foreshock_record_frames_total", outcome="dropped") == 0
    finally:
        live.stop()

    # Fired (firing_step set): at the end of the run (monitor.close()) they resolve.
    assert any(a[6] >= 0 for a in alerts), \
        f"the faulted run raised no alert, nothing to compare:\n{train.stdout[-3000:]}"
    assert len(series) > 50 and len(series[("loss", -1, -1)]) == 400
    files = glob.glob(str(record_dir / "*.fsrec"))
    assert len(files) == 1, files
    assert re.fullmatch(rf"\d{{8}}T\d{{6}}-{RUN}-rank0-s\d+\.fsrec", os.path.basename(files[0]))
    return dict(file=files[0], frames=frames, alerts=alerts, series=series, loss_csv=loss_csv)


@pytest.fixture(scope="module")
def two_worker_replay(recording, tmp_path_factory):
    return replay_into(tmp_path_factory.mktemp("replay2"), "two", recording, "--workers=2")


def assert_same_series(replayed, live):
    assert replayed["series"].keys() == live["series"].keys()
    for key in live["series"]:
        assert replayed["series"][key] == live["series"][key], key
    # Through foreshockctl too: the same (step, value) rows; wall times differ.
    strip = lambda csv: [row.rsplit(",", 1)[0] for row in csv.splitlines()]  # noqa: E731
    assert strip(replayed["loss_csv"]) == strip(live["loss_csv"])
    assert len(strip(live["loss_csv"])) == 401


def test_replay_into_a_one_worker_daemon_gives_the_same_alerts_and_series(recording, tmp_path):
    replayed = replay_into(tmp_path, "one", recording, "--workers=1")
    assert replayed["alerts"] == recording["alerts"]
    assert_same_series(replayed, recording)


def test_replay_into_a_two_worker_daemon_gives_the_same_series(recording, two_worker_replay):
    assert_same_series(two_worker_replay, recording)


def test_replay_into_a_two_worker_daemon_gives_the_same_alerts(recording, two_worker_replay):
    def split(alerts):
        fired = [a for a in alerts if a[4] in ("firing", "resolved")]
        never = [a[:3] + a[4:6] for a in alerts if a[4] not in ("firing", "resolved")]
        return fired, never
    replayed_fired, replayed_never = split(two_worker_replay["alerts"])
    live_fired, live_never = split(recording["alerts"])
    assert live_fired, "the recording should have fired alerts"
    assert replayed_fired == live_fired
    assert replayed_never == live_never


def test_backtest_in_process_reproduces_the_live_alerts(recording):
    """`foreshockctl backtest` (no daemon) replays the recording through the
    same validation, detectors and alert engine: every alert episode the live
    one-worker daemon fired, at the same steps; the divergence by the same rule
    as demo/train.py; and the probable cause of the low-precision fault (the
    demo reports its emulated attention as bf16)."""
    out = ctl("backtest", os.path.dirname(recording["file"]), "--json", timeout=120)
    assert out.returncode == 0, out
    doc = json.loads(out.stdout)
    assert doc["errors"] == []
    (run,) = doc["runs"]
    assert run["run_id"] == RUN and run["rejected"] == 0 and run["error"] == ""
    assert run["labels"]["warmup_steps"] == "50" and run["labels"]["fault"] == "lowprec"
    # The live daemon lists each alert's latest episode: the backtest's last
    # firing of each (alertname, layer) is that one.
    last = {}
    for a in run["alerts"]:
        last[(a["alertname"], a["layer"])] = (a["first_step"], a["step"])
    live = {(a[0], a[1]): (a[5], a[6]) for a in recording["alerts"] if a[6] >= 0}
    assert live and last == live
    # Divergence: demo/train.py's rule on the live loss series.
    sys.path.insert(0, os.path.join(ROOT, "demo"))
    import train  # noqa: E402
    rows = [r.split(",") for r in recording["loss_csv"].splitlines()[1:]]
    losses = [float(r[1]) for r in rows]
    assert run["divergence_step"] == train.divergence_step(losses, 50)
    # Labeled: a fault run injected at 250 whose alerts all came after it.
    assert run["fault"] and run["injection_step"] == 250 and run["false_alarms"] == 0
    assert run["first_alert_step"] == min(a["step"] for a in run["alerts"]) >= 250
    if run["divergence_step"] is not None:
        assert run["lead"] == run["divergence_step"] - run["first_alert_step"]
    assert run["cause"] == "low_precision_attention" and run["cause_correct"], run["alerts"]
