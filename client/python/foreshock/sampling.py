"""What of a layer's Q/K a probe sends: a rotating subset of the query heads
and a subset of the tokens (Monitor(probe_heads=..., probe_tokens=...)).

Frontier-sized probes are large: a 70B-class model (80 layers, 64 query
heads, 8 KV heads, head_dim 128) probed on 2 x 512 tokens is ~1.3 GB of bf16
Q and K per probe. Sampling keeps the wire and the daemon's work small while
every head is still seen every few probes:

- Heads: probe number p sends the query heads p*n .. p*n + n - 1 (mod H),
  ascending, named in QKSample.heads; with them only the K heads they attend
  with, and QKSample.kv_head_of pairs each query head with its K row. Every
  head is seen every ceil(H / n) probes; the daemon pairs each head with its
  own previous sample, so a head's increment spans ceil(H / n) probe
  intervals.
- Tokens: whole sequences of the probe batch, then, if one sequence is
  already over the budget, its first tokens. For causal attention a prefix is
  exact: the kept queries attend to the same keys as in the full probe. The
  same tokens every probe (increments compare like with like).

docs/PERFORMANCE.md ("Sampled probes") has the measured accuracy against the
full probe.
"""
import functools
import math


def check(value, name):
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    return value


def token_subset(q, k, seq_len, max_tokens):
    """q [H, N, d], k [Hkv, N, d] with N = sequences x seq_len (seq_len 0: one
    sequence): the first whole sequences within max_tokens, or the first
    max_tokens tokens of the first one. Returns (q, k, seq_len)."""
    n = q.shape[1]
    if max_tokens is None or n <= max_tokens:
        return q, k, seq_len
    length = seq_len if seq_len and n % seq_len == 0 else n
    if max_tokens >= length:
        keep = (max_tokens // length) * length
        return q[:, :keep], k[:, :keep], seq_len
    # One sequence is over the budget: its prefix (exact for causal attention).
    return q[:, :max_tokens], k[:, :max_tokens], (max_tokens if seq_len else 0)


def head_subset(n_heads, n_kv, per_probe, probe_index):
    """The query heads probe number `probe_index` sends (ascending), the K
    heads they use (ascending) and, per query head, its row among those K
    heads; None when every head is sent. Query head h uses K head
    h // (n_heads / n_kv), the layout of HF's repeat_kv."""
    if per_probe is None or per_probe >= n_heads:
        return None
    start = (probe_index * per_probe) % n_heads
    heads = sorted((start + i) % n_heads for i in range(per_probe))
    group = n_heads // n_kv
    kv_heads = sorted({h // group for h in heads})
    row = {kv: i for i, kv in enumerate(kv_heads)}
    return heads, kv_heads, [row[h // group] for h in heads]


def probes_to_see_every_head(n_heads, per_probe):
    return 1 if per_probe is None or per_probe >= n_heads else math.ceil(n_heads / per_probe)


# Without probe_tokens, a probe over max_probe_bytes first keeps this many
# tokens: n >= 2 * head_dim up to head_dim 128 (the increment's full rank),
# and causal prefixes long enough for the attention statistics.
AUTO_TOKENS = 256


def layer_bytes(n_heads, n_kv, tokens, head_dim, itemsize, per_probe):
    """Q/K bytes of one layer's sample with `per_probe` query heads (None: all)."""
    if per_probe is None or per_probe >= n_heads:
        rows = n_heads + n_kv
    else:
        rows = per_probe + _most_kv_heads(n_heads, n_kv, per_probe)
    return rows * tokens * head_dim * itemsize


@functools.lru_cache(maxsize=256)
def _most_kv_heads(n_heads, n_kv, per_probe):
    """The most K heads any probe of the rotation needs (the window start
    p * per_probe mod n_heads repeats within n_heads probes)."""
    return max(len(head_subset(n_heads, n_kv, per_probe, p)[1]) for p in range(n_heads))


def plan(layers, itemsize, max_bytes, probe_heads=None, probe_tokens=None):
    """How much of a probe to send so that its Q/K fit `max_bytes`.

    layers: (n_heads, n_kv, tokens, head_dim, seq_len) per layer. Explicit
    probe_heads / probe_tokens are kept; what is unset is chosen: first at
    most AUTO_TOKENS tokens, then the most query heads per probe that fit.
    Returns (probe_heads, probe_tokens, bytes), None meaning all."""
    def kept_tokens(n, seq_len, limit):
        if limit is None or n <= limit:
            return n
        length = seq_len if seq_len and n % seq_len == 0 else n
        return (limit // length) * length if limit >= length else limit

    def total(heads, tokens):
        return sum(layer_bytes(h, kv, kept_tokens(n, s, tokens), d, itemsize, heads)
                   for h, kv, n, d, s in layers)

    heads, tokens = probe_heads, probe_tokens
    if max_bytes is None or not layers or total(heads, tokens) <= max_bytes:
        return heads, tokens, total(heads, tokens)
    if tokens is None and max(n for _, _, n, _, _ in layers) > AUTO_TOKENS:
        tokens = AUTO_TOKENS
    if heads is None and total(heads, tokens) > max_bytes:
        most = max(h for h, _, _, _, _ in layers)
        heads = 1
        for candidate in range(most - 1, 0, -1):
            if total(candidate, tokens) <= max_bytes:
                heads = candidate
                break
    return heads, tokens, total(heads, tokens)
