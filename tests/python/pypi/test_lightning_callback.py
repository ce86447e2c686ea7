"""foreshock.integrations.lightning.ForeshockCallback in a real Lightning
`trainer.fit()` of a tiny random-init GPT-2 on CPU, streaming to a real
foreshockd: loss (mean over accumulated micro-batches), grad norm (before
clipping) and LR are checked against values the LightningModule records
itself, probes run after the optimizer step without changing the training
(nor the mode of a submodule kept in eval), and the monitor is closed at the
end and when training fails."""
import json
import math
import os
import types
import urllib.request

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pl = pytest.importorskip("lightning.pytorch")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from foreshock.integrations.lightning import ForeshockCallback  # noqa: E402

VOCAB, SEQ, BATCH, ACCUMULATE, STEPS, EVERY, CLIP = 64, 16, 4, 2, 12, 4, 0.5
LR0 = 1e-3


def _lr(step_index):  # the LambdaLR factor: the LR of optimizer step number step_index + 1
    return LR0 * (1 - step_index / 20)


def _module_class(base):
    class TinyGPT(base):
        def __init__(self, fail_at_step=None):
            super().__init__()
            torch.manual_seed(0)
            # GPT-2's dropout (0.1) makes the losses depend on the RNG and on train mode.
            config = GPT2Config(vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=32, n_layer=2,
                                n_head=4)
            self.model = GPT2LMHeadModel(config)
            self.model.transformer.drop.eval()  # a submodule the user keeps in eval mode
            self.fail_at_step = fail_at_step
            self.losses = []          # every micro-batch's loss
            self.grad_norms = []      # total grad norm before clipping, per optimizer step
            self.optimizer_steps = 0

        def forward(self, input_ids):
            return self.model(input_ids=input_ids).logits

        def training_step(self, batch, batch_idx):
            if self.fail_at_step is not None and self.global_step == self.fail_at_step:
                raise RuntimeError("boom")
            (tokens,) = batch
            logits = self(tokens)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                                     tokens[:, 1:].reshape(-1))
            self.losses.append(loss.item())
            return loss

        def on_before_optimizer_step(self, optimizer):
            # Reference: float64 sum of squares (the callback uses a foreach norm).
            squares = sum(p.grad.double().pow(2).sum().item() for p in self.parameters()
                          if p.grad is not None)
            self.grad_norms.append(math.sqrt(squares))

        def optimizer_step(self, *args, **kwargs):
            super().optimizer_step(*args, **kwargs)
            self.optimizer_steps += 1

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=LR0)
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: _lr(i) / LR0)
            return {"optimizer": optimizer,
                    "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    return TinyGPT


TinyGPT = _module_class(pl.LightningModule)


def _tokens(n=BATCH * ACCUMULATE * STEPS):
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))


def _fit(module, tmp_path, callbacks=(), max_steps=STEPS, pl_module=pl):
    torch.manual_seed(2)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(_tokens()),
                                         batch_size=BATCH, shuffle=False)
    trainer = pl_module.Trainer(accelerator="cpu", devices=1, max_steps=max_steps,
                                accumulate_grad_batches=ACCUMULATE, gradient_clip_val=CLIP,
                                logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False,
                                default_root_dir=str(tmp_path / "proj"),
                                callbacks=list(callbacks))
    trainer.fit(module, loader)
    return trainer


def _http(daemon, path):
    url = daemon.metrics_url.replace("/metrics", path)
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def _points(daemon, run, signal):
    got = _http(daemon, f"/api/v1/points?run={run}&signal={signal}")
    return [(int(p["step"]), p["value"]) for p in got["points"]]


def test_fit_scalars_and_probes_reach_the_daemon(foreshockd, tmp_path):
    reference = TinyGPT()
    _fit(reference, tmp_path)

    module = TinyGPT()
    forwards = []  # (optimizer steps done, train mode, grad enabled) of every forward
    module.register_forward_pre_hook(lambda m, inputs: forwards.append(
        (m.optimizer_steps, m.training, torch.is_grad_enabled())))
    callback = ForeshockCallback(foreshockd.endpoint, every=EVERY, probe_batch=_tokens(2))
    _fit(module, tmp_path, [callback])

    # The probes changed nothing: same losses, same gradients, the frozen
    # dropout still in eval mode, the rest in train mode.
    assert module.losses == reference.losses and len(module.losses) == ACCUMULATE * STEPS
    assert module.grad_norms == reference.grad_norms
    assert not module.model.transformer.drop.training and module.model.lm_head.training

    # Probes at step 0 and every EVERY-th step, after that optimizer step, in eval without grad.
    probe_steps = list(range(0, STEPS + 1, EVERY))
    assert [f for f in forwards if f[1:] != (True, True)] == \
        [(step, False, False) for step in probe_steps]
    assert len(forwards) == ACCUMULATE * STEPS + len(probe_steps)

    # run_id by default: the name of default_root_dir (no logger); job "lightning".
    runs = {r["run"]: r for r in _http(foreshockd, "/api/v1/runs")["runs"]}
    assert runs["proj"]["job_name"] == "lightning"
    steps = list(range(1, STEPS + 1))
    loss = _points(foreshockd, "proj", "loss")
    assert [s for s, _ in loss] == steps
    for (step, value), pair in zip(loss, zip(module.losses[0::2], module.losses[1::2])):
        assert value == pytest.approx(sum(pair) / ACCUMULATE, rel=1e-6), step
    grad_norm = _points(foreshockd, "proj", "grad_norm")
    assert [s for s, _ in grad_norm] == steps
    assert [v for _, v in grad_norm] == pytest.approx(module.grad_norms, rel=1e-5)
    assert min(module.grad_norms) > CLIP  # so a norm taken after clipping would differ
    assert _points(foreshockd, "proj", "lr") == [(s, pytest.approx(_lr(s - 1), rel=1e-12))
                                                 for s in steps]

    series = _http(foreshockd, "/api/v1/series?run=proj")["series"]
    entropy = [s for s in series if s["signal"] == "attention_entropy" and s["head"] == -1]
    assert sorted((s["layer"], int(s["first_step"]), int(s["last_step"]), int(s["points"]))
                  for s in entropy) == [(layer, 0, STEPS, len(probe_steps)) for layer in (0, 1)]

    stats = callback.monitor.stats()
    assert stats["probes"] == len(probe_steps) and stats["rejected"] == {}
    assert stats["acked_records"] == stats["enqueued"] == STEPS + 2 * len(probe_steps)
    assert stats["unsent_at_close"] == 0 and not stats["connected"]
    callback.monitor.step(EVERY * STEPS + 1, loss=1.0)  # closed: dropped
    assert callback.monitor.stats()["dropped_after_close"] == 1


