"""The demo model: attention math, the low-precision fault's backward, MoE routing,
the LR schedule with faults, and the data."""
import argparse

import pytest
import torch

from demo import tiny_moe_gpt as tmg
from demo import train


def plain_attention(q, k, v):
    t = q.shape[-2]
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    s = s + torch.full((t, t), float("-inf")).triu(1)
    return torch.softmax(s, -1) @ v


def qkv(seed=0, shape=(2, 3, 9, 8), dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]


def grads(fn, tensors, d_o):
    for t in tensors:
        t.grad = None
    fn(*tensors).backward(d_o)
    return [t.grad.clone() for t in tensors]


def test_truncate_bf16_rounds_toward_zero_to_bf16_values():
    x = torch.randn(10000) * torch.logspace(-30, 30, 10000)
    t = tmg.truncate_bf16(x)
    assert torch.equal(t, t.to(torch.bfloat16).float())  # representable in bf16
    assert torch.all(t.abs() <= x.abs()) and torch.all((t == 0) | (t.sign() == x.sign()))
    # The truncation is torch's round-to-nearest bf16, or its neighbour toward zero.
    nearest = x.to(torch.bfloat16).float()
    below = torch.where(nearest.abs() > x.abs(),
                        tmg.truncate_bf16(torch.nextafter(nearest, torch.zeros_like(nearest))),
                        nearest)
    assert torch.equal(t, below)
    assert torch.equal(tmg.biased_lowprec(x, 1.0), t)
    assert torch.equal(tmg.biased_lowprec(x, 0.0), x)
    # The strength multiplies the bias: x - 4 (x - t).
    assert torch.allclose(tmg.biased_lowprec(x, 4.0), x - 4 * (x - t))


def test_lowprec_function_at_strength_zero_is_exact_attention_with_gradients():
    q, k, v = qkv(dtype=torch.float64)
    d_o = torch.randn(q.shape, dtype=torch.float64)
    expected = grads(plain_attention, [q, k, v], d_o)
    lowprec = grads(lambda a, b, c: tmg.LowPrecisionAttention.apply(a, b, c, 0.0, True, True),
                    [q, k, v], d_o)
    for e, g in zip(expected, lowprec):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda a, b, c: tmg.LowPrecisionAttention.apply(a, b, c, 0.0, True, True), (q, k, v))


def test_lowprec_backward_takes_d_from_the_low_precision_output():
    """FlashAttention's D = rowsum(dO*O_lp) differs from the exact rowsum(dO*O) by
    delta; the gradient error is then diag(delta) P K * scale for dQ and 0 for dV."""
    q, k, v = qkv(seed=1)
    d_o = torch.randn(q.shape)
    strength = 50.0
    on_out = lambda a, b, c: tmg.LowPrecisionAttention.apply(a, b, c, strength, False, True)  # noqa: E731
    # Straight-through reference: same forward values, exact gradients.
    straight = lambda a, b, c: (lambda o: o + (tmg.biased_lowprec(o, strength) - o).detach())(  # noqa: E731
        plain_attention(a, b, c))
    with torch.no_grad():
        # The same ops without the fault: truncation is discontinuous, so the
        # comparison needs bitwise-equal inputs.
        o_exact = tmg.LowPrecisionAttention.apply(q, k, v, 0.0, False, False)
        o_lp = on_out(q, k, v)
        assert torch.equal(o_lp, tmg.biased_lowprec(o_exact, strength))
        assert not torch.equal(o_lp, o_exact)
    dq, dk, dv = grads(on_out, [q, k, v], d_o)
    dq_ref, dk_ref, dv_ref = grads(straight, [q, k, v], d_o)
    torch.testing.assert_close(dv, dv_ref)
    with torch.no_grad():
        t = q.shape[-2]
        s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        p = torch.softmax(s + torch.full((t, t), float("-inf")).triu(1), -1)
        delta = (d_o * (o_exact - o_lp)).sum(-1, keepdim=True)
        scale = q.shape[-1] ** -0.5
        torch.testing.assert_close(dq - dq_ref, (delta * p) @ k * scale, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(dk - dk_ref, (delta * p).transpose(-2, -1) @ q * scale,
                                   rtol=1e-4, atol=1e-6)
        assert (dq - dq_ref).abs().max() > 1e-4  # the fault does change the gradient


def test_lowprec_on_probs_feeds_truncated_p_to_the_pv_product():
    q, k, v = qkv(seed=2)
    with torch.no_grad():
        t = q.shape[-2]
        p = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
                          + torch.full((t, t), float("-inf")).triu(1), -1)
        expected = tmg.biased_lowprec(p, 20.0) @ v
        got = tmg.causal_attention(q, k, v, 20.0, on_probs=True, on_out=False)
    torch.testing.assert_close(got, expected)


