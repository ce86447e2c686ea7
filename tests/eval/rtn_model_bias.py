"""How biased the emulated bf16 FlashAttention (demo/tiny_moe_gpt.py flash_rtn_bf16)
is inside the demo model (docs/evaluation/HISTORY.md, the precision strength sweep): trains
a healthy gpt4-text-bf16-shaped run for --steps steps, then, per layer, on one batch,
the share of attention rows with a row-max tie and the mean error of O against fp64
softmax(S) V along sign(O) (> 0: |O| too large), in unit roundoffs at the output's
mean scale, for tie rows and the others.

    OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/eval/rtn_model_bias.py [--steps 600]
"""
import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "client", "python")]
from demo import tiny_moe_gpt as tmg  # noqa: E402
from demo import train  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--windows", type=float, nargs="+", default=[0.0, 0.1])
    args = p.parse_args(argv)
    run = train.run(train.parse_args(["--endpoint", "", "--steps", str(args.steps),
                                      "--log-every", "0", "--curvature-every", "0",
                                      "--attention-dtype", "bf16"]), out=lambda *_: None)
    caught = []
    plain = tmg.causal_attention

    def spy(q, k, v, *rest, **kw):
        caught.append((q.detach(), k.detach(), v.detach()))
        return plain(q, k, v, *rest, **kw)
    tmg.causal_attention = spy
    texts = {n: tmg.load_text(n) for n in tmg.CORPORA}
    data = tmg.CharDataset(tmg.CharVocab(texts.values()).encode(texts["gnu"]), 64)
    x, _ = data.batch(32, torch.Generator().manual_seed(5))
    with torch.no_grad():
        run["model"](x)
    tmg.causal_attention = plain
    for window in args.windows:
        for layer, (q, k, v) in enumerate(caught):
            s = tmg.kernel_logits(q, k, window)
            o = tmg.flash_rtn_bf16(s, v).double()
            ref = torch.softmax(s.double(), -1) @ tmg.round_bf16(v).double()
            unit = 2.0 ** -8 * ref.abs().mean()
            err = (o - ref) * torch.sign(ref) / unit
            ties = ((s == s.amax(-1, keepdim=True)).sum(-1) >= 2).unsqueeze(-1).expand_as(err)
            top = torch.softmax(s, -1).amax(-1).median()
            print(f"window {window} layer {layer}: tie rows {ties[..., 0].float().mean():.3f}; "
                  f"error along sign(O): tie rows {err[ties].mean():+.4f}, others "
                  f"{err[~ties].mean():+.4f}, r.m.s. {err.pow(2).mean().sqrt():.3f} unit "
                  f"roundoffs; median largest attention probability {top:.2f}")


if __name__ == "__main__":
    main()
