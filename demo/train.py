"""Trains the tiny MoE GPT on CPU while the Foreshock client streams to foreshockd.

    /usr/bin/python3 demo/train.py --endpoint 127.0.0.1:50051 \\
        --metrics-url http://127.0.0.1:9464/metrics --run-id demo-lowprec \\
        --fault lowprec --fault-step 300 --fault-strength 64

Faults (docs/DESIGN.md §6.2), injected at --fault-step:
  lowprec  biased BF16 truncation of attention P and O (--fault-strength, --lowprec-on)
  lowprec_rtn an emulated bf16 FlashAttention forward, round to nearest: P-bar V biased
           where P-bar has several exact ones (row-max ties; --rtn-tie-window makes them
           frequent), its error times --fault-strength (1 = the emulated kernel)
  lr       learning rate times --lr-factor (at once, or a geometric ramp over --lr-ramp-steps)
  lr_const learning rate times --lr-factor at once from --fault-step, held (a constant
           too-high LR)
  both     the two together (lowprec and lr)
  lr_hidden the optimizer's param groups get the LR times --lr-factor (ramped like lr)
           while the job reports the schedule's LR (a multiplier bug: the knob reads normal)
  lr_peak  the peak LR is --lr-factor times --lr from the start: the warm-up climbs to it,
           so no LR rises over a held maximum (--fault-step is ignored)
Other knob-blind faults: --no-balance-loss (the MoE load-balance loss off: router
collapse), --adam-eps (a tiny epsilon with a low --beta2).
Benign controls: --lr-decay-step/--lr-decay-factor, --lr-restart-step (warm restart;
--lr-restart-peak-factor 2 re-warms to twice the peak), --lr-raise-step/--lr-raise-factor
(a planned LR raise, held),
--text-switch-step/--text-switch-to and --data-switch-step/--data-switch-to (text or
data regime), --batch-size-change-step/--batch-size-to.

Shape and training knobs (--n-layer, --d-model, --n-head, --n-kv-head, --head-dim,
--moe, --n-experts, --top-k, --block-size, --beta2, --data text|copy|random,
--attention-dtype) all default to the shape and behaviour above; the evaluation
corpus (tests/eval/make_corpus.py) varies them.

At the end it prints, per layer, the QK signals the daemon exported through the
run (scraped from --metrics-url) and the client's counters.
"""
import argparse
import json
import math
import os
import sys
import threading
import time

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    # Run as a script: make the repository root and the client importable.
    _ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [_ROOT, os.path.join(_ROOT, "client", "python")]

from demo import tiny_moe_gpt as tmg  # noqa: E402
import foreshock  # noqa: E402
from foreshock import prometheus  # noqa: E402
from foreshock.capture import ModelInfo  # noqa: E402
from foreshock.curvature import CurvatureEstimator  # noqa: E402

TABLE_METRICS = ("foreshock_qk_increment_entropy", "foreshock_qk_increment_top1_share",
                 "foreshock_attention_entropy", "foreshock_attention_max_logit",
                 "foreshock_router_entropy", "foreshock_router_flip_rate")
