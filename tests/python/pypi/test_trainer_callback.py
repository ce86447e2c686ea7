"""foreshock.integrations.transformers.ForeshockCallback in a real
`transformers.Trainer.train()` of a tiny random-init LLaMA on CPU, streaming to
a real foreshockd: the daemon's loss/grad_norm/lr series are exactly what the
Trainer logged, probes run right after the optimizer step of every `every`-th
step without changing the training, and the monitor is closed at the end."""
import json
import os
import subprocess
import sys
import types
import urllib.request

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback,  # noqa: E402
                          TrainingArguments)

from foreshock import Monitor  # noqa: E402
from foreshock.integrations.transformers import ForeshockCallback, default_run_id  # noqa: E402

VOCAB, SEQ, STEPS, EVERY, LOGGING_STEPS = 64, 16, 24, 5, 2


def _model():
    torch.manual_seed(0)
    # attention_dropout > 0: a probe that consumed the training RNG, or ran
    # in train mode, would change every later loss.
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2 * SEQ, attention_dropout=0.1)
    return LlamaForCausalLM(config)


def _tokens():
    return torch.randint(0, VOCAB, (4 * STEPS, SEQ), generator=torch.Generator().manual_seed(1))


def _args(tmp_path, args_class=TrainingArguments, **overrides):
    kwargs = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                  max_steps=STEPS, logging_steps=LOGGING_STEPS, learning_rate=1e-3,
                  use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, seed=0,
                  dataloader_num_workers=0)
    kwargs.update(overrides)
    return args_class(**kwargs)


def _train(args, callbacks=()):
    dataset = [{"input_ids": x, "labels": x} for x in _tokens()]
    trainer = Trainer(model=_model(), args=args, train_dataset=dataset, callbacks=list(callbacks))
    trainer.train()
    return trainer


def _logged(trainer, key):
    return [(entry["step"], entry[key]) for entry in trainer.state.log_history if key in entry]


def _http(daemon, path):
    url = daemon.metrics_url.replace("/metrics", path)
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def _points(daemon, run, signal):
    got = _http(daemon, f"/api/v1/points?run={run}&signal={signal}")
    assert not got["downsampled"]
    return [(int(p["step"]), p["value"]) for p in got["points"]]


class OptimizerSteps(TrainerCallback):
    """Counts optimizer.step() calls, independently of global_step."""

    def __init__(self):
        self.done = 0

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.done += 1


def test_trainer_scalars_and_probes_reach_the_daemon(foreshockd, tmp_path):
    reference = _train(_args(tmp_path, run_name="unmonitored"))

    counter = OptimizerSteps()
    forwards = []  # (optimizer steps done, train mode, grad enabled) of every model forward
    qk_steps = []

    def tap(record):
        if record.HasField("qk"):
            qk_steps.append(record.step)

    callback = ForeshockCallback(foreshockd.endpoint, every=EVERY, tap=tap,
                                 probe_batch={"input_ids": _tokens()[:2]})
    args = _args(tmp_path, run_name="hf-run")
    dataset = [{"input_ids": x, "labels": x} for x in _tokens()]
    trainer = Trainer(model=_model(), args=args, train_dataset=dataset,
                      callbacks=[counter, callback])
    trainer.model.register_forward_pre_hook(
        lambda module, inputs: forwards.append((counter.done, module.training,
                                                torch.is_grad_enabled())))
    trainer.train()

    # The probes did not change the training: same losses and grad norms, bit for bit.
    for key in ("loss", "grad_norm", "learning_rate"):
        assert _logged(trainer, key) == _logged(reference, key), key
    logged_steps = list(range(LOGGING_STEPS, STEPS + 1, LOGGING_STEPS))
    assert [step for step, _ in _logged(trainer, "loss")] == logged_steps

    # Step 0 (before any update), then every EVERY-th step right after its
    # optimizer step: in eval mode, without grad, on the weights after that
    # many updates; then train mode again.
    probe_steps = list(range(0, STEPS + 1, EVERY))
    assert [f for f in forwards if f[1:] != (True, True)] == \
        [(step, False, False) for step in probe_steps]
    assert len(forwards) == STEPS + len(probe_steps)
    assert qk_steps == [step for step in probe_steps for _layer in (0, 1)]
    assert trainer.model.training

    # The daemon's series are what the Trainer logged (steps and values).
    runs = {r["run"]: r for r in _http(foreshockd, "/api/v1/runs")["runs"]}
    assert runs["hf-run"]["job_name"] == "hf-trainer"  # run_id from args.run_name
    for signal, key in (("loss", "loss"), ("grad_norm", "grad_norm"), ("lr", "learning_rate")):
        assert _points(foreshockd, "hf-run", signal) == _logged(trainer, key), signal

    # Probe-derived per-layer series exist for both layers, at the probe steps.
    series = _http(foreshockd, "/api/v1/series?run=hf-run")["series"]
    layered = [s for s in series if s["layer"] >= 0 and s["head"] == -1]
    assert {s["layer"] for s in layered} == {0, 1}, series
    entropy = [s for s in layered if s["signal"] == "attention_entropy"]
    assert [(int(s["first_step"]), int(s["last_step"]), int(s["points"])) for s in entropy] == \
        [(0, probe_steps[-1], len(probe_steps))] * 2

    # Closed by on_train_end, after every record was acknowledged.
    stats = callback.monitor.stats()
    assert stats["probes"] == len(probe_steps) and stats["rejected"] == {}
    assert stats["acked_records"] == stats["enqueued"] == len(logged_steps) + 2 * len(probe_steps)
    assert stats["unsent_at_close"] == 0 and not stats["connected"]
    callback.monitor.step(EVERY * STEPS + 1, loss=1.0)  # not a probe step
    assert callback.monitor.stats()["dropped_after_close"] == 1


