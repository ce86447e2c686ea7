"""The daemon's memory under large probes (issues 27 and 28), against a real
foreshockd over loopback: a periodic checkpoint streams the detector state to
its file instead of copying it (peak RSS during checkpoints against the steady
state), and the --max_memory_mb bound holds under a probe flood, with scalars
getting through while probes are refused and ingest resuming once the flood
stops. The full-size figures are in docs/PERFORMANCE.md; these use small
shapes so that they take seconds on a busy machine."""
import json
import os
import subprocess
import threading
import time

import grpc
import numpy as np

from conftest import wait_until
from foreshock.v1 import ingest_pb2, ingest_pb2_grpc


def _status_kb(pid, field):
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split(f"{field}:")[1].split()[0])


def _bf16(shape, seed):
    """Finite random bf16 bytes (the high halves of float32 normals)."""
    values = np.random.default_rng(seed).standard_normal(int(np.prod(shape)), dtype=np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def _qk_record(step, layer, heads, tokens, head_dim, seed):
    shape = [heads, tokens, head_dim]
    record = ingest_pb2.Record(step=step)
    record.qk.layer = layer
    record.qk.probe_id = "p0"
    record.qk.causal = True
    for tensor, s in ((record.qk.q, seed), (record.qk.k, seed + 1)):
        tensor.dtype = ingest_pb2.BFLOAT16
        tensor.shape.extend(shape)
        tensor.data = _bf16(shape, s)
    return record


def _stream(endpoint, run, batches, heads=0, timeout=120, layers=0):
    """Sends a Hello and `batches` (lists of Records) on one stream; returns the Acks."""
    def requests():
        yield ingest_pb2.StreamRequest(hello=ingest_pb2.Hello(
            run_id=run, job="memory", model=ingest_pb2.ModelInfo(n_heads=heads, n_layers=layers)))
        for seq, records in enumerate(batches, start=1):
            yield ingest_pb2.StreamRequest(batch=ingest_pb2.Batch(seq=seq, records=records))

    with grpc.insecure_channel(endpoint, options=[
            ("grpc.max_send_message_length", 256 << 20),
            ("grpc.max_receive_message_length", 256 << 20)]) as channel:
        acks = []
        try:
            for response in ingest_pb2_grpc.IngestStub(channel).Stream(requests(), timeout=timeout):
                if response.HasField("ack"):
                    acks.append(response.ack)
        except grpc.RpcError as e:
            raise AssertionError(f"stream ended {e.code()}: {e.details()} after {len(acks)} acks")
        return acks


def test_checkpoint_streams_the_state_instead_of_copying_it(start_foreshockd, tmp_path):
    # ~96 MiB of retained QK state (24 layers of one probe, q and k of
    # 128 heads x 32 tokens x 256 dims in bf16: 4 MiB a layer), checkpointed
    # every second. Before, a checkpoint held the serialized state twice more
    # (the blob, then the file's contents) on top of the state itself.
    daemon = start_foreshockd("--checkpoint_interval_s=1", "--workers=2")
    layers, heads, tokens, head_dim = 24, 128, 32, 256
    acks = _stream(daemon.endpoint, "ckpt", [
        [_qk_record(1, layer, heads, tokens, head_dim, seed=2 * layer)] for layer in range(layers)],
        heads=heads)
    assert [a.accepted for a in acks] == [1] * layers, acks
    state_bytes = layers * 2 * heads * tokens * head_dim * 2
    checkpoint = os.path.join(tmp_path, "data", "checkpoints", "detectors.ckpt")

    def checkpoint_size():
        try:
            return os.stat(checkpoint).st_size
        except FileNotFoundError:
            return 0

    # The state is in place once a checkpoint holds all of it.
    assert wait_until(lambda: checkpoint_size() >= state_bytes, timeout_s=60), (
        checkpoint_size(), daemon.log_tail())
    pid = daemon.process.pid
    # Steady state: the least resident memory over 1.5 s (a checkpoint that
    # is being written at one sample is not at the next).
    samples = []
    for _ in range(75):
        samples.append(_status_kb(pid, "VmRSS"))
        time.sleep(0.02)
    steady_kb = min(samples)
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    # Three more checkpoints of the whole state.
    for _ in range(3):
        before = os.stat(checkpoint).st_mtime_ns
        assert wait_until(lambda: os.stat(checkpoint).st_mtime_ns != before
                          and checkpoint_size() >= state_bytes, timeout_s=30, interval_s=0.05), (
            daemon.log_tail())
    peak_kb = _status_kb(pid, "VmHWM")
    assert steady_kb * 1024 > state_bytes  # the state is resident
    assert peak_kb <= 1.2 * steady_kb, (
        f"peak {peak_kb >> 10} MiB during checkpoints vs steady {steady_kb >> 10} MiB "
        f"(state {state_bytes >> 20} MiB)")

    # A restart restores the state from the checkpoint. Read into the heap,
    # the checkpoint and the state it restores were both anonymous memory,
    # about twice the state, at a moment a container's limit cannot spare;
    # mapped, the checkpoint is page cache the kernel can reclaim. Anonymous
    # memory (RssAnon) is sampled while the daemon restores and starts.
    daemon.stop()
    anon_kb, stop_sampling = [], threading.Event()

    def sample_anon():
        while not stop_sampling.is_set():
            process = daemon.process
            try:
                if process is not None and process.pid != pid:
                    anon_kb.append(_status_kb(process.pid, "RssAnon"))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
            time.sleep(0.002)

    sampler = threading.Thread(target=sample_anon, daemon=True)
    sampler.start()
    daemon.start(timeout_s=120)
    time.sleep(0.5)
    stop_sampling.set()
    sampler.join()
    assert "restored detector state" in open(daemon.log_path).read(), daemon.log_tail()
    settled_kb = _status_kb(daemon.process.pid, "RssAnon")
    print(f"restore: RssAnon peak {max(anon_kb) >> 10} MiB, after {settled_kb >> 10} MiB, "
          f"{len(anon_kb)} samples")
    assert settled_kb * 1024 > state_bytes, settled_kb  # the state is back
    assert max(anon_kb) <= 1.2 * settled_kb, (
        f"anonymous memory peaked at {max(anon_kb) >> 10} MiB while restoring, "
        f"{settled_kb >> 10} MiB after (state {state_bytes >> 20} MiB)")


def _load_binary():
    path = os.environ.get("FORESHOCK_LOAD", os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "..", "build", "tests", "load",
        "foreshock_load"))
    assert os.access(path, os.X_OK), f"no load generator at {path}: build foreshock_load"
    return path