RUN_METRICS = ("foreshock_curvature_lambda_max", "foreshock_curvature_eos_ratio")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", default="127.0.0.1:50051",
                   help="foreshockd gRPC address; empty: train without monitoring")
    p.add_argument("--run-id", default="demo")
    p.add_argument("--job", default="tiny-moe-gpt")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--clip", type=float, default=1.0, help="gradient clipping norm (0: off)")
    p.add_argument("--seed", type=int, default=0)
    # One thread: on 2 shared cores, a second intra-op thread made steps of this
    # tiny model no faster at best and ~30x slower when the other core was busy.
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--fault", choices=("none", "lowprec", "lr", "lr_const", "both", "nan",
                                       "lr_hidden", "lr_peak", "lowprec_rtn"),
                   default="none",
                   help="nan: a NaN written into one weight at --fault-step (a numerical fault)")
    p.add_argument("--fault-step", type=int, default=300)
    p.add_argument("--fault-strength", type=float, default=64.0,
                   help="lowprec: multiplier of the BF16 truncation bias (1 = plain truncation); "
                        "lowprec_rtn: multiplier of the emulated kernel's rounding error (1 = "
                        "the kernel)")
    p.add_argument("--rtn-tie-window", type=float, default=0.0,
                   help="lowprec_rtn: attention logits within this of their row's max are set "
                        "to it, so that P-bar has several exact ones (0: only bf16's own ties)")
    p.add_argument("--lowprec-on", choices=("probs", "out", "both"), default="both",
                   help="lowprec: which attention tensors are truncated")
    p.add_argument("--lr-factor", type=float, default=10.0)
    p.add_argument("--lr-ramp-steps", type=int, default=0,
                   help="lr: reach --lr-factor geometrically over this many steps (0: at once)")
    p.add_argument("--lr-decay-step", type=int, default=None, help="benign: decay the LR here")
    p.add_argument("--lr-decay-factor", type=float, default=0.3)
    p.add_argument("--text", choices=tuple(tmg.CORPORA), default="gnu")
    p.add_argument("--text-switch-step", type=int, default=None,
                   help="benign: switch the training text here")
    p.add_argument("--text-switch-to", choices=tuple(tmg.CORPORA), default="permissive")
    p.add_argument("--every", type=int, default=10, help="probe interval in steps")
    p.add_argument("--probe-seqs", type=int, default=4, help="sequences in the probe batch")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--curvature-every", type=int, default=50,
                   help="estimate the preconditioned curvature every N steps (0: off)")
    p.add_argument("--curvature-budget", type=float, default=0.0,
                   help="largest fraction of training time the curvature estimates may take: "
                        "due estimates are skipped beyond it (the client's default is 0.04); "
                        "0 (the demo's default): a fixed cadence, every --curvature-every "
                        "steps, so that evaluation runs are reproducible")
    p.add_argument("--curvature-seqs", type=int, default=2,
                   help="held-out sequences in the curvature batch (its Hessian is estimated)")
    p.add_argument("--curvature-hvps", type=int, default=3,
                   help="Hessian-vector products (Lanczos steps) per curvature estimate, at "
                        "least")
    p.add_argument("--curvature-max-hvps", type=int, default=None,
                   help="at most this many products per estimate: Lanczos continues past "
                        "--curvature-hvps while the Ritz residual is above 0.05 (default: "
                        "--curvature-hvps, a fixed budget)")
    p.add_argument("--metrics-url", default=None,
                   help="foreshockd /metrics URL, scraped through the run for the final table")
    p.add_argument("--scrape-interval", type=float, default=2.0, help="seconds between scrapes")
    p.add_argument("--keep-run-open", action="store_true",
                   help="close the monitor without ending the run (its alerts stay active, "
                        "e.g. for a dashboard to look at); by default the run ends at the end")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--no-output-check", action="store_true",
                   help="do not check the attention output against an fp32 reference on "
                        "the probe (Monitor.check_attention_output)")
    p.add_argument("--weight-qk", action="store_true",
                   help="evaluation: also stream the weight-side QK factors (W_Q^h and W_K^h of "
                        "every layer, per head) as a second run RUN_ID-wqk, probed at --every, "
                        "so that the daemon's QK-increment detector scores the increment of "
                        "W_Q^h W_K^hT (tests/eval/weight_qk.py)")
    p.add_argument("--weight-qk-log", default=None,
                   help="with --weight-qk: also write, per probe, the singular values of every "
                        "head's W_Q^hT W_K^h to this JSONL file")
    p.add_argument("--no-alerts", action="store_true",
                   help="do not watch the daemon's alerts (monitor.on_alert)")
    # Model shape (defaults: tiny_moe_gpt.GPTConfig's).
    m = p.add_argument_group("model shape")
    m.add_argument("--n-layer", type=int, default=4)
    m.add_argument("--d-model", type=int, default=64)
    m.add_argument("--n-head", type=int, default=4)
    m.add_argument("--n-kv-head", type=int, default=None,
                   help="grouped-query attention: K/V heads (default: --n-head)")
    m.add_argument("--head-dim", type=int, default=None, help="default: d_model / n_head")
    m.add_argument("--block-size", type=int, default=64, help="context length")
    m.add_argument("--mlp-hidden", type=int, default=256)
    m.add_argument("--moe", choices=("default", "alternate", "none", "all"), default="default",
                   help="MoE feed-forward placement: default = layers 1 and 3; alternate = "
                        "every odd layer; none; all")
    m.add_argument("--n-experts", type=int, default=4)
    m.add_argument("--top-k", type=int, default=2)
    m.add_argument("--expert-hidden", type=int, default=128)
    m.add_argument("--attention-dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="attention compute dtype: reported to the Monitor (attention_dtype=) "
                        "and, for bf16/fp16, P and O rounded to nearest in healthy attention. "
                        "Default: exact attention, reported as bf16 with --fault lowprec or "
                        "both (the job they emulate) and as the captured Q's dtype (fp32) "
                        "otherwise")
    # Optimizer and schedule.
    o = p.add_argument_group("optimizer and schedule")
    o.add_argument("--beta2", type=float, default=0.95, help="AdamW beta2")
    o.add_argument("--lr-restart-step", type=int, default=None,
                   help="benign warm restart: the LR schedule starts over here (back to the "
                        "base LR after --lr-restart-warmup steps; an earlier decay is undone)")
    o.add_argument("--lr-restart-warmup", type=int, default=50)
    o.add_argument("--lr-restart-peak-factor", type=float, default=1.0,
                   help="benign: the warm restart climbs to this times the base LR (2: a "
                        "re-warm to a higher peak, e.g. after doubling the batch size)")
    o.add_argument("--lr-raise-step", type=int, default=None,
                   help="benign: a planned LR raise here, by --lr-raise-factor, held")
    o.add_argument("--lr-raise-factor", type=float, default=2.0)
    o.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW epsilon")
    o.add_argument("--no-balance-loss", action="store_true",
                   help="fault: train without the MoE load-balance loss (router collapse)")
    o.add_argument("--qk-norm", action="store_true",
                   help="architecture: LayerNorm on each head's q and k (QK-layernorm), the "
                        "mitigation of attention-logit growth at high learning rates")
    o.add_argument("--z-loss", type=float, default=0.0,
                   help="architecture: weight of the output z-loss, mean(logsumexp(logits)^2) "
                        "(PaLM uses 1e-4), the mitigation of output-logit drift; 0: off")
    o.add_argument("--batch-size-change-step", type=int, default=None,
                   help="benign: the batch size becomes --batch-size-to here")
    o.add_argument("--batch-size-to", type=int, default=None)
    # Data.
    d = p.add_argument_group("data")
    d.add_argument("--data", choices=("text", "copy", "random"), default="text",
                   help="text (--text), copy (random prefix then its repetition: an induction "
                        "task) or random (uniform random tokens: a flat loss)")
    d.add_argument("--synthetic-tokens", type=int, default=None,
                   help="copy/random: tokens drawn from the first N ids (default: the vocabulary)")
    d.add_argument("--copy-period", type=int, default=None,
                   help="copy: length of the random prefix that repeats (default: half the "
                        "window, an induction task; short: a fast positional copy)")
    d.add_argument("--data-switch-step", type=int, default=None,
                   help="benign curriculum switch: the training data becomes --data-switch-to here")
    d.add_argument("--data-switch-to", choices=tuple(tmg.CORPORA) + ("copy", "random"),
                   default=None)
    # Corpus generation.
    g = p.add_argument_group("recording")
    g.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                   help="extra Hello label (repeatable)")
    g.add_argument("--stop-after-divergence", type=int, default=None, metavar="N",
                   help="stop N steps after the divergence rule (divergence_step) triggers "
                        "(default: run all --steps)")
    g.add_argument("--output-stats-out", default=None, metavar="PATH",
                   help="write {\"losses\": [...], \"log_partition\": [[mean, max], ...]} as JSON "
                        "to PATH at the end: every step's loss and the log-partition "
                        "(logsumexp of the output logits) of its training batch, mean and max "
                        "over the tokens (what a z-loss penalizes; tests/eval/output_logits.py)")
    g.add_argument("--losses-out", default=None, metavar="PATH",
                   help="write {\"losses\": [...]} (every step's loss) as JSON to PATH at the "
                        "end; '-': as the last line of standard output")
    return p.parse_args(argv)


