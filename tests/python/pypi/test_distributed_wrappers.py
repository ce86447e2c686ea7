"""What the Monitor and the curvature estimator do with each distributed
wrapper, in one process (a world-size-1 gloo group): DDP and torch.compile
are probed through the module they wrap, FSDP2 and tensor-parallel DTensors
make the probe collective, and FSDP1, DeepSpeed engines, ZeRO-3 parameters
and discovery on tensor-parallel layers are refused at construction with the
fix in the message. The multi-rank behaviour is in test_distributed_training.py."""
import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import free_port
from demo.tiny_moe_gpt import GPTConfig, TinyMoEGPT
from foreshock import Monitor, distributed
from foreshock.curvature import CurvatureEstimator

NOWHERE = "127.0.0.1:1"  # nothing listens: these tests never need a daemon


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def tiny():
    torch.manual_seed(0)
    return TinyMoEGPT(GPTConfig(vocab_size=32, n_layer=2, d_model=32, n_head=2, block_size=16,
                                mlp_hidden=64, expert_hidden=32, moe_layers=(1,)))


PROBE = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(3))


def monitor(model, **kwargs):
    return Monitor(NOWHERE, run_id="wrappers", job="unit", model=model, probe_batch=PROBE,
                   every=1, backoff_initial_s=5, **kwargs)


def loss_fn(m, b):
    return F.cross_entropy(m(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten())


def sent_qk(model, **kwargs):
    """{layer: (q, k)} of one probe of `model` (as queued)."""
    sent = []
    m = monitor(model, tap=sent.append, **kwargs)
    try:
        m.probe(0)
    finally:
        m.close(timeout=0)
    return {r.qk.layer: (r.qk.q.data, r.qk.k.data) for r in sent if r.HasField("qk")}, m


def test_rank_and_world_size_default_from_torch_distributed(group):
    m = monitor(None)
    m.close(timeout=0)
    assert m.rank == 0 and m.probes_here
    assert dict(m._sender._hello.hello.labels) == {}  # one rank: no world_size label
    assert distributed.default_rank(5) == 5
    assert distributed.hello_labels({"team": "x"}) == {"team": "x"}


def test_ddp_is_probed_through_its_module(group):
    plain = tiny()
    reference, _ = sent_qk(plain)
    wrapped = torch.nn.parallel.DistributedDataParallel(tiny())
    got, m = sent_qk(wrapped)
    assert m._layout.kind == "ddp" and not m._layout.collective
    assert m.model is wrapped.module
    assert [s.name for s in m.attention_sites] == ["blocks.0.attn", "blocks.1.attn"]
    assert got == reference and len(got) == 2
    # Curvature: the same estimate as on the unwrapped model.
    batch = torch.randint(0, 32, (2, 17), generator=torch.Generator().manual_seed(4))
    a = CurvatureEstimator(plain, loss_fn, batch, hvps=2, hvp_mode="double_backward").estimate()
    b = CurvatureEstimator(wrapped, loss_fn, batch, hvps=2,
                           hvp_mode="double_backward").estimate()
    assert a.lambda_max == b.lambda_max


def test_compiled_model_is_probed_eagerly_through_orig_mod(group):
    reference, _ = sent_qk(tiny())
    compiled = torch.compile(tiny())  # compiles lazily: never called here
    got, m = sent_qk(compiled)
    assert m._layout.wrappers == ("OptimizedModule",) and m.model is compiled._orig_mod
    assert got == reference


def test_fsdp2_makes_the_probe_collective_and_curvature_is_refused(group):
    from torch.distributed.fsdp import fully_shard
    model = tiny()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    reference, _ = sent_qk(tiny())
    got, m = sent_qk(model)
    assert m._layout.kind == "fsdp2" and m._layout.collective
    assert got == reference
    # After the probe every parameter is a shard again (FSDP2 would leave the
    # root unsharded after a no-grad forward).
    assert all(type(p).__name__ == "DTensor" for p in model.parameters())
    with pytest.raises(ValueError, match="sharded across ranks"):
        CurvatureEstimator(model, loss_fn, PROBE)


def test_fsdp1_is_refused_with_the_fix(group):
    from torch.distributed.fsdp import FullyShardedDataParallel
    model = FullyShardedDataParallel(tiny(), device_id=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"FSDP1.*fully_shard.*model=None"):
        monitor(model)
    with pytest.raises(ValueError, match="FSDP1"):
        CurvatureEstimator(model, loss_fn, PROBE)


def test_tensor_parallel_dtensors_refuse_discovery_not_capture(group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    model = tiny()
    parallelize_module(model.blocks[0].attn, init_device_mesh("cpu", (1,)),
                       {"qkv": ColwiseParallel()})
    with pytest.raises(ValueError, match=r"tensor-parallel.*discover=False.*capture_qk"):
        monitor(model)
    m = monitor(model, discover=False, discover_routers=False, probe_all_ranks=True,
                probe_id="tp0")
    m.close(timeout=0)
    assert m._layout.kind == "tensor_parallel" and m._layout.collective


def test_deepspeed_engines_and_zero3_parameters_are_refused(group):
    class DeepSpeedEngine(torch.nn.Module):  # what deepspeed.initialize returns, by name
        def __init__(self):
            super().__init__()
            self.module = tiny()

    with pytest.raises(ValueError, match="engine.module"):
        monitor(DeepSpeedEngine())
    zero3 = tiny()
    zero3.head.weight.ds_id = 7  # ZeRO-3 marks its partitioned parameters
    with pytest.raises(ValueError, match="ZeRO-3"):
        monitor(zero3)
    with pytest.raises(ValueError, match="ZeRO-3"):
        CurvatureEstimator(zero3, loss_fn, PROBE)


def test_a_failing_hook_skips_its_layer_not_the_forward(group, caplog):
    model = tiny()
    m = monitor(model)
    m.attention_sites[0].n_heads = 3  # 32 features do not split into 3 heads
    sent = []
    m.tap = sent.append
    with caplog.at_level(logging.WARNING, logger="foreshock"):
        m.probe(0)
    m.close(timeout=0)
    assert sorted(r.qk.layer for r in sent if r.HasField("qk")) == [1]
    assert any("probe hook failed" in r.getMessage() for r in caplog.records)
