"""Q/K and router capture: discovery on common layouts, the explicit API, probe hygiene.

No daemon: the monitor points at a port nobody listens on and the records are
read from its `tap`.
"""
import contextlib
import logging
import math
import os
import time
import types

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


# A transformers-style attention (no transformers needed): the module picks its
# attention function from a module-level ALL_ATTENTION_FUNCTIONS, with
# eager_attention_forward as the default, and hands it post-rotary q, k.

def eager_attention_forward(module, query, key, value, attention_mask, scaling, **kwargs):
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    t = query.shape[2]
    s = (query @ key.transpose(-1, -2)) * scaling + torch.full((t, t), float("-inf")).triu(1)
    return (torch.softmax(s, -1) @ value).transpose(1, 2), None


def sdpa_like_attention_forward(module, query, key, value, attention_mask, scaling, **kwargs):
    out, _ = eager_attention_forward(module, query, key, value, attention_mask, scaling)
    return out, None


class AttentionFunctions:
    """Stands in for transformers' AttentionInterface."""

    def get_interface(self, name, default):
        return {"sdpa": sdpa_like_attention_forward}.get(name, default)


ALL_ATTENTION_FUNCTIONS = AttentionFunctions()


class InterfaceAttention(LlamaAttention):
    def __init__(self, c, n_head, n_kv, implementation="eager", scaling=None):
        super().__init__(c, n_head, n_kv)
        del self.num_heads, self.num_key_value_heads  # HF >= 4.48 keeps them in config only
        self.config = types.SimpleNamespace(num_attention_heads=n_head, num_key_value_heads=n_kv,
                                            attn_implementation=implementation)
        self.scaling = scaling or self.head_dim ** -0.5

    def forward(self, x, layer):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = rotary(q), rotary(k)
        if self.capture:
            self.capture(layer, q, k)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config.attn_implementation,
                                                          eager_attention_forward)
        y, _ = attention(self, q, k, v, None, scaling=self.scaling)
        return self.o_proj(y.reshape(b, t, -1))


class InterfaceStack(LlamaStack):
    def __init__(self, implementation, scaling=None, n_layer=2, c=32, n_head=4, n_kv=2, vocab=13):
        super().__init__(n_layer, c, n_head, n_kv, vocab)
        for layer in self.layers:
            layer["self_attn"] = InterfaceAttention(c, n_head, n_kv, implementation, scaling)


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

        # Discovery reads the projections: pre-rotary, K with its own 2 heads.
        monitor.step(0)
        discovered = qk_records(records)
        attn = model.layers[0]["self_attn"]
        with torch.no_grad():
            x = model.embed_tokens(probe)  # layer 0's input
            q = attn.q_proj(x).view(3, 6, 4, 8).transpose(1, 2)
            k = attn.k_proj(x).view(3, 6, 2, 8).transpose(1, 2)
        np.testing.assert_allclose(encoding.decode_tensor(discovered[0].q),
                                   heads_tokens(q.numpy()), rtol=1e-6, atol=1e-6)
        # Query heads 0,1 share K head 0; heads 2,3 share K head 1 (the daemon's default).
        np.testing.assert_allclose(encoding.decode_tensor(discovered[0].k),
                                   heads_tokens(k.numpy()), rtol=1e-6, atol=1e-6)

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
                                   heads_tokens(k_rot.numpy()),
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


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("scaling", [None, 0.5])
def test_transformers_style_attention_is_sampled_after_rotary_through_the_interface(
        implementation, scaling):
    torch.manual_seed(3)
    model = InterfaceStack(implementation, scaling)
    probe = torch.randint(0, 13, (3, 6))
    with torch.no_grad():
        before = model(probe)
    monitor, records = make_monitor(model, probe, dtype="fp32")
    try:
        assert [(s.kind, s.n_heads, s.n_kv_heads, s.head_dim, s.fallback_kind)
                for s in monitor.attention_sites] == \
            [("attention_interface", 4, 2, 8, "q_proj/k_proj")] * 2
        monitor.step(0)
        discovered = qk_records(records)
        assert sorted(discovered) == [0, 1]
        # What the forward hands its attention function: post-rotary, K with 2 heads.
        model_qk = {}
        set_capture(model, lambda layer, q, k: model_qk.setdefault(layer, (q.clone(), k.clone())))
        with torch.no_grad():
            model(probe)
        # The model's logits are q·kᵀ·scaling; the daemon computes q·kᵀ/√d, so a
        # scale other than 1/√d travels folded into Q.
        fold = (scaling or 8 ** -0.5) * math.sqrt(8)
        for layer, sample in discovered.items():
            q, k = model_qk[layer]
            np.testing.assert_allclose(encoding.decode_tensor(sample.q),
                                       heads_tokens(q.numpy()) * fold, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(encoding.decode_tensor(sample.k),
                                       heads_tokens(k.numpy()),
                                       rtol=1e-6, atol=1e-6)
        # Only during the probe: the module globals are back, the output unchanged.
        assert ALL_ATTENTION_FUNCTIONS.__class__ is AttentionFunctions
        assert eager_attention_forward.__name__ == "eager_attention_forward" \
            and not hasattr(eager_attention_forward, "_foreshock_original")
        set_capture(model, None)
        with torch.no_grad():
            assert torch.equal(model(probe), before)
    finally:
        monitor.close(timeout=0.1)


def test_interface_site_that_bypasses_the_interface_falls_back_to_its_projections(caplog):
    torch.manual_seed(4)
    model = InterfaceStack("eager")
    for layer in model.layers:  # the forward never calls its attention function
        layer["self_attn"].forward = types.MethodType(LlamaAttention.forward, layer["self_attn"])
        layer["self_attn"].num_heads, layer["self_attn"].num_key_value_heads = 4, 2
    caplog.set_level(logging.INFO, logger="foreshock")
    monitor, records = make_monitor(model, torch.randint(0, 13, (2, 5)))
    try:
        monitor.step(0)
        assert sorted(qk_records(records)) == [0, 1]  # this probe already, from the projections
        assert [s.kind for s in monitor.attention_sites] == ["q_proj/k_proj"] * 2
        warnings = capture_warnings(caplog)
        assert len(warnings) == 2 and "layers.0.self_attn (InterfaceAttention) did not call " \
            "transformers' attention interface" in warnings[0] and "capture_qk" in warnings[0]
        records.clear()
        monitor.step(1)
        assert sorted(qk_records(records)) == [0, 1] and len(capture_warnings(caplog)) == 2
    finally:
        monitor.close(timeout=0.1)


def capture_warnings(caplog):
    """Warnings of discovery and capture (not the sender's: nothing listens)."""
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.module in ("capture", "monitor")]


