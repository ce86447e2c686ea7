"""Security (issue 7): mutual TLS on the gRPC port and on the HTTPS port,
per-run bearer tokens on gRPC and HTTP, safe defaults, and no token in the
daemon's log. A real foreshockd, real certificates (made here with `openssl`),
real tokens, and a real Prometheus scraping /metrics over mutual TLS."""
import json
import os
import re
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request

import grpc
import pytest

from conftest import foreshockd_binary, free_port, wait_until
from foreshock.monitor import Monitor
from foreshock.security import Security
from foreshock.v1 import ingest_pb2, ingest_pb2_grpc, query_pb2, query_pb2_grpc

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")

TOKENS = {
    "a": "tokA-3f9c1e7d2b",       # team-a/ ingest,query
    "b": "tokB-8a41c0e95f",       # team-b/ ingest,query
    "reader": "tokR-77d2e1aa04",  # team-a/ query only
    "prom": "tokP-c0ffee1234",    # * metrics
}
TOKEN_FILE = f"""# test grants
{TOKENS['a']} team-a/ ingest,query
{TOKENS['b']} team-b/ ingest,query
{TOKENS['reader']} team-a/ query
{TOKENS['prom']} * metrics
"""


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_ca(d, name):
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d)


def _make_cert(d, ca, name, san=None):
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout",
             f"{name}.key", "-out", f"{name}.csr", cwd=d)
    ext = f"{name}.ext"
    with open(os.path.join(d, ext), "w") as f:
        f.write(f"subjectAltName={san}\n" if san else "basicConstraints=CA:FALSE\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-days", "2", "-extfile", ext, "-out", f"{name}.pem", cwd=d)


CERTS = {}  # the module's certificates, for _http


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("certs"))
    _make_ca(d, "ca")
    _make_ca(d, "rogue_ca")
    _make_cert(d, "ca", "server", san="IP:127.0.0.1,DNS:localhost")
    _make_cert(d, "ca", "client")
    _make_cert(d, "rogue_ca", "rogue_client")
    CERTS.update({k: os.path.join(d, k)
                  for k in ("ca", "rogue_ca", "server", "client", "rogue_client")})
    return dict(CERTS)


class Daemon:
    def __init__(self, args, log_path):
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([foreshockd_binary(), "--data_dir=", "--workers=1",
                                      "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
                                      *args], stdout=self.log, stderr=subprocess.STDOUT)
        self.grpc_port = self.http_port = None

    def text(self):
        with open(self.log_path) as f:
            return f.read()

    def wait_started(self, timeout_s=20):
        def started():
            m = re.search(r"serving gRPC on \S+ \(port (\d+)\).* on \S+ \(port (\d+)\)", self.text())
            if m:
                self.grpc_port, self.http_port = int(m.group(1)), int(m.group(2))
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


@pytest.fixture(scope="module")
def daemon(certs, tmp_path_factory):
    d = tmp_path_factory.mktemp("daemon")
    token_file = d / "tokens"
    token_file.write_text(TOKEN_FILE)
    token_file.chmod(0o600)
    daemon = Daemon([f"--tls_cert={certs['server']}.pem", f"--tls_key={certs['server']}.key",
                     f"--tls_client_ca={certs['ca']}.pem", f"--token_file={token_file}"],
                    str(d / "foreshockd.log"))
    try:
        yield daemon.wait_started()
    finally:
        daemon.stop()


def _sec(certs, token=None, client="client", ca="ca"):
    cert = certs[client] if client else None
    return Security(token=token or "", tls_ca=certs[ca] + ".pem",
                    tls_cert=cert and cert + ".pem", tls_key=cert and cert + ".key")


def _ingest(daemon, sec, run, steps=3):
    """One stream: Hello and a batch of loss scalars. Returns the responses or raises RpcError."""
    batch = ingest_pb2.Batch(seq=1)
    for step in range(1, steps + 1):
        batch.records.add(step=step).scalars.loss = 2.0 + 0.01 * step
    requests = [ingest_pb2.StreamRequest(hello=ingest_pb2.Hello(run_id=run, job="sec")),
                ingest_pb2.StreamRequest(batch=batch)]
    with sec.channel(daemon.endpoint) as channel:
        return list(ingest_pb2_grpc.IngestStub(channel).Stream(iter(requests), timeout=20,
                                                               metadata=sec.metadata))