def divergence_step(losses, warmup):
    """docs/DESIGN.md §6.3: the first step after warm-up where the 20-step mean
    loss exceeds 1.3x its running minimum, or the loss is not finite; None if
    the run never diverges."""
    running_min = math.inf
    for step in range(len(losses)):
        if not math.isfinite(losses[step]):
            return step
        if step + 1 < 20 or step < warmup:
            continue
        mean = sum(losses[step - 19:step + 1]) / 20
        running_min = min(running_min, mean)
        if mean > 1.3 * running_min:
            return step
    return None


class DivergenceWatch:
    """divergence_step, one loss at a time (same rule, same answer)."""

    def __init__(self, warmup):
        self.warmup = warmup
        self.losses = []
        self.running_min = math.inf
        self.step = None

    def add(self, loss):
        """Adds the next step's loss; returns the divergence step once found."""
        if self.step is not None:
            return self.step
        self.losses.append(loss)
        step = len(self.losses) - 1
        if not math.isfinite(loss):
            self.step = step
        elif not (step + 1 < 20 or step < self.warmup):
            mean = sum(self.losses[step - 19:step + 1]) / 20
            self.running_min = min(self.running_min, mean)
            if mean > 1.3 * self.running_min:
                self.step = step
        return self.step


def lr_at(step, args, applied=False):
    """Warmup then constant, with the lr fault and the benign decay applied: the
    LR the job reports. applied: the LR the optimizer gets (differs under lr_hidden)."""
    restart = getattr(args, "lr_restart_step", None)
    base = args.lr * (args.lr_factor if args.fault == "lr_peak" else 1.0)
    if restart is not None and step >= restart:
        peak = base * getattr(args, "lr_restart_peak_factor", 1.0)
        lr = peak * min(1.0, (step - restart + 1) / max(1, args.lr_restart_warmup))
    else:
        lr = base * min(1.0, (step + 1) / max(1, args.warmup))
    raise_step = getattr(args, "lr_raise_step", None)
    if raise_step is not None and step >= raise_step:
        lr *= args.lr_raise_factor
    if (args.fault in ("lr", "both") or (applied and args.fault == "lr_hidden")) \
            and step >= args.fault_step:
        if args.lr_ramp_steps > 0:
            progress = min(1.0, (step - args.fault_step + 1) / args.lr_ramp_steps)
            lr *= args.lr_factor ** progress
        else:
            lr *= args.lr_factor
    if args.fault == "lr_const" and step >= args.fault_step:
        lr *= args.lr_factor
    if (args.lr_decay_step is not None and step >= args.lr_decay_step
            and (restart is None or step < restart or args.lr_decay_step >= restart)):
        lr *= args.lr_decay_factor
    return lr


