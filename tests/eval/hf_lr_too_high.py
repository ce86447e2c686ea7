"""A Hugging Face model trained as a user would, with a peak LR too high for
it (issue 33): a tiny random-init model on a synthetic copy task, AdamW with a
linear warm-up to the peak LR, clipping at 1.

Models (--models): `llama`, a LlamaForCausalLM (4 layers, hidden 64, no
QK-layernorm); `qwen3moe`, a Qwen3MoeForCausalLM (4 layers, hidden 64,
QK-layernorm as Qwen3 has it, 8 experts top-2 in every layer, no balance
loss: router_aux_loss_coef 0).
Loops (--loops): `monitor`, a hand-written loop with `foreshock.Monitor(every=E)`
and no `lr=` streamed; `trainer`, the `transformers.Trainer` with
`ForeshockCallback(every=E)` (constant_with_warmup, logging_steps=1), which
streams the LR the Trainer logs, as a user's job would.

Each run streams to a real foreshockd that records it (--record_dir). After
all runs the recordings are replayed with `foreshockctl backtest --signals
mechanism` (no loss rules, no LR by any path): the first alert of that
replay is the mechanism's warning, whatever the loop streamed. With
--replay_into the live runs are also replayed into another build's daemon.

    OPENBLAS_NUM_THREADS=1 build/venv-pypi/bin/python tests/eval/hf_lr_too_high.py \\
        --foreshockd build/server/foreshockd --foreshockctl build/ctl/foreshockctl \\
        --out /work/hf-lr --lrs 3e-1 3e-3 --every 10 50 --models llama qwen3moe \\
        --loops monitor trainer

Per run it prints: model, loop, peak LR, every, the divergence step
(demo/train.py's rule, docs/DESIGN.md §6.3), the first firing alert of the
live daemon that is not a loss rule, the mechanism replay's first alert, each
with its step, probable cause and lead in steps. Writes OUT/results.json.

Scoring (--score, after the runs or on an earlier OUT): replays
OUT/recordings with --foreshockctl, takes each run's first mechanism alert
that is not a loss rule (with the cause it fired with), classifies each run
(`outcome`: diverged by the §6.3 rule, else against the best final loss of
the same model and loop: degraded above 1.10x, healthy within 1.05x, else
unclear) and writes OUT/scored.json, the per-run list that
docs/evaluation/hf-seed*.json commit, and prints the table EVALUATION shows.

    build/venv-pypi/bin/python tests/eval/hf_lr_too_high.py --score \\
        --foreshockctl build/ctl/foreshockctl --out /work/hf-seed2"""
import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "client", "python")]

LOSS_RULES = {"ForeshockLossSpike", "ForeshockLossDiverging", "ForeshockNonFinite"}
VOCAB, SEQ, BATCH, PERIOD = 64, 32, 16, 8


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    def __init__(self, binary, workdir, record_dir=None):
        self.grpc, self.http = free_port(), free_port()
        self.data = tempfile.mkdtemp(prefix="hf-lr-data-", dir=workdir)
        args = [binary, f"--listen=127.0.0.1:{self.grpc}", f"--metrics_listen=127.0.0.1:{self.http}",
                f"--data_dir={self.data}", "--checkpoint_interval_s=0", "--fsync=none"]
        if record_dir:
            args.append(f"--record_dir={record_dir}")
        self.log = open(os.path.join(workdir, f"daemon-{self.grpc}.log"), "wb")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.grpc), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("foreshockd did not start")

    @property
    def endpoint(self):
        return f"127.0.0.1:{self.grpc}"

    def alerts(self, run):
        url = (f"http://127.0.0.1:{self.http}/api/v1/alerts?run={run}&include_resolved=true")
        with urllib.request.urlopen(url, timeout=30) as r:
            return json.loads(r.read())

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        shutil.rmtree(self.data, ignore_errors=True)


def copy_batches(steps, seed):
    """Copy task: each sequence repeats a random block of PERIOD tokens."""
    import torch
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        block = torch.randint(0, VOCAB, (BATCH, PERIOD), generator=g)
        yield block.repeat(1, SEQ // PERIOD)


def make_model(name):
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2 * SEQ))
    if name == "qwen3moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
            num_experts=8, num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, head_dim=16, max_position_embeddings=2 * SEQ,
            router_aux_loss_coef=0.0, output_router_logits=False, decoder_sparse_step=1,
            mlp_only_layers=[]))
    raise ValueError(name)


