"""The curvature estimator under torch 2.x: torch.func products against a dense
float64 Hessian of a tiny HF Llama (raw and Adam-preconditioned), the choice
and fallbacks of "auto", convergence on HF GPT-2 (SDPA attention), and
bit-identical training with and without the estimator."""
import copy
import logging
import os

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from foreshock.curvature import (CurvatureEstimator, _lanczos,  # noqa: E402
                                 _optimizer_preconditioner)


def lm_loss(model, batch):
    return model(input_ids=batch, labels=batch).loss


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=16,
                                      max_position_embeddings=16)
    return transformers.LlamaForCausalLM(config)


def tiny_gpt2(seed=0, dropout=0.1):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def dense_hessian(model, loss_fn, batch):
    """float64 Hessian of the loss in the parameters (torch.autograd.functional.hessian
    of a float64 copy; reverse-over-reverse, independent of torch.func's jvp)."""
    model64 = copy.deepcopy(model).double().eval()
    names = [n for n, p in model64.named_parameters() if p.requires_grad]
    shapes = [p.shape for _, p in model64.named_parameters() if p.requires_grad]
    sizes = [s.numel() for s in shapes]
    flat = torch.cat([p.detach().reshape(-1) for p in model64.parameters() if p.requires_grad])
    bound = _Bound(model64, batch, loss_fn)

    def loss_flat(x):
        parts = (c.reshape(s) for c, s in zip(x.split(sizes), shapes))
        return torch.func.functional_call(bound, {"model." + n: t for n, t in zip(names, parts)}, ())

    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.MATH]):
        h = torch.autograd.functional.hessian(loss_flat, flat)
    return h.numpy()


class _Bound(nn.Module):
    def __init__(self, model, batch, loss_fn):
        super().__init__()
        self.model, self.batch, self.loss_fn = model, batch, loss_fn

    def forward(self):
        return self.loss_fn(self.model, self.batch)


def numpy_preconditioner(optimizer, params):
    """P^{-1/2} = 1 / sqrt(sqrt(v_hat) + eps), from AdamW's state, in numpy."""
    group = optimizer.param_groups[0]
    beta2, eps = group["betas"][1], group["eps"]
    parts = []
    for p in params:
        state = optimizer.state[p]
        v_hat = state["exp_avg_sq"].double().numpy().reshape(-1) / (1 - beta2 ** float(state["step"]))
        parts.append(1.0 / np.sqrt(np.sqrt(v_hat) + eps))
    return np.concatenate(parts)


def flat(xs):
    return torch.cat([x.detach().double().reshape(-1) for x in xs]).numpy()


@pytest.fixture(scope="module")
def trained_llama():
    model = tiny_llama()
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 16, (16, 12), generator=g)
    probe = torch.randint(0, 16, (2, 12), generator=g)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(15):
        loss = lm_loss(model, data[(2 * step) % 16:(2 * step) % 16 + 2])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, probe, optimizer, dense_hessian(model, lm_loss, probe)


@pytest.mark.parametrize("hvp_mode", ["func", "double_backward", "auto"])
@pytest.mark.parametrize("preconditioned", [False, True])
def test_top_eigenvalue_matches_dense_float64_hessian(trained_llama, hvp_mode, preconditioned):
    model, probe, optimizer, h = trained_llama
    opt = optimizer if preconditioned else None
    estimator = CurvatureEstimator(model, lm_loss, probe, opt, hvps=3, max_hvps=150, tol=1e-5,
                                   hvp_mode=hvp_mode)
    if preconditioned:
        s = numpy_preconditioner(optimizer, estimator.params)
        h = s[:, None] * h * s[None, :]
    exact = np.linalg.eigvalsh(0.5 * (h + h.T))
    estimate = estimator.estimate()
    assert estimate.preconditioned == preconditioned
    assert estimate.hvp_mode in (("func", "double_backward") if hvp_mode == "auto" else (hvp_mode,))
    assert estimate.residual <= 1e-4
    # The algebraically largest eigenvalue, even where the spectrum reaches further below 0.
    assert estimate.lambda_max == pytest.approx(exact[-1], rel=1e-3)
    # One product, against the dense matrix.
    v = [torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) for p in estimator.params]
    scales, _, _ = _optimizer_preconditioner(opt, estimator.params)
    with estimator._products():
        av = estimator._apply(v, scales)
    np.testing.assert_allclose(flat(av), h @ flat(v), rtol=0, atol=1e-4 * np.abs(h @ flat(v)).max())


def test_func_and_double_backward_products_agree_on_gpt2_with_sdpa():
    model = tiny_gpt2()
    assert model.config._attn_implementation == "sdpa"  # fused CPU kernel: no 2nd derivative
    probe = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    func = CurvatureEstimator(model, lm_loss, probe, hvp_mode="func")
    double = CurvatureEstimator(model, lm_loss, probe, hvp_mode="double_backward")
    v = [torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) for p in func.params]
    with func._products():
        a = flat(func._apply(v, None))
    with double._products():
        b = flat(double._apply(v, None))
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * np.abs(b).max())
    # The tied embedding is one parameter (lm_head.weight is transformer.wte.weight).
    assert sum(p.numel() for p in func.params) == sum(p.numel() for p in model.parameters())


