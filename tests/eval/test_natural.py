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
