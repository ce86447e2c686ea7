"""Router statistics through the real daemon, against an independent numpy
computation, on random and adversarial logits (all tokens to one expert, ties,
E=2/k=1, a single token). Also the router rejection paths."""
import grpc
import numpy as np
import pytest

from foreshock import prometheus
from foreshock.v1 import ingest_pb2, ingest_pb2_grpc


def numpy_router(z, k, floor=0.5, capacity=1.25):
    """docs/DESIGN.md §1.2, straight from the definitions; ties go to the lower index."""
    z = z.astype(np.float64)
    t, e = z.shape
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    p = np.exp(z - lse[:, None])
    h = -(p * (z - lse[:, None])).sum(1) / np.log(e)
    order = np.argsort(-z, axis=1, kind="stable")
    topk = np.sort(order[:, :k], axis=1)
    load = np.bincount(topk.ravel(), minlength=e) / (t * k)
    zs = np.take_along_axis(z, order, axis=1)
    margin = zs[:, k - 1] - zs[:, k]
    safe = np.where(load > 0, load, 1.0)
    return {
        "router_entropy": h.mean(),
        "router_low_entropy_fraction": (h < floor).mean(),
        "router_load_cv": load.std() / load.mean(),
        "router_max_violation": (load.max() - load.mean()) / load.mean(),
        "router_load_entropy": -(load * np.log(safe)).sum() / np.log(e),
        "router_load_cv_noise_floor": np.sqrt((e - k) / (k * t)),
        "router_overloaded_experts": float((load > capacity / e).sum()),
        "router_topk_margin": margin.mean(),
        "router_topk_margin_p10": np.percentile(margin, 10),
        "router_z_loss": (lse ** 2).mean(),
        "router_max_abs_logit": np.abs(z).max(),
        "_topk": topk, "_p": p, "_load": load,
    }


def numpy_pair(prev, cur):
    flips = (prev["_topk"] != cur["_topk"]).any(1).mean()
    p, q = prev["_p"], cur["_p"]
    m = 0.5 * (p + q)
    with np.errstate(divide="ignore", invalid="ignore"):
        kl_p = np.where(p > 0, p * np.log(p / m), 0).sum(1)
        kl_q = np.where(q > 0, q * np.log(q / m), 0).sum(1)
    return {"router_flip_rate": flips, "router_js_divergence": (0.5 * kl_p + 0.5 * kl_q).mean()}


def router_record(step, layer, z, k):
    record = ingest_pb2.Record(step=step)
    record.router.layer = layer
    record.router.top_k = k
    record.router.logits.dtype = ingest_pb2.FLOAT32
    record.router.logits.shape.extend(z.shape)
    record.router.logits.data = z.astype("<f4").tobytes()
    return record


def stream(endpoint, hello, batches):
    requests = [ingest_pb2.StreamRequest(hello=hello)]
    requests += [ingest_pb2.StreamRequest(batch=ingest_pb2.Batch(seq=i + 1, records=b))
                 for i, b in enumerate(batches)]
    with grpc.insecure_channel(endpoint) as channel:
        responses = list(ingest_pb2_grpc.IngestStub(channel).Stream(iter(requests), timeout=30))
    return [r.ack for r in responses if r.HasField("ack")]


def cases():
    rng = np.random.default_rng(1)
    one_expert = rng.normal(size=(64, 8))
    one_expert[:, 3] += 50.0  # every token to expert 3
    ties = np.zeros((16, 4))
    ties[:, 2] = 1.0           # experts 0, 1, 3 tie below expert 2
    return {
        "random": (rng.normal(size=(128, 8)) * 2, rng.normal(size=(128, 8)) * 2, 2),
        "one-expert": (one_expert, one_expert + rng.normal(size=(64, 8)) * 0.1, 1),
        "ties": (ties, ties[:, ::-1].copy(), 2),
        "e2-k1": (rng.normal(size=(32, 2)), rng.normal(size=(32, 2)), 1),
        "single-token": (rng.normal(size=(1, 6)), rng.normal(size=(1, 6)), 3),
        "wide": (rng.normal(size=(256, 64)) * 3, rng.normal(size=(256, 64)) * 3, 8),
    }


@pytest.mark.parametrize("name", list(cases()))
def test_router_statistics_match_numpy(foreshockd, name):
    z0, z1, k = cases()[name]
    hello = ingest_pb2.Hello(run_id=f"router-{name}", job="router-test",
                             model=ingest_pb2.ModelInfo(n_layers=2, n_experts=z0.shape[1],
                                                        top_k=k, moe_layers=[1]))
    acks = stream(foreshockd.endpoint, hello,
                  [[router_record(10, 1, z0, k)], [router_record(20, 1, z1, k)]])
    assert [a.accepted for a in acks] == [1, 1], acks
    expected = numpy_router(z1.astype(np.float32), k)
    expected.update(numpy_pair(numpy_router(z0.astype(np.float32), k), expected))
    # Dead experts: mean load over the window (both samples) below 0.1/E.
    window = (numpy_router(z0.astype(np.float32), k)["_load"] + expected["_load"]) / 2
    expected["router_dead_experts"] = float((window < 0.1 / z0.shape[1]).sum())

    run = hello.run_id
    samples, ok = foreshockd.wait_for(
        lambda s: prometheus.value(s, "foreshock_router_flip_rate", run=run, layer="1") is not None)
    assert ok, f"router signals never appeared for {run}"
    for signal, want in expected.items():
        if signal.startswith("_"):
            continue
        got = prometheus.value(samples, f"foreshock_{signal}", run=run, layer="1")
        assert got is not None, signal
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9), signal
    if name == "one-expert":
        assert expected["router_dead_experts"] == 7
    if name == "ties":
        assert expected["router_flip_rate"] == 1.0


def test_router_bad_input_is_rejected_with_reasons(foreshockd):
    z = np.zeros((8, 4), dtype=np.float32)
    hello = ingest_pb2.Hello(run_id="router-bad", model=ingest_pb2.ModelInfo(
        n_layers=4, n_experts=4, top_k=2, moe_layers=[1, 3]))
    not_2d = router_record(1, 1, z, 2)
    del not_2d.router.logits.shape[:]
    not_2d.router.logits.shape.extend([2, 4, 4])
    nan = z.copy()
    nan[0, 0] = np.nan
    records = [not_2d, router_record(1, 1, np.zeros((8, 6), np.float32), 2),
               router_record(1, 1, z, 4), router_record(1, 1, z, 0),
               router_record(1, 2, z, 2), router_record(1, 3, nan, 2)]
    (ack,) = stream(foreshockd.endpoint, hello, [records])
    reasons = [r.reason.split(":")[0] for r in ack.rejections]
    assert reasons == ["bad_shape", "experts_mismatch", "bad_top_k", "bad_top_k", "not_moe_layer"]
    assert ack.accepted == 1  # the NaN sample is a signal, not a contract violation
    samples, ok = foreshockd.wait_for(lambda s: prometheus.value(
        s, "foreshock_nonfinite_values_total", run="router-bad", kind="router") == 1)
    assert ok
    for reason in set(reasons):
        assert prometheus.value(samples, "foreshock_ingest_rejected_total", reason=reason) >= 1
