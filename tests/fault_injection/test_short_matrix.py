"""Short CI version of the fault-injection matrix (issue 5; the full matrix is run_matrix.py).

One seed of `healthy` and one of `lowprec`, 750 steps, fault at step 500, each
against its own real foreshockd: the healthy run must raise no alert; the
faulted run must diverge and its first Foreshock alert must fire after the
injection and before the divergence.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

import pytest  # noqa: E402

import run_matrix  # noqa: E402  (puts the client, the repo root and tests/python on sys.path)
from conftest import foreshockd_binary  # noqa: E402

STEPS = 750
# Shortened: the matrix's lowprec (x32) diverges ~700 steps after t_inj; x64
# diverges within the 250 steps this run has after t_inj.
run_matrix.SCENARIOS["lowprec_short"] = (
    "fault", "low_precision_attention",
    ["--fault", "lowprec", "--fault-step", str(run_matrix.T_INJ), "--fault-strength", "64",
     "--lowprec-on", "both"])


def _run(tmp_path, scenario):
    os.environ.setdefault("FORESHOCKD", foreshockd_binary())
    return run_matrix.one_run(dict(scenario=scenario, seed=0, steps=STEPS, log_dir=str(tmp_path)))


def test_healthy_run_stays_silent(tmp_path):
    rec = _run(tmp_path, "healthy")
    assert rec["firing"] == [], f"healthy run raised alerts: {rec['firing']}"


def test_lowprec_run_alerts_before_divergence(tmp_path):
    rec = _run(tmp_path, "lowprec_short")
    div = rec["divergence_step"]
    assert div is not None, "the lowprec fault did not diverge within the short run"
    assert rec["firing"], f"no alert fired; divergence at {div}"
    first = rec["first_alert"]
    assert first["step"] >= rec["t_inj"], f"alert before the injection: {first}"
    assert first["step"] < div, f"first alert {first} at or after divergence {div}"
