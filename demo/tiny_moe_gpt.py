"""A tiny character-level GPT with MoE feed-forward layers, for Foreshock demos and
fault-injection runs (docs/DESIGN.md §6).

Default shape: 4 layers, d_model 64, 4 heads of 16, context 64; layers 1 and 3
have an MoE feed-forward (4 experts, top-2, router = Linear named `router`),
the others a dense MLP. Attention is written out (softmax(QK^T/sqrt d) V,
causal) with a hook point for `monitor.capture_qk`, and a fault path:

- low-precision attention (`set_lowprec`): biased BF16 truncation toward zero
  of the attention probabilities and/or output, with a strength knob, through
  a custom autograd Function whose backward takes FlashAttention's
  D = rowsum(dO * O) from the low-precision O (Qiu & Yao's mechanism);
- the published mechanism itself (`set_lowprec_rtn`): an emulated bf16
  FlashAttention forward, round to nearest, whose P-bar V is biased where P-bar
  holds several exact ones (row-max ties), with the same backward.

Text: the license texts under /usr/share/common-licenses, in two corpora
("gnu" and "permissive") so a run can switch text as a benign control.
Synthetic regimes (`SyntheticDataset`): "copy" (a random token prefix, then its
repetition: an induction task whose heads specialize fast) and "random"
(uniform random tokens: a flat loss).

Everything is configurable (GPTConfig: depth, width, heads, grouped-query K/V
heads, head_dim, MoE placement, experts, top-k); the defaults are the shape above.
`set_attention_precision("bf16")` makes healthy attention round P and O to
nearest bf16 (unbiased), through the same FlashAttention-style backward.
"""
import dataclasses
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

LICENSE_DIR = "/usr/share/common-licenses"
# GPL, LGPL and GFDL without a version are links to the latest: left out as duplicates.
CORPORA = {
    "gnu": ("GPL-1", "GPL-2", "GPL-3", "LGPL-2", "LGPL-2.1", "LGPL-3", "GFDL-1.2", "GFDL-1.3"),
    "permissive": ("Apache-2.0", "Artistic", "BSD", "CC0-1.0", "MPL-1.1", "MPL-2.0"),
}


# -- data ---------------------------------------------------------------------

def load_text(corpus, license_dir=LICENSE_DIR):
    """The files of one corpus, concatenated."""
    parts = []
    for name in CORPORA[corpus]:
        with open(os.path.join(license_dir, name), encoding="utf-8", errors="replace") as f:
            parts.append(f.read())
    return "\n".join(parts)


class CharVocab:
    """Characters of every corpus, so that switching text never meets an unknown one."""

    def __init__(self, texts):
        self.chars = sorted(set("".join(texts)))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self):
        return len(self.chars)

    def encode(self, text):
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids)


