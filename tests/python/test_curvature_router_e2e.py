"""Router and curvature through the real daemon from a real torch training run
of the demo model: what /metrics shows equals what the client computed and sent."""
import math

from demo import train
from foreshock import prometheus

RUN = "curv-router-e2e"


def test_router_and_curvature_reach_metrics(foreshockd):
    sent = []
    args = train.parse_args(["--endpoint", foreshockd.endpoint, "--run-id", RUN, "--steps", "41",
                             "--every", "10", "--curvature-every", "20", "--warmup", "10",
                             "--log-every", "0"])
    result = train.run(args, tap=sent.append, out=lambda *_: None)
    stats = result["stats"]
    assert stats["curvature_estimates"] == 3 and stats["acked_records"] == len(sent), stats

    curvature = [r for r in sent if r.WhichOneof("payload") == "curvature"]
    assert [r.step for r in curvature] == [0, 20, 40]
    last = curvature[-1].curvature
    # At least --curvature-hvps products, more while the residual is high (up to 3x).
    assert last.preconditioned and 3 <= last.hvps <= 9 and last.beta1 == 0.9
    assert len(last.layer_rayleigh) == 4  # one per transformer block
    routers = [r for r in sent if r.WhichOneof("payload") == "router"]
    assert sorted({r.router.layer for r in routers}) == [1, 3]  # the MoE layers, discovered

    samples, ok = foreshockd.wait_for(
        lambda s: prometheus.value(s, "foreshock_last_step", run=RUN) == 40
        and prometheus.value(s, "foreshock_curvature_hvps", run=RUN) is not None)
    assert ok, "the daemon never caught up"
    lam = prometheus.value(samples, "foreshock_curvature_lambda_max", run=RUN)
    assert math.isclose(lam, last.lambda_max, rel_tol=1e-12)
    tau = (2 + 2 * last.beta1) / ((1 - last.beta1) * last.lr)
    assert math.isclose(prometheus.value(samples, "foreshock_curvature_eos_ratio", run=RUN),
                        last.lambda_max / tau, rel_tol=1e-9)
    for block, value in enumerate(last.layer_rayleigh):
        got = prometheus.value(samples, "foreshock_curvature_block_rayleigh", run=RUN,
                               block=str(block))
        assert math.isclose(got, value, rel_tol=1e-12), block
    converged = prometheus.value(samples, "foreshock_curvature_converged", run=RUN)
    assert converged == (1.0 if last.residual <= 0.1 else 0.0)
    for layer in ("1", "3"):
        for metric in ("router_entropy", "router_load_cv", "router_flip_rate", "router_z_loss",
                       "router_topk_margin", "router_max_violation", "router_dead_experts"):
            value = prometheus.value(samples, f"foreshock_{metric}", run=RUN, layer=layer)
            assert value is not None and math.isfinite(value), (metric, layer)
    # Baselines run on the same scalars: a healthy 41-step run raises none.
    assert prometheus.value(samples, "foreshock_baseline_nonfinite", run=RUN) == 0.0
    assert prometheus.value(samples, "foreshock_baseline_megatron_spiky_loss", run=RUN) == 0.0
    # The alert engine scored the run's layer aggregates and run-level values.
    scored = prometheus.value(foreshockd.scrape(), "foreshock_alert_points_total", outcome="scored")
    assert scored is not None and scored > 0
