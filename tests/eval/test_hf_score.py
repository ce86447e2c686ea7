"""The Hugging Face sweep's scoring (tests/eval/hf_lr_too_high.py --score,
issue 33): outcomes against the best final loss of the same model and loop,
the first mechanism alert that is not a loss rule, and its lead, on
hand-worked runs."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_lr_too_high as hf  # noqa: E402


def run(run_id, model, loop, lr, final_loss, divergence_step=None, every=10):
    return dict(run_id=run_id, model=model, loop=loop, peak_lr=lr, every=every,
                final_loss=final_loss, divergence_step=divergence_step)


def alert(name, step, cause="learning_rate_too_high", first_step=None):
    return dict(alertname=name, step=step, first_step=first_step or step, layer="1",
                signal="s", probable_cause=cause)


def test_outcomes_against_the_best_final_loss_of_the_same_model_and_loop():
    results = [run("a", "llama", "monitor", 3e-3, 1.00),
               run("b", "llama", "monitor", 1e-2, 1.05),     # exactly 1.05x: healthy
               run("c", "llama", "monitor", 3e-2, 1.06),     # between: unclear
               run("d", "llama", "monitor", 1e-1, 1.11),     # above 1.10x: degraded
               run("e", "llama", "monitor", 3e-1, 0.90, 640),  # diverged whatever its loss
               run("f", "llama", "trainer", 3e-3, 2.00),     # another loop: its own best
               run("g", "qwen3moe", "monitor", 3e-3, 1.50)]
    rows = hf.score(results, {})
    # The diverged run's final loss is the best (0.90): the others are judged
    # against it, as the committed seeds were.
    assert [r["outcome"] for r in rows] == ["degraded", "degraded", "degraded", "degraded",
                                            "diverged", "healthy", "healthy"]
    rows = hf.score([r for r in results if r["run_id"] != "e"], {})
    assert [r["outcome"] for r in rows] == ["healthy", "healthy", "unclear", "degraded",
                                            "healthy", "healthy"]


def test_the_first_alert_that_is_not_a_loss_rule_and_its_lead():
    fired = [alert("ForeshockLossDiverging", 269, "unknown"),
             alert("ForeshockRouterCollapse", 350, "learning_rate_too_high", 330),
             alert("ForeshockRouterCollapse", 340, "unknown", 320),
             alert("ForeshockLossSpike", 316, "unknown")]
    first = hf.first_replayed_mechanism_alert(fired)
    assert (first["alertname"], first["step"], first["first_step"], first["probable_cause"]) == \
        ("ForeshockRouterCollapse", 340, 320, "unknown")
    assert hf.first_replayed_mechanism_alert([alert("ForeshockNonFinite", 5)]) is None
    assert hf.first_replayed_mechanism_alert([]) is None

    results = [run("x", "qwen3moe", "trainer", 3e-1, 1.1, 729),
               run("y", "qwen3moe", "trainer", 3e-3, 1.0)]
    rows = hf.score(results, {"x": first, "y": None})
    assert rows[0]["lead"] == 729 - 340
    assert rows[1]["lead"] is None and rows[1]["first_mechanism_alert"] is None
    table = hf.score_table(rows)
    assert "| qwen3moe | trainer | 0.3 | 10 | diverged | 729 | 1.100 | RouterCollapse 1 (s) 340 | 389 | unknown |" in table
    assert "| qwen3moe | trainer | 0.003 | 10 | healthy | — | 1.000 | — |  |  |" in table