def _query(daemon, sec):
    channel = sec.channel(daemon.endpoint)
    return channel, query_pb2_grpc.QueryStub(channel)


def _code(call):
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def _tls_context(certs, client="client"):
    context = ssl.create_default_context(cafile=certs["ca"] + ".pem")
    if client:
        context.load_cert_chain(certs[client] + ".pem", certs[client] + ".key")
    return context


def _http(daemon, path, token=None, certs=None, client="client"):
    """GET over HTTPS with the CA and a client certificate (the daemon's port is HTTPS)."""
    request = urllib.request.Request(f"https://127.0.0.1:{daemon.http_port}{path}")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10,
                                    context=_tls_context(certs or CERTS, client)) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_ingest_needs_a_token_for_the_run(daemon, certs):
    responses = _ingest(daemon, _sec(certs, TOKENS["a"]), "team-a/run1")
    assert responses[0].HasField("hello_ack") and responses[-1].ack.seq == 1
    assert _ingest(daemon, _sec(certs, TOKENS["b"]), "team-b/run1")[-1].ack.seq == 1
    # A token for run A cannot write run B, and the other way round.
    assert _code(lambda: _ingest(daemon, _sec(certs, TOKENS["a"]), "team-b/run2")) == \
        grpc.StatusCode.PERMISSION_DENIED
    assert _code(lambda: _ingest(daemon, _sec(certs, TOKENS["b"]), "team-a/run2")) == \
        grpc.StatusCode.PERMISSION_DENIED
    # A query-only token cannot write.
    assert _code(lambda: _ingest(daemon, _sec(certs, TOKENS["reader"]), "team-a/run3")) == \
        grpc.StatusCode.PERMISSION_DENIED
    for token in ("", "not-a-token"):
        assert _code(lambda: _ingest(daemon, _sec(certs, token), "team-a/run4")) == \
            grpc.StatusCode.UNAUTHENTICATED
    status, body = _http(daemon, "/metrics", TOKENS["prom"])
    assert status == 200
    text = "\n".join(line for line in body.splitlines()
                     if line.startswith("foreshock_auth_denied_total"))
    m = re.search(r'foreshock_auth_denied_total\{api="grpc_ingest",reason="permission_denied"\} (\S+)',
                  text)
    assert m and float(m.group(1)) == 3, text
    m = re.search(r'foreshock_auth_denied_total\{api="grpc_ingest",reason="unauthenticated"\} (\S+)',
                  text)
    assert m and float(m.group(1)) == 2, text


def test_queries_are_filtered_or_refused_both_ways(daemon, certs):
    _ingest(daemon, _sec(certs, TOKENS["a"]), "team-a/run1")
    _ingest(daemon, _sec(certs, TOKENS["b"]), "team-b/run1")
    for mine, other, token in (("team-a/run1", "team-b/run1", TOKENS["a"]),
                               ("team-b/run1", "team-a/run1", TOKENS["b"])):
        sec = _sec(certs, token)
        channel, stub = _query(daemon, sec)
        with channel:
            md = sec.metadata
            assert wait_until(lambda: [r.run for r in stub.ListRuns(
                query_pb2.ListRunsRequest(), metadata=md, timeout=10).runs] == [mine], 10)
            assert stub.ListSeries(query_pb2.ListSeriesRequest(run=mine), metadata=md,
                                   timeout=10).series
            stub.ListAlerts(query_pb2.ListAlertsRequest(), metadata=md, timeout=10)
            for call in (
                    lambda: stub.ListSeries(query_pb2.ListSeriesRequest(run=other), metadata=md,
                                            timeout=10),
                    lambda: stub.GetSeries(query_pb2.GetSeriesRequest(run=other, signal="loss"),
                                           metadata=md, timeout=10),
                    lambda: stub.ListAlerts(query_pb2.ListAlertsRequest(run=other), metadata=md,
                                            timeout=10),
                    lambda: list(stub.WatchAlerts(query_pb2.WatchAlertsRequest(run=other),
                                                  metadata=md, timeout=10))):
                assert _code(call) == grpc.StatusCode.PERMISSION_DENIED
            assert _code(lambda: stub.ListRuns(query_pb2.ListRunsRequest(), timeout=10)) == \
                grpc.StatusCode.UNAUTHENTICATED
            assert _code(lambda: list(stub.WatchAlerts(query_pb2.WatchAlertsRequest(),
                                                       timeout=10))) == \
                grpc.StatusCode.UNAUTHENTICATED