class SyntheticDataset:
    """Synthetic token windows with the CharDataset interface.

    kind "copy": a random prefix of `period` tokens, then its repetition until the
    window is full (default period: half the window, an induction task; a short
    period is a fast positional copy);
    "random": uniform random tokens (nothing to learn: a flat loss at log V).
    Tokens are drawn from the first `n_tokens` ids of the vocabulary. The probe
    windows come from a fixed generator of their own (the same every call).
    """

    def __init__(self, kind, vocab_size, block_size, n_tokens=None, probe_seed=1234,
                 period=None):
        if kind not in ("copy", "random"):
            raise ValueError(f"unknown synthetic kind {kind!r}")
        self.kind = kind
        self.n_tokens = min(vocab_size, n_tokens or vocab_size)
        self.block_size = block_size
        self.probe_seed = probe_seed
        self.period = period

    def _windows(self, n, length, generator):
        if self.kind == "random":
            return torch.randint(self.n_tokens, (n, length), generator=generator)
        period = self.period or (length + 1) // 2
        prefix = torch.randint(self.n_tokens, (n, period), generator=generator)
        return prefix.repeat(1, -(-length // period))[:, :length]

    def batch(self, batch_size, generator):
        w = self._windows(batch_size, self.block_size + 1, generator)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def probe_batch(self, n_sequences, block_size=None):
        size = block_size or self.block_size
        return self._windows(n_sequences, size, torch.Generator().manual_seed(self.probe_seed + size))


class CharDataset:
    """One corpus as token ids: random training windows, and a held-out tail."""

    def __init__(self, ids, block_size, holdout_fraction=0.1):
        split = int(len(ids) * (1 - holdout_fraction))
        self.train_ids, self.holdout_ids = ids[:split], ids[split:]
        self.block_size = block_size

    def batch(self, batch_size, generator):
        starts = torch.randint(len(self.train_ids) - self.block_size - 1, (batch_size,),
                               generator=generator)
        x = torch.stack([self.train_ids[s:s + self.block_size] for s in starts])
        y = torch.stack([self.train_ids[s + 1:s + 1 + self.block_size] for s in starts])
        return x, y

    def probe_batch(self, n_sequences, block_size=None):
        """Fixed, evenly spaced windows of the held-out text: the monitor's probe input.
        block_size + 1 gives windows that split into inputs and next-token targets."""
        size = block_size or self.block_size
        span = len(self.holdout_ids) - size
        starts = [i * span // max(1, n_sequences - 1) for i in range(n_sequences)]
        return torch.stack([self.holdout_ids[s:s + size] for s in starts])


# -- low-precision fault ------------------------------------------------------

def truncate_bf16(x):
    """Rounds values toward zero to bf16 (drops the low 16 bits of the float32 mantissa)."""
    bits = x.to(torch.float32).contiguous().view(torch.int32) & -65536  # 0xFFFF0000
    return bits.view(torch.float32).to(x.dtype)


def biased_lowprec(x, strength):
    """x - strength * (x - truncate_bf16(x)): strength 1 is BF16 truncation; above 1
    multiplies the rounding bias toward zero (a fault knob, not a real format)."""
    return x - strength * (x - truncate_bf16(x))


def round_bf16(x):
    """Round-to-nearest-even bf16 (the unbiased rounding of a healthy bf16 kernel)."""
    return x.to(torch.bfloat16).to(x.dtype)


def round_fp16(x):
    return x.to(torch.float16).to(x.dtype)


ROUNDERS = {"bf16": round_bf16, "fp16": round_fp16}


def causal_mask(t, device):
    return torch.ones(t, t, dtype=torch.bool, device=device).tril()


class LowPrecisionAttention(torch.autograd.Function):
    """Causal attention whose P and/or O pass through `biased_lowprec`.

    The backward is FlashAttention's: dS = P * (dP - D) with D = rowsum(dO * O)
    computed from the stored low-precision O, not rowsum(P * dP). With exact
    arithmetic the two are equal; with a biased O, the error of D has the same
    sign step after step, which is the failure mechanism being injected. At
    strength 0 this Function equals plain attention, gradients included.
    With `rounder` (e.g. round_bf16) and strength 0, P and O are rounded to
    nearest instead (healthy low-precision attention, unbiased).
    """

    @staticmethod
    def forward(ctx, q, k, v, strength, on_probs, on_out, rounder=None):
        scale = q.shape[-1] ** -0.5
        s = (q @ k.transpose(-2, -1)) * scale
        s = s.masked_fill(~causal_mask(q.shape[-2], q.device), float("-inf"))
        p = torch.softmax(s, dim=-1)
        if strength or rounder is None:
            lp = lambda x: biased_lowprec(x, strength)  # noqa: E731
        else:
            lp = rounder
        p_mm = lp(p) if on_probs else p  # P as fed to the PV matmul
        o = p_mm @ v
        if on_out:
            o = lp(o)
        ctx.save_for_backward(q, k, v, p, p_mm, o)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, d_o):
        return _flash_backward(ctx, d_o) + (None, None, None, None)


def _flash_backward(ctx, d_o):
    """FlashAttention's backward from saved (q, k, v, p, p_mm, o): d_q, d_k, d_v."""
    q, k, v, p, p_mm, o = ctx.saved_tensors
    d_v = p_mm.transpose(-2, -1) @ d_o
    d_p = d_o @ v.transpose(-2, -1)
    d_row = (d_o * o).sum(dim=-1, keepdim=True)  # D from the low-precision O
    d_s = p * (d_p - d_row)  # P recomputed in full precision, as FlashAttention does
    d_q = (d_s @ k) * ctx.scale
    d_k = (d_s.transpose(-2, -1) @ q) * ctx.scale
    return d_q, d_k, d_v


# Rows of the last FlashRTNAttention forwards with >= 2 exact ones in P-bar (row-max
# ties), and all rows: train.py logs the share.
RTN_TIE_STATS = {"rows": 0, "tie_rows": 0}


def kernel_logits(q, k, tie_window=0.0):
    """The emulated bf16 kernel's S: Q and K in bf16, Q K^T * scale rounded to nearest
    bf16, causal -inf; entries within tie_window of their row's max set to the max
    (row-max ties made frequent; 0: only the ties bf16 itself makes)."""
    scale = q.shape[-1] ** -0.5
    s = round_bf16((round_bf16(q) @ round_bf16(k).transpose(-2, -1)) * scale)
    s = s.masked_fill(~causal_mask(q.shape[-2], q.device), float("-inf"))
    if tie_window > 0:
        m = s.amax(dim=-1, keepdim=True)
        s = torch.where(s >= m - tie_window, m, s)
    return s


def flash_rtn_bf16(s, v, block=16):
    """The forward of a bf16 FlashAttention kernel, emulated in fp32 storage with
    round-to-nearest-even bf16 wherever that kernel holds bf16 (the pure-PyTorch
    FlashAttention-2 of Qiu & Yao's "Why low-precision transformer training fails",
    whose training diverges): over key blocks of `block`, with the running row max m,
    P-bar = exp(S - m) rounded to bf16 (entries at a row-max tie are exactly 1), the
    block's P-bar V rounded to bf16 (exact products, fp32 accumulation, bf16 output),
    the running output rescaled and accumulated in bf16; the row sum l in fp32 (as
    FlashAttention-2 keeps it: in bf16, 1 + P-bar's next entry lands on half-unit ties
    too and biases l up, O toward zero); then O = acc / l rounded to bf16.
    s: kernel_logits; v: [.., T, d]. Returns O."""
    v = round_bf16(v)
    t = s.shape[-1]
    m = torch.full(s.shape[:-1] + (1,), float("-inf"), dtype=s.dtype, device=s.device)
    l = torch.zeros_like(m)
    acc = torch.zeros(s.shape[:-1] + (v.shape[-1],), dtype=s.dtype, device=s.device)
    for j in range(0, t, block):
        s_j = s[..., j:j + block]
        m_new = torch.maximum(m, s_j.amax(dim=-1, keepdim=True))
        alpha = torch.exp(m - m_new)  # 0 on the first block (m = -inf; block 0 holds key 0)
        p_bar = round_bf16(torch.exp(s_j - m_new))
        l = alpha * l + p_bar.sum(dim=-1, keepdim=True)  # fp32, as FlashAttention-2 keeps it
        acc = round_bf16(round_bf16(alpha * acc) + round_bf16(p_bar @ v[..., j:j + block, :]))
        m = m_new
    return round_bf16(acc / l)


class FlashRTNAttention(torch.autograd.Function):
    """Causal attention through the emulated bf16 FlashAttention forward
    (`flash_rtn_bf16`, round to nearest, row-max ties in P-bar), with its error
    multiplied by `strength`: O = O_ref + strength * (O_bf16 - O_ref), O_ref = the exact
    softmax(S) V of the same kernel logits S. Strength 1 is the emulated kernel. The
    backward is FlashAttention's (as LowPrecisionAttention's): D = rowsum(dO * O) from
    this O, P recomputed in full precision, straight through the logits' rounding."""

    @staticmethod
    def forward(ctx, q, k, v, strength, tie_window, block=16):
        s = kernel_logits(q, k, tie_window)
        ties = (s == s.amax(dim=-1, keepdim=True)).sum(dim=-1) >= 2
        RTN_TIE_STATS["rows"] += ties.numel()
        RTN_TIE_STATS["tie_rows"] += int(ties.sum())
        p = torch.softmax(s, dim=-1)
        o_ref = p @ v
        o = o_ref + strength * (flash_rtn_bf16(s, v, block) - o_ref)
        ctx.save_for_backward(q, k, v, p, p, o)
        ctx.scale = q.shape[-1] ** -0.5
        return o

    @staticmethod
    def backward(ctx, d_o):
        return _flash_backward(ctx, d_o) + (None, None, None)


def causal_attention(q, k, v, lowprec_strength=0.0, on_probs=True, on_out=True, precision=None,
                     rtn_strength=0.0, rtn_tie_window=0.0):
    """softmax(Q K^T / sqrt(d), causal) V for [B, H, T, d] inputs. precision "bf16"/"fp16":
    P and O rounded to nearest (healthy low precision) unless the lowprec fault is on.
    rtn_strength: the emulated bf16 FlashAttention (FlashRTNAttention) instead."""
    if rtn_strength:
        return FlashRTNAttention.apply(q, k, v, rtn_strength, rtn_tie_window)
    if lowprec_strength:
        return LowPrecisionAttention.apply(q, k, v, lowprec_strength, on_probs, on_out)
    if precision in ROUNDERS:
        return LowPrecisionAttention.apply(q, k, v, 0.0, True, True, ROUNDERS[precision])
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~causal_mask(q.shape[-2], q.device), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


# -- model ----------------------------------------------------------------------

@dataclasses.dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 64
    n_layer: int = 4
    d_model: int = 64
    n_head: int = 4
    mlp_hidden: int = 256
    n_experts: int = 4
    top_k: int = 2
    expert_hidden: int = 128
    moe_layers: tuple = (1, 3)
    n_kv_head: int = None  # grouped-query attention: K/V heads (None: n_head)
    head_dim: int = None  # None: d_model // n_head
    # QK-layernorm (Dehghani et al. 2023; Wortsman et al. 2023): a LayerNorm over
    # each head's q and k before the logits, which keeps attention logits from
    # growing without bound at high learning rates.
    qk_norm: bool = False


def moe_layers_for(placement, n_layer):
    """MoE layer indices: "default" (1, 3, as GPTConfig), "alternate" (every odd
    layer), "none", "all"."""
    if placement == "default":
        return (1, 3)
    if placement == "alternate":
        return tuple(range(1, n_layer, 2))
    if placement == "none":
        return ()
    if placement == "all":
        return tuple(range(n_layer))
    raise ValueError(f"unknown MoE placement {placement!r}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = cfg.n_head
        self.n_kv_head = cfg.n_kv_head or cfg.n_head
        assert self.n_head % self.n_kv_head == 0
        if cfg.head_dim is None:
            assert cfg.d_model % cfg.n_head == 0
        self.head_dim = cfg.head_dim or cfg.d_model // cfg.n_head
        q_dim, kv_dim = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        self.split = (q_dim, kv_dim, kv_dim)
        self.qkv = nn.Linear(cfg.d_model, q_dim + 2 * kv_dim, bias=False)  # [Q | K | V]
        self.proj = nn.Linear(q_dim, cfg.d_model, bias=False)
        self.q_norm = nn.LayerNorm(self.head_dim) if cfg.qk_norm else None
        self.k_norm = nn.LayerNorm(self.head_dim) if cfg.qk_norm else None
        self.qk_hook = None  # e.g. monitor.capture_qk
        self.out_hook = None  # e.g. monitor.check_attention_output
        self.lowprec_strength = 0.0
        self.lowprec_on_probs = True
        self.lowprec_on_out = True
        self.precision = None  # "bf16"/"fp16": healthy round-to-nearest P and O
        self.rtn_strength = 0.0  # > 0: the emulated bf16 FlashAttention fault
        self.rtn_tie_window = 0.0

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2)
                   for z in self.qkv(x).split(self.split, dim=2))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.qk_hook is not None:
            self.qk_hook(self.layer_idx, q, k)  # the capture point: Q, K as attention uses them
        k_kv, v_kv = k, v  # one head per K/V group, as the monitor's reference takes them
        if self.n_kv_head != self.n_head:
            group = self.n_head // self.n_kv_head
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = causal_attention(q, k, v, self.lowprec_strength, self.lowprec_on_probs,
                             self.lowprec_on_out, self.precision, self.rtn_strength,
                             self.rtn_tie_window)
        if self.out_hook is not None:  # the output as this kernel computed it, [B, H, T, d]
            self.out_hook(self.layer_idx, q, k_kv, v_kv, y)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, d_model, hidden):
        super().__init__()
        self.up = nn.Linear(d_model, hidden)
        self.down = nn.Linear(hidden, d_model)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MoEFeedForward(nn.Module):
    """Top-k routed experts; `router` gives the logits, `aux_loss` balances the load."""

    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_experts = cfg.n_experts
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg.d_model, cfg.expert_hidden)
                                     for _ in range(cfg.n_experts))
        self.router_hook = None  # e.g. monitor.capture_router
        self.aux_loss = None

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x)
        if self.router_hook is not None:
            self.router_hook(self.layer_idx, logits, self.top_k)
        probs = torch.softmax(logits, dim=-1)
        top_p, top_i = probs.topk(self.top_k, dim=-1)
        weights = top_p / top_p.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = (top_i == e).nonzero(as_tuple=True)
            if token.numel():
                out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        # Switch-Transformer balance loss: E * sum_e (share of assignments) * (mean prob).
        assigned = F.one_hot(top_i, self.n_experts).sum(dim=1).float().mean(dim=0) / self.top_k
        self.aux_loss = self.n_experts * (assigned * probs.mean(dim=0)).sum()
        return out.reshape(shape)