def test_auto_says_once_why_it_chose(caplog):
    model, probe = tiny_gpt2(), torch.randint(0, 64, (2, 16))
    estimator = CurvatureEstimator(model, lm_loss, probe, hvps=3)
    with caplog.at_level(logging.INFO, logger="foreshock"):
        for _ in range(3):
            estimator.estimate()
    lines = [r.getMessage() for r in caplog.records if "curvature HVPs by" in r.getMessage()]
    assert len(lines) == 1, lines
    assert estimator.hvp_mode in ("func", "double_backward")  # not finite differences
    assert "faster on this model" in lines[0] and "ms by torch.func" in lines[0]


class OldStyleTanh(torch.autograd.Function):
    """Differentiable backward (double backward works) but no setup_context/jvp:
    torch.func transforms refuse it."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)


class OldStyleNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.down(OldStyleTanh.apply(self.up(x)))


def test_auto_falls_back_to_double_backward_where_torch_func_fails(caplog):
    model = OldStyleNet()
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    batch = (x, torch.arange(32) % 3)

    def loss_fn(m, b):
        return F.cross_entropy(m(b[0]), b[1])

    with pytest.raises(RuntimeError, match="setup_context"):
        CurvatureEstimator(model, loss_fn, batch, hvp_mode="func").estimate()
    estimator = CurvatureEstimator(model, loss_fn, batch, hvps=10)
    with caplog.at_level(logging.INFO, logger="foreshock"):
        estimate = estimator.estimate()
    assert estimate.hvp_mode == "double_backward"
    assert "torch.func failed on this model (RuntimeError" in estimator.hvp_choice
    assert any("torch.func failed" in r.getMessage() for r in caplog.records)


def test_gpt2_estimates_converge():
    """The GPT-2 report: with 3 products per estimate the residual stayed far above
    the daemon's bound (0.1). Two causes: SDPA's fused CPU kernel has no double
    backward, so "auto" fell back to finite differences; and, mainly, 3 products
    do not converge once the top eigenvector has turned between estimates. Now
    products use SDPA's math backend and Lanczos runs on while the residual is
    above tol (up to max_hvps)."""
    def run(**kw):
        model = tiny_gpt2(dropout=0.1)
        g = torch.Generator().manual_seed(1)
        data = torch.randint(0, 64, (32, 16), generator=g)
        probe = torch.randint(0, 64, (2, 16), generator=g)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        estimator = CurvatureEstimator(model, lm_loss, probe, optimizer, every=10, **kw)
        torch.manual_seed(2)
        out = []
        for step in range(41):
            loss = lm_loss(model, data[torch.randint(0, 32, (4,))])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if estimator.due(step):
                e = estimator.estimate()
                scales, _, _ = _optimizer_preconditioner(optimizer, estimator.params)
                with estimator._products():  # reference: 60 cold Lanczos steps
                    start = [torch.randn(p.shape, generator=torch.Generator().manual_seed(5))
                             for p in estimator.params]
                    ref, ref_res, _, _ = _lanczos(lambda v: estimator._apply(v, scales), start, 60)
                assert ref_res < 1e-3
                out.append((e, ref))
        return estimator, out

    fixed_estimator, fixed = run(hvps=3, max_hvps=3)
    estimator, adaptive = run(hvps=3, max_hvps=9)  # tol=0.05 (default)
    assert estimator.hvp_mode != "finite_difference"
    assert sum(e.residual > 0.1 for e, _ in fixed) >= 3, [e.residual for e, _ in fixed]
    for e, ref in adaptive:
        assert e.residual <= 0.1 and 3 <= e.hvps <= 9, (e.residual, e.hvps)
        assert e.lambda_max == pytest.approx(ref, rel=0.05)


def _train(model_fn, mode, steps=8, every=3):
    model = model_fn()
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 64, (32, 16), generator=g)
    probe = torch.randint(0, 64, (2, 16), generator=g)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    estimator = CurvatureEstimator(model, lm_loss, probe, optimizer, every=every,
                                   hvp_mode=mode or "auto")
    torch.manual_seed(7)  # the training RNG stream: dropout, batch order
    for step in range(steps):
        loss = lm_loss(model, data[torch.randint(0, 32, (4,))])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if mode and estimator.due(step):
            estimator.estimate()
    return model, optimizer, torch.get_rng_state()


@pytest.mark.parametrize("mode", ["auto", "func", "double_backward", "finite_difference"])
def test_training_is_bit_identical_with_and_without_the_estimator(mode):
    plain, plain_opt, plain_rng = _train(tiny_gpt2, None)
    watched, watched_opt, watched_rng = _train(tiny_gpt2, mode)
    assert torch.equal(plain_rng, watched_rng)
    assert watched.training
    for (name, a), b in zip(plain.state_dict().items(), watched.state_dict().values()):
        assert torch.equal(a, b), name
    for (name, a), b in zip(plain.named_parameters(), watched.parameters()):
        assert torch.equal(a.grad, b.grad), name
    for a, b in zip(plain_opt.state.values(), watched_opt.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"])
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
