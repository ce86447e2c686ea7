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
- Ranks: the Monitor's rank is args.process_index. Every rank sends its
  scalars; only rank 0 probes (unless probe_all_ranks=True).
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
from foreshock.monitor import Monitor

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
        _common.check_monitor_kwargs(monitor, endpoint, run_id, job, probe_batch, model,
                                     monitor_kwargs, "Trainer (args.process_index)")
        if every < 1:
            raise ValueError("every must be >= 1")
        self._endpoint = endpoint
        self._run_id = run_id
        self._job = job
        self._probe_batch = probe_batch
        self._every = every
        self._model = model
        self._monitor_kwargs = monitor_kwargs
        self._owns_monitor = monitor is None
        self.monitor = monitor
        self._prober = _common.Prober(monitor) if monitor is not None else None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model = self._model if self._model is not None else model
        rank = args.process_index
        if self._owns_monitor:
            if self.monitor is not None:
                self.monitor.close()  # a second train() call: a fresh stream
            probe_batch = None
            if self._probe_batch is not None:
                probe_batch = _common.to_device(self._probe_batch, args.device)
            probe_all_ranks = bool(self._monitor_kwargs.get("probe_all_ranks"))
            if probe_batch is not None:
                _common.check_not_sharded(model, args.world_size, not probe_all_ranks, "Trainer")
            run_id = self._run_id or default_run_id(args)
            self.monitor = Monitor(self._endpoint, run_id=run_id, job=self._job or DEFAULT_JOB,
                                   model=model, probe_batch=probe_batch, every=self._every,
                                   rank=rank, **self._monitor_kwargs)
            self._prober = _common.Prober(self.monitor)
            if rank == 0:
                log.info("foreshock: run %s: scalars every %s step(s) (logging_steps), probes "
                         "every %d step(s)%s", run_id, args.logging_steps, self._every,
                         "" if probe_batch is not None else " (no probe_batch: none)")
        else:
            if self.monitor.probe_batch is not None:
                self.monitor.probe_batch = _common.to_device(self.monitor.probe_batch, args.device)
                # Rank 0 cannot tell whether a given monitor probes on every rank: the others can.
                _common.check_not_sharded(self.monitor.model, args.world_size,
                                          rank != 0 and not self.monitor.probes_here, "Trainer")
        if state.global_step == 0:
            self._prober.maybe_probe(0)  # the weights before the first update

    def on_step_end(self, args, state, control, **kwargs):
        # After optimizer.step(), the scheduler step and zero_grad: the probe
        # at step s sees the model after s updates.
        if self._prober is not None:
            self._prober.maybe_probe(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        # Training logs only: evaluation logs have eval_loss, the final one train_loss.
        loss, grad_norm, lr = logs.get("loss"), logs.get("grad_norm"), logs.get("learning_rate")
        if self.monitor is None or (loss is None and grad_norm is None and lr is None):
            return
        _common.send_scalars(self.monitor, state.global_step, loss=loss, grad_norm=grad_norm,
                             lr=lr)

    def on_train_end(self, args, state, control, **kwargs):
        if self._owns_monitor and self.monitor is not None:
            self.monitor.close()
            stats = self.monitor.stats()
            log.info("foreshock: closed; %d record(s) acked, %d probe(s), %d unsent at close",
                     stats["acked_records"], stats["probes"], stats["unsent_at_close"])
