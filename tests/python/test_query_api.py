"""foreshock.v1.Query ListRuns/ListSeries/GetSeries and the same over HTTP JSON
(/api/v1/...) against a real foreshockd: ranges and server-side downsampling
are checked against the raw points computed here with numpy."""
import json
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from foreshock.v1 import ingest_pb2, ingest_pb2_grpc, query_pb2, query_pb2_grpc

N_STEPS = 1000


def _losses():
    rng = np.random.default_rng(7)
    values = 3.0 - np.linspace(0, 1, N_STEPS) + 0.05 * rng.standard_normal(N_STEPS)
    values[417] = float("nan")  # non-finite: counted (foreshock_nonfinite_values_total), not stored
    return values


STORED = [s for s in range(N_STEPS) if s != 417]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    from conftest import Daemon, foreshockd_binary
    d = Daemon(foreshockd_binary(), str(tmp_path_factory.mktemp("query")))
    d.start()
    losses = _losses()

    def requests():
        yield ingest_pb2.StreamRequest(hello=ingest_pb2.Hello(run_id="q-run", job="query-job"))
        for seq, start in enumerate(range(0, N_STEPS, 50), start=1):
            batch = ingest_pb2.Batch(seq=seq)
            for step in range(start, start + 50):
                record = batch.records.add(step=step)
                record.scalars.loss = losses[step]
                record.scalars.lr = 1e-3
            yield ingest_pb2.StreamRequest(batch=batch)

    with grpc.insecure_channel(d.endpoint) as channel:
        acks = [r.ack for r in ingest_pb2_grpc.IngestStub(channel).Stream(requests(), timeout=60)
                if r.HasField("ack")]
    assert len(acks) == N_STEPS // 50  # acknowledged = processed and stored
    yield d
    d.stop()


def _stub(daemon):
    return query_pb2_grpc.QueryStub(grpc.insecure_channel(daemon.endpoint))


def _http(daemon, path):
    url = daemon.metrics_url.replace("/metrics", path)
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_list_runs_and_series(daemon):
    runs = _stub(daemon).ListRuns(query_pb2.ListRunsRequest(), timeout=30).runs
    run = next(r for r in runs if r.run == "q-run")
    assert (run.job_name, run.first_step, run.last_step) == ("query-job", 0, N_STEPS - 1)
    series = _stub(daemon).ListSeries(query_pb2.ListSeriesRequest(run="q-run"), timeout=30).series
    by_signal = {(s.signal, s.layer, s.head): s for s in series}
    loss = by_signal[("loss", -1, -1)]
    assert (loss.first_step, loss.last_step, loss.points) == (0, N_STEPS - 1, len(STORED))
    assert ("lr", -1, -1) in by_signal
    with pytest.raises(grpc.RpcError) as e:
        _stub(daemon).ListSeries(query_pb2.ListSeriesRequest(run="nope"), timeout=30)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_raw_range_is_exactly_what_was_sent(daemon):
    losses = _losses()
    got = _stub(daemon).GetSeries(query_pb2.GetSeriesRequest(
        run="q-run", signal="loss", from_step=100, to_step=599), timeout=30)
    expected = [s for s in STORED if 100 <= s <= 599]
    assert not got.downsampled and got.total_points == len(expected)
    assert [p.step for p in got.points] == expected
    np.testing.assert_array_equal([p.value for p in got.points], losses[expected])


@pytest.mark.parametrize("max_points", [1, 7, 100])
def test_downsampling_matches_numpy_over_the_raw_points(daemon, max_points):
    losses = _losses()
    got = _stub(daemon).GetSeries(query_pb2.GetSeriesRequest(
        run="q-run", signal="loss", max_points=max_points), timeout=30)
    assert got.downsampled and got.total_points == len(STORED) and not got.points
    assert 1 <= len(got.buckets) <= max_points
    covered = 0
    for b in got.buckets:
        raw = losses[[s for s in STORED if b.first_step <= s <= b.last_step]]
        assert b.count == len(raw)
        assert b.min == pytest.approx(raw.min()) and b.max == pytest.approx(raw.max())
        assert b.mean == pytest.approx(raw.mean(), rel=1e-12)
        assert b.last == losses[b.last_step]
        covered += b.count
    assert covered == len(STORED)  # every point in exactly one bucket
    assert got.buckets[0].first_step == 0 and got.buckets[-1].last_step == N_STEPS - 1


