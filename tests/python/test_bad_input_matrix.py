"""Bad input against the real foreshockd: every rejection path yields its gRPC
status (or Ack rejection) and its counter, and a well-behaved client streaming
at the same time keeps getting acks throughout.

Streams here are raw (bytes in, bytes out) so that the tests can send what the
Python stubs would refuse to serialize: invalid UTF-8, garbage, truncation.
"""
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest

from conftest import wait_until
from foreshock import prometheus
from foreshock.sender import RecordQueue, Sender
from foreshock.v1 import ingest_pb2 as pb

METHOD = "/foreshock.v1.Ingest/Stream"
# Every run here has job "matrix", one tenant: its share of --max_runs
# (--max_runs_per_tenant) is tested in tests/server/ingest/rank_ownership_test.cc,
# the total here.
LIMIT_FLAGS = ("--max_message_mb=1", "--max_tensor_elements=4096", "--max_runs=50",
               "--max_runs_per_tenant=0", "--max_streams=16", "--workers=2",
               "--hello_timeout_ms=1500", "--max_probe_ids_per_run=2")


def hello_bytes(run_id="bad", **kwargs):
    return pb.StreamRequest(hello=pb.Hello(run_id=run_id, job="matrix", **kwargs)).SerializeToString()


def batch_bytes(seq, records):
    return pb.StreamRequest(batch=pb.Batch(seq=seq, records=records)).SerializeToString()


def qk_record(shape=(2, 8, 4), step=1, layer=0, short=0, probe_id="p"):
    data = np.zeros(shape, dtype=np.float32).tobytes()
    q = pb.Tensor(dtype=pb.FLOAT32, shape=list(shape), data=data)
    k = pb.Tensor(dtype=pb.FLOAT32, shape=list(shape), data=data[:len(data) - short])
    return pb.Record(step=step, qk=pb.QKSample(layer=layer, probe_id=probe_id, q=q, k=k, causal=True))


class RawStream:
    """One raw ingest stream: messages are bytes; responses parsed."""

    def __init__(self, endpoint):
        self.channel = grpc.insecure_channel(endpoint)
        self.call_fn = self.channel.stream_stream(METHOD, request_serializer=None,
                                                  response_deserializer=pb.StreamResponse.FromString)

    def run(self, messages, timeout=10):
        """Sends `messages`, half-closes; returns (responses, code, details, trailing)."""
        responses = []
        call = self.call_fn(iter(messages), timeout=timeout)
        try:
            for response in call:
                responses.append(response)
            return responses, grpc.StatusCode.OK, "", ()
        except grpc.RpcError as e:
            return responses, e.code(), e.details(), e.trailing_metadata() or ()
        finally:
            self.channel.close()


def run_stream(endpoint, messages, timeout=10):
    return RawStream(endpoint).run(messages, timeout)


class GoodClient:
    """A well-behaved sender streaming one scalars record every 20 ms."""

    def __init__(self, endpoint, run_id="good"):
        self.queue = RecordQueue(10000, 1 << 24)
        self.sender = Sender(endpoint, pb.Hello(run_id=run_id, job="matrix"), self.queue,
                             backoff_initial_s=0.05, backoff_max_s=0.2)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._feed, daemon=True)
        self.step = 0

    def _feed(self):
        while not self.stop.is_set():
            record = pb.Record(step=self.step, scalars=pb.StepScalars(loss=1.0))
            self.queue.put_nowait(record, record.ByteSize())
            self.step += 1
            time.sleep(0.02)

    def __enter__(self):
        self.sender.start()
        self.thread.start()
        assert wait_until(lambda: self.acked() >= 3, timeout_s=10), self.sender.stats()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.sender.close(timeout=10)

    def acked(self):
        return self.sender.stats()["acked_records"]

    def assert_flowing(self):
        """Acks still arrive: at least 5 more within 10 s."""
        start = self.acked()
        assert wait_until(lambda: self.acked() >= start + 5, timeout_s=10), (
            f"the good client's acks stopped at {self.acked()}: {self.sender.stats()}")


def rejected(daemon):
    return {labels["reason"]: value for name, labels, value in daemon.scrape()
            if name == "foreshock_ingest_rejected_total"}


