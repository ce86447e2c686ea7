"""Every memory path under one bound (issue 34, item 1), against a real
foreshockd over loopback, with memory measured as the daemon's VmHWM against
--max_memory_mb: Acks (a batch of millions of bad records), Hello labels,
curvature records and query responses. The probe flood and the per-run state
budget are in test_memory_bound.py and test_state_budget.py."""
import threading

import grpc

from conftest import wait_until
from foreshock.sender import RecordQueue, Sender
from foreshock.v1 import ingest_pb2 as pb

METHOD = "/foreshock.v1.Ingest/Stream"


def _status_kb(pid, field):
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split(f"{field}:")[1].split()[0])


def _idle_rss_mb(start_foreshockd):
    probe = start_foreshockd()
    idle_mb = _status_kb(probe.process.pid, "VmRSS") >> 10
    probe.stop()
    return idle_mb


def _varint(n):
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _empty_records_batch(seq, n):
    """A serialized StreamRequest{batch: {seq, n empty Records}}: 2 bytes a record
    on the wire (built as bytes: protobuf objects for millions of records would
    take the test's own memory and minutes)."""
    body = b"\x08" + _varint(seq) + b"\x12\x00" * n  # Batch.seq = 1, Batch.records = 2
    return b"\x12" + _varint(len(body)) + body      # StreamRequest.batch = 2


def _raw_stream(endpoint, messages, timeout=120):
    """Sends serialized StreamRequests on one stream; returns the StreamResponses
    and their serialized sizes."""
    responses = []
    with grpc.insecure_channel(endpoint, options=[
            ("grpc.max_send_message_length", 256 << 20),
            ("grpc.max_receive_message_length", 1 << 30)]) as channel:
        call = channel.stream_stream(METHOD, request_serializer=lambda b: b,
                                     response_deserializer=lambda b: b)
        for raw in call(iter(messages), timeout=timeout):
            responses.append((pb.StreamResponse.FromString(raw), len(raw)))
    return responses


def _hello(run, **kwargs):
    return pb.StreamRequest(hello=pb.Hello(run_id=run, job="memory", **kwargs)).SerializeToString()


def test_a_batch_of_millions_of_empty_records_gets_a_small_ack_and_memory_stays_bounded(
        start_foreshockd):
    # Issue 34: a 10 MB batch of 5M empty records made a 408 MB Ack (one
    # rejection per record) and took the daemon to 1,369 MiB against 256.
    limit_mb = _idle_rss_mb(start_foreshockd) + 64
    daemon = start_foreshockd(f"--max_memory_mb={limit_mb}")
    n = 5_000_000
    scalar = pb.Record(step=1)
    scalar.scalars.loss = 2.0
    after = pb.StreamRequest(batch=pb.Batch(seq=3, records=[scalar])).SerializeToString()
    under = 200_000  # below --max_records_per_batch: parsed, each rejected missing_payload
    responses = _raw_stream(daemon.endpoint, [
        _hello("acks"), _empty_records_batch(1, n), _empty_records_batch(2, under), after])
    acks = [(r.ack, size) for r, size in responses if r.HasField("ack")]
    assert [a.seq for a, _ in acks] == [1, 2, 3], acks
    (big, big_size), (mid, mid_size), (last, _) = acks
    # Every record is settled, at most 256 of them listed.
    assert big.accepted == 0 and len(big.rejections) == 256, big.accepted
    assert big.omitted_rejections == n - 256
    assert dict(big.omitted_by_reason) == {"too_many_records": n - 256}
    assert all(r.reason.startswith("too_many_records: ") for r in big.rejections)
    assert [r.index for r in big.rejections] == list(range(256))
    assert mid.accepted == 0 and len(mid.rejections) == 256
    assert dict(mid.omitted_by_reason) == {"missing_payload": under - 256}
    assert mid.omitted_rejections == under - 256
    assert big_size < 64 << 10 and mid_size < 64 << 10, (big_size, mid_size)
    # The stream goes on: the next batch is accepted.
    assert last.accepted == 1 and not last.rejections
    peak_mb = _status_kb(daemon.process.pid, "VmHWM") >> 10
    print(f"ack amplification: VmHWM {peak_mb} MiB, --max_memory_mb={limit_mb}")
    assert peak_mb <= 1.2 * limit_mb, (peak_mb, limit_mb)
    samples = daemon.scrape()
    rejected = {labels.get("reason"): value for name, labels, value in samples
                if name == "foreshock_ingest_rejected_total"}
    assert rejected["too_many_records"] == n
    assert rejected["missing_payload"] == under


