"""Monitor(model=...) on Hugging Face transformers models, with no code in the model.

Each family is built from a small config (random init, nothing downloaded) and
probed under attn_implementation "sdpa" and "eager". The reference is the
model's own eager attention probabilities (output_attentions=True, recorded
by transformers from the eager softmax) and its own router logits
(output_router_logits=True): the Q and K the client sent must reproduce those
probabilities through the daemon's logit formula q·kᵀ/√d, which holds only for
Q/K after rotary embedding and q_norm/k_norm, with the model's scale.
"""
import logging
import math
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402  (the PyPI venv pins it: a missing one is a failure)
from conftest import free_port  # noqa: E402
from foreshock import Monitor, ModelInfo, encoding, prometheus  # noqa: E402
from foreshock.v1 import ingest_pb2 as pb  # noqa: E402

VOCAB, BATCH, SEQ = 64, 2, 12
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
MOE = dict(num_experts_per_tok=2)


def _gpt2(**extra):
    return transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                   n_positions=64, bos_token_id=0, eos_token_id=0, **extra)


# family -> (model class, config factory, attention class, router class or None)
FAMILIES = {
    # grouped-query attention (4 query heads, 2 KV heads) with rotary
    "llama": ("LlamaForCausalLM", lambda: transformers.LlamaConfig(**SMALL),
              "LlamaAttention", None),
    # top-2 router `gate` (MixtralTopKRouter returns (logits, weights, indices))
    "mixtral": ("MixtralForCausalLM",
                lambda: transformers.MixtralConfig(**SMALL, num_local_experts=4, **MOE),
                "MixtralAttention", "MixtralTopKRouter"),
    # per-head q_norm/k_norm before rotary
    "qwen3_moe": ("Qwen3MoeForCausalLM",
                  lambda: transformers.Qwen3MoeConfig(**SMALL, num_experts=4,
                                                      moe_intermediate_size=16, **MOE),
                  "Qwen3MoeAttention", "Qwen3MoeTopKRouter"),
    # q_norm/k_norm over the whole projection
    "olmoe": ("OlmoeForCausalLM",
              lambda: transformers.OlmoeConfig(**SMALL, num_experts=4, **MOE),
              "OlmoeAttention", "OlmoeTopKRouter"),
    # shared expert with its own `shared_expert_gate` (not a router); MoE on
    # every second layer only
    "qwen2_moe": ("Qwen2MoeForCausalLM",
                  lambda: transformers.Qwen2MoeConfig(
                      **{**SMALL, "num_hidden_layers": 4}, num_experts=4,
                      moe_intermediate_size=16, shared_expert_intermediate_size=16,
                      decoder_sparse_step=2, **MOE),
                  "Qwen2MoeAttention", "Qwen2MoeTopKRouter"),
    # router named `router`; logit scale attention_multiplier, not 1/sqrt(d)
    "granitemoe": ("GraniteMoeForCausalLM",
                   lambda: transformers.GraniteMoeConfig(**SMALL, num_local_experts=4, **MOE,
                                                         attention_multiplier=0.5),
                   "GraniteMoeAttention", "GraniteMoeTopKRouter"),
    # fused Conv1D c_attn, no rotary
    "gpt2": ("GPT2LMHeadModel", _gpt2, "GPT2Attention", None),
    # logit scale 1/(sqrt(d) * (layer + 1))
    "gpt2_inverse_layer_scale": ("GPT2LMHeadModel",
                                 lambda: _gpt2(scale_attn_by_inverse_layer_idx=True),
                                 "GPT2Attention", None),
}
ATTN = ("sdpa", "eager")


def build(family, attn, seed=0):
    model_cls, config_fn, _, _ = FAMILIES[family]
    config = config_fn()
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    assert model.config._attn_implementation == attn
    return model.eval()


def probe_batch(seed=1):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def names_of(model, class_name):
    return [n for n, m in model.named_modules() if type(m).__name__ == class_name]


def reference(model, probe, moe):
    """The model's own eager attention probabilities [B, H, T, T] per layer and
    router logits [B*T, E] per MoE layer, on the same weights."""
    implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            kwargs = dict(output_router_logits=True) if moe else {}
            out = model(probe, output_attentions=True, **kwargs)
    finally:
        model.set_attn_implementation(implementation)
    attentions = [a.double().numpy() for a in out.attentions]
    routers = [r.double().numpy() for r in out.router_logits] if moe else []
    return attentions, routers


