"""A Hugging Face model trained as a user would, with a peak LR too high for
it (issue 33): a tiny random-init LLaMA (4 layers, hidden 64, no QK-layernorm)
on a synthetic copy task, AdamW with a linear warm-up to the peak LR, clipping
at 1, `foreshock.Monitor(every=E)` in a hand-written loop, no `lr=` streamed.
Each run streams to a real foreshockd that records it (--record_dir); the
same recording can then be replayed into another build's daemon
(--replay_into) to compare alerting rules on identical runs.

    OPENBLAS_NUM_THREADS=1 build/venv-pypi/bin/python tests/eval/hf_lr_too_high.py \\
        --foreshockd build/server/foreshockd --foreshockctl build/foreshockctl \\
        --out /work/hf-lr --lrs 3e-1 3e-3 --every 10 50 [--replay_into OLD_FORESHOCKD]

Per run it prints: peak LR, every, the divergence step (demo/train.py's rule,
docs/DESIGN.md §6.3), the first firing mechanism alert (not a loss rule) with
its step and probable cause, and the lead in steps; with --replay_into, the
same for the other daemon. Writes OUT/results.json."""
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


def train(endpoint, run_id, peak_lr, every, steps, warmup, seed):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    import foreshock
    from demo.train import divergence_step
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=2 * SEQ)
    model = LlamaForCausalLM(config)
    probe = next(copy_batches(1, seed + 1000))[:4]
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
    p.add_argument("--foreshockd", required=True)
    p.add_argument("--foreshockctl", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--lrs", nargs="+", type=float, default=[3e-1, 3e-3])
    p.add_argument("--every", nargs="+", type=int, default=[10, 50])
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--warmup", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replay_into", default=None, help="another build's foreshockd")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rec_dir = os.path.join(args.out, "recordings")
    os.makedirs(rec_dir, exist_ok=True)
    results = []
    for lr in args.lrs:
        for every in args.every:
            run_id = f"hf-llama-lr{lr:g}-every{every}-s{args.seed}"
            daemon = Daemon(args.foreshockd, args.out, rec_dir)
            try:
                t0 = time.monotonic()
                losses, div = train(daemon.endpoint, run_id, lr, every, args.steps, args.warmup,
                                    args.seed)
                time.sleep(2)
                first = first_mechanism_alert(daemon.alerts(run_id))
            finally:
                daemon.stop()
            row = dict(run_id=run_id, peak_lr=lr, every=every, steps=len(losses),
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


if __name__ == "__main__":
    main()
