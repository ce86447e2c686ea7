"""An in-process foreshock.v1.Ingest server for client tests that need no daemon.

It records what arrives (per stream: the Hello and the Batches), acks every
batch, can reject chosen records, and can hold acks back to leave batches in
flight. It implements the contract from the proto, not the daemon's logic.
"""
import concurrent.futures
import threading
import time

import grpc

from foreshock.v1 import ingest_pb2 as pb
from foreshock.v1 import ingest_pb2_grpc as pb_grpc


class FakeIngest(pb_grpc.IngestServicer):
    def __init__(self, reject=None):
        self.reject = reject          # record -> reason string or None
        self.fail_hellos = 0          # fail this many streams (UNAVAILABLE) instead of a HelloAck
        self.hello_delay_s = 0.0      # wait this long before answering a Hello
        self.release_hellos = threading.Event()
        self.release_hellos.set()     # clear() to hold every HelloAck back until set()
        # End this many streams as the daemon ends an idle one (DEADLINE_EXCEEDED
        # stream_idle_timeout), each when a batch arrives, without acking it.
        self.idle_end_on_batch = 0
        self.streams = []             # one dict per stream: {"hello": Hello, "batches": [Batch]}
        self.release_acks = threading.Event()
        self.release_acks.set()       # clear() to hold acks back
        self.lock = threading.Lock()

    def Stream(self, request_iterator, context):
        stream = {"hello": None, "batches": []}
        with self.lock:
            self.streams.append(stream)
        for request in request_iterator:
            if request.WhichOneof("kind") == "hello":
                stream["hello"] = request.hello
                time.sleep(self.hello_delay_s)
                while not self.release_hellos.wait(0.05):
                    if not context.is_active():
                        return
                with self.lock:
                    fail, self.fail_hellos = self.fail_hellos > 0, max(0, self.fail_hellos - 1)
                if fail:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "not ready")
                yield pb.StreamResponse(hello_ack=pb.HelloAck(session_id=f"s{len(self.streams)}"))
                continue
            batch = request.batch
            with self.lock:
                stream["batches"].append(batch)
                idle_end, self.idle_end_on_batch = (self.idle_end_on_batch > 0,
                                                    max(0, self.idle_end_on_batch - 1))
            if idle_end:
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                              "stream_idle_timeout: no message for 300000 ms")
            while not self.release_acks.wait(0.05):
                if not context.is_active():
                    return
            ack = pb.Ack(seq=batch.seq)
            for index, record in enumerate(batch.records):
                reason = self.reject(record) if self.reject else None
                if reason:
                    ack.rejections.add(index=index, reason=reason)
                else:
                    ack.accepted += 1
            yield pb.StreamResponse(ack=ack)

    def records(self):
        with self.lock:
            return [r for s in self.streams for b in s["batches"] for r in b.records]


class FakeServer:
    """Serves a FakeIngest on 127.0.0.1:port; stop() and start() again on the same port."""

    def __init__(self, port, servicer=None):
        self.port = port
        self.servicer = servicer or FakeIngest()
        self.server = None

    @property
    def endpoint(self):
        return f"127.0.0.1:{self.port}"

    def start(self):
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_IngestServicer_to_server(self.servicer, self.server)
        if self.server.add_insecure_port(self.endpoint) != self.port:
            raise RuntimeError(f"could not bind {self.endpoint}")
        self.server.start()
        return self

    def stop(self):
        if self.server is not None:
            self.server.stop(grace=None).wait()
            self.server = None
