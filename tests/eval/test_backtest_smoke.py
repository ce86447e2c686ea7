"""The evaluation pipeline, short (CI): make_corpus.py --smoke trains two tiny
runs (healthy; a constant too-high LR from step 100) with the real client
into a real recording foreshockd; `foreshockctl backtest` replays them in
process; evaluate.py scores them and writes the report."""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
FORESHOCKD = os.environ.get("FORESHOCKD", os.path.join(ROOT, "build", "server", "foreshockd"))
FORESHOCKCTL = os.environ.get("FORESHOCKCTL", os.path.join(ROOT, "build", "ctl", "foreshockctl"))


def test_smoke_corpus_backtests_and_scores(tmp_path):
    corpus = tmp_path / "corpus"
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    made = subprocess.run([sys.executable, os.path.join(HERE, "make_corpus.py"), "--smoke",
                           "--out", str(corpus), "--jobs", "2", "--foreshockd", FORESHOCKD],
                          capture_output=True, text=True, timeout=600, env=env)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    manifest = {r["run_id"]: r for r in json.load(open(corpus / "manifest.json"))["runs"]}
    assert len(manifest) == 2 and not any("error" in r for r in manifest.values()), manifest

    out = subprocess.run([FORESHOCKCTL, "backtest", str(corpus / "recordings"), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["errors"] == []
    runs = {r["run_id"]: r for r in doc["runs"]}
    assert runs.keys() == manifest.keys()
    for run_id, run in runs.items():
        m = manifest[run_id]
        assert run["records"] > 0 and run["rejected"] == 0 and run["error"] == "", run
        assert run["labels"]["config"] == m["config"] and run["scenario"] == m["scenario"]
        # The same divergence rule as the trainer's, from the recorded losses.
        assert run["divergence_step"] == m["divergence_step"], (run_id, m)
        assert run["injection_step"] == m["injection_step"]
        assert run["fault"] == (m["expected_cause"] is not None)
        assert run["expected_cause"] == (m["expected_cause"] or "")
        # Every alert fired by the end of the recorded steps.
        assert all(0 <= a["step"] <= run["last_step"] for a in run["alerts"])
    fault = next(r for r in runs.values() if r["fault"])
    assert fault["divergence_step"] is not None and fault["divergence_step"] >= 100
    assert fault["false_alarms"] == sum(1 for a in fault["alerts"] if a["step"] < 100)
    healthy = next(r for r in runs.values() if not r["fault"])
    assert healthy["false_alarms"] == len(healthy["alerts"])

    report = tmp_path / "EVALUATION.md"
    scored = subprocess.run([sys.executable, os.path.join(HERE, "evaluate.py"), "--corpus",
                             str(corpus), "--foreshockctl", FORESHOCKCTL, "--report", str(report),
                             "--json", str(tmp_path / "eval.json")],
                            capture_output=True, text=True, timeout=300)
    assert scored.returncode == 0, scored.stdout[-3000:] + scored.stderr[-3000:]
    text = report.read_text()
    for section in ("## Held-out configurations", "## Per configuration", "## Baselines",
                    "## Every run"):
        assert section in text
    result = json.load(open(tmp_path / "eval.json"))
    assert result["all"]["fault_runs"] == 1 and result["all"]["control_runs"] == 1
    assert {r["run_id"] for r in result["runs"]} == set(manifest)


def test_weight_side_streams_are_recorded_and_scored_apart(tmp_path):
    # make_corpus.py --weight-qk: each run also streams RUN-wqk (the weights'
    # QK factors); evaluate.py leaves those out, weight_qk.py replays them.
    corpus = tmp_path / "corpus"
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    made = subprocess.run([sys.executable, os.path.join(HERE, "make_corpus.py"), "--smoke",
                           "--weight-qk", "--out", str(corpus), "--jobs", "2",
                           "--foreshockd", FORESHOCKD],
                          capture_output=True, text=True, timeout=600, env=env)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    manifest = {r["run_id"]: r for r in json.load(open(corpus / "manifest.json"))["runs"]}
    for run_id, m in manifest.items():
        assert len(m["weight_recordings"]) == 1 and m["recordings"], m
        assert (corpus / "logs" / f"{run_id}.wqk.jsonl").exists()

    sys.path.insert(0, HERE)
    import evaluate
    import weight_qk
    assert not any("-wqk-" in f for f in evaluate.recordings(str(corpus)))
    assert len(evaluate.recordings(str(corpus), weight_side=True)) == len(manifest)
    rows = weight_qk.main(["--corpus", str(corpus), "--foreshockctl", FORESHOCKCTL,
                           "--report", str(tmp_path / "wqk.md")])
    assert {r["run_id"] for r in rows} == manifest.keys()
    lr = next(r for r in rows if r["scenario"] == "lr_const")
    assert lr["lr_surge"] == lr["injection"] == 100  # the training run's own alerts, joined
    # The weight-side stream went through the daemon's validation whole.
    out = subprocess.run([FORESHOCKCTL, "backtest", "--json",
                          *evaluate.recordings(str(corpus), weight_side=True)],
                         capture_output=True, text=True, timeout=300)
    for run in json.loads(out.stdout)["runs"]:
        assert run["records"] > 0 and run["rejected"] == 0 and run["labels"]["source"] == "weights"
    assert "weight-side increment, shipped configuration" in (tmp_path / "wqk.md").read_text()
