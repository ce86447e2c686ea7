"""The natural-instability benchmark's outcome rules (tests/eval/natural.py):
damage onset against the QK-layernorm twin, diverged / degraded / healthy /
unclear, on loss curves whose answers are worked out by hand."""
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE]

import natural  # noqa: E402


def row(losses, divergence_step=None):
    return dict(losses=losses, divergence_step=divergence_step,
                final_loss=natural.final_loss(losses))


def test_damage_onset_is_the_first_20_step_mean_10_percent_over_the_twin():
    twin = [2.0] * 600
    assert natural.damage_onset([2.0] * 600, twin) is None
    # From step 300 the run sits at 2.5: the 20-step mean passes 2.2 once nine
    # of its 20 values are 2.5 (2 + 0.5 * 9 / 20 = 2.225), at step 308.
    degraded = [2.0] * 300 + [2.5] * 300
    assert natural.damage_onset(degraded, twin) == 308
    # Inside the warm-up nothing counts, however far above the twin.
    early = [3.0] * 50 + [2.0] * 550
    assert natural.damage_onset(early, twin) is None
    # A non-finite loss is damage at once.
    assert natural.damage_onset([2.0] * 200 + [math.nan] * 10, twin) == 200


def test_outcomes():
    twin = row([2.0] * 600)
    assert natural.classify(row([2.0] * 600, divergence_step=420), twin, 2.0) == ("diverged", 420)
    assert natural.classify(row([2.0] * 300 + [2.5] * 300), twin, 2.0) == ("degraded", 308)
    assert natural.classify(row([2.05] * 600), twin, 2.0) == ("healthy", None)
    # Worse than the best LR by more than the margin, yet never 10% above its twin.
    assert natural.classify(row([2.15] * 600), row([2.1] * 600), 2.0) == ("unclear", None)
    # A twin is judged against the best LR only.
    assert natural.classify(twin, None, 2.0) == ("healthy", None)


def test_every_cell_has_a_qk_layernorm_twin():
    cells = natural.all_cells()
    for name in natural.CELLS:
        assert name in cells and name + "+qkln" in cells
        assert "--qk-norm" in natural.cell_flags(name + "+qkln")
        assert "--qk-norm" not in natural.cell_flags(name)


def test_scoring_against_a_replay():
    """Warned = an alert before the onset; the lead fraction counts from step
    100 and is at most 100%; any alert on a healthy run is a false alarm."""
    def r(cell, lr, losses):
        return dict(row(losses), cell=cell, lr=lr, seed=0, run_id=natural.run_id_of(cell, lr, 0))
    rows = [r("moe-fp32", 3e-3, [2.0] * 600),                      # healthy (the best LR)
            r("moe-fp32", 1e-1, [2.0] * 300 + [2.5] * 300),        # degraded at 308
            r("moe-fp32", 3e-1, [2.0] * 120 + [3.0] * 480),        # degraded at 124
            r("moe-fp32+qkln", 3e-3, [2.0] * 600),
            r("moe-fp32+qkln", 1e-1, [2.0] * 600),
            r("moe-fp32+qkln", 3e-1, [2.0] * 600)]

    def alert(step, cause="learning_rate_too_high"):
        return dict(step=step, alertname="ForeshockAttentionLogitGrowth",
                    signal="attention_max_logit", probable_cause=cause)
    replay = {natural.run_id_of("moe-fp32", 1e-1, 0): dict(alerts=[alert(400), alert(204)]),
              natural.run_id_of("moe-fp32", 3e-1, 0): dict(alerts=[alert(60)]),
              natural.run_id_of("moe-fp32+qkln", 3e-3, 0): dict(alerts=[alert(500, "unknown")])}
    scored = {x["run_id"]: x for x in natural.score(rows, replay)}
    degraded = scored[natural.run_id_of("moe-fp32", 1e-1, 0)]
    assert (degraded["outcome"], degraded["onset"], degraded["first_step"]) == ("degraded", 308, 204)
    assert degraded["warned"] and degraded["lead_steps"] == 104 and degraded["cause_lr"]
    assert math.isclose(degraded["lead_fraction"], 104 / 208)
    early = scored[natural.run_id_of("moe-fp32", 3e-1, 0)]
    assert early["onset"] == 124 and early["warned"] and early["lead_fraction"] == 1.0  # 64 of 24
    assert scored[natural.run_id_of("moe-fp32", 3e-3, 0)]["false_alarm"] is False
    assert scored[natural.run_id_of("moe-fp32+qkln", 3e-3, 0)]["false_alarm"] is True
    table = natural.score_table(list(scored.values()))
    assert "warned before onset: 2" in table and "twins (any outcome) alarmed: 1/3" in table


