"""The curvature estimator against an exact Hessian on a tiny model, its
warm-start advantage, its HVP fallbacks, and the guarantee that it never
changes training."""
import torch
import torch.nn as nn
import torch.nn.functional as F
import pytest

from foreshock.curvature import (CurvatureEstimator, _dot, _lanczos, _optimizer_preconditioner,
                                 block_index_of, exact_preconditioned_top_eigenvalue,
                                 hvps_to_tolerance)


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.ln(x))))


class TinyNet(nn.Module):
    """~500 parameters in residual blocks: small enough to form the Hessian."""

    def __init__(self, vocab=12, d=6, hidden=12, n_blocks=2, dropout=0.0):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, hidden) for _ in range(n_blocks))
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        x = self.emb(x)
        for block in self.blocks:
            x = self.drop(block(x))
        return self.head(x)


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def make_task(seed=0, **kw):
    torch.manual_seed(seed)
    model = TinyNet(**kw)
    x = torch.randint(0, 12, (64,))
    return model, (x, (5 * x + 3) % 12)


def train_step(model, optimizer, batch):
    loss = loss_fn(model, batch)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def power_iteration_hvps(estimator, exact, rel_tol=0.01, max_hvps=500):
    """HVPs cold power iteration needs to get within rel_tol (the classic baseline)."""
    scales, _, _ = _optimizer_preconditioner(estimator.optimizer, estimator.params)
    g = torch.Generator().manual_seed(7)
    v = [torch.randn(p.shape, generator=g) for p in estimator.params]
    for n in range(1, max_hvps + 1):
        norm = torch.sqrt(_dot(v, v))
        v = [x / norm for x in v]
        av = estimator._apply(v, scales)
        if abs(float(_dot(v, av)) - exact) <= rel_tol * abs(exact):
            return n
        v = av
    return max_hvps + 1


def test_warm_started_tracking_matches_exact_preconditioned_eigenvalue():
    model, batch = make_task()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(20):  # Adam's second moments settle before tracking starts
        train_step(model, optimizer, batch)
    # A fixed budget of 3 products (max_hvps=3): what the warm start alone achieves.
    estimator = CurvatureEstimator(model, loss_fn, batch, optimizer, every=1, hvps=3, max_hvps=3)
    errors, counts = [], []
    for step in range(50):
        train_step(model, optimizer, batch)
        estimate = estimator.estimate()
        assert estimate.preconditioned and estimate.hvps == 3
        exact = exact_preconditioned_top_eigenvalue(model, loss_fn, batch, optimizer)
        errors.append(abs(estimate.lambda_max - exact) / abs(exact))
        if step in (10, 30, 49):
            counts.append((hvps_to_tolerance(estimator, exact, warm=True),
                           hvps_to_tolerance(estimator, exact, warm=False),
                           power_iteration_hvps(estimator, exact)))
    late = errors[5:]
    assert max(late) <= 0.02, [round(e, 4) for e in errors]
    # HVPs to 1% from the warm vector vs from a random one (Lanczos, and the
    # classic power iteration). At this scale the spectral gap is large, so a
    # cold start is cheap too; docs/PERFORMANCE.md reports the measured counts.
    for warm, cold_lanczos, cold_power in counts:
        assert warm is not None and cold_lanczos is not None
        assert warm < cold_lanczos and warm < cold_power, counts
    print("warm/cold-lanczos/cold-power HVPs to 1%:", counts)


class Quadratic(nn.Module):
    """loss = 0.5 theta^T H theta with H = diag(h)."""

    def __init__(self, h):
        super().__init__()
        self.h = torch.tensor(h)
        self.theta = nn.Parameter(torch.ones(len(h)))

    def forward(self):
        return 0.5 * (self.h * self.theta * self.theta).sum()


def test_largest_ritz_value_not_largest_magnitude():
    # H = diag(-10, 1, 2): power iteration finds -10; the top of the spectrum is 2.
    model = Quadratic([-10.0, 1.0, 2.0])
    estimator = CurvatureEstimator(model, lambda m, _: m(), None, hvps=3)
    estimate = estimator.estimate()
    assert estimate.lambda_max == pytest.approx(2.0, rel=1e-5)
    assert not estimate.preconditioned and estimate.lr == 0.0
    assert estimate.residual < 1e-4


