"""Finding Q/K and MoE routers in a model, and collecting them during a probe.

Two ways to get Q/K out of a forward pass (see README.md):
- explicit: the attention forward calls `monitor.capture_qk(layer, q, k)`;
- discovered:
  - Hugging Face transformers (>= 4.48) attention modules pick their attention
    function from `ALL_ATTENTION_FUNCTIONS` (or call the modeling module's
    `eager_attention_forward`). During the probe those two names, in the
    globals of the module's forward, are replaced by wrappers that see the
    function's `query` [B, H, T, d] and `key` [B, Hkv, T, d]: the tensors
    whose product is the attention logits (after rotary, q_norm/k_norm, ...),
    under every attn_implementation (eager, sdpa, flash, flex).
  - anything else: forward hooks on projections found by name (q_proj/k_proj,
    fused [Q | K | V]): Q and K before any rotary embedding.

Hooks and wrappers are attached only for the duration of a probe forward, so
the training forward pays nothing for them.
"""
import contextlib
import dataclasses
import functools
import inspect
import logging
import math
import threading

import torch

from foreshock import output_check
from foreshock.v1 import ingest_pb2 as pb

log = logging.getLogger("foreshock")

# Attribute names that carry the number of query heads / key-value heads.
HEAD_COUNT_ATTRS = ("n_head", "num_heads", "n_heads", "num_attention_heads")
KV_HEAD_COUNT_ATTRS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "n_kv_head")
# Fused projections whose output features are [Q | K | V], concatenated.
FUSED_QKV_NAMES = ("c_attn", "qkv", "qkv_proj", "Wqkv")
# Router inside an MoE block (a module that also has `experts`): a projection
# (nn.Linear) or, in transformers >= 5, a *TopKRouter with a [experts, hidden]
# `weight` that returns (router_logits, weights, indices).
ROUTER_NAMES = ("router", "gate")
EXPERT_COUNT_ATTRS = ("num_experts", "num_local_experts", "moe_num_experts", "n_routed_experts")
TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "moe_top_k", "k")
# The globals through which a transformers attention forward reaches its
# attention function (a forward naming either is an "attention_interface" site).
HF_ATTENTION_GLOBALS = ("ALL_ATTENTION_FUNCTIONS", "eager_attention_forward")
INTERFACE = "attention_interface"
CAPTURE_QK_HINT = "call monitor.capture_qk(layer, q, k) from its forward, after rotary embedding"
CAPTURE_ROUTER_HINT = "call monitor.capture_router(layer, logits, top_k) from its forward"


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


def _float_attr(module, name):
    value = getattr(module, name, None)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


