"""Numpy reference of the per-head QK quantities of docs/DESIGN.md §1.1.

Deliberately the slow, direct way: dense n x n matrices and a full SVD, so it
checks the daemon's factored computation rather than repeating it.
"""
import numpy as np


def block_causal_mask(n, causal, seq_len):
    """allowed[i, j]: query i may attend key j (same sequence; j <= i if causal)."""
    seq = np.arange(n) // seq_len if seq_len > 0 else np.zeros(n, dtype=int)
    allowed = seq[:, None] == seq[None, :]
    if causal:
        allowed &= np.arange(n)[None, :] <= np.arange(n)[:, None]
    return allowed


def attention_stats(q, k, causal, seq_len):
    """(mean over queries of the softmax entropy in nats, max allowed logit) of one head."""
    q, k = q.astype(np.float64), k.astype(np.float64)
    s = q @ k.T / np.sqrt(q.shape[1])
    allowed = block_causal_mask(q.shape[0], causal, seq_len)
    masked = np.where(allowed, s, -np.inf)
    shifted = masked - masked.max(axis=1, keepdims=True)
    p = np.exp(shifted)
    p /= p.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(p > 0, p * np.log(p), 0.0)
    return float(-plogp.sum(axis=1).mean()), float(s[allowed].max())


def increment_stats(q0, k0, q1, k1):
    """Spectral statistics of dS1 = (dQ K0^T + Q0 dK^T)/sqrt(d) of one head."""
    q0, k0, q1, k1 = (x.astype(np.float64) for x in (q0, k0, q1, k1))
    n, d = q0.shape
    dq, dk = q1 - q0, k1 - k0
    ds1 = (dq @ k0.T + q0 @ dk.T) / np.sqrt(d)
    second = dq @ dk.T / np.sqrt(d)
    sigma = np.linalg.svd(ds1, compute_uv=False)[:min(n, 2 * d)]  # rank <= 2d
    p = sigma / sigma.sum()
    nz = p[p > 0]
    entropy = float(-(nz * np.log(nz)).sum())
    return dict(
        qk_increment_entropy=entropy / np.log(2 * d),
        qk_increment_effective_rank=float(np.exp(entropy)),
        qk_increment_top1_share=float(sigma[0] ** 2 / (sigma ** 2).sum()),
        qk_second_order_ratio=float(np.linalg.norm(second) / np.linalg.norm(ds1)),
    )


# How each per-head value folds into the layer value (docs/DESIGN.md §4.4).
AGGREGATION = {
    "qk_increment_entropy": min,
    "qk_increment_effective_rank": min,
    "qk_increment_top1_share": max,
    "qk_second_order_ratio": max,
    "attention_entropy": min,
    "attention_max_logit": max,
}


def layer_signals(q0, k0, q1, k1, causal, seq_len):
    """Layer aggregates of every QK signal, from [H, n, d] samples (previous, current)."""
    per_head = []
    for h in range(q1.shape[0]):
        values = increment_stats(q0[h], k0[h], q1[h], k1[h])
        values["attention_entropy"], values["attention_max_logit"] = \
            attention_stats(q1[h], k1[h], causal, seq_len)
        per_head.append(values)
    return {name: agg(v[name] for v in per_head) for name, agg in AGGREGATION.items()}