def test_attention_discovery_cannot_read_is_named_with_the_fix(caplog):
    class InterleavedAttention(nn.Module):
        """Falcon-style query_key_value, heads interleaved: no layout discovery knows."""

        def __init__(self):
            super().__init__()
            self.num_heads = 2
            self.query_key_value = nn.Linear(8, 24)

        def forward(self, x):
            self.query_key_value(x)
            return x

    model = nn.Sequential(InterleavedAttention(), nn.Sequential(InterleavedAttention()),
                          nn.MultiheadAttention(8, 2))
    caplog.set_level(logging.INFO, logger="foreshock")
    monitor, records = make_monitor(model[:2], torch.randn(1, 3, 8))
    try:
        assert monitor.attention_sites == []
        (warning,) = capture_warnings(caplog)
        assert warning.startswith("foreshock: 0 (InterleavedAttention), 1.0 "
                                  "(InterleavedAttention) look like attention")
        assert warning.endswith("call monitor.capture_qk(layer, q, k) from its forward, "
                                "after rotary embedding")
        monitor.step(0)
        assert qk_records(records) == {}
    finally:
        monitor.close(timeout=0.1)
    caplog.clear()
    make_monitor(model[2:], None)[0].close(timeout=0.1)
    assert capture_warnings(caplog)[0].startswith("foreshock: 2 (MultiheadAttention) looks like")


def test_discovery_is_logged_at_info(caplog):
    caplog.set_level(logging.INFO, logger="foreshock")
    monitor, _ = make_monitor(demo_model(), None)
    monitor.close(timeout=0.1)
    (line,) = [r.getMessage() for r in caplog.records if "discovery found" in r.getMessage()]
    assert line == ("foreshock: discovery found 4 attention layer(s): blocks.0.attn (fused:qkv), "
                    "blocks.1.attn (fused:qkv), blocks.2.attn (fused:qkv), blocks.3.attn "
                    "(fused:qkv) and 2 router(s): blocks.1.ffn.router (router), "
                    "blocks.3.ffn.router (router)")
    caplog.clear()
    monitor, _ = make_monitor(nn.Sequential(nn.Linear(2, 2)), None)
    monitor.close(timeout=0.1)
    assert [r.getMessage() for r in caplog.records if "discovery found" in r.getMessage()] == \
        ["foreshock: discovery found 0 attention layer(s) and 0 router(s)"]