def training_loss(args, model, logits, targets):
    """(cross-entropy, the loss trained on): the MoE balance loss at 0.01 unless
    --no-balance-loss, and the output z-loss (mean squared log-partition) at
    --z-loss."""
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss = ce if args.no_balance_loss else ce + 0.01 * model.moe_aux_loss()
    if args.z_loss > 0:
        loss = loss + args.z_loss * torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
    return ce, loss


def model_config(args, vocab_size):
    """GPTConfig from the shape flags (the defaults give GPTConfig's defaults)."""
    return tmg.GPTConfig(
        vocab_size=vocab_size, block_size=args.block_size, n_layer=args.n_layer,
        d_model=args.d_model, n_head=args.n_head, mlp_hidden=args.mlp_hidden,
        n_experts=args.n_experts, top_k=args.top_k, expert_hidden=args.expert_hidden,
        moe_layers=tmg.moe_layers_for(args.moe, args.n_layer),
        n_kv_head=args.n_kv_head, head_dim=args.head_dim, qk_norm=args.qk_norm)


def reported_attention_dtype(args):
    """What the Monitor is told attention computes in. The lowprec fault
    emulates a job whose attention runs in bf16 (its P and O pass through bf16
    rounding), so a run with it reports bf16 unless --attention-dtype says
    otherwise; without either, the client reports the captured Q's dtype (fp32)."""
    if args.attention_dtype:
        return args.attention_dtype
    return "bf16" if args.fault in ("lowprec", "both", "lowprec_rtn") else None


