"""Sharding runs over several daemons (foreshock.sharding, Monitor(endpoint="a,b,c")).

Unit: the rendezvous hash spreads runs evenly, gives every rank of a run the
same daemon, and moves only ~1/N of the runs when a daemon is added or
removed; the endpoint forms resolve without a network.

Real: three foreshockd daemons on loopback, all delivering to one real
Alertmanager. 30 runs x 2 ranks stream step scalars through the real client;
each run lives on exactly one daemon (the one the hash names) with both of its
ranks, every run's loss spike fires there, on_alert hears it from that daemon,
and all the alerts are visible in the one Alertmanager.
"""
import re
import socket

import grpc
import numpy as np
import pytest

from conftest import Daemon, foreshockd_binary, wait_until
from foreshock import Monitor, sharding
from foreshock.v1 import query_pb2, query_pb2_grpc

RUNS = [f"run-{i}" for i in range(30)]
THREE = ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"]


# -- unit ----------------------------------------------------------------------

def placement(runs, endpoints):
    return {run: sharding.pick(run, endpoints) for run in runs}


def test_thirty_runs_spread_within_half_of_even_over_three_daemons():
    counts = {e: 0 for e in THREE}
    for endpoint in placement(RUNS, THREE).values():
        counts[endpoint] += 1
    even = len(RUNS) / len(THREE)
    assert all(0.5 * even <= c <= 1.5 * even for c in counts.values()), counts


def test_every_rank_and_every_list_order_agree():
    # Each rank computes its placement on its own, from its own copy of the list.
    for run in RUNS:
        chosen = {sharding.pick(run, order) for order in
                  (THREE, THREE[::-1], [THREE[1], THREE[2], THREE[0]], ",".join(THREE))}
        assert len(chosen) == 1, run
    # ... and a Monitor (no daemon needed: its sender just retries) uses that daemon.
    for rank in range(3):
        monitor = Monitor(",".join(THREE[::-1]), run_id="run-7", job="unit", rank=rank,
                          backoff_initial_s=0.01)
        try:
            assert monitor.endpoint == sharding.pick("run-7", THREE)
            assert monitor.endpoints == sorted(THREE)
        finally:
            monitor.close(timeout=0.1)


def test_the_hash_is_stable_across_processes_and_versions():
    # blake2b, not Python's salted hash(): these values must never change, or an
    # upgraded client would send a live run's ranks to another daemon.
    assert sharding._score("10.0.0.1:50051", "run-0") == int.from_bytes(
        __import__("hashlib").blake2b(b"10.0.0.1:50051\0run-0", digest_size=8).digest(), "big")
    assert [sharding.pick(r, THREE) for r in ("run-0", "run-1", "run-2")] == \
        [placement(RUNS, THREE)[r] for r in ("run-0", "run-1", "run-2")]


@pytest.mark.parametrize("runs", [RUNS, [f"job-{i}" for i in range(3000)]])
def test_adding_a_daemon_moves_only_the_runs_it_takes(runs):
    before = placement(runs, THREE)
    four = THREE + ["10.0.0.4:50051"]
    after = placement(runs, four)
    moved = [r for r in runs if after[r] != before[r]]
    assert all(after[r] == four[3] for r in moved)  # nothing reshuffles among the old three
    assert [r for r in runs if after[r] == four[3]] == moved
    if len(runs) >= 1000:
        assert 0.2 <= len(moved) / len(runs) <= 0.3, len(moved)  # ~1/4
    else:
        assert 1 <= len(moved) <= len(runs) // 2, len(moved)


@pytest.mark.parametrize("runs", [RUNS, [f"job-{i}" for i in range(3000)]])
def test_removing_a_daemon_moves_only_its_runs(runs):
    before = placement(runs, THREE)
    gone = THREE[1]
    after = placement(runs, [THREE[0], THREE[2]])
    moved = {r for r in runs if after[r] != before[r]}
    assert moved == {r for r in runs if before[r] == gone}