def wait_counter(daemon, reason, at_least):
    samples, ok = daemon.wait_for(
        lambda s: (prometheus.value(s, "foreshock_ingest_rejected_total", reason=reason) or 0)
        >= at_least, timeout_s=10)
    assert ok, f"{reason}: {rejected(daemon)}"


@pytest.fixture
def daemon(start_foreshockd):
    return start_foreshockd(*LIMIT_FLAGS)


STREAM_CASES = {
    # name: (messages, status, reason)
    "batch_before_hello": ([batch_bytes(1, [qk_record()])], grpc.StatusCode.INVALID_ARGUMENT,
                           "batch_before_hello"),
    "duplicate_hello": ([hello_bytes(), hello_bytes()], grpc.StatusCode.INVALID_ARGUMENT,
                        "duplicate_hello"),
    "empty_run_id": ([hello_bytes(run_id="")], grpc.StatusCode.INVALID_ARGUMENT, "bad_hello"),
    "id_too_long": ([hello_bytes(run_id="r" * 300)], grpc.StatusCode.INVALID_ARGUMENT, "bad_hello"),
    "empty_request": ([b""], grpc.StatusCode.INVALID_ARGUMENT, "empty_request"),
    "garbage": ([b"\xff\xff\xff\xff"], grpc.StatusCode.INVALID_ARGUMENT, "malformed_request"),
    "truncated_message": ([batch_bytes(1, [qk_record()])[:-9]], grpc.StatusCode.INVALID_ARGUMENT,
                          "malformed_request"),
    "utf8_run_id": ([hello_bytes(run_id="RUNID").replace(b"RUNID", b"RU\xff\xfeD")],
                    grpc.StatusCode.INVALID_ARGUMENT, "malformed_request"),
    "utf8_label": ([hello_bytes(labels={"team": "LABEL"}).replace(b"LABEL", b"LA\xc3\x28L")],
                   grpc.StatusCode.INVALID_ARGUMENT, "malformed_request"),
    "utf8_probe_id": ([hello_bytes(), batch_bytes(1, [qk_record()]).replace(b"\x12\x01p",
                                                                            b"\x12\x01\xff")],
                      grpc.StatusCode.INVALID_ARGUMENT, "malformed_request"),
}


def test_stream_level_rejections_each_give_their_status_and_counter(daemon):
    with GoodClient(daemon.endpoint) as good:
        for name, (messages, status, reason) in STREAM_CASES.items():
            before = rejected(daemon).get(reason, 0)
            _, code, details, _ = run_stream(daemon.endpoint, messages)
            assert code == status, f"{name}: {code} {details}"
            assert details.startswith(reason + ":"), f"{name}: {details}"
            if name.startswith("utf8"):
                assert "UTF-8" in details, details
            wait_counter(daemon, reason, before + 1)
        good.assert_flowing()


def test_record_rejections_come_back_in_the_ack_with_their_counter(daemon):
    cases = [
        ("byte_length_mismatch", qk_record(short=4)),
        ("tensor_too_large", qk_record(shape=(4, 64, 32))),  # 8192 elements > 4096
        ("shape_over_limit", qk_record(shape=(2, 5000, 4))),
        ("negative_step", pb.Record(step=-1, scalars=pb.StepScalars(loss=1.0))),
        ("missing_payload", pb.Record(step=1)),
        ("layer_out_of_range", qk_record(layer=5000)),
    ]
    with GoodClient(daemon.endpoint) as good:
        messages = [hello_bytes("records"), batch_bytes(1, [r for _, r in cases] + [qk_record()]),
                    batch_bytes(1, [qk_record()])]  # seq not above the previous one
        responses, code, details, _ = run_stream(daemon.endpoint, messages)
        assert code == grpc.StatusCode.OK, details
        acks = [r.ack for r in responses if r.WhichOneof("kind") == "ack"]
        assert len(acks) == 2
        assert acks[0].accepted == 1
        got = {r.index: r.reason.split(":")[0] for r in acks[0].rejections}
        assert got == {i: reason for i, (reason, _) in enumerate(cases)}
        assert acks[1].accepted == 0
        assert acks[1].rejections[0].reason.startswith("non_increasing_seq:")
        for reason, _ in cases + [("non_increasing_seq", None)]:
            wait_counter(daemon, reason, 1)
        good.assert_flowing()