def monitor_labels(args):
    # warmup_steps: the divergence rule's warm-up, for `foreshockctl backtest`.
    labels = {"fault": args.fault, "seed": str(args.seed), "warmup_steps": str(args.warmup)}
    if reported_attention_dtype(args):
        labels["attention_dtype"] = reported_attention_dtype(args)
    for item in args.label:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--label {item!r}: expected KEY=VALUE")
        labels[key] = value
    return labels


class WeightQKView(torch.nn.Module):
    """The weight-side QK form as a probe forward: for every layer it hands
    `hook(layer, q, k)` the transposed per-head projections W_Q^hT and W_K^hT
    ([1, heads, d_model, head_dim]), so that q k^T = W_Q^hT W_K^h, the
    bilinear form of the head's attention logits (without the layer norm's
    gain), and the daemon's Q/K increment spectrum is that of the weights'
    step increment. Reads the model; holds no parameters of its own."""

    def __init__(self, model, level_log=None):
        super().__init__()
        self._model = [model]  # a list: not a submodule (no parameters here)
        self.hook = None
        # level_log: a JSONL file; per probe, the singular values of every head's
        # W_Q^hT W_K^h (d_model x d_model, rank <= head_dim), from the small core
        # R_Q R_K^T of the thin QRs W_Q^hT = Q_Q R_Q, W_K^hT = Q_K R_K.
        self.level_log = level_log
        self.step = None

    def forward(self, _probe):
        levels = []
        for block in self._model[0].blocks:
            attn = block.attn
            q_dim, kv_dim, _ = attn.split
            weight = attn.qkv.weight.detach().float()  # [q_dim + 2 kv_dim, d_model]
            d_model = weight.shape[1]
            q = weight[:q_dim].view(attn.n_head, attn.head_dim, d_model).transpose(1, 2)
            k = weight[q_dim:q_dim + kv_dim].view(attn.n_kv_head, attn.head_dim,
                                                  d_model).transpose(1, 2)
            self.hook(attn.layer_idx, q.unsqueeze(0), k.unsqueeze(0))
            if self.level_log is not None:
                group = attn.n_head // attn.n_kv_head
                r_q = torch.linalg.qr(q.double(), mode="r")[1]  # [heads, hd, hd]
                r_k = torch.linalg.qr(k.double(), mode="r")[1].repeat_interleave(group, dim=0)
                levels.append(torch.linalg.svdvals(r_q @ r_k.transpose(1, 2)).tolist())
        if self.level_log is not None:
            self.level_log.write(json.dumps(dict(step=self.step, singular_values=levels)) + "\n")


class MetricsRecorder:
    """Scrapes /metrics on a background thread (training never waits on it)."""

    def __init__(self, url, run, interval_s):
        self.url, self.run, self.interval_s = url, run, interval_s
        self.snapshots = []  # (daemon's last_step, {metric: {layer: value}})
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="metrics-scraper", daemon=True)

    def start(self):
        self._thread.start()

    def scrape_once(self):
        try:
            samples = prometheus.scrape(self.url)
        except (OSError, ValueError):
            self.errors += 1
            return None
        last_step = prometheus.value(samples, "foreshock_last_step", run=self.run)
        values = {m: prometheus.by_layer(samples, m, self.run) for m in TABLE_METRICS}
        for m in RUN_METRICS:  # run-level: shown as a single "run" column
            v = prometheus.value(samples, m, run=self.run)
            values[m] = {} if v is None else {"run": v}
        if last_step is not None and any(values.values()):
            self.snapshots.append((int(last_step), values))
        return last_step

    def _loop(self):
        while not self._stop.wait(self.interval_s):
            self.scrape_once()

    def finish(self, final_step, timeout_s=10.0):
        """Stops the thread, then scrapes until the daemon has caught up with final_step."""
        self._stop.set()
        self._thread.join()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            last_step = self.scrape_once()
            if last_step is not None and last_step >= final_step:
                return
            time.sleep(0.2)

    def table(self, max_rows=10):
        by_step = {}
        for step, values in self.snapshots:
            by_step[step] = values  # the latest scrape of a step wins
        steps = sorted(by_step)
        if len(steps) > max_rows:
            steps = [steps[round(i * (len(steps) - 1) / (max_rows - 1))] for i in range(max_rows)]
        lines = []
        for metric in TABLE_METRICS + RUN_METRICS:
            layers = sorted({layer for s in steps for layer in by_step[s][metric]}, key=str)
            if not layers:
                continue
            lines.append(metric)
            lines.append("  " + "step".rjust(6) + "".join((f"  layer {l}" if l != "run" else "run").rjust(10)
                                                           for l in layers))
            for s in steps:
                row = by_step[s][metric]
                lines.append("  " + str(s).rjust(6) + "".join(
                    (f"{row[l]:10.4g}" if l in row else " " * 9 + "-") for l in layers))
        return "\n".join(lines)


