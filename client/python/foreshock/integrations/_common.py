"""What the Trainer and Lightning callbacks share: probe scheduling that
leaves training undisturbed, sending scalars without a probe, probe batch
placement and the check for sharded models."""
import inspect
import logging
from collections.abc import Mapping

import torch

from foreshock.monitor import Monitor

log = logging.getLogger("foreshock")

# Monitor arguments the callbacks set themselves.
_SET_BY_CALLBACK = ("rank",)


def check_monitor_kwargs(monitor, endpoint, run_id, job, probe_batch, model, monitor_kwargs,
                         framework):
    """Refuses bad constructor arguments now rather than when training starts."""
    if monitor is not None:
        given = [name for name, value in (("endpoint", endpoint), ("run_id", run_id), ("job", job),
                                          ("probe_batch", probe_batch), ("model", model))
                 if value is not None] + sorted(monitor_kwargs)
        if given:
            raise TypeError(f"ForeshockCallback(monitor=...) takes the monitor as it is; "
                            f"also got {', '.join(given)} (set them on the Monitor)")
        if not isinstance(monitor, Monitor):
            raise TypeError(f"monitor must be a foreshock.Monitor, got {type(monitor).__name__}")
        return
    if endpoint is None and monitor_kwargs.get("endpoints") is None:
        raise TypeError("ForeshockCallback needs the daemon's endpoint (\"host:port\") "
                        "or a monitor=foreshock.Monitor(...)")
    known = set(inspect.signature(Monitor.__init__).parameters) - {"self"}
    for name in monitor_kwargs:
        if name in _SET_BY_CALLBACK:
            raise TypeError(f"ForeshockCallback sets {name} from the {framework}; do not pass it")
        if name not in known or name in ("endpoint", "run_id", "job", "model", "probe_batch"):
            raise TypeError(f"ForeshockCallback got an unexpected argument {name!r} "
                            f"(Monitor arguments: {', '.join(sorted(known))})")


def to_device(batch, device):
    """The probe batch on the model's device. Mappings become dicts, so that a
    tokenizer's BatchEncoding (a UserDict, not a dict) is passed as model(**batch)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


def sharded_reason(model):
    """Why a forward of `model` needs every rank (parameters sharded over
    ranks), or None. Probing on rank 0 alone would then wait forever for
    the other ranks' collectives."""
    for module in model.modules():
        name = type(module).__name__
        if name == "FullyShardedDataParallel" or name.startswith("FSDP"):
            return f"FSDP ({name})"
    for param in model.parameters():
        if hasattr(param, "ds_id"):  # DeepSpeed ZeRO-3 partitions parameters
            return "DeepSpeed ZeRO-3"
        if type(param).__name__ == "DTensor" or type(param.data).__name__ == "DTensor":
            return "DTensor parameters (FSDP2 or tensor parallel)"
    return None


def check_not_sharded(model, world_size, probes_alone, framework):
    if model is None or world_size <= 1 or not probes_alone:
        return
    reason = sharded_reason(model)
    if reason:
        raise ValueError(
            f"ForeshockCallback: the model's parameters are sharded over ranks ({reason}), so a "
            f"probe forward on rank 0 alone would hang the {framework}. Pass probe_batch=None "
            f"(step scalars only), or probe_all_ranks=True with a distinct probe_id per rank.")


def send_scalars(monitor, step, loss=None, grad_norm=None, lr=None):
    """monitor.step() without what else it does when a step is due (probe,
    curvature): the callbacks schedule those themselves, right after the
    optimizer step, whether or not that step's scalars are known yet (the
    Trainer logs them every logging_steps). With no probe batch and no
    estimator for the call, step() sends the scalars record and nothing else."""
    probe_batch, curvature = monitor.probe_batch, monitor.curvature
    monitor.probe_batch, monitor.curvature = None, None
    try:
        monitor.step(step, loss=loss, grad_norm=grad_norm, lr=lr)
    finally:
        monitor.probe_batch, monitor.curvature = probe_batch, curvature


class Prober:
    """Runs the monitor's probe (and curvature estimate) when a step is due.

    Monitor.probe() restores the model's train flag with model.train(flag),
    which would also switch submodules the user keeps in eval mode (frozen
    BatchNorm, a frozen backbone's dropout) back to train: every module's
    own flag is restored here instead. The first probe's errors propagate
    (a wrong probe batch shows at the start); later ones are logged and
    skipped, so a failing probe never stops a long run."""

    def __init__(self, monitor):
        self.monitor = monitor
        self.failures = 0
        self._ran = False

    def maybe_probe(self, step):
        monitor = self.monitor
        if not monitor.probes_here:
            return
        if (monitor.model is not None and monitor.probe_batch is not None
                and step % monitor.every == 0):
            self._probe(step)
        if monitor.curvature is not None and monitor.curvature.due(step):
            monitor.estimate_curvature(step)  # logs and counts its own failures

    def _probe(self, step):
        model = self.monitor.model
        modes = [(module, module.training) for module in model.modules()]
        try:
            self.monitor.probe(step)
        except Exception as e:  # noqa: BLE001 - training is sacred after the first probe
            if not self._ran:
                raise RuntimeError(f"foreshock: the probe forward at step {step} failed ({e}); "
                                   "check probe_batch: model(probe_batch) must run") from e
            self.failures += 1
            log.warning("foreshock: probe at step %d failed (%s); skipped", step, e,
                        exc_info=self.failures == 1)
        finally:
            for module, training in modes:
                module.training = training
        self._ran = True
