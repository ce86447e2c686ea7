"""Cost of the attention output check (Monitor(output_check=True)) on the probe.

One bf16 Hugging Face Llama (4 layers, hidden 256, 8 heads / 4 K/V heads,
sdpa) on CPU, probe batch 4 x 128 tokens. Two monitors on the same model, one
with the check and one without, probe alternately (the order flips every
round) 30 times; the first 5 rounds are dropped and the medians compared as a
ratio. The check runs each layer's attention function once more on fp32
inputs, only on probe steps; the training step itself is untouched.

    OMP_NUM_THREADS=1 PYTHONPATH=.:tests/python FORESHOCK_INSTALLED_CLIENT=1 \\
        build/venv-pypi/bin/python tests/bench/probe_output_check.py
"""
import statistics
import time

import torch
import transformers

from conftest import free_port
from foreshock import Monitor


def main(rounds=30, skip=5):
    torch.set_num_threads(1)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688,
                                   num_hidden_layers=4, num_attention_heads=8,
                                   num_key_value_heads=4, max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    probe = torch.randint(0, 512, (4, 128), generator=torch.Generator().manual_seed(1))
    # Nothing listens on these ports: the records queue (bounded) and are dropped at close.
    monitors = {flag: Monitor(f"127.0.0.1:{free_port()}", run_id=f"bench-{flag}", job="bench",
                              model=model, probe_batch=probe, every=1, output_check=flag,
                              queue_size=100000, queue_bytes=1 << 30)
                for flag in (False, True)}
    times = {False: [], True: []}
    try:
        for i in range(rounds):
            for flag in ((False, True) if i % 2 else (True, False)):
                start = time.perf_counter()
                monitors[flag].probe(i)
                times[flag].append(time.perf_counter() - start)
    finally:
        for monitor in monitors.values():
            monitor.close(timeout=0)
    without, with_check = (statistics.median(times[f][skip:]) for f in (False, True))
    print(f"probe, median of {rounds - skip}: without the check {without * 1e3:.1f} ms, "
          f"with it {with_check * 1e3:.1f} ms, ratio {with_check / without:.3f}")


if __name__ == "__main__":
    main()
