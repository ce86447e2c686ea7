"""lr_growth_rules.py's arithmetic against dense references: the Gram route
of ||A B^T||_F, the update size read back from a recording written here, and
the growth rule on a series whose answer is known."""
import math
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lr_growth_rules as rules  # noqa: E402
from foreshock.v1 import ingest_pb2  # noqa: E402


def test_frobenius_of_product_matches_the_dense_product():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((37, 8)), rng.standard_normal((37, 8))
    assert math.isclose(rules.frobenius_of_product(a, b), np.linalg.norm(a @ b.T), rel_tol=1e-10)


def _tensor(array):
    return ingest_pb2.Tensor(dtype=ingest_pb2.FLOAT32, shape=list(array.shape),
                             data=array.astype("<f4").tobytes())


def _write_recording(path, samples):
    with open(path, "wb") as f:
        f.write(b"FSHKREC1" + struct.pack("<II", 1, 0))
        requests = [ingest_pb2.StreamRequest(hello=ingest_pb2.Hello(run_id="r", job="j"))]
        for seq, (step, q, k) in enumerate(samples):
            record = ingest_pb2.Record(step=step, qk=ingest_pb2.QKSample(
                layer=1, q=_tensor(q), k=_tensor(k), kv_head_of=[0, 0]))
            requests.append(ingest_pb2.StreamRequest(batch=ingest_pb2.Batch(seq=seq, records=[record])))
        for request in requests:
            payload = request.SerializeToString()
            f.write(struct.pack("<IIq", len(payload), 0, 0) + payload)


def test_update_size_is_the_relative_logit_change_per_step(tmp_path):
    """Two query heads sharing one K head (grouped-query), probes 10 steps apart."""
    rng = np.random.default_rng(1)
    n, d = 12, 4
    q0, k0 = rng.standard_normal((2, n, d)).astype(np.float32), rng.standard_normal((1, n, d)).astype(np.float32)
    q1 = (q0 + 0.1 * rng.standard_normal((2, n, d))).astype(np.float32)
    k1 = (k0 + 0.1 * rng.standard_normal((1, n, d))).astype(np.float32)
    path = tmp_path / "run.fsrec"
    _write_recording(path, [(100, q0, k0), (110, q1, k1)])
    got = rules.update_sizes(str(path))
    assert [(s, layer, head) for s, layer, head, _ in got] == [(110, 1, 0), (110, 1, 1)]
    for (_, _, head, value) in got:
        a, b = q0[head].astype(np.float64), k0[0].astype(np.float64)
        da, db = q1[head] - a, k1[0] - b
        expected = np.linalg.norm(da @ b.T + a @ db.T) / np.linalg.norm(a @ b.T) / 10
        assert math.isclose(value, expected, rel_tol=1e-9)


def test_growth_rule_fires_on_the_consecutive_probe_after_a_jump():
    points = [(s, 0, -1, 1.0 if s < 600 else 5.0) for s in range(0, 1000, 20)]
    assert rules.first_growth(points, ratio=3, consecutive=2, per_head=False) == 620
    assert rules.first_growth(points, ratio=6, consecutive=2, per_head=False) is None
    # Before step 200 (WARMUP) nothing is a baseline: an early jump is not judged.
    early = [(s, 0, -1, 1.0 if s < 100 else 5.0) for s in range(0, 1000, 20)]
    assert rules.first_growth(early, ratio=3, consecutive=2, per_head=False) is None
