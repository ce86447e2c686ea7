"""Writes the seed corpus (tests/fuzz/corpus): serialized StreamRequests.

    PYTHONPATH=client/python python3 tests/fuzz/make_corpus.py
"""
import os
import struct

from foreshock.v1 import ingest_pb2 as pb

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def tensor(shape, dtype=pb.FLOAT32, short=0):
    n = 1
    for d in shape:
        n *= d
    size = 4 if dtype == pb.FLOAT32 else 2
    return pb.Tensor(dtype=dtype, shape=shape, data=bytes(range(256)) * (n * size // 256)
                     + bytes(n * size % 256)[:max(0, n * size % 256 - short)])


def qk(layer=0, shape=(2, 8, 8), dtype=pb.FLOAT32):
    return pb.Record(step=10, qk=pb.QKSample(layer=layer, probe_id="p0", q=tensor(shape, dtype),
                                             k=tensor(shape, dtype), causal=True, seq_len=4))


def seeds():
    model = pb.ModelInfo(n_layers=4, n_heads=2, head_dim=8, n_experts=8, top_k=2,
                         moe_layers=[1, 3])
    yield "hello", pb.StreamRequest(hello=pb.Hello(run_id="run-1", job="train", rank=0,
                                                   model=model, labels={"team": "a"}))
    yield "hello_bad_top_k", pb.StreamRequest(hello=pb.Hello(
        run_id="r", model=pb.ModelInfo(n_experts=4, top_k=4)))
    yield "hello_empty_run", pb.StreamRequest(hello=pb.Hello(job="j"))
    batch = pb.Batch(seq=1, records=[
        qk(),
        qk(layer=1, dtype=pb.BFLOAT16),
        pb.Record(step=10, router=pb.RouterSample(layer=1, probe_id="r0", top_k=2,
                                                  logits=tensor((16, 8)))),
        pb.Record(step=10, scalars=pb.StepScalars(loss=2.5, grad_norm=1.0, lr=3e-4)),
        pb.Record(step=10, curvature=pb.CurvatureSample(lambda_max=12.0, residual=0.01, hvps=20,
                                                        lr=3e-4, beta1=0.9, overlap=0.5,
                                                        layer_rayleigh=[1.0, 2.0, 3.0, 4.0])),
    ])
    yield "batch_all_kinds", pb.StreamRequest(batch=batch)
    yield "batch_edge_cases", pb.StreamRequest(batch=pb.Batch(seq=2, records=[
        pb.Record(step=-1, scalars=pb.StepScalars(loss=1.0)),           # negative_step
        pb.Record(step=1),                                              # missing_payload
        pb.Record(step=1, qk=pb.QKSample(layer=9, q=tensor((2, 8, 8)), k=tensor((2, 8, 8)))),
        pb.Record(step=1, qk=pb.QKSample(q=tensor((2, 8, 8)), k=tensor((2, 8, 4)))),
        pb.Record(step=1, qk=pb.QKSample(q=pb.Tensor(dtype=pb.FLOAT32, shape=[2, 0, 8]),
                                         k=tensor((2, 8, 8)))),
        pb.Record(step=1, router=pb.RouterSample(layer=1, top_k=8, logits=tensor((4, 8)))),
        pb.Record(step=1, router=pb.RouterSample(layer=1, top_k=1, logits=tensor((4, 8), short=3))),
        pb.Record(step=1, qk=pb.QKSample(q=pb.Tensor(dtype=7, shape=[1, 1, 1], data=b"abcd"),
                                         k=tensor((1, 1, 1)))),
    ]))
    yield "batch_big_shape", pb.StreamRequest(batch=pb.Batch(seq=3, records=[
        pb.Record(step=1, qk=pb.QKSample(q=pb.Tensor(dtype=pb.FLOAT32, shape=[256, 4096, 256]),
                                         k=pb.Tensor(dtype=pb.FLOAT32, shape=[256, 4096, 256]))),
        pb.Record(step=1, qk=pb.QKSample(q=pb.Tensor(dtype=pb.FLOAT32,
                                                     shape=[2**62, 2**62, 2**62]))),
    ]))
    yield "empty_request", pb.StreamRequest()


def main():
    os.makedirs(OUT, exist_ok=True)
    for name, request in seeds():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(request.SerializeToString())
    # Raw edge cases: invalid UTF-8 in a string field, a truncated message.
    hello = pb.StreamRequest(hello=pb.Hello(run_id="RUNID", job="j")).SerializeToString()
    with open(os.path.join(OUT, "hello_invalid_utf8"), "wb") as f:
        f.write(hello.replace(b"RUNID", b"RU\xff\xfeD"))
    with open(os.path.join(OUT, "batch_truncated"), "wb") as f:
        f.write(pb.StreamRequest(batch=pb.Batch(seq=1, records=[qk()])).SerializeToString()[:-7])


if __name__ == "__main__":
    main()
