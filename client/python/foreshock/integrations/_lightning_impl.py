"""The Lightning callback's body, shared by lightning.pytorch and pytorch_lightning
(see foreshock/integrations/lightning.py for what it sends and when)."""
import logging
import os

import torch

from foreshock.integrations import _common

log = logging.getLogger("foreshock")

DEFAULT_JOB = "lightning"


def default_run_id(trainer):
    """The name of trainer.default_root_dir, followed by the logger's version
    directory under it: "proj/lightning_logs/version_3", or "proj" without a
    logger. trainer.log_dir is broadcast from rank 0, so every rank agrees."""
    root = os.path.abspath(trainer.default_root_dir)
    log_dir = os.path.abspath(trainer.log_dir or root)
    name = os.path.basename(root)
    rel = os.path.relpath(log_dir, root)
    if rel == ".":
        return name
    if rel.startswith(".."):
        return os.path.basename(log_dir)
    return "/".join([name, *rel.split(os.sep)])


def lightning_autocast(trainer):
    """"bf16"/"fp16" when the Trainer's precision runs the forward under autocast
    ("bf16-mixed", "16-mixed"; "bf16" and 16 in Lightning 1.x), else None
    ("bf16-true" holds bf16 weights: the probe computes in bf16 as it is)."""
    precision = str(getattr(trainer, "precision", "32"))
    if precision in ("bf16-mixed", "bf16"):
        return "bf16"
    if precision in ("16-mixed", "16"):
        return "fp16"
    return None


def total_grad_norm(parameters):
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return None
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6: foreach, no sync
        return torch.nn.utils.get_total_norm(grads)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def _loss_of(outputs):
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    return loss.detach() if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


class _HostValue:
    """A 0-d tensor to read on the host a step later. On CUDA the copy is
    started now (non_blocking: into pinned memory) and an event marks its
    end, so reading it waits for this step's work only, not for the whole
    queue as float(tensor) would."""

    def __init__(self, tensor):
        tensor = tensor.detach()
        self._event = None
        if tensor.is_cuda:
            self._host = tensor.to("cpu", non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(tensor.device))
        else:
            self._host = tensor

    def value(self):
        if self._event is not None:
            self._event.synchronize()
        return float(self._host)


def _host_value(tensor):
    return None if tensor is None else _HostValue(tensor)


def _value(host_value):
    return None if host_value is None else host_value.value()


class ForeshockCallbackMixin:
    """Streams a Lightning run's loss, grad norm and LR to foreshockd and probes the model.

    Args:
      endpoint: the daemon(s), as for foreshock.Monitor ("host:port", a list, "dns:///...").
      run_id: default: the name of trainer.default_root_dir and the logger's
        version directory, e.g. "proj/lightning_logs/version_3".
      job: default "lightning".
      probe_batch: the fixed probe input of `model` (tensor: model(x); dict:
        model(**x)); moved to the module's device when training starts. None:
        scalars only.
      every: probe every `every` optimizer steps.
      grad_norm: compute and send the total gradient norm (None: yes unless
        the parameters are sharded over ranks).
      monitor: a ready foreshock.Monitor instead of endpoint/run_id/... (the
        callback neither creates nor closes it; its rank is yours to set).
      model: the module to probe; default the LightningModule (it must have
        a forward); e.g. pl_module.model for a wrapped Hugging Face model.
      **monitor_kwargs: any other foreshock.Monitor argument.
    """

    def __init__(self, endpoint=None, run_id=None, job=None, probe_batch=None, every=100, *,
                 grad_norm=None, monitor=None, model=None, **monitor_kwargs):
        super().__init__()
        self._owner = _common.MonitorOwner(endpoint, run_id, job, probe_batch, every, model,
                                           monitor, monitor_kwargs,
                                           "Lightning Trainer (trainer.global_rank)")
        self._grad_norm = grad_norm
        self._reset_step_state(0)

    @property
    def monitor(self):
        """The foreshock.Monitor: the one given, or the one created at train start."""
        return self._owner.monitor

    def _reset_step_state(self, step):
        self._last_step = step
        self._losses = []         # loss tensors of the micro-batches since the last step
        self._step_grad_norm = None
        self._step_lr = None
        self._pending = None      # (step, loss, grad_norm, lr) waiting to be read and sent

    # -- hooks ------------------------------------------------------------------

    def on_train_start(self, trainer, pl_module):
        owner = self._owner
        model = owner.model if owner.model is not None else pl_module
        reason = _common.sharded_reason(model) if trainer.world_size > 1 else None
        if self._grad_norm is None:
            self._grad_norm = reason is None
        elif self._grad_norm and reason:
            raise ValueError(f"ForeshockCallback(grad_norm=True): the parameters are sharded "
                             f"over ranks ({reason}), a rank's gradients are part of the norm; "
                             "pass grad_norm=False")
        run_id = default_run_id(trainer)  # trainer.log_dir: a collective, all ranks call it
        owner.start(model, rank=trainer.global_rank, device=pl_module.device, run_id=run_id,
                    job=DEFAULT_JOB, autocast=lightning_autocast(trainer))
        self._reset_step_state(trainer.global_step)
        if trainer.global_step == 0:
            owner.prober.maybe_probe(0)  # the weights before the first update

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._step_lr = trainer.optimizers[0].param_groups[0]["lr"]
        if self._grad_norm:
            self._step_grad_norm = total_grad_norm(pl_module.parameters())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.monitor is None:
            return
        loss = _loss_of(outputs)
        if loss is not None:
            self._losses.append(loss)
        step = trainer.global_step
        if step == self._last_step:
            return  # accumulating gradients: no optimizer step yet
        self._send_pending()  # the previous step's values: computed by now
        if self._losses:
            # Automatic optimization hands losses divided by accumulate_grad_batches.
            losses = torch.stack(self._losses)
            loss = losses.sum() if pl_module.automatic_optimization else losses.mean()
        else:
            loss = None
        self._pending = (step, _host_value(loss), _host_value(self._step_grad_norm),
                         self._step_lr)
        self._losses, self._step_grad_norm, self._step_lr = [], None, None
        self._last_step = step
        self._owner.prober.maybe_probe(step)

    def on_train_end(self, trainer, pl_module):
        self._send_pending()
        self._close()

    def on_exception(self, trainer, pl_module, exception):
        try:
            self._send_pending()
        except Exception:  # noqa: BLE001 - the training's own exception matters, not ours
            log.warning("foreshock: could not send the last step's scalars", exc_info=True)
        self._close()

    # -- helpers ----------------------------------------------------------------

    def _send_pending(self):
        if self._pending is None or self.monitor is None:
            return
        step, loss, grad_norm, lr = self._pending
        self._pending = None
        _common.send_scalars(self.monitor, step, loss=_value(loss), grad_norm=_value(grad_norm),
                             lr=lr)

    def _close(self):
        self._owner.close()
