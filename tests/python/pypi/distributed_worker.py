"""One rank of the distributed-training tests (test_distributed_training.py),
started by `python -m torch.distributed.run --nproc_per_node=N` on CPU (gloo).

    distributed_worker.py MODE ENDPOINT RUN_ID OUT_DIR STEPS EVERY [SLOW_RANK]

MODE:
  ddp    the demo model wrapped in DistributedDataParallel and handed to the
         Monitor as is, with a CurvatureEstimator on the DDP model too;
  fsdp2  the demo model sharded with fully_shard (each block and the root);
  tp     a hand-split tensor-parallel attention model: each rank holds its
         share of the heads and hands its own Q/K over with capture_qk
         (probe_all_ranks=True, probe_id per rank).

Each rank trains the same steps twice, without and with the Monitor (same
seeds), and writes OUT_DIR/rank<r>.json: both loss sequences, whether the
parameters ended bit-identical, the Monitor's stats and what it queued (the
tap). SLOW_RANK sleeps 50 ms before every step, so that the others wait for
it in every collective.
"""
import faulthandler
import gc
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from demo.tiny_moe_gpt import GPTConfig, TinyMoEGPT
from foreshock import Monitor
from foreshock.capture import ModelInfo
from foreshock.curvature import CurvatureEstimator

VOCAB, BLOCK = 40, 16
CLOSE_TIMEOUT_S = 2.0


def demo_model():
    torch.manual_seed(0)
    model = TinyMoEGPT(GPTConfig(vocab_size=VOCAB, n_layer=2, d_model=32, n_head=2,
                                 block_size=BLOCK, mlp_hidden=64, expert_hidden=32,
                                 moe_layers=(1,)))
    # A buffer, as HF models' rotary embeddings have (inv_freq): DDP's forward
    # broadcasts buffers from rank 0, a collective every rank must join.
    model.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2) / 8)),
                          persistent=False)
    return model


class SplitAttentionLM(nn.Module):
    """Attention-only LM whose heads are split over the ranks (Megatron-style):
    Q/K/V projections hold this rank's heads (column split), the output
    projection their input columns (row split), summed with an all_reduce."""

    N_HEADS, HEAD_DIM, D_MODEL, N_LAYERS = 4, 8, 32, 2

    def __init__(self, rank, world, hook=None):
        super().__init__()
        torch.manual_seed(0)  # the full weights, identical on every rank; then this rank's share
        self.emb = nn.Embedding(VOCAB, self.D_MODEL)
        full = [(nn.Linear(self.D_MODEL, self.N_HEADS * self.HEAD_DIM, bias=False),
                 nn.Linear(self.D_MODEL, self.N_HEADS * self.HEAD_DIM, bias=False),
                 nn.Linear(self.D_MODEL, self.N_HEADS * self.HEAD_DIM, bias=False),
                 nn.Linear(self.N_HEADS * self.HEAD_DIM, self.D_MODEL, bias=False))
                for _ in range(self.N_LAYERS)]
        self.head = nn.Linear(self.D_MODEL, VOCAB, bias=False)
        self.local_heads = self.N_HEADS // world
        cols = slice(rank * self.local_heads * self.HEAD_DIM,
                     (rank + 1) * self.local_heads * self.HEAD_DIM)
        self.layers = nn.ModuleList()
        for q, k, v, o in full:
            layer = nn.Module()
            layer.q = nn.Linear(self.D_MODEL, self.local_heads * self.HEAD_DIM, bias=False)
            layer.k = nn.Linear(self.D_MODEL, self.local_heads * self.HEAD_DIM, bias=False)
            layer.v = nn.Linear(self.D_MODEL, self.local_heads * self.HEAD_DIM, bias=False)
            layer.o = nn.Linear(self.local_heads * self.HEAD_DIM, self.D_MODEL, bias=False)
            with torch.no_grad():
                layer.q.weight.copy_(q.weight[cols])
                layer.k.weight.copy_(k.weight[cols])
                layer.v.weight.copy_(v.weight[cols])
                layer.o.weight.copy_(o.weight[:, cols])
            self.layers.append(layer)
        self.hook = hook

    def forward(self, idx):
        b, t = idx.shape
        x = self.emb(idx)
        for i, layer in enumerate(self.layers):
            def heads(z):
                return z.view(b, t, self.local_heads, self.HEAD_DIM).transpose(1, 2)
            xin = _CopyToParallel.apply(x)
            q, k, v = heads(layer.q(xin)), heads(layer.k(xin)), heads(layer.v(xin))
            if self.hook is not None:
                self.hook(i, q, k)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            partial = layer.o(att.transpose(1, 2).reshape(b, t, -1))
            # Each rank's heads contribute a partial sum; _AllReduceSum keeps
            # autograd right (the gradient of a sum to every rank is the identity).
            x = x + _AllReduceSum.apply(partial)
        return self.head(x)

    @torch.no_grad()
    def reference_qk(self, idx, layer_index):
        """Q and K of every head of layer `layer_index`, [B, H, T, d], computed by an
        unsplit forward from the current weights gathered from every rank (a collective)."""
        def gather(weight, dim):
            parts = [torch.empty_like(weight) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, weight.contiguous())
            return torch.cat(parts, dim=dim)
        full = [(gather(layer.q.weight, 0), gather(layer.k.weight, 0), gather(layer.v.weight, 0),
                 gather(layer.o.weight, 1)) for layer in self.layers]
        b, t = idx.shape
        x = self.emb(idx)
        for i, (q, k, v, o) in enumerate(full):
            def heads(z):
                return z.view(b, t, self.N_HEADS, self.HEAD_DIM).transpose(1, 2)
            qq, kk, vv = heads(x @ q.T), heads(x @ k.T), heads(x @ v.T)
            if i == layer_index:
                return qq, kk
            att = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
            x = x + att.transpose(1, 2).reshape(b, t, -1) @ o.T
        raise IndexError(layer_index)


