"""Curvature tracking: the largest eigenvalue of the (Adam-preconditioned) Hessian.

    estimator = CurvatureEstimator(model, loss_fn, probe_batch, optimizer, every=50, hvps=3)
    monitor = Monitor(..., curvature=estimator)       # sends a CurvatureSample every 50 steps
                                                      # or less often: see `budget`

The operator is A = P^{-1/2} H P^{-1/2} with P = diag(sqrt(v_hat) + eps) read from
Adam's (bias-corrected) second moments, or plain H for SGD and before Adam has
state. H is the Hessian of `loss_fn(model, probe_batch)` on the fixed probe batch.

Each estimate runs at least `hvps` Hessian-vector products as Lanczos steps
started from the previous estimate's eigenvector (warm start), and more, up to
`max_hvps`, while the Ritz residual is above `tol`; it reports the largest
Ritz value. Plain power iteration converges to the eigenvalue of largest
*magnitude*, which on a transformer can be a large negative one; the largest
Ritz value of the Krylov space is the algebraically largest estimate. The Ritz
vector is kept, on the model's device, as the next warm start.

HVPs come from torch.func (forward-over-reverse: jvp of grad, torch >= 2.0),
from double backward (one gradient graph per estimate, reused by its
products), or from a central finite difference of gradients,
(g(theta + e v) - g(theta - e v)) / 2e, for models whose custom ops lack
second derivatives. "auto" decides on the first product: it keeps the exact
methods only where they agree with a finite difference (such ops often drop
their second-order term silently instead of raising), and of torch.func and
double backward the one that was faster on this model. Products run with
SDPA's math backend: the fused attention kernels have no second derivatives.

The estimator never touches training state: gradients come from
torch.autograd.grad / torch.func (nothing accumulates into .grad), the
optimizer state is only read, parameters perturbed by the finite difference
are restored bit for bit from a copy, the model runs in eval mode (no dropout,
no running-stat updates), random start vectors come from a private generator,
and the global RNG state (CPU and the model's CUDA devices) is restored after
each estimate, so a loss_fn that draws random numbers leaves the training
stream untouched too.
"""
import contextlib
import logging
import math
import re
import time
from dataclasses import dataclass, field

import torch

HVP_MODES = ("auto", "func", "double_backward", "finite_difference")

log = logging.getLogger("foreshock")

try:  # torch >= 2.0
    from torch.func import functional_call as _functional_call, grad as _func_grad, jvp as _func_jvp
except ImportError:  # torch 1.13 (Debian): double backward only
    _functional_call = _func_grad = _func_jvp = None


