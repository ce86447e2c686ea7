"""The emulated bf16 FlashAttention fault (demo/tiny_moe_gpt.py FlashRTNAttention,
train.py --fault lowprec_rtn): round-to-nearest P-bar V is biased where P-bar holds
several exact ones (row-max ties) and the tied V entries share a sign, and unbiased
otherwise (docs/evaluation/HISTORY.md, "Precision faults at realistic strength")."""
import torch

from demo import tiny_moe_gpt as tmg
from demo import train

ROWS, KEYS, DIM = 4096, 64, 16


def concentrated_logits(n_ties, generator):
    """Rows whose attention sits on `n_ties` keys at the row max (0), the rest 12-16
    below it (a tail far under a bf16 unit of the output, as in a row that has
    collapsed onto a few similar keys). n_ties 0: a unique max and a second key
    0.1-1 below it, so the leading sum has no structure in its low bits."""
    s = -12.0 - 4.0 * torch.rand(ROWS, KEYS, generator=generator)
    pos = torch.argsort(torch.rand(ROWS, KEYS, generator=generator), dim=1)
    if n_ties:
        s.scatter_(1, pos[:, :n_ties], 0.0)
    else:
        s.scatter_(1, pos[:, :1], 0.0)
        s.scatter_(1, pos[:, 1:2], -0.1 - 0.9 * torch.rand(ROWS, 1, generator=generator))
    return tmg.round_bf16(s)


ULP = 2.0 ** -7  # bf16's unit in the last place on [1, 2), where |O| is here


def mean_error_in_ulps(s, v, block=16):
    """Mean signed error of the emulated kernel's O against fp64 softmax(S) V (V as
    the kernel reads it, in bf16), in units of ULP, and its standard error. (Absolute
    units: an error divided by the ulp of each exact value is biased near powers of 2.)"""
    o = tmg.flash_rtn_bf16(s, v, block).double()
    exact = torch.softmax(s.double(), dim=-1) @ tmg.round_bf16(v).double()
    err = (o - exact) / ULP
    return err.mean().item(), err.std().item() / err.numel() ** 0.5


def values(sign, generator):
    """V with every column of one sign (sign -1 or +1: |V| in about [1.2, 1.8]), or
    of mixed sign (0)."""
    v = 0.1 * torch.randn(ROWS, KEYS, DIM, generator=generator)
    return v + 1.5 * sign if sign else v


def test_ties_in_p_bar_bias_the_output_toward_the_sign_of_v():
    g = torch.Generator().manual_seed(0)
    for sign in (-1.0, 1.0):
        for n_ties in (2, 3, 4):
            s = concentrated_logits(n_ties, g)
            # P-bar holds exactly n_ties ones per row.
            p_bar = tmg.round_bf16(torch.exp(s - s.amax(-1, keepdim=True)))
            assert torch.equal((p_bar == 1).sum(-1), torch.full((ROWS,), n_ties))
            mean, se = mean_error_in_ulps(s.view(ROWS, 1, KEYS), values(sign, g))
            # The sum of tied bf16 values lands on half-unit ties that the tail,
            # of the same sign, breaks away from zero: |O| too large, on average.
            assert sign * mean > 0.04, (sign, n_ties, mean)
            assert abs(mean) > 20 * se


def test_without_ties_or_with_mixed_signs_round_to_nearest_is_unbiased():
    g = torch.Generator().manual_seed(1)
    s = concentrated_logits(0, g)
    assert torch.equal((tmg.round_bf16(torch.exp(s - s.amax(-1, keepdim=True))) == 1).sum(-1),
                       torch.ones(ROWS, dtype=torch.long))
    for sign in (-1.0, 1.0):
        mean, se = mean_error_in_ulps(s.view(ROWS, 1, KEYS), values(sign, g))
        assert abs(mean) < 0.02, (sign, mean)
    mean, se = mean_error_in_ulps(concentrated_logits(2, g).view(ROWS, 1, KEYS), values(0.0, g))
    assert abs(mean) < 0.02, mean


def test_flash_blocks_equal_attention_up_to_bf16_rounding():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 40, 8, generator=g) for _ in range(3))
    s = tmg.kernel_logits(q, k)
    exact = torch.softmax(s.double(), -1) @ tmg.round_bf16(v).double()
    for block in (7, 16, 40):
        o = tmg.flash_rtn_bf16(s, v, block)
        assert torch.equal(o, tmg.round_bf16(o))  # a bf16 output
        assert (o.double() - exact).abs().max() < 0.05


def test_tie_window_makes_row_max_ties_and_strength_scales_the_error():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 32, 16, generator=g) for _ in range(3))
    plain = tmg.kernel_logits(q, k)
    tied = tmg.kernel_logits(q, k, tie_window=0.5)
    ties = lambda s: ((s == s.amax(-1, keepdim=True)).sum(-1) >= 2).float().mean()  # noqa: E731
    assert ties(tied) > 0.3 > ties(plain)
    o_ref = torch.softmax(tied, -1) @ v
    o1 = tmg.FlashRTNAttention.apply(q, k, v, 1.0, 0.5)
    o8 = tmg.FlashRTNAttention.apply(q, k, v, 8.0, 0.5)
    assert torch.equal(o1, o_ref + (tmg.flash_rtn_bf16(tied, v) - o_ref))
    assert torch.allclose(o8 - o_ref, 8 * (o1 - o_ref), atol=1e-6)
    assert (o1 - o_ref).abs().max() > 0


def test_backward_takes_d_from_the_faulty_output():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g).requires_grad_() for _ in range(3))
    d_o = torch.randn(1, 2, 16, 8, generator=g)
    o = tmg.FlashRTNAttention.apply(q, k, v, 24.0, 0.0)
    o.backward(d_o)
    # Same P, same dO: only D = rowsum(dO * O) differs from attention on the exact
    # output, so dQ differs while dV (P^T dO) does not.
    s = tmg.kernel_logits(q.detach(), k.detach())
    p = torch.softmax(s, -1)
    d_p = d_o @ v.detach().transpose(-2, -1)
    for out, same in ((o.detach(), True), (p @ v.detach(), False)):
        d_s = p * (d_p - (d_o * out).sum(-1, keepdim=True))
        assert torch.allclose(q.grad, d_s @ k.detach() * 8 ** -0.5, atol=1e-5) == same
    assert torch.allclose(v.grad, p.transpose(-2, -1) @ d_o, atol=1e-6)


def test_train_fault_turns_the_emulation_on_at_the_fault_step_and_reports_bf16():
    args = train.parse_args(["--endpoint", "", "--fault", "lowprec_rtn", "--fault-step", "3",
                             "--fault-strength", "2", "--rtn-tie-window", "0.25",
                             "--steps", "5", "--log-every", "0", "--curvature-every", "0",
                             "--n-layer", "2", "--d-model", "32", "--block-size", "16",
                             "--batch-size", "2"])
    assert train.reported_attention_dtype(args) == "bf16"
    before = dict(tmg.RTN_TIE_STATS)
    result = train.run(args, out=lambda *_: None)
    attn = [b.attn for b in result["model"].blocks]
    assert [(a.rtn_strength, a.rtn_tie_window) for a in attn] == [(2.0, 0.25)] * 2
    assert tmg.RTN_TIE_STATS["rows"] > before["rows"]
    assert tmg.RTN_TIE_STATS["tie_rows"] > before["tie_rows"]