def test_probe_ids_per_run_are_bounded_across_streams(daemon):
    # --max_probe_ids_per_run=2: each probe_id keeps detector state per layer,
    # so a client that invents one per step is refused, run-wide.
    records = [qk_record(probe_id=p) for p in ("p0", "p1", "p2", "p0")]
    responses, code, details, _ = run_stream(
        daemon.endpoint, [hello_bytes("probes"), batch_bytes(1, records)])
    assert code == grpc.StatusCode.OK, details
    ack = [r.ack for r in responses if r.WhichOneof("kind") == "ack"][0]
    assert ack.accepted == 3
    assert [(r.index, r.reason.split(":")[0]) for r in ack.rejections] == \
        [(2, "too_many_probe_ids")]
    responses, _, _, _ = run_stream(  # another stream (rank) of the same run
        daemon.endpoint, [hello_bytes("probes", rank=1), batch_bytes(1, [qk_record(probe_id="p3"),
                                                                         qk_record(probe_id="p1")])])
    ack = [r.ack for r in responses if r.WhichOneof("kind") == "ack"][0]
    assert ack.accepted == 1 and ack.rejections[0].reason.startswith("too_many_probe_ids:")
    wait_counter(daemon, "too_many_probe_ids", 2)


def test_oversized_message_is_refused_and_the_daemon_keeps_serving(daemon):
    # --max_message_mb=1: a 1.5 MiB batch is refused by the service, explained and
    # counted; a 3 MiB one is beyond gRPC's transport limit (twice ours) and refused
    # before it is read. The good client's acks keep flowing throughout.
    with GoodClient(daemon.endpoint) as good:
        big = pb.Record(step=1, qk=pb.QKSample(layer=0, q=pb.Tensor(data=b"\0" * (3 << 19))))
        _, code, details, _ = run_stream(daemon.endpoint, [hello_bytes("big"), batch_bytes(1, [big])])
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert details.startswith("message_too_large: ") and "--max_message_mb" in details, details
        wait_counter(daemon, "message_too_large", 1)
        huge = pb.Record(step=1, qk=pb.QKSample(layer=0, q=pb.Tensor(data=b"\0" * (3 << 20))))
        _, code, details, _ = run_stream(daemon.endpoint, [hello_bytes("huge"), batch_bytes(1, [huge])])
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        good.assert_flowing()


def test_sender_drops_a_batch_over_the_message_limit_and_delivers_the_rest(daemon):
    queue = RecordQueue(100, 1 << 24)
    sender = Sender(daemon.endpoint, pb.Hello(run_id="too-large", job="matrix"), queue,
                    backoff_initial_s=0.05, backoff_max_s=0.2)
    sender.start()
    try:
        big = pb.Record(step=1, qk=pb.QKSample(layer=0, q=pb.Tensor(data=b"\0" * (3 << 19))))
        queue.put_nowait(big, big.ByteSize())
        assert wait_until(lambda: sender.stats()["dropped_too_large"] == 1, timeout_s=10), \
            sender.stats()
        for step in range(2, 5):
            record = pb.Record(step=step, scalars=pb.StepScalars(loss=1.0))
            queue.put_nowait(record, record.ByteSize())
        assert wait_until(lambda: sender.stats()["acked_records"] == 3, timeout_s=10), \
            sender.stats()
    finally:
        sender.close(timeout=10)


def test_client_cancelling_mid_batch_and_stalled_clients_do_not_block_others(daemon):
    with GoodClient(daemon.endpoint) as good:
        # Truncated streams: the client cancels while a batch is in flight.
        for _ in range(5):
            channel = grpc.insecure_channel(daemon.endpoint)
            fn = channel.stream_stream(METHOD, request_serializer=None,
                                       response_deserializer=pb.StreamResponse.FromString)
            call = fn(iter([hello_bytes("cancel"), batch_bytes(1, [qk_record()] * 50)]))
            next(call)  # the HelloAck
            call.cancel()
            channel.close()
        # Stalled clients: a Hello, then nothing, while the good client streams.
        release = threading.Event()

        def stalled_messages():
            yield hello_bytes("stalled")
            release.wait(30)

        channels, calls = [], []
        for _ in range(5):
            channel = grpc.insecure_channel(daemon.endpoint)
            fn = channel.stream_stream(METHOD, request_serializer=None,
                                       response_deserializer=pb.StreamResponse.FromString)
            call = fn(stalled_messages())
            assert next(call).WhichOneof("kind") == "hello_ack"
            channels.append(channel)
            calls.append(call)
        good.assert_flowing()
        # A fresh well-behaved stream also gets through.
        responses, code, details, _ = run_stream(
            daemon.endpoint, [hello_bytes("fresh"), batch_bytes(1, [qk_record()])])
        assert code == grpc.StatusCode.OK and responses[-1].ack.accepted == 1, details
        release.set()
        for call in calls:
            list(call)
        for channel in channels:
            channel.close()
        # Every stream is gone again: only the good client's remains.
        _, ok = daemon.wait_for(
            lambda s: prometheus.value(s, "foreshock_ingest_active_streams") == 1)
        assert ok, daemon.scrape()
        good.assert_flowing()