class Block(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg, layer_idx)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.ffn = (MoEFeedForward(cfg, layer_idx) if layer_idx in cfg.moe_layers
                    else MLP(cfg.d_model, cfg.mlp_hidden))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class TinyMoEGPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "down.weight")):
                # GPT-2: residual branches scaled down with depth.
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def moe_aux_loss(self):
        """Sum of the MoE balance losses of the last forward."""
        return sum(b.ffn.aux_loss for b in self.blocks if isinstance(b.ffn, MoEFeedForward))

    def set_qk_hook(self, hook):
        """hook(layer, q, k) with q, k [B, H, T, d]; e.g. monitor.capture_qk. None removes it."""
        for block in self.blocks:
            block.attn.qk_hook = hook

    def set_out_hook(self, hook):
        """hook(layer, q, k, v, out): the attention inputs (K/V one head per group) and
        its output [B, H, T, d]; e.g. monitor.check_attention_output. None removes it."""
        for block in self.blocks:
            block.attn.out_hook = hook

    def set_router_hook(self, hook):
        """hook(layer, logits [N, E], top_k); e.g. monitor.capture_router."""
        for block in self.blocks:
            if isinstance(block.ffn, MoEFeedForward):
                block.ffn.router_hook = hook

    def set_attention_precision(self, precision):
        """None/"fp32": exact attention; "bf16"/"fp16": P and O rounded to nearest."""
        for block in self.blocks:
            block.attn.precision = None if precision in (None, "fp32") else precision

    def set_lowprec(self, strength, on_probs=True, on_out=True, layers=None):
        """Turns the biased low-precision attention fault on (strength > 0) or off (0)."""
        for i, block in enumerate(self.blocks):
            on = layers is None or i in layers
            block.attn.lowprec_strength = strength if on else 0.0
            block.attn.lowprec_on_probs = on_probs
            block.attn.lowprec_on_out = on_out

    def set_lowprec_rtn(self, strength, tie_window=0.0, layers=None):
        """Turns the emulated bf16 FlashAttention fault (FlashRTNAttention) on
        (strength > 0: the multiplier of its rounding error) or off (0)."""
        for i, block in enumerate(self.blocks):
            on = layers is None or i in layers
            block.attn.rtn_strength = strength if on else 0.0
            block.attn.rtn_tie_window = tie_window
