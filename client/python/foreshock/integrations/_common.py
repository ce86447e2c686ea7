"""What the Trainer and Lightning callbacks share: the monitor they create or
are given, probe scheduling that leaves training undisturbed, sending
scalars without a probe, and probe batch placement."""
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
    """Why the parameters of `model` are sharded over ranks (a rank's
    gradients are then part of the total norm), or None."""
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


class MonitorOwner:
    """The callbacks' monitor: the one handed over as monitor= (used as it is,
    never closed here), or one the callback creates when training starts,
    from its constructor's arguments, and closes when training ends.

    Wrapped and sharded models are the Monitor's business
    (foreshock.distributed): DDP is probed through .module, an FSDP2 model's
    probe forward runs on every rank (one sends), and what cannot be probed
    is refused when the Monitor is created, with the fix named."""

    def __init__(self, endpoint, run_id, job, probe_batch, every, model, monitor, monitor_kwargs,
                 framework):
        check_monitor_kwargs(monitor, endpoint, run_id, job, probe_batch, model, monitor_kwargs,
                             framework)
        if every < 1:
            raise ValueError("every must be >= 1")
        self._endpoint = endpoint
        self._run_id = run_id
        self._job = job
        self._probe_batch = probe_batch
        self._every = every
        self.model = model  # None: the framework's model
        self._monitor_kwargs = monitor_kwargs
        self.owns_monitor = monitor is None
        self.monitor = monitor
        self.prober = Prober(monitor) if monitor is not None else None

    def start(self, model, rank, device, run_id, job, autocast=None):
        """At the start of training: the monitor of this training, on `rank`,
        with the probe batch on `device`. `run_id` and `job` are the
        framework's defaults, used unless the constructor was given them;
        `autocast` ("bf16", "fp16" or None) is the framework's mixed precision,
        for a monitor whose autocast was not set (Monitor(autocast=...))."""
        if not self.owns_monitor:
            if self.monitor.probe_batch is not None:
                self.monitor.probe_batch = to_device(self.monitor.probe_batch, device)
            if autocast is not None and self.monitor.autocast is None:
                self.monitor.autocast = _monitor_autocast(autocast)
            return self.monitor
        if self.monitor is not None:
            self.monitor.close()  # a second train()/fit() call: a fresh stream
        probe_batch = None
        if self._probe_batch is not None:
            probe_batch = to_device(self._probe_batch, device)
        kwargs = dict(self._monitor_kwargs)
        if autocast is not None and kwargs.get("autocast") is None:
            kwargs["autocast"] = autocast
        try:
            # Without a probe batch the model is not needed (scalars only), so
            # a model the Monitor cannot probe is no reason to refuse.
            self.monitor = Monitor(self._endpoint, run_id=self._run_id or run_id,
                                   job=self._job or job,
                                   model=model if probe_batch is not None else None,
                                   probe_batch=probe_batch, every=self._every, rank=rank,
                                   **kwargs)
        except ValueError as e:
            raise ValueError(f"ForeshockCallback: {e} (here: probe_batch=None sends the "
                             "scalars only)") from e
        self.prober = Prober(self.monitor)
        return self.monitor

    def close(self):
        """At the end of training: closes a monitor this owner created (the run has ended)."""
        if self.owns_monitor and self.monitor is not None:
            self.monitor.close()
            stats = self.monitor.stats()
            log.info("foreshock: closed; %d record(s) acked, %d probe(s), %d unsent at close",
                     stats["acked_records"], stats["probes"], stats["unsent_at_close"])


def _monitor_autocast(name):
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


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
        due = (monitor.model is not None and monitor.probe_batch is not None
               and step % monitor.every == 0)
        if not monitor.probes_here:
            if due and monitor.probe_is_collective:
                monitor.join_probe()  # FSDP2: every rank runs the forward; this one sends nothing
            return
        if due:
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
