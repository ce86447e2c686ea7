"""The preregistered draw (tests/eval/preregistered.py): seeded by the freeze
commit alone, every cell's pins respected, runs labelled for the backtest, and
scoring refused when the frozen paths changed."""
import json
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE]

import preregistered  # noqa: E402

A = "85d1908" + "0" * 33
B = "f742535" + "0" * 33


def flag(run, name):
    argv = run["train_flags"]
    return argv[argv.index(name) + 1]


def labels(run):
    argv = run["train_flags"]
    return dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--label")


def test_the_draw_is_a_function_of_the_commit():
    a1, a2, b = preregistered.draw(A), preregistered.draw(A), preregistered.draw(B)
    assert a1 == a2
    assert [r["train_flags"] for r in a1] != [r["train_flags"] for r in b]
    assert len(a1) == len(preregistered.CELLS) * preregistered.PER_CELL
    assert len({r["run_id"] for r in a1}) == len(a1)


def test_cells_keep_their_pins_and_labels():
    for commit in (A, B, "c" * 40):
        for run in preregistered.draw(commit):
            cell, lab = run["cell"], labels(run)
            assert lab["cell"] == cell and lab["scenario"] == cell
            if cell.startswith("lowprec"):
                assert flag(run, "--attention-dtype") == "bf16"
            if cell == "no_balance":
                assert flag(run, "--moe") != "none"
            if cell == "adam_eps":
                assert run["train_flags"].count("--beta2") == 1 and flag(run, "--beta2") == "0.9"
            if cell == "data_switch":
                assert flag(run, "--data") == "text"
            if run["kind"] == "fault":
                assert lab["expected_cause"] == run["expected_cause"]
                assert flag(run, "--fault-step") == lab["injection_step"]
            else:
                assert "expected_cause" not in lab and "--fault" not in run["train_flags"]
            n_head, kv = int(flag(run, "--n-head")), int(flag(run, "--n-kv-head"))
            assert n_head % kv == 0 and int(flag(run, "--d-model")) % n_head == 0


def test_scoring_refuses_a_tree_whose_detectors_changed(tmp_path):
    first = subprocess.run(["git", "-C", HERE, "rev-list", "--max-parents=0", "HEAD"],
                           capture_output=True, text=True, check=True).stdout.split()[0]
    assert not preregistered.frozen_tree_matches(first)
    draw = tmp_path / "draw.json"
    draw.write_text(json.dumps(dict(freeze_commit=first, seed=0, runs=[])))
    argv = ["score", "--corpus", str(tmp_path), "--draw", str(draw)]
    with pytest.raises(SystemExit, match="differ from the freeze commit"):
        preregistered.main(argv)
    # ... and a held-out draw is scored with the built-in defaults only.
    with pytest.raises(SystemExit, match="frozen built-in defaults"):
        preregistered.main(argv + ["--config", str(draw)])


def test_a_calibration_draw_is_not_a_held_out_one():
    cal = preregistered.draw(A, calibration_seed=1)
    assert cal == preregistered.draw(B, calibration_seed=1)  # the commit plays no part
    assert all(labels(r)["split"] == "calibration-draw-1" for r in cal)
    assert all(labels(r)["split"].startswith("preregistered-") for r in preregistered.draw(A))
    assert {r["run_id"] for r in cal}.isdisjoint(r["run_id"] for r in preregistered.draw(A))


def test_every_frozen_path_exists_and_the_model_is_one():
    # Draws 1-4 froze "demo/model.py", a file that never existed: the model and
    # its fault code were not guarded. A frozen path that does not exist
    # guards nothing.
    root = os.path.dirname(os.path.dirname(HERE))
    for path in preregistered.FREEZE:
        assert os.path.exists(os.path.join(root, path)), path
    for path in ("demo/tiny_moe_gpt.py", "tests/eval/make_corpus.py", "tests/eval/evaluate.py"):
        assert path in preregistered.FREEZE


