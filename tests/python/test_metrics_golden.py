"""Golden /metrics, end to end (issue 17), in the style of node_exporter's
end-to-end test: the real foreshockd, fixed flags, a fresh data directory, a
small deterministic ingest stream over gRPC, one scrape, and the page compared
with the checked-in golden/metrics.txt.

What legitimately varies is normalized first (normalize() below): resident
memory and the machine's memory bound, detector timings (histogram buckets and
sums; the counts stay), Alertmanager delivery timing, and the values the
detectors compute (replaced by <finite>, so NaN/Inf still shows). Families are
sorted by name and samples within a family by text, because prometheus-cpp
orders series by hash. Everything else is compared as is: every family name,
its HELP and TYPE, every series with its labels, and the values of counters
the stream determines. So the test fails when a family is renamed or dropped,
loses or changes its HELP text, changes type, or a known label value that is
exported at 0 (server/common/metrics.h) disappears.

After an intended change, regenerate the golden file and review its diff:

    FORESHOCK_UPDATE_GOLDEN=1 ctest --test-dir build -R python_metrics_golden
    # or: FORESHOCK_UPDATE_GOLDEN=1 FORESHOCKD=build/server/foreshockd \\
    #       python3 -m pytest tests/python/test_metrics_golden.py
"""
import http.server
import math
import os
import re
import threading
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from conftest import HERE, ROOT, Daemon, foreshockd_binary, wait_until
from foreshock.v1 import ingest_pb2 as pb
from foreshock.v1 import ingest_pb2_grpc

GOLDEN = os.path.join(HERE, "golden", "metrics.txt")
TOKEN = "golden-token-0123456789"
RUN = "golden"
MODEL = pb.ModelInfo(n_layers=2, n_heads=2, head_dim=4, n_experts=4, top_k=2, moe_layers=[1])
HEADS, TOKENS, DIM, EXPERTS = 2, 8, 4, 4

# Values that differ between machines or runs, by sample name.
VARYING = {
    "foreshock_memory_resident_bytes": "<bytes>",
    "foreshock_memory_limit_bytes": "<bytes>",  # without --max_memory_mb: from the machine's memory
    "foreshock_record_bytes": "<bytes>",  # the recorder thread may still be writing at the scrape
    "foreshock_data_dir_bytes": "<bytes>",  # segment headers, checkpoints: not byte-stable
    "foreshock_detector_seconds_bucket": "<timing>",
    "foreshock_detector_seconds_sum": "<timing>",
    # The fake Alertmanager answers at once, but how many POSTs (and re-sends)
    # happen before the scrape depends on timing.
    "foreshock_alertmanager_posts_total": "<count>",
    "foreshock_alertmanager_tracked_alerts": "<count>",
}
# Gauges with a run label that are not detector output: compared as is.
DAEMON_RUN_GAUGES = {"foreshock_run_info", "foreshock_last_step", "foreshock_alert_active",
                     # step scalars are exported as sent
                     "foreshock_loss", "foreshock_grad_norm", "foreshock_lr"}

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)$")


def normalize(text):
    """The page with varying values replaced, families sorted by name, samples
    sorted within their family."""
    families = {}  # name -> {"meta": [...], "samples": [...], "type": str}
    current = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            name = line.split(" ", 3)[2]
            current = families.setdefault(name, {"meta": [], "samples": [], "type": None})
            current["meta"].append(line)
            if line.startswith("# TYPE "):
                current["type"] = line.split(" ", 3)[3]
            continue
        match = _SAMPLE.match(line)
        assert match and current is not None, f"unexpected line on /metrics: {line!r}"
        name, labels, value = match.groups()
        labels = labels or ""
        if name in VARYING:
            value = VARYING[name]
        elif (current["type"] == "gauge" and 'run="' in labels
              and name not in DAEMON_RUN_GAUGES):
            value = "<finite>" if math.isfinite(float(value)) else value
        current["samples"].append(f"{name}{labels} {value}")
    out = []
    for name in sorted(families):
        out.extend(families[name]["meta"])
        out.extend(sorted(families[name]["samples"]))
    return "\n".join(out) + "\n"


class TokenDaemon(Daemon):
    """The conftest daemon, scraped with a bearer token (--token_file)."""

    def metrics_text(self, token=TOKEN):
        request = urllib.request.Request(self.metrics_url)
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(request, timeout=2.0) as response:
            return response.read().decode("utf-8")


