"""Curvature cost on the training step, on small random-init Hugging Face models.

For each model family (tiny configs, nothing downloaded), three copies of the
same model train on the same batches, one step each in turn (interleaved, so
that a busy machine slows all three alike):
  none    Monitor without curvature
  before  CurvatureEstimator at the old defaults: every=50, hvps=3, a fixed cadence
  after   CurvatureEstimator at the current defaults (every=50, hvps=3, budget=0.04:
          due estimates are skipped while they would exceed 4% of training time)
The estimator never changes training (bit-identical weights), so the three
copies hold the same weights at every step. Reported per family: parameters,
the mean step of `none`, the mean time of one estimate, the estimates' total
time as a % of the training time (as Monitor measures it: between its step()
calls), and the cadence the budget chose. Accuracy: after the run, one more
estimate from each arm's warm vector against a converged reference (60 cold
Lanczos steps, residual printed) on the same weights.

  OPENBLAS_NUM_THREADS=1 build/venv-pypi/bin/python tests/bench/curvature_cost_hf.py [--steps 400]

No daemon: the monitors send to 127.0.0.1:1 and just retry.
"""
import argparse
import logging
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402

import foreshock  # noqa: E402
from foreshock.curvature import CurvatureEstimator, _lanczos, _optimizer_preconditioner  # noqa: E402

VOCAB = 512
BUDGET = CurvatureEstimator.__init__.__defaults__[-1]  # the default budget
BASE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)

FAMILIES = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**BASE)),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **BASE, **MOE)),
    "phi3": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **{**BASE, "num_key_value_heads": 4}, pad_token_id=0)),
}


def lm_loss(model, batch):
    logits = model(batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def _recorded(est, log):
    estimate = est.estimate

    def recorded():
        e = estimate()
        log.append((recorded.step, e.seconds))
        return e
    recorded.step = None
    return recorded


def build(family):
    torch.manual_seed(0)
    model = FAMILIES[family]()
    model.config._attn_implementation = "sdpa"
    return model


def run(family, steps, batch, seq, curv_seqs):
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (steps, batch, seq + 1), generator=g)
    curv = torch.randint(0, VOCAB, (curv_seqs, seq + 1), generator=g)
    arms = {}
    for name, kw in (("none", None), ("before", dict(budget=None)), ("after", {})):
        model = build(family)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        est = None if kw is None else CurvatureEstimator(model, lm_loss, curv, opt, **kw)
        monitor = foreshock.Monitor("127.0.0.1:1", run_id=f"bench-{family}-{name}", job="bench",
                                    curvature=est)
        arms[name] = dict(model=model, opt=opt, est=est, monitor=monitor, steps=[], log=[])
        if est is not None:
            est.estimate = _recorded(est, arms[name]["log"])
    params = sum(p.numel() for p in arms["none"]["model"].parameters())
    for step in range(steps):
        for arm in arms.values():
            start = time.perf_counter()
            if arm["monitor"]._step_clock is not None:
                # The monitor times training between its step() calls; here the
                # other arms ran in between: restart its clock at this arm's step.
                arm["monitor"]._step_clock = start
            loss = lm_loss(arm["model"], data[step])
            arm["opt"].zero_grad(set_to_none=True)
            loss.backward()
            arm["opt"].step()
            arm["steps"].append(time.perf_counter() - start)
            if arm["est"] is not None:
                arm["est"].estimate.step = step
            arm["monitor"].step(step, loss=loss.detach())
    row = dict(family=family, params=params,
               step_ms=1e3 * sum(arms["none"]["steps"]) / steps)
    for name in ("before", "after"):
        arm = arms[name]
        stats = arm["monitor"].stats()
        est = arm["est"]
        row[name] = dict(
            estimates=est.estimates, at=[s for s, _ in arm["log"]],
            first_ms=1e3 * arm["log"][0][1],
            later_ms=(1e3 * sum(x for _, x in arm["log"][1:]) / (len(arm["log"]) - 1)
                      if len(arm["log"]) > 1 else None),
            pct=100 * stats["curvature_seconds_total"] / stats["train_seconds_total"],
            train_s=stats["train_seconds_total"], skipped=est.skipped_for_budget)
    # Accuracy: the next estimate from each arm's warm vector against a converged
    # reference on the same weights (the arms' weights are bit-identical).
    assert all(torch.equal(a, b) for a, b in zip(arms["before"]["model"].parameters(),
                                                 arms["after"]["model"].parameters()))
    ref_est = arms["before"]["est"]
    scales, _, _ = _optimizer_preconditioner(ref_est.optimizer, ref_est.params)
    with ref_est._products():
        start = [torch.randn(p.shape, generator=torch.Generator().manual_seed(5))
                 for p in ref_est.params]
        ref, ref_res, _, _ = _lanczos(lambda v: ref_est._apply(v, scales), start, 60)
    row["reference"], row["reference_residual"] = ref, ref_res
    for name in ("before", "after"):
        e = arms[name]["est"].estimate()
        row[name].update(final=e.lambda_max, final_residual=e.residual,
                         final_err=abs(e.lambda_max - ref) / abs(ref),
                         mode=arms[name]["est"].hvp_mode)
    for arm in arms.values():
        arm["monitor"].close(timeout=0.1)
    return row