def train_with_trainer(endpoint, run_id, model, probe, peak_lr, every, steps, warmup, seed,
                       workdir):
    """The Trainer and ForeshockCallback as a user would set them up; returns the losses."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from foreshock.integrations.transformers import ForeshockCallback

    class CopyTask(torch.utils.data.Dataset):
        def __init__(self):
            self.rows = torch.cat(list(copy_batches(steps, seed)))

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return {"input_ids": self.rows[i], "labels": self.rows[i]}

    losses = []

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    args = TrainingArguments(
        output_dir=os.path.join(workdir, run_id), run_name=run_id, max_steps=steps,
        per_device_train_batch_size=BATCH, learning_rate=peak_lr,
        lr_scheduler_type="constant_with_warmup", warmup_steps=warmup, max_grad_norm=1.0,
        adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.0, logging_steps=1,
        save_strategy="no", report_to=[], seed=seed, use_cpu=True, disable_tqdm=True,
        dataloader_drop_last=True)
    trainer = Trainer(model=model, args=args, train_dataset=CopyTask(), callbacks=[
        ForeshockCallback(endpoint, probe_batch=probe, every=every, job="hf-lr-too-high"),
        Losses()])
    trainer.train()
    return losses


def train(endpoint, run_id, peak_lr, every, steps, warmup, seed, model_name="llama",
          loop="monitor", workdir="."):
    import torch
    import foreshock
    from demo.train import divergence_step
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    model = make_model(model_name)
    probe = next(copy_batches(1, seed + 1000))[:4]
    if loop == "trainer":
        losses = train_with_trainer(endpoint, run_id, model, probe, peak_lr, every, steps,
                                    warmup, seed, workdir)
        return losses, divergence_step(losses, warmup)
    monitor = foreshock.Monitor(endpoint, run_id=run_id, job="hf-lr-too-high", model=model,
                                probe_batch=probe, every=every,
                                labels={"peak_lr": repr(peak_lr), "warmup_steps": str(warmup)})
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95),
                                  weight_decay=0.0)
    losses = []
    try:
        for step, x in enumerate(copy_batches(steps, seed)):
            for group in optimizer.param_groups:
                group["lr"] = peak_lr * min(1.0, (step + 1) / warmup)
            out = model(input_ids=x, labels=x)
            optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            loss = out.loss.item()
            losses.append(loss)
            monitor.step(step, loss=loss, grad_norm=grad_norm.item())  # no lr=: as a user would
            if not math.isfinite(loss):
                break
    finally:
        monitor.close(timeout=30)
    return losses, divergence_step(losses, warmup)


def first_mechanism_alert(alerts):
    firing = [a for a in alerts.get("alerts", alerts if isinstance(alerts, list) else [])
              if a.get("alertname") not in LOSS_RULES and a.get("firing_step", -1) is not None
              and int(a.get("firing_step", -1)) >= 0]
    if not firing:
        return None
    a = min(firing, key=lambda a: int(a["firing_step"]))
    return dict(alertname=a["alertname"], layer=a.get("layer"), signal=a.get("signal"),
                firing_step=int(a["firing_step"]), first_step=int(a.get("first_step", -1)),
                probable_cause=a.get("probable_cause"))


def first_replayed_mechanism_alert(fired):
    """The first of a backtest run's fired alerts that is not a loss rule (the
    mechanism row replays the loss rules too, as consequences), with the cause
    it fired with; None if there is none."""
    fired = sorted((a for a in fired if a["alertname"] not in LOSS_RULES),
                   key=lambda a: a["step"])
    if not fired:
        return None
    return {k: fired[0].get(k) for k in
            ("alertname", "first_step", "layer", "probable_cause", "signal", "step")}


def mechanism_replay(foreshockctl, recordings):
    """run_id -> the first mechanism alert (not a loss rule) of the
    mechanism-only backtest of the recordings."""
    out = subprocess.run([foreshockctl, "backtest", recordings, "--json", "--signals",
                          "mechanism"], capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return {run["run_id"]: first_replayed_mechanism_alert(run.get("alerts", []))
            for run in json.loads(out.stdout)["runs"]}


def outcome(row, best_final_loss):
    """diverged (the §6.3 rule), else against the best final loss of the same
    model and loop: degraded above 1.10x, healthy within 1.05x, else unclear."""
    if row["divergence_step"] is not None:
        return "diverged"
    ratio = row["final_loss"] / best_final_loss
    return "degraded" if ratio > 1.10 else "healthy" if ratio <= 1.05 else "unclear"


def score(results, first_alerts):
    """Per run of results.json: outcome, the first mechanism alert and its lead
    in steps on a diverged run (the layout of docs/evaluation/hf-seed*.json)."""
    best = {}
    for r in results:
        key = (r["model"], r["loop"])
        best[key] = min(best.get(key, math.inf), r["final_loss"])
    rows = []
    for r in results:
        first = first_alerts.get(r["run_id"])
        lead = (r["divergence_step"] - first["step"]
                if first and r["divergence_step"] is not None else None)
        rows.append(dict(model=r["model"], loop=r["loop"], peak_lr=r["peak_lr"],
                         every=r["every"], outcome=outcome(r, best[(r["model"], r["loop"])]),
                         divergence_step=r["divergence_step"], final_loss=r["final_loss"],
                         first_mechanism_alert=first, lead=lead))
    return rows


def score_table(rows):
    lines = ["| model | loop | peak LR | every | outcome | divergence | final loss | "
             "first mechanism alert: layer (signal) step | lead | cause |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for x in rows:
        a = x["first_mechanism_alert"]
        alert = (f"{a['alertname'].removeprefix('Foreshock')} {a['layer']} ({a['signal']}) "
                 f"{a['step']}" if a else "—")
        lead = "" if x["lead"] is None else x["lead"]
        lines.append(f"| {x['model']} | {x['loop']} | {x['peak_lr']:g} | {x['every']} | "
                     f"{x['outcome']} | {x['divergence_step'] or '—'} | {x['final_loss']:.3f} | "
                     f"{alert} | {lead} | {a['probable_cause'] if a else ''} |")
    return "\n".join(lines)


def score_recorded(foreshockctl, out_dir):
    with open(os.path.join(out_dir, "results.json")) as f:
        results = json.load(f)
    rows = score(results, mechanism_replay(foreshockctl, os.path.join(out_dir, "recordings")))
    with open(os.path.join(out_dir, "scored.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(score_table(rows))


def replay(foreshockctl, binary, recordings, workdir, run_id):
    daemon = Daemon(binary, workdir)
    try:
        for path in recordings:
            subprocess.run([foreshockctl, "replay", path, "--to", daemon.endpoint, "--speed", "max"],
                           check=True, capture_output=True, timeout=600)
        time.sleep(2)
        return first_mechanism_alert(daemon.alerts(run_id))
    finally:
        daemon.stop()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--score", action="store_true",
                   help="only score the runs already in --out (see the module text)")
    p.add_argument("--foreshockd")
    p.add_argument("--foreshockctl", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--lrs", nargs="+", type=float, default=[3e-1, 3e-3])
    p.add_argument("--every", nargs="+", type=int, default=[10, 50])
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--warmup", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replay_into", default=None, help="another build's foreshockd")
    p.add_argument("--models", nargs="+", default=["llama"], choices=["llama", "qwen3moe"])
    p.add_argument("--loops", nargs="+", default=["monitor"], choices=["monitor", "trainer"])
    args = p.parse_args()
    if args.score:
        score_recorded(args.foreshockctl, args.out)
        return
    if not args.foreshockd:
        p.error("--foreshockd is required to record runs")
    os.makedirs(args.out, exist_ok=True)
    rec_dir = os.path.join(args.out, "recordings")
    os.makedirs(rec_dir, exist_ok=True)
    results = []
    runs = [(m, loop, lr, every) for m in args.models for loop in args.loops
            for lr in args.lrs for every in args.every]
    for model_name, loop, lr, every in runs:
        run_id = f"hf-{model_name}-{loop}-lr{lr:g}-every{every}-s{args.seed}"
        daemon = Daemon(args.foreshockd, args.out, rec_dir)
        try:
            t0 = time.monotonic()
            losses, div = train(daemon.endpoint, run_id, lr, every, args.steps, args.warmup,
                                args.seed, model_name, loop, args.out)
            time.sleep(2)
            first = first_mechanism_alert(daemon.alerts(run_id))
        finally:
            daemon.stop()
        row = dict(run_id=run_id, model=model_name, loop=loop, peak_lr=lr, every=every,
                   steps=len(losses),
                   divergence_step=div, final_loss=losses[-1], first_alert=first,
                   lead=(div - first["firing_step"]) if (first and div is not None) else None,
                   wall_s=round(time.monotonic() - t0, 1))
        if args.replay_into:
            recs = sorted(os.path.join(rec_dir, n) for n in os.listdir(rec_dir)
                          if f"-{run_id}-rank" in n)
            other = replay(args.foreshockctl, args.replay_into, recs, args.out, run_id)
            row["other_first_alert"] = other
            row["other_lead"] = ((div - other["firing_step"]) if (other and div is not None)
                                 else None)
        print(json.dumps(row), flush=True)
        results.append(row)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    mechanism = mechanism_replay(args.foreshockctl, rec_dir)
    for row in results:
        first = mechanism.get(row["run_id"])
        row["mechanism_first_alert"] = first
        row["mechanism_lead"] = ((row["divergence_step"] - first["step"])
                                 if first and row["divergence_step"] is not None else None)
        print(json.dumps({k: row[k] for k in ("run_id", "divergence_step", "final_loss",
                                              "mechanism_first_alert", "mechanism_lead")}),
              flush=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
