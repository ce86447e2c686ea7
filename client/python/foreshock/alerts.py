"""Alert delivery to the training process: a background WatchAlerts stream.

    monitor.on_alert(lambda event: ...)   # event: foreshock.v1.AlertEvent

The callback runs on the watcher thread, never on the training thread, so a
training loop can react (checkpoint, stop, lower the LR) through flags it
reads at its own pace. The stream reconnects with backoff if the daemon
restarts; on reconnect the daemon first re-sends the alerts active then.
"""
import logging
import random
import threading
import time

import grpc

from foreshock import _exit
from foreshock.security import Security
from foreshock.v1 import query_pb2, query_pb2_grpc

log = logging.getLogger("foreshock")
# Backoff jitter from the OS: a training script seeds the global `random`.
_JITTER = random.SystemRandom()


class AlertWatcher(_exit.BackgroundWorker):
    """Streams foreshock.v1.Query/WatchAlerts for one run (or all, run="") to callbacks."""

    def __init__(self, endpoint, run, *, backoff_initial_s=0.2, backoff_max_s=5.0,
                 channel_options=(), security=None, ready=None, ready_timeout_s=10.0):
        self.endpoint = endpoint
        self._security = security or Security()  # TLS and token (foreshock.security)
        self.run = run
        self._callbacks = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._call = None
        self._backoff = (backoff_initial_s, backoff_max_s)
        self._channel_options = list(channel_options)
        self.events = 0
        self.callback_errors = 0
        self.reconnects = 0
        # A threading.Event to wait for (at most ready_timeout_s) before the
        # first watch: the monitor's HelloAck (Monitor.on_alert).
        self._ready = ready
        self._ready_timeout_s = ready_timeout_s
        self._thread = threading.Thread(target=self._run, name="foreshock-alerts", daemon=True)

    def add_callback(self, callback):
        with self._lock:
            self._callbacks.append(callback)
        if not self._thread.is_alive() and not self._stop.is_set():
            _exit.register(self)  # stopped before the interpreter finalizes
            self._thread.start()

    def _signal_stop(self):
        self._stop.set()

    def close(self, timeout=5.0):
        self.stop_now()
        self.join(timeout)

    def _run(self):
        if self._ready is not None:
            deadline = time.monotonic() + self._ready_timeout_s
            while not (self._ready.is_set() or self._stop.is_set()) and time.monotonic() < deadline:
                self._ready.wait(0.05)
        backoff = self._backoff[0]
        first = True
        while not self._stop.is_set():
            try:
                with self._security.channel(self.endpoint, self._channel_options) as channel:
                    stub = query_pb2_grpc.QueryStub(channel)
                    call = stub.WatchAlerts(query_pb2.WatchAlertsRequest(run=self.run,
                                                                         send_active=True),
                                            metadata=self._security.metadata)
                    with self._lock:
                        self._call = call
                    if self._stop.is_set():
                        call.cancel()
                    if not first:
                        self.reconnects += 1
                    first = False
                    for event in call:
                        backoff = self._backoff[0]
                        self.events += 1
                        with self._lock:
                            callbacks = list(self._callbacks)
                        for callback in callbacks:
                            try:
                                callback(event)
                            except Exception:  # a user callback must not kill the watcher
                                self.callback_errors += 1
                                log.exception("foreshock: on_alert callback raised")
            except grpc.RpcError as error:
                if self._stop.is_set():
                    break
                log.debug("foreshock: WatchAlerts ended (%s); reconnecting", error.code())
            finally:
                with self._lock:
                    self._call = None
            self._stop.wait(backoff * _JITTER.uniform(0.5, 1.0))
            backoff = min(backoff * 2, self._backoff[1])