def accuracy(family, steps, batch, seq, curv_seqs, gaps=(50, 100, 150, 300)):
    """The accuracy cost of a longer cadence: one model trains; estimators (3 HVPs,
    warm-started) at cadences `gaps` all estimate at the last step; each against a
    converged reference (60 cold Lanczos steps) on the same weights."""
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (steps + 1, batch, seq + 1), generator=g)
    curv = torch.randint(0, VOCAB, (curv_seqs, seq + 1), generator=g)
    model = build(family)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    ests = {gap: CurvatureEstimator(model, lm_loss, curv, opt, every=gap, budget=None,
                                    hvp_mode="double_backward") for gap in gaps}
    results = {}
    for step in range(steps + 1):
        loss = lm_loss(model, data[step])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        for gap, est in ests.items():
            if est.due(step):
                e = est.estimate()
                if step == steps:
                    results[gap] = e
    ref_est = ests[gaps[0]]
    scales, _, _ = _optimizer_preconditioner(opt, ref_est.params)
    with ref_est._products():
        start = [torch.randn(p.shape, generator=torch.Generator().manual_seed(5))
                 for p in ref_est.params]
        ref, ref_res, _, _ = _lanczos(lambda v: ref_est._apply(v, scales), start, 60)
    print(f"{family}, step {steps}: converged lambda_max {ref:.4g} (residual {ref_res:.1e})")
    for gap, e in results.items():
        print(f"  every {gap}: {e.lambda_max:.4g}, {100 * abs(e.lambda_max - ref) / abs(ref):.1f}% "
              f"off, residual {e.residual:.2f}, overlap with the last vector {e.overlap:.2f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--curv-seqs", type=int, default=2)
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--accuracy", action="store_true",
                   help="instead: the accuracy cost of cadences 50/100/150/300 at --steps")
    args = p.parse_args()
    if args.accuracy:
        torch.set_num_threads(1)
        for family in args.families.split(","):
            accuracy(family, args.steps, args.batch, args.seq, args.curv_seqs)
        return
    torch.set_num_threads(1)
    logging.getLogger("foreshock").setLevel(logging.ERROR)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; "
          f"{args.steps} steps of {args.batch} x {args.seq} tokens, curvature batch "
          f"{args.curv_seqs} x {args.seq}, AdamW, fp32, 1 thread")
    print("| model | params | step ms | ms per estimate (first; later) | before: cadence, "
          "% of step (run; steady) | after: estimates at steps, % of step (run; steady) | "
          "next estimate vs converged: before, after |")
    print("|---|---|---|---|---|---|---|")
    for family in args.families.split(","):
        r = run(family, args.steps, args.batch, args.seq, args.curv_seqs)
        b, a = r["before"], r["after"]
        later = b["later_ms"]
        step_ms = r["step_ms"]
        # Steady state: later estimates, amortized over the cadence the rule settles
        # on (before: 50; after: the smallest multiple of 50 within the budget).
        steady_b = 100 * later / (50 * step_ms)
        k = 1
        while later > BUDGET * k * 50 * step_ms:
            k += 1
        steady_a = 100 * later / (k * 50 * step_ms)
        print(f"| {family} | {r['params']:,} | {step_ms:.1f} | {b['first_ms']:.0f}; {later:.0f} | "
              f"every 50, {b['pct']:.1f}%; {steady_b:.1f}% | "
              f"{a['at']}, {a['pct']:.1f}%; every {k * 50}: {steady_a:.1f}% | "
              f"{100 * b['final_err']:.1f}%, {100 * a['final_err']:.1f}% "
              f"(converged {r['reference']:.3g}) |", flush=True)


if __name__ == "__main__":
    main()