def test_streams_beyond_max_streams_are_refused_with_a_retry_hint(daemon):
    with GoodClient(daemon.endpoint) as good:
        release = threading.Event()

        def stalled_messages():
            yield hello_bytes("hold")
            release.wait(30)

        channels, calls = [], []
        for _ in range(15):  # with the good client's: 16 = --max_streams
            channel = grpc.insecure_channel(daemon.endpoint)
            fn = channel.stream_stream(METHOD, request_serializer=None,
                                       response_deserializer=pb.StreamResponse.FromString)
            call = fn(stalled_messages())
            next(call)
            channels.append(channel)
            calls.append(call)
        _, code, details, trailing = run_stream(daemon.endpoint, [hello_bytes("one-too-many")])
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert details.startswith("too_many_streams:") and "retry" in details, details
        assert ("retry-after-ms", "1000") in tuple(trailing), trailing
        wait_counter(daemon, "too_many_streams", 1)
        good.assert_flowing()
        release.set()
        for call in calls:
            list(call)
        for channel in channels:
            channel.close()
        # Room again: a new stream is served.
        assert wait_until(lambda: run_stream(daemon.endpoint, [hello_bytes("after")])[1]
                          == grpc.StatusCode.OK, timeout_s=10)


def test_connections_that_never_send_a_hello_are_ended_and_free_their_slot(daemon):
    # --max_streams=16, --hello_timeout_ms=1500: 15 silent streams plus the good
    # client fill every slot; the silent ones end with DEADLINE_EXCEEDED and the
    # slots are free again, while the good client's acks keep flowing.
    with GoodClient(daemon.endpoint) as good:
        release = threading.Event()

        def silent():
            release.wait(30)
            return
            yield  # a generator that sends nothing

        channels, calls = [], []
        for _ in range(15):
            channel = grpc.insecure_channel(daemon.endpoint)
            fn = channel.stream_stream(METHOD, request_serializer=None,
                                       response_deserializer=pb.StreamResponse.FromString)
            channels.append(channel)
            calls.append(fn(silent(), timeout=20))
        for call in calls:
            with pytest.raises(grpc.RpcError) as info:
                list(call)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value
            assert info.value.details().startswith("hello_timeout: "), info.value.details()
        release.set()
        for channel in channels:
            channel.close()
        wait_counter(daemon, "hello_timeout", 15)
        good.assert_flowing()
        # Every slot but the good client's is free: 15 new streams at once are served.
        hold = threading.Event()

        def hello_then_hold(i):
            yield hello_bytes(f"after-{i}")
            hold.wait(30)

        channels, calls = [], []
        for i in range(15):
            channel = grpc.insecure_channel(daemon.endpoint)
            fn = channel.stream_stream(METHOD, request_serializer=None,
                                       response_deserializer=pb.StreamResponse.FromString)
            channels.append(channel)
            calls.append(fn(hello_then_hold(i), timeout=20))
        for call in calls:
            assert next(call).HasField("hello_ack")
        hold.set()
        for call in calls:
            list(call)
        for channel in channels:
            channel.close()


