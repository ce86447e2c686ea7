"""Shared fixtures: free ports, and starting/stopping a real foreshockd.

Reusable from any test under tests/python:

    def test_something(foreshockd):          # a fresh daemon, killed afterwards
        foreshockd.endpoint                   # "127.0.0.1:<grpc port>" for the client
        foreshockd.scrape()                   # parsed /metrics (foreshock.prometheus.parse)
        samples, ok = foreshockd.wait_for(lambda samples: ..., timeout_s=20)

    def test_other(start_foreshockd):         # a factory, for extra flags or restarts
        daemon = start_foreshockd("--per_head_metrics")

The binary comes from $FORESHOCKD (ctest sets it to the built target); without
it, tests that need the daemon are skipped only if the default build path
does not exist either.
"""
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CLIENT = os.path.join(ROOT, "client", "python")
# FORESHOCK_INSTALLED_CLIENT=1 (the PyPI venv tests): import the client that
# `pip install ./client/python` installed, as users do, not the checkout's.
INSTALLED_CLIENT = os.environ.get("FORESHOCK_INSTALLED_CLIENT") == "1"
for path in ((ROOT,) if INSTALLED_CLIENT else (CLIENT, ROOT)):
    if path not in sys.path:
        sys.path.insert(0, path)

if not INSTALLED_CLIENT:
    # The stubs are build outputs: generate them when the tests run from a
    # checkout that CMake has not built (same command as proto/CMakeLists.txt).
    import generate_stubs  # noqa: E402

    generate_stubs.ensure()

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import torch  # noqa: E402

# The test models are tiny: a second intra-op thread does not speed them up, and
# stalls them badly when the other core is busy (ctest -j, a build).
torch.set_num_threads(1)

from foreshock import prometheus  # noqa: E402

DEFAULT_FORESHOCKD = os.path.join(ROOT, "build", "server", "foreshockd")


def free_port():
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def foreshockd_binary():
    """Path of the daemon binary; skips the test if there is none to run."""
    path = os.environ.get("FORESHOCKD")
    if path:
        if not os.access(path, os.X_OK):
            pytest.fail(f"FORESHOCKD={path} is not an executable")
        return path
    if os.access(DEFAULT_FORESHOCKD, os.X_OK):
        return DEFAULT_FORESHOCKD
    pytest.skip(f"no foreshockd: set FORESHOCKD or build {DEFAULT_FORESHOCKD}")


def wait_until(predicate, timeout_s=10.0, interval_s=0.02):
    """Polls predicate() until it is truthy or time runs out; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return predicate()
        time.sleep(interval_s)
    return True


class Daemon:
    """One foreshockd process on free ports. stop() kills it by PID."""

    def __init__(self, binary, log_dir, extra_args=(), grpc_port=None, metrics_port=None):
        self.binary = binary
        self.log_dir = log_dir
        self.extra_args = list(extra_args)
        # Each daemon keeps its durable store under its own log dir (the binary's
        # default, ./foreshock-data, would be shared by every test).
        if not any(a.startswith("--data_dir") for a in self.extra_args):
            self.extra_args.append(f"--data_dir={os.path.join(log_dir, 'data')}")
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.process = None
        self.log_path = None
        self.starts = 0

    @property
    def endpoint(self):
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self):
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self, timeout_s=20.0):
        """Starts the process (same ports on a restart) and waits until both ports serve."""
        self.starts += 1
        self.log_path = os.path.join(self.log_dir, f"foreshockd.{self.starts}.log")
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [self.binary, f"--listen={self.endpoint}",
                 f"--metrics_listen=127.0.0.1:{self.metrics_port}", *self.extra_args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"foreshockd exited with {self.process.returncode}:\n"
                                   + self.log_tail())
            if self._port_open(self.grpc_port) and self._metrics_up():
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"foreshockd did not serve within {timeout_s}s:\n" + self.log_tail())

    def stop(self, sig=signal.SIGTERM, timeout_s=10.0):
        """Signals the process by PID and waits; SIGKILL if it does not exit in time."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(sig)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def log_tail(self, n_bytes=4000):
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n_bytes:].decode("utf-8", "replace")
        except OSError:
            return ""

    def metrics_text(self):
        with urllib.request.urlopen(self.metrics_url, timeout=2.0) as response:
            return response.read().decode("utf-8")

    def scrape(self):
        return prometheus.parse(self.metrics_text())

    def wait_for(self, predicate, timeout_s=20.0, interval_s=0.2):
        """Scrapes until predicate(samples) is truthy or time runs out; returns
        (last samples, last predicate result), so callers assert with their own message."""
        deadline = time.monotonic() + timeout_s
        samples = []
        while True:
            samples = self.scrape()
            result = predicate(samples)
            if result or time.monotonic() > deadline:
                return samples, result
            time.sleep(interval_s)

    @staticmethod
    def _port_open(port):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            return s.connect_ex(("127.0.0.1", port)) == 0

    def _metrics_up(self):
        try:
            self.metrics_text()
            return True
        except (OSError, urllib.error.URLError):
            return False


class AlertWatch:
    """foreshock.v1.Query/WatchAlerts (one run, or every run for ""), read on a
    thread as foreshockctl watch does; events in arrival order."""

    def __init__(self, endpoint, run=""):
        import grpc
        from foreshock.v1 import query_pb2, query_pb2_grpc
        self._grpc = grpc
        self.channel = grpc.insecure_channel(endpoint)
        self.call = query_pb2_grpc.QueryStub(self.channel).WatchAlerts(
            query_pb2.WatchAlertsRequest(run=run))
        self.events = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        try:
            for event in self.call:
                self.events.append(event)
        except self._grpc.RpcError:
            pass  # cancelled by close()

    def close(self):
        self.call.cancel()
        self.thread.join(10)
        self.channel.close()


@pytest.fixture
def start_foreshockd(tmp_path):
    """Factory: start_foreshockd(*extra_args) -> a started Daemon; all are stopped after."""
    binary = foreshockd_binary()
    daemons = []

    def start(*extra_args):
        daemon = Daemon(binary, str(tmp_path), extra_args)
        daemons.append(daemon)
        return daemon.start()

    try:
        yield start
    finally:
        for daemon in daemons:
            daemon.stop()


@pytest.fixture
def foreshockd(start_foreshockd):
    """A fresh foreshockd with default flags on free ports."""
    return start_foreshockd()


@pytest.fixture
def foreshockd_from_step_0(start_foreshockd, tmp_path):
    """A foreshockd that scores the probe series from step 0, for runs a few
    dozen steps long: by default they start at step 200 (warmup_steps: early
    training's transient), so nothing would be judged and "no alert" would
    hold vacuously."""
    config = tmp_path / "from-step-0.yaml"
    config.write_text("alerts:\n  defaults:\n    warmup_steps: 0\n")
    return start_foreshockd(f"--config={config}")
