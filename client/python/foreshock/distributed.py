"""Models wrapped for distributed training, as the Monitor and the curvature
estimator see them (client/python/README.md, "Distributed training").

- DistributedDataParallel (and DataParallel): every rank holds the whole model.
  Discovery and the probe forward go through `model.module`: DDP's own forward
  broadcasts buffers (a collective every rank must join) and prepares its
  reducer for a backward that a probe never runs. Through `.module` the probe
  is local, so only the probing rank(s) run it.
- torch.compile (OptimizedModule): discovery and the probe go through
  `_orig_mod`, eagerly: hooks attached for one probe would otherwise make
  dynamo recompile.
- FSDP2 (`torch.distributed.fsdp.fully_shard`, FSDPModule anywhere in the
  model): each rank holds a shard of the weights and the forward all-gathers
  them, so the probe forward is collective. Every rank runs it at the same
  steps (the schedule is `step % every == 0`, nothing else: it never depends
  on the daemon or the sender), and only the sending rank(s) attach hooks and
  send. The activations are whole on every rank, so discovery works as usual.
- Refused at construction, with the fix in the message: FSDP1
  (FullyShardedDataParallel), DeepSpeed engines and ZeRO-3 partitioned
  parameters, and discovery on tensor-parallel DTensor layers (each rank's
  projection holds only its heads).

The curvature estimator runs on one rank: under DDP through `.module`
(torch.autograd.grad never runs the AccumulateGrad nodes DDP's reducer hooks
into, so no gradient all-reduce fires); FSDP2 and the refused wrappers are
refused there too (its products would need every rank).
"""
import dataclasses
import logging

import torch

log = logging.getLogger("foreshock")


def _dist():
    """torch.distributed when it is usable and initialized, else None."""
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def default_rank(rank=None):
    """`rank` when given, else this process's torch.distributed rank (0 when
    torch.distributed is not initialized)."""
    if rank is not None:
        return int(rank)
    dist = _dist()
    return dist.get_rank() if dist is not None else 0


def world_size():
    """torch.distributed's world size, or 1 when it is not initialized."""
    dist = _dist()
    return dist.get_world_size() if dist is not None else 1


def hello_labels(labels):
    """The Hello labels, plus `world_size` (ranks that report scalars for the
    run) from torch.distributed when there are several and the caller did not
    set it: the daemon then waits for every rank's scalars of the run's first
    steps before it averages them."""
    labels = {str(k): str(v) for k, v in dict(labels or {}).items()}
    n = world_size()
    if n > 1 and "world_size" not in labels:
        labels["world_size"] = str(n)
    return labels


@dataclasses.dataclass
class Layout:
    """What the monitor probes, found from the model it was given."""
    module: object = dataclasses.field(repr=False)  # discovery and the probe forward run on this
    collective: bool = False  # the probe forward runs collectives: every rank runs it
    wrappers: tuple = ()      # wrapper classes peeled off, outermost first
    kind: str = "local"       # "local", "ddp", "fsdp2", "tensor_parallel"

    def after_probe(self):
        """FSDP2 leaves the root's parameters unsharded after a no-grad forward
        (it expects a backward to follow): reshard everything, as after a
        training step, so the weights an optimizer step updates next are the
        ones the next forward gathers, and state_dict sees shards."""
        if not self.collective:
            return
        for sub in self.module.modules():
            if _is_fsdp2(sub) and hasattr(sub, "reshard"):
                sub.reshard()


def _class_names(obj):
    return {c.__name__ for c in type(obj).__mro__}


# Wrappers are recognized by class name (the whole MRO), not isinstance:
# importing torch.distributed.fsdp fails on some builds (Debian's torch 1.13
# under Python 3.11), and a model that uses none of them should not pay for
# the imports.
def _is(obj, *names):
    return not _class_names(obj).isdisjoint(names)


def _is_ddp(module):
    return _is(module, "DistributedDataParallel", "DataParallel") and hasattr(module, "module")


def _is_fsdp1(module):
    return _is(module, "FullyShardedDataParallel")


def _is_fsdp2(module):
    return _is(module, "FSDPModule")


def _is_dtensor(tensor):
    return _is(tensor, "DTensor")


def _is_compiled(module):
    # torch._dynamo.eval_frame.OptimizedModule, without importing dynamo.
    return "OptimizedModule" in _class_names(module) and hasattr(module, "_orig_mod")