def sent_log_probs(q, k, batch, seq):
    """log softmax(q·kᵀ/√d) under the causal mask, from the wire's q [H, B*T, d]
    and k [Hkv, B*T, d] (query head h with K head h // (H / Hkv)), as
    [B, H, T, T] (masked entries -inf). Written from the wire contract."""
    h, _, d = q.shape
    k = np.repeat(k, h // k.shape[0], axis=0)
    q = q.astype(np.float64).reshape(h, batch, seq, d).transpose(1, 0, 2, 3)
    k = k.astype(np.float64).reshape(h, batch, seq, d).transpose(1, 0, 2, 3)
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d)
    s = np.where(np.tril(np.ones((seq, seq), dtype=bool)), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    return s - m - np.log(np.exp(s - m).sum(axis=-1, keepdims=True))


def max_log_prob_error(log_probs, probs):
    causal = np.broadcast_to(np.tril(np.ones(probs.shape[-2:], dtype=bool)), probs.shape)
    return float(np.abs(log_probs[causal] - np.log(probs[causal])).max())


def make_monitor(model, probe, endpoint=None, **kwargs):
    records = []
    monitor = Monitor(endpoint or f"127.0.0.1:{free_port()}", run_id=kwargs.pop("run_id", "hf"),
                      job="test", model=model, probe_batch=probe, every=1, tap=records.append,
                      dtype="fp32", **kwargs)
    return monitor, records


def capture_warnings(caplog):
    """Warnings of discovery and capture (not the sender's: nothing listens)."""
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.module in ("capture", "monitor")]


def payloads(records, kind):
    return {getattr(r, kind).layer: getattr(r, kind) for r in records
            if r.WhichOneof("payload") == kind}


# -- capture against the model's own attention ---------------------------------------

@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sent_qk_reproduce_the_models_own_attention(family, attn, caplog):
    _, _, attn_class, router_class = FAMILIES[family]
    model, probe = build(family, attn), probe_batch()
    caplog.set_level(logging.INFO, logger="foreshock")
    monitor, records = make_monitor(model, probe)
    try:
        # Discovery finds every attention layer and router, and says so.
        attention_names = names_of(model, attn_class)
        router_names = names_of(model, router_class) if router_class else []
        assert attention_names and [s.name for s in monitor.attention_sites] == attention_names
        assert {s.kind for s in monitor.attention_sites} == {"attention_interface"}
        assert [s.name for s in monitor.router_sites] == router_names
        config = model.config
        n_layers = config.num_hidden_layers
        moe_layers = tuple(int(n.split(".")[2]) for n in router_names)  # model.layers.<i>.
        assert monitor.model_info == ModelInfo(
            n_layers=n_layers, n_heads=4, head_dim=8, n_experts=4 if router_class else 0,
            top_k=2 if router_class else 0, moe_layers=moe_layers)
        found = [r.getMessage() for r in caplog.records if "discovery found" in r.getMessage()]
        assert len(found) == 1
        assert f"found {n_layers} attention layer(s): {attention_names[0]} (attention_interface)" \
            in found[0]
        assert f"and {len(router_names)} router(s)" in found[0]
        if router_names:
            assert f"{router_names[0]} (router)" in found[0]

        monitor.step(0)
        qk, routers = payloads(records, "qk"), payloads(records, "router")
        assert sorted(qk) == list(range(n_layers))
        assert sorted(routers) == list(moe_layers)
        attentions, router_logits = reference(model, probe, bool(router_class))
        for layer, sample in qk.items():
            # K with its own heads (Llama-style configs here have 2; the daemon
            # pairs query head h with K head h // (4 / kv_heads)).
            kv_heads = getattr(config, "num_key_value_heads", None) or 4
            assert list(sample.q.shape) == [4, BATCH * SEQ, 8]
            assert list(sample.k.shape) == [kv_heads, BATCH * SEQ, 8]
            assert sample.seq_len == SEQ and sample.causal
            log_probs = sent_log_probs(encoding.decode_tensor(sample.q),
                                       encoding.decode_tensor(sample.k), BATCH, SEQ)
            error = max_log_prob_error(log_probs, attentions[layer])
            assert error < 1e-4, f"layer {layer}: |log p_sent - log p_model| = {error}"
        for i, layer in enumerate(moe_layers):
            assert routers[layer].top_k == 2
            np.testing.assert_allclose(encoding.decode_tensor(routers[layer].logits),
                                       router_logits[i], rtol=1e-5, atol=1e-6)
        assert capture_warnings(caplog) == []
    finally:
        monitor.close(timeout=0.1)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "granitemoe",
                                    "gpt2_inverse_layer_scale"])