def test_unknown_series_and_bad_ranges_are_clear_errors(daemon):
    stub = _stub(daemon)
    with pytest.raises(grpc.RpcError) as e:
        stub.GetSeries(query_pb2.GetSeriesRequest(run="q-run", signal="los"), timeout=30)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert "its signals:" in e.value.details() and ", loss, " in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.GetSeries(query_pb2.GetSeriesRequest(run="q-run", signal="loss", from_step=9,
                                                  to_step=3), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_http_json_api_gives_the_same_answers(daemon):
    status, runs = _http(daemon, "/api/v1/runs")
    assert status == 200 and any(r["run"] == "q-run" and r["last_step"] == str(N_STEPS - 1)
                                 for r in runs["runs"])
    status, series = _http(daemon, "/api/v1/series?run=q-run")
    assert status == 200 and {"loss", "lr"} <= {s["signal"] for s in series["series"]}
    status, points = _http(daemon, "/api/v1/points?run=q-run&signal=loss&from=10&to=19")
    assert status == 200 and [int(p["step"]) for p in points["points"]] == list(range(10, 20))
    np.testing.assert_array_equal([p["value"] for p in points["points"]], _losses()[10:20])
    grpc_buckets = _stub(daemon).GetSeries(query_pb2.GetSeriesRequest(
        run="q-run", signal="loss", max_points=7), timeout=30).buckets
    status, down = _http(daemon, "/api/v1/points?run=q-run&signal=loss&max_points=7")
    assert status == 200 and down["downsampled"] is True
    assert [(int(b["first_step"]), b["mean"]) for b in down["buckets"]] == \
        [(b.first_step, b.mean) for b in grpc_buckets]
    status, error = _http(daemon, "/api/v1/points?run=q-run&signal=loss&layer=x")
    assert status == 400 and error["code"] == "INVALID_ARGUMENT" and "layer" in error["error"]
    status, error = _http(daemon, "/api/v1/points?run=q-run&signal=nope")
    assert status == 404 and error["code"] == "NOT_FOUND"
    status, alerts = _http(daemon, "/api/v1/alerts?run=q-run&include_resolved=true")
    # The NaN loss at step 417 fired ForeshockNonFinite (and it resolved after clean steps).
    assert status == 200
    assert [(a["alertname"], a["first_step"]) for a in alerts["alerts"]] == \
        [("ForeshockNonFinite", "417")]


def _hello_only(daemon, run):
    """A stream with a Hello and nothing else: the daemon has seen the run, but
    the store holds no series of it and it has no alerts."""
    hello = ingest_pb2.StreamRequest(hello=ingest_pb2.Hello(run_id=run, job="query-job"))
    with grpc.insecure_channel(daemon.endpoint) as channel:
        responses = list(ingest_pb2_grpc.IngestStub(channel).Stream(iter([hello]), timeout=30))
    assert any(r.HasField("hello_ack") for r in responses), responses


def test_list_alerts_of_an_unknown_run_is_not_found_like_series(daemon):
    stub = _stub(daemon)
    for include_resolved in (False, True):
        with pytest.raises(grpc.RpcError) as e:
            stub.ListAlerts(query_pb2.ListAlertsRequest(run="nope", include_resolved=include_resolved),
                            timeout=30)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert "nope" in e.value.details()
    # The same code and text as ListSeries gives for that run.
    with pytest.raises(grpc.RpcError) as series_error:
        stub.ListSeries(query_pb2.ListSeriesRequest(run="nope"), timeout=30)
    assert series_error.value.details() == e.value.details()

    # A known run: its alerts, active ones (none: ForeshockNonFinite resolved)...
    assert list(stub.ListAlerts(query_pb2.ListAlertsRequest(run="q-run"), timeout=30).alerts) == []
    got = stub.ListAlerts(query_pb2.ListAlertsRequest(run="q-run", include_resolved=True),
                          timeout=30).alerts
    assert [a.alertname for a in got] == ["ForeshockNonFinite"]
    # ...a run with a Hello only: known, no alerts, an empty list...
    _hello_only(daemon, "q-hello-only")
    assert list(stub.ListAlerts(query_pb2.ListAlertsRequest(run="q-hello-only"),
                                timeout=30).alerts) == []
    # ...and every run: never NOT_FOUND.
    stub.ListAlerts(query_pb2.ListAlertsRequest(include_resolved=True), timeout=30)


def test_http_alerts_of_an_unknown_run_is_404_like_series(daemon):
    status, error = _http(daemon, "/api/v1/alerts?run=nope")
    assert status == 404, (status, error)
    assert set(error) == {"code", "error"} and error["code"] == "NOT_FOUND"
    assert "nope" in error["error"]
    assert _http(daemon, "/api/v1/series?run=nope") == (status, error)
    status, error = _http(daemon, "/api/v1/alerts?run=nope&include_resolved=true")
    assert status == 404 and error["code"] == "NOT_FOUND"

    # A known run without active alerts: 200 and an empty list; every run: 200.
    assert _http(daemon, "/api/v1/alerts?run=q-run") == (200, {"alerts": []})
    _hello_only(daemon, "q-hello-only-http")
    assert _http(daemon, "/api/v1/alerts?run=q-hello-only-http&include_resolved=true") == \
        (200, {"alerts": []})
    status, alerts = _http(daemon, "/api/v1/alerts")
    assert status == 200