def test_the_python_client_counts_rejections_the_ack_only_counts(foreshockd):
    # With more than 256 rejections in a batch the Ack lists 256 and counts
    # the rest; the client's accounting still balances:
    # sent = acked + rejected + duplicates + unacked.
    queue = RecordQueue(10000, 1 << 24)
    n = 1000
    for step in range(n):
        record = pb.Record(step=step)  # no payload: missing_payload
        queue.put_nowait(record, record.ByteSize() + 2)
    acks = []
    sender = Sender(foreshockd.endpoint, pb.Hello(run_id="client-acks", job="memory"), queue,
                    on_settled=lambda records, ack: acks.append((len(records), ack)),
                    backoff_initial_s=0.05, backoff_max_s=0.2)
    sender.start()
    sender.close(timeout=30)
    stats = sender.stats()
    assert stats["sent"] == n and stats["unacked"] == 0, stats
    assert stats["acked_records"] == 0 and stats["rejected"] == {"missing_payload": n}, stats
    assert stats["acked_records"] + sum(stats["rejected"].values()) + stats["duplicates"] \
        + stats["unacked"] == stats["sent"]
    assert all(len(ack.rejections) <= 256 for _, ack in acks), [len(a.rejections) for _, a in acks]
    big = [(count, ack) for count, ack in acks if count > 256]
    assert big, [count for count, _ in acks]  # the queue was full at the start: one batch
    assert all(ack.omitted_rejections == count - 256 for count, ack in big)


def _hello_outcome(endpoint, labels, run="labels"):
    """Sends a Hello with `labels`; returns None when it is acknowledged, else
    the (code, details) that ended the stream."""
    try:
        responses = _raw_stream(endpoint, [_hello(run, labels=labels)], timeout=60)
    except grpc.RpcError as e:
        return e.code(), e.details()
    assert [r.HasField("hello_ack") for r, _ in responses] == [True], responses
    return None