class TopKRouter(nn.Module):
    """transformers >= 5 router: a [experts, hidden] weight, (logits, weights, indices) out."""

    def __init__(self, hidden, experts, top_k):
        super().__init__()
        self.top_k, self.num_experts = top_k, experts
        self.weight = nn.Parameter(torch.randn(experts, hidden))

    def forward(self, x):
        logits = nn.functional.linear(x.reshape(-1, x.shape[-1]), self.weight)
        weights, indices = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        return logits, weights, indices


def test_router_module_returning_a_tuple_is_discovered(caplog):
    class Block(nn.Module):
        def __init__(self, router):
            super().__init__()
            self.gate, self.experts = router, nn.ModuleList([nn.Linear(8, 8)] * 4)

        def forward(self, x):
            self.gate(x)
            return x

    class NoLogits(TopKRouter):
        def forward(self, x):
            return super().forward(x)[1:]

    torch.manual_seed(5)
    model = nn.Sequential(Block(TopKRouter(8, 4, 2)), Block(NoLogits(8, 4, 2)))
    probe = torch.randn(2, 3, 8)
    caplog.set_level(logging.INFO, logger="foreshock")
    monitor, records = make_monitor(model, probe)
    try:
        assert [(s.name, s.layer, s.n_experts, s.top_k) for s in monitor.router_sites] == \
            [("0.gate", 0, 4, 2), ("1.gate", 1, 4, 2)]
        monitor.step(0)
        routers = router_records(records)
        assert sorted(routers) == [0]
        with torch.no_grad():
            want = model[0].gate(probe)[0]
        np.testing.assert_array_equal(encoding.decode_tensor(routers[0].logits), want.numpy())
        (warning,) = capture_warnings(caplog)
        assert warning.startswith("foreshock: router 1.gate (NoLogits) returned no [tokens, 4] "
                                  "logits") and "monitor.capture_router(layer, logits, top_k)" \
            in warning
    finally:
        monitor.close(timeout=0.1)


# -- explicit capture and probe hygiene ---------------------------------------------

