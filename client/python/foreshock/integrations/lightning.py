"""foreshock for the Lightning Trainer (`lightning.pytorch`; `pytorch_lightning`
users import foreshock.integrations.pytorch_lightning instead).

    from foreshock.integrations.lightning import ForeshockCallback

    trainer = L.Trainer(callbacks=[ForeshockCallback("127.0.0.1:50051", run_id="run-42",
                                                     probe_batch=probe, every=50)])

- Loss: `outputs["loss"]` of `on_train_batch_end` (what training_step
  returned); with gradient accumulation, the mean over the micro-batches of
  the optimizer step (Lightning hands each divided by accumulate_grad_batches).
- LR: the first optimizer's first param group, read in
  `on_before_optimizer_step`: the LR this step used (step schedulers have
  already moved on by `on_train_batch_end`).
- Grad norm (grad_norm=True, the default): the total 2-norm of the gradients
  in `on_before_optimizer_step`, after AMP unscaling and before clipping
  (what clip_grad_norm_ would report), as one foreach norm: 0.2-0.5 % of a
  CPU training step, about 1/11 of AdamW's step. Off by default when the
  parameters are sharded (FSDP, DeepSpeed), where a rank holds part of them.
- Loss and grad norm are copied to the host without blocking and read one
  step later, so that the callback does not make the CPU wait for the
  accelerator's queue every step.
- Step: trainer.global_step (optimizer steps done). Probes run in
  `on_train_batch_end` after the optimizer step when global_step % every
  == 0, and once at step 0 in `on_train_start`.
- Ranks: the Monitor's rank is trainer.global_rank; every rank sends scalars,
  only rank 0 probes (unless probe_all_ranks=True). A model sharded with
  FSDP2 (ModelParallelStrategy's fully_shard) runs the probe forward on
  every rank (it is collective), rank 0 sends; what the Monitor cannot
  probe (FSDP1, DeepSpeed ZeRO-3) is refused when training starts.
- The monitor the callback creates is closed in `on_train_end`, and in
  `on_exception` when training fails.
"""
try:
    import lightning.pytorch as _pl
except ImportError:
    try:
        import pytorch_lightning as _pl
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("foreshock.integrations.lightning needs Lightning "
                          "(pip install lightning)") from e

from foreshock.integrations._lightning_impl import ForeshockCallbackMixin


class ForeshockCallback(ForeshockCallbackMixin, _pl.Callback):
    __doc__ = ForeshockCallbackMixin.__doc__