def test_hello_labels_have_bounds_and_a_flood_of_large_labels_stays_bounded(
        start_foreshockd, tmp_path):
    # Issue 34: 30 Hellos with 8 MiB of labels each held 275 MiB (2.15x a
    # 128 MiB bound) and wrote 241 MiB to disk.
    limit_mb = _idle_rss_mb(start_foreshockd) + 64
    daemon = start_foreshockd(f"--max_memory_mb={limit_mb}")
    # At the documented bounds: accepted.
    assert _hello_outcome(daemon.endpoint, {f"k{i}": "v" for i in range(64)}) is None
    assert _hello_outcome(daemon.endpoint, {"k" * 128: "v" * 1024}) is None
    assert _hello_outcome(daemon.endpoint,
                          {f"k{i:02d}": "v" * 1021 for i in range(16)}) is None  # 16,384 bytes
    # One past each: refused, with the reason.
    for labels, what in (({f"k{i}": "v" for i in range(65)}, "65 labels"),
                         ({"k" * 129: "v"}, "a label key of 129 bytes"),
                         ({"k": "v" * 1025}, "is 1025 bytes"),
                         ({f"k{i:02d}": "v" * 1022 for i in range(16)}, "16400 bytes in all")):
        outcome = _hello_outcome(daemon.endpoint, labels)
        assert outcome is not None, what
        code, details = outcome
        assert code == grpc.StatusCode.INVALID_ARGUMENT, outcome
        assert details.startswith("bad_labels: ") and what in details, details
    # The flood: 30 Hellos of 8 MiB of labels (128 values of 64 KiB).
    flood = {f"key{i}": "x" * (64 << 10) for i in range(128)}
    for i in range(30):
        outcome = _hello_outcome(daemon.endpoint, flood, run=f"flood-{i}")
        assert outcome is not None and outcome[0] == grpc.StatusCode.INVALID_ARGUMENT, outcome
    peak_mb = _status_kb(daemon.process.pid, "VmHWM") >> 10
    print(f"label flood: VmHWM {peak_mb} MiB, --max_memory_mb={limit_mb}")
    assert peak_mb <= 1.2 * limit_mb, (peak_mb, limit_mb)
    samples = daemon.scrape()
    assert sum(v for n, l, v in samples if n == "foreshock_ingest_rejected_total"
               and l.get("reason") == "bad_labels") == 4 + 30
    # Nothing of the refused Hellos was written (the data directory holds the
    # three accepted ones, 17 KiB at most each).
    data_bytes = sum(f.stat().st_size for f in (tmp_path / "data").rglob("*") if f.is_file())
    assert data_bytes < 4 << 20, data_bytes


def test_the_python_monitor_checks_labels_before_it_connects():
    import pytest
    from foreshock import Monitor
    with pytest.raises(ValueError, match="at most 1024"):
        Monitor("127.0.0.1:1", run_id="r", job="j", labels={"k": "v" * 1025})
    with pytest.raises(ValueError, match="at most 64"):
        Monitor("127.0.0.1:1", run_id="r", job="j", labels={f"k{i}": "v" for i in range(65)})


def _curvature_record(step, layers):
    record = pb.Record(step=step)
    record.curvature.lambda_max = 10.0
    record.curvature.residual = 0.01
    record.curvature.hvps = 20
    record.curvature.layer_rayleigh.extend([0.5 + 0.001 * step] * layers)
    return record


def _typed_stream(endpoint, run, batches, layers=0, timeout=120):
    """Sends a Hello and `batches` (lists of Records) on one stream; returns the Acks."""
    messages = [_hello(run, model=pb.ModelInfo(n_layers=layers))] + [
        pb.StreamRequest(batch=pb.Batch(seq=seq, records=records)).SerializeToString()
        for seq, records in enumerate(batches, start=1)]
    return [r.ack for r, _ in _raw_stream(endpoint, messages, timeout) if r.HasField("ack")]


def test_curvature_per_layer_values_are_refused_at_the_memory_bound(start_foreshockd):
    # Issue 34: each curvature record may carry 1,024 per-layer values, each a
    # series of its own; 128 runs took memory to 2.0x the bound with no
    # rejection. Here 128 runs of 4 steps x 1,024 values (some 1.2 MiB of
    # series each) against a bound 40 MiB above the idle daemon.
    limit_mb = _idle_rss_mb(start_foreshockd) + 40
    daemon = start_foreshockd(f"--max_memory_mb={limit_mb}", "--max_state_mb_per_run=0")
    refused = accepted = 0
    for r in range(128):
        scalars = pb.Record(step=1)
        scalars.scalars.loss = 2.0
        run_level = pb.Record(step=1)
        run_level.curvature.lambda_max = 10.0
        acks = _typed_stream(daemon.endpoint, f"curv-{r}",
                             [[scalars, run_level]] +
                             [[_curvature_record(step, 1024)] for step in range(1, 5)],
                             layers=1024)
        assert len(acks) == 5, acks
        # Step scalars and a curvature record without per-layer values are
        # never refused.
        assert acks[0].accepted == 2 and not acks[0].rejections, acks[0]
        for ack in acks[1:]:
            accepted += ack.accepted
            for rejection in ack.rejections:
                assert rejection.reason.startswith("memory_limit: "), rejection.reason
                refused += 1
    peak_mb = _status_kb(daemon.process.pid, "VmHWM") >> 10
    print(f"curvature: VmHWM {peak_mb} MiB, --max_memory_mb={limit_mb}, "
          f"{accepted} records accepted, {refused} refused")
    assert refused > 0 and accepted > 0, (refused, accepted)
    assert peak_mb <= 1.2 * limit_mb, (peak_mb, limit_mb)


