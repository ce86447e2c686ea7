"""Per-tenant run quotas across daemon restarts (issue 34 item 3), against a
real foreshockd over loopback gRPC, restarted on the same data directory.

Runs recovered from the data directory count toward --max_runs; they must
count toward their tenant's --max_runs_per_tenant share too, or one tenant
that adds a run per restart fills --max_runs and locks every other tenant
out (too_many_runs) until the recovered runs are released a day later."""
import re
import subprocess

import grpc
import pytest

from conftest import foreshockd_binary, wait_until
from foreshock.security import Security
from foreshock.v1 import ingest_pb2, ingest_pb2_grpc

TOKENS = {"a": "tokA-51c0e9d27f", "b": "tokB-a83f1c6e02"}
TOKEN_FILE = f"""{TOKENS['a']} team-a/ ingest
{TOKENS['b']} team-b/ ingest
"""
MAX_RUNS, MAX_RUNS_PER_TENANT = 4, 2


class Daemon:
    """One foreshockd process on ports the OS picks; a restart is a new one
    on the same data directory."""

    def __init__(self, args, log_path):
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([foreshockd_binary(), "--workers=1", "--listen=127.0.0.1:0",
                                      "--metrics_listen=127.0.0.1:0", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.grpc_port = None

    def text(self):
        with open(self.log_path) as f:
            return f.read()

    def wait_started(self, timeout_s=20):
        def started():
            m = re.search(r"serving gRPC on \S+ \(port (\d+)\)", self.text())
            if m:
                self.grpc_port = int(m.group(1))
            return m is not None or self.proc.poll() is not None
        assert wait_until(started, timeout_s), self.text()
        assert self.grpc_port, self.text()
        return self

    @property
    def endpoint(self):
        return f"127.0.0.1:{self.grpc_port}"

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _ingest(daemon, run, token=None, job="quota"):
    """One stream: a Hello and a batch of three losses. Returns ("ok", accepted)
    or (status code name, details) when the daemon refused the stream."""
    batch = ingest_pb2.Batch(seq=1)
    for step in range(1, 4):
        batch.records.add(step=step).scalars.loss = 2.0
    requests = [ingest_pb2.StreamRequest(hello=ingest_pb2.Hello(run_id=run, job=job)),
                ingest_pb2.StreamRequest(batch=batch)]
    sec = Security(token=token or "")
    try:
        with sec.channel(daemon.endpoint) as channel:
            responses = list(ingest_pb2_grpc.IngestStub(channel).Stream(
                iter(requests), timeout=20, metadata=sec.metadata))
    except grpc.RpcError as e:
        return e.code().name, e.details()
    assert responses[0].HasField("hello_ack"), responses
    return "ok", responses[-1].ack.accepted


@pytest.mark.parametrize("tenancy", ["token", "job"])
def test_one_tenant_adding_a_run_per_restart_cannot_lock_others_out(tmp_path, tenancy):
    # With --token_file a tenant is a token; without, a job name.
    args = [f"--data_dir={tmp_path / 'data'}", f"--max_runs={MAX_RUNS}",
            f"--max_runs_per_tenant={MAX_RUNS_PER_TENANT}"]
    if tenancy == "token":
        token_file = tmp_path / "tokens"
        token_file.write_text(TOKEN_FILE)
        token_file.chmod(0o600)
        args.append(f"--token_file={token_file}")
        a = {"token": TOKENS["a"]}
        b = {"token": TOKENS["b"]}
    else:
        a = {"job": "team-a"}
        b = {"job": "team-b"}

    starts = 0

    def start():
        nonlocal starts
        starts += 1
        return Daemon(args, str(tmp_path / f"foreshockd.{starts}.log")).wait_started()

    # Team a starts one new run after each restart, as a job that makes a new
    # run_id per launch does.
    outcomes = []
    for i in range(MAX_RUNS):
        daemon = start()
        try:
            outcomes.append(_ingest(daemon, f"team-a/run{i}", **a))
        finally:
            daemon.stop()
    assert [o[0] for o in outcomes[:MAX_RUNS_PER_TENANT]] == ["ok"] * MAX_RUNS_PER_TENANT, outcomes
    # The recovered runs count toward team a's own share: its next runs are
    # refused as its own excess, not admitted toward the daemon's total.
    for code, details in outcomes[MAX_RUNS_PER_TENANT:]:
        assert code == "RESOURCE_EXHAUSTED", outcomes
        assert details.startswith("too_many_runs_for_tenant: "), outcomes
        assert f"already has {MAX_RUNS_PER_TENANT} runs" in details, outcomes

    daemon = start()
    try:
        # A recovered run is still its tenant's: a Hello for it is admitted
        # (it counts already), a new run of the same tenant is not.
        assert _ingest(daemon, "team-a/run0", **a)[0] == "ok"
        code, details = _ingest(daemon, "team-a/run-after-restart", **a)
        assert (code, details.split(":")[0]) == ("RESOURCE_EXHAUSTED", "too_many_runs_for_tenant"), \
            details
        # The other tenant still gets its runs: the total is not full.
        assert _ingest(daemon, "team-b/run0", **b) == ("ok", 3)
        assert _ingest(daemon, "team-b/run1", **b) == ("ok", 3)
    finally:
        daemon.stop()
