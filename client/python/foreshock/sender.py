"""The background sender: a bounded record queue and the thread that streams it.

The training thread only ever calls RecordQueue.put_nowait, which never waits
on the network: when the queue is full the record is dropped and counted.
One sender thread owns the gRPC stream `foreshock.v1.Ingest/Stream`:

- each stream starts with Hello and takes records from the queue only once the
  HelloAck came back, so records wait in the queue (not on a dead socket)
  while the daemon is down;
- records go out in Batches of up to `max_batch_bytes`; `seq` is per sender,
  not per stream: it starts at the current Unix time in microseconds (so a
  restarted process numbers above its predecessor) and keeps increasing across
  streams; Hello.first_seq says so, and the daemon deduplicates by
  (run_id, rank, sender_id, seq), sender_id being drawn from the OS (not
  the seedable `random`) per Sender;
- every batch stays in an unacked buffer (at most `max_unacked_bytes`; beyond
  that the oldest batches are dropped and their records counted as
  `dropped_unacked`) until its Ack settles it: accepted records, rejections (by
  reason code) or `duplicates` (a resend the daemon had already stored);
- when the stream breaks, the thread reconnects with exponential backoff and
  jitter; the new stream sends Hello (first_seq: the oldest unacked seq), then
  resends every unacked batch with its old seq (counted as `resent` records),
  then new ones. The training thread never waits for any of this;
- a daemon at one of its limits (too_many_streams, too_many_streams_for_tenant,
  memory_limit) sends retry-after-ms, which replaces the backoff for that wait;
  a batch over the daemon's --max_message_mb (message_too_large) is dropped,
  not resent, and its records counted as `dropped_too_large`;
- a rank another sender's live stream holds (ALREADY_EXISTS rank_in_use: two
  processes with one rank, or this restarted process while its predecessor's
  connection has not ended yet) is retried after the daemon's retry-after-ms
  hint, with the backoff, until the rank is free (the daemon hands it over
  once the holder's stream ends or is idle past --rank_takeover_grace_ms);
  counted as `rank_in_use`, and the training thread never waits for it;
- a stream the daemon ended for idleness (stream_idle_timeout: nothing sent
  for its --stream_idle_timeout_ms, everything sent acked) is reopened only
  once there is something to send (counted as `idle_closes`);
- close(goodbye=True) (Monitor.close) sends, after everything queued, one last
  batch with Batch.goodbye: this sender is done with the run. It is kept and
  resent like any batch until its Ack, which the daemon sends once the end
  counts (docs/DESIGN.md §3.4); older daemons ack it as an empty batch.
"""
import collections
import logging
import random
import secrets
import re
import threading
import time

import grpc

from foreshock import _exit
from foreshock.security import Security
from foreshock.v1 import ingest_pb2 as pb
from foreshock.v1 import ingest_pb2_grpc as pb_grpc

log = logging.getLogger("foreshock")

# How often blocked waits wake up to notice a closed stream or an abort.
_POLL_S = 0.05
# Reconnect jitter from the OS: with a seeded global `random`, every rank of a
# job would back off in lockstep.
_JITTER = random.SystemRandom()


class RecordQueue:
    """A FIFO bounded both in records and in bytes; put_nowait never blocks."""

    def __init__(self, max_records, max_bytes):
        if max_records < 1 or max_bytes < 1:
            raise ValueError("queue bounds must be positive")
        self.max_records = max_records
        self.max_bytes = max_bytes
        self._items = collections.deque()  # (record, byte size)
        self._bytes = 0
        self._cond = threading.Condition()

    def put_nowait(self, record, size):
        """Appends the record, or returns False when it does not fit."""
        with self._cond:
            if len(self._items) >= self.max_records or self._bytes + size > self.max_bytes:
                return False
            self._items.append((record, size))
            self._bytes += size
            self._cond.notify()
            return True

    def take_batch(self, max_bytes, timeout):
        """Waits up to `timeout` for a record, then takes records while they fit in
        `max_bytes` (always at least one, however large)."""
        with self._cond:
            if not self._items:
                self._cond.wait(timeout)
            batch, total = [], 0
            while self._items and (not batch or total + self._items[0][1] <= max_bytes):
                record, size = self._items.popleft()
                batch.append((record, size))
                total += size
            self._bytes -= total
            return batch

    def put_front(self, batch):
        """Returns records that never reached the wire to the head of the queue."""
        with self._cond:
            for item in reversed(batch):
                self._items.appendleft(item)
                self._bytes += item[1]
            self._cond.notify()

    def __len__(self):
        with self._cond:
            return len(self._items)