def test_capture_qk_sends_grouped_query_k_once_per_group():
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
        assert list(sample.q.shape) == [4, 14, 3] and list(sample.k.shape) == [2, 14, 3]
        assert sample.seq_len == 7 and list(sample.kv_head_of) == []  # contiguous groups
        np.testing.assert_array_equal(encoding.decode_tensor(sample.k),
                                      heads_tokens(captured["k"].numpy()))
        np.testing.assert_array_equal(encoding.decode_tensor(sample.q),
                                      heads_tokens(captured["q"].numpy()))
    finally:
        monitor.close(timeout=0.1)
    # For older daemons: K repeated for every query head (h uses K head h // 2).
    monitor, records = make_monitor(OneLayer(), probe, dtype="fp32", broadcast_kv=True)
    try:
        monitor.step(0)
        (sample,) = qk_records(records).values()
        assert list(sample.q.shape) == list(sample.k.shape) == [4, 14, 3]
        k_sent, k_in = encoding.decode_tensor(sample.k), captured["k"].numpy()
        for head in range(4):
            np.testing.assert_array_equal(k_sent[head], k_in[:, head // 2].reshape(14, 3))
    finally:
        monitor.close(timeout=0.1)


def test_capture_qk_outside_the_probe_is_a_cheap_no_op():
    model = demo_model()
    monitor, records = make_monitor(model, torch.randint(0, 20, (1, 64)), every=1000)
    # Cheap by construction, not by a timer: outside a probe forward it must
    # not touch its arguments at all, so objects that raise on any use pass.
    class Untouchable:
        def __getattribute__(self, name):
            raise AssertionError(f"capture_qk used its tensor outside a probe: .{name}")

    try:
        for _ in range(100):
            monitor.capture_qk(0, Untouchable(), Untouchable())
            monitor.check_attention_output(0, *(Untouchable() for _ in range(4)))
        assert records == []
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


# -- probe hygiene: the training job never pays for a probe's trouble ---------------

class KwargsGPT(nn.Module):
    """Takes its input as a keyword, as HF models do with a tokenizer's output."""

    def __init__(self):
        super().__init__()
        self.inner = GPTStack(NanoGPTAttention)

    def forward(self, input_ids):
        return self.inner(input_ids)


def test_a_failing_probe_is_logged_and_counted_and_training_continues(caplog):
    torch.manual_seed(0)
    model = GPTStack(NanoGPTAttention)
    monitor, records = make_monitor(model, torch.randn(1, 5))  # floats into nn.Embedding: raises
    try:
        with caplog.at_level(logging.ERROR, logger="foreshock"):
            for step in range(3):
                monitor.step(step, loss=1.0)  # must not raise
        assert monitor.stats()["probe_failures"] == 3
        assert sum("probe at step 0 failed" in r.getMessage() for r in caplog.records) == 1
        assert [r.step for r in records if r.WhichOneof("payload") == "scalars"] == [0, 1, 2]
        assert model.training  # the failed probe's eval() was undone
    finally:
        monitor.close(timeout=0.1)


def test_probe_restores_every_modules_own_mode_and_accepts_any_mapping():
    from collections.abc import Mapping

    class Encoding(Mapping):  # like transformers' BatchEncoding: a Mapping, not a dict
        def __init__(self, **kw):
            self._data = dict(kw)

        def __getitem__(self, key):
            return self._data[key]

        def __iter__(self):
            return iter(self._data)

        def __len__(self):
            return len(self._data)

    torch.manual_seed(0)
    model = KwargsGPT()
    model.train()
    frozen = model.inner.h[0]
    frozen.eval()  # the user keeps this block in eval during training
    monitor, records = make_monitor(model, Encoding(input_ids=torch.randint(0, 11, (2, 8))))
    try:
        monitor.step(0)
        assert monitor.stats()["probe_failures"] == 0 and qk_records(records)
        assert model.training and model.inner.training and model.inner.h[1].training
        assert not any(m.training for m in frozen.modules())
    finally:
        monitor.close(timeout=0.1)


@pytest.mark.parametrize("compute, declared, expected", [
    (torch.float32, None, "FLOAT32"),
    (torch.bfloat16, None, "BFLOAT16"),
    (torch.float16, None, "FLOAT16"),
    (torch.float64, None, "FLOAT32"),
    # A kernel that computes in bf16 from fp32 inputs says so itself.
    (torch.float32, "bf16", "BFLOAT16"),
])
def test_each_qk_sample_says_the_dtype_attention_is_computed_in(compute, declared, expected):
    """QKSample.attention_dtype: the captured Q's own dtype, whatever the wire
    dtype (bf16 here), unless Monitor(attention_dtype=...) says otherwise."""
    class OneLayer(nn.Module):
        def forward(self, x):
            x = x.to(compute)
            monitor.capture_qk(0, x[:, :2], x[:, 2:])
            return x

    probe = torch.randn(1, 4, 5, 3)  # [B, H, T, d]
    kwargs = {} if declared is None else {"attention_dtype": declared}
    monitor, records = make_monitor(OneLayer(), probe, **kwargs)
    try:
        monitor.step(0)
        (sample,) = qk_records(records).values()
        assert sample.q.dtype == encoding.pb.BFLOAT16  # the wire dtype is another matter
        assert encoding.pb.DType.Name(sample.attention_dtype) == expected
    finally:
        monitor.close(timeout=0.1)


def test_attention_dtype_must_be_a_known_name():
    with pytest.raises(ValueError, match="dtype must be one of"):
        make_monitor(nn.Identity(), torch.zeros(1, 2, 3, 4), attention_dtype="fp8")


# -- mixed precision: the probe computes as the training forward does (issue 26) ----

class PromotingInterfaceAttention(InterfaceAttention):
    """HF under autocast: rotary with fp32 cos/sin promotes the bf16 q/k to fp32,
    while the attention kernel (matmuls under autocast) computes in bf16."""

    def forward(self, x, layer):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2).float()
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2).float()
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        y, _ = eager_attention_forward(self, rotary(q), rotary(k), v, None, scaling=self.scaling)
        return self.o_proj(y.reshape(b, t, -1))


def promoting_stack():
    torch.manual_seed(0)
    model = LlamaStack()
    for layer in model.layers:
        layer["self_attn"] = PromotingInterfaceAttention(32, 4, 2)
    return model


