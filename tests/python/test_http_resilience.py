"""The HTTP port (--metrics_listen) against clients that hold connections.

A real foreshockd with its default HTTP limits (--http_threads=32,
--http_request_timeout_ms=5000, --http_max_connections_per_ip=8):

- idle connections (an unfinished request header, then nothing) from several
  addresses, reconnecting when closed, do not keep /metrics, /-/healthy and
  the API from answering within 1 s;
- one address gets at most 8 connections; further ones are answered 503 and
  closed at once, counted in foreshock_http_connections_refused_total, while
  other addresses are still answered;
- HEAD works on every GET route: same status and Content-Type, no body;
- API errors quoting invalid UTF-8 from the request are valid JSON.

All of 127.0.0.0/8 is loopback on Linux, so 127.0.0.2, 127.0.0.3, ... act as
separate client addresses.
"""
import http.client
import json
import selectors
import socket
import threading
import time

import pytest

from conftest import wait_until
from foreshock import prometheus

# Defaults of foreshockd's flags (server/foreshockd.cc).
MAX_PER_IP = 8
REQUEST_TIMEOUT_S = 5.0
REFUSED = "foreshock_http_connections_refused_total"
HALF_REQUEST = b"GET /metrics HTTP/1.1\r\nHost: foreshockd\r\n"  # no final blank line


def _half_open(port, source):
    s = socket.create_connection(("127.0.0.1", port), timeout=2, source_address=(source, 0))
    s.sendall(HALF_REQUEST)
    return s