def _second_order_attention():
    """SDPA's fused kernels (flash, memory-efficient, cuDNN) have neither double
    backward nor forward-mode AD; its math backend computes the same function
    with plain differentiable ops. A no-op before torch.nn.attention existed."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.MATH])


def _rng_fork(params):
    """Restores the global RNG state (CPU, and the CUDA devices holding params) on exit."""
    devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    return torch.random.fork_rng(devices=devices)


@dataclass
class CurvatureEstimate:
    """One estimate; fields mirror foreshock.v1.CurvatureSample."""
    lambda_max: float
    residual: float          # ||A v - lambda v|| / |lambda|
    hvps: int
    preconditioned: bool
    lr: float
    beta1: float
    overlap: float           # |<v_t, v_{t-1}>|, 0 for the first estimate
    layer_rayleigh: list = field(default_factory=list)  # v_l^T (A v)_l per transformer block
    hvp_mode: str = "double_backward"  # or "func", "finite_difference" (not on the wire)
    seconds: float = 0.0

    def to_proto(self, pb):
        return pb.CurvatureSample(
            lambda_max=self.lambda_max, residual=self.residual, hvps=self.hvps,
            preconditioned=self.preconditioned, lr=self.lr, beta1=self.beta1,
            overlap=self.overlap, layer_rayleigh=self.layer_rayleigh)


def block_index_of(name):
    """Transformer block of a parameter name: the first integer path component
    ("blocks.3.attn.qkv.weight" -> 3, "model.layers.11.mlp.up.weight" -> 11,
    "transformer.h.0.ln_1.weight" -> 0); None for embeddings, heads, final norms."""
    match = re.search(r"(?:^|\.)(\d+)\.", name)
    return int(match.group(1)) if match else None


def _optimizer_preconditioner(optimizer, params):
    """(scales, preconditioned, beta1): scales[i] = P_i^{-1/2} per parameter, or
    None for plain H. Adam/AdamW with state give P = sqrt(v_hat) + eps."""
    if optimizer is None:
        return None, False, 0.0
    group_of = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            group_of[id(p)] = group
    first = optimizer.param_groups[0]
    if "betas" not in first:  # SGD and friends: momentum acts as heavy-ball beta
        return None, False, float(first.get("momentum", 0.0) or 0.0)
    beta1 = float(first["betas"][0])
    scales = []
    for p in params:
        state = optimizer.state.get(p, {})
        if "exp_avg_sq" not in state:
            return None, False, beta1  # no second moments yet: plain H
        group = group_of[id(p)]
        beta2 = group["betas"][1]
        step = state["step"]
        step = float(step.item() if torch.is_tensor(step) else step)
        v_hat = state["exp_avg_sq"] / (1.0 - beta2 ** step)
        scales.append((v_hat.sqrt() + group["eps"]).rsqrt())
    return scales, True, beta1


def _dot(xs, ys):
    # torch.dot reads both vectors once, with no temporary; half types accumulate in float32.
    return sum(torch.dot(x.reshape(-1), y.reshape(-1)) if x.dtype in (torch.float32, torch.float64)
               else torch.dot(x.reshape(-1).float(), y.reshape(-1).float())
               for x, y in zip(xs, ys))


def _norm(xs):
    return torch.sqrt(_dot(xs, xs))


def _axpy(a, xs, ys):
    """ys += a * xs, in place."""
    torch._foreach_add_(ys, xs, alpha=float(a))


class _LossModule(torch.nn.Module):
    """loss_fn(model, batch) as a module whose parameters are the model's
    ("model.<name>"), so that torch.func.functional_call can substitute them."""

    def __init__(self, model, loss):
        super().__init__()
        self.model = model
        self._loss = loss

    def forward(self):
        return self._loss(self.model)


class CurvatureEstimator:
    """Warm-started Lanczos estimate of lambda_max of P^{-1/2} H P^{-1/2}.

    Args:
      model: the torch module being trained.
      loss_fn: loss_fn(model, probe_batch) -> scalar loss on the probe batch.
      probe_batch: fixed input of every estimate (anything loss_fn accepts).
      optimizer: read for Adam's second moments, lr and beta1 (None: plain H, lr 0).
      every: estimate when step % every == 0 (default 50), at most; see budget.
      budget: the largest fraction of training time the estimates may take
        (default 0.04). Under a Monitor, which times the training steps between
        its step() calls, a due step is skipped while the estimates so far plus
        one more (costed as the last one) would exceed budget x the training
        time so far: the cadence stretches to every k x `every` steps on a model
        whose estimate is dear against its step (docs/PERFORMANCE.md). The
        first estimate always runs. None: a fixed cadence, every `every` steps.
        due(step) without the training time (a hand-written loop) ignores it.
      hvps: Hessian-vector products (Lanczos steps) per estimate, at least (default 3).
      max_hvps: at most this many per estimate: beyond `hvps`, Lanczos continues
        while the residual is above `tol` (default `hvps`: a fixed budget; e.g.
        3 * hvps for estimates that converge, see docs/PERFORMANCE.md).
      tol: residual ||Av - lambda v|| / |lambda| that ends an estimate early
        (default 0.05; the daemon keeps estimates above 0.1 out of detection).
      hvp_mode: "auto" (decided on the first product, see the module docstring),
        "func" (torch.func, torch >= 2.0), "double_backward" or "finite_difference".
      fd_eps: norm of the finite-difference step in parameter space; None (default):
        sqrt(machine eps) * (1 + ||theta||), the usual choice (Nocedal & Wright,
        8.1), which balances float rounding against truncation. A fixed 1e-3
        was 12% off on a 15M-parameter model in float32.
      seed: seed of the private generator for the first start vector.
    """

    # Relative disagreement between an exact product and finite differences
    # beyond which "auto" concludes the exact one is wrong (float32 central
    # differences agree to ~1e-3).
    AUTO_AGREEMENT = 0.05

    def __init__(self, model, loss_fn, probe_batch, optimizer=None, every=50, hvps=3,
                 hvp_mode="auto", fd_eps=None, seed=0, max_hvps=None, tol=0.05, budget=0.04):
        if hvp_mode not in HVP_MODES:
            raise ValueError(f"hvp_mode must be one of {HVP_MODES}")
        if hvp_mode == "func" and _func_jvp is None:
            raise ValueError(f"hvp_mode='func' needs torch.func (torch >= 2.0; this is torch "
                             f"{torch.__version__}): use hvp_mode='auto' or 'double_backward'")
        # Default: a fixed budget. The daemon's curvature rule was calibrated on
        # fixed-budget estimates; converged ones read higher on healthy Adam runs
        # (which sit at the edge of stability) and need the calibrated rule first.
        max_hvps = hvps if max_hvps is None else max_hvps
        if hvps < 1 or every < 1 or max_hvps < hvps:
            raise ValueError("hvps and every must be >= 1, and max_hvps >= hvps")
        if budget is not None and not 0 < budget <= 1:
            raise ValueError("budget must be a fraction of training time in (0, 1], or None")
        # DDP: differentiate its .module (no reducer hooks, no collectives); a
        # sharded model (FSDP2, FSDP1, ZeRO-3) is refused here (foreshock.distributed).
        from foreshock.distributed import model_for_curvature
        model = model_for_curvature(model)
        self.model = model
        self.loss_fn = loss_fn
        self.probe_batch = probe_batch
        self.optimizer = optimizer
        self.every = every
        self.hvps = hvps
        self.max_hvps = max_hvps
        self.tol = tol
        self.hvp_mode = hvp_mode
        self.fd_eps = fd_eps
        self.budget = budget
        self.skipped_for_budget = 0  # due steps skipped to stay within the budget
        self._last_seconds = 0.0
        names_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in names_params]
        self._names = [n for n, _ in names_params]
        self.blocks = [block_index_of(n) for n, _ in names_params]
        self.n_blocks = 1 + max((b for b in self.blocks if b is not None), default=-1)
        self._generator = torch.Generator(device="cpu").manual_seed(seed)
        self._vector = None        # warm start: the last Ritz vector (model device)
        self._graph = None         # (gradients with graph, indices that need it), see _fixed_point
        self._reuse_graph = False
        self._loss_module = None   # see _hvp_func
        self.hvp_choice = None     # why "auto" chose its method (logged once)
        self.hvps_total = 0
        self.seconds_total = 0.0
        self.estimates = 0

    def due(self, step, train_seconds=None):
        """Whether to estimate at this step: a multiple of `every` and, given the
        training time so far (seconds outside the monitor, as Monitor.step()
        measures it), within the budget: all estimates so far plus one more
        costed as the last one at most budget x train_seconds."""
        if step % self.every != 0:
            return False
        if self.budget is None or train_seconds is None or self.estimates == 0:
            return True
        if self.seconds_total + self._last_seconds <= self.budget * train_seconds:
            return True
        self.skipped_for_budget += 1
        return False

    def reset(self):
        """Forgets the warm start (the next estimate starts from a random vector)."""
        self._vector = None

    # -- the operator -----------------------------------------------------------

    def _loss(self):
        return self.loss_fn(self.model, self.probe_batch)

    def _grad(self, create_graph=False):
        # allow_unused: an MoE expert that no probe token reaches has no gradient.
        grads = torch.autograd.grad(self._loss(), self.params, create_graph=create_graph,
                                    allow_unused=True)
        return [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads)]

    @contextlib.contextmanager
    def _fixed_point(self):
        """Within it, the parameters do not change: double backward builds the
        gradient graph once and reuses it for every product (one forward and
        backward per estimate instead of one per HVP)."""
        self._graph = None
        self._reuse_graph = True
        try:
            yield
        finally:
            self._graph = None  # frees the graph
            self._reuse_graph = False

    def _hvp_double_backward(self, direction):
        graph = self._graph if self._reuse_graph else None
        if graph is None:
            grads = self._grad(create_graph=True)
            graph = (grads, [i for i, g in enumerate(grads) if g.requires_grad])
            if self._reuse_graph:
                self._graph = graph
        grads, used = graph
        hv = torch.autograd.grad([grads[i] for i in used], self.params,
                                 grad_outputs=[direction[i] for i in used], allow_unused=True,
                                 retain_graph=self._reuse_graph)
        return [torch.zeros_like(p) if h is None else h.detach() for p, h in zip(self.params, hv)]

    def _hvp_func(self, direction):
        """Forward-over-reverse: the jvp of torch.func.grad along `direction`, with the
        parameters substituted by detached copies (functional_call), so that no
        graph reaches the model's parameters and nothing is kept between products."""
        if self._loss_module is None:
            self._loss_module = _LossModule(self.model,
                                            lambda model: self.loss_fn(model, self.probe_batch))
        names = ["model." + n for n in self._names]
        module = self._loss_module

        def loss_at(params):
            return _functional_call(module, dict(zip(names, params)), ())

        primals = tuple(p.detach() for p in self.params)
        _, hv = _func_jvp(_func_grad(loss_at), (primals,), (tuple(direction),))
        return [h.detach() for h in hv]

    def _fd_step(self):
        if self.fd_eps is not None:
            return self.fd_eps
        theta = float(_norm([p.detach() for p in self.params]))
        return math.sqrt(torch.finfo(self.params[0].dtype).eps) * (1.0 + theta)

    def _hvp_finite_difference(self, direction, step=None):
        eps = (step or self._fd_step()) / max(float(_norm(direction)), 1e-30)
        saved = [p.detach().clone() for p in self.params]
        try:
            with torch.no_grad():
                for p, d in zip(self.params, direction):
                    p.add_(d, alpha=eps)
            plus = self._grad()
            with torch.no_grad():
                for p, s, d in zip(self.params, saved, direction):
                    p.copy_(s).add_(d, alpha=-eps)
            minus = self._grad()
        finally:
            with torch.no_grad():  # bit-exact restore: theta + e v - e v != theta in floats
                for p, s in zip(self.params, saved):
                    p.copy_(s)
        return [(a - b) / (2 * eps) for a, b in zip(plus, minus)]

    def _hvp(self, direction):
        if self.hvp_mode == "finite_difference":
            return self._hvp_finite_difference(direction)
        if self.hvp_mode == "double_backward":
            return self._hvp_double_backward(direction)
        if self.hvp_mode == "func":
            return self._hvp_func(direction)
        return self._choose(direction)

    def _choose(self, direction):
        """"auto", on the first product. A custom op without second derivatives
        either raises or, worse, silently drops its second-order term (e.g. a
        @once_differentiable kernel): check the exact methods against a finite
        difference once, and of those that agree keep the faster one for this
        model, i.e. the smaller predicted cost of an `hvps`-product estimate:
        torch.func pays every product in full; double backward pays one
        gradient graph per estimate, then a cheaper product."""
        # Two steps: if one of them is dominated by rounding (too small) or by
        # truncation (too large), the other is not.
        step = self._fd_step()
        finites = [self._hvp_finite_difference(direction, step),
                   self._hvp_finite_difference(direction, step / 4)]
        finite = finites[0]
        scale = max(float(_norm(finite)), 1e-30)

        def timed(method):
            start = time.perf_counter()
            product = method(direction)
            float(_norm(product))  # waits for an accelerator
            return product, time.perf_counter() - start

        def disagreement(product):
            rel = min(float(_norm([a - b for a, b in zip(product, f)])) for f in finites) / scale
            return None if rel <= self.AUTO_AGREEMENT else \
                f"its product differs from a finite difference by {rel:.0%}"

        func = func_s = None
        if _func_jvp is None:
            func_why = f"torch {torch.__version__} has no torch.func"
        else:
            try:
                func, first_s = timed(self._hvp_func)
                func_s = min(first_s, timed(self._hvp_func)[1])  # the first call warms up
                func_why = disagreement(func)
                func_why = func_why and "torch.func: " + func_why
            except Exception as e:  # noqa: BLE001 - any failure means "not on this model"
                func_why = f"torch.func failed on this model ({type(e).__name__}: {e})"
                func = None
            if func_why is not None:
                func = None
        double = None
        try:
            double, graph_s = timed(self._hvp_double_backward)   # builds the gradient graph
            double_s = timed(self._hvp_double_backward)[1]       # reuses it
            double_why = disagreement(double)
        except (RuntimeError, NotImplementedError) as e:
            double_why = f"double backward failed ({type(e).__name__}: {e})"
        else:
            double_why = double_why and "double backward: " + double_why
        if double_why is not None:
            double = None
        k = self.hvps
        if func is not None and double is not None:
            func_cost, double_cost = k * func_s, graph_s + (k - 1) * double_s
            timing = (f"{1e3 * func_cost:.0f} ms by torch.func, {1e3 * double_cost:.0f} ms by "
                      f"double backward for {k} products")
            if func_cost < double_cost:
                self._decide("func", "faster on this model: " + timing)
                self._graph = None  # frees the gradient graph built for timing
                return func
            self._decide("double_backward", "faster on this model: " + timing)
            return double
        if func is not None:
            self._decide("func", double_why)
            return func
        if double is not None:
            self._decide("double_backward", func_why)
            return double
        self._decide("finite_difference", f"{func_why}; {double_why}")
        return finite

    def _decide(self, mode, why):
        self.hvp_mode = mode
        self.hvp_choice = f"{mode}: {why}"
        log.info("foreshock: curvature HVPs by %s (%s)", mode.replace("_", " "), why)

    def _apply(self, vector, scales):
        """A v = S H S v with S = P^{-1/2} (identity when scales is None)."""
        if scales is None:
            return self._hvp(vector)
        hv = self._hvp([s * v for s, v in zip(scales, vector)])
        return [s * h for s, h in zip(scales, hv)]

    # -- Lanczos ------------------------------------------------------------------

    def _start_vector(self):
        if self._vector is not None:
            return [v.clone() for v in self._vector]
        return [torch.randn(p.shape, generator=self._generator, dtype=torch.float32)
                .to(device=p.device, dtype=p.dtype) for p in self.params]

    @contextlib.contextmanager
    def _products(self):
        """Where the products run: eval mode, the global RNG state restored on exit,
        SDPA's math backend, one gradient graph for the whole estimate."""
        was_training = self.model.training
        self.model.eval()
        try:
            with _rng_fork(self.params), _second_order_attention(), self._fixed_point():
                yield
        finally:
            self.model.train(was_training)

    def estimate(self):
        """Runs one estimate now and returns a CurvatureEstimate."""
        start = time.perf_counter()
        products = [0]

        def apply(v):
            products[0] += 1
            return self._apply(v, scales)

        with self._products():
            scales, preconditioned, beta1 = _optimizer_preconditioner(self.optimizer, self.params)
            lam, residual, ritz, a_ritz = _lanczos(apply, self._start_vector(), self.hvps,
                                                   tol=self.tol, k_max=self.max_hvps)
        hvps = products[0]
        self.hvps_total += hvps
        overlap = abs(float(_dot(ritz, self._vector))) if self._vector is not None else 0.0
        self._vector = [y.detach().clone() for y in ritz]
        contributions = [0.0] * self.n_blocks
        for block, y, ay in zip(self.blocks, ritz, a_ritz):
            if block is not None:
                contributions[block] += float((y * ay).sum())
        lr = float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else 0.0
        seconds = time.perf_counter() - start
        self.seconds_total += seconds
        self._last_seconds = seconds
        self.estimates += 1
        return CurvatureEstimate(
            lambda_max=lam, residual=residual, hvps=hvps, preconditioned=preconditioned,
            lr=lr, beta1=beta1, overlap=overlap, layer_rayleigh=contributions,
            hvp_mode=self.hvp_mode, seconds=seconds)


