"""Writes docs/evaluation/MATRIX.md (and PNGs under docs/evaluation/) from run_matrix.py's JSON.

    /usr/bin/python3 tests/fault_injection/report.py build/fault_injection/results.json

Every number in the report is computed here from the JSON; nothing is typed in.
Plots need python3-matplotlib (apt-get install -y --no-install-recommends python3-matplotlib).
"""
import argparse
import gzip
import json
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

BASELINES = ("olmo", "megatron", "nan_check")
BASELINE_TITLES = {"olmo": "OLMo 6σ/128 (loss or grad norm)", "megatron": "Megatron 10× max loss",
                   "nan_check": "NaN check"}


def baseline_alarms(run, after_inj):
    """First alarm step per baseline (OLMo = the earlier of its loss and grad-norm rules)."""
    b = run["baselines_after_inj" if after_inj else "baselines_all"]
    olmo = [s for s in (b["olmo_loss"], b["olmo_grad_norm"]) if s is not None]
    return {"olmo": min(olmo) if olmo else None, "megatron": b["megatron_loss"],
            "nan_check": b["nan_check"]}


def first_alert_after(run, step):
    for e in run["firing"]:
        if e["step"] >= step:
            return e
    return None


def analyse(data):
    runs = sorted([r for r in data["runs"] if "error" not in r], key=lambda r: (list(data["meta"]["scenarios"]).index(r["scenario"]),
                                               r["seed"]))
    # A baseline is noisy if it alarms on any control run, or before injection in a fault run
    # (the pre-injection part of a fault run is a healthy run) -- the rule Foreshock is held to.
    noisy = {b: [] for b in BASELINES}
    for r in runs:
        alarms = baseline_alarms(r, after_inj=False)
        for b in BASELINES:
            s = alarms[b]
            if s is None:
                continue
            if r["kind"] == "control" or (r["t_inj"] is not None and s < r["t_inj"]):
                noisy[b].append(f"{r['scenario']} seed {r['seed']} step {s}")
    competitors = [b for b in BASELINES if not noisy[b]]
    rows = []
    for r in runs:
        row = dict(run=r)
        row["holdout"] = r["seed"] in data["meta"]["holdout_seeds"]
        div = r["divergence_step"]
        if r["kind"] == "control":
            row["false_alarm"] = r["first_alert"] is not None
            row["alert"] = r["first_alert"]
        else:
            pre = [e for e in r["firing"] if e["step"] < r["t_inj"]]
            row["false_alarm"] = bool(pre)
            row["alert"] = first_alert_after(r, r["t_inj"])
        a = row["alert"]
        row["lead"] = div - a["step"] if (a is not None and div is not None) else None
        alarms = baseline_alarms(r, after_inj=r["kind"] == "fault")
        row["baselines"] = alarms
        comp = [alarms[b] for b in competitors if alarms[b] is not None]
        row["best_baseline"] = min(comp) if comp else None
        row["lead_over_baseline"] = (row["best_baseline"] - a["step"]
                                     if (a is not None and row["best_baseline"] is not None) else None)
        if r["kind"] == "fault":
            row["before_div"] = a is not None and div is not None and a["step"] < div
            row["beats_baselines"] = a is not None and (row["best_baseline"] is None
                                                        or a["step"] < row["best_baseline"])
            # The first alert's cause is provisional; the engine refines it as more families
            # fire near the onset and settles it settle_steps after the onset (firing->firing
            # re-sends). Scored: the cause it gave last before the divergence, i.e. what the
            # user had been told when the run diverged.
            row["cause_first"] = a["probable_cause"] if a is not None else None
            row["cause_first_ok"] = row["cause_first"] == r["expected_cause"]
            limit = div if div is not None else math.inf
            upd = [e for e in r["events"] if e["step"] >= r["t_inj"] and e["step"] <= limit
                   and e["to_state"] == "firing"]
            row["cause_at_div"] = upd[-1]["probable_cause"] if upd else None
            row["cause_ok"] = row["cause_at_div"] == r["expected_cause"]
            settled = [e for e in upd if e.get("cause_settled")]
            row["settled_step"] = settled[0]["step"] if settled else None
            row["cause_evidence"] = upd[-1].get("cause_evidence") if upd else None
        rows.append(row)
    return rows, noisy, competitors