def test_curvature_per_layer_values_count_in_the_run_state_budget(start_foreshockd):
    # Like a probe's retained state: 8 KiB a per-layer value against
    # --max_state_mb_per_run, so that one run cannot hold the daemon with them.
    daemon = start_foreshockd("--max_state_mb_per_run=4", "--max_memory_mb=0")
    acks = _typed_stream(daemon.endpoint, "budget", [
        [_curvature_record(1, 256)],   # 2 MiB: within
        [_curvature_record(2, 256)],   # the same series: no growth
        [_curvature_record(3, 1024)],  # 8 MiB: over
    ], layers=1024)
    assert [a.accepted for a in acks] == [1, 1, 0], acks
    assert acks[2].rejections[0].reason.startswith("state_limit: "), acks[2]
    assert "per-layer values" in acks[2].rejections[0].reason
    # Other runs are not affected.
    assert _typed_stream(daemon.endpoint, "other", [[_curvature_record(1, 256)]],
                         layers=1024)[0].accepted == 1


def _loss_value(step, attempt=1):
    return 2.0 * attempt + (step % 97) * 1e-3


def _loss_batches(run_points, per_batch=50_000, first_step=1, attempt=1):
    """Serialized StreamRequests of scalar records, loss at steps
    first_step..run_points (built as bytes: 10^6 protobuf records would take
    the test's own memory)."""
    import struct
    out = []
    for seq, first in enumerate(range(first_step, run_points + 1, per_batch), start=1):
        body = [b"\x08" + _varint(seq)]
        for step in range(first, min(first + per_batch, run_points + 1)):
            scalars = b"\x09" + struct.pack("<d", _loss_value(step, attempt))  # StepScalars.loss = 1
            record = b"\x08" + _varint(step) + b"\x12" + _varint(len(scalars)) + scalars
            body.append(b"\x12" + _varint(len(record)) + record)
        body = b"".join(body)
        out.append(b"\x12" + _varint(len(body)) + body)
    return out


def _ingest_loss(endpoint, run, points):
    acks = [r.ack for r, _ in _raw_stream(endpoint, [_hello(run)] + _loss_batches(points),
                                          timeout=600) if r.HasField("ack")]
    assert sum(a.accepted for a in acks) == points, [(a.accepted, len(a.rejections)) for a in acks]


