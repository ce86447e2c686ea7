"""Post hoc: would a growth rule on the attention max logit, or on the size of
the attention logits' change per training step, warn the LR faults the
shipped mechanism signals missed (docs/evaluation/HISTORY.md, draw 4: "Why the three
lr_hidden runs were not warned")? Nothing here is a shipped rule; it measures
candidates on recorded corpora, so that the figures in EVALUATION.md can be
reproduced.

For each run of each corpus (make_corpus.py's layout: CORPUS/recordings/*.fsrec):
- the shipped mechanism alerts and the divergence step come from
  `foreshockctl backtest --signals mechanism --json`, which also dumps the
  per-layer attention_max_logit;
- the update size, ||dS1||_F / ||S0||_F per training step for every layer and
  head (dS1 = (dQ K0^T + Q0 dK^T)/sqrt(d), S0 = Q0 K0^T/sqrt(d), between
  consecutive probes), is computed here from the recorded Q and K.

A candidate alarms when a series is at least R times the median of its own
trailing WINDOW steps (samples after step WARMUP, at least 4 of them) on K
probes in a row; a run alarms at its first series. Scores: diverging faults
warned before divergence (the candidate or a shipped alert, whichever is
first after the injection), LR faults among them, median lead, controls
alarmed, faults alarmed before their injection by the candidate.

    OPENBLAS_NUM_THREADS=1 build/venv-pypi/bin/python tests/eval/lr_growth_rules.py \
        CORPUS1 CORPUS2 ...   # any recorded corpora

It needs the foreshock client (its stubs and decoder: the client's venv has
them). Frames are not CRC-checked here: the backtest over the same files
reports corrupt ones.
"""
import argparse
import itertools
import json
import math
import os
import statistics
import struct
import subprocess
import sys

import numpy as np

from foreshock.encoding import decode_tensor
from foreshock.v1 import ingest_pb2

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WARMUP, WINDOW = 200, 200


def stream_requests(path):
    """The recorded StreamRequests (record/recording.h: a 16-byte file header,
    then frames of u32 length, u32 crc, i64 time and the payload)."""
    with open(path, "rb") as f:
        data = f.read()
    offset = 16
    while offset + 16 <= len(data):
        length = struct.unpack_from("<I", data, offset)[0]
        offset += 16
        if offset + length > len(data):
            return
        request = ingest_pb2.StreamRequest()
        request.ParseFromString(data[offset:offset + length])
        yield request
        offset += length


def frobenius_of_product(a, b):
    """||A B^T||_F from the d x d Grams: tr((A^T A)(B^T B))."""
    return math.sqrt(max(0.0, float(np.sum((a.T @ a) * (b.T @ b)))))


def update_sizes(path):
    """[(step, layer, head, ||dS1|| / ||S0|| / steps between the probes)]."""
    previous, out = {}, []
    for request in stream_requests(path):
        if not request.HasField("batch"):
            continue
        for record in request.batch.records:
            if record.WhichOneof("payload") != "qk":
                continue
            qk = record.qk
            q, k = decode_tensor(qk.q).astype(np.float64), decode_tensor(qk.k).astype(np.float64)
            heads, kv_heads = q.shape[0], k.shape[0]
            for row in range(heads):
                kv = qk.kv_head_of[row] if len(qk.kv_head_of) else row // (heads // kv_heads)
                head = qk.heads[row] if len(qk.heads) else row
                key = (qk.layer, head)
                if key in previous:
                    step0, q0, k0 = previous[key]
                    gap = record.step - step0
                    if gap > 0 and q0.shape == q[row].shape:
                        s0 = frobenius_of_product(q0, k0)
                        ds = frobenius_of_product(np.hstack([q[row] - q0, q0]),
                                                  np.hstack([k0, k[kv] - k0]))
                        if s0 > 0:
                            out.append((record.step, qk.layer, head, ds / s0 / gap))
                previous[key] = (record.step, q[row], k[kv])
    return out