class _CopyToParallel(torch.autograd.Function):
    """Identity forward; the gradient from every rank's heads summed backward."""
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (4, BLOCK + 1), generator=g)


def main():
    mode, endpoint, run_id, out_dir, steps, every = sys.argv[1:7]
    # A rank that aborts in native code dumps every thread's Python stack to a
    # file of its own (the test shows it), not interleaved with the other rank's.
    fault_log = open(os.path.join(out_dir, f"fault-rank{os.environ.get('RANK', '0')}.txt"), "w")
    faulthandler.enable(fault_log, all_threads=True)
    slow_rank = int(sys.argv[7]) if len(sys.argv) > 7 else -1
    steps, every = int(steps), int(every)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    probe = torch.randint(0, VOCAB, (2, BLOCK), generator=torch.Generator().manual_seed(7))
    result = dict(rank=rank, world=world)

    def build(with_monitor):
        sent = []
        monitor = curvature = None
        if mode == "ddp":
            inner = demo_model()
            model = torch.nn.parallel.DistributedDataParallel(inner)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
            if with_monitor:
                curvature = CurvatureEstimator(
                    model, lambda m, b: F.cross_entropy(m(b[:, :-1]).flatten(0, 1),
                                                        b[:, 1:].flatten()),
                    batch(10 ** 6, 0), opt, every=every, hvps=2,
                    budget=None)  # a fixed cadence: the test counts estimates
                # rank given, as in the report of the crash; the other modes
                # rely on the default (torch.distributed's rank).
                monitor = Monitor(endpoint, run_id=run_id, job="dist-test", model=model,
                                  probe_batch=probe, every=every, curvature=curvature,
                                  tap=sent.append, rank=rank)
        elif mode == "fsdp2":
            from torch.distributed.fsdp import fully_shard
            inner = model = demo_model()
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
            if with_monitor:
                try:
                    CurvatureEstimator(model, lambda m, b: m(b).sum(), probe)
                    result["curvature_refused"] = None
                except ValueError as e:
                    result["curvature_refused"] = str(e)
                monitor = Monitor(endpoint, run_id=run_id, job="dist-test", model=model,
                                  probe_batch=probe, every=every, tap=sent.append)
        else:  # tp
            inner = model = SplitAttentionLM(rank, world)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
            if with_monitor:
                monitor = Monitor(endpoint, run_id=run_id, job="dist-test", model=model,
                                  probe_batch=probe, every=every, tap=sent.append,
                                  probe_all_ranks=True, probe_id=f"tp{rank}", discover=False,
                                  discover_routers=False,
                                  model_info=ModelInfo(n_layers=model.N_LAYERS,
                                                       n_heads=model.local_heads,
                                                       head_dim=model.HEAD_DIM))
                model.hook = monitor.capture_qk
        return model, inner, opt, monitor, sent

    runs = {}
    for with_monitor in (False, True):
        model, inner, opt, monitor, sent = build(with_monitor)
        losses = []
        start = time.monotonic()
        for step in range(steps):
            if rank == slow_rank:
                time.sleep(0.05)
            data = batch(step, 0 if mode == "tp" else rank)  # TP: every rank the same data
            logits = model(data[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            if monitor is not None:
                monitor.step(step, loss=loss.item(), grad_norm=1.0 + rank, lr=3e-3)
            losses.append(loss.item())
        train_s = time.monotonic() - start
        params = [p.detach().clone() for p in inner.parameters()]
        runs[with_monitor] = (losses, params)
        if monitor is not None:
            close_start = time.monotonic()
            monitor.close(timeout=CLOSE_TIMEOUT_S)
            result["client_threads_after_close"] = sorted(
                t.name for t in threading.enumerate() if t.name.startswith("foreshock"))
            result.update(
                losses=losses, train_s=train_s, close_s=time.monotonic() - close_start,
                rank_attr=monitor.rank, stats=monitor.stats(), layout=monitor._layout.kind,
                hello_labels=dict(monitor._sender._hello.hello.labels),
                sent=[dict(kind=r.WhichOneof("payload"), step=r.step,
                           probe_id=getattr(getattr(r, r.WhichOneof("payload")), "probe_id", ""),
                           layer=getattr(getattr(r, r.WhichOneof("payload")), "layer", -1),
                           shape=list(r.qk.q.shape) if r.HasField("qk") else [])
                      for r in sent])
            if mode == "tp":
                # This rank's captured Q/K against the full model's heads.
                from foreshock.encoding import decode_tensor
                errors = []
                lo = rank * inner.local_heads
                last = max(r.step for r in sent if r.HasField("qk"))
                assert last == steps - 1, "the last probe must see the final weights"
                for r in sent:
                    if r.HasField("qk") and r.step == last:
                        q = torch.from_numpy(decode_tensor(r.qk.q).copy()).float()
                        k = torch.from_numpy(decode_tensor(r.qk.k).copy()).float()
                        fq, fk = inner.reference_qk(probe, r.qk.layer)
                        fq = fq[:, lo:lo + inner.local_heads].permute(1, 0, 2, 3).reshape(
                            inner.local_heads, -1, inner.HEAD_DIM)
                        fk = fk[:, lo:lo + inner.local_heads].permute(1, 0, 2, 3).reshape(
                            inner.local_heads, -1, inner.HEAD_DIM)
                        errors.append(max(float((q - fq).abs().max() / fq.abs().max()),
                                          float((k - fk).abs().max() / fk.abs().max())))
                result["qk_rel_errors"] = errors
    result["reference_losses"] = runs[False][0]
    result["same_losses"] = runs[False][0] == runs[True][0]
    result["same_params"] = all(torch.equal(a, b) for a, b in zip(runs[False][1], runs[True][1]))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    # Tear the process group down while Python is fully alive. FSDP2's modules
    # hold the gloo process group; left to interpreter finalization, its worker
    # thread can free a finished collective's tensors then, and taking the GIL
    # from that thread during finalization aborts the process (terminate, then
    # SIGSEGV in the fault handler): seen once in CI and once in ~75 loaded
    # runs here, a core dump showing c10d::ProcessGroupGloo::runLoop in
    # TensorImpl::decref_pyobject. So: drop every module and optimizer, collect
    # the cycles, then destroy the group, whose destructor joins its threads.
    del model, inner, opt, monitor, sent, runs
    gc.collect()
    dist.destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    main()