def _get(url):
    """(status, body bytes) of a GET, errors included."""
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=300) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_raw_queries_over_a_long_run_page_within_the_memory_bound(start_foreshockd):
    # Issue 34: one raw GET /api/v1/points?max_points=0 over 500k loss points
    # took the daemon to 787 MiB with --max_memory_mb=256; eight concurrent
    # ones over 1M points reached 10.9 GB. Now an answer over --max_query_mb
    # is refused with how to page it, concurrent requests share
    # --max_query_total_mb (a quarter of the bound: 64 MiB here), and eight
    # clients paging through the whole run at once all get every point.
    import json
    import re
    from foreshock.v1 import query_pb2, query_pb2_grpc
    limit_mb, points = 256, 1_000_000
    daemon = start_foreshockd(f"--max_memory_mb={limit_mb}", "--max_queue_mb=16")
    _ingest_loss(daemon.endpoint, "long", points)
    base = daemon.metrics_url.replace("/metrics", "") + "/api/v1/points?run=long&signal=loss"

    status, body = _get(base + "&max_points=0")
    assert status == 413, (status, body[:200])
    error = json.loads(body)["error"]
    assert "Page through it at most" in error and "steps 1 to " in error, error

    def page_through(out, refusals):
        got, next_from = [], 1
        while next_from <= points:
            status, body = _get(f"{base}&max_points=0&from={next_from}")
            if status == 503:  # the shared budget is taken: retry
                refusals.append(json.loads(body)["error"])
                threading.Event().wait(0.2)
                continue
            if status == 413:  # too large: take the page the message names
                to = int(re.search(r"steps \d+ to (\d+) first", json.loads(body)["error"])[1])
                status, body = _get(f"{base}&max_points=0&from={next_from}&to={to}")
                if status == 503:
                    refusals.append(json.loads(body)["error"])
                    threading.Event().wait(0.2)
                    continue
            assert status == 200, (status, body[:300])
            steps = [int(p["step"]) for p in json.loads(body)["points"]]
            got.extend(steps)
            next_from = steps[-1] + 1
        out.append(got)

    results, refusals, errors = [], [], []

    def run():
        try:
            page_through(results, refusals)
        except AssertionError as e:
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 8 and all(r == list(range(1, points + 1)) for r in results)
    assert refusals and all("--max_query_total_mb" in r for r in refusals), refusals[:1]

    # gRPC says the same, RESOURCE_EXHAUSTED.
    with grpc.insecure_channel(daemon.endpoint) as channel:
        try:
            query_pb2_grpc.QueryStub(channel).GetSeries(
                query_pb2.GetSeriesRequest(run="long", signal="loss"), timeout=60)
            raise AssertionError("a raw GetSeries of 1M points was answered")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
            assert "Page through it at most" in e.details(), e.details()
    peak_mb = _status_kb(daemon.process.pid, "VmHWM") >> 10
    print(f"queries: VmHWM {peak_mb} MiB, --max_memory_mb={limit_mb}, "
          f"{len(refusals)} busy refusals")
    assert peak_mb <= 1.2 * limit_mb, (peak_mb, limit_mb)
    samples = daemon.scrape()
    refused = {l.get("reason"): v for n, l, v in samples if n == "foreshock_query_refused_total"}
    assert refused["too_large"] >= 1 + 8 and refused["busy"] == len(refusals), refused


