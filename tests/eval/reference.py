"""The two reference baselines of issue 25 (docs/EVALUATION.md), scored on the
same replays as the shipped alerts.

- qk_head_z: a plain robust z on the QK-increment spectral entropy of every
  layer and head, each head its own series: the median and MAD of a trailing
  window of WINDOW steps that ends GAP steps before the sample (only samples
  after the LR warm-up, the run's warmup_steps label), the MAD floored at 1% of
  the median; a head alarms when z = (median - x) / (1.4826 MAD) >= Z on
  CONSECUTIVE probes in a row; the run alarms at its first head. Nothing else.
- gradnorm_z: the robust z of the grad norm that `foreshockctl backtest`
  computes (its `gradnorm_z` baseline: trailing 200 steps, 10 back, z above 8
  on 3 steps in a row).

Both give rows shaped like the backtest's, so evaluate.summarize scores them;
they name no cause.
"""
import statistics

WINDOW, GAP, Z, CONSECUTIVE, MAD_FLOOR = 400, 200, 4.0, 3, 0.01
MIN_WINDOW = 3  # samples the window must hold


def qk_head_alarms(rows, warmup, window=WINDOW, gap=GAP, z=Z, consecutive=CONSECUTIVE):
    """Steps at which some head alarmed (every time a head reaches
    `consecutive` anomalous probes in a row), ascending. `rows`: the
    backtest's dumped [step, layer, head, value] of qk_increment_entropy."""
    by_head = {}
    for step, layer, head, value in rows:
        if head >= 0:
            by_head.setdefault((layer, head), []).append((step, value))
    alarms = []
    for series in by_head.values():
        series.sort()
        run = 0
        for i, (step, x) in enumerate(series):
            base = [v for s, v in series[:i] if warmup <= s and step - gap - window <= s < step - gap]
            if len(base) < MIN_WINDOW:
                run = 0
                continue
            med = statistics.median(base)
            mad = max(statistics.median(abs(v - med) for v in base), MAD_FLOOR * abs(med))
            run = run + 1 if mad > 0 and (med - x) / (1.4826 * mad) >= z else 0
            if run == consecutive:
                alarms.append(step)
    return sorted(alarms)


def as_row(run, alarms):
    """A backtest-shaped row for a baseline that alarmed at `alarms`."""
    inj, div = run["injection_step"], run["divergence_step"]
    fault = run["fault"]
    start = inj if (fault and inj is not None) else None
    early = [a for a in alarms if start is not None and a < start]
    after = [a for a in alarms if start is None or a >= start]
    first = after[0] if (after and fault) else None
    lead = div - first if (first is not None and div is not None) else None
    frac = (lead / (div - inj) if lead is not None and inj is not None and div > inj else None)
    return dict(run_id=run["run_id"], config=run["config"], scenario=run["scenario"], fault=fault,
                injection_step=inj, divergence_step=div, expected_cause=run["expected_cause"],
                lead=lead, lead_fraction=frac, first_alert_step=first,
                alerts=alarms if not fault else after, false_alarms=len(early) if fault else len(alarms),
                cause_correct=False, first_cause_correct=False, labels=run.get("labels", {}))


def qk_head_rows(runs):
    """Rows of the per-head QK reference; `runs` from a backtest with
    --dump_series qk_increment_entropy."""
    out = []
    for r in runs:
        warmup = int(r.get("labels", {}).get("warmup_steps", 100))
        out.append(as_row(r, qk_head_alarms(r.get("series", {}).get("qk_increment_entropy", []),
                                            warmup)))
    return out


def gradnorm_rows(runs):
    """Rows of the grad-norm robust z (the backtest's gradnorm_z baseline)."""
    out = []
    for r in runs:
        b = r["baselines"].get("gradnorm_z", {})
        first, early = b.get("first_step"), b.get("before_injection", False)
        alarms = [] if first is None else [first]
        row = as_row(r, alarms)
        if r["fault"] and early:
            row["false_alarms"] += 1
        out.append(row)
    return out