class FakeAlertmanager:
    """Accepts POST /api/v2/alerts with 200, so that delivery succeeds quietly."""

    def __init__(self):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def tensor(values, shape, dtype=pb.FLOAT32):
    return pb.Tensor(dtype=dtype, shape=shape, data=np.asarray(values, "<f4").tobytes())


def pattern(n, phase):
    """Deterministic, non-degenerate values (no random generator involved)."""
    return np.sin(np.arange(n) * 0.37 + phase) + 0.1 * np.cos(np.arange(n) * 1.3 + 2 * phase)


def qk(step, layer):
    record = pb.Record(step=step)
    shape = [HEADS, TOKENS, DIM]
    n = HEADS * TOKENS * DIM
    record.qk.layer = layer
    record.qk.q.CopyFrom(tensor(pattern(n, step + layer), shape))
    record.qk.k.CopyFrom(tensor(pattern(n, 0.5 * step - layer), shape))
    record.qk.causal = True
    record.qk.seq_len = TOKENS
    record.qk.attention_dtype = pb.BFLOAT16 if layer == 0 else pb.FLOAT32
    if layer == 0:  # a round-to-nearest kernel's output check (attention_output_*)
        record.qk.output_check.CopyFrom(pb.AttentionOutputCheck(
            mean_signed_error=-1e-5, rms_error=8e-4, mean_abs_reference=0.3, elements=n))
    return record


def router(step, layer=1):
    record = pb.Record(step=step)
    record.router.layer = layer
    record.router.top_k = 2
    record.router.logits.CopyFrom(tensor(pattern(TOKENS * EXPERTS, step), [TOKENS, EXPERTS]))
    return record


def curvature(step):
    record = pb.Record(step=step)
    c = record.curvature
    c.lambda_max, c.residual, c.hvps, c.lr, c.beta1, c.overlap = 150.0, 0.01, 12, 1e-3, 0.9, 0.95
    c.layer_rayleigh.extend([60.0, 90.0])
    return record


def scalars(step, loss=None):
    record = pb.Record(step=step)
    # Calm, exactly representable values (they are exported as sent): far from
    # every alert threshold, so that no build's rounding decides an alert.
    record.scalars.loss = 2.0 + (step % 5) / 128 if loss is None else loss
    record.scalars.grad_norm = 1.0 + (step % 3) / 64
    record.scalars.lr = 1e-3
    return record


def batches():
    """Three batches: 130 steps of scalars (the z-scores need a full 128-step
    window), three QK samples per layer (the top-1 overlap needs two
    increments), two router and curvature samples, a non-finite loss
    (ForeshockNonFinite fires), and records rejected with three reasons."""
    out = []
    for seq, (first, last) in enumerate(((0, 60), (60, 120), (120, 130)), start=1):
        batch = pb.Batch(seq=seq)
        batch.records.extend([qk(first, 0), qk(first, 1)])
        if seq < 3:
            batch.records.extend([router(first), curvature(first)])
        batch.records.extend(scalars(s) for s in range(first, last))
        out.append(batch)
    bad_dtype = qk(130, 0)
    bad_dtype.qk.q.dtype = pb.DTYPE_UNSPECIFIED  # unknown_dtype
    short = qk(130, 1)
    short.qk.k.data = short.qk.k.data[:-4]  # byte_length_mismatch
    out[-1].records.extend([scalars(130, float("nan")), bad_dtype, short,
                            scalars(-1)])  # negative_step
    return out


def stream(endpoint, requests):
    """Sends `requests` on one stream; returns the responses and the final status code."""
    with grpc.insecure_channel(endpoint) as channel:
        call = ingest_pb2_grpc.IngestStub(channel).Stream(
            iter(requests), timeout=30, metadata=[("authorization", f"Bearer {TOKEN}")])
        try:
            return list(call), grpc.StatusCode.OK
        except grpc.RpcError as e:
            return [], e.code()


def declared_families():
    """foreshock_<name> of every family in server/common/metrics.h's tables."""
    with open(os.path.join(ROOT, "server", "common", "metrics.h")) as f:
        text = f.read()
    return {"foreshock_" + name for name in re.findall(r'X\(\w+,\s*"(\w+)"', text)}


