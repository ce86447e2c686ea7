"""Finding Q/K projections and MoE routers in a model, and collecting them during a probe.

Two ways to get Q/K out of a forward pass (see README.md):
- explicit: the attention forward calls `monitor.capture_qk(layer, q, k)`;
- discovered: forward hooks on projection layers found by name (below).

Hooks are attached only for the duration of a probe forward, so the training
forward pays nothing for them.
"""
import dataclasses
import logging

import torch

from foreshock.v1 import ingest_pb2 as pb

log = logging.getLogger("foreshock")

# Attribute names that carry the number of query heads / key-value heads.
HEAD_COUNT_ATTRS = ("n_head", "num_heads", "n_heads", "num_attention_heads")
KV_HEAD_COUNT_ATTRS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "n_kv_head")
# Fused projections whose output features are [Q | K | V], concatenated.
FUSED_QKV_NAMES = ("c_attn", "qkv", "qkv_proj", "Wqkv")
# Router projections inside an MoE block (a module that also has `experts`).
ROUTER_NAMES = ("router", "gate")
TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "moe_top_k", "k")


@dataclasses.dataclass
class ModelInfo:
    """Shape of the monitored model, sent to the daemon in the stream's Hello."""
    n_layers: int = 0
    n_heads: int = 0
    head_dim: int = 0
    n_experts: int = 0
    top_k: int = 0
    moe_layers: tuple = ()

    def to_proto(self):
        return pb.ModelInfo(n_layers=self.n_layers, n_heads=self.n_heads, head_dim=self.head_dim,
                            n_experts=self.n_experts, top_k=self.top_k,
                            moe_layers=list(self.moe_layers))


