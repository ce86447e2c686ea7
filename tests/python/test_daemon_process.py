"""foreshockd as a process: --help documents every flag, SIGTERM/SIGINT drain
and exit 0, and accepted samples are processed before exit."""
import re
import signal
import subprocess
import time

import grpc
import numpy as np
import pytest

from conftest import foreshockd_binary
from foreshock.v1 import ingest_pb2, ingest_pb2_grpc

FLAGS = ["listen", "metrics_listen", "workers", "per_head_metrics", "series_capacity",
         "max_tokens", "max_head_dim", "max_heads", "max_layers", "max_experts",
         "max_queue_mb", "max_message_mb", "shutdown_grace_ms", "log_level", "data_dir", "fsync",
         "fsync_interval_ms", "segment_mb", "retention_max_age_h", "retention_max_gb",
         "checkpoint_interval_s", "record_dir", "series_cache_points"]


def test_help_documents_every_flag():
    out = subprocess.run([foreshockd_binary(), "--help"], capture_output=True, text=True,
                         timeout=30)
    text = out.stdout + out.stderr
    for flag in FLAGS:
        match = re.search(rf"--{flag} \((.+?)\); default:", text, re.S)
        assert match, f"--{flag} missing from --help:\n{text}"
        assert len(match.group(1).split()) >= 5, f"--{flag} has no real help text"
    assert "127.0.0.1:50051" in text and "127.0.0.1:9464" in text


def _qk_batch(seq, n_layers, step, rng, heads=2, tokens=32, head_dim=8):
    batch = ingest_pb2.Batch(seq=seq)
    for layer in range(n_layers):
        q = rng.standard_normal((heads, tokens, head_dim)).astype("<f4")
        k = rng.standard_normal((heads, tokens, head_dim)).astype("<f4")
        record = batch.records.add(step=step)
        record.qk.layer = layer
        record.qk.causal = True
        for tensor, value in ((record.qk.q, q), (record.qk.k, k)):
            tensor.dtype = ingest_pb2.FLOAT32
            tensor.shape.extend(value.shape)
            tensor.data = value.tobytes()
    return batch


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_drains_accepted_samples_and_exits_zero(start_foreshockd, sig):
    # One worker and many samples, so that work is still queued when the signal lands.
    daemon = start_foreshockd("--workers=1")
    rng = np.random.default_rng(0)
    n_batches, n_layers = 40, 4
    hello = ingest_pb2.Hello(run_id="drain", job="process-test",
                             model=ingest_pb2.ModelInfo(n_layers=n_layers, n_heads=2, head_dim=8))
    requests = [ingest_pb2.StreamRequest(hello=hello)] + [
        ingest_pb2.StreamRequest(batch=_qk_batch(i + 1, n_layers, i, rng)) for i in range(n_batches)]
    with grpc.insecure_channel(daemon.endpoint) as channel:
        responses = list(ingest_pb2_grpc.IngestStub(channel).Stream(iter(requests), timeout=60))
    acks = [r.ack for r in responses if r.HasField("ack")]
    assert len(acks) == n_batches and all(a.accepted == n_layers for a in acks)

    daemon.process.send_signal(sig)
    assert daemon.process.wait(timeout=30) == 0, daemon.log_tail()
    log = daemon.log_tail()
    assert "draining" in log, log
    # Everything acknowledged was processed before exit.
    match = re.search(r"foreshockd stopped: (\d+) samples processed", log)
    assert match, log
    assert int(match.group(1)) == n_batches * n_layers


def test_refuses_a_port_in_use(foreshockd, tmp_path):
    out = subprocess.run([foreshockd_binary(), f"--listen=127.0.0.1:{foreshockd.grpc_port}",
                          "--metrics_listen=127.0.0.1:0", f"--data_dir={tmp_path / 'second-daemon-data'}"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0
    assert "cannot serve gRPC" in out.stdout + out.stderr