def first_growth(points, ratio, consecutive, per_head):
    """The first step at which a series is >= ratio x its trailing median on
    `consecutive` probes in a row; per_head False judges each layer's max."""
    series = {}
    for step, layer, head, value in points:
        key = (layer, head) if per_head else layer
        series.setdefault(key, {}).setdefault(step, []).append(value)
    first = None
    for by_step in series.values():
        ordered = sorted((step, max(values)) for step, values in by_step.items())
        run = 0
        for i, (step, value) in enumerate(ordered):
            base = [v for s, v in ordered[:i] if s >= WARMUP and step - WINDOW <= s < step]
            if len(base) < 4:
                run = 0
                continue
            median = statistics.median(base)
            run = run + 1 if median > 0 and value >= ratio * median else 0
            if run >= consecutive:
                first = step if first is None else min(first, step)
                break
    return first


def score(runs, candidate):
    t = dict(diverged=0, warned=0, lr=0, lr_warned=0, leads=[], controls=0, alarmed=0,
             shipped_warned=0, shipped_lr_warned=0, shipped_leads=[], shipped_alarmed=0, early=0)
    for run, new in zip(runs, candidate):
        shipped = [int(a["step"]) for a in run["alerts"]]
        steps = shipped + ([new] if new is not None else [])
        if not run["fault"]:
            t["controls"] += 1
            t["alarmed"] += bool(steps)
            t["shipped_alarmed"] += bool(shipped)
            continue
        injection = run["injection_step"] or 0
        t["early"] += new is not None and new < injection
        divergence = run["divergence_step"]
        if divergence is None:
            continue
        is_lr = run["expected_cause"] == "learning_rate_too_high"
        t["diverged"] += 1
        t["lr"] += is_lr
        span = max(1, divergence - injection)
        for prefix, candidates in (("", steps), ("shipped_", shipped)):
            first = min((s for s in candidates if s >= injection), default=None)
            warned = first is not None and first < divergence
            t[prefix + "warned"] += warned
            t[prefix + "lr_warned"] += warned and is_lr
            t[prefix + "leads"].append((divergence - first) / span if warned else 0.0)
    return t


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("corpora", nargs="+")
    parser.add_argument("--foreshockctl", default=os.path.join(ROOT, "build", "ctl", "foreshockctl"))
    args = parser.parse_args()
    runs, logits, sizes = [], [], []
    for corpus in args.corpora:
        out = subprocess.run([args.foreshockctl, "backtest", os.path.join(corpus, "recordings"),
                              "--json", "--signals", "mechanism", "--dump_series", "attention_max_logit"],
                             check=False, capture_output=True, text=True)
        for run in json.loads(out.stdout)["runs"]:
            runs.append(run)
            logits.append([(s, l, h, v) for s, l, h, v in run["series"]["attention_max_logit"] if h == -1])
            points = []
            for path in run["files"]:
                points += update_sizes(path)
            sizes.append(points)
    print(f"{len(runs)} runs from {len(args.corpora)} corpora")
    for name, data, per_head_options in (("attention max logit (per layer)", logits, [False]),
                                         ("update size", sizes, [True, False])):
        for per_head, ratio, consecutive in itertools.product(per_head_options, [2, 3, 4, 6], [2, 3]):
            t = score(runs, [first_growth(p, ratio, consecutive, per_head) for p in data])
            where = "each head" if per_head and name == "update size" else "each layer's max"
            print(f"{name}, {where}, >= {ratio}x trailing median on {consecutive} probes: "
                  f"warned {t['warned']}/{t['diverged']} (shipped mechanism {t['shipped_warned']}), "
                  f"LR faults {t['lr_warned']}/{t['lr']} ({t['shipped_lr_warned']}), "
                  f"median lead {statistics.median(t['leads'] or [0]):.0%} "
                  f"({statistics.median(t['shipped_leads'] or [0]):.0%}), "
                  f"controls alarmed {t['alarmed']}/{t['controls']} ({t['shipped_alarmed']}), "
                  f"faults alarmed before injection by the rule {t['early']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