def test_http_api_and_metrics_need_tokens(daemon, certs):
    _ingest(daemon, _sec(certs, TOKENS["a"]), "team-a/run1")
    _ingest(daemon, _sec(certs, TOKENS["b"]), "team-b/run1")
    status, body = _http(daemon, "/api/v1/runs", TOKENS["reader"])
    assert status == 200 and [r["run"] for r in json.loads(body)["runs"]] == ["team-a/run1"]
    assert _http(daemon, "/api/v1/series?run=team-a/run1", TOKENS["reader"])[0] == 200
    assert _http(daemon, "/api/v1/series?run=team-b/run1", TOKENS["reader"])[0] == 403
    assert _http(daemon, "/api/v1/points?run=team-a/run1&signal=loss", TOKENS["b"])[0] == 403
    assert _http(daemon, "/api/v1/alerts?run=team-a/run1", TOKENS["b"])[0] == 403
    assert _http(daemon, "/api/v1/runs")[0] == 401
    assert _http(daemon, "/api/v1/runs", "wrong")[0] == 401
    assert _http(daemon, "/metrics")[0] == 401
    assert _http(daemon, "/metrics", TOKENS["a"])[0] == 401  # no metrics right
    assert _http(daemon, "/-/healthy")[0] == 200             # liveness stays open


def test_https_port_requires_tls_and_a_client_certificate(daemon, certs):
    # Plaintext HTTP to the HTTPS port gets no answer.
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(f"http://127.0.0.1:{daemon.http_port}/-/healthy", timeout=5).read()
    # No client certificate, or one from another CA: the handshake fails.
    for client in (None, "rogue_client"):
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            _http(daemon, "/-/healthy", certs=certs, client=client)
    # A server certificate the client does not trust: refused by the client.
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"https://127.0.0.1:{daemon.http_port}/-/healthy", timeout=5,
                               context=ssl.create_default_context(cafile=certs["rogue_ca"] + ".pem"))
    # ...and the daemon keeps serving the proper client.
    assert _http(daemon, "/-/healthy", certs=certs) == (200, "ok\n")