def summarize(rows):
    faults = [r for r in rows if r["run"]["kind"] == "fault"]
    controls = [r for r in rows if r["run"]["kind"] == "control"]
    leads = [r["lead"] for r in faults if r["lead"] is not None]
    lob = [r["lead_over_baseline"] for r in faults if r["lead_over_baseline"] is not None]
    return dict(
        n_fault=len(faults), n_control=len(controls),
        diverged=sum(r["run"]["divergence_step"] is not None for r in faults),
        alerted=sum(r["alert"] is not None for r in faults),
        before_div=sum(r["before_div"] for r in faults),
        beats=sum(r["beats_baselines"] for r in faults),
        cause_ok=sum(r["cause_ok"] for r in faults),
        cause_first_ok=sum(r["cause_first_ok"] for r in faults),
        settled=sum(r["settled_step"] is not None for r in faults),
        median_lead=statistics.median(leads) if leads else None,
        min_lead=min(leads) if leads else None, max_lead=max(leads) if leads else None,
        median_lead_over_baseline=statistics.median(lob) if lob else None,
        n_lead_over_baseline=len(lob),
        control_false_alarms=sum(r["false_alarm"] for r in controls),
        preinj_false_alarms=sum(r["false_alarm"] for r in faults),
    )


def fmt(x):
    return "—" if x is None else str(x)


