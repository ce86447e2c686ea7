"""The precision strength sweep's table (issue 25 item 2; docs/evaluation/HISTORY.md): per
run of a corpus recorded with configs.KNOB_BLIND's lowprec_rtn_* scenarios, whether
training diverged, and what each replay (mechanism signals alone, direct checks
alone, shipped defaults) raised first, against the strength.

    /usr/bin/python3 tests/eval/evaluate.py --corpus CORPUS --json CORPUS/eval.json
    /usr/bin/python3 tests/eval/rtn_sweep.py --corpus CORPUS --eval CORPUS/eval.json
"""
import argparse
import json
import os
import re
import subprocess


def strength(scenario):
    m = re.search(r"_x(\d+(?:\.\d+)?)$", scenario)
    return float(m.group(1)) if m else 0.0


def first_after(row, injection):
    """(step, 'alert layer signal') of the row's first alert at or after `injection`."""
    alerts = [a for a in row["alerts"] if injection is None or a["step"] >= injection]
    if not alerts:
        return None, "none"
    a = min(alerts, key=lambda a: a["step"])
    return a["step"], f"{a['alertname'].replace('Foreshock', '')} {a['layer']} {a['signal']}"


def output_check_max(ctl, corpus):
    """{run_id: the largest attention_output_bias (the output check's statistic, in
    unit roundoffs; it alerts above 0.25) at or after the injection}."""
    doc = json.loads(subprocess.run(
        [ctl, "backtest", os.path.join(corpus, "recordings"), "--json", "--dump_series",
         "attention_output_bias"], check=True, capture_output=True, text=True).stdout)
    out = {}
    for r in doc["runs"]:
        inj = r["injection_step"] or 0
        vals = [v for step, _layer, head, v in r.get("series", {}).get("attention_output_bias", [])
                if step >= inj and head == -1]
        out[r["run_id"]] = max(vals) if vals else None
    return out


def table(manifest, result, check=None):
    by_row = {name: {r["run_id"]: r for r in rows} for name, rows in result["rows"].items()}
    runs = sorted(manifest["runs"], key=lambda r: (r["kind"] != "control", "noties" in r["scenario"],
                                                   strength(r["scenario"]), r["seed"]))
    lines = ["| run | strength | ties (rows) | final loss | divergence | mechanism alone: first "
             "alert | lead | direct: first alert | shipped: first alert | output check, max |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for m in runs:
        inj, div = m["injection_step"], m["divergence_step"]
        cells = []
        for name in ("mechanism", "direct", "shipped"):
            row = by_row[name].get(m["run_id"])
            step, what = first_after(row, inj) if row else (None, "not replayed")
            if row and not row["fault"] and row["alerts"]:
                step, what = first_after(row, None)
                what = "(false) " + what
            cells.append((step, what))
        lead = "—"
        if div is not None and cells[0][0] is not None and cells[0][0] < div:
            lead = f"{div - cells[0][0]} ({100 * (div - cells[0][0]) / (div - inj):.0f}%)"
        ties = "—" if m.get("rtn_tie_share") is None else f"{100 * m['rtn_tie_share']:.1f}%"
        fmt = lambda c: c[1] if c[0] is None else f"{c[0]}: {c[1]}"  # noqa: E731
        oc = (check or {}).get(m["run_id"])
        lines.append(f"| {m['scenario']} s{m['seed']} | {strength(m['scenario']) or '—'} | {ties} | "
                     f"{m['final_loss']:.3f} | {div if div is not None else 'none'} | "
                     f"{fmt(cells[0])} | {lead} | {fmt(cells[1])} | {fmt(cells[2])} | "
                     f"{'—' if oc is None else f'{oc:.2f}'} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True)
    p.add_argument("--eval", required=True, help="evaluate.py --json output for the corpus")
    p.add_argument("--foreshockctl", default=os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        "build", "ctl", "foreshockctl"))
    args = p.parse_args(argv)
    with open(os.path.join(args.corpus, "manifest.json")) as f:
        manifest = json.load(f)
    with open(args.eval) as f:
        result = json.load(f)
    print(table(manifest, result, output_check_max(args.foreshockctl, args.corpus)))


if __name__ == "__main__":
    main()
