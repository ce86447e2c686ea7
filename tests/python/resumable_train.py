"""A resumable training job for tests/python/test_run_lifecycle.py.

The demo model (demo/tiny_moe_gpt.py) trained on CPU with a Monitor, the way a
real job checkpoints and resumes: model, optimizer and data-order state are
saved after step --save-after; --resume starts from that checkpoint at the
next step, under the same run_id. --nan-at writes a NaN into a weight before
that step (a numerical fault); --stall-at makes the process stop training
after that step and sleep, so that the test can SIGKILL it there.

Everything the test compares with the daemon goes to --out (JSON, rewritten
after every step): the loss sent at each step, and the alert events the
Monitor's on_alert received.

    python3 tests/python/resumable_train.py --endpoint HOST:PORT --run-id R \\
        --steps 60 --save-after 29 --checkpoint ckpt.pt --out attempt1.json
"""
import argparse
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if os.environ.get("FORESHOCK_INSTALLED_CLIENT") != "1":
    sys.path[:0] = [os.path.join(ROOT, "client", "python")]
sys.path.insert(0, ROOT)

import numpy  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from demo import tiny_moe_gpt as tmg  # noqa: E402
import foreshock  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--steps", type=int, default=60, help="train steps [start, steps)")
    p.add_argument("--every", type=int, default=5, help="probe interval")
    p.add_argument("--save-after", type=int, default=None,
                   help="checkpoint after this step's update")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--resume", action="store_true", help="start from --checkpoint")
    p.add_argument("--nan-at", type=int, default=None, help="a NaN into a weight before this step")
    p.add_argument("--stall-at", type=int, default=None,
                   help="after this step, stop training and sleep (to be killed)")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    # Seeded as nearly every training script is (transformers.set_seed does
    # these three): both attempts start with the same global RNG states, so a
    # client that drew its sender id from them would make the restart look
    # like a reconnect of the first attempt.
    random.seed(0)
    numpy.random.seed(0)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    text = tmg.load_text("gnu")
    vocab = tmg.CharVocab([text])
    cfg = tmg.GPTConfig(vocab_size=len(vocab), block_size=32)
    data = tmg.CharDataset(vocab.encode(text), cfg.block_size)
    model = tmg.TinyMoEGPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    batches = torch.Generator().manual_seed(0)
    start = 0
    if args.resume:
        state = torch.load(args.checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        batches.set_state(state["batches"])
        start = state["step"] + 1
    probe = data.probe_batch(2)  # the same held-out windows in every attempt

    monitor = foreshock.Monitor(args.endpoint, run_id=args.run_id, job="resumable",
                                model=model, probe_batch=probe, every=args.every)
    result = {"start": start, "losses": {}, "events": [], "pid": os.getpid()}

    def record_event(event):
        result["events"].append({"alertname": event.alert.alertname, "from": event.from_state,
                                 "to": event.to_state, "step": event.step,
                                 "resolved_reason": event.alert.resolved_reason})

    monitor.on_alert(record_event)

    def write():
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, args.out)

    for step in range(start, args.steps):
        if args.nan_at is not None and step == args.nan_at:
            with torch.no_grad():
                model.head.weight[0, 0] = float("nan")
        x, y = data.batch(8, batches)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        monitor.step(step, loss=loss.item(), lr=3e-3)
        result["losses"][str(step)] = loss.item()
        if args.save_after is not None and step == args.save_after:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "batches": batches.get_state(), "step": step}, args.checkpoint)
        write()
        if args.stall_at is not None and step == args.stall_at:
            result["stalled"] = True
            write()
            while True:  # the crash comes from outside (SIGKILL)
                time.sleep(1)
    monitor.close(timeout=10)
    result["stats"] = {k: v for k, v in monitor.stats().items() if not isinstance(v, dict)}
    write()


if __name__ == "__main__":
    main()