def test_ten_thousand_run_ids_beyond_max_runs_are_refused(start_foreshockd):
    # The run limit under test, not the stream limit: refused streams free
    # their --max_streams slot as the daemon finishes them, which on a loaded
    # machine can lag behind 8 clients opening the next ones (a refusal for
    # too_many_streams, not too_many_runs).
    # None of these runs stores a sample: none may stop counting meanwhile.
    daemon = start_foreshockd(*[f for f in LIMIT_FLAGS if not f.startswith("--max_streams=")],
                              "--max_streams=256", "--empty_run_release_s=3600")
    with GoodClient(daemon.endpoint) as good:  # run "good" is one of the 50
        channel = grpc.insecure_channel(daemon.endpoint)
        fn = channel.stream_stream(METHOD, request_serializer=None,
                                   response_deserializer=pb.StreamResponse.FromString)

        def hello(i):
            try:
                responses = list(fn(iter([hello_bytes(f"run-{i}")]), timeout=30))
                return grpc.StatusCode.OK if responses else None, "", i
            except grpc.RpcError as e:
                return e.code(), e.details(), i

        with futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(hello, range(10000)))
        channel.close()
        admitted = [r for r in results if r[0] == grpc.StatusCode.OK]
        refused = [r for r in results if r[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert len(admitted) == 49 and len(refused) == 10000 - 49, (
            len(admitted), len(refused), set(r[0] for r in results))
        assert all(d.startswith("too_many_runs:") for _, d, _ in refused), \
            {d.split(":")[0] for _, d, _ in refused}
        wait_counter(daemon, "too_many_runs", 10000 - 49)
        # Known runs keep being admitted.
        _, code, details, _ = run_stream(daemon.endpoint, [hello_bytes(f"run-{admitted[0][2]}")])
        assert code == grpc.StatusCode.OK, details
        good.assert_flowing()


# -- issue 16: no client can starve the others; bad input never costs others --

def _rss_mb(daemon):
    with open(f"/proc/{daemon.process.pid}/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


def _open_hello_then_silence(endpoint, run_id, release, timeout=30):
    """A stream that sends its Hello and then nothing; returns (channel, call) after the HelloAck."""
    def messages():
        yield hello_bytes(run_id)
        release.wait(timeout)

    channel = grpc.insecure_channel(endpoint)
    fn = channel.stream_stream(METHOD, request_serializer=None,
                               response_deserializer=pb.StreamResponse.FromString)
    call = fn(messages(), timeout=timeout)
    try:
        assert next(call).HasField("hello_ack")
    except grpc.RpcError:
        channel.close()
        raise
    return channel, call


def test_hello_then_silence_streams_end_on_the_idle_timeout_and_free_their_slots(start_foreshockd):
    # The finding: 1,024 streams that said Hello and then nothing held every
    # --max_streams slot for ever. Here 16 of them fill --max_streams=16; with
    # --stream_idle_timeout_ms=1000 they end with DEADLINE_EXCEEDED, counted,
    # and a well-behaved client then connects and gets acks.
    daemon = start_foreshockd("--max_streams=16", "--stream_idle_timeout_ms=1000", "--workers=2")
    release = threading.Event()
    held = [_open_hello_then_silence(daemon.endpoint, f"silent-{i}", release) for i in range(16)]
    try:
        _, code, details, _ = run_stream(daemon.endpoint, [hello_bytes("locked-out")])
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith("too_many_streams:")
        for _, call in held:
            with pytest.raises(grpc.RpcError) as info:
                list(call)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value
            assert info.value.details().startswith("stream_idle_timeout: "), info.value.details()
        wait_counter(daemon, "stream_idle_timeout", 16)
        with GoodClient(daemon.endpoint) as good:
            good.assert_flowing()
    finally:
        release.set()
        for channel, _ in held:
            channel.close()


def test_one_run_opening_streams_is_refused_while_another_run_gets_acks(start_foreshockd):
    # Without --token_file the tenant is the run_id: one run opening streams
    # is stopped at --max_streams_per_tenant, far below --max_streams, and
    # another run's client still connects and gets acks.
    daemon = start_foreshockd("--max_streams=64", "--max_streams_per_tenant=4", "--workers=2")
    release = threading.Event()
    held, refusal = [], None
    try:
        for _ in range(64):
            try:
                held.append(_open_hello_then_silence(daemon.endpoint, "greedy", release))
            except grpc.RpcError as e:
                refusal = (e.code(), e.details(), e.trailing_metadata() or ())
                break
        assert len(held) == 4 and refusal is not None, (len(held), refusal)
        code, details, trailing = refusal
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert details.startswith("too_many_streams_for_tenant: run 'greedy'"), details
        assert ("retry-after-ms", "1000") in tuple(trailing), trailing
        wait_counter(daemon, "too_many_streams_for_tenant", 1)
        with GoodClient(daemon.endpoint, run_id="polite") as good:
            good.assert_flowing()
    finally:
        release.set()
        for channel, _ in held:
            channel.close()


def test_a_huge_layer_rayleigh_is_rejected_and_creates_no_series(start_foreshockd):
    # The finding: a CurvatureSample with 100,000 layer_rayleigh values (800 KB)
    # created 100,000 series; six such messages took the daemon from 24 MB to
    # 741 MB resident, 1.19 GB after one scrape, and /metrics to 39 MB. Now each
    # value must name one of the Hello's n_layers layers.
    daemon = start_foreshockd("--workers=2")
    hello = pb.StreamRequest(hello=pb.Hello(run_id="rayleigh", job="matrix",
                                            model=pb.ModelInfo(n_layers=32))).SerializeToString()
    huge = pb.Record(step=1, curvature=pb.CurvatureSample(
        lambda_max=10.0, residual=0.01, lr=1e-3, beta1=0.9, preconditioned=True,
        layer_rayleigh=[float(i) for i in range(100000)]))
    rss_before = _rss_mb(daemon)
    text_before = daemon.metrics_text()
    for i in range(6):
        message = batch_bytes(1, [huge])
        assert len(message) > 800000
        responses, code, details, _ = run_stream(daemon.endpoint, [hello, message], timeout=30)
        assert code == grpc.StatusCode.OK, details
        ack = responses[-1].ack
        assert ack.accepted == 0 and len(ack.rejections) == 1, ack
        assert ack.rejections[0].reason.startswith(
            "too_many_layers: layer_rayleigh has 100000 values"), ack.rejections[0].reason
    wait_counter(daemon, "too_many_layers", 6)
    text = daemon.metrics_text()
    assert "foreshock_curvature_block_rayleigh{" not in text
    assert len(text) < len(text_before) + 4000, (len(text_before), len(text))
    assert _rss_mb(daemon) - rss_before < 64, (rss_before, _rss_mb(daemon))
    # A sample with one value per layer is accepted: 32 block series, no more.
    good = pb.Record(step=2, curvature=pb.CurvatureSample(
        lambda_max=10.0, residual=0.01, lr=1e-3, beta1=0.9, preconditioned=True,
        layer_rayleigh=[0.5] * 32))
    responses, code, details, _ = run_stream(daemon.endpoint, [hello, batch_bytes(1, [good])])
    assert code == grpc.StatusCode.OK and responses[-1].ack.accepted == 1, details
    samples, ok = daemon.wait_for(lambda s: sum(
        1 for n, l, _ in s if n == "foreshock_curvature_block_rayleigh") == 32, timeout_s=10)
    assert ok, [x for x in samples if x[0] == "foreshock_curvature_block_rayleigh"][:5]


def test_a_step_far_beyond_the_run_is_rejected_and_later_steps_are_not_stale(daemon):
    # The finding: one record with step 2^63-1 was accepted and became the
    # run's last step, so every real later step could be taken as stale.
    def scalars(step):
        return pb.Record(step=step, scalars=pb.StepScalars(loss=1.0 + 0.01 * (step % 7)))

    messages = [hello_bytes("steps"), batch_bytes(1, [scalars(5)]),
                batch_bytes(2, [scalars(2 ** 63 - 1)]),
                batch_bytes(3, [scalars(step) for step in range(6, 31)])]
    responses, code, details, _ = run_stream(daemon.endpoint, messages)
    assert code == grpc.StatusCode.OK, details
    acks = [r.ack for r in responses if r.WhichOneof("kind") == "ack"]
    assert [a.accepted for a in acks] == [1, 0, 25], acks
    assert acks[1].rejections[0].reason.startswith(
        "step_out_of_range: step 9223372036854775807 is more than 100000000 beyond"), acks[1]
    wait_counter(daemon, "step_out_of_range", 1)
    samples, ok = daemon.wait_for(
        lambda s: prometheus.value(s, "foreshock_last_step", run="steps") == 30)
    assert ok, prometheus.value(samples, "foreshock_last_step", run="steps")
    assert (prometheus.value(samples, "foreshock_alert_points_total", outcome="stale") or 0) == 0
