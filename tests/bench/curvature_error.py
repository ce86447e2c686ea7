"""The curvature estimator's error against the exact eigenvalue, over training.

A tiny MoE GPT (demo/tiny_moe_gpt.py scaled down until its Hessian can be
formed: a few thousand parameters) trains with AdamW on the synthetic copy
task at a sane peak LR and at one too high for it. At every probe of a given
cadence, several estimators, each warm-started from its own previous
estimate, estimate the largest eigenvalue of the Adam-preconditioned Hessian
on the fixed probe batch, and the exact value is computed on the same weights
and batch: the Hessian formed by double backward, preconditioned the same
way, torch.linalg.eigvalsh in float64 (foreshock.curvature's
exact_preconditioned_top_eigenvalue).

Two questions apart:
- how far an estimate is from the exact value (estimator error), by
  estimator configuration; and
- how much the exact value itself moves between consecutive probes (the
  scatter that no estimator can remove: the batch Hessian's top eigenvalue
  really changes), against the estimates' own step-to-step scatter.

    OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/bench/curvature_error.py --out /tmp/curv.json

Every figure in docs/PERFORMANCE.md's "Estimator error against the exact
eigenvalue" comes from one such run.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.join(ROOT, "client", "python"), ROOT]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from demo import tiny_moe_gpt as tmg  # noqa: E402
from foreshock.curvature import CurvatureEstimator, exact_preconditioned_top_eigenvalue  # noqa: E402

# Estimator configurations: (name, constructor keywords). "default" is the
# client's default (a fixed 3 products); "converging" lets Lanczos run on
# while the residual is above tol; "cold" re-starts from a random vector
# every time (what a warm start saves).
CONFIGS = (
    ("default (3 HVPs, warm)", dict(hvps=3)),
    ("converging (3-9 HVPs, tol 0.05, warm)", dict(hvps=3, max_hvps=9, tol=0.05)),
    ("converging (3-20 HVPs, tol 0.01, warm)", dict(hvps=3, max_hvps=20, tol=0.01)),
)


def tiny_config(vocab, qk_norm):
    return tmg.GPTConfig(vocab_size=vocab, block_size=8, n_layer=2, d_model=12, n_head=2,
                         mlp_hidden=16, n_experts=2, top_k=1, expert_hidden=8, moe_layers=(1,),
                         qk_norm=qk_norm)


def loss_fn(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def run(lr, every, steps, seed, warmup, qk_norm):
    torch.manual_seed(seed)
    vocab = 12
    data = tmg.SyntheticDataset("copy", vocab, block_size=8)
    model = tmg.TinyMoEGPT(tiny_config(vocab, qk_norm))
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    windows = data.probe_batch(4, block_size=9)
    probe = (windows[:, :-1].contiguous(), windows[:, 1:].contiguous())
    estimators = [(name, CurvatureEstimator(model, loss_fn, probe, optimizer, every=1,
                                            hvp_mode="double_backward", budget=None, seed=seed,
                                            **kw)) for name, kw in CONFIGS]
    rows = []
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        for group in optimizer.param_groups:  # linear warm-up to the peak LR
            group["lr"] = lr * min(1.0, (step + 1) / warmup)
        x, y = data.batch(16, generator)
        loss = loss_fn(model, (x, y))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step < 20 or step % every:  # Adam's second moments settle first
            continue
        t = time.perf_counter()
        exact = exact_preconditioned_top_eigenvalue(model, loss_fn, probe, optimizer)
        exact_s = time.perf_counter() - t
        row = dict(step=step, loss=float(loss), exact=exact, exact_s=exact_s, estimates={})
        for name, estimator in estimators:
            t = time.perf_counter()
            e = estimator.estimate()
            row["estimates"][name] = dict(value=e.lambda_max, residual=e.residual, hvps=e.hvps,
                                          ms=1e3 * (time.perf_counter() - t))
        rows.append(row)
    return dict(lr=lr, every=every, seed=seed, qk_norm=qk_norm, params=n_params, rows=rows,
                final_loss=statistics.mean(r["loss"] for r in rows[-3:]) if rows else None)


def quantile(values, q):
    values = sorted(values)
    if not values:
        return float("nan")
    i = (len(values) - 1) * q
    lo, hi = math.floor(i), math.ceil(i)
    return values[lo] + (values[hi] - values[lo]) * (i - lo)


def consecutive_log_ratios(values):
    return [abs(math.log(b / a)) for a, b in zip(values, values[1:]) if a > 0 and b > 0]


def summarise(result):
    rows = result["rows"]
    exact = [r["exact"] for r in rows]
    out = dict(lr=result["lr"], every=result["every"], seed=result["seed"],
               qk_norm=result["qk_norm"], params=result["params"], estimates=len(rows),
               final_loss=result["final_loss"],
               exact_range=(min(exact), max(exact)),
               exact_step_scatter_p50=quantile(consecutive_log_ratios(exact), 0.5),
               exact_step_scatter_max=max(consecutive_log_ratios(exact), default=float("nan")),
               configs={})
    for name, _ in CONFIGS:
        est = [r["estimates"][name] for r in rows]
        errors = [abs(e["value"] - r["exact"]) / abs(r["exact"]) for e, r in zip(est, rows)]
        values = [e["value"] for e in est]
        out["configs"][name] = dict(
            err_p50=quantile(errors, 0.5), err_p90=quantile(errors, 0.9), err_max=max(errors),
            below_residual_0_1=sum(e["residual"] <= 0.1 for e in est) / len(est),
            err_p50_when_residual_le_0_1=quantile(
                [x for x, e in zip(errors, est) if e["residual"] <= 0.1], 0.5),
            hvps_mean=statistics.mean(e["hvps"] for e in est),
            ms_mean=statistics.mean(e["ms"] for e in est),
            step_scatter_p50=quantile(consecutive_log_ratios(values), 0.5),
            step_scatter_max=max(consecutive_log_ratios(values), default=float("nan")))
    return out


def table(summaries):
    lines = ["| LR | every | exact λ range | exact λ step-to-step, median / max ×"
             " | estimator | error median / p90 / max | residual ≤ 0.1 | HVPs | ms"
             " | estimate step-to-step, median / max × |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        lo, hi = s["exact_range"]
        for name, c in s["configs"].items():
            lines.append(
                f"| {s['lr']:g} | {s['every']} | {lo:.3g}–{hi:.3g} | "
                f"{math.exp(s['exact_step_scatter_p50']):.2f} / {math.exp(s['exact_step_scatter_max']):.2f} | "
                f"{name} | {100 * c['err_p50']:.1f}% / {100 * c['err_p90']:.1f}% / {100 * c['err_max']:.0f}% | "
                f"{100 * c['below_residual_0_1']:.0f}% | {c['hvps_mean']:.1f} | {c['ms_mean']:.0f} | "
                f"{math.exp(c['step_scatter_p50']):.2f} / {math.exp(c['step_scatter_max']):.2f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lrs", type=float, nargs="+", default=[3e-3, 1e-1],
                   help="peak LRs (a sane one and one too high for the model)")
    p.add_argument("--every", type=int, nargs="+", default=[10, 50], help="probe cadences")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--warmup", type=int, default=100, help="linear LR warm-up steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--qk-norm", action="store_true", help="QK-layernorm in the model")
    p.add_argument("--out", help="also write every estimate and the summaries as JSON")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results, summaries = [], []
    for lr in args.lrs:
        for every in args.every:
            result = run(lr, every, args.steps, args.seed, args.warmup, args.qk_norm)
            results.append(result)
            summaries.append(summarise(result))
            print(f"lr {lr:g} every {every}: {result['params']} parameters, "
                  f"{len(result['rows'])} estimates, final loss {result['final_loss']:.3f}",
                  flush=True)
    print(table(summaries))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(results=results, summaries=summaries), f, indent=1)


if __name__ == "__main__":
    main()
