"""Alerts a real training run can trust (issue 26), through the real daemon:
a healthy MoE whose experts are dead from initialization raises no alert
(experts that die during training raise one, held until another kind of
alert fires); an LR surge that persists keeps a
firing alert until the run ends; a diverged run always has a firing alert
(ForeshockLossDiverging)."""
import json
import math
import urllib.request

import numpy as np
import torch
import torch.nn as nn

from conftest import wait_until
from foreshock import Monitor

EXPERTS, TOP_K, TOKENS = 8, 2, 64


def _alerts(daemon, run):
    url = daemon.metrics_url.replace("/metrics", f"/api/v1/alerts?run={run}&include_resolved=true")
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())["alerts"]


def _last_step(daemon, run):
    url = daemon.metrics_url.replace("/metrics", "/api/v1/runs")
    with urllib.request.urlopen(url, timeout=30) as response:
        runs = {r["run"]: r for r in json.loads(response.read())["runs"]}
    return int(runs[run]["last_step"]) if run in runs else -1


class Router(nn.Module):
    """Hands the monitor router logits of a model in training: fixed preferences
    plus a small drift per probe; experts in `dead` get no token."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.base = torch.randn(TOKENS, EXPERTS, generator=torch.Generator().manual_seed(0))
        self.dead = {6, 7}  # dead from initialization
        self.monitor = None
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        noise = torch.randn(TOKENS, EXPERTS, generator=torch.Generator().manual_seed(self.calls))
        logits = self.base + 0.05 * noise
        for e in self.dead:
            logits[:, e] = -20.0
        self.monitor.capture_router(0, logits, TOP_K)
        return x * self.weight


# Router series start at training step 200 (warmup_steps), then need their
# 12-sample warm-up: 300 probes, one per step, leave ~90 scored. The
# dead-expert window holds up to 64 probes (200 steps, capped at 64 samples),
# so an expert that dies at 250 is judged dead some 60 probes later.
def _moe_run(daemon, run, die_at=None, probes=300, loss_spike_at=None):
    model = Router()
    monitor = Monitor(daemon.endpoint, run_id=run, job="test", model=model,
                      probe_batch=torch.zeros(1), every=1, discover=False,
                      discover_routers=False)
    model.monitor = monitor
    for step in range(probes):
        if step == die_at:
            model.dead.add(5)  # an expert dies during training
        spiked = loss_spike_at is not None and step >= loss_spike_at
        monitor.step(step, loss=(6.0 if spiked else 2.0) + 0.01 * math.sin(step))
    assert wait_until(lambda: _last_step(daemon, run) == probes - 1, timeout_s=30)
    assert wait_until(lambda: any(n == "foreshock_router_dead_experts" and l.get("run") == run
                                  for n, l, _ in daemon.scrape()), timeout_s=30)
    alerts = _alerts(daemon, run)
    monitor.close()
    return alerts


def test_experts_dead_from_initialization_raise_no_alert(foreshockd):
    alerts = _moe_run(foreshockd, "moe-healthy")
    assert alerts == [], alerts
    dead = [v for n, l, v in foreshockd.scrape()
            if n == "foreshock_router_dead_experts" and l.get("run") == "moe-healthy"]
    assert dead == [2.0]  # the scenario is what it says


def test_experts_that_die_during_training_wait_for_another_kind_of_alert(foreshockd):
    """Dead experts alone are what a MoE without (enough) balance loss does at
    any LR while its loss stays healthy (issue 33): the collapse is pending,
    saying why, and pages nobody."""
    alerts = _moe_run(foreshockd, "moe-dying", die_at=250, probes=420)
    collapse = [a for a in alerts if a["alertname"] == "ForeshockRouterCollapse"]
    assert collapse and collapse[0]["signal"] == "router_experts_died", alerts
    assert int(collapse[0]["first_step"]) >= 250
    assert all(a["state"] == "pending" for a in collapse), collapse
    assert "Held: experts that stopped receiving tokens" in collapse[0]["description"], collapse
    assert int(collapse[0]["firing_step"]) == -1


def test_experts_that_die_before_the_loss_spikes_are_a_collapse(foreshockd):
    """The same deaths, then the loss spikes: the collapse fires with the
    spike, its onset kept at the deaths."""
    alerts = _moe_run(foreshockd, "moe-dying-spike", die_at=250, probes=420, loss_spike_at=400)
    spike = [a for a in alerts if a["alertname"] == "ForeshockLossSpike"]
    assert spike and spike[0]["state"] == "firing", alerts
    collapse = [a for a in alerts if a["alertname"] == "ForeshockRouterCollapse"]
    assert collapse and collapse[0]["signal"] == "router_experts_died", alerts
    assert collapse[0]["state"] == "firing", collapse
    assert 250 <= int(collapse[0]["first_step"]) < 400
    assert int(collapse[0]["firing_step"]) >= 400, [
        (a["alertname"], a["signal"], a["layer"], a["first_step"], a["firing_step"], a["state"])
        for a in alerts]
    # Neither a router alert nor a loss spike is evidence of a cause.
    assert collapse[0]["probable_cause"] == "unknown", collapse[0]


def test_a_persisting_lr_fault_and_a_diverged_run_keep_firing_until_the_end(foreshockd):
    """LR x30 from step 200 on, the loss diverging after it: 200 more steps.
    The LR surge stays firing (it resolved ~20 steps in before) and
    ForeshockLossDiverging fires and stays firing; both resolve when the run ends."""
    run, steps, fault = "lr-diverged", 400, 200
    monitor = Monitor(foreshockd.endpoint, run_id=run, job="test")
    rng = np.random.default_rng(0)
    for step in range(steps):
        lr = 1e-3 * min(1.0, (step + 1) / 50) * (30 if step >= fault else 1)
        loss = 2.0 + 3.0 * math.exp(-step / 40) + 0.02 * rng.standard_normal()
        if step >= fault:
            loss += 0.02 * (step - fault)  # diverging: up 4 by the end
        monitor.step(step, loss=loss, lr=lr)
    assert wait_until(lambda: _last_step(foreshockd, run) == steps - 1, timeout_s=30)

    def firing():
        return {a["alertname"]: a for a in _alerts(foreshockd, run) if a["state"] == "firing"}
    assert wait_until(lambda: {"ForeshockLearningRateSurge", "ForeshockLossDiverging"}
                      <= set(firing()), timeout_s=30), _alerts(foreshockd, run)
    now = firing()
    surge, diverging = now["ForeshockLearningRateSurge"], now["ForeshockLossDiverging"]
    assert int(surge["first_step"]) == fault
    assert diverging["severity"] == "critical"
    assert fault < int(diverging["first_step"]) < steps
    # Nothing of the episode resolved while the run went on.
    assert not [a for a in _alerts(foreshockd, run)
                if a["alertname"] in ("ForeshockLearningRateSurge", "ForeshockLossDiverging")
                and a["state"] == "resolved"]
    monitor.close()  # the run ends: now they resolve, saying why
    assert wait_until(lambda: not firing(), timeout_s=30), _alerts(foreshockd, run)
    ended = {a["alertname"]: a for a in _alerts(foreshockd, run)}
    assert ended["ForeshockLossDiverging"]["resolved_reason"] == "run_ended"
