"""foreshock for the Hugging Face `transformers.Trainer`.

    from foreshock.integrations.transformers import ForeshockCallback

    trainer = Trainer(model=model, args=TrainingArguments(..., run_name="run-42", logging_steps=1),
                      train_dataset=ds,
                      callbacks=[ForeshockCallback("127.0.0.1:50051", probe_batch=probe, every=50)])

- Scalars: the Trainer's logs. Every `logging_steps` steps `on_log` gets
  `loss` (the mean over the steps since the last log), `grad_norm` (this
  step's, before clipping; only when max_grad_norm > 0) and `learning_rate`
  (this step's); they are sent as step `state.global_step`. Set
  logging_steps=1 for a per-step loss (the Trainer's default is 500).
- Probes: in `on_step_end`, right after optimizer.step() (and zero_grad), when
  global_step % every == 0, and once at step 0 before the first update. Step
  s is the model after s optimizer steps, as in `monitor.step(s, ...)` of a
  hand-written loop.
- Mixed precision: with bf16=True or fp16=True the probe runs under the same
  autocast as the Trainer's forward, so the attention compute dtype the
  daemon sees (foreshock_attention_compute_bits) is the training's.
- Ranks: the Monitor's rank is args.process_index. Every rank sends its
  scalars; only rank 0 probes (unless probe_all_ranks=True). A model
  sharded with FSDP2 runs the probe forward on every rank (it is
  collective), rank 0 sends; what the Monitor cannot probe (FSDP1,
  DeepSpeed ZeRO-3) is refused when training starts, with the fix named.
- The monitor the callback creates is closed in `on_train_end`; a monitor
  passed as monitor= is left open (close it yourself).
"""
import logging
import os

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("foreshock.integrations.transformers needs transformers "
                      "(pip install transformers)") from e

from foreshock.integrations import _common

log = logging.getLogger("foreshock")

DEFAULT_JOB = "hf-trainer"


def default_run_id(args):
    """args.run_name, else the name of args.output_dir: both are the same on
    every rank (ranks must agree on the run) and again when the run resumes
    from its checkpoints (its series continue)."""
    if args.run_name:
        return args.run_name
    return os.path.basename(os.path.normpath(os.path.abspath(args.output_dir)))


class ForeshockCallback(TrainerCallback):
    """Streams a Trainer's loss, grad norm and LR to foreshockd and probes the model.

    Args:
      endpoint: the daemon(s), as for foreshock.Monitor ("host:port", a list, "dns:///...").
      run_id: default: args.run_name, else the last component of args.output_dir.
      job: default "hf-trainer".
      probe_batch: the fixed probe input (tensor: model(x); dict: model(**x), e.g.
        {"input_ids": ...}). Moved to args.device when training starts. None: scalars only.
      every: probe every `every` optimizer steps.
      monitor: a ready foreshock.Monitor instead of the arguments above (then
        the callback neither creates nor closes one; its rank is yours to set).
      model: the module to probe; default the Trainer's model.
      **monitor_kwargs: any other foreshock.Monitor argument (labels, dtype,
        probe_id, model_info, token, tls_ca, curvature, probe_all_ranks, ...).
    """

    def __init__(self, endpoint=None, run_id=None, job=None, probe_batch=None, every=100, *,
                 monitor=None, model=None, **monitor_kwargs):
        self._owner = _common.MonitorOwner(endpoint, run_id, job, probe_batch, every, model,
                                           monitor, monitor_kwargs,
                                           "Trainer (args.process_index)")

    @property
    def monitor(self):
        """The foreshock.Monitor: the one given, or the one created at train start."""
        return self._owner.monitor

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        owner = self._owner
        # Mixed precision: the Trainer runs its forward under autocast; so does the probe.
        autocast = "bf16" if getattr(args, "bf16", False) else \
            "fp16" if getattr(args, "fp16", False) else None
        monitor = owner.start(owner.model if owner.model is not None else model,
                              rank=args.process_index, device=args.device,
                              run_id=default_run_id(args), job=DEFAULT_JOB, autocast=autocast)
        if owner.owns_monitor and args.process_index == 0:
            log.info("foreshock: run %s: scalars every %s step(s) (logging_steps), probes "
                     "every %d step(s)%s", monitor.run_id, args.logging_steps, monitor.every,
                     "" if monitor.probe_batch is not None else " (no probe_batch: none)")
        if state.global_step == 0:
            owner.prober.maybe_probe(0)  # the weights before the first update

    def on_step_end(self, args, state, control, **kwargs):
        # After optimizer.step(), the scheduler step and zero_grad: the probe
        # at step s sees the model after s updates.
        if self._owner.prober is not None:
            self._owner.prober.maybe_probe(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        # Training logs only: evaluation logs have eval_loss, the final one train_loss.
        loss, grad_norm, lr = logs.get("loss"), logs.get("grad_norm"), logs.get("learning_rate")
        if self.monitor is None or (loss is None and grad_norm is None and lr is None):
            return
        _common.send_scalars(self.monitor, state.global_step, loss=loss, grad_norm=grad_norm,
                             lr=lr)

    def on_train_end(self, args, state, control, **kwargs):
        self._owner.close()
