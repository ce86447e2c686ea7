#!/usr/bin/env python3
"""How far the per-layer QK values of sampled probes are from the full probe's.

A sampled probe (Monitor(probe_heads=..., probe_tokens=...), or the automatic
max_probe_bytes plan: client/python/foreshock/sampling.py) sends a rotating
window of each layer's query heads and a subset of its tokens. The daemon
pairs each head with its own previous sample (so a rotated head's increment
spans a whole rotation) and shows per layer the min or max over every head's
latest values (docs/DESIGN.md §4.4). This replays that on probe trajectories,
with the numpy reference of the daemon's math (tests/python/qk_reference.py;
the increment factored by thin QRs for large n), and compares the per-layer
value under each scheme with the full probe's at the same probe:

- the demo's TinyMoEGPT (Debian torch) trained on its corpus, probed every
  10 steps on 4 x 128 tokens (the row "heads 4/4, tokens 512/512" is the full
  probe itself: 0 by construction, a check of the harness);
- synthetic 70B-shaped layers: 64 query heads over 8 KV heads, head_dim 128,
  2 x 512 tokens; Q/K from shared token features with a power-law spectrum,
  mixed per head with varying sharpness, drifting by small low-rank updates
  between probes.

Scored from the probe after two full rotations on. Reported: median and max
over probes and layers of |sampled - full|, and the max relative to |full|.

    OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/bench/probe_sampling_accuracy.py
    OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/bench/probe_sampling_accuracy.py --quick
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "client", "python"), os.path.join(ROOT, "tests", "python"), ROOT]

import torch  # noqa: E402

import qk_reference as ref  # noqa: E402
from foreshock import sampling  # noqa: E402

SIGNALS = ("attention_entropy", "attention_max_logit", "qk_increment_entropy",
           "qk_increment_top1_share")
INCREMENTS = ("qk_increment_entropy", "qk_increment_top1_share")
# Columns: each signal against the full probe; the increments also against
# the full probe's increment over the same span (a rotation).
COLUMNS = SIGNALS + tuple(f"{s} (same span)" for s in INCREMENTS)


def increment_stats(q0, k0, q1, k1):
    """ref.increment_stats, factored (thin QRs: the same singular values up to
    rounding) so that n = 1024, d = 128 takes milliseconds, not seconds."""
    q0, k0, q1, k1 = (x.astype(np.float64) for x in (q0, k0, q1, k1))
    n, d = q0.shape
    a = np.hstack([q1 - q0, q0])
    b = np.hstack([k0, k1 - k0])
    ra = np.linalg.qr(a, mode="r")
    rb = np.linalg.qr(b, mode="r")
    sigma = np.linalg.svd(ra @ rb.T / np.sqrt(d), compute_uv=False)
    p = sigma / sigma.sum()
    nz = p[p > 0]
    entropy = float(-(nz * np.log(nz)).sum())
    return dict(qk_increment_entropy=entropy / np.log(2 * d),
                qk_increment_top1_share=float(sigma[0] ** 2 / (sigma ** 2).sum()))


def head_values(q0, k0, q1, k1, kv_of, seq_len, heads):
    """{head: {signal: value}}: attention at the second sample, the increment
    from the first, for the given query heads of q [H, n, d], k [Hkv, n, d]."""
    out = {}
    for h in heads:
        g = kv_of[h]
        values = increment_stats(q0[h], k0[g], q1[h], k1[g])
        values["attention_entropy"], values["attention_max_logit"] = \
            ref.attention_stats(q1[h], k1[g], True, seq_len)
        out[h] = values
    return out


def layer_value(latest):
    """The daemon's per-layer value: over every head's latest values."""
    return {s: ref.AGGREGATION.get(s, max)(v[s] for v in latest.values()) for s in SIGNALS}


def compare(trajectories, schemes):
    """trajectories: per layer, a list of probes (q [H, n, d], k [Hkv, n, d],
    seq_len). schemes: (per_probe heads or None, token limit or None).
    At every probe after the first two rotations, the per-layer value the
    daemon shows under the scheme (each head's latest sample: rotated heads
    from up to one rotation ago, their increments spanning a rotation)
    against the full probe's (every head, consecutive probes).
    Returns {(scheme, signal): [(abs diff, rel diff)]}."""
    diffs = {}
    for probes in trajectories:
        h, hkv = probes[0][0].shape[0], probes[0][1].shape[0]
        kv_of = [i // (h // hkv) for i in range(h)]
        full = [None] + [layer_value(head_values(*probes[t - 1][:2], *probes[t][:2], kv_of,
                                                 probes[t][2], range(h)))
                         for t in range(1, len(probes))]
        spans = {}
        for per_probe, tokens in schemes:
            period = sampling.probes_to_see_every_head(h, per_probe)
            if period not in spans:  # the full probe's increments over `period` probes
                spans[period] = [None] * period + [
                    layer_value(head_values(*probes[t - period][:2], *probes[t][:2], kv_of,
                                            probes[t][2], range(h)))
                    for t in range(period, len(probes))]
            sub = []
            for q, k, seq_len in probes:
                qs, ks, seq = sampling.token_subset(torch.from_numpy(q), torch.from_numpy(k),
                                                    seq_len, tokens)
                sub.append((qs.numpy(), ks.numpy(), seq))
            last_seen, latest = {}, {}
            name = (f"heads {per_probe or h}/{h}, tokens {sub[0][0].shape[1]}/"
                    f"{probes[0][0].shape[1]}")
            for t in range(len(probes)):
                window = sampling.head_subset(h, hkv, per_probe, t)
                window = range(h) if window is None else window[0]
                for head in window:
                    if head in last_seen:
                        t0 = last_seen[head]
                        latest[head] = head_values(*sub[t0][:2], *sub[t][:2], kv_of, sub[t][2],
                                                   [head])[head]
                    last_seen[head] = t
                if t >= 2 * period and len(latest) == h:
                    got = layer_value(latest)
                    for s in SIGNALS:
                        diff = abs(got[s] - full[t][s])
                        diffs.setdefault((name, s), []).append((diff, diff / abs(full[t][s])))
                    for s in INCREMENTS:
                        want = spans[period][t][s]
                        diffs.setdefault((name, f"{s} (same span)"), []).append(
                            (abs(got[s] - want), abs(got[s] - want) / abs(want)))
    return diffs


def demo_trajectories(steps, probe_every, probes):
    """Q/K of the demo model's layers at its last `probes` probes, `probe_every` steps apart."""
    from demo import tiny_moe_gpt as tmg
    from foreshock import Monitor, encoding

    torch.manual_seed(0)
    text = tmg.load_text("gnu")
    vocab = tmg.CharVocab([text])
    data = tmg.CharDataset(vocab.encode(text), block_size=128)
    model = tmg.TinyMoEGPT(tmg.GPTConfig(vocab_size=len(vocab), block_size=128))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    probe = data.probe_batch(4)
    generator = torch.Generator().manual_seed(1)
    records = []
    monitor = Monitor("127.0.0.1:1", run_id="acc", job="acc", model=model, probe_batch=probe,
                      every=probe_every, tap=records.append, dtype="fp32", max_probe_bytes=None,
                      discover=False, discover_routers=False, backoff_initial_s=60)
    model.set_qk_hook(monitor.capture_qk)
    try:
        for step in range(1, steps + 1):
            x, y = data.batch(16, generator)
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     y.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step > steps - probes * probe_every:
                monitor.step(step)
    finally:
        monitor.close(timeout=0)
    by_step = {}
    for r in records:
        if r.HasField("qk"):
            by_step.setdefault(r.step, {})[r.qk.layer] = r.qk
    steps_probed = sorted(by_step)
    return [[(encoding.decode_tensor(by_step[t][layer].q), encoding.decode_tensor(by_step[t][layer].k),
              by_step[t][layer].seq_len) for t in steps_probed]
            for layer in sorted(by_step[steps_probed[-1]])]


