"""A persisting fault in real HF training keeps a firing alert until the run
ends (issue 26: with LR x30/x50 from a step on, ForeshockLearningRateSurge
resolved ~30 steps later and runs that had diverged ended with no firing
alert; without `lr=` only a ForeshockLossSpike fired, resolved 18 steps
later). A tiny random-init HF Llama/Mistral (~90K parameters) learns
text-like sequences (arithmetic progressions mod the vocabulary) with AdamW;
from step FAULT on the LR is x40 and stays there, and the loss diverges
(from ~0.16 to ~4, every seed tried). The Monitor streams loss, grad norm
and (first case) the LR to a real foreshockd; at the last step, before
close(), /api/v1/alerts must show ForeshockLearningRateSurge and
ForeshockLossDiverging firing, never resolved in between."""
import json
import os
import urllib.request

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from conftest import wait_until  # noqa: E402
from foreshock import Monitor  # noqa: E402

VOCAB, SEQ, BATCH = 128, 32, 8
LR, SURGE, FAULT, STEPS = 3e-3, 40, 130, 200  # loss_over_running_min starts at the 101st sample
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _model(family):
    config = getattr(transformers, f"{family}Config")(**SMALL)
    torch.manual_seed(0)
    return getattr(transformers, f"{family}ForCausalLM")(config)


def _batch(generator, n=BATCH):
    """Text-like rows: x, x+d, x+2d, ... mod VOCAB, random start x and stride d in 1..3."""
    start = torch.randint(0, VOCAB, (n, 1), generator=generator)
    stride = torch.randint(1, 4, (n, 1), generator=generator)
    return (start + stride * torch.arange(SEQ)) % VOCAB


def _http(daemon, path):
    url = daemon.metrics_url.replace("/metrics", path)
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def _last_step(daemon, run):
    runs = {r["run"]: r for r in _http(daemon, "/api/v1/runs")["runs"]}
    return int(runs[run]["last_step"]) if run in runs else -1


def _train(daemon, family, run, stream_lr):
    """Trains STEPS steps, LR x SURGE from FAULT on; returns the monitor, still open,
    once the daemon has taken in the last step, and the losses."""
    model = _model(family)
    generator = torch.Generator().manual_seed(1)
    monitor = Monitor(daemon.endpoint, run_id=run, job="test", model=model,
                      probe_batch=_batch(torch.Generator().manual_seed(3), 2), every=10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    try:
        for step in range(STEPS):
            lr = LR * (SURGE if step >= FAULT else 1)
            for group in optimizer.param_groups:
                group["lr"] = lr
            tokens = _batch(generator)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            monitor.step(step, loss=loss.item(), grad_norm=grad_norm.item(),
                         lr=lr if stream_lr else None)
        assert wait_until(lambda: _last_step(daemon, run) == STEPS - 1, timeout_s=60)
    except BaseException:
        monitor.close()
        raise
    # The fault did what it should: learned before it, diverged after it.
    assert max(losses[FAULT - 20:FAULT]) < 1.0, losses[FAULT - 20:FAULT]
    assert min(losses[-20:]) > 2.0, losses[-20:]
    return monitor


def _alerts(daemon, run):
    return _http(daemon, f"/api/v1/alerts?run={run}&include_resolved=true")["alerts"]


def _assert_firing_at_the_end(daemon, run, names):
    def firing():
        return {a["alertname"]: a for a in _alerts(daemon, run) if a["state"] == "firing"}
    assert wait_until(lambda: set(names) <= set(firing()), timeout_s=30), _alerts(daemon, run)
    now = firing()
    # Firing since the episode began, never resolved while the run went on.
    assert not [a for a in _alerts(daemon, run)
                if a["alertname"] in names and a["state"] != "firing"], _alerts(daemon, run)
    diverging = now["ForeshockLossDiverging"]
    assert diverging["severity"] == "critical"
    assert FAULT < int(diverging["first_step"]) < STEPS, diverging
    return now


def test_a_persisting_lr_surge_keeps_firing_until_the_run_ends(foreshockd):
    run = "hf-lr-surge"
    monitor = _train(foreshockd, "Llama", run, stream_lr=True)
    try:
        now = _assert_firing_at_the_end(
            foreshockd, run, ("ForeshockLearningRateSurge", "ForeshockLossDiverging"))
        assert int(now["ForeshockLearningRateSurge"]["first_step"]) == FAULT
    finally:
        monitor.close()


def test_a_diverged_run_without_lr_has_a_firing_alert_at_the_end(foreshockd):
    run = "hf-diverged-no-lr"
    monitor = _train(foreshockd, "Mistral", run, stream_lr=False)
    try:
        _assert_firing_at_the_end(foreshockd, run, ("ForeshockLossDiverging",))
    finally:
        monitor.close()