def run(args, tap=None, out=print):
    """Trains; returns losses, timings and the client's stats. `tap` goes to the Monitor."""
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # Adam's tiny second moments are slow as denormals on CPU
    texts = {name: tmg.load_text(name) for name in tmg.CORPORA}
    vocab = tmg.CharVocab(texts.values())
    cfg = model_config(args, len(vocab))
    datasets = {name: tmg.CharDataset(vocab.encode(text), cfg.block_size)
                for name, text in texts.items()}
    for kind in ("copy", "random"):
        datasets[kind] = tmg.SyntheticDataset(kind, len(vocab), cfg.block_size,
                                              n_tokens=args.synthetic_tokens,
                                              period=args.copy_period)
    data = datasets[args.text if args.data == "text" else args.data]
    model = tmg.TinyMoEGPT(cfg)
    model.set_attention_precision(args.attention_dtype)
    # The probe stays on the starting data's held-out windows for the whole run.
    probe = data.probe_batch(args.probe_seqs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, args.beta2),
                                  eps=args.adam_eps, weight_decay=0.01)
    batches = torch.Generator().manual_seed(args.seed)

    monitor = None
    alert_events = []
    if args.endpoint:
        extra = {}
        if reported_attention_dtype(args):
            extra["attention_dtype"] = reported_attention_dtype(args)
        monitor = foreshock.Monitor(
            args.endpoint, run_id=args.run_id, job=args.job, model=model, probe_batch=probe,
            every=args.every, dtype=args.dtype, tap=tap, labels=monitor_labels(args), **extra)
        if args.curvature_every > 0:
            # A fixed held-out batch with targets: the Hessian is of the CE loss on it.
            curvature_batch = data.probe_batch(args.curvature_seqs, block_size=cfg.block_size + 1)
            inputs, targets = curvature_batch[:, :-1], curvature_batch[:, 1:]
            monitor.curvature = CurvatureEstimator(
                model, lambda m, b: F.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten()),
                (inputs, targets), optimizer, every=args.curvature_every, hvps=args.curvature_hvps,
                max_hvps=args.curvature_max_hvps,
                budget=args.curvature_budget or None)
        # The explicit one-line capture API (same Q/K as discovery finds here: no rotary).
        model.set_qk_hook(monitor.capture_qk)
        model.set_router_hook(monitor.capture_router)
        if not args.no_output_check:
            # The attention output against the monitor's fp32 reference (rounding bias).
            model.set_out_hook(monitor.check_attention_output)
        if not args.no_alerts:
            # Runs on the client's watcher thread; a real job would set a flag
            # here and checkpoint, stop or lower the LR from the training loop.
            monitor.on_alert(lambda event: alert_events.append(event))
    weight_monitor = None
    if args.endpoint and args.weight_qk:
        view = WeightQKView(model, open(args.weight_qk_log, "w") if args.weight_qk_log else None)
        weight_monitor = foreshock.Monitor(
            args.endpoint, run_id=f"{args.run_id}-wqk", job=args.job, model=view,
            probe_batch=torch.zeros(1, dtype=torch.long), every=args.every, dtype="fp32",
            labels=dict(monitor_labels(args), source="weights", main_run=args.run_id),
            discover=False, discover_routers=False, causal=False, probe_id="weights",
            model_info=ModelInfo(n_layers=cfg.n_layer, n_heads=cfg.n_head,
                                 head_dim=model.blocks[0].attn.head_dim))
        view.hook = weight_monitor.capture_qk
    recorder = None
    if args.metrics_url:
        recorder = MetricsRecorder(args.metrics_url, args.run_id, args.scrape_interval)
        recorder.start()

    losses, grad_norms, train_seconds, monitor_seconds = [], [], [], []
    log_partitions = []  # (mean, max) over the batch's tokens, with --output-stats-out
    watch = DivergenceWatch(args.warmup)
    tie_stats_start = None  # lowprec_rtn: RTN_TIE_STATS at the fault step
    batch_size = args.batch_size
    steps_run = args.steps
    try:
        for step in range(args.steps):
            t0 = time.perf_counter()
            if step == args.fault_step and args.fault in ("lowprec", "both"):
                model.set_lowprec(args.fault_strength,
                                  on_probs=args.lowprec_on in ("probs", "both"),
                                  on_out=args.lowprec_on in ("out", "both"))
            if step == args.fault_step and args.fault == "lowprec_rtn":
                model.set_lowprec_rtn(args.fault_strength, args.rtn_tie_window)
                tie_stats_start = dict(tmg.RTN_TIE_STATS)
            if step == args.fault_step and args.fault == "nan":
                with torch.no_grad():
                    model.head.weight[0, 0] = float("nan")
            if args.text_switch_step is not None and step == args.text_switch_step:
                data = datasets[args.text_switch_to]
            if args.data_switch_step is not None and step == args.data_switch_step:
                data = datasets[args.data_switch_to or args.text_switch_to]
            if args.batch_size_change_step is not None and step == args.batch_size_change_step:
                batch_size = args.batch_size_to
            lr = lr_at(step, args)  # what the job reports (and streams)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, args, applied=True)
            x, y = data.batch(batch_size, batches)
            logits = model(x)
            ce, loss = training_loss(args, model, logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(
                model.parameters(), args.clip if args.clip > 0 else math.inf)
            optimizer.step()
            ce_value, grad_norm_value = ce.item(), grad_norm.item()
            if args.output_stats_out:
                with torch.no_grad():
                    log_z = torch.logsumexp(logits.detach().float(), dim=-1)
                    log_partitions.append((log_z.mean().item(), log_z.max().item()))
            t1 = time.perf_counter()
            if monitor is not None:
                monitor.step(step, loss=ce_value, grad_norm=grad_norm_value, lr=lr)
            if weight_monitor is not None:
                view.step = step
                weight_monitor.step(step)
            t2 = time.perf_counter()
            losses.append(ce_value)
            grad_norms.append(grad_norm_value)
            train_seconds.append(t1 - t0)
            monitor_seconds.append(t2 - t1)
            if args.log_every and (step % args.log_every == 0 or step == args.steps - 1):
                out(f"step {step:5d}  loss {ce_value:.4f}  grad_norm {grad_norm_value:.3f}  "
                    f"lr {lr:.2e}  step {1e3 * (t1 - t0):.1f} ms")
            diverged = watch.add(ce_value)
            if (args.stop_after_divergence is not None and diverged is not None
                    and step >= diverged + args.stop_after_divergence):
                steps_run = step + 1
                out(f"stopping at step {step}: {args.stop_after_divergence} steps after the "
                    f"divergence at step {diverged}")
                break
    finally:
        stats = None
        if monitor is not None:
            monitor.close(timeout=10.0, end=not args.keep_run_open)
            stats = monitor.stats()
        if weight_monitor is not None:
            weight_monitor.close(timeout=10.0, end=not args.keep_run_open)
            if view.level_log is not None:
                view.level_log.close()
        if recorder is not None:
            recorder.finish(steps_run - 1)

    probe_steps = [s for s in range(steps_run) if s % args.every == 0]
    other_steps = [s for s in range(steps_run) if s % args.every != 0]
    result = dict(
        losses=losses, grad_norms=grad_norms, train_seconds=train_seconds,
        monitor_seconds=monitor_seconds,
        mean_step_s=sum(train_seconds) / len(train_seconds),
        mean_probe_s=(sum(monitor_seconds[s] for s in probe_steps) / len(probe_steps)
                      if monitor is not None and probe_steps else 0.0),
        mean_nonprobe_monitor_s=(sum(monitor_seconds[s] for s in other_steps) / len(other_steps)
                                 if monitor is not None and other_steps else 0.0),
        stats=stats, recorder=recorder, model=model, alert_events=alert_events,
        log_partitions=log_partitions,
        divergence_step=divergence_step(losses, args.warmup), rtn_tie_share=None)
    if tie_stats_start is not None:
        # Attention rows (training, probe and curvature forwards) with a row-max tie.
        rows = tmg.RTN_TIE_STATS["rows"] - tie_stats_start["rows"]
        ties = tmg.RTN_TIE_STATS["tie_rows"] - tie_stats_start["tie_rows"]
        result["rtn_tie_share"] = ties / max(1, rows)
        out(f"lowprec_rtn: {ties} of {rows} attention rows since step {args.fault_step} had "
            f"several exact ones in P-bar (row-max ties), {100 * ties / max(1, rows):.2f}%")
    out(f"\nmean train step {1e3 * result['mean_step_s']:.1f} ms; monitor.step "
        f"{1e3 * result['mean_probe_s']:.2f} ms on probe steps (every {args.every}), "
        f"{1e3 * result['mean_nonprobe_monitor_s']:.3f} ms otherwise")
    if stats is not None and stats.get("curvature_estimates"):
        total_train = sum(train_seconds)
        out(f"curvature: {stats['curvature_estimates']} estimates, "
            f"{1e3 * stats['curvature_seconds_total'] / stats['curvature_estimates']:.0f} ms each, "
            f"{100 * stats['curvature_seconds_total'] / total_train:.1f}% of training time "
            f"(every {args.curvature_every} steps, at least {args.curvature_hvps} HVPs)")
    if recorder is not None:
        out("\nSignals exported by foreshockd (rows: the daemon's last_step at each scrape)")
        out(recorder.table() if recorder.snapshots else
            f"  (no values scraped from {args.metrics_url}; {recorder.errors} failed scrapes)")
    if monitor is not None and not args.no_alerts:
        out("\n" + alert_timeline(alert_events, result["divergence_step"], args))
    if stats is not None:
        out("\nclient stats: " + ", ".join(f"{k}={v}" for k, v in sorted(stats.items())))
    return result


def alert_timeline(events, divergence, args):
    """The alerts the daemon raised, in order, against the loss divergence."""
    fault = "no fault" if args.fault == "none" else f"fault {args.fault} injected at step {args.fault_step}"
    lines = [f"Alert timeline ({fault}):"]
    firing = [e for e in events if e.to_state == "firing" and e.from_state != "firing"]
    for e in events:
        if e.to_state in ("firing", "resolved") and e.from_state != e.to_state:
            a = e.alert
            lines.append(f"  step {e.step:5d}  {e.to_state:8s} {a.alertname:36s} layer {a.layer:>3s}  "
                         f"signal {a.signal:28s} first_step {a.first_step:5d}  "
                         f"probable_cause {a.probable_cause}")
    if not firing:
        lines.append("  no alert fired")
    lines.append(f"  loss divergence (20-step mean > 1.3x running min): "
                 f"{'step ' + str(divergence) if divergence is not None else 'none'}")
    if firing and divergence is not None:
        first = min(firing, key=lambda e: e.step)
        lines.append(f"  lead: {divergence - first.step} steps between the first firing alert "
                     f"({first.alert.alertname}, layer {first.alert.layer}) and the divergence")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    result = run(args)
    if args.output_stats_out:
        finite = lambda x: x if math.isfinite(x) else None  # noqa: E731
        with open(args.output_stats_out, "w") as f:
            json.dump({"losses": [finite(x) for x in result["losses"]],
                       "log_partition": [[finite(m), finite(x)]
                                         for m, x in result["log_partitions"]]}, f)
    if args.losses_out:
        text = json.dumps({"losses": [x if math.isfinite(x) else None for x in result["losses"]]})
        if args.losses_out == "-":
            print(text, flush=True)
        else:
            with open(args.losses_out, "w") as f:
                f.write(text)


if __name__ == "__main__":
    main()