def _refuse_unsupported(module, what):
    """Raises for wrappers whose probe forward the client cannot run safely."""
    if "DeepSpeedEngine" in _class_names(module):
        raise ValueError(
            f"{what}: a DeepSpeed engine is not supported as the model; pass engine.module "
            "(ZeRO stages 0-2, where every rank holds the whole weights), or model=None "
            "for scalars only")
    for name, sub in module.named_modules():
        if _is_fsdp1(sub):
            raise ValueError(
                f"{what}: FullyShardedDataParallel (FSDP1{', at ' + name if name else ''}) is "
                "not supported: shard with FSDP2 (torch.distributed.fsdp.fully_shard), "
                "which foreshock probes on every rank, or pass model=None for scalars only")
        if _is_ddp(sub) and sub is not module:
            raise ValueError(
                f"{what}: a DistributedDataParallel inside the model ({name}) would "
                "broadcast its buffers in the probe forward on one rank only; pass the "
                "model it wraps")
    for name, param in module.named_parameters():
        if hasattr(param, "ds_id") or hasattr(param, "ds_status"):
            raise ValueError(
                f"{what}: DeepSpeed ZeRO-3 partitioned parameters ({name}) are gathered "
                "by every rank in each forward; not supported: use ZeRO stage 0-2 or FSDP2 "
                "(fully_shard), or pass model=None for scalars only")


def _tensor_parallel_params(module):
    """Names of DTensor parameters sharded for tensor parallelism: outside FSDP2,
    or, under FSDP2, sharded on more than FSDP's dim 0 of one mesh dimension."""
    managed = set()
    for sub in module.modules():
        if _is_fsdp2(sub):
            managed.update(id(p) for p in sub.parameters())
    names = []
    for name, param in module.named_parameters():
        if not _is_dtensor(param):
            continue
        shards = [p for p in param.placements if p.is_shard()]
        if id(param) not in managed or len(shards) > 1 or \
                any(getattr(p, "dim", 0) != 0 for p in shards):
            names.append(name)
    return names


def layout_of(model, discover=True):
    """The Layout of the model handed to Monitor (None: scalars only). Raises
    ValueError, naming the fix, for what the client cannot probe safely."""
    if model is None:
        return Layout(None)
    what = "Monitor(model=...)"
    wrappers = []
    module = model
    while True:
        _refuse_unsupported(module, what)
        if _is_ddp(module):
            wrappers.append(type(module).__name__)
            module = module.module
        elif _is_compiled(module):
            wrappers.append(type(module).__name__)
            module = module._orig_mod
        else:
            break
    collective = any(_is_fsdp2(m) for m in module.modules())
    tensor_parallel = _tensor_parallel_params(module)
    if tensor_parallel:
        if discover:
            raise ValueError(
                f"{what}: parameters are tensor-parallel DTensors ({tensor_parallel[0]}, ...): "
                "each rank's projections hold only its heads, which discovery cannot read; "
                "pass discover=False, discover_routers=False and hand each rank's Q/K over "
                "with monitor.capture_qk, with probe_all_ranks=True and a probe_id per rank")
        collective = True  # its forward all-reduces across the tensor-parallel group
    if tensor_parallel:
        kind = "tensor_parallel"
    elif collective:
        kind = "fsdp2"
    else:
        kind = "ddp" if "DistributedDataParallel" in wrappers else "local"
    if wrappers or collective:
        log.info("foreshock: probing %s%s", " -> ".join(wrappers + [type(module).__name__]),
                 "; the probe forward is collective: every rank runs it, the probing "
                 "rank(s) send" if collective else "")
    return Layout(module, collective, tuple(wrappers), kind)


def model_for_curvature(model):
    """The module the curvature estimator differentiates: DDP's (or a compiled
    model's) inner module; raises ValueError for sharded models."""
    what = "CurvatureEstimator(model=...)"
    module = model
    while True:
        _refuse_unsupported(module, what)
        if _is_ddp(module):
            module = module.module
        elif _is_compiled(module):
            module = module._orig_mod
        else:
            break
    if any(_is_fsdp2(m) for m in module.modules()) or _tensor_parallel_params(module):
        raise ValueError(
            f"{what}: the model's weights are sharded across ranks (FSDP2 fully_shard or "
            "tensor-parallel DTensors): Hessian-vector products would need every rank at "
            "once; not supported: leave curvature off for this model")
    return module


def guard_hooks(handles):
    """Makes the forward hooks behind `handles` log and skip instead of raising,
    so that a sample the client cannot read never aborts the probe forward
    (which, when collective, would leave the other ranks waiting)."""
    for handle in handles:
        hooks = handle.hooks_dict_ref() if hasattr(handle, "hooks_dict_ref") else None
        if hooks is None or handle.id not in hooks:
            continue
        hooks[handle.id] = _Guarded(hooks[handle.id])


class _Guarded:
    warned = set()

    def __init__(self, hook):
        self.hook = hook

    def __call__(self, *args, **kwargs):
        try:
            return self.hook(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the probe must never abort the forward
            key = (getattr(self.hook, "__qualname__", repr(self.hook)), type(e).__name__)
            if key not in _Guarded.warned:
                _Guarded.warned.add(key)
                log.warning("foreshock: a probe hook failed (%s: %s); that sample is skipped",
                            type(e).__name__, e)
            return None
