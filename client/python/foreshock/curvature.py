"""Curvature tracking: the largest eigenvalue of the (Adam-preconditioned) Hessian.

    estimator = CurvatureEstimator(model, loss_fn, probe_batch, optimizer, every=50, hvps=3)
    monitor = Monitor(..., curvature=estimator)       # sends a CurvatureSample every 50 steps

The operator is A = P^{-1/2} H P^{-1/2} with P = diag(sqrt(v_hat) + eps) read from
Adam's (bias-corrected) second moments, or plain H for SGD and before Adam has
state. H is the Hessian of `loss_fn(model, probe_batch)` on the fixed probe batch.

Each estimate runs K Hessian-vector products as Lanczos steps started from the
previous estimate's eigenvector (warm start), and reports the largest Ritz
value. Plain power iteration converges to the eigenvalue of largest
*magnitude*, which on a transformer can be a large negative one; the largest
Ritz value of the Krylov space is the algebraically largest estimate. The Ritz
vector is kept, on the model's device, as the next warm start.

HVPs come from double backward, or from a central finite difference of
gradients, (g(theta + e v) - g(theta - e v)) / 2e, for models whose custom ops
lack double backward. "auto" checks double backward against a finite
difference on the first product, since such ops often drop their second-order
term silently instead of raising.

The estimator never touches training state: gradients come from
torch.autograd.grad (nothing accumulates into .grad), the optimizer state is
only read, parameters perturbed by the finite difference are restored bit for
bit from a copy, the model runs in eval mode (no dropout, no running-stat
updates) and random start vectors come from a private generator, so the
training RNG stream is untouched.
"""
import contextlib
import math
import re
import time
from dataclasses import dataclass, field

import torch

HVP_MODES = ("auto", "double_backward", "finite_difference")


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
    hvp_mode: str = "double_backward"
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
    return sum((x * y).sum() for x, y in zip(xs, ys))


def _norm(xs):
    return torch.sqrt(_dot(xs, xs))


def _axpy(a, xs, ys):
    """ys += a * xs, in place."""
    for x, y in zip(xs, ys):
        y.add_(x, alpha=float(a))


