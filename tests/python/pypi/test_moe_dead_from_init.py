"""A healthy HF MoE run whose experts are dead from initialization raises no
alert (issue 26: ForeshockRouterCollapse fired on every layer of such
Qwen3-MoE and Mixtral runs once scoring started, cause
learning_rate_too_high). A tiny random-init Qwen3-MoE whose routers give two
experts a strongly negative logit (dead from the first probe on), trained by
the Trainer with the callback at a constant LR in fp32, a real daemon."""
import json
import os
import urllib.request

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
from transformers import Trainer, TrainingArguments  # noqa: E402

from foreshock.integrations.transformers import ForeshockCallback  # noqa: E402

VOCAB, SEQ, STEPS = 64, 12, 40


def _model():
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_experts=8,
        moe_intermediate_size=16, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # experts 6 and 7 never chosen: dead from initialization
        model.model.embed_tokens.weight[:, 0] += 0.2
        for layer in model.model.layers:
            layer.mlp.gate.weight[6:, 0] -= 3.0
    return model

def test_healthy_moe_with_experts_dead_from_initialization_raises_no_alert(
        foreshockd_from_step_0, tmp_path):
    tokens = torch.randint(0, VOCAB, (4 * STEPS, SEQ), generator=torch.Generator().manual_seed(1))
    probe = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), run_name="moe-dead-init",
                             per_device_train_batch_size=4, max_steps=STEPS, logging_steps=1,
                             learning_rate=1e-4, lr_scheduler_type="constant", use_cpu=True,
                             report_to=[], save_strategy="no", disable_tqdm=True, seed=0,
                             dataloader_num_workers=0)
    callback = ForeshockCallback(foreshockd_from_step_0.endpoint, probe_batch={"input_ids": probe},
                                 every=1)
    Trainer(model=_model(), args=args, train_dataset=[{"input_ids": x, "labels": x} for x in tokens],
            callbacks=[callback]).train()

    def http(path):
        url = foreshockd_from_step_0.metrics_url.replace("/metrics", path)
        with urllib.request.urlopen(url, timeout=30) as response:
            return json.loads(response.read())
    points = http("/api/v1/points?run=moe-dead-init&signal=router_dead_experts&layer=0")["points"]
    assert len(points) == STEPS + 1
    assert all(p["value"] >= 2 for p in points)  # dead from the first probe to the last
    alerts = http("/api/v1/alerts?run=moe-dead-init&include_resolved=true")["alerts"]
    assert not [a for a in alerts if a["alertname"] == "ForeshockRouterCollapse"], alerts
