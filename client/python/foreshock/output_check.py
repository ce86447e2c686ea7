"""The attention output against an fp32 reference (QKSample.output_check).

A low-precision attention kernel whose rounding is biased (truncation toward
zero, the fault Qiu & Yao trace BF16 flash-attention failures to) errs the
same way in every element of its output; round-to-nearest errs both ways and
averages out. On the probe batch the monitor compares the kernel's output O
with O_ref, the same attention computed in fp32 from the same inputs, and
sends three means; the daemon turns them into `attention_output_bias`, in
units of the attention dtype's unit roundoff (docs/DESIGN.md §1.1).

Two ways to get O_ref:
  - reference_attention(): plain softmax(q k^T * scale) v with a causal mask,
    for models that call Monitor.check_attention_output themselves;
  - the same attention function called again with fp32 inputs (the Hugging
    Face capture does this), which keeps the model's own mask, scaling,
    soft-capping and windows.
"""
import torch


def reference_attention(q, k, v, scale=None, causal=True):
    """softmax(q k^T * scale) v in fp32 for q [..., H, T, d] and k, v [..., Hkv, T, d]
    (grouped-query: query head h uses K/V head h // (H / Hkv), as HF's repeat_kv)."""
    q, k, v = q.float(), k.float(), v.float()
    heads, kv_heads = q.shape[-3], k.shape[-3]
    if kv_heads != heads:
        if kv_heads == 0 or heads % kv_heads:
            raise ValueError(f"{heads} query heads cannot share {kv_heads} K/V heads")
        group = heads // kv_heads
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    s = (q @ k.transpose(-2, -1)) * scale
    if causal:
        t_q, t_k = s.shape[-2], s.shape[-1]
        mask = torch.ones(t_q, t_k, dtype=torch.bool, device=s.device).tril(t_k - t_q)
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def compare(out, ref):
    """The three means of QKSample.output_check for the kernel's output `out` against
    `ref` (same shape), or None when there is nothing to compare."""
    if out.shape != ref.shape or out.numel() == 0:
        return None
    ref = ref.detach().to(torch.float64)
    err = out.detach().to(torch.float64) - ref
    return dict(mean_signed_error=float((err * torch.sign(ref)).mean()),
                rms_error=float(err.square().mean().sqrt()),
                mean_abs_reference=float(ref.abs().mean()),
                elements=int(out.numel()))


def check(q, k, v, out, scale=None, causal=True):
    """compare(out, reference_attention(q, k, v, scale, causal))."""
    return compare(out, reference_attention(q, k, v, scale, causal))


def upcast(x):
    """x in fp32 when it is a floating-point tensor of lower precision, else x."""
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64:
        return x.float()
    return x