class CurvatureEstimator:
    """Warm-started Lanczos estimate of lambda_max of P^{-1/2} H P^{-1/2}.

    Args:
      model: the torch module being trained.
      loss_fn: loss_fn(model, probe_batch) -> scalar loss on the probe batch.
      probe_batch: fixed input of every estimate (anything loss_fn accepts).
      optimizer: read for Adam's second moments, lr and beta1 (None: plain H, lr 0).
      every: estimate when step % every == 0 (default 50).
      hvps: Hessian-vector products (Lanczos steps) per estimate (default 3).
      hvp_mode: "auto" (double backward, unless on the first product it raises or
        disagrees with a finite difference), "double_backward" or
        "finite_difference".
      fd_eps: finite-difference step along the unit direction.
      seed: seed of the private generator for the first start vector.
    """

    # Relative disagreement between double backward and finite differences
    # beyond which "auto" concludes double backward is wrong (float32 central
    # differences agree to ~1e-3).
    AUTO_AGREEMENT = 0.05

    def __init__(self, model, loss_fn, probe_batch, optimizer=None, every=50, hvps=3,
                 hvp_mode="auto", fd_eps=1e-3, seed=0):
        if hvp_mode not in HVP_MODES:
            raise ValueError(f"hvp_mode must be one of {HVP_MODES}")
        if hvps < 1 or every < 1:
            raise ValueError("hvps and every must be >= 1")
        self.model = model
        self.loss_fn = loss_fn
        self.probe_batch = probe_batch
        self.optimizer = optimizer
        self.every = every
        self.hvps = hvps
        self.hvp_mode = hvp_mode
        self.fd_eps = fd_eps
        names_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in names_params]
        self.blocks = [block_index_of(n) for n, _ in names_params]
        self.n_blocks = 1 + max((b for b in self.blocks if b is not None), default=-1)
        self._generator = torch.Generator(device="cpu").manual_seed(seed)
        self._vector = None        # warm start: the last Ritz vector (model device)
        self._graph = None         # (gradients with graph, indices that need it), see _fixed_point
        self._reuse_graph = False
        self.hvps_total = 0
        self.seconds_total = 0.0
        self.estimates = 0

    def due(self, step):
        return step % self.every == 0

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

    def _hvp_finite_difference(self, direction):
        eps = self.fd_eps / max(float(_norm(direction)), 1e-30)
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
        # "auto", decided on the first product. A custom op without double backward
        # either raises or, worse, silently drops its second-order term (e.g. a
        # @once_differentiable kernel): check double backward against a finite
        # difference once, and keep whichever is right.
        finite = self._hvp_finite_difference(direction)
        try:
            double = self._hvp_double_backward(direction)
        except RuntimeError:
            double = None
        if double is not None:
            diff = [a - b for a, b in zip(double, finite)]
            if float(_norm(diff)) <= self.AUTO_AGREEMENT * max(float(_norm(finite)), 1e-30):
                self.hvp_mode = "double_backward"
                return double
        self.hvp_mode = "finite_difference"
        return finite

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

    def estimate(self):
        """Runs one estimate now and returns a CurvatureEstimate."""
        start = time.perf_counter()
        was_training = self.model.training
        self.model.eval()
        try:
            scales, preconditioned, beta1 = _optimizer_preconditioner(self.optimizer, self.params)
            with self._fixed_point():
                lam, residual, ritz, a_ritz = _lanczos(
                    lambda v: self._apply(v, scales), self._start_vector(), self.hvps)
        finally:
            self.model.train(was_training)
        self.hvps_total += self.hvps
        overlap = abs(float(_dot(ritz, self._vector))) if self._vector is not None else 0.0
        self._vector = [y.detach().clone() for y in ritz]
        contributions = [0.0] * self.n_blocks
        for block, y, ay in zip(self.blocks, ritz, a_ritz):
            if block is not None:
                contributions[block] += float((y * ay).sum())
        lr = float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else 0.0
        seconds = time.perf_counter() - start
        self.seconds_total += seconds
        self.estimates += 1
        return CurvatureEstimate(
            lambda_max=lam, residual=residual, hvps=self.hvps, preconditioned=preconditioned,
            lr=lr, beta1=beta1, overlap=overlap, layer_rayleigh=contributions,
            hvp_mode="finite_difference" if self.hvp_mode == "finite_difference"
            else "double_backward", seconds=seconds)


def _lanczos(apply, start, k, on_step=None):
    """k Lanczos steps of the symmetric operator `apply` from `start` (a list of
    tensors). Returns (largest Ritz value, relative residual, Ritz vector, A times
    the Ritz vector). on_step(j, largest Ritz value after j+1 steps) may return
    True to stop early."""
    norm = _norm(start)
    basis, alphas, betas = [[x / norm for x in start]], [], []
    w = None
    for j in range(k):
        w = apply(basis[j])
        alpha = float(_dot(basis[j], w))
        alphas.append(alpha)
        # Full reorthogonalization (twice): k is small and it keeps the Ritz values honest.
        for _ in range(2):
            for b in basis:
                _axpy(-float(_dot(b, w)), b, w)
        beta = float(_norm(w))
        betas.append(beta)
        if on_step is not None and on_step(j, _ritz(alphas, betas)[0][-1].item()):
            break
        if j + 1 < k:
            if beta < 1e-12 * max(1.0, abs(alpha)):
                break  # invariant subspace: the Ritz values are exact
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

    was_training = estimator.model.training
    estimator.model.eval()
    try:
        scales, _, _ = _optimizer_preconditioner(estimator.optimizer, estimator.params)
        with estimator._fixed_point():
            _lanczos(lambda v: estimator._apply(v, scales), start, max_hvps, on_step)
    finally:
        estimator.model.train(was_training)
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