class Rank1Arguments(TrainingArguments):
    """TrainingArguments of the second process of a job: the Trainer itself
    then runs as a non-main process (no saving, no progress bar)."""

    @property
    def process_index(self):
        return 1


def test_other_ranks_send_scalars_but_do_not_probe(tmp_path):
    from conftest import free_port
    from fake_ingest import FakeServer

    server = FakeServer(free_port()).start()
    try:
        callback = ForeshockCallback(server.endpoint, run_id="r", every=EVERY,
                                     probe_batch=_tokens()[:2])
        trainer = _train(_args(tmp_path, Rank1Arguments, max_steps=6), [callback])
        assert not trainer.state.is_world_process_zero
        [stream] = server.servicer.streams
        assert stream["hello"].rank == 1 and stream["hello"].run_id == "r"
        records = server.servicer.records()
        assert all(r.WhichOneof("payload") == "scalars" for r in records)  # no probe
        assert [(r.step, r.scalars.loss) for r in records] == _logged(trainer, "loss")
        assert [step for step, _ in _logged(trainer, "loss")] == [2, 4, 6]
        assert callback.monitor.stats()["probes"] == 0
    finally:
        server.stop()


def test_a_given_monitor_is_used_and_left_open(tmp_path):
    from conftest import free_port
    from fake_ingest import FakeServer

    server = FakeServer(free_port()).start()
    try:
        with Monitor(server.endpoint, run_id="given", job="j", model=None) as monitor:
            callback = ForeshockCallback(monitor=monitor)
            _train(_args(tmp_path, max_steps=4), [callback])
            monitor.step(100, loss=2.0)  # still open after train()
            assert monitor.stats()["dropped_after_close"] == 0
        assert [r.step for r in server.servicer.records()] == [2, 4, 100]
    finally:
        server.stop()


def test_bad_arguments_are_refused_at_construction():
    with pytest.raises(TypeError, match="endpoint"):
        ForeshockCallback()
    with pytest.raises(TypeError, match="rank"):
        ForeshockCallback("127.0.0.1:1", rank=2)
    with pytest.raises(TypeError, match="'evry'"):
        ForeshockCallback("127.0.0.1:1", evry=3)
    with pytest.raises(ValueError, match="every"):
        ForeshockCallback("127.0.0.1:1", every=0)
    monitor = Monitor("127.0.0.1:1", run_id="x", job="j")
    try:
        with pytest.raises(TypeError, match="run_id"):
            ForeshockCallback(monitor=monitor, run_id="y")
    finally:
        monitor.close(timeout=0)


def test_a_model_the_monitor_cannot_probe_is_refused_with_the_fix_named():
    model = _model()
    next(model.parameters()).ds_id = 0  # how DeepSpeed ZeRO-3 marks partitioned parameters
    args = types.SimpleNamespace(process_index=0, world_size=2, device=torch.device("cpu"),
                                 run_name="x", output_dir="out", logging_steps=1)
    state = types.SimpleNamespace(global_step=0)
    callback = ForeshockCallback("127.0.0.1:1", probe_batch=_tokens()[:1])
    with pytest.raises(ValueError, match="DeepSpeed ZeRO-3.*probe_batch=None"):
        callback.on_train_begin(args, state, None, model=model)
    assert callback.monitor is None
    # The fix named works: scalars only, the same model.
    callback = ForeshockCallback("127.0.0.1:1")
    callback.on_train_begin(args, state, None, model=model)
    try:
        assert callback.monitor.model is None and callback.monitor.stats()["probes"] == 0
    finally:
        callback.monitor.close(timeout=0)


def test_default_run_id():
    args = types.SimpleNamespace(run_name=None, output_dir="/ckpt/llama-7b-lr3e-4/")
    assert default_run_id(args) == "llama-7b-lr3e-4"
    args.run_name = "named"
    assert default_run_id(args) == "named"


def test_foreshock_imports_without_transformers():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import foreshock, foreshock.integrations\n"
            "try:\n"
            "    import foreshock.integrations.transformers\n"
            "except ImportError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    assert "needs transformers (pip install transformers)" in out.stdout