@pytest.fixture
def daemon(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN} * ingest,query,metrics\n")
    tokens.chmod(0o600)
    record_dir = tmp_path / "recordings"
    record_dir.mkdir()
    alertmanager = FakeAlertmanager()
    daemon = TokenDaemon(foreshockd_binary(), str(tmp_path), [
        f"--data_dir={tmp_path / 'data'}", "--workers=2", f"--token_file={tokens}",
        f"--record_dir={record_dir}", f"--alertmanager_url={alertmanager.url}",
        "--checkpoint_interval_s=3600"])
    try:
        yield daemon.start()
    finally:
        daemon.stop()
        alertmanager.stop()


def test_metrics_page_matches_the_golden_file(daemon):
    responses, code = stream(daemon.endpoint, [
        pb.StreamRequest(hello=pb.Hello(run_id=RUN, job="golden-job", model=MODEL))]
        + [pb.StreamRequest(batch=b) for b in batches()])
    assert code == grpc.StatusCode.OK, code
    acks = [r.ack for r in responses if r.HasField("ack")]
    assert [a.seq for a in acks] == [1, 2, 3], responses
    assert [len(a.rejections) for a in acks] == [0, 0, 3], acks
    # A stream refused at once (batch_before_hello) and a scrape without a
    # token (foreshock_auth_denied_total{api="http",reason="unauthenticated"}).
    _, code = stream(daemon.endpoint, [pb.StreamRequest(batch=pb.Batch(seq=1))])
    assert code == grpc.StatusCode.INVALID_ARGUMENT, code
    with pytest.raises(urllib.error.HTTPError) as denied:
        daemon.metrics_text(token=None)
    assert denied.value.code == 401

    # Workers, the recorder and Alertmanager delivery finish asynchronously:
    # scrape until two pages in a row are the same, with no stream open.
    pages = []

    def settled():
        text = daemon.metrics_text()
        pages.append(normalize(text))
        return ("foreshock_ingest_active_streams 0\n" in text and len(pages) >= 2
                and pages[-1] == pages[-2])
    assert wait_until(settled, timeout_s=30, interval_s=0.3), daemon.log_tail()
    page = pages[-1]

    # Independent of the golden file: the scenario reaches every declared family.
    missing = sorted(f for f in declared_families() if f"# HELP {f} " not in page)
    assert not missing, f"families of server/common/metrics.h not on the page: {missing}"

    if os.environ.get("FORESHOCK_UPDATE_GOLDEN"):
        os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
        with open(GOLDEN, "w") as f:
            f.write(page)
        pytest.skip(f"wrote {GOLDEN}; review its diff")
    with open(GOLDEN) as f:
        golden = f.read()
    if page != golden:
        import difflib
        diff = "".join(difflib.unified_diff(golden.splitlines(True), page.splitlines(True),
                                            "golden/metrics.txt", "/metrics (normalized)"))
        pytest.fail("/metrics differs from the golden file (regenerate with "
                    "FORESHOCK_UPDATE_GOLDEN=1 if the change is intended):\n" + diff)


def test_normalize_keeps_what_the_golden_file_guards():
    """The normalization must not hide names, HELP text, labels or known zeros."""
    page = """# HELP foreshock_x_total Some help.
# TYPE foreshock_x_total counter
foreshock_x_total{reason="b"} 0
foreshock_x_total{reason="a"} 2
# HELP foreshock_qk_increment_entropy H.
# TYPE foreshock_qk_increment_entropy gauge
foreshock_qk_increment_entropy{layer="0",run="r"} 0.5123
foreshock_qk_increment_entropy{layer="1",run="r"} NaN
# HELP foreshock_memory_resident_bytes M.
# TYPE foreshock_memory_resident_bytes gauge
foreshock_memory_resident_bytes 123456
"""
    assert normalize(page) == """# HELP foreshock_memory_resident_bytes M.
# TYPE foreshock_memory_resident_bytes gauge
foreshock_memory_resident_bytes <bytes>
# HELP foreshock_qk_increment_entropy H.
# TYPE foreshock_qk_increment_entropy gauge
foreshock_qk_increment_entropy{layer="0",run="r"} <finite>
foreshock_qk_increment_entropy{layer="1",run="r"} NaN
# HELP foreshock_x_total Some help.
# TYPE foreshock_x_total counter
foreshock_x_total{reason="a"} 2
foreshock_x_total{reason="b"} 0
"""
    assert normalize(page.replace("Some help.", "Other help.")) != normalize(page)
    assert normalize(page.replace('{reason="b"} 0\n', "")) != normalize(page)
