"""The reading's ablation table (tests/eval/READING.md): the built-in defaults,
and each rule or setting the reading discusses taken out or changed alone,
replayed over the corpus; one markdown row per variant for the held-out and
for the calibration configurations.

    /usr/bin/python3 tests/eval/ablations.py --corpus CORPUS
"""
import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE]

import configs  # noqa: E402
import evaluate  # noqa: E402

# name -> alert configuration on top of the built-in defaults (YAML).
VARIANTS = {
    "defaults": "",
    "without the output check (`attention_output_bias` off)":
        "alerts:\n  signals:\n    attention_output_bias:\n      enabled: false\n",
    "without `ForeshockLearningRateSurge`":
        "alerts:\n  signals:\n    lr_over_held_max:\n      enabled: false\n",
    "without the fp32 hold":
        "alerts:\n  probable_cause:\n    fp32_attention_needs_corroboration: false\n",
    "LR surge bound 2 instead of 3 (the calibration's choice)":
        "alerts:\n  signals:\n    lr_over_held_max:\n      bound: 2.0\n",
    "`qk.trend` false":
        "alerts:\n  signals:\n    qk_increment_entropy:\n      trend: false\n"
        "    qk_increment_top1_share:\n      trend: false\n",
}

HEADER = ("| {split} | alerted before divergence | median lead % | controls alerted | "
          "faults alerted early | cause right | first alert's cause right |\n"
          "|---|---|---|---|---|---|---|")


def row(name, s):
    return (f"| {name} | {s['alerted_before_divergence']}/{s['diverged']} | "
            f"{evaluate.pct(s['median_lead_fraction'])} | {s['controls_alerted']}/{s['control_runs']} | "
            f"{s['faults_alerted_early']}/{s['fault_runs']} | {s['cause_correct']}/{s['cause_labeled']} | "
            f"{s['first_cause_correct']}/{s['cause_labeled']} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True)
    p.add_argument("--foreshockctl", default=evaluate.DEFAULT_CTL)
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args(argv)
    splits = {name: c["split"] for name, c in configs.CONFIGS.items()}
    files = evaluate.recordings(args.corpus)
    rows = {"held_out": [], "calibration": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, yaml) in enumerate(VARIANTS.items()):
            path = None
            if yaml:
                path = os.path.join(tmp, f"v{i}.yaml")
                with open(path, "w") as f:
                    f.write(yaml)
            runs = evaluate.backtest_parallel(args.foreshockctl, files, path, args.jobs)["runs"]
            for split in rows:
                chosen = [r for r in runs if (splits.get(r["config"]) == "held_out") ==
                          (split == "held_out")]
                rows[split].append(row(name, evaluate.summarize(chosen)))
    for split, lines in rows.items():
        print(HEADER.format(split=split.replace("_", " ")))
        print("\n".join(lines))
        print()


if __name__ == "__main__":
    main()
