"""Mixed precision as the model trains (issue 26): bf16 autocast around the
training forward (plain torch, the Trainer's bf16=True, Lightning's
precision="bf16-mixed") is reported to the daemon as bf16 attention
(foreshock_attention_compute_bits 16), although the probe is called outside
the autocast block and HF models hand their attention function fp32 Q/K
under autocast (rotary with fp32 cos/sin promotes them). Tiny random-init HF
models on CPU, a few steps each, a real foreshockd."""
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from foreshock import Monitor  # noqa: E402

VOCAB, SEQ, BATCH, STEPS, EVERY = 64, 12, 4, 4, 2
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {"llama": ("LlamaForCausalLM", "LlamaConfig"),
            "mistral": ("MistralForCausalLM", "MistralConfig")}


def _model(family, attn="sdpa"):
    model_cls, config_cls = FAMILIES[family]
    config = getattr(transformers, config_cls)(**SMALL)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config)


def _tokens(n=BATCH * STEPS, seed=1):
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def _compute_bits(daemon, run, layers):
    """foreshock_attention_compute_bits of `run` per layer, once every layer has it."""
    def bits(samples):
        got = {int(labels["layer"]): value for name, labels, value in samples
               if name == "foreshock_attention_compute_bits" and labels.get("run") == run}
        return got if len(got) == layers else None
    _, got = daemon.wait_for(bits, timeout_s=30)
    assert got, f"no foreshock_attention_compute_bits for every layer of {run}"
    return got


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_torch_autocast_bf16_reads_16_bits(family, attn, foreshockd):
    model = _model(family, attn)
    run = f"autocast-{family}-{attn}"
    monitor = Monitor(foreshockd.endpoint, run_id=run, job="test", model=model,
                      probe_batch=_tokens(2, seed=3), every=EVERY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = _tokens()
    try:
        for step in range(STEPS):
            batch = data[step * BATCH:(step + 1) * BATCH]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step(step, loss=loss.item())  # outside autocast, as the README says
    finally:
        monitor.close()
    assert _compute_bits(foreshockd, run, 2) == {0: 16.0, 1: 16.0}


def test_fp32_training_reads_32_bits(foreshockd):
    model = _model("llama")
    monitor = Monitor(foreshockd.endpoint, run_id="fp32", job="test", model=model,
                      probe_batch=_tokens(2, seed=3), every=EVERY)
    try:
        for step in range(2):
            with torch.no_grad():
                model(input_ids=_tokens(2))
            monitor.step(step)
    finally:
        monitor.close()
    assert _compute_bits(foreshockd, "fp32", 2) == {0: 32.0, 1: 32.0}


def test_trainer_bf16_reads_16_bits(foreshockd, tmp_path):
    from transformers import Trainer, TrainingArguments

    from foreshock.integrations.transformers import ForeshockCallback

    args = TrainingArguments(output_dir=str(tmp_path / "out"), run_name="trainer-bf16",
                             per_device_train_batch_size=BATCH, max_steps=STEPS, logging_steps=1,
                             learning_rate=1e-3, use_cpu=True, bf16=True, report_to=[],
                             save_strategy="no", disable_tqdm=True, seed=0,
                             dataloader_num_workers=0)
    dataset = [{"input_ids": x, "labels": x} for x in _tokens()]
    callback = ForeshockCallback(foreshockd.endpoint, probe_batch={"input_ids": _tokens(2, 3)},
                                 every=EVERY)
    Trainer(model=_model("llama"), args=args, train_dataset=dataset,
            callbacks=[callback]).train()
    assert _compute_bits(foreshockd, "trainer-bf16", 2) == {0: 16.0, 1: 16.0}


def test_lightning_bf16_mixed_reads_16_bits(foreshockd, tmp_path):
    pl = pytest.importorskip("lightning.pytorch")

    from foreshock.integrations.lightning import ForeshockCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _model("mistral")

        def training_step(self, batch, batch_idx):
            (tokens,) = batch
            return self.model(input_ids=tokens, labels=tokens).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    module = Module()
    callback = ForeshockCallback(foreshockd.endpoint, run_id="lightning-bf16",
                                 probe_batch=_tokens(2, seed=3), every=EVERY, model=module.model)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(_tokens()),
                                         batch_size=BATCH)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, precision="bf16-mixed",
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[callback])
    trainer.fit(module, loader)
    assert _compute_bits(foreshockd, "lightning-bf16", 2) == {0: 16.0, 1: 16.0}