def test_the_references_are_scored_like_the_mechanism():
    """score_references: a reference alarm before the onset warns, one on a
    healthy run or a twin is a false alarm; the grad-norm z comes from the
    backtest's baseline, the per-head QK z from the dumped entropy points."""
    scored = [dict(run_id="bad", cell="moe-fp32", outcome="degraded", onset=300),
               dict(run_id="late", cell="moe-fp32", outcome="diverged", onset=250),
               dict(run_id="ok", cell="moe-fp32", outcome="healthy", onset=None),
               dict(run_id="twin", cell="moe-fp32+qkln", outcome="healthy", onset=None)]
    # One head's entropy: flat at 2.0 (a little noise), then a collapse to
    # 0.5 from step 1000 on, confirmed on the third probe (1020).
    flat = [[s, 0, 0, 2.0 + 0.01 * (s % 3)] for s in range(100, 1000, 10)]
    collapse = flat + [[s, 0, 0, 0.5] for s in range(1000, 1100, 10)]
    replay = {"bad": dict(baselines=dict(gradnorm_z=dict(first_step=200))),
              "late": dict(baselines=dict(gradnorm_z=dict(first_step=260))),
              "ok": dict(baselines=dict(gradnorm_z={}),
                         series=dict(qk_increment_entropy=collapse)),
              "twin": dict(baselines=dict(gradnorm_z={}),
                           series=dict(qk_increment_entropy=flat))}
    out = natural.score_references(scored, replay)
    assert out["gradnorm_z"] == dict(warned=1, damaged=2, healthy=2, healthy_alarmed=0, twins=1,
                                     twins_alarmed=0, median_lead_fraction=0.5)
    assert natural.reference_first_alarms(replay["ok"])["qk_head_z"] == 1020
    assert out["qk_head_z"]["healthy_alarmed"] == 1 and out["qk_head_z"]["twins_alarmed"] == 0


def test_a_natural_draw_is_a_function_of_the_commit_and_keeps_its_pins():
    a = natural.draw_groups("85d1908" + "0" * 33)
    assert a == natural.draw_groups("85d1908" + "0" * 33)
    assert a != natural.draw_groups("f742535" + "0" * 33)
    assert sorted(g["mitigation"] for g in a["groups"]) == sorted(natural.MITIGATIONS)
    for g in a["groups"]:
        flags = g["flags"]
        value = lambda name: flags[flags.index(name) + 1]  # noqa: E731
        assert "--lr" not in flags and flags.count("--attention-dtype") == 1
        assert value("--attention-dtype") == ("bf16" if g["mitigation"] == "bf16" else "fp32")
        if g["mitigation"] == "fp32-nobalance":
            assert "--no-balance-loss" in flags and value("--moe") != "none"
        if g["mitigation"] == "fp32-zloss":
            assert value("--z-loss") == "1e-4"
        assert int(value("--warmup")) == g["warmup"] and int(value("--every")) == g["every"]
    runs = natural.plan_runs(a)
    assert len(runs) == 2 * len(a["groups"]) * len(a["lrs"]) * len(a["seeds"])
    for cell, lr, seed, flags, warmup, every in runs:
        assert ("--qk-norm" in flags) == cell.endswith("+qkln")


def test_damage_onset_counts_from_the_run_s_own_warm_up():
    twin = row([2.0] * 600)
    early = row([2.0] * 60 + [3.0] * 540)
    assert natural.classify(early, twin, 2.0) == ("degraded", 100)  # the default warm-up: 100
    early["warmup"] = 50
    # 2 + (s - 59) / 20 > 2.2 from s = 64, once 5 of the 20 losses are 3.0.
    assert natural.classify(early, twin, 2.0) == ("degraded", 64)


def test_rule_2_a_transient_gap_at_the_best_loss_is_not_damage():
    """Outcome rule 2: a run that trails its twin by 10% for a while but ends
    within the healthy margin of its cell's best loss is healthy; rule 1
    (seeds 1-5, natural draw 1) called it degraded."""
    twin = row([2.0] * 600)
    transient = row([2.0] * 200 + [2.5] * 100 + [2.0] * 300)
    assert natural.classify(transient, twin, 2.0, rule=1) == ("degraded", 208)
    assert natural.classify(transient, twin, 2.0, rule=2) == ("healthy", None)
    # A run that stays behind is degraded under both rules.
    behind = row([2.0] * 300 + [2.5] * 300)
    for rule in (1, 2):
        assert natural.classify(behind, twin, 2.0, rule=rule) == ("degraded", 308)
