"""Configuration that fails closed, secrets never logged (issue 34, item 2).

The real foreshockd binary, started with each bad configuration: a malformed
--listen/--metrics_listen list, a non-loopback element hidden behind a
loopback one, a malformed --alertmanager_url, a token file others can read.
Each must exit 2 at start with the reason, never serve half-secured. A good
TLS configuration with two HTTP addresses serves TLS on both (a plain HTTP
request to either gets no metrics), and with Alertmanager credentials in the
URL and tokens in use, the secret bytes appear nowhere in the daemon's output,
/metrics or the HTTP API."""
import os
import shutil
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from conftest import foreshockd_binary, free_port, wait_until
from foreshock.security import Security
from foreshock.v1 import ingest_pb2, ingest_pb2_grpc

METRICS_TOKEN = "tokM-0ddba11c0ffee"
INGEST_TOKEN = "tokI-5ca1ab1e7e57"
TOKEN_FILE = f"{METRICS_TOKEN} * metrics,query\n{INGEST_TOKEN} cfg- ingest,query\n"


class Started:
    """A foreshockd process and its combined stdout/stderr."""

    def __init__(self, args, log_path):
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([foreshockd_binary(), "--data_dir=", "--workers=1", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)

    def text(self):
        with open(self.log_path) as f:
            return f.read()

    def outcome(self):
        """Waits until the daemon exits or says it serves (what it waits on is the
        daemon's own report, not a clock; the long limit only guards a hang).
        Returns its exit code, or None when it is serving."""
        def decided():
            return self.proc.poll() is not None or "foreshockd serving" in self.text()
        assert wait_until(decided, timeout_s=120), self.text()
        return self.proc.poll()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture
def start(tmp_path):
    started = []

    def run(*args):
        daemon = Started(list(args), str(tmp_path / f"foreshockd.{len(started)}.log"))
        started.append(daemon)
        return daemon

    yield run
    for daemon in started:
        daemon.stop()


def _token_file(tmp_path, mode=0o600):
    path = tmp_path / "tokens"
    path.write_text(TOKEN_FILE)
    path.chmod(mode)
    return path


def _refused(start, *args):
    """Starts the daemon with `args`; asserts it exits 2 without serving. Returns its output."""
    daemon = start(*args)
    code = daemon.outcome()
    assert code == 2, f"exit {code} (None: it started) with {args}:\n{daemon.text()}"
    text = daemon.text()
    assert "foreshockd serving" not in text
    return text


@pytest.mark.parametrize("args, reason", [
    (["--metrics_listen=127.0.0.1:0,"], "address 2 '': empty address"),
    (["--metrics_listen=,127.0.0.1:0"], "address 1 '': empty address"),
    (["--metrics_listen=127.0.0.1"], "no :PORT"),
    (["--metrics_listen=127.0.0.1:http"], "bad port 'http'"),
    (["--metrics_listen=127.0.0.1:99999"], "bad port '99999'"),
    (["--metrics_listen=127.0.0.1:0s"], "bad port '0s'"),
    (["--metrics_listen=127.0.0.1:0, 127.0.0.1:0"], "whitespace"),
    (["--metrics_listen=::1:0"], "in brackets"),
    (["--listen=127.0.0.1:0,junk"], "--listen=127.0.0.1:0,junk: address 2 'junk': no :PORT"),
    (["--listen="], "--listen is empty"),
    (["--listen=:0"], "no host"),
], ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_malformed_listen_lists_are_refused(start, args, reason):
    assert reason in _refused(start, "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0", *args)


@pytest.mark.parametrize("args, reason", [
    # The bypass: the old check only looked inside the first brackets.
    (["--metrics_listen=[::1]:0,0.0.0.0:0"], "refusing --metrics_listen address 0.0.0.0:0"),
    (["--metrics_listen=127.0.0.1:0,[::]:0"], "refusing --metrics_listen address [::]:0"),
    (["--listen=[::1]:0,0.0.0.0:0"], "refusing --listen address 0.0.0.0:0"),
], ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_every_element_of_a_list_is_checked_for_loopback(start, args, reason):
    text = _refused(start, "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0", *args)
    assert reason in text and "--insecure" in text, text


@pytest.mark.parametrize("url, reason", [
    ("not a url", "whitespace"),
    ("not-a-url", "must start with http:// or https://"),
    ("ftp://127.0.0.1:9093", "must start with http:// or https://"),
    ("http://", "has no host"),
    ("http://127.0.0.1:notaport", "port"),
    ("http://127.0.0.1:9093/?x=1", "query or fragment"),
    ("http://amuser:HUNTER2-am-pass@:9093", "has no host"),
], ids=lambda v: v)
def test_malformed_alertmanager_url_is_refused_without_echoing_it(start, url, reason):
    text = _refused(start, "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
                    f"--alertmanager_url={url}")
    assert "--alertmanager_url: " in text and reason in text, text
    assert "HUNTER2-am-pass" not in text and "amuser" not in text


@pytest.mark.parametrize("value", ["0", "-5", "4000000000"])
def test_a_forgetting_period_out_of_range_is_refused(start, value):
    # 0 would forget every run between two batches; a daemon that never
    # forgets grows with every run it sees.
    text = _refused(start, "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
                    f"--forget_runs_idle_s={value}")
    assert f"--forget_runs_idle_s={value}: must be between 1 and 100 years" in text


def test_token_file_readable_by_others_is_refused_unless_allowed(start, tmp_path):
    tokens = _token_file(tmp_path, 0o644)
    text = _refused(start, "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
                    f"--token_file={tokens}")
    assert "mode 0644" in text and "chmod 600" in text and "--allow_insecure_token_file" in text
    assert METRICS_TOKEN not in text and INGEST_TOKEN not in text
    # Group-readable by a group that is not the daemon's (nogroup): refused.
    os.chown(tokens, -1, 65534)
    tokens.chmod(0o640)
    assert "mode 0640" in _refused(start, "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
                                   f"--token_file={tokens}")
    # The explicit override starts, and says what it accepted.
    daemon = start("--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
                   f"--token_file={tokens}", "--allow_insecure_token_file")
    assert daemon.outcome() is None, daemon.text()
    assert "--allow_insecure_token_file: --token_file" in daemon.text()
    # A group that is the daemon's own (a Kubernetes Secret with fsGroup, 0440)
    # starts without the override, and so does 0600.
    os.chown(tokens, -1, os.getegid())
    tokens.chmod(0o440)
    daemon = start("--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
                   f"--token_file={tokens}")
    assert daemon.outcome() is None, daemon.text()
    tokens.chmod(0o600)
    daemon = start("--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
                   f"--token_file={tokens}")
    assert daemon.outcome() is None, daemon.text()


# --- TLS on every address ----------------------------------------------------

def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def server_cert(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl")
    d = str(tmp_path_factory.mktemp("certs"))
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=server", "-keyout",
             "server.key", "-out", "server.csr", cwd=d)
    with open(os.path.join(d, "server.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "2", "-extfile", "server.ext", "-out", "server.pem", cwd=d)
    return {k: os.path.join(d, f"{k}.pem") for k in ("ca", "server")} | {
        "key": os.path.join(d, "server.key")}


def _get(url, token, context=None):
    """(status, body), or (None, error) when no HTTP answer came back."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status, response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ConnectionError) as e:
        return None, repr(e)


def _plain_http_get(port, token):
    """A plain HTTP request written on the raw socket; returns whatever came back."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  f"Authorization: Bearer {token}\r\nConnection: close\r\n\r\n".encode())
        received = b""
        try:
            while chunk := s.recv(65536):
                received += chunk
        except (ConnectionResetError, socket.timeout):
            pass
    return received


def test_tls_covers_every_metrics_address(start, tmp_path, server_cert):
    ports = [free_port(), free_port()]
    daemon = start("--listen=127.0.0.1:0", f"--metrics_listen=127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}",
                   f"--tls_cert={server_cert['server']}", f"--tls_key={server_cert['key']}",
                   f"--token_file={_token_file(tmp_path)}")
    assert daemon.outcome() is None, daemon.text()
    context = ssl.create_default_context(cafile=server_cert["ca"])
    for port in ports:
        # Plain HTTP gets no metrics and no HTTP answer at all...
        received = _plain_http_get(port, METRICS_TOKEN)
        assert b"foreshock_" not in received and not received.startswith(b"HTTP/"), (port, received)
        status, body = _get(f"http://127.0.0.1:{port}/metrics", METRICS_TOKEN)
        assert status is None and "foreshock_" not in body, (port, status, body[:200])
        # ...while HTTPS on the same port serves them.
        status, body = _get(f"https://127.0.0.1:{port}/metrics", METRICS_TOKEN, context)
        assert status == 200 and "foreshock_" in body, (port, status, body[:200])
    assert "TLS on gRPC and HTTPS" in daemon.text()


def test_tls_covers_every_grpc_address(start, tmp_path, server_cert):
    ports = [free_port(), free_port()]
    daemon = start(f"--listen=127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}",
                   "--metrics_listen=127.0.0.1:0",
                   f"--tls_cert={server_cert['server']}", f"--tls_key={server_cert['key']}",
                   f"--token_file={_token_file(tmp_path)}")
    assert daemon.outcome() is None, daemon.text()
    for port in ports:
        # Plaintext gRPC cannot talk to either address...
        with pytest.raises(grpc.RpcError) as refused:
            _ingest(f"127.0.0.1:{port}", Security(token=INGEST_TOKEN), f"cfg-plain-{port}")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        # ...TLS can, on both.
        secure = Security(token=INGEST_TOKEN, tls_ca=server_cert["ca"])
        responses = _ingest(f"127.0.0.1:{port}", secure, f"cfg-run-{port}")
        assert responses[-1].ack.accepted == 1, responses


# --- secrets never logged ----------------------------------------------------

AM_USER = "amuser-7f3e"
AM_PASSWORD = "AMPASS-9c41d2e8b7"


def _ingest(endpoint, sec, run, nan=False):
    values = np.random.default_rng(0).normal(size=(2, 8, 4))
    if nan:
        values[1, 3, 2] = np.nan
    record = ingest_pb2.Record(step=10)
    record.qk.layer = 0
    record.qk.causal = True
    for tensor in (record.qk.q, record.qk.k):
        tensor.dtype = ingest_pb2.FLOAT32
        tensor.shape.extend(values.shape)
        tensor.data = values.astype("<f4").tobytes()
    hello = ingest_pb2.Hello(run_id=run, job="cfg",
                             model=ingest_pb2.ModelInfo(n_layers=2, n_heads=2, head_dim=4))
    requests = [ingest_pb2.StreamRequest(hello=hello),
                ingest_pb2.StreamRequest(batch=ingest_pb2.Batch(seq=1, records=[record]))]
    with sec.channel(endpoint) as channel:
        return list(ingest_pb2_grpc.IngestStub(channel).Stream(iter(requests), timeout=30,
                                                               metadata=sec.metadata))


def test_secrets_never_appear_in_logs_metrics_or_api(start, tmp_path):
    closed_port = free_port()  # nothing listens: every delivery fails and is logged
    grpc_port, http_port = free_port(), free_port()
    daemon = start(f"--listen=127.0.0.1:{grpc_port}", f"--metrics_listen=127.0.0.1:{http_port}",
                   f"--token_file={_token_file(tmp_path)}", "--log_level=debug",
                   f"--alertmanager_url=http://{AM_USER}:{AM_PASSWORD}@127.0.0.1:{closed_port}/",
                   "--alertmanager_resend_s=1")
    assert daemon.outcome() is None, daemon.text()
    # A NaN probe fires ForeshockNonFinite, which the daemon fails to deliver
    # to the closed port, and logs the failure with the (redacted) URL.
    responses = _ingest(f"127.0.0.1:{grpc_port}", Security(token=INGEST_TOKEN), "cfg-nan", nan=True)
    assert responses[-1].ack.accepted == 1, responses
    assert wait_until(lambda: "alertmanager: POST" in daemon.text(), 60), daemon.text()
    base = f"http://127.0.0.1:{http_port}"
    outputs = {}
    for path in ("/metrics", "/api/v1/runs", "/api/v1/alerts", "/"):
        status, body = _get(base + path, METRICS_TOKEN)
        assert status == 200, (path, status, body[:300])
        outputs[path] = body
    assert "foreshock_alertmanager_posts_total" in outputs["/metrics"]
    daemon.stop()
    outputs["log"] = daemon.text()
    log = outputs["log"]
    assert f"***@127.0.0.1:{closed_port}" in log, log  # the URL is logged, redacted
    for where, text in outputs.items():
        for secret in (AM_USER, AM_PASSWORD, METRICS_TOKEN, INGEST_TOKEN):
            assert secret not in text, (where, secret)
