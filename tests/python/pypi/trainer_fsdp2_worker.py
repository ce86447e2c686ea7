"""One rank of a Hugging Face Trainer run sharded with FSDP2 (accelerate's
fully_shard, fsdp_version 2) on CPU/gloo, with foreshock's ForeshockCallback;
run by test_distributed_training.py under torch.distributed.run.

    trainer_fsdp2_worker.py ENDPOINT RUN_ID OUT_DIR STEPS EVERY

Writes OUT_DIR/rank<r>.json: the monitor's stats and the Trainer's logged losses."""
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

from foreshock.integrations.transformers import ForeshockCallback  # noqa: E402

VOCAB, SEQ = 64, 16


def main():
    endpoint, run_id, out_dir, steps, every = sys.argv[1:6]
    steps, every = int(steps), int(every)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2 * SEQ)
    model = LlamaForCausalLM(config)
    tokens = torch.randint(0, VOCAB, (4 * steps * 4, SEQ),
                           generator=torch.Generator().manual_seed(1))
    dataset = [{"input_ids": x, "labels": x} for x in tokens]
    probe = {"input_ids": tokens[:2]}
    args = TrainingArguments(
        output_dir=os.path.join(out_dir, "out"), run_name=run_id, per_device_train_batch_size=2,
        max_steps=steps, logging_steps=1, learning_rate=1e-3, report_to=[],
        save_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
        fsdp=True, fsdp_config={"fsdp_version": 2, "reshard_after_forward": True,
                                        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
        ddp_backend="gloo")
    callback = ForeshockCallback(endpoint, probe_batch=probe, every=every)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[callback])
    trainer.train()
    rank = args.process_index
    sharded = type(trainer.model_wrapped).__name__
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(dict(rank=rank, world=args.world_size, stats=callback.monitor.stats(),
                       collective=callback.monitor.probe_is_collective, wrapped=sharded,
                       losses=[(e["step"], e["loss"]) for e in trainer.state.log_history
                               if "loss" in e]), f)


if __name__ == "__main__":
    main()
