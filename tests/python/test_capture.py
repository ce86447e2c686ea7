"""Q/K and router capture: discovery on common layouts, the explicit API, probe hygiene.

No daemon: the monitor points at a port nobody listens on and the records are
read from its `tap`.
"""
import math
import time

import numpy as np
import pytest
import torch
import torch.nn as nn

from conftest import free_port
from demo import tiny_moe_gpt as tmg
from foreshock import Monitor, ModelInfo, encoding


def make_monitor(model, probe, **kwargs):
    records = []
    monitor = Monitor(f"127.0.0.1:{free_port()}", run_id="t", job="test", model=model,
                      probe_batch=probe, every=kwargs.pop("every", 1), tap=records.append,
                      **kwargs)
    return monitor, records


def qk_records(records):
    return {r.qk.layer: r.qk for r in records if r.WhichOneof("payload") == "qk"}


def router_records(records):
    return {r.router.layer: r.router for r in records if r.WhichOneof("payload") == "router"}


def heads_tokens(x_bhtd):
    """[B, H, T, d] -> [H, B*T, d], written independently of the client's helper."""
    b, h, t, d = x_bhtd.shape
    return np.stack([x_bhtd[:, i].reshape(b * t, d) for i in range(h)])


# -- toy models of common layouts ------------------------------------------------

