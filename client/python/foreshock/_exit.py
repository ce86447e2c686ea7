"""Stops the client's background threads before the interpreter finalizes.

The sender and the alert watcher are daemon threads that spend their lives
inside gRPC. When Python finalizes, a daemon thread that next takes the GIL is
terminated where it stands; inside gRPC's Cython/C++ frames that can abort the
whole process (terminate, SIGABRT, then SIGSEGV in the fault handler; gRPC
documents the hazard for clients alive at shutdown). A training job that
finished cleanly would then exit with a signal, and torchrun would report the
rank as failed. So each background worker registers here, and an atexit hook,
which Python runs before finalization, stops them all and waits for them, for
at most EXIT_WAIT_S in total.

Workers derive from BackgroundWorker: stop_now() (no flush: the process is
leaving), join(timeout) and is_alive().
"""
import atexit
import threading
import time
import weakref

# Bounded: exit must never hang on an unreachable daemon.
EXIT_WAIT_S = 5.0

_lock = threading.Lock()
_workers = weakref.WeakSet()


class BackgroundWorker:
    """One thread (self._thread) that holds at most one gRPC call in flight
    (self._call, under self._lock); _signal_stop() tells the thread to stop."""

    def _signal_stop(self):
        raise NotImplementedError

    def stop_now(self):
        """Stops the thread without flushing: cancels the call in flight."""
        self._signal_stop()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()

    def join(self, timeout):
        if self._thread.is_alive():
            self._thread.join(timeout)

    def is_alive(self):
        return self._thread.is_alive()


def register(worker):
    with _lock:
        _workers.add(worker)


def stop_all(wait_s=EXIT_WAIT_S):
    """Stops every registered worker; returns the number still alive after wait_s."""
    with _lock:
        workers = list(_workers)
    for worker in workers:
        worker.stop_now()
    deadline = time.monotonic() + wait_s
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
    return sum(1 for worker in workers if worker.is_alive())


atexit.register(stop_all)