def test_the_powered_design_holds_its_cells_at_their_calibrated_strengths():
    runs = preregistered.draw(A, design="powered")
    assert runs == preregistered.draw(A, design="powered")
    counts = {}
    for run in runs:
        counts[run["cell"]] = counts.get(run["cell"], 0) + 1
    assert counts == preregistered.POWERED_CELLS
    assert sum(n for c, n in counts.items() if preregistered.CELLS[c][0] == "fault") >= 24
    assert sum(n for c, n in counts.items() if preregistered.CELLS[c][0] == "control") == 12
    strength = {"lr_hidden": "--lr-factor", "lowprec": "--fault-strength",
                "lowprec_rtn": "--fault-strength"}
    for run in runs:
        cell = run["cell"]
        if cell in strength:
            drawn = float(flag(run, strength[cell]))
            assert drawn in [float(v) for v in preregistered.POWERED_STRENGTHS[cell]], run
        if cell.startswith("lowprec"):
            assert flag(run, "--attention-dtype") == "bf16"
    # A calibration draw may try other strengths and cells; a held-out one may not.
    cal = preregistered.draw(A, calibration_seed=9, design="powered",
                             strengths={"lr_peak": [77]}, only=["lr_peak"])
    assert {r["cell"] for r in cal} == {"lr_peak"} and len(cal) == 6
    assert {flag(r, "--lr-factor") for r in cal} == {"77"}
    assert all(int(flag(r, "--warmup")) in preregistered.POWERED_LR_PEAK_WARMUP for r in cal)
    with pytest.raises(SystemExit, match="calibration draws"):
        preregistered.main(["draw", "--commit", A, "--design", "powered",
                            "--strengths", "lr_peak=77", "--out", os.devnull])


def test_score_reports_the_no_lr_row_and_the_controls_that_held(tmp_path):
    """`score` on real recordings (the CI corpus's five runs, drawn here as a
    calibration draw): the mechanism, direct and shipped rows, the no-LR row
    (mechanism + output check, from draw 6 on) and the controls table that
    leaves out controls which diverged themselves."""
    ctl = os.environ.get("FORESHOCKCTL", os.path.join(ROOT, "build", "ctl", "foreshockctl"))
    frozen = os.path.join(HERE, "frozen")
    corpus = tmp_path / "corpus"
    shutil.copytree(os.path.join(frozen, "recordings"), corpus / "recordings")
    shutil.copy(os.path.join(frozen, "manifest.json"), corpus / "manifest.json")
    manifest = json.load(open(corpus / "manifest.json"))["runs"]
    runs = [dict(run_id=r["run_id"], category="precision" if r["kind"] == "fault" else "control",
                 cell=r["scenario"]) for r in manifest]
    draw = tmp_path / "draw.json"
    draw.write_text(json.dumps(dict(freeze_commit=None, seed="calibration-test", runs=runs)))
    report, out = tmp_path / "report.md", tmp_path / "rows.json"
    assert preregistered.main(["score", "--corpus", str(corpus), "--draw", str(draw),
                               "--foreshockctl", ctl, "--report", str(report),
                               "--json", str(out), "--jobs", "2"]) is None
    rows = json.load(open(out))["rows"]
    assert set(rows) == {"mechanism", "direct", "shipped", "no_lr", "qk_head_z", "gradnorm_z"}
    assert {r["run_id"] for r in rows["no_lr"]} == {r["run_id"] for r in manifest}
    text = report.read_text()
    assert "| this draw | no LR read (mechanism signals and the output check) |" in text
    controls = [r for r in rows["mechanism"] if not r["fault"]]
    held = [r for r in controls if r["divergence_step"] is None]
    alarmed = sum(1 for r in held if r["alerts"])
    assert (f"| mechanism signals alone (no LR streamed, no output check) | "
            f"{alarmed}/{len(held)} (") in text