def test_model_set_lowprec_reaches_the_chosen_layers():
    torch.manual_seed(0)
    model = tmg.TinyMoEGPT(tmg.GPTConfig(vocab_size=30))
    idx = torch.randint(0, 30, (2, 64))
    with torch.no_grad():
        clean = model(idx)
        model.set_lowprec(64.0, layers={2})
        assert [b.attn.lowprec_strength for b in model.blocks] == [0, 0, 64.0, 0]
        faulty = model(idx)
        model.set_lowprec(0.0)
        assert torch.equal(model(idx), clean)
    assert not torch.allclose(faulty, clean)


def test_moe_routes_each_token_to_its_top_k_experts():
    torch.manual_seed(0)
    cfg = tmg.GPTConfig(vocab_size=30)
    moe = tmg.MoEFeedForward(cfg, layer_idx=1)
    x = torch.randn(3, 5, cfg.d_model)
    with torch.no_grad():
        out = moe(x).reshape(-1, cfg.d_model)
        flat = x.reshape(-1, cfg.d_model)
        probs = torch.softmax(moe.router(flat), -1)
        for i in range(flat.shape[0]):
            top = probs[i].topk(2)
            w = top.values / top.values.sum()
            expected = sum(w[j] * moe.experts[int(e)](flat[i]) for j, e in enumerate(top.indices))
            torch.testing.assert_close(out[i], expected, rtol=1e-5, atol=1e-6)
    assert moe.aux_loss.item() >= 1.0 - 1e-6  # E * sum f_e P_e >= 1, equality when uniform


def test_lr_schedule_warmup_faults_and_decay():
    args = argparse.Namespace(lr=1e-3, warmup=10, fault="none", fault_step=50, lr_factor=8.0,
                              lr_ramp_steps=0, lr_decay_step=None, lr_decay_factor=0.5)
    assert train.lr_at(0, args) == pytest.approx(1e-4)
    assert train.lr_at(60, args) == pytest.approx(1e-3)
    args.fault = "lr"
    assert train.lr_at(49, args) == pytest.approx(1e-3)
    assert train.lr_at(50, args) == pytest.approx(8e-3)
    args.lr_ramp_steps = 3  # geometric: x2 per step up to x8
    assert [train.lr_at(s, args) / 1e-3 for s in (50, 51, 52, 60)] == \
        pytest.approx([2.0, 4.0, 8.0, 8.0])
    args.fault, args.lr_decay_step = "none", 70
    assert train.lr_at(70, args) == pytest.approx(5e-4)


def test_lr_faults_the_reported_lr_cannot_show_and_benign_raises():
    args = argparse.Namespace(lr=1e-3, warmup=10, fault="lr_hidden", fault_step=50, lr_factor=8.0,
                              lr_ramp_steps=0, lr_decay_step=None, lr_decay_factor=0.5)
    # A multiplier bug: the optimizer gets 8x, the job reports the schedule.
    assert train.lr_at(60, args) == pytest.approx(1e-3)
    assert train.lr_at(60, args, applied=True) == pytest.approx(8e-3)
    assert train.lr_at(49, args, applied=True) == pytest.approx(1e-3)
    # The peak set too high from the start: the warm-up climbs to 8x, reported as applied.
    args.fault = "lr_peak"
    assert train.lr_at(0, args) == pytest.approx(8e-4)
    assert train.lr_at(9, args) == train.lr_at(9, args, applied=True) == pytest.approx(8e-3)
    # Benign: a re-warm to twice the peak, and a planned raise, held.
    args.fault = "none"
    args.lr_restart_step, args.lr_restart_warmup, args.lr_restart_peak_factor = 100, 10, 2.0
    assert train.lr_at(100, args) == pytest.approx(2e-4)
    assert train.lr_at(120, args) == pytest.approx(2e-3)
    args.lr_restart_step, args.lr_raise_step, args.lr_raise_factor = None, 80, 3.0
    assert train.lr_at(79, args) == pytest.approx(1e-3)
    assert train.lr_at(90, args) == pytest.approx(3e-3)


def test_data_vocab_covers_both_texts_and_the_probe_is_fixed():
    texts = {name: tmg.load_text(name) for name in tmg.CORPORA}
    assert all(len(t) > 10000 for t in texts.values())
    vocab = tmg.CharVocab(texts.values())
    data = tmg.CharDataset(vocab.encode(texts["gnu"]), 64)
    assert vocab.decode(data.train_ids[:200].tolist()) == texts["gnu"][:200]
    probe = data.probe_batch(4)
    assert probe.shape == (4, 64) and torch.equal(probe, data.probe_batch(4))
    assert len({tuple(row.tolist()) for row in probe}) == 4
    x, y = data.batch(8, torch.Generator().manual_seed(0))
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_short_training_lowers_the_loss():
    args = train.parse_args(["--endpoint", "", "--steps", "60", "--log-every", "0",
                             "--warmup", "10"])
    result = train.run(args, out=lambda *_: None)
    losses = result["losses"]
    assert sum(losses[-10:]) / 10 < losses[0] - 1.0


