"""The curvature swing analysis (tests/eval/curvature_swing.py, issue 33):
which estimates count, the swing between them, its median and the online
rule, on series whose answers are worked out by hand."""
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE]

import curvature_swing as cs  # noqa: E402


def test_only_positive_estimates_within_the_residual_bound_from_the_step_count():
    lambdas = [(0, 5.0), (50, 10.0), (100, -3.0), (150, 20.0), (200, 40.0)]
    residuals = [(0, 0.01), (50, 0.5), (100, 0.01), (150, 0.1), (200, 0.05)]
    assert cs.converged_estimates(lambdas, residuals) == [(0, 5.0), (150, 20.0), (200, 40.0)]
    assert cs.converged_estimates(lambdas, residuals, from_step=100) == [(150, 20.0), (200, 40.0)]
    # An estimate without a residual is not judged.
    assert cs.converged_estimates([(0, 1.0)], []) == []


def test_a_swing_is_the_factor_either_way_and_its_median_is_geometric():
    estimates = [(0, 100.0), (50, 400.0), (100, 100.0), (150, 200.0)]
    assert [(s, round(f, 9)) for s, f in cs.swings(estimates)] == [(50, 4.0), (100, 4.0), (150, 2.0)]
    assert math.isclose(cs.median_swing(estimates), 4.0)
    # Two swings, 2 and 8: the geometric mean of the middle two, 4 (not 5).
    assert math.isclose(cs.median_swing([(0, 1.0), (1, 2.0), (2, 16.0)]), 4.0)
    assert cs.median_swing([(0, 1.0)]) is None
    assert math.isclose(cs.median_swing([(s, 7.0) for s in range(5)]), 1.0)


def test_the_online_rule_needs_k_swings_and_persistence():
    steady = [(50 * i, 1000.0 * 1.2 ** i) for i in range(12)]
    assert cs.first_online_step(steady, 3, 2.0, 1) is None
    # From the 6th estimate on lambda alternates by 4x: swings of 4 from step 300.
    bouncing = steady[:6] + [(50 * i, 4000.0 if i % 2 else 1000.0) for i in range(6, 12)]
    # Swings: 1.2 (x5, to step 250), then 1000/2488 (step 300), then 4 each.
    # The median of the last 3 passes 2 once two of them are large: step 350.
    assert cs.first_online_step(bouncing, 3, 2.0, 1) == 350
    assert cs.first_online_step(bouncing, 3, 2.0, 2) == 400
    assert cs.first_online_step(bouncing, 5, 2.0, 1) == 400
    assert cs.first_online_step(bouncing[:7], 3, 2.0, 1) is None


def test_the_converging_plan_raises_each_groups_product_limit_only():
    plan = dict(groups=[dict(cell="g0", flags=["--every", "10", "--curvature-hvps", "3"]),
                        dict(cell="g1", flags=["--curvature-hvps", "2",
                                               "--curvature-max-hvps", "2"])], lrs=[0.1])
    converging = cs.converging_plan(plan, 3)
    assert converging["groups"][0]["flags"] == ["--every", "10", "--curvature-hvps", "3",
                                                "--curvature-max-hvps", "9"]
    assert converging["groups"][1]["flags"] == ["--curvature-hvps", "2",
                                                "--curvature-max-hvps", "6"]
    assert plan["groups"][0]["flags"] == ["--every", "10", "--curvature-hvps", "3"]
    assert converging["lrs"] == [0.1]