def train_steps(model, monitor, steps, autocast):
    """A few training steps, the forward under autocast (when given), and
    monitor.step() after optimizer.step(), outside it, as the README says."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randint(0, 13, (2, 6), generator=torch.Generator().manual_seed(3))
    for step in range(steps):
        context = torch.autocast("cpu", dtype=autocast) if autocast is not None \
            else contextlib.nullcontext()
        with context:
            loss = model(data).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.step(step, loss=loss.item())


@pytest.mark.parametrize("stack", [LlamaStack, promoting_stack])
@pytest.mark.parametrize("autocast, monitor_autocast, expected", [
    (torch.bfloat16, None, "BFLOAT16"),  # followed from the training forward
    (None, None, "FLOAT32"),
    (torch.bfloat16, False, "FLOAT32"),  # switched off: the probe runs as called
    (None, "bf16", "BFLOAT16"),          # declared (the callbacks do this)
])
def test_the_attention_dtype_is_what_the_training_forward_computes_in(
        stack, autocast, monitor_autocast, expected):
    """Issue 26: with torch.autocast("cpu", torch.bfloat16) around the forward and
    monitor.step() after optimizer.step(), the probe ran in fp32 and the run was
    reported as computing attention in fp32. The probe now runs under the
    training forward's autocast, and an attention function's output dtype (bf16
    under autocast, though handed fp32 q/k) is the compute dtype."""
    model = stack()
    probe = torch.randint(0, 13, (2, 6), generator=torch.Generator().manual_seed(1))
    kwargs = {} if monitor_autocast is None else {"autocast": monitor_autocast}
    monitor, records = make_monitor(model, probe, every=2, **kwargs)
    try:
        train_steps(model, monitor, 3, autocast)
        qk = [r.qk for r in records if r.WhichOneof("payload") == "qk"]
        assert len(qk) == 2 * len(model.layers)  # probes at steps 0 and 2
        for sample in qk:
            assert encoding.pb.DType.Name(sample.attention_dtype) == expected, sample.layer
        assert monitor.stats()["probe_failures"] == 0
    finally:
        monitor.close(timeout=0.1)
    assert not torch.is_autocast_cpu_enabled()  # nothing leaked out of the probe


def test_autocast_must_be_bf16_or_fp16():
    with pytest.raises(ValueError, match="autocast must be"):
        make_monitor(nn.Identity(), torch.zeros(1, 2, 3, 4), autocast="fp8")


def test_discovered_sites_print_short():
    """print(monitor.attention_sites) was 100+ KB for HF models: each site's
    repr dragged its modeling module's globals."""
    model = InterfaceStack("eager")
    monitor, _ = make_monitor(model, torch.zeros(1, 3, dtype=torch.long))
    try:
        text = repr(monitor.attention_sites)
        assert len(monitor.attention_sites) == 2 and len(text) < 400, text
        assert "layer=0" in text and "InterfaceAttention" in text
    finally:
        monitor.close(timeout=0.1)


# Issue 36: what is monitored is said once without any logging configuration.
_DESCRIBE_SCRIPT = """
import logging, sys, torch
if sys.argv[1] == "logging":
    logging.basicConfig(level=logging.INFO)
from demo import tiny_moe_gpt as tmg
from foreshock import Monitor
torch.manual_seed(0)
cfg = tmg.GPTConfig(vocab_size=16, block_size=8, n_layer=2, d_model=16, n_head=2, mlp_hidden=32,
                    n_experts=2, top_k=1, expert_hidden=8, moe_layers=(1,))
m = Monitor("127.0.0.1:1", run_id="describe-me", job="t", model=tmg.TinyMoEGPT(cfg),
            probe_batch=torch.randint(0, 16, (1, 8)), every=2, backoff_initial_s=5.0)
print("BEFORE", m.describe())
for step in range(7):
    m.step(step, loss=1.0)
print("AFTER", m.describe())
m.close(timeout=0.2)
"""


@pytest.mark.parametrize("mode", ["no_logging", "logging"])
def test_the_first_probe_says_once_what_is_monitored(mode):
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _DESCRIBE_SCRIPT, mode], capture_output=True,
                         text=True, timeout=120, cwd=os.path.join(os.path.dirname(__file__), "..", ".."),
                         env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr
    after = [line for line in out.stdout.splitlines() if line.startswith("AFTER ")]
    assert len(after) == 1, out.stdout
    described = after[0][len("AFTER "):]
    assert described.startswith("foreshock: run describe-me rank 0: Q/K of 2 attention layer(s) "
                                "[0, 1], 1 router(s) [1], attention computed in fp32, curvature "
                                "off, a probe every 2 steps"), described
    # Four probes, one line: on stderr, by itself or as the logger's record.
    announced = [line for line in out.stderr.splitlines() if described in line]
    assert len(announced) == 1, out.stderr
    before = [line for line in out.stdout.splitlines() if line.startswith("BEFORE ")]
    assert "known at the first probe" in before[0], before