def synthetic_70b_trajectories(count, probes, tokens=1024, seq_len=512, heads=64, kv=8, d=128,
                               rank=256, seed=0):
    """Per layer, `probes` samples of a 70B-shaped layer: Q/K from shared token
    features (power-law spectrum) mixed per head (heads differ in sharpness:
    logits of a few to tens), drifting by small low-rank updates."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        z = rng.standard_normal((tokens, rank)) * (np.arange(1, rank + 1) ** -0.5)
        scale = np.exp(rng.normal(0, 0.4, heads))
        wq = rng.standard_normal((heads, rank, d)) * (0.5 * scale[:, None, None])
        wk = rng.standard_normal((kv, rank, d)) * 0.5
        trajectory = []
        for _ in range(probes):
            q = np.einsum("nr,hrd->hnd", z, wq).astype(np.float32)
            k = np.einsum("nr,hrd->hnd", z, wk).astype(np.float32)
            trajectory.append((q, k, seq_len))
            wq = wq + rng.standard_normal((heads, rank, 4)) @ rng.standard_normal((heads, 4, d)) * 0.01
            wk = wk + rng.standard_normal((kv, rank, 4)) @ rng.standard_normal((kv, 4, d)) * 0.01
        out.append(trajectory)
    return out


def table(title, diffs):
    print(f"\n{title}\n")
    print("| sampled | " + " | ".join(COLUMNS) + " |")
    print("|---|" + "---|" * len(COLUMNS))
    for what in dict.fromkeys(w for w, _ in diffs):  # in the order measured
        cells = []
        for s in COLUMNS:
            values = diffs[(what, s)]
            med_abs = statistics.median(a for a, _ in values)
            max_abs = max(a for a, _ in values)
            max_rel = max(r for _, r in values)
            cells.append(f"{med_abs:.3g} / {max_abs:.3g} ({100 * max_rel:.2g}%)")
        print(f"| {what} | " + " | ".join(cells) + " |")
    print("\ncells: median / max over probes and layers of |sampled - full| "
          "(max relative to |full|)")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer layers and probes (a smoke run)")
    args = p.parse_args()
    start = time.time()
    demo = demo_trajectories(steps=120 if args.quick else 400, probe_every=10,
                             probes=10 if args.quick else 24)
    q = demo[0][0][0]
    table(f"demo TinyMoEGPT: {len(demo)} layers x {len(demo[0])} probes 10 steps apart, "
          f"{q.shape[0]} heads, {q.shape[1]} tokens (4 x 128), head_dim {q.shape[2]}",
          compare(demo, [(None, None), (2, None), (1, None), (None, 256), (None, 128),
                         (2, 256)]))
    synthetic = synthetic_70b_trajectories(1 if args.quick else 2, probes=20 if args.quick else 26)
    table(f"synthetic 70B-shaped layers: 64 heads over 8 KV heads, head_dim 128, 2 x 512 tokens, "
          f"{len(synthetic)} layer(s) x {len(synthetic[0])} probes",
          compare(synthetic, [(32, None), (8, None), (None, 256), (8, 256)]))
    print(f"\n{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