def _lanczos(apply, start, k, on_step=None, tol=None, k_max=None):
    """At least k Lanczos steps of the symmetric operator `apply` from `start` (a
    list of tensors), then more, up to k_max, while the relative residual of the
    top Ritz pair is above tol. Returns (largest Ritz value, relative residual,
    Ritz vector, A times the Ritz vector). on_step(j, largest Ritz value after
    j+1 steps) may return True to stop early."""
    k_max = max(k, k_max or k)
    norm = _norm(start)
    basis, alphas, betas = [[x / norm for x in start]], [], []
    w = None
    for j in range(k_max):
        w = apply(basis[j])
        alpha = float(_dot(basis[j], w))
        alphas.append(alpha)
        # The three-term recurrence. Orthogonality to the earlier basis is lost only
        # towards Ritz vectors that have converged (Paige: by about eps ||A|| over
        # their residual), so full reorthogonalization, one classical Gram-Schmidt
        # pass, runs once some Ritz pair is nearly converged. Running it at every
        # step cost as much as the products themselves on a 15M-parameter model.
        _axpy(-alpha, basis[j], w)
        if j > 0:
            _axpy(-betas[-1], basis[j - 1], w)
        beta = float(_norm(w))
        if _some_ritz_pair_converged(alphas, betas + [beta]):
            for b, c in [(b, float(_dot(b, w))) for b in basis]:
                _axpy(-c, b, w)
            beta = float(_norm(w))
        betas.append(beta)
        if on_step is not None and on_step(j, _ritz(alphas, betas)[0][-1].item()):
            break
        if j + 1 == k_max or beta < 1e-12 * max(1.0, abs(alpha)):
            break  # the budget is spent, or an invariant subspace: the Ritz values are exact
        if j + 1 >= k and (tol is None or _top_residual(alphas, betas) <= tol):
            break
        basis.append([x / beta for x in w])
    evals, evecs = _ritz(alphas, betas)
    m = len(alphas)
    lam, s = float(evals[-1]), evecs[:, -1]
    ritz = [torch.zeros_like(x) for x in basis[0]]
    for i in range(m):
        _axpy(float(s[i]), basis[i], ritz)
    # A y = lambda y + beta_m s_m q_{m+1}: the residual and A y need no extra HVP.
    beta_m, s_m = betas[m - 1], float(s[m - 1])
    residual = abs(beta_m * s_m) / max(abs(lam), 1e-30)
    a_ritz = [lam * y for y in ritz]
    if beta_m > 0 and m == len(basis):
        _axpy(s_m, w, a_ritz)  # w = beta_m q_{m+1}
    return lam, residual, ritz, a_ritz