def test_weight_qk_view_hands_over_each_heads_bilinear_form_and_its_spectrum():
    # GQA (4 query heads, 2 K heads): head h's logits are x W_Q^hT W_K^g x^T with
    # g = h // 2, so its Q K^T from the view must be that d_model x d_model form,
    # and the logged singular values those of a dense SVD of it.
    import io
    import json
    import numpy as np
    torch.manual_seed(0)
    cfg = tmg.GPTConfig(vocab_size=30, n_layer=2, d_model=48, n_head=4, n_kv_head=2,
                        block_size=16, mlp_hidden=64, expert_hidden=32, moe_layers=())
    model = tmg.TinyMoEGPT(cfg)
    log = io.StringIO()
    view = train.WeightQKView(model, log)
    seen = []
    view.hook = lambda layer, q, k: seen.append((layer, q, k))
    view.step = 7
    view(torch.zeros(1, dtype=torch.long))
    assert [layer for layer, _, _ in seen] == [0, 1]
    row = json.loads(log.getvalue())
    assert row["step"] == 7
    hd = 12
    for layer, q, k in seen:
        assert q.shape == (1, 4, 48, hd) and k.shape == (1, 2, 48, hd)
        weight = model.blocks[layer].attn.qkv.weight.detach().double().numpy()
        x = np.random.default_rng(layer).standard_normal((5, 48))
        for h in range(4):
            w_q, w_k = weight[h * hd:(h + 1) * hd], weight[48 + (h // 2) * hd:48 + (h // 2 + 1) * hd]
            form = w_q.T @ w_k
            got = q[0, h].double().numpy() @ k[0, h // 2].double().numpy().T
            np.testing.assert_allclose(got, form, rtol=1e-5, atol=1e-7)
            # The same logits as the layer computes from x (before the 1/sqrt(d) scale).
            np.testing.assert_allclose(x @ got @ x.T, (x @ w_q.T) @ (x @ w_k.T).T, rtol=1e-5,
                                       atol=1e-6)
            dense = np.linalg.svd(form, compute_uv=False)[:hd]
            np.testing.assert_allclose(row["singular_values"][layer][h], dense,
                                       rtol=1e-9, atol=1e-12 * dense[0])


def test_qk_norm_normalizes_each_heads_q_and_k_before_the_logits():
    # The natural-instability benchmark's mitigation (issue 33): LayerNorm over
    # each head's q and k, applied before the capture point, so the monitor sees
    # what attention uses.
    torch.manual_seed(0)
    cfg = tmg.GPTConfig(vocab_size=17, block_size=8, n_layer=1, d_model=16, n_head=2,
                        moe_layers=(), qk_norm=True)
    model = tmg.TinyMoEGPT(cfg)
    seen = {}
    model.set_qk_hook(lambda layer, q, k: seen.update(q=q.detach(), k=k.detach()))
    with torch.no_grad():
        model.blocks[0].attn.qkv.weight.mul_(50.0)  # huge raw projections
        model(torch.randint(0, 17, (3, 8)))
    for t in (seen["q"], seen["k"]):
        assert t.shape == (3, 2, 8, 8)
        assert torch.allclose(t.mean(-1), torch.zeros(()), atol=1e-4)
        assert torch.allclose(t.var(-1, unbiased=False), torch.ones(()), atol=1e-2)
    plain = tmg.TinyMoEGPT(tmg.GPTConfig(vocab_size=17, block_size=8, n_layer=1, d_model=16,
                                         n_head=2, moe_layers=()))
    assert plain.blocks[0].attn.q_norm is None


def test_training_loss_adds_the_z_loss_and_the_balance_loss_as_flagged():
    torch.manual_seed(0)
    cfg = tmg.GPTConfig(vocab_size=11, block_size=8, n_layer=2, d_model=16, n_head=2,
                        moe_layers=(1,))
    model = tmg.TinyMoEGPT(cfg)
    x = torch.randint(0, 11, (2, 8))
    logits = model(x)
    y = torch.randint(0, 11, (2, 8))
    base = train.parse_args(["--endpoint", ""])
    ce, loss = train.training_loss(base, model, logits, y)
    assert torch.allclose(loss, ce + 0.01 * model.moe_aux_loss())
    z = train.parse_args(["--endpoint", "", "--z-loss", "1e-3", "--no-balance-loss"])
    ce2, loss2 = train.training_loss(z, model, logits, y)
    lse = torch.logsumexp(logits, dim=-1)
    assert torch.allclose(ce2, ce)
    assert torch.allclose(loss2, ce + 1e-3 * (lse ** 2).mean())
