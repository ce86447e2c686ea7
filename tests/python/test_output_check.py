"""The attention output against an fp32 reference (foreshock.output_check,
QKSample.output_check, the daemon's attention_output_bias and
ForeshockAttentionRoundingBias).

The reference attention is checked against an independent numpy computation;
the means against numpy on known errors; round-to-nearest, truncation and the
demo's fault against the bound; and the whole path with a real daemon and a
real training run of the demo model.
"""
import numpy as np
import pytest
import torch

from demo import train
from demo.tiny_moe_gpt import causal_attention
from foreshock import output_check, prometheus

BF16_UNIT = 2.0 ** -8
FP16_UNIT = 2.0 ** -11


def numpy_attention(q, k, v, scale, causal):
    """softmax(q k^T * scale) v in float64 numpy, K/V repeated per query-head group."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    group = q.shape[-3] // k.shape[-3]
    k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    s = np.einsum("...id,...jd->...ij", q, k) * scale
    if causal:
        t = s.shape[-1]
        s = np.where(np.tril(np.ones((t, t), dtype=bool)), s, -np.inf)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return p @ v


@pytest.mark.parametrize("heads,kv_heads,causal,scale", [
    (4, 4, True, None), (6, 2, True, None), (2, 1, False, 0.1), (3, 3, False, None)])
def test_reference_attention_matches_numpy(heads, kv_heads, causal, scale):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q = torch.randn(2, heads, 24, 8, generator=g) * 2
    k = torch.randn(2, kv_heads, 24, 8, generator=g)
    v = torch.randn(2, kv_heads, 24, 8, generator=g)
    got = output_check.reference_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), scale, causal)
    assert got.dtype == torch.float32
    want = numpy_attention(q.bfloat16().float().numpy(), k.bfloat16().float().numpy(),
                           v.bfloat16().float().numpy(), 8 ** -0.5 if scale is None else scale,
                           causal)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def test_reference_attention_refuses_heads_that_do_not_group():
    with pytest.raises(ValueError, match="cannot share"):
        output_check.reference_attention(torch.ones(1, 3, 4, 2), torch.ones(1, 2, 4, 2),
                                         torch.ones(1, 2, 4, 2))


def test_the_three_means_match_numpy():
    g = torch.Generator().manual_seed(3)
    ref = torch.randn(2, 3, 16, 8, generator=g)
    out = ref + 0.01 * torch.randn(2, 3, 16, 8, generator=g) - 0.003 * torch.sign(ref)
    got = output_check.compare(out, ref)
    r, o = ref.double().numpy(), out.double().numpy()
    e = o - r
    assert got["elements"] == r.size
    assert got["mean_signed_error"] == pytest.approx(np.mean(e * np.sign(r)), rel=1e-12)
    assert got["rms_error"] == pytest.approx(np.sqrt(np.mean(e ** 2)), rel=1e-12)
    assert got["mean_abs_reference"] == pytest.approx(np.mean(np.abs(r)), rel=1e-12)
    assert got["mean_signed_error"] == pytest.approx(-0.003, abs=1e-3)
    assert output_check.compare(out[:1], ref) is None  # shapes differ: nothing to compare


def bias_in_units(stats, unit):
    """The daemon's attention_output_bias (detectors/qk_detector.cc): the mean
    signed error less 4 standard errors, floored at 0, in unit roundoffs."""
    standard_error = stats["rms_error"] / stats["elements"] ** 0.5
    bias = max(0.0, abs(stats["mean_signed_error"]) - 4 * standard_error)
    return bias / stats["mean_abs_reference"] / unit


@pytest.mark.parametrize("tokens,dim,heads", [(8, 8, 1), (64, 16, 4), (128, 32, 8)])
def test_round_to_nearest_stays_far_below_the_bound_and_truncation_above(tokens, dim, heads):
    """The daemon's bound is 0.25 unit roundoffs (alerts/default_config.cc). The demo's
    attention: healthy bf16/fp16 rounds P and O to nearest; the fault truncates."""
    g = torch.Generator().manual_seed(tokens + dim)
    q = torch.randn(2, heads, tokens, dim, generator=g) * 2
    k = torch.randn(2, heads, tokens, dim, generator=g)
    v = torch.randn(2, heads, tokens, dim, generator=g)

    def bias(unit, **kwargs):
        return bias_in_units(output_check.check(q, k, v, causal_attention(q, k, v, **kwargs)), unit)

    assert bias(BF16_UNIT) == 0.0  # exact attention is its own reference
    assert bias(BF16_UNIT, precision="bf16") < 0.1
    assert bias(FP16_UNIT, precision="fp16") < 0.1
    assert 0.5 < bias(BF16_UNIT, lowprec_strength=1.0) < 2.0  # truncation of P and O
    if tokens * dim * heads >= 1024:  # P alone errs less: seen on probes of some size
        assert 0.3 < bias(BF16_UNIT, lowprec_strength=1.0, on_out=False) < 1.0
    assert bias(BF16_UNIT, lowprec_strength=64.0) > 30  # the evaluation corpus's fault


def test_a_training_run_with_the_fault_raises_the_rounding_bias_alert(foreshockd):
    """A real run of the demo model: exact attention until step 150, then biased
    truncation (reported as bf16, the job the fault emulates). Before the
    fault the check reads 0; after it, far above the bound, and the alert
    fires on the second faulty probe with cause low_precision_attention."""
    sent = []
    args = train.parse_args(["--endpoint", foreshockd.endpoint, "--run-id", "rounding",
                             "--steps", "181", "--every", "10", "--fault", "lowprec",
                             "--fault-step", "150", "--fault-strength", "64", "--warmup", "5",
                             "--curvature-every", "0", "--log-every", "0", "--keep-run-open"])
    result = train.run(args, tap=sent.append, out=lambda *_: None)
    checks = {}
    for r in sent:
        if r.WhichOneof("payload") == "qk":
            assert r.qk.HasField("output_check")
            c = r.qk.output_check
            checks[(r.step, r.qk.layer)] = bias_in_units(
                dict(mean_signed_error=c.mean_signed_error, rms_error=c.rms_error,
                     mean_abs_reference=c.mean_abs_reference, elements=c.elements), BF16_UNIT)
    assert sorted({s for s, _ in checks}) == list(range(0, 181, 10))
    assert all(v == 0.0 for (s, _), v in checks.items() if s < 150), checks
    assert all(v > 10 for (s, _), v in checks.items() if s >= 150), checks

    samples, ok = foreshockd.wait_for(
        lambda s: any(name == "foreshock_alert_active" and value == 1
                      and labels.get("alertname") == "ForeshockAttentionRoundingBias"
                      for name, labels, value in s), timeout_s=30)
    assert ok, foreshockd.log_tail()
    got = {int(labels["layer"]): value for name, labels, value in samples
           if name == "foreshock_attention_output_bias" and labels.get("run") == "rounding"}
    assert sorted(got) == [0, 1, 2, 3]
    for layer, value in got.items():
        assert value == pytest.approx(checks[(180, layer)], rel=1e-9)
    firing = [e for e in result["alert_events"]
              if e.to_state == "firing" and e.alert.alertname == "ForeshockAttentionRoundingBias"]
    assert firing, [(e.alert.alertname, e.to_state) for e in result["alert_events"]]
    assert firing[0].alert.first_step == 150
    assert firing[0].alert.probable_cause == "low_precision_attention"


def test_without_the_check_the_daemon_has_no_bias_series(foreshockd):
    args = train.parse_args(["--endpoint", foreshockd.endpoint, "--run-id", "unchecked",
                             "--steps", "21", "--every", "10", "--no-output-check",
                             "--curvature-every", "0", "--log-every", "0"])
    sent = []
    train.run(args, tap=sent.append, out=lambda *_: None)
    assert not any(r.qk.HasField("output_check") for r in sent if r.WhichOneof("payload") == "qk")
    samples, ok = foreshockd.wait_for(
        lambda s: prometheus.value(s, "foreshock_last_step", run="unchecked") == 20, timeout_s=30)
    assert ok, foreshockd.log_tail()
    assert not [x for x in samples if x[0] == "foreshock_attention_output_bias"]