def plot_run(row, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    r = row["run"]
    # Cropped at divergence + 150 steps: after it the blown-up values would hide the lead-up.
    end = len(r["losses"]) if r["divergence_step"] is None else min(len(r["losses"]),
                                                                     r["divergence_step"] + 150)
    steps = list(range(end))
    nan = float("nan")
    losses = [nan if v is None else v for v in r["losses"][:end]]
    gns = [nan if v is None else v for v in r["grad_norms"][:end]]
    a = row["alert"]
    signal_metric = None
    if a is not None and r["signals"] and ("foreshock_" + a["signal"]) in r["signals"][0][1]:
        signal_metric = "foreshock_" + a["signal"]
    panels = [signal_metric or "foreshock_attention_max_logit", "foreshock_router_entropy",
              "foreshock_curvature_eos_ratio"]
    panels = list(dict.fromkeys(panels))
    fig, axes = plt.subplots(2 + len(panels), 1, figsize=(7.5, 1.7 * (2 + len(panels))), sharex=True)
    axes[0].plot(steps, losses, lw=0.6, color="tab:blue")
    axes[0].set_ylabel("loss")
    axes[1].plot(steps, gns, lw=0.6, color="tab:orange")
    axes[1].set_ylabel("grad norm\n(pre-clip)")
    axes[1].set_yscale("log")
    by_step = {}
    for s, values in r["signals"]:
        by_step[s] = values
    snap_steps = [s for s in sorted(by_step) if s < end]
    for ax, metric in zip(axes[2:], panels):
        layers = sorted({l for s in snap_steps for l in by_step[s].get(metric, {})})
        for layer in layers:
            ys = [by_step[s].get(metric, {}).get(layer) for s in snap_steps]
            ax.plot(snap_steps, [nan if y is None else y for y in ys], lw=0.8, marker=".", ms=2,
                    label=f"layer {layer}" if layer != "run" else "run")
        ax.set_ylabel(metric.replace("foreshock_", "").replace("_", "\n", 1), fontsize=7)
        values = [v for s in snap_steps for v in by_step[s].get(metric, {}).values() if v is not None]
        if values and min(values) > 0 and max(values) > 20 * min(values):
            ax.set_yscale("log")  # blow-ups near divergence span decades
        if len(layers) > 1:
            ax.legend(fontsize=6, loc="upper left", ncol=len(layers))
    for ax in axes:
        if r["t_inj"] is not None:
            ax.axvline(r["t_inj"], color="gray", ls="--", lw=0.8)
        if a is not None:
            ax.axvline(a["step"], color="red", lw=1.0)
        if r["divergence_step"] is not None:
            ax.axvline(r["divergence_step"], color="black", lw=1.0)
        for b, s in row["baselines"].items():
            if s is not None and s < end:
                ax.axvline(s, color="tab:purple", ls=":", lw=0.8)
    title = f"{r['scenario']} seed {r['seed']}: gray --- t_inj, red first Foreshock alert"
    if a is not None:
        title += f" ({a['alertname']}, layer {a['layer']})"
    title += ", black divergence, purple : baseline alarms"
    axes[0].set_title(title, fontsize=7)
    axes[-1].set_xlabel("step (signals: the daemon's values at each /metrics scrape)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write(data, md_path, fig_dir, notes=None):
    rows, noisy, competitors = analyse(data)
    meta = data["meta"]
    lines = []
    w = lines.append
    w("# The live fault-injection matrix (one model)")
    w("")
    w("The project's evaluation is [docs/EVALUATION.md](../EVALUATION.md): a corpus of varied "
      "configurations replayed with `foreshockctl backtest`. This page is the earlier matrix on the "
      "demo model, run live against fresh daemons, with the alert defaults of the daemon that ran it "
      "(the commit is not recorded in the JSON: the checked-in results predate issue 13's defaults).")
    w("")
    w("Generated by `tests/fault_injection/report.py` from the JSON written by "
      "`tests/fault_injection/run_matrix.py` (issue 5; protocol and definitions: docs/DESIGN.md §6). "
      "Every number below is computed from that file. Each run trains the tiny MoE GPT "
      "(`demo/train.py`) on CPU with the real Python client streaming to its own real `foreshockd` "
      "started with default flags (the built-in alert defaults of that daemon); "
      "alerts are collected through `WatchAlerts`.")
    w("")
    w("## How to reproduce")
    w("")
    w("```")
    command = meta["command"]
    if command.startswith("python3 "):
        command = "/usr/bin/" + command
    w(f"OPENBLAS_NUM_THREADS=1 {command}")
    w(f"/usr/bin/python3 tests/fault_injection/report.py {os.path.relpath(data.get('_path', ''), ROOT)}")
    w("```")
    w("")
    steps = (f"{meta['steps']} steps" if meta.get("control_steps", meta["steps"]) == meta["steps"]
             else f"{meta['steps']} steps (fault runs) and {meta['control_steps']} steps (controls)")
    w(f"Wall time of this matrix: **{meta['wall_s'] / 60:.1f} min** for {len(data['runs'])} runs of "
      f"{steps}, {meta['jobs']} at a time on {meta['cpus']} cores"
      + ("" if meta.get("complete") else " (**incomplete: the matrix was cut short**)") + ".")
    w("")
    w("## Scenarios")
    w("")
    w(f"Faults and benign changes start at t_inj = {meta['t_inj']} (after the detectors' warm-up). "
      f"Seeds {meta['seeds']}; held out from calibration: {meta['holdout_seeds']}.")
    w("")
    w("| scenario | kind | expected probable cause | train.py flags |")
    w("|---|---|---|---|")
    for name, sc in meta["scenarios"].items():
        w(f"| {name} | {sc['kind']} | {fmt(sc['expected_cause'])} | `{' '.join(sc['flags']) or '(none)'}` |")
    w("")
    w("Definitions (docs/DESIGN.md §6.3, §6.4): divergence step = first step after warm-up where the "
      "20-step mean loss exceeds 1.3× its running minimum, or the loss is non-finite; "
      "lead = divergence step − first firing Foreshock alert. Baselines on the same per-step "
      f"series: OLMo-style spike (loss or pre-clip grad norm above mean + {meta['baselines']['olmo_sigmas']:g}σ "
      f"of the trailing {meta['baselines']['olmo_window']}-step window), Megatron-style spiky loss "
      f"(loss above {meta['baselines']['megatron_factor']:g}× the running maximum), NaN check (non-finite "
      "loss or grad norm). A baseline that alarms on any control run, or before t_inj in a fault run, is "
      "**noisy** and does not compete. For fault runs the alert and baseline columns give the first "
      "alarm at or after t_inj; a Foreshock alert before t_inj counts as a false alarm.")
    w("")
    errors = [r for r in data["runs"] if "error" in r]
    if errors:
        w("**Runs that crashed** (not in the tables or the summary):")
        w("")
        for r in errors:
            w(f"- {r['scenario']} seed {r['seed']}: `{r['error'][:200]}`")
        w("")
    guarded = [r for r in data["runs"] if r.get("curvature_failures")]
    if guarded:
        # Older result files list the skipped steps; newer ones carry the client's count.
        def skipped(r):
            x = r["curvature_failures"]
            return len(x) if isinstance(x, list) else int(x)
        w("**Curvature estimates skipped in blown-up runs:** after the divergence, the Lanczos "
          "matrix of a blown-up model is not finite; the client skips such an estimate and counts "
          "it (`stats()['curvature_failures']`; in the first matrix run this error escaped "
          "`Monitor.step` and the runner caught it, which is what found the bug). Affected runs: "
          + "; ".join(f"{r['scenario']} seed {r['seed']} ({skipped(r)} estimates; divergence at "
                      f"{fmt(r['divergence_step'])})" for r in guarded) + ".")
        w("")
    w("## Baselines")
    w("")
    for b in BASELINES:
        status = ("noisy — " + "; ".join(noisy[b][:6]) + (" …" if len(noisy[b]) > 6 else "")) \
            if noisy[b] else "competes"
        w(f"- {BASELINE_TITLES[b]}: {status}")
    w("")

    def table(sel):
        w("| scenario | seed | t_inj | divergence | first alert step | alertname | layer | signal | "
          "probable cause | OLMo | Megatron | NaN | lead over divergence | lead over best baseline |")
        w("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for row in sel:
            r, a = row["run"], row["alert"]
            cause = "—"
            if a is not None:
                cause = a["probable_cause"]
                if r["kind"] == "fault":
                    if row["cause_at_div"] != cause:
                        cause += f" → {fmt(row['cause_at_div'])}"
                    cause += " (settled)" if row["settled_step"] is not None else " (provisional)"
                    cause += " ✓" if row["cause_ok"] else " ✗"
            alert_step = fmt(a and a["step"])
            if row["false_alarm"]:
                alert_step += " (false alarm)" if r["kind"] == "control" else " (+ alarm before t_inj)"
            lob = row["lead_over_baseline"]
            if r["kind"] == "fault" and a is not None and row["best_baseline"] is None:
                lob = "no competing alarm"
            w(f"| {r['scenario']} | {r['seed']} | {fmt(r['t_inj'])} | {fmt(r['divergence_step'])} | "
              f"{alert_step} | {fmt(a and a['alertname'])} | {fmt(a and a['layer'])} | "
              f"{fmt(a and a['signal'])} | {cause} | {fmt(row['baselines']['olmo'])} | "
              f"{fmt(row['baselines']['megatron'])} | {fmt(row['baselines']['nan_check'])} | "
              f"{fmt(row['lead'])} | {fmt(lob)} |")
        w("")

    def summary(sel, label):
        s = summarize(sel)
        w(f"**{label}** — fault runs: {s['n_fault']}, diverged: {s['diverged']}, alerted after t_inj: "
          f"{s['alerted']}, alerted before divergence: {s['before_div']}/{s['n_fault']}; "
          f"first alert earlier than every competing baseline: {s['beats']}/{s['n_fault']}; "
          f"probable cause correct (the cause last given before divergence): "
          f"{s['cause_ok']}/{s['n_fault']}"
          + (f" ({100 * s['cause_ok'] / s['n_fault']:.0f}%)" if s['n_fault'] else "")
          + f", settled before divergence in {s['settled']}/{s['n_fault']}"
          + f" (the provisional cause of the first alert: {s['cause_first_ok']}/{s['n_fault']})"
          + f"; median lead over divergence: {fmt(s['median_lead'])} steps (range {fmt(s['min_lead'])}"
          f"…{fmt(s['max_lead'])}); median lead over the best competing baseline: "
          f"{fmt(s['median_lead_over_baseline'])} steps (over the {s['n_lead_over_baseline']} runs where "
          f"one alarmed); false alarms: {s['control_false_alarms']}/{s['n_control']} control runs, "
          f"{s['preinj_false_alarms']} fault runs before t_inj.")
        w("")
        return s

    calib = [r for r in rows if not r["holdout"]]
    held = [r for r in rows if r["holdout"]]
    w("## Summary")
    w("")
    s_cal = summary(calib, "Calibration seeds")
    s_held = summary(held, "Held-out seeds") if held else None
    s_all = summary(rows, "All runs")
    faults = [r for r in rows if r["run"]["kind"] == "fault"]
    for b in BASELINES:
        if not noisy[b]:
            continue
        fired = [r for r in faults if r["baselines"][b] is not None]
        earlier = [r for r in fired if r["alert"] is not None and r["alert"]["step"] < r["baselines"][b]]
        w(f"For transparency, against the noisy {BASELINE_TITLES[b]} anyway (its first alarm at or after "
          f"t_inj): it alarmed in {len(fired)}/{len(faults)} fault runs, and Foreshock's first alert came "
          f"earlier in {len(earlier)} of those.")
        w("")
    # What each fault run's diagnosis rested on (the engine's probable_cause_evidence).
    w("Evidence behind the cause last given before divergence (annotation `probable_cause_evidence`):")
    w("")
    for r in faults:
        w(f"- {r['run']['scenario']} seed {r['run']['seed']}: {fmt(r['cause_at_div'])} "
          f"(settled at step {fmt(r['settled_step'])}) — {fmt(r['cause_evidence'])}")
    w("")
    # Probable cause given by the first alert, per scenario (all seeds).
    w("First alert per fault scenario (all seeds): probable cause and alert name counts.")
    w("")
    w("| scenario | steps t_inj → divergence | steps t_inj → first alert | expected cause | causes given (first alert) | cause last given before divergence | first alert names |")
    w("|---|---|---|---|---|---|---|")
    for name, sc in meta["scenarios"].items():
        if sc["kind"] != "fault":
            continue
        sel = [r for r in faults if r["run"]["scenario"] == name]
        causes, names, later = {}, {}, {}
        for r in sel:
            later[fmt(r["cause_at_div"])] = later.get(fmt(r["cause_at_div"]), 0) + 1
            c = r["alert"]["probable_cause"] if r["alert"] else "(no alert)"
            causes[c] = causes.get(c, 0) + 1
            n_ = f"{r['alert']['alertname']}/{r['alert']['signal']}" if r["alert"] else "(no alert)"
            names[n_] = names.get(n_, 0) + 1
        def span(xs):
            xs = [x for x in xs if x is not None]
            return f"{min(xs)}…{max(xs)}" if xs else "—"
        to_div = span([r["run"]["divergence_step"] - r["run"]["t_inj"] for r in sel
                       if r["run"]["divergence_step"] is not None])
        to_alert = span([r["alert"]["step"] - r["run"]["t_inj"] for r in sel if r["alert"]])
        w(f"| {name} | {to_div} | {to_alert} | {sc['expected_cause']} | "
          + ", ".join(f"{k} ×{v}" for k, v in sorted(causes.items())) + " | "
          + ", ".join(f"{k} ×{v}" for k, v in sorted(later.items())) + " | "
          + ", ".join(f"{k} ×{v}" for k, v in sorted(names.items())) + " |")
    w("")
    w("### Targets (all runs)")
    w("")
    n = s_all["n_fault"]
    targets = [
        ("every fault run alerts before divergence", s_all["before_div"] == n and n > 0,
         f"{s_all['before_div']}/{n}"),
        ("first alert precedes every competing baseline in every fault run", s_all["beats"] == n and n > 0,
         f"{s_all['beats']}/{n}"),
        ("zero alerts on healthy and benign runs", s_all["control_false_alarms"] == 0,
         f"{s_all['control_false_alarms']} false alarms on {s_all['n_control']} control runs"),
        ("probable cause (last given before divergence) correct on ≥ 90% of fault runs",
         n > 0 and s_all["cause_ok"] >= 0.9 * n,
         f"{s_all['cause_ok']}/{n}"),
    ]
    w("| target | met | result |")
    w("|---|---|---|")
    for name, ok, res in targets:
        w(f"| {name} | {'yes' if ok else '**NO**'} | {res} |")
    w("")
    if notes:
        w(notes.rstrip())
        w("")
    w("## Runs: calibration seeds")
    w("")
    table(calib)
    if held:
        w("## Runs: held-out seeds")
        w("")
        table(held)
    w("## Plots")
    w("")
    w("One run per scenario (the lowest seed). Top: per-step loss and pre-clip grad norm; below: "
      "the signal of the first alert (or the attention max logit when there is none), the router "
      "entropy and the curvature edge-of-stability ratio, as exported by the daemon at each /metrics "
      "scrape during the run (every 2 s, i.e. every few tens of steps). Vertical lines: gray dashed "
      "t_inj, red the first Foreshock alert, black the divergence step, purple dotted baseline alarms.")
    w("")
    os.makedirs(fig_dir, exist_ok=True)
    done = set()
    for row in rows:
        r = row["run"]
        if r["scenario"] in done:
            continue
        done.add(r["scenario"])
        name = f"{r['scenario']}-seed{r['seed']}.png"
        try:
            plot_run(row, os.path.join(fig_dir, name))
        except ImportError as e:
            w(f"(plot of {r['scenario']} skipped: {e})")
            continue
        rel = os.path.relpath(os.path.join(fig_dir, name), os.path.dirname(md_path))
        w(f"### {r['scenario']} (seed {r['seed']})")
        w("")
        w(f"![{r['scenario']} seed {r['seed']}]({rel})")
        w("")
    with open(md_path, "w") as f:
        f.write("\n".join(lines))
    return s_all, targets


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="?", default=os.path.join(ROOT, "docs", "evaluation", "results.json.gz"))
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "evaluation", "MATRIX.md"))
    p.add_argument("--figures", default=os.path.join(ROOT, "docs", "evaluation"))
    p.add_argument("--notes", default=os.path.join(HERE, "NOTES.md"),
                   help="hand-written analysis inserted after the targets (if the file exists)")
    a = p.parse_args(argv)
    with (gzip.open(a.results, "rt") if a.results.endswith(".gz") else open(a.results)) as f:
        data = json.load(f)
    data["_path"] = os.path.abspath(a.results)
    notes = None
    if a.notes and os.path.exists(a.notes):
        with open(a.notes) as f:
            notes = f.read()
    s, targets = write(data, a.out, a.figures, notes)
    print(json.dumps(s, indent=1))
    for name, ok, res in targets:
        print(f"{'MET    ' if ok else 'NOT MET'}  {name}: {res}")


if __name__ == "__main__":
    main()