def test_endpoint_forms():
    assert sharding.resolve("127.0.0.1:50051") == ["127.0.0.1:50051"]
    assert sharding.resolve(" b:2, a:1 ,b:2") == ["a:1", "b:2"]
    assert sharding.resolve(["b:2", "a:1"]) == ["a:1", "b:2"]
    assert sharding.resolve("[::1]:50051") == ["[::1]:50051"]
    # A single name that resolves to one address stays the name (the old behaviour):
    # 'localhost' has 127.0.0.1 (and maybe ::1, which is the same machine).
    assert sharding.resolve("localhost:50051") == ["localhost:50051"]
    # dns:/// always resolves; numeric names resolve without a network.
    assert sharding.resolve("dns:///127.0.0.1:7") == ["127.0.0.1:7"]
    assert sharding.resolve("dns:127.0.0.1:7") == ["127.0.0.1:7"]
    assert sharding.resolve("dns:///localhost:7") == ["127.0.0.1:7"]
    for bad in ("", " , ", "nohostport", "host:http", "dns://8.8.8.8/x:1", "a:1,dns:///b:2"):
        with pytest.raises(ValueError):
            sharding.resolve(bad)
    with pytest.raises(ValueError):
        sharding.resolve("dns:///no-such-host.invalid:1")
    # An unresolvable plain name is left to gRPC (a daemon whose DNS entry comes later).
    assert sharding.resolve("no-such-host.invalid:1") == ["no-such-host.invalid:1"]


def fake_getaddrinfo(records):
    """A resolver with fixed answers: {name: [address, ...]} (deterministic, no network)."""
    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        if host not in records:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (a, port) if ":" not in a else (a, port, 0, 0)) for a in records[host]]
    return getaddrinfo


def test_a_name_with_several_addresses_is_sharded_over_them(monkeypatch):
    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo({
        "foreshockd.ml.svc": ["10.1.0.12", "10.1.0.7", "10.1.0.9", "10.1.0.7"],
        "dual": ["10.1.0.1", "fd00::1"],  # one machine with both families: one daemon
        "v6only": ["fd00::2", "fd00::1"],
    }))
    expected = ["10.1.0.7:50051", "10.1.0.9:50051", "10.1.0.12:50051"]
    assert sharding.resolve("dns:///foreshockd.ml.svc:50051") == expected
    assert sharding.resolve("foreshockd.ml.svc:50051") == expected  # a headless Service
    assert sharding.resolve("dual:50051") == ["dual:50051"]
    assert sharding.resolve("dns:///dual:50051") == ["10.1.0.1:50051"]
    assert sharding.resolve("v6only:1") == ["[fd00::1]:1", "[fd00::2]:1"]
    assert sharding.endpoint_for("run-3", "dns:///foreshockd.ml.svc:50051") == \
        sharding.pick("run-3", expected)
    monitor = Monitor("dns:///foreshockd.ml.svc:50051", run_id="run-3", job="unit")
    try:
        assert monitor.endpoint == sharding.pick("run-3", expected)
    finally:
        monitor.close(timeout=0.1)


def test_monitor_arguments():
    with pytest.raises(TypeError):
        Monitor(run_id="r", job="j")
    with pytest.raises(TypeError):
        Monitor("a:1", endpoints=["b:2"], run_id="r", job="j")
    with pytest.raises(TypeError):
        Monitor("a:1", job="j")
    monitor = Monitor(endpoints=THREE, run_id="run-1", job="j", backoff_initial_s=0.01)
    try:
        assert monitor.endpoint == sharding.pick("run-1", THREE)
    finally:
        monitor.close(timeout=0.1)


def test_command_line(capsys):
    sharding._main(["run-1", ",".join(THREE)])
    assert capsys.readouterr().out.strip() == sharding.pick("run-1", THREE)


# -- three real daemons, one real Alertmanager ---------------------------------

STEADY, SPIKE = 140, 20  # ForeshockLossSpike: warmup 100, window 100, gap 10, 3 of 5


def loss_curve(seed):
    rng = np.random.default_rng(seed)
    steady = 2.0 + 0.02 * rng.standard_normal(STEADY)
    spike = 4.0 + 0.02 * rng.standard_normal(SPIKE)
    return np.concatenate([steady, spike])


def runs_on(daemon):
    with grpc.insecure_channel(daemon.endpoint) as channel:
        stub = query_pb2_grpc.QueryStub(channel)
        return {r.run for r in stub.ListRuns(query_pb2.ListRunsRequest(), timeout=10).runs}


def alerts_on(daemon):
    with grpc.insecure_channel(daemon.endpoint) as channel:
        stub = query_pb2_grpc.QueryStub(channel)
        # With resolved ones: closing the monitors ended the runs, which resolves their alerts.
        return stub.ListAlerts(query_pb2.ListAlertsRequest(include_resolved=True), timeout=10).alerts