def _idle_rss_mb(start_foreshockd):
    probe = start_foreshockd()
    idle_mb = _status_kb(probe.process.pid, "VmRSS") >> 10
    probe.stop()
    return idle_mb


def _scalar_batch_accepted(endpoint, run):
    record = ingest_pb2.Record(step=1)
    record.scalars.loss = 2.0
    acks = _stream(endpoint, run, [[record]], timeout=10)
    return len(acks) == 1 and acks[0].accepted == 1


def test_probe_flood_stays_bounded_scalars_get_through_and_ingest_recovers(
        start_foreshockd, tmp_path):
    # The flood, scaled down: 4 streams of 8 QK layers (32 heads x
    # 64 tokens x 128 dims, bf16: 1 MiB a record, 8 MiB a batch) and a router
    # sample on every step, with a checkpoint every second, against a bound
    # 80 MiB above the idle daemon. The retained state of 4 runs x 8 layers
    # alone passes the bound, so the flood does on a busy machine too (with 4
    # layers it sometimes did not). Before: streams were ended (and
    # reconnected, and resent their whole windows) instead of probes refused,
    # the peak was 1.68x the bound, and a new run's stream was refused while
    # memory stayed above the resume mark. With gRPC's BDP-grown windows, and
    # both cores busy, the peak was 1.5x the bound (issue 27).
    limit_mb = _idle_rss_mb(start_foreshockd) + 80
    streams, batch_mib = 4, 8
    daemon = start_foreshockd(f"--max_memory_mb={limit_mb}", "--max_queue_mb=16",
                              "--checkpoint_interval_s=1", "--workers=2")
    report_path = tmp_path / "flood.json"
    proc = subprocess.run(
        [_load_binary(), f"--target={daemon.endpoint}", f"--daemon_pid={daemon.process.pid}",
         f"--json={report_path}", f"--runs={streams}", "--ranks_per_run=1",
         f"--layers_per_rank={batch_mib}", "--heads=32", "--tokens=64", "--head_dim=128",
         "--probe_every=1", "--steps_per_s=4", "--duration_s=6", "--drain_timeout_s=60"],
        capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(report_path.read_text())
    # Probes were refused at the bound, record by record; scalars never.
    # (Every sent batch held a scalar record: all were acknowledged.)
    assert report["rejected"].get("memory_limit", 0) > 0, report
    assert set(report["rejected"]) == {"memory_limit"}, report
    assert report["stream_errors"] == {}, report
    assert report["scalars_acked"] > 0, report
    assert report["verified"] and report["lost"] == 0 and report["duplicated"] == 0, report
    # The bound held, checkpoints included. What it cannot refuse is a
    # message already read: the batch being parsed and its parsed copy, per
    # sending stream (docs/OPERATIONS.md, "Memory"). At this small bound that
    # term is larger than the 20% allowed at the 1 GiB bound.
    allowance_mb = max(0.2 * limit_mb, 2 * streams * batch_mib)
    assert report["daemon_vmhwm_mb"] <= limit_mb + allowance_mb, (
        report["daemon_vmhwm_mb"], limit_mb, allowance_mb)
    # After the flood: a new run's one-scalar batch is accepted at once, and
    # probes are accepted again within a few seconds.
    assert _scalar_batch_accepted(daemon.endpoint, "after-flood"), daemon.log_tail()
    probe = _qk_record(2, 0, 8, 16, 64, seed=99)
    assert wait_until(lambda: _stream(daemon.endpoint, "after-flood-probe", [[probe]],
                                      heads=8, timeout=10)[0].accepted == 1,
                      timeout_s=20, interval_s=0.5), daemon.log_tail()


def test_metrics_series_are_bounded_per_daemon_and_the_rest_still_stored(start_foreshockd):
    # Issue 27: /metrics grew linearly with runs (200 runs of 1,024
    # layer_rayleigh values: 13.9 MB, 209k samples). --max_metrics_series
    # bounds the signal series over all runs; the rest are counted, stored
    # and queryable.
    from foreshock.v1 import query_pb2, query_pb2_grpc
    daemon = start_foreshockd("--max_metrics_series=300")
    for r in range(3):
        record = ingest_pb2.Record(step=10)
        record.curvature.lambda_max = 10.0
        record.curvature.residual = 0.01
        record.curvature.hvps = 20
        record.curvature.layer_rayleigh.extend([0.5] * 256)
        acks = _stream(daemon.endpoint, f"m{r}", [[record]], layers=256)
        assert acks[0].accepted == 1, acks

    def value(samples, name, **labels):
        return sum(v for n, l, v in samples
                   if n == name and all(l.get(k) == x for k, x in labels.items()))

    samples, done = daemon.wait_for(
        lambda s: value(s, "foreshock_samples_processed_total", kind="curvature") >= 3,
        timeout_s=30)
    assert done, daemon.log_tail()
    blocks = [s for s in samples if s[0] == "foreshock_curvature_block_rayleigh"]
    assert 0 < len(blocks) <= 300, len(blocks)
    assert value(samples, "foreshock_metrics_signal_series") <= 300 + 4  # + one per worker at most
    assert value(samples, "foreshock_metrics_series_dropped_total") >= 3 * 256 - 300
    # Not exported, still stored: the last run's blocks are in the Query API.
    with grpc.insecure_channel(daemon.endpoint) as channel:
        response = query_pb2_grpc.QueryStub(channel).GetSeries(
            query_pb2.GetSeriesRequest(run="m2", signal="curvature_block_rayleigh", layer=255),
            timeout=10)
    assert [p.value for p in response.points] == [0.5]


def test_transport_holds_at_most_a_window_per_stream(start_foreshockd):
    # Issue 27: under CPU contention a flooding client's batches piled up in
    # gRPC's transport buffers, which --max_memory_mb cannot refuse (the flood
    # peaked at 1.5x the bound). Here the daemon cannot keep up by
    # construction (one worker, a 1 MiB queue), and 8 streams each push 12
    # batches of 4 MiB without waiting for acks. With BDP-grown windows the
    # daemon held 326-375 MiB; with --grpc_stream_window_kb (1 MiB, BDP
    # probing off) 110-113: per stream, the batch being read and its parsed
    # copy, plus the window.
    idle_mb = _idle_rss_mb(start_foreshockd)
    daemon = start_foreshockd("--workers=1", "--max_queue_mb=1", "--max_memory_mb=0")
    streams, batches, records_per_batch = 8, 12, 4  # records of 1 MiB, all layer 0
    records = [_qk_record(step, 0, 32, 64, 128, seed=step)
               for step in range(1, batches * records_per_batch + 1)]
    batch_list = [records[i:i + records_per_batch] for i in range(0, len(records), records_per_batch)]
    errors = []

    def push(i):
        try:
            acks = _stream(daemon.endpoint, f"transport-{i}", batch_list, heads=32, timeout=300)
            assert [a.accepted for a in acks] == [records_per_batch] * batches, acks
        except AssertionError as e:
            errors.append(e)

    threads = [threading.Thread(target=push, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    peak_mb = _status_kb(daemon.process.pid, "VmHWM") >> 10
    batch_mb = records_per_batch
    # Per stream: three batches' worth (the one being read, its parsed copy,
    # the window), plus the queue, the retained state and slack.
    assert peak_mb - idle_mb <= streams * 3 * batch_mb + 32, (peak_mb, idle_mb)
