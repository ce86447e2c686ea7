"""One rank of a Lightning run sharded with FSDP2 (ModelParallelStrategy:
fully_shard in configure_model) on CPU/gloo, with foreshock's Lightning
ForeshockCallback; run by test_distributed_training.py under
torch.distributed.run.

    lightning_fsdp2_worker.py ENDPOINT RUN_ID OUT_DIR STEPS EVERY

Writes OUT_DIR/rank<r>.json: the monitor's stats, how the model was sharded,
and the losses this rank trained on."""
import gc
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from foreshock.integrations.lightning import ForeshockCallback  # noqa: E402

VOCAB, SEQ = 64, 16


class Llama(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=2 * SEQ)
        self.model = LlamaForCausalLM(config)
        self.losses = []

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def forward(self, input_ids):
        return self.model(input_ids=input_ids)

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main():
    endpoint, run_id, out_dir, steps, every = sys.argv[1:6]
    steps, every = int(steps), int(every)
    tokens = torch.randint(0, VOCAB, (64, SEQ), generator=torch.Generator().manual_seed(1))
    probe = tokens[:2]
    module = Llama()
    callback = ForeshockCallback(endpoint, run_id=run_id, probe_batch=probe, every=every,
                                 model=module.model)
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                     process_group_backend="gloo")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps,
                        callbacks=[callback], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=out_dir)
    loader = torch.utils.data.DataLoader(tokens, batch_size=2)
    trainer.fit(module, loader)
    rank = trainer.global_rank
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(dict(rank=rank, world=trainer.world_size, stats=callback.monitor.stats(),
                       collective=callback.monitor.probe_is_collective,
                       sharded=type(module.model).__name__, losses=module.losses), f)
    # The gloo process group torn down while Python is fully alive, not at
    # interpreter finalization (distributed_worker.py says why).
    del trainer, module, callback, strategy, loader
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    main()