def _under(name, parent):
    """Whether module `name` is `parent` or inside it ("" is the root)."""
    return parent == "" or name == parent or name.startswith(parent + ".")


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
    """Grouped-query attention: repeat each K head for the query heads that
    share it (Monitor(broadcast_kv=True), for daemons that predate K with its
    own heads on the wire)."""
    hq, hk = q.shape[0], k.shape[0]
    if hq == hk:
        return k
    if hk == 0 or hq % hk:
        raise ValueError(f"{hq} query heads cannot share {hk} key heads")
    # Query head h uses K head h // (hq/hk), the layout of HF's repeat_kv.
    return k.repeat_interleave(hq // hk, dim=0)


def fold_scaling(q, scaling, head_dim):
    """The daemon takes the logits to be q·kᵀ/√d (docs/DESIGN.md §1.1). A model
    whose scale differs (GPT-2's scale_attn_by_inverse_layer_idx, Granite's
    attention_multiplier) gets it folded into Q, so that the daemon's logits
    are the model's. No copy when the scale is the usual one."""
    if scaling is None or head_dim <= 0:
        return q
    factor = float(scaling) * math.sqrt(head_dim)
    return q if abs(factor - 1.0) < 1e-6 else q * factor


def autocast_dtype(device_type):
    """The dtype autocast computes in on `device_type` right now, or None when
    autocast is off there. torch >= 2.4 has is_autocast_enabled(device_type) and
    get_autocast_dtype(device_type); older versions (1.13 included) only the
    per-device functions for cuda and cpu."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return None
    except (TypeError, AttributeError, RuntimeError):
        pass  # torch < 2.4
    if device_type == "cuda":
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
    if device_type == "cpu":
        enabled = getattr(torch, "is_autocast_cpu_enabled", None)
        if enabled is not None and enabled():
            return torch.get_autocast_cpu_dtype()
    return None


def autocast_context(device_type, dtype):
    """torch.autocast(device_type, dtype), or a no-op context for dtype None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def without_autocast(device_type):
    """A context in which autocast is off on `device_type` (an fp32 reference)."""
    try:
        return torch.autocast(device_type=device_type, enabled=False)
    except RuntimeError:  # a device type autocast does not know
        return contextlib.nullcontext()


@dataclasses.dataclass(repr=False)
class AttentionSite:
    """One discovered attention module and how to read Q and K from it."""
    layer: int
    name: str
    kind: str                  # "attention_interface", "q_proj/k_proj" or "fused:<child name>"
    n_heads: int
    n_kv_heads: int
    head_dim: int
    q_module: torch.nn.Module = None  # projections (None for an interface site without any)
    k_module: torch.nn.Module = None  # the fused projection for fused kinds
    module: torch.nn.Module = None    # the attention module itself
    scaling: float = None      # its own logit scale, when it declares one (`scaling`)
    # attention_interface sites: the (globals dict, name) pairs wrapped during
    # the probe, the projection kind to fall back on if the module turns out
    # not to call the interface, and whether it was seen calling it.
    interface_globals: tuple = ()
    fallback_kind: str = None
    verified: bool = False
    warned: set = dataclasses.field(default_factory=set)

    def __repr__(self):
        # Short: the module and the interface globals (a modeling module's whole
        # namespace) would make print(monitor.attention_sites) 100+ KB.
        return (f"AttentionSite(layer={self.layer}, name={self.name!r}, kind={self.kind!r}, "
                f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
                f"head_dim={self.head_dim}, module={type(self.module).__name__})")


@dataclasses.dataclass(repr=False)
class RouterSite:
    layer: int
    name: str
    n_experts: int
    top_k: int
    module: torch.nn.Module
    warned: bool = False

    def __repr__(self):
        return (f"RouterSite(layer={self.layer}, name={self.name!r}, n_experts={self.n_experts}, "
                f"top_k={self.top_k}, module={type(self.module).__name__})")


def _interface_globals(module):
    """((globals, name), ...) through which module's forward reaches a transformers
    attention function; () if it does not name one."""
    cls = type(module)
    cached = _INTERFACE_NAMES.get(cls)
    if cached is None:
        cached = ()
        try:
            fn = inspect.unwrap(cls.forward)
            names = fn.__code__.co_names
            cached = tuple((fn.__globals__, n) for n in HF_ATTENTION_GLOBALS
                           if n in names and n in fn.__globals__)
        except (AttributeError, TypeError, ValueError):
            pass  # not a plain Python forward (scripted, builtin)
        _INTERFACE_NAMES[cls] = cached
    return cached


_INTERFACE_NAMES = {}  # class -> its forward's interface globals


def _projection_geometry(kind, q_mod, k_mod, n_heads, n_kv, head_dim):
    """(n_kv, head_dim) of a q_proj/k_proj or fused site, or (None, reason)."""
    if kind.startswith("fused"):
        total = _out_features(q_mod)
        if head_dim is None:
            # [Q | K | V] with K, V of n_kv heads each (n_kv = n_heads without GQA).
            head_dim = total // (n_heads + 2 * (n_kv or n_heads))
        n_kv = n_kv or n_heads
        if head_dim <= 0 or (n_heads + 2 * n_kv) * head_dim != total:
            return None, (f"{kind[6:]} has {total} outputs, not ({n_heads} + 2*{n_kv}) heads "
                          f"x {head_dim} (an interleaved layout?)")
    else:
        q_width, k_width = _out_features(q_mod), _out_features(k_mod)
        head_dim = head_dim or q_width // n_heads
        n_kv = n_kv or (k_width // head_dim if head_dim else 0)
        if not head_dim or q_width != n_heads * head_dim or k_width != n_kv * head_dim:
            return None, (f"q_proj/k_proj widths {q_width}/{k_width} do not fit {n_heads} "
                          f"heads x {head_dim}")
    if n_heads % n_kv:
        return None, f"{n_heads} query heads cannot share {n_kv} key heads"
    return (n_kv, head_dim), None


def _attention_site(name, module, fallback_heads, layer):
    children = dict(module.named_children())
    interface = _interface_globals(module)
    q, k = children.get("q_proj"), children.get("k_proj")
    fused_name = next((n for n in FUSED_QKV_NAMES if _is_projection(children.get(n))), None)
    if _is_projection(q) and _is_projection(k):
        proj_kind, q_mod, k_mod = "q_proj/k_proj", q, k
    elif fused_name is not None:
        proj_kind, q_mod, k_mod = f"fused:{fused_name}", children[fused_name], children[fused_name]
    else:
        proj_kind = q_mod = k_mod = None
    if not interface and proj_kind is None:
        return None
    where = f"{name} ({type(module).__name__})"
    config = getattr(module, "config", None)
    n_heads = _first_int_attr((module, config), HEAD_COUNT_ATTRS) or fallback_heads
    if not n_heads:
        log.warning("foreshock: %s looks like attention (%s) but has no head count attribute "
                    "%s; pass model_info=ModelInfo(n_heads=...) or %s", where,
                    INTERFACE if interface else proj_kind, HEAD_COUNT_ATTRS, CAPTURE_QK_HINT)
        return None
    n_kv = _first_int_attr((module, config), KV_HEAD_COUNT_ATTRS)
    groups = _first_int_attr((module,), ("num_key_value_groups",))
    if n_kv is None and groups and n_heads % groups == 0:
        n_kv = n_heads // groups
    head_dim = _first_int_attr((module,), ("head_dim",))
    scaling = _float_attr(module, "scaling")
    geometry, reason = None, None
    if proj_kind is not None:
        geometry, reason = _projection_geometry(proj_kind, q_mod, k_mod, n_heads, n_kv, head_dim)
    if not interface:
        if geometry is None:
            log.warning("foreshock: %s: %s; skipped: %s", where, reason, CAPTURE_QK_HINT)
            return None
        return AttentionSite(layer, name, proj_kind, n_heads, geometry[0], geometry[1],
                             q_mod, k_mod, module=module, scaling=scaling)
    # transformers attention: Q/K come from the attention function's arguments;
    # the shapes here are for ModelInfo and are checked against them at the probe.
    if geometry is not None:
        n_kv, head_dim = n_kv or geometry[0], head_dim or geometry[1]
    head_dim = head_dim or _first_int_attr((config,), ("head_dim",))
    if head_dim is None:
        hidden = _first_int_attr((config,), ("hidden_size", "n_embd", "d_model"))
        head_dim = hidden // n_heads if hidden and hidden % n_heads == 0 else None
    n_kv = n_kv or n_heads
    if head_dim is None or n_heads % n_kv:
        log.warning("foreshock: %s calls transformers' attention interface, but its head_dim "
                    "or key heads (%s query heads, %s key heads) are unknown; skipped: %s",
                    where, n_heads, n_kv, CAPTURE_QK_HINT)
        return None
    return AttentionSite(layer, name, INTERFACE, n_heads, n_kv, head_dim,
                         q_mod if geometry else None, k_mod if geometry else None,
                         module=module, scaling=scaling, interface_globals=interface,
                         fallback_kind=proj_kind if geometry else None)


def discover_attention(model, fallback_heads=0):
    """Attention modules in forward registration order; the order is the layer index."""
    sites = []
    for name, module in model.named_modules():
        site = _attention_site(name, module, fallback_heads, len(sites))
        if site is not None:
            sites.append(site)
    _warn_undiscovered_attention(model, sites)
    return sites


def _warn_undiscovered_attention(model, sites):
    """A module named like attention with no discovered site in or around it is
    a layer the probe would silently miss: name it and the fix."""
    found = [s.name for s in sites]
    warned, missed = [], []
    for name, module in model.named_modules():
        if "attention" not in type(module).__name__.lower():
            continue
        if any(_under(name, f) or _under(f, name) for f in found) \
                or any(_under(name, w) for w in warned):
            continue
        warned.append(name)
        missed.append(f"{name or '<model>'} ({type(module).__name__})")
    if missed:
        shown = ", ".join(missed[:4]) + (f", ... ({len(missed) - 4} more)" if len(missed) > 4
                                         else "")
        log.warning("foreshock: %s look%s like attention, but discovery cannot read Q and K "
                    "there (no transformers attention-interface call, no q_proj/k_proj, no "
                    "fused [Q | K | V] child %s): not sampled; %s", shown,
                    "s" if len(missed) == 1 else "", FUSED_QKV_NAMES, CAPTURE_QK_HINT)


def _n_experts(router):
    return _out_features(router) or _first_int_attr((router,), EXPERT_COUNT_ATTRS) or (
        router.weight.shape[0] if isinstance(getattr(router, "weight", None), torch.Tensor)
        and router.weight.dim() == 2 else None)


def discover_routers(model, attention_sites, fallback_top_k=0):
    """Routers of MoE blocks, each given the layer of the attention before it."""
    layer_of = {s.name: s.layer for s in attention_sites}
    sites = []
    current_layer = -1
    for name, module in model.named_modules():
        current_layer = layer_of.get(name, current_layer)
        children = dict(module.named_children())
        if "experts" not in children:
            continue
        router_name = next((n for n in ROUTER_NAMES
                            if children.get(n) is not None and _n_experts(children[n])), None)
        if router_name is None:
            log.warning("foreshock: %s (%s) has experts but no router child %s with an expert "
                        "count; router skipped: %s", name, type(module).__name__, ROUTER_NAMES,
                        CAPTURE_ROUTER_HINT)
            continue
        router = children[router_name]
        top_k = _first_int_attr((module, router, getattr(module, "config", None),
                                 getattr(router, "config", None)), TOP_K_ATTRS) or fallback_top_k
        if not top_k:
            log.warning("foreshock: MoE block %s (%s) has no top-k attribute %s; router skipped: "
                        "pass model_info=ModelInfo(top_k=...) or %s", name,
                        type(module).__name__, TOP_K_ATTRS, CAPTURE_ROUTER_HINT)
            continue
        # Without any attention module seen yet, fall back to the router's own order.
        layer = current_layer if current_layer >= 0 else len(sites)
        sites.append(RouterSite(layer, f"{name}.{router_name}", _n_experts(router), top_k,
                                router))
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


def router_logits(out, n_experts):
    """The [..., n_experts] logits in a router's output: the output itself, or the
    first such tensor of a tuple ((logits, weights, indices) in transformers >= 5;
    Llama-4's router returns (scores [E, T], logits))."""
    candidates = out if isinstance(out, (tuple, list)) else (out,)
    for t in candidates:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 1 \
                and t.shape[-1] == n_experts:
            return t
    return None


# -- wrapping transformers' attention functions during a probe ---------------------

_tap_lock = threading.Lock()
# id(attention module) -> (callback(module, query, key, kwargs),
#                          on_output(module, fn, args, kwargs, result) or None)
_taps = {}
_patches = {}   # (id(globals), name) -> [globals, original, users]
_wrapped = {}   # attention function -> its wrapper


def _wrap_attention_fn(fn):
    """fn(module, query, key, value, mask, **kwargs) with a tap on (query, key)."""
    if not callable(fn) or getattr(fn, "_foreshock_original", None) is not None:
        return fn
    wrapper = _wrapped.get(fn)
    if wrapper is None:
        @functools.wraps(fn)
        def wrapper(module, *args, **kwargs):
            tap = _taps.get(id(module))
            if tap is None:
                return fn(module, *args, **kwargs)
            callback, on_output = tap
            query = args[0] if args else kwargs.get("query")
            key = args[1] if len(args) > 1 else kwargs.get("key")
            callback(module, query, key, kwargs)
            result = fn(module, *args, **kwargs)
            if on_output is not None:
                on_output(module, fn, args, kwargs, result)
            return result

        wrapper._foreshock_original = fn
        _wrapped[fn] = wrapper
    return wrapper


class _InterfaceProxy:
    """Stands in for ALL_ATTENTION_FUNCTIONS: the same mapping, wrapped functions."""

    def __init__(self, real):
        self._foreshock_real = real

    def get_interface(self, *args, **kwargs):   # transformers >= 4.56
        return _wrap_attention_fn(self._foreshock_real.get_interface(*args, **kwargs))

    def __getitem__(self, key):                  # transformers 4.48-4.55
        return _wrap_attention_fn(self._foreshock_real[key])

    def get(self, key, default=None):
        return _wrap_attention_fn(self._foreshock_real.get(key, default))

    def __contains__(self, key):
        return key in self._foreshock_real

    def __iter__(self):
        return iter(self._foreshock_real)

    def __len__(self):
        return len(self._foreshock_real)

    def __getattr__(self, name):
        return getattr(self._foreshock_real, name)


class _InterfaceTap:
    """Handle: routes one module's attention-function calls to a callback, until
    remove(). The patched globals are shared by every module of that modeling
    file (and every thread) while any tap is on; the wrappers pass calls of
    other modules straight through."""

    def __init__(self, site, callback, on_output=None):
        self._module_id = id(site.module)
        self._keys = []
        with _tap_lock:
            _taps[self._module_id] = (callback, on_output)
            for globs, name in site.interface_globals:
                key = (id(globs), name)
                entry = _patches.get(key)
                if entry is None:
                    original = globs[name]
                    entry = _patches[key] = [globs, original, 0]
                    globs[name] = _InterfaceProxy(original) if name == "ALL_ATTENTION_FUNCTIONS" \
                        else _wrap_attention_fn(original)
                entry[2] += 1
                self._keys.append(key)

    def remove(self):
        with _tap_lock:
            _taps.pop(self._module_id, None)
            for key in self._keys:
                entry = _patches[key]
                entry[2] -= 1
                if entry[2] == 0:
                    globs, original, _ = _patches.pop(key)
                    globs[key[1]] = original
            self._keys = []


class ProbeCollector:
    """What one probe forward produced: Q/K per layer and router logits per layer.

    Tensors are kept detached, on their device; they are encoded after the
    forward. The first capture of a layer wins (a module called twice in one
    forward, e.g. shared weights, is sampled at its first call).
    """

    def __init__(self, reduce=None, check_outputs=False):
        # layer -> (q [H, N, d], k [Hkv, N, d], seq_len, sampled): sampled is
        # what `reduce` returned beside the tensors, None when it kept them whole.
        self.explicit_qk = {}
        self.discovered_qk = {}
        self.fallback_qk = {}      # projection samples of interface sites not yet verified
        self.explicit_router = {}  # layer -> (logits [N, E], top_k)
        self.discovered_router = {}
        self._attention_sites = []
        # reduce(q, k, seq_len) -> (q, k, seq_len, sampled): the monitor's
        # sampling, applied as each layer is captured, so that a large model's
        # probe never holds every layer's whole Q/K at once (foreshock.sampling).
        self.reduce = reduce
        # layer -> QKSample.output_check fields (foreshock.output_check): from
        # Monitor.check_attention_output, or, with check_outputs, from the
        # attention function called again in fp32 (interface sites).
        self.output_checks = {}
        self.check_outputs = check_outputs
        # layer -> the dtype of the attention function's output (interface
        # sites): what the kernel computed in, which under autocast is not the
        # dtype of the Q/K it was handed (rotary with fp32 cos/sin promotes them).
        self.output_dtypes = {}
        # layer -> the attention function's logit soft-cap (its `softcap` argument).
        self.softcaps = {}

    def add_qk(self, store, layer, q, k, seq_len):
        if layer in store:
            return
        if q.shape[1] != k.shape[1]:
            log.warning("foreshock: layer %d has %d query tokens and %d key tokens "
                        "(cross-attention?); not sampled", layer, q.shape[1], k.shape[1])
            return
        hq, hk = q.shape[0], k.shape[0]
        if hk == 0 or hq % hk:
            raise ValueError(f"layer {layer}: {hq} query heads cannot share {hk} key heads")
        # Grouped-query K goes on the wire once per group: the daemon pairs
        # query head h with K head h // (hq/hk), the layout of HF's repeat_kv.
        q, k, sampled = q.detach(), k.detach(), None
        if self.reduce is not None:
            q, k, seq_len, sampled = self.reduce(q, k, seq_len)
        store[layer] = (q, k, seq_len, sampled)

    def add_output_check(self, layer, stats):
        if stats is not None and layer not in self.output_checks:
            self.output_checks[layer] = stats

    def add_router(self, store, layer, logits, top_k):
        if layer not in store:
            store[layer] = (logits.detach().reshape(-1, logits.shape[-1]), top_k)

    def _on_attention(self, site, query, key, kwargs):
        """A tapped attention function's query [B, H, T, d] and key [B, Hkv, T, d]."""
        if site.layer in self.discovered_qk:
            return
        shape_ok = (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor)
                    and query.dim() == 4 and key.dim() == 4
                    and query.shape[1] == site.n_heads and key.shape[1] == site.n_kv_heads
                    and query.shape[-1] == key.shape[-1] == site.head_dim)
        if not shape_ok:
            _warn_once(site, "shape", "foreshock: %s (%s) passed query %s and key %s to its "
                       "attention function, not [B, %d, T, %d] and [B, %d, T, %d]; not sampled: "
                       "%s", site.name, type(site.module).__name__, _shape(query), _shape(key),
                       site.n_heads, site.head_dim, site.n_kv_heads, site.head_dim,
                       CAPTURE_QK_HINT)
            return
        seq_len = query.shape[2]
        window = kwargs.get("sliding_window")
        if isinstance(window, int) and 0 < window < seq_len:
            _warn_once(site, "window", "foreshock: %s attends over a sliding window of %d "
                       "tokens, shorter than the probe's %d: the daemon's attention entropy and "
                       "max logit assume full causal attention", site.name, window, seq_len)
        softcap = kwargs.get("softcap")
        if isinstance(softcap, (int, float)) and not isinstance(softcap, bool) and softcap > 0:
            # Gemma 2: logits = cap * tanh(logits / cap); sent as QKSample.logit_softcap,
            # the daemon's max logit is then of the capped logits.
            self.softcaps[site.layer] = float(softcap)
        scaling = kwargs.get("scaling", site.scaling)
        q, _ = heads_tokens_from_bhtd(fold_scaling(query, scaling, site.head_dim))
        k, _ = heads_tokens_from_bhtd(key)
        self.add_qk(self.discovered_qk, site.layer, q, k, seq_len)

    def _attach_projection(self, site, kind, store, handles):
        if kind == "q_proj/k_proj":
            pending = {}

            def on_q(_m, _i, out, site=site, pending=pending):
                pending["q"] = to_heads_tokens(fold_scaling(out, site.scaling, site.head_dim),
                                               site.n_heads)

            def on_k(_m, _i, out, site=site, pending=pending):
                if "q" in pending:  # q_proj runs before k_proj in the forward
                    q, seq_len = pending.pop("q")
                    k, _ = to_heads_tokens(out, site.n_kv_heads)
                    self.add_qk(store, site.layer, q, k, seq_len)

            handles.append(site.q_module.register_forward_hook(on_q))
            handles.append(site.k_module.register_forward_hook(on_k))
        else:
            def on_fused(_m, _i, out, site=site):
                qw, kw = site.n_heads * site.head_dim, site.n_kv_heads * site.head_dim
                q = fold_scaling(out[..., :qw], site.scaling, site.head_dim)
                q, seq_len = to_heads_tokens(q, site.n_heads)
                k, _ = to_heads_tokens(out[..., qw:qw + kw], site.n_kv_heads)
                self.add_qk(store, site.layer, q, k, seq_len)

            handles.append(site.q_module.register_forward_hook(on_fused))

    def attach(self, attention_sites, router_sites):
        """Registers the discovery hooks and taps; returns their handles for removal."""
        handles = []
        self._attention_sites = list(attention_sites)
        for site in attention_sites:
            if site.kind != INTERFACE:
                self._attach_projection(site, site.kind, self.discovered_qk, handles)
                continue
            handles.append(_InterfaceTap(
                site, functools.partial(self._tapped, site),
                functools.partial(self._on_output, site)))
            if not site.verified and site.fallback_kind:
                # Until the module is seen calling the interface, also sample its
                # projections, in case it bypasses the interface (GPT-2's eager
                # reorder_and_upcast_attn).
                self._attach_projection(site, site.fallback_kind, self.fallback_qk, handles)
        for site in router_sites:
            def on_router(_m, _i, out, site=site):
                logits = router_logits(out, site.n_experts)
                if logits is None:
                    if not site.warned:
                        site.warned = True
                        log.warning("foreshock: router %s (%s) returned no [tokens, %d] logits; "
                                    "not sampled: %s", site.name, type(site.module).__name__,
                                    site.n_experts, CAPTURE_ROUTER_HINT)
                    return
                self.add_router(self.discovered_router, site.layer, logits, site.top_k)

            handles.append(site.module.register_forward_hook(on_router))
        return handles

    def _tapped(self, site, _module, query, key, kwargs):
        try:
            self._on_attention(site, query, key, kwargs)
        except Exception as e:  # noqa: BLE001 - never break the user's forward
            _warn_once(site, "error", "foreshock: sampling Q/K of %s failed (%s); not sampled: %s",
                       site.name, e, CAPTURE_QK_HINT)

    def _on_output(self, site, module, fn, args, kwargs, result):
        """The tapped attention function returned: note its output dtype, and
        check the output against an fp32 reference when asked to."""
        out = result[0] if isinstance(result, (tuple, list)) else result
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            self.output_dtypes.setdefault(site.layer, out.dtype)
        if self.check_outputs:
            self._check_output(site, module, fn, args, kwargs, result)

    def _check_output(self, site, module, fn, args, kwargs, result):
        """The attention function's output against the same function on fp32 inputs
        with autocast off: the model's own mask and scaling, only the precision
        differs. Low-precision attention only (inputs or, under autocast, the
        output; fp32 attention has nothing to compare with itself)."""
        if site.layer in self.output_checks:
            return
        query = args[0] if args else kwargs.get("query")
        out = result[0] if isinstance(result, (tuple, list)) else result
        low = (torch.bfloat16, torch.float16)
        if not isinstance(query, torch.Tensor) or not isinstance(out, torch.Tensor) or \
                (query.dtype not in low and out.dtype not in low):
            return
        try:
            with torch.no_grad(), without_autocast(query.device.type):
                ref = fn(module, *[output_check.upcast(a) for a in args],
                         **{name: output_check.upcast(a) for name, a in kwargs.items()})
            ref = ref[0] if isinstance(ref, (tuple, list)) else ref
            self.add_output_check(site.layer, output_check.compare(out, ref))
        except Exception as e:  # noqa: BLE001 - e.g. a flash kernel without fp32 support
            _warn_once(site, "output_check", "foreshock: %s (%s): its attention function "
                       "does not run on fp32 inputs (%s); its output is not checked against "
                       "an fp32 reference (attention_output_bias)", site.name,
                       type(site.module).__name__, e)

    def finish(self):
        """After a successful probe forward: an attention_interface site that did not
        call its attention function through the interface falls back to its
        projections (or is reported), for this probe and the next ones."""
        if self.explicit_qk:
            return  # explicit capture replaces discovery anyway
        for site in self._attention_sites:
            if site.kind != INTERFACE:
                continue
            if site.layer in self.discovered_qk:
                site.verified = True
                continue
            if site.fallback_kind is None:
                _warn_once(site, "bypass", "foreshock: %s (%s) did not call transformers' "
                           "attention interface during the probe; not sampled: %s", site.name,
                           type(site.module).__name__, CAPTURE_QK_HINT)
                continue
            log.warning("foreshock: %s (%s) did not call transformers' attention interface "
                        "during the probe; sampling Q/K from its %s instead (before any rotary "
                        "embedding): for post-rotary Q/K %s", site.name,
                        type(site.module).__name__, site.fallback_kind, CAPTURE_QK_HINT)
            site.kind = site.fallback_kind
            if site.layer in self.fallback_qk:
                self.discovered_qk[site.layer] = self.fallback_qk[site.layer]


def _shape(x):
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def _warn_once(site, what, *args):
    if what not in site.warned:
        site.warned.add(what)
        log.warning(*args)