def test_a_failing_fit_closes_the_monitor_with_the_last_steps_sent(tmp_path):
    from conftest import free_port
    from fake_ingest import FakeServer

    server = FakeServer(free_port()).start()
    try:
        module = TinyGPT(fail_at_step=3)
        callback = ForeshockCallback(server.endpoint, run_id="fails", every=EVERY,
                                     probe_batch=_tokens(2), grad_norm=False)
        with pytest.raises(RuntimeError, match="boom"):
            _fit(module, tmp_path, [callback])
        stats = callback.monitor.stats()
        assert stats["unsent_at_close"] == 0 and not stats["connected"]
        records = server.servicer.records()
        scalars = [(r.step, r.scalars.HasField("loss"), r.scalars.HasField("grad_norm"))
                   for r in records if r.HasField("scalars")]
        assert scalars == [(1, True, False), (2, True, False), (3, True, False)]
        assert [r.step for r in records if r.HasField("qk")] == [0, 0]
    finally:
        server.stop()


def _stub_trainer(tmp_path, global_rank, world_size):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    return types.SimpleNamespace(global_rank=global_rank, world_size=world_size, global_step=0,
                                 default_root_dir=str(tmp_path), log_dir=str(tmp_path),
                                 optimizers=[optimizer])


def test_rank_comes_from_the_trainer_and_other_ranks_do_not_probe(tmp_path):
    from conftest import free_port
    from fake_ingest import FakeServer

    server = FakeServer(free_port()).start()
    try:
        module = TinyGPT()
        callback = ForeshockCallback(server.endpoint, run_id="r", every=1, probe_batch=_tokens(2))
        callback.on_train_start(_stub_trainer(tmp_path, 1, 2), module)
        assert not callback.monitor.probes_here
        callback.on_train_end(None, module)
        [stream] = server.servicer.streams
        assert stream["hello"].rank == 1 and callback.monitor.stats()["probes"] == 0
    finally:
        server.stop()


def test_sharded_parameters_are_refused():
    module = TinyGPT()
    next(module.parameters()).ds_id = 0  # how DeepSpeed ZeRO-3 marks partitioned parameters
    trainer = _stub_trainer("/tmp", 0, 2)
    with pytest.raises(ValueError, match="grad_norm=False"):
        ForeshockCallback("127.0.0.1:1", run_id="x", grad_norm=True).on_train_start(trainer,
                                                                                   module)
    with pytest.raises(ValueError, match="DeepSpeed ZeRO-3.*probe_batch=None"):
        ForeshockCallback("127.0.0.1:1", run_id="x",
                          probe_batch=_tokens(1)).on_train_start(trainer, module)
    with pytest.raises(TypeError, match="rank"):
        ForeshockCallback("127.0.0.1:1", rank=1)


def test_pytorch_lightning_package(tmp_path):
    ptl = pytest.importorskip("pytorch_lightning")
    from conftest import free_port
    from fake_ingest import FakeServer

    from foreshock.integrations.pytorch_lightning import ForeshockCallback as PTLCallback

    server = FakeServer(free_port()).start()
    try:
        callback = PTLCallback(server.endpoint, run_id="ptl", every=EVERY, probe_batch=_tokens(2))
        assert isinstance(callback, ptl.Callback)
        module = _module_class(ptl.LightningModule)()
        _fit(module, tmp_path, [callback], max_steps=EVERY, pl_module=ptl)
        records = server.servicer.records()
        assert [r.step for r in records if r.HasField("scalars")] == list(range(1, EVERY + 1))
        assert [r.step for r in records if r.HasField("qk")] == [0, 0, EVERY, EVERY]
    finally:
        server.stop()