def test_block_contributions_add_up_to_the_rayleigh_quotient():
    model, batch = make_task()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(5):
        train_step(model, optimizer, batch)
    estimator = CurvatureEstimator(model, loss_fn, batch, optimizer, hvps=20)
    estimate = estimator.estimate()
    assert not estimate.preconditioned and estimate.beta1 == 0.9 and estimate.lr == 0.1
    assert len(estimate.layer_rayleigh) == 2
    # Recompute v^T A v per parameter directly with one more HVP.
    v = estimator._vector
    av = estimator._apply(v, None)
    per_block = [0.0, 0.0]
    outside = 0.0
    for block, x, ax in zip(estimator.blocks, v, av):
        if block is None:
            outside += float((x * ax).sum())
        else:
            per_block[block] += float((x * ax).sum())
    assert estimate.layer_rayleigh == pytest.approx(per_block, rel=1e-3, abs=1e-5)
    assert sum(per_block) + outside == pytest.approx(estimate.lambda_max, rel=1e-3)


def test_block_index_from_parameter_names():
    assert block_index_of("blocks.3.attn.qkv.weight") == 3
    assert block_index_of("model.layers.11.mlp.up_proj.weight") == 11
    assert block_index_of("transformer.h.0.ln_1.weight") == 0
    assert block_index_of("tok_emb.weight") is None
    assert block_index_of("lm_head.weight") is None