# Relative Ritz residual below which the basis is reorthogonalized (float32:
# orthogonality then stays within ~eps / REORTHOGONALIZE_BELOW = 6e-6).
REORTHOGONALIZE_BELOW = 1e-2


def _some_ritz_pair_converged(alphas, betas):
    evals, evecs = _ritz(alphas, betas)
    scale = max(float(evals.abs().max()), 1e-30)
    return float((betas[-1] * evecs[-1, :]).abs().min()) <= REORTHOGONALIZE_BELOW * scale


def _top_residual(alphas, betas):
    """||A y - lambda y|| / |lambda| of the top Ritz pair after len(alphas) steps."""
    evals, evecs = _ritz(alphas, betas)
    return abs(betas[-1] * float(evecs[-1, -1])) / max(abs(float(evals[-1])), 1e-30)


def _ritz(alphas, betas):
    """Eigenpairs (ascending) of the Lanczos tridiagonal matrix. A non-finite
    entry (a blown-up model) raises FloatingPointError, not LAPACK's error."""
    if not all(math.isfinite(x) for x in alphas) or not all(math.isfinite(x) for x in betas):
        raise FloatingPointError("non-finite Hessian-vector product: the loss or its "
                                 "gradients are not finite")
    m = len(alphas)
    t = torch.zeros(m, m, dtype=torch.float64)
    for i in range(m):
        t[i, i] = alphas[i]
        if i + 1 < m:
            t[i, i + 1] = t[i + 1, i] = betas[i]
    return torch.linalg.eigh(t)