def _reference_buckets(points, max_points):
    """store::DownsamplePoints written out: the step range of the points in
    max_points buckets of equal width, empty ones skipped."""
    first, last = points[0][0], points[-1][0]
    width = -(-(last - first + 1) // max_points)
    buckets = {}
    for step, value in points:
        buckets.setdefault((step - first) // width, []).append((step, value))
    return [{"first_step": b[0][0], "last_step": b[-1][0], "count": len(b),
             "min": min(v for _, v in b), "max": max(v for _, v in b),
             "mean": sum(v for _, v in b) / len(b), "last": b[-1][1]}
            for _, b in sorted(buckets.items())]


def test_a_downsampled_query_reads_a_long_range_window_by_window(start_foreshockd):
    # Issue 34: a downsampled query read its whole range before bucketing
    # it, so with --max_query_mb=4 any chart over more than ~65k points was
    # refused ("narrow the range"), and at the default 64 MiB the loss chart
    # of a million-step run was. Now it reads windows that fit the budget.
    # The run here was resumed from a checkpoint at step 100,000: the chart
    # shows the first attempt before it and the second from it on.
    import json
    daemon = start_foreshockd("--max_query_mb=4")
    run, killed_at, resumed_at, end = "windows", 200_000, 100_000, 260_000
    # Attempt 1: its stream ends without a goodbye (the job died).
    acks = [r.ack for r, _ in _raw_stream(daemon.endpoint, [
        _hello(run, first_seq=1, sender_id=0xA1)] + _loss_batches(killed_at))
        if r.HasField("ack")]
    assert sum(a.accepted for a in acks) == killed_at
    acks = [r.ack for r, _ in _raw_stream(daemon.endpoint, [
        _hello(run, first_seq=1, sender_id=0xA2)] + _loss_batches(
            end, first_step=resumed_at, attempt=2)) if r.HasField("ack")]
    assert sum(a.accepted for a in acks) == end - resumed_at + 1
    expected = ([(s, _loss_value(s, 1)) for s in range(1, resumed_at)] +
                [(s, _loss_value(s, 2)) for s in range(resumed_at, end + 1)])
    base = daemon.metrics_url.replace("/metrics", "") + f"/api/v1/points?run={run}&signal=loss"
    for query, points in (("", expected),
                          ("&from=50000&to=150000", expected[49_999:150_000]),
                          ("&from=150001", expected[150_000:])):
        for max_points in (700, 1000):
            status, body = _get(f"{base}&max_points={max_points}{query}")
            assert status == 200, (query, status, body[:300])
            got = json.loads(body)
            assert got["downsampled"] and int(got["total_points"]) == len(points), (query, got.keys())
            reference = _reference_buckets(points, max_points)
            assert len(got["buckets"]) == len(reference), (query, len(got["buckets"]))
            for g, r in zip(got["buckets"], reference):
                assert (int(g["first_step"]), int(g["last_step"]), int(g["count"])) == (
                    r["first_step"], r["last_step"], r["count"]), (query, g, r)
                for field in ("min", "max", "last"):
                    assert g[field] == r[field], (query, field, g, r)
                assert abs(g["mean"] - r["mean"]) <= 1e-12 * abs(r["mean"]), (query, g, r)
    # A short range across the resumption: raw points, the resumed attempt's from 100,000.
    status, body = _get(f"{base}&max_points=1000&from=99500&to=100499")
    got = json.loads(body)
    assert status == 200 and not got.get("downsampled"), body[:300]
    assert [(int(p["step"]), p["value"]) for p in got["points"]] == expected[99_499:100_499]
    # Too many buckets for the budget: a clear error, not an answer past it.
    status, body = _get(f"{base}&max_points=200000")
    assert status == 413 and "ask for fewer points" in json.loads(body)["error"], body[:300]


def test_closed_alert_episodes_are_bounded_over_all_runs_and_a_flapping_run_pays(
        start_foreshockd):
    # Issue 34: closed alert episodes (about 1 KiB each, 4,096 per run) come
    # from step scalars, which --max_memory_mb never refuses, so runs whose
    # alerts flap could grow the daemon past its bound. --max_alert_episodes
    # bounds them over all runs, taken from the run that keeps the most.
    import json
    daemon = start_foreshockd("--max_alert_episodes=4")

    def cycles(n):
        """n ForeshockNonFinite episodes: a NaN loss, then 20 finite steps (clear_after)."""
        records = []
        for cycle in range(n):
            for offset in range(21):
                record = pb.Record(step=1 + 21 * cycle + offset)
                record.scalars.loss = float("nan") if offset == 0 else 2.0
                records.append(record)
        return [records[i:i + 50] for i in range(0, len(records), 50)]

    for run, n in (("steady", 3), ("flappy", 8)):
        acks = _typed_stream(daemon.endpoint, run, cycles(n))
        assert sum(a.accepted for a in acks) == 21 * n, acks
    base = daemon.metrics_url.replace("/metrics", "")

    def episodes(run):
        status, body = _get(f"{base}/api/v1/alerts?run={run}&include_resolved=1")
        assert status == 200, body[:200]
        return [int(a.get("episode", 0)) for a in json.loads(body)["alerts"]]

    def metric(name):
        return sum(v for n, _, v in daemon.scrape() if n == name)

    # 2 + 7 closed episodes, 4 kept: the steady run keeps both of its own.
    assert wait_until(lambda: metric("foreshock_alert_episodes_dropped_total") == 5,
                      timeout_s=30), daemon.scrape()
    assert metric("foreshock_alert_episodes_kept") == 4
    assert episodes("steady") == [1, 2, 3]
    assert episodes("flappy") == [6, 7, 8]


def test_points_json_is_protobufs_json_mapping(foreshockd):
    # /api/v1/points writes the points and buckets itself (protobuf's printer
    # took 1.4 KB a point); what it writes must be what protobuf's JSON
    # mapping says, for every value a loss point can have (non-finite losses
    # are counted, not stored: they are sent to show they change nothing).
    import json
    import struct
    from google.protobuf import json_format
    from foreshock.v1 import query_pb2, query_pb2_grpc
    values = [float("nan"), float("inf"), float("-inf"), 0.1, 1 / 3, 1e-300, 2.5e300, -0.0,
              123456789.123456789, 5e-324, 2.0]
    body = [b"\x08\x01"]
    for step, value in enumerate(values, start=1):
        scalars = b"\x09" + struct.pack("<d", value)
        record = b"\x08" + _varint(step) + b"\x12" + _varint(len(scalars)) + scalars
        body.append(b"\x12" + _varint(len(record)) + record)
    body = b"".join(body)
    acks = [r.ack for r, _ in _raw_stream(foreshockd.endpoint, [
        _hello("json"), b"\x12" + _varint(len(body)) + body]) if r.HasField("ack")]
    assert acks[0].accepted == len(values), acks
    base = foreshockd.metrics_url.replace("/metrics", "") + "/api/v1/points?run=json&signal=loss"
    with grpc.insecure_channel(foreshockd.endpoint) as channel:
        stub = query_pb2_grpc.QueryStub(channel)
        for max_points in (0, 4):
            assert wait_until(lambda: stub.GetSeries(query_pb2.GetSeriesRequest(
                run="json", signal="loss"), timeout=10).total_points == 8)
            proto = stub.GetSeries(query_pb2.GetSeriesRequest(
                run="json", signal="loss", max_points=max_points), timeout=10)
            status, text = _get(f"{base}&max_points={max_points}")
            assert status == 200, text
            expected = json_format.MessageToDict(proto, preserving_proto_field_name=True,
                                                 including_default_value_fields=True)
            got = json.loads(text)

            def same(a, b):
                if isinstance(a, dict):
                    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
                if isinstance(a, list):
                    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
                numbers = (int, float)
                if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool):
                    return float(a) == float(b)  # "-0" reads back as the int 0
                return a == b and type(a) is type(b)

            assert same(expected, got), (expected, got)
            assert len(got["points"] if max_points == 0 else got["buckets"]) > 0


def test_every_memory_path_at_once_stays_within_the_bound(start_foreshockd, tmp_path):
    # Issue 34's soak: a probe flood, raw queries paging through a 1M-point
    # run, label bloat, curvature runs and ack amplification, all at once for
    # 60 s against --max_memory_mb=256. Nothing acknowledged is lost (the
    # load generator verifies every acked record is stored), the peak stays
    # within 1.2x, and ingest resumes afterwards.
    import json
    import os
    import subprocess
    limit_mb, points, duration_s = 256, 1_000_000, 60
    daemon = start_foreshockd(f"--max_memory_mb={limit_mb}", "--max_queue_mb=16",
                              "--checkpoint_interval_s=5")
    _ingest_loss(daemon.endpoint, "long", points)
    base = daemon.metrics_url.replace("/metrics", "") + "/api/v1/points?run=long&signal=loss"
    stop = threading.Event()
    errors, counts = [], {"pages": 0, "busy": 0, "labels": 0, "curvature": 0, "acks": 0}

    def guarded(fn):
        def run():
            try:
                while not stop.is_set():
                    fn()
            except Exception as e:  # reported below
                errors.append(f"{fn.__name__}: {e!r}")
        return threading.Thread(target=run, daemon=True)

    def pager():
        next_from = 1
        while next_from <= points and not stop.is_set():
            status, body = _get(f"{base}&max_points=0&from={next_from}&to={next_from + 99_999}")
            if status == 503:
                counts["busy"] += 1
                stop.wait(0.2)
                continue
            assert status == 200, (status, body[:200])
            steps = [int(p["step"]) for p in json.loads(body)["points"]]
            assert steps == list(range(next_from, next_from + len(steps))), steps[:3]
            counts["pages"] += 1
            next_from = steps[-1] + 1

    flood = {f"key{i}": "x" * (64 << 10) for i in range(128)}

    def labels():
        outcome = _hello_outcome(daemon.endpoint, flood, run=f"bloat-{counts['labels']}")
        assert outcome is not None and outcome[0] == grpc.StatusCode.INVALID_ARGUMENT, outcome
        counts["labels"] += 1
        stop.wait(0.5)

    def curvature():
        if counts["curvature"] >= 48:
            stop.wait(0.5)
            return
        acks = _typed_stream(daemon.endpoint, f"soak-curv-{counts['curvature']}",
                             [[_curvature_record(step, 1024)] for step in range(1, 5)],
                             layers=1024)
        assert len(acks) == 4 and all(a.accepted + len(a.rejections) == 1 for a in acks), acks
        counts["curvature"] += 1

    def amplification():
        responses = _raw_stream(daemon.endpoint, [
            _hello(f"amp-{counts['acks']}"), _empty_records_batch(1, 5_000_000)])
        ack = [r.ack for r, _ in responses if r.HasField("ack")][0]
        assert len(ack.rejections) == 256 and ack.omitted_rejections == 5_000_000 - 256
        counts["acks"] += 1
        stop.wait(2)

    threads = [guarded(pager) for _ in range(4)] + [
        guarded(labels), guarded(curvature), guarded(amplification)]
    for t in threads:
        t.start()
    report_path = tmp_path / "soak.json"
    load = os.environ.get("FORESHOCK_LOAD", os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "..", "build", "tests", "load",
        "foreshock_load"))
    proc = subprocess.run(
        [load, f"--target={daemon.endpoint}", f"--daemon_pid={daemon.process.pid}",
         f"--json={report_path}", "--runs=4", "--ranks_per_run=1", "--layers_per_rank=8",
         "--heads=32", "--tokens=64", "--head_dim=128", "--probe_every=1", "--steps_per_s=4",
         f"--duration_s={duration_s}", "--drain_timeout_s=60"],
        capture_output=True, text=True, timeout=duration_s + 180)
    stop.set()
    for t in threads:
        t.join(timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(report_path.read_text())
    assert not errors, errors
    assert report["verified"] and report["lost"] == 0 and report["duplicated"] == 0, report
    assert report["stream_errors"] == {}, report
    assert report["scalars_acked"] > 0, report
    assert all(counts[k] > 0 for k in ("pages", "labels", "curvature", "acks")), counts
    peak_mb = _status_kb(daemon.process.pid, "VmHWM") >> 10
    print(f"soak: VmHWM {peak_mb} MiB, --max_memory_mb={limit_mb}, {counts}, "
          f"probes refused {report['rejected']}")
    assert peak_mb <= 1.2 * limit_mb, (peak_mb, limit_mb, counts)
    # Afterwards: scalars at once, probes again within a few seconds.
    scalar = pb.Record(step=1)
    scalar.scalars.loss = 2.0
    assert _typed_stream(daemon.endpoint, "after-soak", [[scalar]])[0].accepted == 1
    assert wait_until(lambda: _typed_stream(daemon.endpoint, "after-soak-curv", [
        [_curvature_record(1, 64)]], layers=64)[0].accepted == 1, timeout_s=30, interval_s=0.5)