class NoDoubleBackwardTanh(torch.autograd.Function):
    """A custom op with a first derivative only (like many fused kernels)."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)


class CustomOpNet(TinyNet):
    def forward(self, x):
        x = self.emb(x)
        for block in self.blocks:
            x = x + block.down(NoDoubleBackwardTanh.apply(block.up(block.ln(x))))
        return self.head(x)


def test_finite_difference_fallback_for_ops_without_double_backward():
    torch.manual_seed(0)
    reference = TinyNet()
    custom = CustomOpNet()
    custom.load_state_dict(reference.state_dict())
    x = torch.randint(0, 12, (64,))
    batch = (x, (5 * x + 3) % 12)
    exact = CurvatureEstimator(reference, loss_fn, batch, hvps=12, hvp_mode="double_backward")
    auto = CurvatureEstimator(custom, loss_fn, batch, hvps=12, hvp_mode="auto")
    forced = CurvatureEstimator(custom, loss_fn, batch, hvps=12, hvp_mode="double_backward")
    a, b, c = exact.estimate(), auto.estimate(), forced.estimate()
    # once_differentiable silently drops the op's second-order term: forced
    # double backward is wrong, and auto notices and uses finite differences.
    assert abs(c.lambda_max - a.lambda_max) > 0.05 * a.lambda_max
    assert b.hvp_mode == "finite_difference" and a.hvp_mode == "double_backward"
    assert b.lambda_max == pytest.approx(a.lambda_max, rel=1e-2)
    # On a model whose ops all support double backward, auto keeps an exact method
    # (torch.func instead where it exists and was faster).
    plain_auto = CurvatureEstimator(reference, loss_fn, batch, hvps=12, hvp_mode="auto")
    assert plain_auto.estimate().hvp_mode in ("double_backward", "func")
    assert "finite difference" in auto.hvp_choice and plain_auto.hvp_choice


def _train(seed, estimate_every, hvp_mode="double_backward", steps=12, dropout=0.1):
    model, batch = make_task(seed, dropout=dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    estimator = CurvatureEstimator(model, loss_fn, batch, optimizer, every=estimate_every or 1,
                                   hvps=3, hvp_mode=hvp_mode)
    torch.manual_seed(seed + 1)  # the training RNG stream (dropout, data order)
    for step in range(steps):
        idx = torch.randint(0, 64, (32,))
        train_step(model, optimizer, (batch[0][idx], batch[1][idx]))
        if estimate_every and estimator.due(step):
            estimator.estimate()
    return model, optimizer


HAS_FUNC = hasattr(torch, "func")
MODES = ["auto", "double_backward", "finite_difference"] + (["func"] if HAS_FUNC else [])


@pytest.mark.parametrize("hvp_mode", MODES)
def test_estimator_never_changes_training(hvp_mode):
    plain, plain_opt = _train(3, None)
    watched, watched_opt = _train(3, 2, hvp_mode)
    for (name, a), b in zip(plain.named_parameters(), watched.parameters()):
        assert torch.equal(a, b), f"{name} differs"
        assert torch.equal(a.grad, b.grad), f"{name}.grad differs"
    for a, b in zip(plain_opt.state.values(), watched_opt.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def test_a_failing_estimate_never_reaches_the_training_loop():
    from foreshock import Monitor
    model, batch = make_task()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    estimator = CurvatureEstimator(model, loss_fn, batch, optimizer, every=1)
    with pytest.raises(FloatingPointError):  # the estimator itself says why
        with torch.no_grad():
            model.head.weight[0, 0] = float("nan")
        estimator.estimate()
    # Nothing listens on port 1: the monitor keeps its records queued.
    monitor = Monitor("127.0.0.1:1", run_id="r", job="j", curvature=estimator)
    try:
        monitor.step(0, loss=1.0)  # must not raise
        assert monitor.stats()["curvature_failures"] == 1
        assert monitor.stats()["curvature_estimates"] == 0
    finally:
        monitor.close(timeout=0.5)


def test_budget_grows_until_the_residual_is_small():
    model, batch = make_task(n_blocks=3)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(20):
        train_step(model, optimizer, batch)
    exact = exact_preconditioned_top_eigenvalue(model, loss_fn, batch, optimizer)
    fixed = CurvatureEstimator(model, loss_fn, batch, optimizer, hvps=2, max_hvps=2)
    adaptive = CurvatureEstimator(model, loss_fn, batch, optimizer, hvps=2, max_hvps=40, tol=1e-3)
    a, b = fixed.estimate(), adaptive.estimate()
    assert a.hvps == 2 and a.residual > 1e-3  # a cold start is far from converged after 2
    assert 2 < b.hvps < 40 and b.residual <= 1e-3
    assert b.lambda_max == pytest.approx(exact, rel=1e-3)
    assert adaptive.hvps_total == b.hvps
    # The reported residual is ||A v - lambda v|| / |lambda|, checked with one more product.
    scales, _, _ = _optimizer_preconditioner(optimizer, adaptive.params)
    v = adaptive._vector
    with adaptive._products():
        av = adaptive._apply(v, scales)
    r = torch.sqrt(sum(((x - b.lambda_max * y) ** 2).sum() for x, y in zip(av, v)))
    assert float(r) / b.lambda_max == pytest.approx(b.residual, rel=0.05, abs=1e-5)


class BNNet(TinyNet):
    """Batch norm (running statistics) and dropout between the blocks."""

    def __init__(self):
        super().__init__(dropout=0.2)
        self.norm = nn.BatchNorm1d(6)

    def forward(self, x):
        h = self.blocks[1](self.blocks[0](self.emb(x)))
        return self.head(self.drop(self.norm(h)))


def test_rng_buffers_and_dropout_untouched_even_by_a_random_loss_fn():
    def noisy_loss(model, batch):  # draws from the global RNG, as label smoothing might
        x, y = batch
        return F.cross_entropy(model(x), y) + 1e-3 * torch.rand(()).item()

    def run(estimate):
        torch.manual_seed(4)
        model = BNNet()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randint(0, 12, (64,))
        batch = (x, (5 * x + 3) % 12)
        estimator = CurvatureEstimator(model, noisy_loss, batch, optimizer, hvps=3)
        for step in range(8):
            idx = torch.randint(0, 64, (32,))
            train_step(model, optimizer, (batch[0][idx], batch[1][idx]))
            if estimate and step % 3 == 0:
                estimator.estimate()
        return model, optimizer, torch.get_rng_state()

    (plain, plain_opt, plain_rng), (watched, watched_opt, watched_rng) = run(False), run(True)
    assert torch.equal(plain_rng, watched_rng)
    for (name, a), b in zip(plain.state_dict().items(), watched.state_dict().values()):
        assert torch.equal(a, b), name  # parameters and BN running statistics
    for a, b in zip(plain.parameters(), watched.parameters()):
        assert torch.equal(a.grad, b.grad)
    for a, b in zip(plain_opt.state.values(), watched_opt.state.values()):
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    assert watched.training  # the estimate's eval mode is undone


@pytest.mark.skipif(HAS_FUNC, reason="torch.func exists here")
def test_func_mode_refused_without_torch_func():
    model, batch = make_task()
    with pytest.raises(ValueError, match="torch.func"):
        CurvatureEstimator(model, loss_fn, batch, hvp_mode="func")


class FarQuadratic(nn.Module):
    """0.5 sum h_i theta_i^2 far from the origin: large gradients, moderate curvature."""

    def __init__(self, n=1000):
        super().__init__()
        self.h = torch.linspace(-1.0, 2.0, n)
        self.theta = nn.Parameter(torch.full((n,), 100.0))

    def forward(self):
        return 0.5 * (self.h * self.theta * self.theta).sum()


def test_auto_keeps_double_backward_where_a_fixed_fd_step_drowns_in_rounding():
    model = FarQuadratic()
    # A step of norm 1e-3 (the old default): float32 rounding of gradients ~1e2
    # swamps the difference, the check fails and auto falls back to it.
    fixed = CurvatureEstimator(model, lambda m, _: m(), None, hvps=3, fd_eps=1e-3)
    assert fixed.estimate().hvp_mode == "finite_difference"
    # The default step scales with ||theta||: the exact method passes the check.
    scaled = CurvatureEstimator(model, lambda m, _: m(), None, hvps=20, max_hvps=60, tol=1e-4)
    estimate = scaled.estimate()
    assert estimate.hvp_mode in ("double_backward", "func")
    assert estimate.lambda_max == pytest.approx(2.0, rel=1e-3)


def test_budget_rule_skips_due_steps_that_would_exceed_it():
    """The cadence rule alone, with made-up times (no clock): an estimate is due
    on a multiple of `every` only while the estimates so far plus one more,
    costed as the last one, stay within budget x training time."""
    model, batch = make_task()
    estimator = CurvatureEstimator(model, loss_fn, batch, every=10, budget=0.05)
    assert estimator.due(0, train_seconds=0.0)  # the first always runs
    estimator.estimates, estimator.seconds_total, estimator._last_seconds = 1, 1.0, 1.0
    assert not estimator.due(7, train_seconds=1e6)          # not a multiple of every
    assert not estimator.due(10, train_seconds=39.0)        # 2 s > 5% of 39 s
    assert estimator.skipped_for_budget == 1
    assert estimator.due(20, train_seconds=40.0)            # 2 s = 5% of 40 s
    assert estimator.due(30)                                # no training time: every 10
    fixed = CurvatureEstimator(model, loss_fn, batch, every=10, budget=None)
    fixed.estimates, fixed.seconds_total, fixed._last_seconds = 1, 1.0, 1.0
    assert fixed.due(10, train_seconds=1e-3)
    with pytest.raises(ValueError):
        CurvatureEstimator(model, loss_fn, batch, budget=0)


def test_monitor_keeps_curvature_within_its_budget_of_a_slow_step():
    """Under a Monitor, an estimate dearer than the training step (a loss_fn
    that sleeps 20 ms; steps of 10 ms) at every=1 would cost ~2x the training
    time on a fixed cadence; with budget=0.1 the cadence stretches so
    that the estimates stay within 10% of the training time the monitor
    measures (plus at most one estimate: the first always runs, and an estimate
    may cost more than the last one it was costed as), and it keeps estimating.
    The bounds hold whatever the machine's load (both sides are measured)."""
    import time
    from foreshock import Monitor

    def slow_loss(model, batch):
        time.sleep(0.02)
        return loss_fn(model, batch)

    model, batch = make_task()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    estimator = CurvatureEstimator(model, slow_loss, batch, optimizer, every=1, budget=0.1,
                                   hvp_mode="double_backward")
    monitor = Monitor("127.0.0.1:1", run_id="r", job="j", curvature=estimator)
    per_estimate = []
    estimate = estimator.estimate
    estimator.estimate = lambda: per_estimate.append(estimate()) or per_estimate[-1]
    try:
        steps = 150
        for step in range(steps):
            train_step(model, optimizer, batch)
            time.sleep(0.01)
            monitor.step(step, loss=1.0)
        stats = monitor.stats()
    finally:
        monitor.close(timeout=0.5)
    spent, train = stats["curvature_seconds_total"], stats["train_seconds_total"]
    longest = max(e.seconds for e in per_estimate)
    assert spent <= 0.1 * train + longest, (spent, train, longest)
    assert 3 <= stats["curvature_estimates"] < steps // 3, stats
    assert stats["curvature_skipped_for_budget"] == steps - stats["curvature_estimates"]