def test_the_comparison_rejects_projection_outputs(family):
    """The check above can fail: Q/K read from q_proj/k_proj (before rotary and
    q_norm/k_norm) or c_attn without the model's scale do not reproduce the
    model's attention."""
    model, probe = build(family, "eager"), probe_batch()
    attentions, _ = reference(model, probe, False)
    site_cls = FAMILIES[family][2]
    outputs, handles = {}, []

    def keep(layer, *parts):
        def hook(_module, _inputs, out):
            for part, width in parts:  # (name, (start, stop)) slices of the output
                outputs[(part, layer)] = out[..., width[0]:width[1]]
        return hook

    for i, name in enumerate(names_of(model, site_cls)):
        attn = model.get_submodule(name)
        if hasattr(attn, "q_proj"):
            handles.append(attn.q_proj.register_forward_hook(keep(i, ("q", (0, None)))))
            handles.append(attn.k_proj.register_forward_hook(keep(i, ("k", (0, None)))))
        else:  # c_attn: [Q | K | V], 32 features each
            handles.append(attn.c_attn.register_forward_hook(
                keep(i, ("q", (0, 32)), ("k", (32, 64)))))
    with torch.no_grad():
        model(probe)
    for h in handles:
        h.remove()
    errors = []
    for layer in range(len(attentions)):
        q = outputs[("q", layer)].reshape(BATCH, SEQ, 4, 8)
        k = outputs[("k", layer)].reshape(BATCH, SEQ, -1, 8).repeat_interleave(
            4 // outputs[("k", layer)].reshape(BATCH, SEQ, -1, 8).shape[2], dim=2)
        wire = [x.permute(2, 0, 1, 3).reshape(4, BATCH * SEQ, 8).numpy() for x in (q, k)]
        errors.append(max_log_prob_error(sent_log_probs(*wire, BATCH, SEQ), attentions[layer]))
    assert max(errors) > 1e-2, errors


def test_gpt2_eager_reorder_and_upcast_bypasses_the_interface_and_falls_back(caplog):
    """GPT-2's eager `reorder_and_upcast_attn` path skips the attention function:
    the first probe notices, says so, and reads c_attn (the same Q/K: no rotary),
    with the module's scale folded in."""
    model_cls, _, attn_class, _ = FAMILIES["gpt2"]
    config = _gpt2(reorder_and_upcast_attn=True, scale_attn_by_inverse_layer_idx=True)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model, probe = getattr(transformers, model_cls)(config).eval(), probe_batch()
    caplog.set_level(logging.INFO, logger="foreshock")
    monitor, records = make_monitor(model, probe)
    try:
        assert [s.kind for s in monitor.attention_sites] == ["attention_interface"] * 2
        monitor.step(0)
        monitor.step(1)
        assert [s.kind for s in monitor.attention_sites] == ["fused:c_attn"] * 2
        warnings = capture_warnings(caplog)
        assert len(warnings) == 2 and all("did not call transformers' attention interface" in w
                                          and "fused:c_attn" in w and "capture_qk" in w
                                          for w in warnings), warnings
        attentions, _ = reference(model, probe, False)
        for step in (0, 1):
            qk = {r.qk.layer: r.qk for r in records
                  if r.WhichOneof("payload") == "qk" and r.step == step}
            assert sorted(qk) == [0, 1]
            for layer, sample in qk.items():
                log_probs = sent_log_probs(encoding.decode_tensor(sample.q),
                                           encoding.decode_tensor(sample.k), BATCH, SEQ)
                assert max_log_prob_error(log_probs, attentions[layer]) < 1e-4
    finally:
        monitor.close(timeout=0.1)


def test_attention_discovery_cannot_read_is_named_with_the_fix(caplog):
    """Falcon's attention neither calls the attention interface nor has separate or
    [Q | K | V]-fused projections (its query_key_value interleaves heads)."""
    config = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(config).eval()
    caplog.set_level(logging.INFO, logger="foreshock")
    monitor, records = make_monitor(model, probe_batch())
    try:
        assert monitor.attention_sites == []
        (warning,) = capture_warnings(caplog)
        assert "transformer.h.0.self_attention (FalconAttention), " \
               "transformer.h.1.self_attention (FalconAttention) look like attention" in warning
        assert "call monitor.capture_qk(layer, q, k) from its forward, after rotary" in warning
        monitor.step(0)
        assert payloads(records, "qk") == {}
    finally:
        monitor.close(timeout=0.1)


def test_probe_leaves_the_model_and_transformers_as_they_were():
    model, probe = build("mixtral", "sdpa"), probe_batch()
    modeling = __import__(type(model).__module__, fromlist=["x"])
    interface, eager = modeling.ALL_ATTENTION_FUNCTIONS, modeling.eager_attention_forward
    with torch.no_grad():
        before = model(probe).logits
    monitor, _ = make_monitor(model, probe)
    try:
        monitor.step(0)
    finally:
        monitor.close(timeout=0.1)
    assert modeling.ALL_ATTENTION_FUNCTIONS is interface
    assert modeling.eager_attention_forward is eager
    assert all(not m._forward_hooks for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(probe).logits, before)


# -- end to end: a real daemon exports every layer --------------------------------------

@pytest.mark.parametrize("family", ["llama", "mixtral", "qwen3_moe", "olmoe", "qwen2_moe",
                                    "granitemoe", "gpt2"])
def test_every_layer_reaches_the_daemon(family, foreshockd):
    """Per-layer QK and router series for every layer; the daemon's attention
    entropy (from q·kᵀ/√d) is the model's own, also where the model's scale is
    not 1/√d (granitemoe)."""
    _, _, _, router_class = FAMILIES[family]
    model, probe = build(family, "sdpa"), probe_batch()
    run = f"hf-{family}"
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    monitor, sent = make_monitor(model, probe, endpoint=foreshockd.endpoint, run_id=run)
    try:
        model.train()
        for step in range(3):
            batch = probe_batch(seed=10 + step)
            loss = model(batch, labels=batch).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            monitor.step(step, loss=loss.item())  # probes at steps 0, 1, 2
    finally:
        monitor.close(timeout=10)
    stats = monitor.stats()
    assert stats["acked_records"] == len(sent) and stats["rejected"] == {}, stats
    # Grouped-query K went with its own heads; the daemon paired them (below).
    kv_heads = getattr(model.config, "num_key_value_heads", None) or 4
    assert {r.qk.k.shape[0] for r in sent if r.WhichOneof("payload") == "qk"} == {kv_heads}

    # The daemon's attention entropy is the model's own (last probe's weights).
    attentions, router_logits = reference(model.eval(), probe, bool(router_class))
    want_entropy = {}
    for layer, probs in enumerate(attentions):
        with np.errstate(divide="ignore", invalid="ignore"):
            plogp = np.where(probs > 0, probs * np.log(probs), 0.0)
        want_entropy[layer] = float((-plogp.sum(-1)).mean(axis=(0, 2)).min())  # min over heads
    moe_layers = monitor.model_info.moe_layers
    want_max_abs = {layer: float(np.abs(router_logits[i]).max())
                    for i, layer in enumerate(moe_layers)}

    def problems(samples):
        bad = []
        for name in ("qk_increment_entropy", "attention_max_logit"):
            got = prometheus.by_layer(samples, f"foreshock_{name}", run)
            bad += [f"{name}: no layer {i}" for i in range(len(attentions)) if i not in got]
        got = prometheus.by_layer(samples, "foreshock_attention_entropy", run)
        bad += [f"attention_entropy[{i}]: daemon {got.get(i)}, model {want:.6g}"
                for i, want in want_entropy.items()
                if got.get(i) is None or not math.isclose(got[i], want, rel_tol=1e-3)]
        for name in ("router_entropy", "router_flip_rate"):
            got = prometheus.by_layer(samples, f"foreshock_{name}", run)
            bad += [f"{name}: no layer {i}" for i in moe_layers if i not in got]
        got = prometheus.by_layer(samples, "foreshock_router_max_abs_logit", run)
        bad += [f"router_max_abs_logit[{i}]: daemon {got.get(i)}, model {want:.6g}"
                for i, want in want_max_abs.items()
                if got.get(i) is None or not math.isclose(got[i], want, rel_tol=1e-5)]
        return bad

    assert bool(moe_layers) == bool(router_class)
    samples, _ = foreshockd.wait_for(lambda s: not problems(s), timeout_s=30)
    assert not problems(samples), "\n".join(problems(samples)) + "\n" + foreshockd.log_tail()


# -- the attention output against its fp32 self (QKSample.output_check) -------------

def output_bias_ulps(check, unit=2.0 ** -8):
    """The daemon's attention_output_bias (detectors/qk_detector.cc) in bf16 unit roundoffs."""
    standard_error = check.rms_error / check.elements ** 0.5
    return max(0.0, abs(check.mean_signed_error) - 4 * standard_error) / check.mean_abs_reference / unit


def probe_checks(model, probe, **kwargs):
    monitor, records = make_monitor(model, probe, **kwargs)
    try:
        monitor.probe(0)
    finally:
        monitor.close(timeout=0)
    return payloads(records, "qk")


@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("family", ["llama", "gpt2_inverse_layer_scale", "granitemoe"])
def test_bf16_attention_is_checked_against_the_same_function_in_fp32(family, attn):
    """A bf16 model: every layer's output is compared with its attention function
    run again on fp32 inputs (the model's own mask and scale). Round-to-nearest
    bf16 errs (rms about a unit roundoff) without bias."""
    model, probe = build(family, attn).to(torch.bfloat16), probe_batch()
    qk = probe_checks(model, probe)
    assert sorted(qk) == list(range(model.config.num_hidden_layers))
    for layer, sample in qk.items():
        assert sample.attention_dtype == pb.BFLOAT16
        assert sample.HasField("output_check"), layer
        c = sample.output_check
        assert c.elements == BATCH * SEQ * 32  # heads x head_dim = hidden size
        rms_ulps = c.rms_error / c.mean_abs_reference / 2.0 ** -8
        assert 0.05 < rms_ulps < 5, (layer, rms_ulps)  # a real comparison, not itself
        assert output_bias_ulps(c) < 0.25, (layer, c)
    # fp32 attention has nothing to compare with itself; the check can be turned off.
    assert not any(s.HasField("output_check") for s in probe_checks(build(family, attn), probe).values())
    assert not any(s.HasField("output_check")
                   for s in probe_checks(model, probe, output_check=False).values())


def _register_attention(name, fn):
    from transformers import AttentionInterface
    AttentionInterface.register(name, fn)


def test_a_truncating_bf16_kernel_reads_as_rounding_bias(caplog):
    """An attention function that truncates its bf16 output toward zero (a
    biased kernel) is seen; one that refuses fp32 inputs is skipped with one
    warning, and the probe goes on."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def truncating(module, query, key, value, attention_mask, **kwargs):
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        if out.dtype == torch.bfloat16:  # exact bf16 -> float32 -> drop the low bits
            bits = out.float().view(torch.int32) & -65536
            out = (bits.view(torch.float32) * (1 - 2.0 ** -7)).to(torch.bfloat16)
        return out, weights

    def bf16_only(module, query, key, value, attention_mask, **kwargs):
        if query.dtype != torch.bfloat16:
            raise RuntimeError("this kernel supports bf16 only")
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    _register_attention("foreshock_test_truncating", truncating)
    _register_attention("foreshock_test_bf16_only", bf16_only)
    probe = probe_batch()
    model = build("llama", "sdpa").to(torch.bfloat16)
    model.set_attn_implementation("foreshock_test_truncating")
    qk = probe_checks(model, probe)
    assert len(qk) == 2
    for layer, sample in qk.items():
        assert output_bias_ulps(sample.output_check) > 0.25, (layer, sample.output_check)

    caplog.set_level(logging.INFO, logger="foreshock")
    model.set_attn_implementation("foreshock_test_bf16_only")
    qk = probe_checks(model, probe)
    assert sorted(qk) == [0, 1]  # Q/K still sampled
    assert not any(s.HasField("output_check") for s in qk.values())
    warnings = [w for w in capture_warnings(caplog) if "fp32 reference" in w]
    assert len(warnings) == 2 and "bf16 only" in warnings[0], warnings  # once per layer