class FusedQKVAttention(nn.Module):
    """Attention with one fused [Q | K | V] projection `c_attn`; no head-count attribute."""

    def __init__(self, c, n_head, c_attn):
        super().__init__()
        self._heads = n_head  # private: discovery must find the public attribute of subclasses
        self.c_attn = c_attn
        self.c_proj = nn.Linear(c, c)
        self.capture = None

    def forward(self, x, layer):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self._heads, c // self._heads).transpose(1, 2) for z in (q, k, v))
        if self.capture:
            self.capture(layer, q, k)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        y = torch.softmax(s + torch.full((t, t), float("-inf")).triu(1), -1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class NanoGPTAttention(FusedQKVAttention):
    """nanoGPT: c_attn is an nn.Linear, heads in `n_head`."""

    def __init__(self, c, n_head):
        super().__init__(c, n_head, nn.Linear(c, 3 * c))
        self.n_head = n_head


class HFConv1D(nn.Module):
    """HF GPT-2's Conv1D: a Linear with the weight transposed and the width in `nf`."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        return x @ self.weight + self.bias


class HFGPT2Attention(FusedQKVAttention):
    """HF GPT-2: c_attn is a Conv1D, heads in `num_heads`, plus `head_dim`."""

    def __init__(self, c, n_head):
        super().__init__(c, n_head, HFConv1D(3 * c, c))
        self.num_heads, self.head_dim = n_head, c // n_head


class GPTStack(nn.Module):
    def __init__(self, attention_cls, n_layer=3, c=16, n_head=4, vocab=11):
        super().__init__()
        self.emb = nn.Embedding(vocab, c)
        self.h = nn.ModuleList(nn.ModuleDict({"ln_1": nn.LayerNorm(c),
                                              "attn": attention_cls(c, n_head)})
                               for _ in range(n_layer))

    def forward(self, idx):
        x = self.emb(idx)
        for i, block in enumerate(self.h):
            x = x + block["attn"](block["ln_1"](x), i)
        return x


def rotary(x):
    """Rotary embedding on [B, H, T, d] (half-split convention)."""
    t, d = x.shape[-2], x.shape[-1]
    freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angle = torch.arange(t).float()[:, None] * freq[None, :]
    cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaAttention(nn.Module):
    """HF LLaMA layout with grouped-query attention: q_proj/k_proj/v_proj/o_proj."""

    def __init__(self, c, n_head, n_kv):
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = n_head, n_kv, c // n_head
        self.q_proj = nn.Linear(c, n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c, n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c, n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_head * self.head_dim, c, bias=False)
        self.capture = None

    def forward(self, x, layer):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        q, k = rotary(q), rotary(k)
        if self.capture:
            self.capture(layer, q, k)  # after rotary, K with its own (fewer) heads
        rep = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        y = torch.softmax(s + torch.full((t, t), float("-inf")).triu(1), -1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class LlamaStack(nn.Module):
    def __init__(self, n_layer=2, c=32, n_head=4, n_kv=2, vocab=13):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, c)
        self.layers = nn.ModuleList(nn.ModuleDict({"self_attn": LlamaAttention(c, n_head, n_kv)})
                                    for _ in range(n_layer))

    def forward(self, input_ids):
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = x + layer["self_attn"](x, i)
        return x


def set_capture(model, fn):
    for m in model.modules():
        if hasattr(m, "capture"):
            m.capture = fn


# -- discovery -------------------------------------------------------------------

@pytest.mark.parametrize("attention_cls", [NanoGPTAttention, HFGPT2Attention])
def test_gpt2_fused_c_attn_is_discovered_with_the_models_own_q_k(attention_cls):
    torch.manual_seed(0)
    model = GPTStack(attention_cls)
    probe = torch.randint(0, 11, (2, 5))
    monitor, records = make_monitor(model, probe)
    try:
        assert monitor.model_info == ModelInfo(n_layers=3, n_heads=4, head_dim=4)
        assert [s.kind for s in monitor.attention_sites] == ["fused:c_attn"] * 3
        monitor.step(0)
        discovered = qk_records(records)
        assert sorted(discovered) == [0, 1, 2]

        # What the model's own forward computes, handed over explicitly:
        model_qk = {}
        set_capture(model, lambda layer, q, k: model_qk.setdefault(layer, (q.clone(), k.clone())))
        with torch.no_grad():
            model.eval()
            model(probe)
        for layer, sample in discovered.items():
            assert list(sample.q.shape) == [4, 10, 4] and sample.seq_len == 5 and sample.causal
            assert sample.probe_id == "default"
            q, k = (heads_tokens(t.to(torch.bfloat16).float().numpy()) for t in model_qk[layer])
            np.testing.assert_array_equal(encoding.decode_tensor(sample.q), q)
            np.testing.assert_array_equal(encoding.decode_tensor(sample.k), k)
    finally:
        monitor.close(timeout=0.1)


def test_llama_q_proj_k_proj_is_discovered_pre_rotary_and_capture_qk_overrides():
    torch.manual_seed(1)
    model = LlamaStack()
    probe = torch.randint(0, 13, (3, 6))
    monitor, records = make_monitor(model, probe, dtype="fp32")
    try:
        assert monitor.model_info == ModelInfo(n_layers=2, n_heads=4, head_dim=8)
        assert [(s.kind, s.n_kv_heads) for s in monitor.attention_sites] == \
            [("q_proj/k_proj", 2)] * 2

        # Discovery reads the projections: pre-rotary, with K broadcast to 4 heads.
        monitor.step(0)
        discovered = qk_records(records)
        attn = model.layers[0]["self_attn"]
        with torch.no_grad():
            x = model.embed_tokens(probe)  # layer 0's input
            q = attn.q_proj(x).view(3, 6, 4, 8).transpose(1, 2)
            k = attn.k_proj(x).view(3, 6, 2, 8).transpose(1, 2)
        np.testing.assert_allclose(encoding.decode_tensor(discovered[0].q),
                                   heads_tokens(q.numpy()), rtol=1e-6, atol=1e-6)
        k_sent = encoding.decode_tensor(discovered[0].k)
        for head in range(4):  # query heads 0,1 share K head 0; heads 2,3 share K head 1
            np.testing.assert_allclose(k_sent[head], k[:, head // 2].reshape(18, 8),
                                       rtol=1e-6, atol=1e-6)

        # Once the forward calls capture_qk (post-rotary), explicit samples replace discovery.
        set_capture(model, monitor.capture_qk)
        records.clear()
        monitor.step(1)
        explicit = qk_records(records)
        assert sorted(explicit) == [0, 1]
        q_rot, k_rot = rotary(q), rotary(k)
        np.testing.assert_allclose(encoding.decode_tensor(explicit[0].q),
                                   heads_tokens(q_rot.numpy()), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(encoding.decode_tensor(explicit[0].k),
                                   heads_tokens(k_rot.repeat_interleave(2, dim=1).numpy()),
                                   rtol=1e-5, atol=1e-6)
        assert not np.allclose(encoding.decode_tensor(explicit[0].q),
                               encoding.decode_tensor(discovered[0].q))
    finally:
        monitor.close(timeout=0.1)


def demo_model():
    torch.manual_seed(2)
    return tmg.TinyMoEGPT(tmg.GPTConfig(vocab_size=20))


def test_demo_model_discovery_finds_attention_and_routers():
    model = demo_model()
    probe = torch.randint(0, 20, (2, 64))
    monitor, records = make_monitor(model, probe)
    try:
        assert monitor.model_info == ModelInfo(n_layers=4, n_heads=4, head_dim=16, n_experts=4,
                                               top_k=2, moe_layers=(1, 3))
        monitor.step(0)
        discovered_qk, discovered_router = qk_records(records), router_records(records)
        assert sorted(discovered_qk) == [0, 1, 2, 3]
        assert sorted(discovered_router) == [1, 3]
        for sample in discovered_router.values():
            assert list(sample.logits.shape) == [128, 4] and sample.top_k == 2

        # The demo's explicit hooks must give the same samples as discovery.
        model.set_qk_hook(monitor.capture_qk)
        model.set_router_hook(monitor.capture_router)
        records.clear()
        monitor.step(1)
        for layer, sample in qk_records(records).items():
            assert sample == discovered_qk[layer]
        for layer, sample in router_records(records).items():
            assert sample == discovered_router[layer]
    finally:
        monitor.close(timeout=0.1)


def test_model_without_head_count_is_skipped_unless_model_info_gives_it():
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(8, 24)

        def forward(self, x):
            return self.qkv(x)

    model = nn.Sequential(Bare())
    monitor, _ = make_monitor(model, torch.randn(1, 3, 8))
    assert monitor.attention_sites == []
    monitor.close(timeout=0.1)
    monitor, records = make_monitor(model, torch.randn(1, 3, 8), model_info=ModelInfo(n_heads=2))
    try:
        assert [(s.n_heads, s.head_dim) for s in monitor.attention_sites] == [(2, 4)]
        monitor.step(0)
        assert list(qk_records(records)[0].q.shape) == [2, 3, 4]
    finally:
        monitor.close(timeout=0.1)


# -- explicit capture and probe hygiene ---------------------------------------------

def test_capture_qk_broadcasts_grouped_query_k():
    captured = {}

    class OneLayer(nn.Module):
        def forward(self, x):
            captured["q"], captured["k"] = x[:, :4], x[:, 4:]  # 4 query heads, 2 key heads
            monitor.capture_qk(0, captured["q"], captured["k"])
            return x

    probe = torch.randn(2, 6, 7, 3)  # [B, H, T, d]
    monitor, records = make_monitor(OneLayer(), probe, dtype="fp32")
    try:
        monitor.step(0)
        (sample,) = qk_records(records).values()
        assert list(sample.q.shape) == list(sample.k.shape) == [4, 14, 3]
        assert sample.seq_len == 7
        k_sent, k_in = encoding.decode_tensor(sample.k), captured["k"].numpy()
        for head in range(4):
            np.testing.assert_array_equal(k_sent[head], k_in[:, head // 2].reshape(14, 3))
        np.testing.assert_array_equal(encoding.decode_tensor(sample.q),
                                      heads_tokens(captured["q"].numpy()))
    finally:
        monitor.close(timeout=0.1)


def test_capture_qk_outside_the_probe_is_a_cheap_no_op():
    model = demo_model()
    monitor, records = make_monitor(model, torch.randint(0, 20, (1, 64)), every=1000)
    try:
        q = k = torch.zeros(1, 4, 64, 16)
        n = 20000
        start = time.perf_counter()
        for _ in range(n):
            monitor.capture_qk(0, q, k)
        per_call = (time.perf_counter() - start) / n
        assert records == []
        assert per_call < 20e-6, f"capture_qk outside a probe took {per_call * 1e6:.2f} us"
    finally:
        monitor.close(timeout=0.1)


def test_probe_runs_every_n_steps_in_eval_no_grad_and_restores_the_model():
    model = demo_model()
    forwards = []

    def spy(module, inputs):
        forwards.append((module.training, torch.is_grad_enabled()))

    model.register_forward_pre_hook(spy)
    monitor, records = make_monitor(model, torch.randint(0, 20, (1, 64)), every=5)
    try:
        model.train()
        for step in range(11):
            monitor.step(step, loss=1.0)
        assert forwards == [(False, False)] * 3  # steps 0, 5, 10
        assert model.training and all(m.training for m in model.modules())
        assert all(p.grad is None for p in model.parameters())
        # The discovery hooks are attached only during the probe forward.
        assert all(not m._forward_hooks for m in model.modules())
        kinds = [r.WhichOneof("payload") for r in records]
        assert kinds.count("scalars") == 11 and kinds.count("qk") == 12
        assert [r.step for r in records if r.WhichOneof("payload") == "qk"] == [0] * 4 + [5] * 4 + [10] * 4
        model.eval()
        monitor.step(15)
        assert not model.training  # eval mode is restored as eval
    finally:
        monitor.close(timeout=0.1)


def test_step_scalars_carry_presence():
    monitor, records = make_monitor(None, None)
    try:
        monitor.step(3, loss=torch.tensor(2.5), lr=1e-3)
        monitor.step(4)
        first, second = (r.scalars for r in records)
        assert first.HasField("loss") and first.loss == 2.5 and first.lr == 1e-3
        assert not first.HasField("grad_norm")
        assert records[1].WhichOneof("payload") == "scalars"
        assert not (second.HasField("loss") or second.HasField("grad_norm") or second.HasField("lr"))
    finally:
        monitor.close(timeout=0.1)


def test_only_rank_zero_probes_unless_asked():
    torch.manual_seed(0)
    cfg = tmg.GPTConfig(vocab_size=16, block_size=8, n_layer=2, d_model=16, n_head=2,
                        moe_layers=(1,))
    model = tmg.TinyMoEGPT(cfg)
    probe = torch.randint(0, 16, (2, 8))
    kinds = {}
    for rank, all_ranks in ((0, False), (1, False), (1, True)):
        sent = []
        # Nothing listens on port 1: records stay queued; `tap` sees them all.
        monitor = Monitor("127.0.0.1:1", run_id="r", job="j", model=model, probe_batch=probe,
                          every=1, rank=rank, tap=sent.append, probe_all_ranks=all_ranks)
        try:
            monitor.step(0, loss=1.0)
        finally:
            monitor.close(timeout=0.2)
        kinds[(rank, all_ranks)] = sorted({r.WhichOneof("payload") for r in sent})
    assert kinds[(0, False)] == ["qk", "router", "scalars"]
    assert kinds[(1, False)] == ["scalars"]  # data-parallel ranks send scalars only
    assert kinds[(1, True)] == ["qk", "router", "scalars"]