def streams_opened(daemon):
    """(run, rank) of every ingest stream the daemon's log says it opened."""
    with open(daemon.log_path, encoding="utf-8", errors="replace") as log:
        return {(m.group(1), int(m.group(2))) for m in
                re.finditer(r"stream \S+ opened: run=(\S+) job=\S+ rank=(-?\d+)", log.read())}


@pytest.fixture
def three_daemons_one_alertmanager(tmp_path):
    from test_alertmanager_e2e import Alertmanager
    binary = foreshockd_binary()
    am_dir = tmp_path / "alertmanager"
    am_dir.mkdir()
    alertmanager = Alertmanager(am_dir)
    daemons = []
    try:
        alertmanager.start()
        for i in range(3):
            log_dir = tmp_path / f"daemon-{i}"
            log_dir.mkdir()
            daemons.append(Daemon(binary, str(log_dir), [
                f"--alertmanager_url={alertmanager.url}", "--workers=1"]).start())
        yield daemons, alertmanager
    finally:
        for daemon in daemons:
            daemon.stop()
        alertmanager.stop()


def test_three_daemons_hold_disjoint_runs_and_all_alert_to_one_alertmanager(
        three_daemons_one_alertmanager):
    daemons, alertmanager = three_daemons_one_alertmanager
    spec = ",".join(d.endpoint for d in daemons)
    by_endpoint = {d.endpoint: d for d in daemons}
    expected = {run: sharding.pick(run, spec) for run in RUNS}
    assert {expected[r] for r in RUNS} == set(by_endpoint), "every daemon should get runs"

    heard = {}  # run -> alert events its rank 0 received through on_alert
    monitors = []
    for run in RUNS:
        for rank in (0, 1):
            monitor = Monitor(spec, run_id=run, job="sharding", rank=rank,
                              backoff_initial_s=0.05, backoff_max_s=0.5)
            monitors.append((run, rank, monitor))
            if rank == 0:
                heard[run] = []
                monitor.on_alert(heard[run].append)
    try:
        curves = {run: loss_curve(i) for i, run in enumerate(RUNS)}
        for step in range(STEADY + SPIKE):
            for run, rank, monitor in monitors:  # the ranks of a data-parallel run agree
                monitor.step(step, loss=curves[run][step], grad_norm=1.0, lr=1e-3)

        def firing_runs():
            return {a["labels"]["run"] for a in alertmanager.alerts()
                    if a["labels"].get("alertname") == "ForeshockLossSpike"
                    and a["status"]["state"] == "active"}
        assert wait_until(lambda: firing_runs() >= set(RUNS), timeout_s=60, interval_s=0.5), \
            sorted(set(RUNS) - firing_runs())
        # The one Alertmanager shows every run's alert once, whichever daemon sent it.
        runs_in_am = [a["labels"]["run"] for a in alertmanager.alerts()
                      if a["labels"].get("alertname") == "ForeshockLossSpike"]
        assert sorted(runs_in_am) == sorted(RUNS)

        # on_alert watched the daemon that holds the run.
        def heard_all():
            return all(any(e.to_state == "firing" and e.alert.alertname == "ForeshockLossSpike"
                           for e in heard[run]) for run in RUNS)
        assert wait_until(heard_all, timeout_s=20), \
            [run for run in RUNS if not heard[run]]
        assert all(e.alert.run == run for run in RUNS for e in heard[run])
    finally:
        for _, _, monitor in monitors:
            monitor.close(timeout=10)

    for run, rank, monitor in monitors:
        stats = monitor.stats()
        assert monitor.endpoint == expected[run]
        assert stats["acked_records"] == STEADY + SPIKE and not stats["rejected"], (run, stats)

    # Each run is on exactly one daemon, the hashed one, with both of its ranks.
    for daemon in daemons:
        mine = {r for r in RUNS if expected[r] == daemon.endpoint}
        assert runs_on(daemon) == mine, daemon.endpoint
        assert streams_opened(daemon) == {(r, rank) for r in mine for rank in (0, 1)}
        # ... and it fired that run's alert itself.
        fired = {a.run for a in alerts_on(daemon) if a.alertname == "ForeshockLossSpike"}
        assert fired == mine, daemon.endpoint

    # Closing the monitors ended the runs: every daemon sent the resolution
    # to the one Alertmanager too.
    assert wait_until(lambda: not [a for a in alertmanager.alerts()
                                   if a["labels"].get("alertname") == "ForeshockLossSpike"],
                      timeout_s=30, interval_s=0.5), alertmanager.alerts()
