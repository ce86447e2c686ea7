"""Sampled probes (Monitor(probe_heads=..., probe_tokens=...), foreshock.sampling):
which heads and tokens go on the wire, and, against a real foreshockd, that
each sampled head's series is that head's, computed as from the full probe."""
import json
import math
import urllib.request

import numpy as np
import pytest
import torch
import torch.nn as nn

from conftest import free_port
from foreshock import Monitor, encoding, sampling


def test_head_subsets_rotate_over_every_head_with_their_k_heads():
    seen = set()
    for p in range(sampling.probes_to_see_every_head(8, 3)):  # 3 probes
        heads, kv_heads, kv_row = sampling.head_subset(8, 2, 3, p)
        assert heads == sorted(heads) and len(heads) == 3
        # Query head h uses K head h // 4; kv_row points at it among the K heads sent.
        assert [kv_heads[r] for r in kv_row] == [h // 4 for h in heads]
        seen.update(heads)
    assert seen == set(range(8))
    assert sampling.head_subset(8, 2, 3, 2)[0] == [0, 6, 7]  # wraps around
    assert sampling.head_subset(8, 2, 8, 0) is None and sampling.head_subset(8, 2, None, 5) is None
    with pytest.raises(ValueError, match="probe_heads"):
        Monitor("127.0.0.1:1", run_id="r", job="j", probe_heads=0)


def test_token_subsets_keep_whole_sequences_or_a_prefix():
    q, k = torch.randn(4, 3 * 10, 2), torch.randn(2, 3 * 10, 2)  # 3 sequences of 10
    q2, k2, seq_len = sampling.token_subset(q, k, 10, 25)  # two whole sequences
    assert (q2.shape[1], k2.shape[1], seq_len) == (20, 20, 10)
    assert torch.equal(q2, q[:, :20]) and torch.equal(k2, k[:, :20])
    q2, k2, seq_len = sampling.token_subset(q, k, 10, 6)  # a prefix of the first
    assert (q2.shape[1], seq_len) == (6, 6) and torch.equal(q2, q[:, :6])
    q2, _, seq_len = sampling.token_subset(q, k, 0, 7)  # one sequence
    assert (q2.shape[1], seq_len) == (7, 0)
    assert sampling.token_subset(q, k, 10, 30)[0] is q


class GroupedAttention(nn.Module):
    """One causal GQA layer that hands its Q/K to the monitor: 8 query heads over 2 K heads."""

    def __init__(self, c=32, n_head=8, n_kv=2, vocab=17):
        super().__init__()
        self.n_head, self.n_kv, self.d = n_head, n_kv, c // n_head
        self.embed = nn.Embedding(vocab, c)
        self.q = nn.Linear(c, c, bias=False)
        self.k = nn.Linear(c, n_kv * self.d, bias=False)
        self.monitor = None
        self.last = None

    def forward(self, idx):
        b, t = idx.shape
        x = self.embed(idx)
        q = self.q(x).view(b, t, self.n_head, self.d).transpose(1, 2)
        k = self.k(x).view(b, t, self.n_kv, self.d).transpose(1, 2)
        self.last = (q.detach().clone(), k.detach().clone())
        if self.monitor is not None:
            self.monitor.capture_qk(0, q, k)
        return q.sum() + k.sum()


def attention_entropy(q, k, seq):
    """Mean causal softmax entropy of one head, q, k [N, d] of back-to-back sequences."""
    q, k = q.astype(np.float64), k.astype(np.float64)
    total, count = 0.0, 0
    for s in range(0, q.shape[0], seq):
        logits = q[s:s + seq] @ k[s:s + seq].T / math.sqrt(q.shape[1])
        logits = np.where(np.tril(np.ones((seq, seq), dtype=bool)), logits, -np.inf)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        total += float(-(np.where(p > 0, p * np.log(p), 0.0)).sum())
        count += seq
    return total / count


def test_sampled_probe_on_the_wire():
    torch.manual_seed(0)
    model = GroupedAttention()
    probe = torch.randint(0, 17, (3, 10))
    records = []
    monitor = Monitor(f"127.0.0.1:{free_port()}", run_id="s", job="t", model=model,
                      probe_batch=probe, every=1, tap=records.append, dtype="fp32",
                      discover=False, probe_heads=3, probe_tokens=25)
    model.monitor = monitor
    try:
        for step in range(3):
            monitor.step(step)
            q_full, k_full = model.last  # [B, H, T, d]
            (sample,) = [r.qk for r in records if r.step == step and r.HasField("qk")]
            heads, kv_heads, kv_row = sampling.head_subset(8, 2, 3, step)
            assert list(sample.heads) == heads and list(sample.kv_head_of) == kv_row
            assert sample.seq_len == 10
            q, k = encoding.decode_tensor(sample.q), encoding.decode_tensor(sample.k)
            assert q.shape == (3, 20, 4) and k.shape == (len(kv_heads), 20, 4)
            for row, h in enumerate(heads):  # the first two sequences of head h
                np.testing.assert_array_equal(q[row], q_full[:2, h].reshape(20, 4).numpy())
            for row, g in enumerate(kv_heads):
                np.testing.assert_array_equal(k[row], k_full[:2, g].reshape(20, 4).numpy())
    finally:
        monitor.close(timeout=0.1)


def test_every_sampled_head_reaches_the_daemon_as_itself(start_foreshockd):
    daemon = start_foreshockd("--per_head_metrics")
    torch.manual_seed(1)
    model = GroupedAttention()
    probe = torch.randint(0, 17, (3, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = Monitor(daemon.endpoint, run_id="sampled", job="t", model=model, probe_batch=probe,
                      every=1, discover=False, dtype="fp32", probe_heads=4, probe_tokens=20)
    model.monitor = monitor
    want = {}  # (step, head) -> attention entropy from the full probe's tensors
    try:
        # Heads 0-3, 4-7, 0-3, 4-7, ...: the window at head 0 comes back (a
        # subset, not "every head": the other heads keep their state).
        for step in range(6):
            monitor.step(step, loss=1.0)
            q_full, k_full = model.last
            for h in sampling.head_subset(8, 2, 4, step)[0]:
                want[(step, h)] = attention_entropy(q_full[:2, h].reshape(20, 4).numpy(),
                                                    k_full[:2, h // 4].reshape(20, 4).numpy(), 10)
            model.monitor = None
            loss = model(torch.randint(0, 17, (4, 10))) ** 2 * 1e-3
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            model.monitor = monitor
    finally:
        monitor.close(timeout=10)
    assert monitor.stats()["rejected"] == {}

    def points(signal, head):
        url = daemon.metrics_url.replace(
            "/metrics", f"/api/v1/points?run=sampled&signal={signal}&layer=0&head={head}")
        with urllib.request.urlopen(url, timeout=10) as response:
            return {int(p["step"]): p["value"] for p in json.loads(response.read())["points"]}

    def complete(_samples):
        try:
            return len(points("attention_entropy", 7)) == 3 and \
                len(points("qk_increment_entropy", 7)) == 2
        except OSError:
            return False

    daemon.wait_for(complete, timeout_s=30)
    for h in range(8):
        got = points("attention_entropy", h)
        expected = {s: v for (s, head), v in want.items() if head == h}
        assert sorted(got) == sorted(expected), h
        for s, v in expected.items():
            assert got[s] == pytest.approx(v, rel=1e-4), (h, s)
        # An increment once the head was seen twice: steps where its previous sample exists.
        seen = sorted(expected)
        assert sorted(points("qk_increment_entropy", h)) == seen[1:], h


def test_the_default_budget_samples_a_70b_shaped_probe_and_leaves_small_ones_whole():
    seventy_b = [(64, 8, 2 * 512, 128, 512)] * 80  # 80 layers, 2 x 512 tokens
    assert sampling.plan(seventy_b, 2, None)[2] > 1.5e9  # bf16, unsampled
    heads, tokens, size = sampling.plan(seventy_b, 2, 48 << 20)
    assert (heads, tokens) == (8, 256) and size <= 48 << 20
    # Exactly: 80 layers x (8 query heads + their 1 K head) x 256 tokens x 128 x 2 bytes.
    assert size == 80 * 9 * 256 * 128 * 2
    # Explicit choices are kept; the rest is fitted around them.
    assert sampling.plan(seventy_b, 2, 48 << 20, probe_tokens=512)[:2] == (2, 512)
    assert sampling.plan(seventy_b, 2, 48 << 20, probe_heads=16)[:2] == (16, 256)
    demo = [(4, 4, 2 * 64, 16, 64)] * 4
    assert sampling.plan(demo, 2, 48 << 20)[:2] == (None, None)


def test_a_probe_over_max_probe_bytes_is_sampled_and_says_so(caplog):
    torch.manual_seed(0)
    model = GroupedAttention()
    probe = torch.randint(0, 17, (2, 300))  # 600 tokens: over AUTO_TOKENS
    records = []
    budget = 3 * 256 * 4 * 4  # fp32: 2 query heads + 1 K head of 256 tokens
    monitor = Monitor(f"127.0.0.1:{free_port()}", run_id="s", job="t", model=model,
                      probe_batch=probe, every=1, tap=records.append, dtype="fp32",
                      discover=False, max_probe_bytes=budget)
    model.monitor = monitor
    try:
        with caplog.at_level("INFO", logger="foreshock"):
            monitor.step(0)
            monitor.step(1)
        samples = [r.qk for r in records if r.HasField("qk")]
        assert [list(s.heads) for s in samples] == [[0, 1], [2, 3]]
        assert all(s.q.shape[1] == 256 and s.seq_len == 256 for s in samples)  # a prefix
        assert all(len(s.q.data) + len(s.k.data) <= budget for s in samples)
        said = [r.getMessage() for r in caplog.records if "max_probe_bytes" in r.getMessage()]
        assert len(said) == 1 and "every head every 4 probes" in said[0], said
    finally:
        monitor.close(timeout=0.1)


def test_layers_are_sampled_as_they_are_captured(monkeypatch):
    """A large model's probe never holds every layer's whole Q/K: each layer
    is cut down (a copy, not a view of the whole) as it is captured."""
    from foreshock import ModelInfo, capture

    stored = []
    original = capture.ProbeCollector.add_qk

    def add_qk(self, store, layer, q, k, seq_len):
        original(self, store, layer, q, k, seq_len)
        stored.append(store[layer][:2])

    monkeypatch.setattr(capture.ProbeCollector, "add_qk", add_qk)
    torch.manual_seed(0)
    model = GroupedAttention()
    probe = torch.randint(0, 17, (2, 300))
    records = []
    budget = 3 * 256 * 4 * 4  # fp32: 2 query heads + 1 K head of 256 tokens
    monitor = Monitor(f"127.0.0.1:{free_port()}", run_id="s", job="t", model=model,
                      probe_batch=probe, every=1, tap=records.append, dtype="fp32",
                      discover=False, max_probe_bytes=budget,
                      model_info=ModelInfo(n_layers=1, n_heads=8, head_dim=4))
    model.monitor = monitor
    try:
        for step in range(3):
            monitor.step(step)
        # From the first probe on (model_info says 1 layer): 2 of 8 heads, 256 tokens.
        assert [tuple(q.shape) for q, _ in stored] == [(2, 256, 4)] * 3
        assert [tuple(k.shape) for _, k in stored] == [(1, 256, 4)] * 3
        assert all(q._base is None and k._base is None for q, k in stored)
        assert [list(r.qk.heads) for r in records if r.HasField("qk")] == [[0, 1], [2, 3], [4, 5]]
    finally:
        monitor.close(timeout=0.1)