def test_prometheus_scrapes_over_mutual_tls_with_a_token(daemon, certs, tmp_path):
    prometheus = shutil.which("prometheus") or "/usr/bin/prometheus"
    assert os.access(prometheus, os.X_OK), "Debian's prometheus is required (scripts/test installs it)"
    config = tmp_path / "prometheus.yml"
    config.write_text(f"""global:
  scrape_interval: 1s
scrape_configs:
  - job_name: foreshock
    scheme: https
    tls_config:
      ca_file: {certs['ca']}.pem
      cert_file: {certs['client']}.pem
      key_file: {certs['client']}.key
    authorization:
      credentials: {TOKENS['prom']}
    static_configs:
      - targets: ["127.0.0.1:{daemon.http_port}"]
""")
    port = free_port()
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen([prometheus, f"--config.file={config}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        def scraped():
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
            try:
                url = (f"http://127.0.0.1:{port}/api/v1/query?query="
                       "foreshock_ingest_streams_total")
                result = json.load(urllib.request.urlopen(url, timeout=5))["data"]["result"]
            except OSError:
                return False
            return bool(result)
        assert wait_until(scraped, 60, 0.5)
        targets = json.load(urllib.request.urlopen(
            f"http://127.0.0.1:{port}/api/v1/targets", timeout=5))["data"]["activeTargets"]
        assert targets[0]["health"] == "up" and targets[0]["scrapeUrl"].startswith("https://"), targets
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_mutual_tls_refuses_other_clients(daemon, certs):
    token = TOKENS["a"]
    for sec in (_sec(certs, token, client=None),            # no client certificate
                _sec(certs, token, client="rogue_client")):  # signed by another CA
        channel, stub = _query(daemon, sec)
        with channel:
            assert _code(lambda: stub.ListRuns(query_pb2.ListRunsRequest(), metadata=sec.metadata,
                                               timeout=5)) == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(daemon.endpoint) as channel:  # plaintext to a TLS port
        assert _code(lambda: query_pb2_grpc.QueryStub(channel).ListRuns(
            query_pb2.ListRunsRequest(), timeout=5)) == grpc.StatusCode.UNAVAILABLE


def test_monitor_passes_token_and_certificates(daemon, certs):
    monitor = Monitor(daemon.endpoint, run_id="team-a/monitor", job="sec", token=TOKENS["a"],
                      tls_ca=certs["ca"] + ".pem", tls_cert=certs["client"] + ".pem",
                      tls_key=certs["client"] + ".key", backoff_max_s=0.5)
    for step in range(1, 4):
        monitor.step(step, loss=2.0)
    monitor.close(timeout=10)
    assert monitor.stats()["acked_records"] == 3, monitor.stats()
    sec = _sec(certs, TOKENS["reader"])
    channel, stub = _query(daemon, sec)
    with channel:
        runs = [r.run for r in stub.ListRuns(query_pb2.ListRunsRequest(), metadata=sec.metadata,
                                             timeout=10).runs]
    assert "team-a/monitor" in runs


def test_foreshockctl_passes_token_and_certificates(daemon, certs, tmp_path):
    ctl = os.environ.get("FORESHOCKCTL") or os.path.join(
        os.path.dirname(os.path.dirname(foreshockd_binary())), "ctl", "foreshockctl")
    if not os.access(ctl, os.X_OK):
        pytest.skip(f"no foreshockctl at {ctl}")
    _ingest(daemon, _sec(certs, TOKENS["a"]), "team-a/run1")
    _ingest(daemon, _sec(certs, TOKENS["b"]), "team-b/run1")
    token_file = tmp_path / "token"
    token_file.write_text(TOKENS["b"] + "\n")
    tls = [f"--tls_ca={certs['ca']}.pem", f"--tls_cert={certs['client']}.pem",
           f"--tls_key={certs['client']}.key", f"--endpoint={daemon.endpoint}", "--timeout_s=5"]

    def run(*args, env_token=None):
        env = dict(os.environ)
        env.pop("FORESHOCK_TOKEN", None)
        if env_token:
            env["FORESHOCK_TOKEN"] = env_token
        return subprocess.run([ctl, *tls, *args], capture_output=True, text=True, timeout=30,
                              env=env)

    out = run("runs", "--json", f"--token_file={token_file}")
    assert out.returncode == 0, out.stderr
    assert [r["run"] for r in json.loads(out.stdout)["runs"]] == ["team-b/run1"]
    out = run("runs", "--json", env_token=TOKENS["a"])
    assert out.returncode == 0 and "team-a/run1" in out.stdout and "team-b" not in out.stdout
    out = run("runs")
    assert out.returncode == 1 and "UNAUTHENTICATED" in out.stderr, out.stderr
    for output in (out.stdout, out.stderr):
        assert TOKENS["a"] not in output and TOKENS["b"] not in output


def test_no_token_in_the_log(daemon):
    # Runs after the tests above, which used every token, valid or not.
    text = daemon.text()
    assert "refused" in text  # the denials were logged...
    for token in list(TOKENS.values()) + ["not-a-token"]:
        assert token not in text  # ...without the token


def test_safe_defaults(tmp_path, certs):
    # Plaintext and no tokens on a non-loopback address: refused, exit 2.
    proc = subprocess.run([foreshockd_binary(), "--data_dir=", "--listen=0.0.0.0:0",
                           "--metrics_listen=127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=30)
    assert proc.returncode == 2 and "--insecure" in proc.stdout, proc.stdout
    proc = subprocess.run([foreshockd_binary(), "--data_dir=", "--listen=127.0.0.1:0",
                           "--metrics_listen=[::]:0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30)
    assert proc.returncode == 2 and "refusing --metrics_listen" in proc.stdout, proc.stdout
    # --insecure starts anyway, and says so.
    d = Daemon([], str(tmp_path / "loopback.log"))
    try:
        d.wait_started()
        assert "loopback only" in d.text()
    finally:
        d.stop()
    d = Daemon(["--insecure", "--listen=0.0.0.0:0"], str(tmp_path / "insecure.log"))
    try:
        d.wait_started()
        assert "--insecure" in d.text()
    finally:
        d.stop()
    # TLS and tokens: gRPC and HTTPS may listen on every address without --insecure.
    token_file = tmp_path / "tokens"
    token_file.write_text(TOKEN_FILE)
    token_file.chmod(0o600)  # owner only, or the daemon refuses it (issue 34)
    d = Daemon([f"--tls_cert={certs['server']}.pem", f"--tls_key={certs['server']}.key",
                f"--token_file={token_file}", "--listen=0.0.0.0:0",
                "--metrics_listen=0.0.0.0:0"], str(tmp_path / "tls.log"))
    try:
        d.wait_started()
        assert "insecure" not in d.text()
    finally:
        d.stop()
    # A malformed token file or half a key pair: exit 2, naming the line, not the token.
    token_file.write_text("secret-token-xyz team-a/ ingest,write\n")
    proc = subprocess.run([foreshockd_binary(), "--data_dir=", f"--token_file={token_file}"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30)
    assert proc.returncode == 2 and "line 1" in proc.stdout, proc.stdout
    assert "secret-token-xyz" not in proc.stdout
    proc = subprocess.run([foreshockd_binary(), "--data_dir=", f"--tls_cert={certs['server']}.pem"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30)
    assert proc.returncode == 2, proc.stdout


def test_one_tokens_streams_cannot_take_every_slot(tmp_path):
    # Issue 16: with --token_file a tenant is a token. One token opening
    # streams (for any of its runs, or silent ones that never send a Hello)
    # is refused at --max_streams_per_tenant, well below --max_streams, while
    # another token still connects and gets acks.
    import threading
    token_file = tmp_path / "tokens"
    token_file.write_text(TOKEN_FILE)
    token_file.chmod(0o600)
    d = Daemon([f"--token_file={token_file}", "--max_streams=64", "--max_streams_per_tenant=3"],
               str(tmp_path / "tenants.log"))
    release = threading.Event()
    channels, calls, refusal = [], [], None
    try:
        d.wait_started()
        sec_a = Security(token=TOKENS["a"])

        def hello_then_silence(run):
            yield ingest_pb2.StreamRequest(hello=ingest_pb2.Hello(run_id=run, job="sec"))
            release.wait(30)

        def silence():
            release.wait(30)
            return
            yield

        # One silent stream (no Hello: it holds a slot of the token all the same) ...
        channel = sec_a.channel(d.endpoint)
        channels.append(channel)
        silent = ingest_pb2_grpc.IngestStub(channel).Stream(silence(), timeout=30,
                                                           metadata=sec_a.metadata)
        # ... then Hellos for different runs of the same token, until refused.
        for i in range(64):
            channel = sec_a.channel(d.endpoint)
            channels.append(channel)
            call = ingest_pb2_grpc.IngestStub(channel).Stream(
                hello_then_silence(f"team-a/run{i}"), timeout=30, metadata=sec_a.metadata)
            calls.append(call)  # held open
            try:
                assert next(call).HasField("hello_ack")
            except grpc.RpcError as e:
                refusal = (i, e.code(), e.details(), dict(e.trailing_metadata() or ()))
                break
        assert refusal is not None
        i, code, details, trailing = refusal
        assert i == 2, refusal  # the silent stream and two more: 3
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert details.startswith("too_many_streams_for_tenant: token token@2 "), details
        assert trailing.get("retry-after-ms") == "1000", trailing
        # The other tenant is served.
        responses = _ingest(d, Security(token=TOKENS["b"]), "team-b/run1")
        assert responses[0].HasField("hello_ack") and responses[-1].ack.accepted == 3
        assert TOKENS["a"] not in d.text()
        silent.cancel()
        for call in calls:
            call.cancel()
    finally:
        release.set()
        for channel in channels:
            channel.close()
        d.stop()