class _Stream:
    """State of one gRPC stream, shared by its request generator and the response loop."""

    def __init__(self):
        self.lock = threading.Lock()
        self.hello_acked = threading.Event()
        self.closed = False
        self.in_flight = {}  # seq -> number of records, sent on this stream, not acked


class Sender(_exit.BackgroundWorker):
    """Owns the sender thread. Thread-safe: stats() and close() may be called from anywhere."""

    def __init__(self, endpoint, hello, queue, *, max_unacked_bytes=64 << 20, on_settled=None,
                 max_batch_bytes=1 << 20,
                 backoff_initial_s=0.1, backoff_max_s=5.0, channel_options=(), security=None):
        self._endpoint = endpoint
        self._security = security or Security()  # TLS and token (foreshock.security)
        self._hello = pb.StreamRequest(hello=hello)
        self._queue = queue
        self._max_batch_bytes = max_batch_bytes
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._channel_options = list(channel_options)
        self._closing = threading.Event()  # flush what is queued, then stop
        self._abort = threading.Event()    # stop now
        self._lock = threading.Lock()
        self._call = None
        self._counts = dict(sent=0, batches_sent=0, acked_records=0, duplicates=0, resent=0,
                            dropped_unacked=0, unacked=0, reconnects=0, unsent_at_close=0,
                            dropped_too_large=0, idle_closes=0, failed_connects=0,
                            rank_in_use=0, goodbye_acked=False)
        self._ever_accepted = False  # a stream got its HelloAck before: the next one is a reconnect
        # Batches sent and not acked, oldest first: seq -> [(record, size)].
        self._max_unacked_bytes = max_unacked_bytes
        self._retry_after_s = None  # the last refusal's retry hint, for the next wait
        self._idle_ended = False    # the last stream was ended by the daemon for idleness
        self._unacked = collections.OrderedDict()
        self._unacked_bytes = 0
        self._next_seq = time.time_ns() // 1000
        # From the OS, never the global `random`: training scripts seed that
        # (random.seed, transformers.set_seed), which would give every restart
        # of a job the same id, and the daemon would take it for a reconnect.
        self._sender_id = secrets.randbits(63) + 1
        self._goodbye = False       # close(goodbye=True): end with a Batch.goodbye
        self._goodbye_seq = None    # its seq, once sent
        # Set at the first HelloAck: the daemon has taken this sender's Hello
        # (and with it, a restart of the run: Monitor.on_alert waits for it).
        self.hello_acked = threading.Event()
        # Called on the sender's response thread as on_settled(records, ack)
        # for every batch an Ack settles (accepted, rejected or duplicate).
        self._on_settled = on_settled
        self._rejected = collections.Counter()
        self._connected = False
        self._thread = threading.Thread(target=self._run, name="foreshock-sender", daemon=True)

    def start(self):
        _exit.register(self)  # stopped before the interpreter finalizes
        self._thread.start()

    def _signal_stop(self):
        self._abort.set()

    def stats(self):
        with self._lock:
            return dict(self._counts, unacked=sum(len(b) for b in self._unacked.values()),
                        rejected=dict(self._rejected), connected=self._connected)

    def _settled(self):
        with self._lock:
            return not self._unacked

    def _done(self):
        """Closing and nothing left to deliver, the goodbye included."""
        with self._lock:
            goodbye_done = not self._goodbye or self._counts["goodbye_acked"]
        return (self._closing.is_set() and len(self._queue) == 0 and self._settled()
                and goodbye_done)

    def _batch(self, seq, batch):
        return pb.StreamRequest(batch=pb.Batch(seq=seq, records=[r for r, _ in batch],
                                               goodbye=pb.Goodbye() if seq == self._goodbye_seq
                                               else None))

    def close(self, timeout, goodbye=False):
        """Sends what is queued and waits for its acks, for at most `timeout` seconds.
        With goodbye, then tells the daemon this sender is done with the run and
        waits for that to be acked too."""
        self._goodbye = goodbye
        self._closing.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            # Still alive at exit, the atexit hook (foreshock._exit) waits for it.
            self.stop_now()
            self._thread.join(1.0)
        with self._lock:
            self._counts["unsent_at_close"] = len(self._queue) + sum(
                len(b) for b in self._unacked.values())

    # -- sender thread -------------------------------------------------------

    def _run(self):
        backoff = self._backoff_initial_s
        failures = 0  # consecutive streams without a HelloAck: log only the first
        while not self._abort.is_set():
            if self._done():
                return  # nothing left to deliver
            handshaken, finished = self._run_stream(quiet=failures > 0)
            if finished:
                return
            if handshaken:
                backoff = self._backoff_initial_s
                failures = 0
            else:
                failures += 1
                with self._lock:
                    self._counts["failed_connects"] += 1
            if self._idle_ended:
                # Nothing was pending: open the next stream when there is
                # something to send (or to flush at close).
                self._idle_ended = False
                while not (self._abort.is_set() or self._closing.is_set()
                           or len(self._queue) > 0 or not self._settled()):
                    self._abort.wait(_POLL_S)
                continue
            # Full jitter on the upper half keeps many ranks from reconnecting in lockstep.
            # A daemon at a limit says when to come back (trailing retry-after-ms).
            wait_s, self._retry_after_s = self._retry_after_s or backoff, None
            self._abort.wait(wait_s * _JITTER.uniform(0.5, 1.0))
            backoff = min(backoff * 2, self._backoff_max_s)

    def _run_stream(self, quiet):
        """One stream's life. Returns (got a HelloAck, ended cleanly after a flush)."""
        stream = _Stream()
        channel = self._security.channel(self._endpoint, options=self._channel_options)
        finished = False
        try:
            call = pb_grpc.IngestStub(channel).Stream(self._requests(stream),
                                                      metadata=self._security.metadata)
            with self._lock:
                self._call = call
            if self._abort.is_set():
                call.cancel()
            for response in call:
                kind = response.WhichOneof("kind")
                if kind == "hello_ack":
                    with self._lock:
                        self._connected = True
                        # Counted as documented: streams accepted after the
                        # first, not connection attempts.
                        if self._ever_accepted:
                            self._counts["reconnects"] += 1
                        self._ever_accepted = True
                    log.info("foreshock: connected to %s (session %s)", self._endpoint,
                             response.hello_ack.session_id)
                    stream.hello_acked.set()
                    self.hello_acked.set()
                elif kind == "ack":
                    self._on_ack(stream, response.ack)
            # The server ends the stream after our half-close, i.e. after a flush.
            finished = self._closing.is_set()
        except grpc.RpcError as err:
            self._after_refusal(err)
            if (err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                    and (err.details() or "").startswith("stream_idle_timeout")):
                # Everything sent was acked (a batch that crossed the end stays
                # unacked here and is resent): an ordinary end, not a failure.
                self._idle_ended = True
                with self._lock:
                    self._counts["idle_closes"] += 1
                log.info("foreshock: the daemon closed the idle stream to %s; reopening it "
                         "when there is data", self._endpoint)
            elif (err.code() == grpc.StatusCode.ALREADY_EXISTS
                    and (err.details() or "").startswith("rank_in_use")):
                # Another sender holds this rank (or took it over from this
                # stream): wait for the hint and try again; never give up,
                # never block the training thread.
                with self._lock:
                    self._counts["rank_in_use"] += 1
                    first = self._counts["rank_in_use"] == 1
                log.log(logging.WARNING if first else logging.DEBUG,
                        "foreshock: %s; retrying", err.details())
            elif not self._abort.is_set():
                log.log(logging.DEBUG if quiet and not stream.hello_acked.is_set()
                        else logging.WARNING,
                        "foreshock: stream to %s ended: %s %s; reconnecting", self._endpoint,
                        err.code().name, err.details())
        finally:
            with stream.lock:
                stream.closed = True
                stream.in_flight.clear()  # still unacked: the next stream resends them
            with self._lock:
                self._connected = False
                self._call = None
            channel.close()
        return stream.hello_acked.is_set(), finished

    def _requests(self, stream):
        """Request iterator of one stream; gRPC consumes it on its own thread."""
        with self._lock:
            first_seq = next(iter(self._unacked), self._next_seq)
        hello = pb.StreamRequest()
        hello.CopyFrom(self._hello)
        hello.hello.first_seq = first_seq
        hello.hello.sender_id = self._sender_id
        yield hello
        while not stream.hello_acked.wait(_POLL_S):
            if stream.closed or self._abort.is_set():
                return
        # Resend what earlier streams left unacknowledged, with the same seqs.
        with self._lock:
            resend = list(self._unacked)
        for seq in resend:
            with self._lock:
                batch = self._unacked.get(seq)
                if batch is None:  # dropped (or acked late) meanwhile
                    continue
                self._counts["resent"] += len(batch)
            with stream.lock:
                if stream.closed:
                    return
                stream.in_flight[seq] = len(batch)
            yield self._batch(seq, batch)
        while not (stream.closed or self._abort.is_set()):
            if self._closing.is_set() and len(self._queue) == 0:
                if self._settled():
                    with self._lock:
                        send_goodbye = self._goodbye and self._goodbye_seq is None
                    if not send_goodbye:
                        return  # half-close: everything queued (and the goodbye) acked
                    with stream.lock:
                        if stream.closed:
                            return
                        with self._lock:
                            seq = self._goodbye_seq = self._next_seq
                            self._next_seq += 1
                            self._keep_unacked(seq, [])
                            self._counts["batches_sent"] += 1
                        stream.in_flight[seq] = 0
                    yield self._batch(seq, [])
                    continue
                time.sleep(_POLL_S)
                continue
            batch = self._queue.take_batch(self._max_batch_bytes, _POLL_S)
            if not batch:
                continue
            with stream.lock:
                if stream.closed:
                    self._queue.put_front(batch)
                    return
                with self._lock:
                    seq = self._next_seq
                    self._next_seq += 1
                    self._keep_unacked(seq, batch)
                    self._counts["sent"] += len(batch)
                    self._counts["batches_sent"] += 1
                stream.in_flight[seq] = len(batch)
            yield self._batch(seq, batch)

    def _after_refusal(self, err):
        """A stream the daemon ended at one of its limits: honour its retry hint, and drop
        batches it can never accept (message_too_large) rather than resend them forever."""
        try:
            trailers = dict(err.trailing_metadata() or ())
            if "retry-after-ms" in trailers:
                self._retry_after_s = min(int(trailers["retry-after-ms"]) / 1000.0,
                                          self._backoff_max_s * 4)
        except (TypeError, ValueError):
            pass
        match = re.match(r"message_too_large: .* the limit is (\d+)", err.details() or "")
        if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or not match:
            return
        limit = int(match.group(1))
        with self._lock:
            for seq in list(self._unacked):
                batch = self._unacked[seq]
                size = pb.StreamRequest(batch=pb.Batch(seq=seq, records=[r for r, _ in batch])).ByteSize()
                if size > limit:
                    del self._unacked[seq]
                    self._unacked_bytes -= sum(s for _, s in batch)
                    self._counts["dropped_too_large"] += len(batch)
                    log.warning("foreshock: dropping batch %d (%d records, %d bytes): the daemon "
                                "accepts at most %d bytes per message (--max_message_mb)",
                                seq, len(batch), size, limit)

    def _keep_unacked(self, seq, batch):
        """Holds a sent batch until its ack; drops the oldest beyond the bound. Under _lock."""
        size = sum(s for _, s in batch)
        while self._unacked and self._unacked_bytes + size > self._max_unacked_bytes:
            _, dropped = self._unacked.popitem(last=False)
            self._unacked_bytes -= sum(s for _, s in dropped)
            self._counts["dropped_unacked"] += len(dropped)
        self._unacked[seq] = batch
        self._unacked_bytes += size

    def _on_ack(self, stream, ack):
        with stream.lock:
            n_records = stream.in_flight.pop(ack.seq, None)
        with self._lock:
            batch = self._unacked.pop(ack.seq, None)
            if batch is not None:
                self._unacked_bytes -= sum(s for _, s in batch)
        if n_records is None or batch is None:
            if n_records is None:
                log.warning("foreshock: ack for unknown batch seq %d", ack.seq)
            return  # batch is None: dropped from the unacked buffer meanwhile
        # The daemon lists at most 256 rejections and counts the rest
        # (omitted_rejections, by code in omitted_by_reason).
        rejected = len(ack.rejections) + ack.omitted_rejections
        if ack.accepted + rejected + ack.duplicates != n_records:
            log.warning("foreshock: batch %d had %d records; ack settles %d accepted + %d "
                        "rejected + %d duplicates", ack.seq, n_records, ack.accepted,
                        rejected, ack.duplicates)
        if self._on_settled is not None:
            try:
                self._on_settled([r for r, _ in batch], ack)
            except Exception:  # a user callback never stops the sender
                log.exception("foreshock: on_settled failed")
        with self._lock:
            self._counts["acked_records"] += ack.accepted
            self._counts["duplicates"] += ack.duplicates
            if ack.seq == self._goodbye_seq:
                self._counts["goodbye_acked"] = True
            for rejection in ack.rejections:
                # Reasons read "<code>: <detail>"; the code is the stable part.
                self._rejected[rejection.reason.split(":", 1)[0].strip()] += 1
            by_reason = 0
            for code, count in ack.omitted_by_reason.items():
                self._rejected[code] += count
                by_reason += count
            if ack.omitted_rejections > by_reason:  # a daemon that did not say why
                self._rejected["omitted"] += ack.omitted_rejections - by_reason
        if ack.rejections:
            first = ack.rejections[0]
            log.warning("foreshock: batch %d: %d record(s) rejected, e.g. record %d: %s",
                        ack.seq, rejected, first.index, first.reason)