def _get(port, path, method="GET", source="127.0.0.1", timeout=1.0):
    """(status, headers, body) of one request over a raw socket; reads until EOF
    (the daemon closes every connection), so a HEAD body would show up here."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout,
                                  source_address=(source, 0)) as s:
        s.sendall(f"{method} {path} HTTP/1.1\r\nHost: foreshockd\r\n\r\n".encode())
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in
               (line.split(":", 1) for line in lines[1:] if ":" in line)}
    return status, headers, body


def _refused(daemon):
    return prometheus.value(daemon.scrape(), REFUSED)


class Loris:
    """Keeps `count` idle connections from each source address open: each sends
    an unfinished request header and then nothing; one the daemon closes is
    reopened (after a short pause), as an attacker would."""

    def __init__(self, port, sources):
        self.port = port
        self.sources = sources  # [(address, count)]
        self.selector = selectors.DefaultSelector()
        self.stopping = threading.Event()
        self.opened = 0
        self.closed_by_server = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        for source, count in self.sources:
            for _ in range(count):
                self._open(source)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        self.thread.join(5)
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()
        self.selector.close()

    def open_now(self):
        return len(self.selector.get_map())

    def _open(self, source):
        try:
            s = _half_open(self.port, source)
        except OSError:
            return False
        s.setblocking(False)
        self.selector.register(s, selectors.EVENT_READ, source)
        self.opened += 1
        return True

    def _run(self):
        reopen = []
        while not self.stopping.is_set():
            for key, _ in self.selector.select(timeout=0.05):
                # Readable: the daemon answered (400/503) or closed it.
                self.selector.unregister(key.fileobj)
                key.fileobj.close()
                self.closed_by_server += 1
                reopen.append((time.monotonic() + 0.2, key.data))
            now = time.monotonic()
            due = [source for at, source in reopen if at <= now]
            reopen = [(at, source) for at, source in reopen if at > now]
            for source in due:
                if not self._open(source):
                    reopen.append((now + 0.2, source))


def test_idle_connections_do_not_block_scrapes(foreshockd):
    port = foreshockd.metrics_port
    # 32 idle connections: 16 from one address (half of them over its limit)
    # and 8 from each of two more; more than civetweb's 4 default threads.
    sources = [("127.0.0.2", 16), ("127.0.0.3", 8), ("127.0.0.4", 8)]
    with Loris(port, sources) as loris:
        time.sleep(0.5)
        # Past the request timeout, so that closed idle connections come back.
        deadline = time.monotonic() + REQUEST_TIMEOUT_S + 2
        answered = 0
        while time.monotonic() < deadline:
            for path in ("/metrics", "/-/healthy", "/api/v1/runs"):
                # A request queued behind the idle connections would be served
                # only when one of them times out (REQUEST_TIMEOUT_S); half of
                # that as the socket's timeout tells the two apart on a busy
                # machine too.
                status, _, body = _get(port, path, timeout=REQUEST_TIMEOUT_S / 2)
                assert status == 200, (path, status, body[:200])
                answered += 1
            time.sleep(0.1)
        # The attack was real: idle connections held workers all along.
        assert loris.open_now() >= 24, loris.open_now()
        assert loris.opened >= 32
    assert answered >= 30
    assert _get(port, "/-/healthy")[0] == 200


def test_one_address_is_bounded_and_refusals_are_counted(foreshockd):
    port = foreshockd.metrics_port
    assert _refused(foreshockd) == 0  # exported from the start
    extra = 4
    sockets = [_half_open(port, "127.0.0.2") for _ in range(MAX_PER_IP + extra)]
    try:
        assert wait_until(lambda: _refused(foreshockd) == extra, timeout_s=5), \
            _refused(foreshockd)
        # The refused ones were answered 503 and closed at once; the others wait.
        sel = selectors.DefaultSelector()
        for s in sockets:
            sel.register(s, selectors.EVENT_READ)
        sel.select(timeout=1.0)
        time.sleep(0.3)  # all of them, not the first
        ready = [key.fileobj for key, _ in sel.select(timeout=0)]
        sel.close()
        assert len(ready) == extra, len(ready)
        for s in ready:
            try:
                data = s.recv(4096)
            except ConnectionResetError:
                data = b""
            assert data == b"" or data.startswith(b"HTTP/1.1 503 "), data
        # Another address is served, and so is 127.0.0.1 (the scraper above).
        assert _get(port, "/-/healthy", source="127.0.0.3")[0] == 200
        assert _get(port, "/api/v1/runs", source="127.0.0.3")[0] == 200
        # A complete request from the full address: 503, counted.
        status, headers, body = _get(port, "/-/healthy", source="127.0.0.2")
        assert status == 503 and b"--http_max_connections_per_ip" in body, (status, body)
        assert wait_until(lambda: _refused(foreshockd) == extra + 1, timeout_s=5)
    finally:
        for s in sockets:
            s.close()
    # Closed connections give their slots back (once the daemon has seen them
    # close: a try before that may still be refused).
    def served_again():
        try:
            return _get(port, "/-/healthy", source="127.0.0.2")[0] == 200
        except OSError:
            return False

    assert wait_until(served_again, timeout_s=5, interval_s=0.1)


@pytest.mark.parametrize("path", ["/metrics", "/-/healthy", "/api/v1/runs", "/"])
def test_head_answers_like_get_without_a_body(foreshockd, path):
    port = foreshockd.metrics_port
    get_status, get_headers, get_body = _get(port, path)
    head_status, head_headers, head_body = _get(port, path, method="HEAD")
    assert get_status == 200 and get_body
    assert head_status == 200, head_status
    assert head_body == b""
    assert head_headers["content-type"] == get_headers["content-type"]
    if path != "/metrics":  # the exposition changes between two scrapes
        assert head_headers["content-length"] == str(len(get_body))


@pytest.mark.parametrize("query", [
    "/api/v1/series?run=%FF%FE%FD",
    "/api/v1/series?run=ok%C3%28%ED%A0%80%F4%90%80%80%C0%80%E2%82",  # bad continuation,
    # surrogate, above U+10FFFF, overlong, truncated
    "/api/v1/series?run=%00%01%1F%7F%22%5C%0A",                        # controls, quote, backslash
    "/api/v1/points?run=%FF&signal=%FE",
    "/api/v1/points?run=r&signal=s&layer=%FF%FE",                     # integer parse error
    "/api/v1/alerts?run=%FF%FE",
])
def test_api_errors_are_valid_json_for_any_bytes(foreshockd, query):
    status, headers, body = _get(foreshockd.metrics_port, query)
    assert headers["content-type"] == "application/json"
    answer = json.loads(body.decode("utf-8"))  # strict: invalid UTF-8 raises
    if status != 200:
        assert 400 <= status < 500, (status, body)
        assert set(answer) == {"code", "error"}, answer
        if "%FF" in query:
            assert "\ufffd" in answer["error"], answer