def hvps_to_tolerance(estimator, exact, rel_tol=0.01, max_hvps=300, warm=True):
    """HVPs one Lanczos run needs before its largest Ritz value is within rel_tol
    of `exact`, started from the estimator's warm vector (warm=True) or from a
    random vector (cold); None if max_hvps do not suffice. Touches neither the
    warm start nor the counters: this is for measuring, not tracking."""
    start = estimator._start_vector() if warm else [
        torch.randn(p.shape, generator=torch.Generator().manual_seed(12345), dtype=torch.float32)
        .to(device=p.device, dtype=p.dtype) for p in estimator.params]
    needed = []

    def on_step(j, top):
        if abs(top - exact) <= rel_tol * abs(exact):
            needed.append(j + 1)
            return True
        return False

    with estimator._products():
        scales, _, _ = _optimizer_preconditioner(estimator.optimizer, estimator.params)
        _lanczos(lambda v: estimator._apply(v, scales), start, max_hvps, on_step)
    return needed[0] if needed else None


def exact_preconditioned_top_eigenvalue(model, loss_fn, probe_batch, optimizer=None):
    """Reference for small models (a few thousand parameters): forms the full
    Hessian with double backward, applies the same preconditioner and returns
    the largest eigenvalue (torch.linalg.eigvalsh, float64)."""
    params = [p for p in model.parameters() if p.requires_grad]
    sizes = [p.numel() for p in params]
    n = sum(sizes)
    was_training = model.training
    model.eval()
    try:
        with _second_order_attention():
            loss = loss_fn(model, probe_batch)
        grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
        flat = torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                          for p, g in zip(params, grads)])
        eye = torch.eye(n, dtype=flat.dtype, device=flat.device)
        try:  # one batched double backward (vmap) when the ops support it
            rows = torch.autograd.grad(flat, params, grad_outputs=eye, is_grads_batched=True,
                                       allow_unused=True)
            h = torch.cat([(torch.zeros(n, p.numel()) if r is None else r.reshape(n, -1))
                           for p, r in zip(params, rows)], dim=1).double()
        except RuntimeError:
            h = torch.stack([torch.cat([(torch.zeros_like(p) if r is None else r).reshape(-1)
                                        for p, r in zip(params, torch.autograd.grad(
                                            flat[i], params, retain_graph=True, allow_unused=True))])
                             .double() for i in range(n)])
    finally:
        model.train(was_training)
    h = 0.5 * (h + h.T)
    scales, _, _ = _optimizer_preconditioner(optimizer, params)
    if scales is not None:
        s = torch.cat([x.reshape(-1) for x in scales]).double()
        h = s[:, None] * h * s[None, :]
    return float(torch.linalg.eigvalsh(h)[-1])


__all__ = ["CurvatureEstimator", "CurvatureEstimate", "block_index_of",
           "exact_preconditioned_top_eigenvalue", "hvps_to_tolerance"]