def _first_int_attr(objs, names):
    for obj in objs:
        if obj is None:
            continue
        for name in names:
            value = getattr(obj, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _out_features(module):
    # nn.Linear has out_features; HF's GPT-2 Conv1D has nf.
    for name in ("out_features", "nf"):
        value = getattr(module, name, None)
        if isinstance(value, int):
            return value
    return None


def _is_projection(module):
    return module is not None and _out_features(module) is not None


def to_heads_tokens(x, n_heads):
    """[..., T, n_heads * d] projection output -> ([n_heads, B*T, d], T)."""
    if x.dim() == 2:
        x = x.unsqueeze(0)
    seq_len, head_dim = x.shape[-2], x.shape[-1] // n_heads
    x = x.reshape(-1, seq_len, n_heads, head_dim)        # [B, T, H, d]
    return x.permute(2, 0, 1, 3).reshape(n_heads, -1, head_dim), seq_len


def heads_tokens_from_bhtd(x):
    """capture_qk layout: [B, H, T, d] or [H, T, d] -> ([H, B*T, d], T)."""
    if x.dim() == 3:
        return x, x.shape[1]
    if x.dim() == 4:
        b, h, t, d = x.shape
        return x.permute(1, 0, 2, 3).reshape(h, b * t, d), t
    raise ValueError(f"expected q/k as [B, H, T, d] or [H, T, d], got shape {tuple(x.shape)}")


def broadcast_kv_heads(q, k):
    """Grouped-query attention: repeat each K head for the query heads that share it."""
    hq, hk = q.shape[0], k.shape[0]
    if hq == hk:
        return k
    if hk == 0 or hq % hk:
        raise ValueError(f"{hq} query heads cannot share {hk} key heads")
    # Query head h uses K head h // (hq/hk), the layout of HF's repeat_kv.
    return k.repeat_interleave(hq // hk, dim=0)


@dataclasses.dataclass
class AttentionSite:
    """One discovered attention module and how to read Q and K from it."""
    layer: int
    name: str
    kind: str                 # "q_proj/k_proj" or "fused:<child name>"
    n_heads: int
    n_kv_heads: int
    head_dim: int
    q_module: torch.nn.Module
    k_module: torch.nn.Module  # the fused projection for fused kinds


@dataclasses.dataclass
class RouterSite:
    layer: int
    name: str
    n_experts: int
    top_k: int
    module: torch.nn.Module


def discover_attention(model, fallback_heads=0):
    """Attention modules in forward registration order; the order is the layer index."""
    sites = []
    for name, module in model.named_modules():
        children = dict(module.named_children())
        q, k = children.get("q_proj"), children.get("k_proj")
        fused_name = next((n for n in FUSED_QKV_NAMES if _is_projection(children.get(n))), None)
        if _is_projection(q) and _is_projection(k):
            kind, q_mod, k_mod = "q_proj/k_proj", q, k
            q_width, k_width = _out_features(q), _out_features(k)
        elif fused_name is not None:
            kind, q_mod = f"fused:{fused_name}", children[fused_name]
            k_mod = q_mod
        else:
            continue
        config = getattr(module, "config", None)
        n_heads = _first_int_attr((module, config), HEAD_COUNT_ATTRS) or fallback_heads
        if not n_heads:
            log.warning("foreshock: %s looks like attention (%s) but has no head count "
                        "attribute %s; pass model_info=ModelInfo(n_heads=...) or call "
                        "monitor.capture_qk from its forward", name, kind, HEAD_COUNT_ATTRS)
            continue
        n_kv = _first_int_attr((module, config), KV_HEAD_COUNT_ATTRS)
        head_dim = _first_int_attr((module,), ("head_dim",))
        if kind.startswith("fused"):
            total = _out_features(q_mod)
            if head_dim is None:
                # [Q | K | V] with K, V of n_kv heads each (n_kv = n_heads without GQA).
                head_dim = total // (n_heads + 2 * (n_kv or n_heads))
            n_kv = n_kv or n_heads
            if (n_heads + 2 * n_kv) * head_dim != total:
                log.warning("foreshock: %s.%s has %d outputs, not (%d + 2*%d) heads x %d; skipped",
                            name, fused_name, total, n_heads, n_kv, head_dim)
                continue
        else:
            head_dim = head_dim or q_width // n_heads
            n_kv = n_kv or k_width // head_dim
            if q_width != n_heads * head_dim or k_width != n_kv * head_dim:
                log.warning("foreshock: %s q_proj/k_proj widths %d/%d do not fit %d heads x %d; "
                            "skipped", name, q_width, k_width, n_heads, head_dim)
                continue
        if n_heads % n_kv:
            log.warning("foreshock: %s has %d query heads and %d key heads; skipped",
                        name, n_heads, n_kv)
            continue
        sites.append(AttentionSite(len(sites), name, kind, n_heads, n_kv, head_dim, q_mod, k_mod))
    return sites


def discover_routers(model, attention_sites, fallback_top_k=0):
    """Router projections of MoE blocks, each given the layer of the attention before it."""
    layer_of = {s.name: s.layer for s in attention_sites}
    sites = []
    current_layer = -1
    for name, module in model.named_modules():
        current_layer = layer_of.get(name, current_layer)
        children = dict(module.named_children())
        if "experts" not in children:
            continue
        router_name = next((n for n in ROUTER_NAMES if _is_projection(children.get(n))), None)
        if router_name is None:
            continue
        top_k = _first_int_attr((module, getattr(module, "config", None)), TOP_K_ATTRS) \
            or fallback_top_k
        if not top_k:
            log.warning("foreshock: MoE block %s has no top-k attribute %s; router skipped",
                        name, TOP_K_ATTRS)
            continue
        # Without any attention module seen yet, fall back to the router's own order.
        layer = current_layer if current_layer >= 0 else len(sites)
        sites.append(RouterSite(layer, f"{name}.{router_name}",
                                _out_features(children[router_name]), top_k,
                                children[router_name]))
    return sites


def model_info_from_sites(attention, routers):
    first = attention[0] if attention else None
    return ModelInfo(
        n_layers=len(attention),
        n_heads=first.n_heads if first else 0,
        head_dim=first.head_dim if first else 0,
        n_experts=routers[0].n_experts if routers else 0,
        top_k=routers[0].top_k if routers else 0,
        moe_layers=tuple(sorted({r.layer for r in routers})),
    )


class ProbeCollector:
    """What one probe forward produced: Q/K per layer and router logits per layer.

    Tensors are kept detached, on their device; they are encoded after the
    forward. The first capture of a layer wins (a module called twice in one
    forward, e.g. shared weights, is sampled at its first call).
    """

    def __init__(self):
        self.explicit_qk = {}      # layer -> (q [H, N, d], k [H, N, d], seq_len)
        self.discovered_qk = {}
        self.explicit_router = {}  # layer -> (logits [N, E], top_k)
        self.discovered_router = {}

    def add_qk(self, store, layer, q, k, seq_len):
        if layer in store:
            return
        if q.shape[1] != k.shape[1]:
            log.warning("foreshock: layer %d has %d query tokens and %d key tokens "
                        "(cross-attention?); not sampled", layer, q.shape[1], k.shape[1])
            return
        store[layer] = (q.detach(), broadcast_kv_heads(q.detach(), k.detach()), seq_len)

    def add_router(self, store, layer, logits, top_k):
        if layer not in store:
            store[layer] = (logits.detach().reshape(-1, logits.shape[-1]), top_k)

    def attach(self, attention_sites, router_sites):
        """Registers the discovery hooks; returns their handles for removal."""
        handles = []
        for site in attention_sites:
            if site.kind == "q_proj/k_proj":
                pending = {}

                def on_q(_m, _i, out, site=site, pending=pending):
                    pending["q"] = to_heads_tokens(out, site.n_heads)

                def on_k(_m, _i, out, site=site, pending=pending):
                    if "q" in pending:  # q_proj runs before k_proj in the forward
                        q, seq_len = pending.pop("q")
                        k, _ = to_heads_tokens(out, site.n_kv_heads)
                        self.add_qk(self.discovered_qk, site.layer, q, k, seq_len)

                handles.append(site.q_module.register_forward_hook(on_q))
                handles.append(site.k_module.register_forward_hook(on_k))
            else:
                def on_fused(_m, _i, out, site=site):
                    qw, kw = site.n_heads * site.head_dim, site.n_kv_heads * site.head_dim
                    q, seq_len = to_heads_tokens(out[..., :qw], site.n_heads)
                    k, _ = to_heads_tokens(out[..., qw:qw + kw], site.n_kv_heads)
                    self.add_qk(self.discovered_qk, site.layer, q, k, seq_len)

                handles.append(site.q_module.register_forward_hook(on_fused))
        for site in router_sites:
            def on_router(_m, _i, out, site=site):
                self.add_router(self.discovered_router, site.layer, out, site.top_k)

            handles.append(site.module.register_forward_hook(on_router))
        return handles
