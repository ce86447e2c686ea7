"""foreshockctl against a real foreshockd: usage and exit codes, the
unreachable-daemon error (at once for a refused connection, after --timeout_s
for a silent endpoint), `alerts --json`, NOT_FOUND for an unknown run,
`watch` until SIGINT, `runs`, and `series --csv` rows against the points
sent."""
import json
import math
import os
import signal
import socket
import subprocess
import threading
import time

import grpc
import numpy as np
import pytest

from conftest import free_port, foreshockd_binary, wait_until
from foreshock.v1 import ingest_pb2, ingest_pb2_grpc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def foreshockctl_binary():
    """$FORESHOCKCTL, else next to the daemon under test (build/ctl/foreshockctl)."""
    path = os.environ.get("FORESHOCKCTL")
    if not path:
        build = os.path.dirname(os.path.dirname(foreshockd_binary()))
        path = os.path.join(build, "ctl", "foreshockctl")
    if not os.access(path, os.X_OK):
        pytest.fail(f"no foreshockctl at {path} (build the foreshockctl target)")
    return path


def ctl(*args, timeout=30):
    return subprocess.run([foreshockctl_binary(), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


def stream(endpoint, run, batches):
    """One Ingest stream: Hello, then the batches; returns the acks."""
    hello = ingest_pb2.Hello(run_id=run, job="ctl-test",
                             model=ingest_pb2.ModelInfo(n_layers=2, n_heads=2, head_dim=4))
    requests = [ingest_pb2.StreamRequest(hello=hello)] + [
        ingest_pb2.StreamRequest(batch=b) for b in batches]
    with grpc.insecure_channel(endpoint) as channel:
        responses = list(ingest_pb2_grpc.IngestStub(channel).Stream(iter(requests), timeout=30))
    return [r.ack for r in responses if r.HasField("ack")]


def nan_qk_batch(seq, step):
    values = np.random.default_rng(step).normal(size=(2, 8, 4))
    values[1, 3, 2] = np.nan
    batch = ingest_pb2.Batch(seq=seq)
    record = batch.records.add(step=step)
    record.qk.layer = 0
    record.qk.causal = True
    for tensor in (record.qk.q, record.qk.k):
        tensor.dtype = ingest_pb2.FLOAT32
        tensor.shape.extend(values.shape)
        tensor.data = values.astype("<f4").tobytes()
    return batch


# ---------------------------------------------------------------- no daemon

UNREACHABLE_COMMANDS = [
    ["runs"], ["alerts"], ["alerts", "--all", "--json"], ["alerts", "--run", "r"],
    ["series", "r", "loss", "--csv"], ["watch"], ["watch", "--run", "r", "--json"]]


@pytest.mark.parametrize("command", UNREACHABLE_COMMANDS)
def test_refused_connection_fails_at_once_in_one_line_exit_2(command):
    # Nothing listens there: the connection is refused, and that is the answer
    # at once, whatever --timeout_s (default 10 s) says.
    endpoint = f"127.0.0.1:{free_port()}"
    # A ctl that waited out --timeout_s instead would hit ctl()'s own 30 s timeout.
    out = ctl(*command, "--endpoint", endpoint, "--timeout_s", "600")
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert endpoint in lines[0] and "cannot reach foreshockd" in lines[0], lines[0]
    assert "connection refused" in lines[0], lines[0]
    assert out.stdout == ""


@pytest.fixture
def silent_endpoint():
    """A port that accepts TCP connections (into the listen backlog) and never
    says anything: the connection neither completes nor fails."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"127.0.0.1:{listener.getsockname()[1]}"


@pytest.mark.parametrize("command", [["runs"], ["alerts", "--run", "r"], ["watch"]])
def test_silent_endpoint_is_waited_for_up_to_timeout_s(silent_endpoint, command):
    started = time.monotonic()
    out = ctl(*command, "--endpoint", silent_endpoint, "--timeout_s", "2")
    took = time.monotonic() - started
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert silent_endpoint in lines[0] and "no connection within 2 s" in lines[0], lines[0]
    assert took >= 1.8, took  # it waited out its timeout; ctl()'s own timeout catches a hang


def test_replay_into_an_unreachable_daemon_exits_2(tmp_path):
    # A valid, empty recording: header only.
    path = tmp_path / "empty.fsrec"
    path.write_bytes(b"FSHKREC1" + (1).to_bytes(4, "little") + bytes(4))
    endpoint = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    out = ctl("replay", path, "--to", endpoint)
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and endpoint in lines[0] and "connection refused" in lines[0], out
    assert "--to" in lines[0], lines[0]  # the option that names the address


def test_usage_errors_exit_2_and_help_exits_0(tmp_path):
    for args in (["bogus"], ["alerts", "--bogus"], ["series", "only-run"], ["runs", "extra"],
                 ["alerts", "--run"], ["series", "r", "s", "--layer", "x"],
                 ["replay", "file.fsrec"], ["replay", "--to", "127.0.0.1:1"],
                 ["replay", "f", "--to", "127.0.0.1:1", "--speed", "warp"],
                 ["--timeout_s", "0", "runs"], []):
        out = ctl(*args)
        assert out.returncode == 2, (args, out)
        assert out.stderr, args
    out = ctl("replay", tmp_path / "missing.fsrec", "--to", "127.0.0.1:1")
    assert out.returncode == 2 and "missing.fsrec" in out.stderr, out

    top = ctl("--help")
    assert top.returncode == 0
    for command in ("runs", "alerts", "watch", "series", "replay", "--endpoint", "--json",
                    "--timeout_s", "127.0.0.1:50051"):
        assert command in top.stdout, command
    for command, words in {"runs": ["ListRuns"], "alerts": ["--run", "--all"],
                           "watch": ["--run", "SIGINT"],
                           "series": ["--layer", "--head", "--from", "--to", "--max_points",
                                      "--csv", "step,value,min,max,count,first_step,last_step"],
                           "replay": ["--to", "--speed", "max", "realtime"]}.items():
        for form in ([command, "--help"], ["help", command]):
            out = ctl(*form)
            assert out.returncode == 0, form
            assert out.stdout.startswith(f"Usage: foreshockctl {command}"), out.stdout
            for word in words:
                assert word in out.stdout, (command, word)


def test_foreshockd_help_documents_record_dir():
    out = subprocess.run([foreshockd_binary(), "--help"], capture_output=True, text=True,
                         timeout=30)
    text = out.stdout + out.stderr
    assert "--record_dir" in text and "foreshockctl replay" in text and ".fsrec" in text


# ---------------------------------------------------------------- with a daemon

def test_alerts_json_table_and_watch(foreshockd):
    endpoint = foreshockd.endpoint
    out = ctl("alerts", "--endpoint", endpoint)
    assert out.returncode == 0 and out.stdout == "no active alerts\n", out

    watch = subprocess.Popen([foreshockctl_binary(), "watch", "--json", "--run", "ctl-alert",
                              "--endpoint", endpoint], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(watch.stdout), daemon=True)
    reader.start()
    try:
        time.sleep(0.5)  # subscribed before the alert happens
        stream(endpoint, "other-run", [nan_qk_batch(1, 3)])
        assert all(a.accepted == 1 for a in stream(endpoint, "ctl-alert", [nan_qk_batch(1, 7)]))
        assert wait_until(lambda: any('"to_state":"firing"' in l for l in lines), 20), lines
    finally:
        watch.send_signal(signal.SIGINT)
        watch.wait(10)
        reader.join(5)
    assert watch.returncode == 0, watch.stderr.read()
    events = [json.loads(l) for l in lines]
    assert all(e["alert"]["run"] == "ctl-alert" for e in events)
    firing = [e for e in events if e["to_state"] == "firing"][0]
    assert firing["alert"]["alertname"] == "ForeshockNonFinite" and firing["step"] == "7"

    out = ctl("alerts", "--json", "--endpoint", endpoint)
    assert out.returncode == 0, out
    alerts = json.loads(out.stdout)["alerts"]
    assert {a["run"] for a in alerts} == {"ctl-alert", "other-run"}
    (alert,) = [a for a in alerts if a["run"] == "ctl-alert"]
    assert alert["alertname"] == "ForeshockNonFinite" and alert["state"] == "firing"
    assert alert["first_step"] == "7" and alert["labels"]["alertname"] == "ForeshockNonFinite"
    for key in ("summary", "description", "probable_cause", "suggested_action"):
        assert alert[key], key

    out = ctl("alerts", "--run", "ctl-alert", "--all", "--endpoint", endpoint)
    assert out.returncode == 0
    header, *rows = out.stdout.splitlines()
    assert header.split()[:6] == ["STATE", "ALERTNAME", "RUN", "ATTEMPT", "EPISODE", "LAYER"]
    assert len(rows) == 1 and rows[0].split()[:6] == ["firing", "ForeshockNonFinite", "ctl-alert",
                                                       "1", "1", "all"]
    # Columns line up: every row starts each column where the header does.
    assert rows[0].index("ForeshockNonFinite") == header.index("ALERTNAME")

    # An unknown run is NOT_FOUND, as for series: one line, the same status.
    series = ctl("series", "no-such-run", "loss", "--endpoint", endpoint)
    assert series.returncode == 1 and "NOT_FOUND" in series.stderr, series
    for extra in ([], ["--json"], ["--all"]):
        out = ctl("alerts", "--run", "no-such-run", *extra, "--endpoint", endpoint)
        assert out.returncode == series.returncode, out
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "NOT_FOUND" in lines[0] and "no-such-run" in lines[0], out
        assert out.stdout == ""
    # A known run without alerts: an empty answer, status 0. "quiet-run" sent
    # finite scalars; "hello-only-run" only its Hello.
    assert sum(a.accepted for a in stream(endpoint, "quiet-run",
                                          [scalars_batch(1, range(5), lambda s: 2.0)])) == 5
    stream(endpoint, "hello-only-run", [])
    for run in ("quiet-run", "hello-only-run"):
        out = ctl("alerts", "--run", run, "--endpoint", endpoint)
        assert out.returncode == 0 and out.stdout == "no active alerts\n", out
        out = ctl("alerts", "--run", run, "--all", "--endpoint", endpoint)
        assert out.returncode == 0 and out.stdout == "no alerts\n", out
        out = ctl("alerts", "--run", run, "--json", "--endpoint", endpoint)
        assert out.returncode == 0 and json.loads(out.stdout) == {"alerts": []}, out

    # The run ends (its sender says goodbye): the alert resolves by the run's
    # lifecycle, and the table says so in its STATE column.
    stream(endpoint, "ctl-alert", [ingest_pb2.Batch(seq=2, goodbye=ingest_pb2.Goodbye())])

    def states():
        out = ctl("alerts", "--run", "ctl-alert", "--all", "--endpoint", endpoint)
        return [row.split()[0] for row in out.stdout.splitlines()[1:]]
    assert wait_until(lambda: states() == ["resolved:run_ended"], 20), states()

    # A watch that the daemon ends (it shuts down) exits non-zero.
    watch = subprocess.Popen([foreshockctl_binary(), "watch", "--endpoint", endpoint],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)
    foreshockd.stop()
    watch.wait(20)
    assert watch.returncode in (1, 2), (watch.returncode, watch.stderr.read())


def scalars_batch(seq, steps, loss):
    batch = ingest_pb2.Batch(seq=seq)
    for step in steps:
        record = batch.records.add(step=step)
        record.scalars.loss = loss(step)
        record.scalars.grad_norm = 1.0 + step / 7.0
    return batch


def test_series_over_the_daemons_query_limit_is_fetched_page_by_page(start_foreshockd):
    # Issue 34: a raw answer over --max_query_mb is refused (RESOURCE_EXHAUSTED,
    # so that a long run cannot take the daemon's memory); foreshockctl
    # series then asks for it in step windows and joins them. 1 MiB is some
    # 4,700 raw points.
    daemon = start_foreshockd("--max_query_mb=1")
    n = 20000
    acks = stream(daemon.endpoint, "ctl-pages", [
        scalars_batch(i + 1, range(i * 5000, (i + 1) * 5000), lambda step: 1.0 + step)
        for i in range(n // 5000)])
    assert sum(a.accepted for a in acks) == n
    out = ctl("series", "ctl-pages", "loss", "--csv", "--endpoint", daemon.endpoint, timeout=120)
    assert out.returncode == 0, out.stderr
    header, *rows = out.stdout.splitlines()
    assert header == "step,value,wall_time_unix_ms"
    assert [int(r.split(",")[0]) for r in rows] == list(range(n))
    assert [float(r.split(",")[1]) for r in rows] == [1.0 + s for s in range(n)]
    # Within a range too, and the daemon did refuse the whole.
    out = ctl("series", "ctl-pages", "loss", "--csv", "--from", "7000", "--to", "17999",
              "--endpoint", daemon.endpoint, timeout=120)
    assert out.returncode == 0, out.stderr
    assert [int(r.split(",")[0]) for r in out.stdout.splitlines()[1:]] == list(range(7000, 18000))
    refused = [v for name, labels, v in daemon.scrape()
               if name == "foreshock_query_refused_total" and labels.get("reason") == "too_large"]
    assert refused and refused[0] >= 2, refused


def test_runs_and_series_csv_match_the_points_sent(foreshockd):
    endpoint = foreshockd.endpoint
    loss = lambda step: 3.0 / (1.0 + step) + math.sin(step) / 3.0  # noqa: E731
    steps = list(range(60))
    acks = stream(endpoint, "ctl-series", [scalars_batch(i + 1, steps[i * 10:(i + 1) * 10], loss)
                                           for i in range(6)])
    assert sum(a.accepted for a in acks) == 60

    def csv_rows(*extra):
        out = ctl("series", "ctl-series", "loss", "--csv", *extra, "--endpoint", endpoint)
        assert out.returncode == 0, out
        header, *rows = out.stdout.splitlines()
        return header.split(","), [row.split(",") for row in rows]

    assert wait_until(lambda: len(csv_rows()[1]) == 60, 20), csv_rows()
    header, rows = csv_rows()
    assert header == ["step", "value", "wall_time_unix_ms"]
    assert [int(r[0]) for r in rows] == steps
    # Exact: the value printed reads back as the double the trainer sent.
    assert [float(r[1]) for r in rows] == [loss(s) for s in steps]
    assert all(int(r[2]) > 0 for r in rows)

    header, rows = csv_rows("--from", "10", "--to", "19")
    assert [int(r[0]) for r in rows] == list(range(10, 20))

    header, rows = csv_rows("--max_points", "6")
    assert header == ["step", "value", "min", "max", "count", "first_step", "last_step", "last"]
    assert sum(int(r[4]) for r in rows) == 60 and 1 < len(rows) <= 6
    for r in rows:
        first, last = int(r[5]), int(r[6])
        inside = [loss(s) for s in steps if first <= s <= last]
        assert int(r[0]) == last and int(r[4]) == len(inside)
        assert float(r[2]) == min(inside) and float(r[3]) == max(inside)
        assert float(r[1]) == pytest.approx(sum(inside) / len(inside), rel=1e-12)
        assert float(r[7]) == loss(last)

    out = ctl("series", "ctl-series", "loss", "--json", "--to", "2", "--endpoint", endpoint)
    response = json.loads(out.stdout)
    assert response["total_points"] == "3" and [p["value"] for p in response["points"]] == \
        [loss(0), loss(1), loss(2)]

    out = ctl("series", "ctl-series", "loss", "--to", "4", "--endpoint", endpoint)
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    assert "5 points" in lines[0] and lines[1].split() == ["STEP", "VALUE", "WALL_TIME"]
    assert len(lines) == 2 + 5

    out = ctl("series", "ctl-series", "no_such_signal", "--endpoint", endpoint)
    assert out.returncode == 1 and "NOT_FOUND" in out.stderr, out
    out = ctl("series", "no-such-run", "loss", "--endpoint", endpoint)
    assert out.returncode == 1 and "NOT_FOUND" in out.stderr, out

    out = ctl("runs", "--json", "--endpoint", endpoint)
    assert out.returncode == 0, out
    (run,) = [r for r in json.loads(out.stdout)["runs"] if r["run"] == "ctl-series"]
    assert run["job_name"] == "ctl-test" and run["first_step"] == "0" and run["last_step"] == "59"
    # A run whose sender said goodbye shows when it ended; a live one "-".
    ended = stream(endpoint, "ctl-ended", [scalars_batch(1, [0, 1], loss),
                                           ingest_pb2.Batch(seq=2, goodbye=ingest_pb2.Goodbye())])
    assert [a.seq for a in ended] == [1, 2], ended
    out = ctl("runs", "--endpoint", endpoint)
    header, *rows = out.stdout.splitlines()
    assert header.split()[:4] == ["RUN", "JOB", "FIRST_STEP", "LAST_STEP"]
    assert header.split()[-2:] == ["ATTEMPT", "ENDED"]
    by_run = {r.split()[0]: r for r in rows}
    assert by_run["ctl-series"].split()[:4] == ["ctl-series", "ctl-test", "0", "59"], rows
    assert by_run["ctl-series"].split()[-2:] == ["1", "-"], rows
    assert by_run["ctl-ended"][header.index("ENDED"):].startswith("20"), rows  # a UTC time


def test_replay_realtime_keeps_the_recorded_gaps_and_max_does_not(tmp_path):
    """A stream recorded with pauses, replayed both ways; also a torn tail."""
    from conftest import Daemon
    record_dir = tmp_path / "recordings"
    recorder = Daemon(foreshockd_binary(), str(tmp_path / "rec"),
                      [f"--record_dir={record_dir}", f"--data_dir={tmp_path / 'rec-data'}"])
    os.makedirs(recorder.log_dir)
    recorder.start()
    try:
        hello = ingest_pb2.Hello(run_id="gaps", job="ctl-test")

        def slow_requests():
            yield ingest_pb2.StreamRequest(hello=hello)
            for i in range(3):
                time.sleep(0.6)
                yield ingest_pb2.StreamRequest(
                    batch=scalars_batch(i + 1, [i], lambda s: 1.0 + s))

        with grpc.insecure_channel(recorder.endpoint) as channel:
            responses = list(ingest_pb2_grpc.IngestStub(channel).Stream(slow_requests(), timeout=30))
        assert len(responses) == 4
        assert wait_until(lambda: len(list(record_dir.glob("*.fsrec"))) == 1, 10)
    finally:
        recorder.stop()
    (recording,) = record_dir.glob("*.fsrec")

    target = Daemon(foreshockd_binary(), str(tmp_path / "target"),
                    [f"--data_dir={tmp_path / 'target-data'}"])
    os.makedirs(target.log_dir)
    target.start()
    try:
        started = time.monotonic()
        out = ctl("replay", recording, "--to", target.endpoint, "--speed", "realtime")
        took = time.monotonic() - started
        assert out.returncode == 0, out
        assert "sent 4 messages (1 hello, 3 batches, 3 records)" in out.stdout, out.stdout
        assert "accepted 3, rejected 0" in out.stdout and "stream OK" in out.stdout
        assert took >= 1.7, f"realtime replay took {took:.2f}s; the recording spans 1.8s"

        started = time.monotonic()
        out = ctl("replay", recording, "--to", target.endpoint, "--speed", "max", "--json")
        # Measured in the same run as the realtime replay: max does not sleep
        # through the recording's 1.8 s span.
        assert time.monotonic() - started < took - 1.0, (time.monotonic() - started, took)
        (result,) = json.loads(out.stdout)
        assert result["ok"] and result["accepted"] == 3

        # A torn last frame: the whole frames are replayed, and it says so.
        torn = tmp_path / "torn.fsrec"
        torn.write_bytes(recording.read_bytes()[:-5])
        out = ctl("replay", torn, "--to", target.endpoint)
        assert out.returncode == 0, out
        assert "3 records" not in out.stdout and "2 records" in out.stdout, out.stdout
        assert "torn frame" in out.stdout and "truncated tail" in out.stdout, out.stdout

        # A corrupt frame: replay stops there and fails.
        data = bytearray(recording.read_bytes())
        data[-3] ^= 0xFF
        corrupt = tmp_path / "corrupt.fsrec"
        corrupt.write_bytes(bytes(data))
        out = ctl("replay", corrupt, "--to", target.endpoint)
        assert out.returncode == 1, out
        assert "CRC-32C" in out.stdout, out.stdout

        # Not a recording at all: nothing is sent, usage error.
        bogus = tmp_path / "bogus.fsrec"
        bogus.write_bytes(b"hello world, no magic here")
        out = ctl("replay", recording, bogus, "--to", target.endpoint)
        assert out.returncode == 2 and "not a Foreshock recording" in out.stderr, out
    finally:
        target.stop()
