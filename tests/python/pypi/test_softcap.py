"""Soft-capped attention (issue 26): Gemma 2 caps its logits at
attn_logit_softcapping (cap * tanh(x / cap)); the client sends the cap
(QKSample.logit_softcap) and the daemon judges the max logit of the capped
logits, so a run whose logits sit at the cap (50) raises no logit alert
against the bound 100. A tiny random-init Gemma 2 whose Q/K projections are
scaled up (raw logits far above 100), trained a few steps under bf16 autocast
(bf16 attention: the logit alert is not held for corroboration), real daemon."""
import json
import math
import os
import urllib.request

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from conftest import wait_until  # noqa: E402
from foreshock import Monitor, encoding  # noqa: E402

VOCAB, SEQ, CAP, STEPS = 64, 12, 50.0, 20


def _gemma2():
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        attn_logit_softcapping=CAP, final_logit_softcapping=None, query_pre_attn_scalar=8,
        sliding_window=64)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config)
    with torch.no_grad():  # logits far beyond the bound before the cap
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(80)
            layer.self_attn.k_proj.weight.mul_(80)
    return model


def _raw_max_logit(sample):
    q = encoding.decode_tensor(sample.q).astype(np.float64)
    k = encoding.decode_tensor(sample.k).astype(np.float64)
    k = np.repeat(k, q.shape[0] // k.shape[0], axis=0)
    h, n, d = q.shape
    t = sample.seq_len
    q, k = q.reshape(h, n // t, t, d), k.reshape(h, n // t, t, d)
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d)
    return float(s[..., np.tril(np.ones((t, t), dtype=bool))].max())  # causal, as the daemon

def test_gemma2_logits_at_the_cap_raise_no_logit_alert(foreshockd_from_step_0):
    model = _gemma2()
    records = []
    tokens = torch.randint(0, VOCAB, (2 * STEPS, SEQ), generator=torch.Generator().manual_seed(1))
    monitor = Monitor(foreshockd_from_step_0.endpoint, run_id="gemma2", job="test", model=model,
                      probe_batch=tokens[:2], every=1, tap=records.append)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    try:
        for step in range(STEPS):
            batch = tokens[2 * step:2 * step + 2]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step(step, loss=loss.item())
        qk = [r.qk for r in records if r.WhichOneof("payload") == "qk"]
        assert qk and all(s.logit_softcap == CAP for s in qk)
        assert min(_raw_max_logit(s) for s in qk) > 100  # uncapped, they would fire

        def max_logits(samples):
            got = {int(l["layer"]): v for n, l, v in samples
                   if n == "foreshock_attention_max_logit" and l.get("run") == "gemma2"
                   and "head" not in l}
            return got if len(got) == 2 else None
        url = foreshockd_from_step_0.metrics_url.replace("/metrics", "/api/v1/runs")
        assert wait_until(lambda: any(r["run"] == "gemma2" and int(r["last_step"]) == STEPS - 1
                                      for r in json.loads(urllib.request.urlopen(url).read())["runs"]),
                          timeout_s=30)
        samples, got = foreshockd_from_step_0.wait_for(max_logits, timeout_s=30)
        assert got and all(0.9 * CAP < v <= CAP for v in got.values()), got  # at the cap
        bits = [v for n, l, v in samples
                if n == "foreshock_attention_compute_bits" and l.get("run") == "gemma2"]
        assert bits == [16.0, 16.0]  # bf16: nothing is held for corroboration
        url = foreshockd_from_step_0.metrics_url.replace("/metrics",
                                             "/api/v1/alerts?run=gemma2&include_resolved=true")
        alerts = json.loads(urllib.request.urlopen(url).read())["alerts"]
        assert not [a for a in alerts if a["alertname"] == "ForeshockAttentionLogitGrowth"], alerts
    finally:
        monitor.close()
