"""Distributed training, as users run it: `python -m torch.distributed.run
--nproc_per_node=N` on CPU (gloo), each rank a real training loop
(distributed_worker.py) streaming to a real foreshockd.

- DDP: the DDP-wrapped model handed to the Monitor as is (it used to crash
  both ranks: the probe ran DDP's forward, and its buffer broadcast, on rank 0
  only). Every rank sends scalars, only rank 0 probes and runs curvature, the
  training is bit-identical to the same training without the Monitor, and the
  run's loss series in the daemon is the mean of the ranks' losses at every
  step (each rank's own loss kept in the head slot).
- FSDP2 (fully_shard): every rank runs the collective probe forward, rank 0
  sends; also with the daemon unreachable and one rank slow: no hang.
- FSDP2 from Lightning (ModelParallelStrategy, fully_shard in configure_model)
  with the Lightning callback: the callback's probes are collective too.
- Tensor parallel, split by hand: each rank holds half the heads, probes
  with probe_all_ranks=True and its own probe_id, and what it sends is its
  heads of the whole model's Q/K.
"""
import glob
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import CLIENT, INSTALLED_CLIENT, ROOT, free_port
from foreshock import prometheus

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "distributed_worker.py")
STEPS, EVERY = 9, 4            # probes at steps 0, 4, 8 (the last: final weights)
PROBE_STEPS = [0, 4, 8]
TORCHRUN_TIMEOUT_S = 240       # a hang fails the test instead of the suite


def torchrun(nproc, mode, endpoint, run_id, out_dir, slow_rank=None, steps=STEPS, worker=WORKER):
    """Runs the worker on `nproc` ranks; returns {rank: result dict}. A worker
    other than distributed_worker.py takes no mode argument."""
    # PYTHONFAULTHANDLER: a rank that aborts in native code (SIGABRT, SIGSEGV)
    # prints the Python stack it was on, into the output the assertion shows.
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               PYTHONFAULTHANDLER="1")
    paths = [ROOT] if INSTALLED_CLIENT else [CLIENT, ROOT]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", worker] + \
        ([mode] if worker == WORKER else []) + [endpoint, run_id, str(out_dir), str(steps),
                                                  str(EVERY)]
    if slow_rank is not None:
        cmd.append(str(slow_rank))
    # Own process group: on a timeout, the launcher and every rank are killed.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TORCHRUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"torchrun {mode} did not finish in {TORCHRUN_TIMEOUT_S} s (a hang):\n"
                    + output[-4000:])
    faults = "".join(f"\n--- {name}:\n" + open(os.path.join(out_dir, name)).read()[-4000:]
                     for name in sorted(os.listdir(out_dir)) if name.startswith("fault-rank")
                     and os.path.getsize(os.path.join(out_dir, name)))
    assert proc.returncode == 0, f"torchrun {mode} failed:\n{output[-6000:]}{faults}"
    results = {}
    for rank in range(nproc):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            results[rank] = json.load(f)
    return results


def http_json(daemon, path):
    url = daemon.metrics_url.replace("/metrics", path)
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def points(daemon, run, signal_name, layer=-1, head=-1):
    body = http_json(daemon, f"/api/v1/points?run={run}&signal={signal_name}&layer={layer}"
                             f"&head={head}")
    return [(int(p["step"]), p["value"]) for p in body.get("points", [])]


def wait_processed(daemon, timeout_s=60):
    def done(samples):
        accepted = sum(v for n, _, v in samples if n == "foreshock_ingest_records_total")
        processed = sum(v for n, _, v in samples if n == "foreshock_samples_processed_total")
        return accepted > 0 and processed >= accepted and \
            prometheus.value(samples, "foreshock_queue_bytes") == 0
    samples, ok = daemon.wait_for(done, timeout_s=timeout_s)
    assert ok, "the daemon did not finish processing"
    return samples


def kinds_by_step(result, kind):
    return sorted({r["step"] for r in result["sent"] if r["kind"] == kind})


def assert_training_untouched(results):
    for rank, r in results.items():
        # Same seeds with and without the Monitor: the Monitor (probes,
        # curvature, sender) changed nothing in the training, bit for bit.
        assert r["same_losses"] and r["same_params"], f"rank {rank}: training changed"
        # close() leaves no client thread behind: at interpreter exit none can be
        # inside gRPC's native code (CPython ends such threads with pthread_exit,
        # which aborts a C++ frame: 'terminate called without an active exception').
        assert r["client_threads_after_close"] == [], f"rank {rank}: {r['client_threads_after_close']}"


def assert_delivered(result):
    stats = result["stats"]
    assert stats["rejected"] == {}, stats
    assert stats["acked_records"] == stats["enqueued"] == len(result["sent"]), stats


def assert_run_loss_is_the_rank_mean(daemon, run, results):
    n = len(results)
    expected = []
    for step in range(STEPS):
        total = 0.0
        for rank in range(n):  # the daemon sums in rank order: bit-identical
            total += results[rank]["losses"][step]
        values = {results[rank]["losses"][step] for rank in range(n)}
        expected.append((step, values.pop() if len(values) == 1 else total / n))
    assert points(daemon, run, "loss") == expected
    for rank in range(n):
        assert points(daemon, run, "loss", head=rank) == \
            list(enumerate(results[rank]["losses"])), f"rank {rank}'s own loss"
    # grad_norm: rank r reported 1 + r; lr: all the same, so exactly that value.
    assert points(daemon, run, "grad_norm") == \
        [(s, sum(1.0 + r for r in range(n)) / n) for s in range(STEPS)]
    assert points(daemon, run, "lr") == [(s, 3e-3) for s in range(STEPS)]
    # The baselines ran once per step, on the merged series.
    assert [s for s, _ in points(daemon, run, "baseline_nonfinite")] == list(range(STEPS))


def scalar_series(daemon, run, nproc):
    """The run's merged scalars, each rank's own, and the baseline computed from them."""
    out = {(name, head): points(daemon, run, name, head=head)
           for name in ("loss", "grad_norm", "lr") for head in range(-1, nproc)}
    out["baseline_nonfinite"] = points(daemon, run, "baseline_nonfinite")
    return out


@pytest.mark.parametrize("nproc", [2, 3])
def test_ddp_model_as_given(start_foreshockd, tmp_path, nproc):
    record_dir = tmp_path / "recordings"
    daemon = start_foreshockd("--per_head_metrics", f"--record_dir={record_dir}")
    run = f"ddp-{nproc}"
    results = torchrun(nproc, "ddp", daemon.endpoint, run, tmp_path)
    assert_training_untouched(results)
    for rank, r in results.items():
        assert r["rank_attr"] == rank
        assert r["layout"] == "ddp"
        assert r["hello_labels"] == {"world_size": str(nproc)}
        assert_delivered(r)
        assert kinds_by_step(r, "scalars") == list(range(STEPS))
    # Probes and curvature once per run: on rank 0 only, through model.module.
    zero = results[0]
    assert zero["stats"]["probes"] == len(PROBE_STEPS)
    assert zero["stats"]["curvature_estimates"] == len(PROBE_STEPS)
    assert zero["stats"]["curvature_failures"] == 0
    assert kinds_by_step(zero, "qk") == PROBE_STEPS
    assert kinds_by_step(zero, "router") == PROBE_STEPS
    for rank in range(1, nproc):
        stats = results[rank]["stats"]
        assert stats["probes"] == stats["probes_joined"] == stats["curvature_estimates"] == 0
        assert {x["kind"] for x in results[rank]["sent"]} == {"scalars"}

    samples = wait_processed(daemon)
    assert_run_loss_is_the_rank_mean(daemon, run, results)
    # Probe series: one point per probe step (rank 1 sent none).
    for layer in (0, 1):
        assert [s for s, _ in points(daemon, run, "attention_entropy", layer=layer)] == PROBE_STEPS
    assert [s for s, _ in points(daemon, run, "router_entropy", layer=1)] == PROBE_STEPS
    assert [s for s, _ in points(daemon, run, "curvature_lambda_max")] == PROBE_STEPS
    # /metrics: the run's gauge is the mean; with --per_head_metrics each rank's too.
    last_mean = points(daemon, run, "loss")[-1][1]
    run_gauge = [v for n, labels, v in samples if n == "foreshock_loss" and labels == {"run": run}]
    assert run_gauge == [pytest.approx(last_mean, rel=1e-15)]
    for rank in range(nproc):
        assert prometheus.value(samples, "foreshock_loss", run=run, rank=str(rank)) == \
            pytest.approx(results[rank]["losses"][-1], rel=1e-15)

    # Replayed into a fresh daemon, the ranks' records interleave differently:
    # the merged series are the same, bit for bit. (--speed realtime keeps the
    # streams overlapping as they did live: at full speed one rank's stream
    # can end, goodbye included, before the other's opens, and the run's
    # lifecycle would take the second for a new attempt.)
    live = scalar_series(daemon, run, nproc)
    daemon.stop()  # the recorder has written every stream
    files = sorted(glob.glob(str(record_dir / "*.fsrec")))
    assert len(files) == nproc
    replayed = start_foreshockd(f"--data_dir={tmp_path / 'replay-data'}")
    from test_foreshockctl import ctl
    out = ctl("replay", *files, "--to", replayed.endpoint, "--speed", "realtime", timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    wait_processed(replayed)
    assert scalar_series(replayed, run, nproc) == live


def test_fsdp2_every_rank_runs_the_probe_forward_one_sends(foreshockd, tmp_path):
    run = "fsdp2"
    results = torchrun(2, "fsdp2", foreshockd.endpoint, run, tmp_path)
    assert_training_untouched(results)
    zero, one = results[0], results[1]
    for rank, r in results.items():
        assert r["rank_attr"] == rank  # the default: torch.distributed's rank
        assert r["layout"] == "fsdp2"
        assert_delivered(r)
        assert "sharded" in r["curvature_refused"], r["curvature_refused"]
    assert (zero["stats"]["probes"], zero["stats"]["probes_joined"]) == (3, 0)
    assert (one["stats"]["probes"], one["stats"]["probes_joined"]) == (0, 3)
    assert kinds_by_step(zero, "qk") == kinds_by_step(zero, "router") == PROBE_STEPS
    assert {x["kind"] for x in one["sent"]} == {"scalars"}
    wait_processed(foreshockd)
    assert_run_loss_is_the_rank_mean(foreshockd, run, results)
    assert [s for s, _ in points(foreshockd, run, "attention_entropy", layer=0)] == PROBE_STEPS


def test_fsdp2_with_the_daemon_down_and_a_slow_rank_completes(tmp_path):
    # Nothing listens on the port: every connect fails, the sender retries in
    # the background; rank 1 is slow, so rank 0 waits for it in every all-gather.
    results = torchrun(2, "fsdp2", f"127.0.0.1:{free_port()}", "fsdp2-down", tmp_path,
                       slow_rank=1)
    assert_training_untouched(results)
    for r in results.values():
        stats = r["stats"]
        assert stats["acked_records"] == 0 and stats["failed_connects"] >= 1, stats
        # close(timeout=2) gives up, it does not hang: a liveness guard, not a latency bound.
        assert r["close_s"] < 60, r["close_s"]
    assert results[0]["stats"]["probes"] == results[1]["stats"]["probes_joined"] == 3
    # The slow rank slept 50 ms per step; the other one waited for it.
    assert results[0]["train_s"] >= 0.05 * STEPS


def test_lightning_fsdp2_callback_probes_on_every_rank(foreshockd, tmp_path):
    # The callback schedules its own probes: on the rank that does not send it
    # must still run the collective forward, or rank 0's all-gather hangs.
    run = "lightning-fsdp2"
    results = torchrun(2, None, foreshockd.endpoint, run, tmp_path,
                       worker=os.path.join(HERE, "lightning_fsdp2_worker.py"))
    zero, one = results[0], results[1]
    for r in results.values():
        assert r["collective"] and r["sharded"].startswith("FSDP"), r
        assert r["stats"]["unsent_at_close"] == 0 and r["stats"]["goodbye_acked"], r["stats"]
        assert r["stats"]["rejected"] == {}, r["stats"]
    assert (zero["stats"]["probes"], zero["stats"]["probes_joined"]) == (3, 0)
    assert (one["stats"]["probes"], one["stats"]["probes_joined"]) == (0, 3)
    wait_processed(foreshockd)
    for layer in (0, 1):  # the whole model's attention, from rank 0's probes
        assert [s for s, _ in points(foreshockd, run, "attention_entropy", layer=layer)] == \
            PROBE_STEPS
    # Each rank's loss (Lightning steps 1..STEPS) is the head slot of the run's loss.
    for rank, r in results.items():
        assert [v for _, v in points(foreshockd, run, "loss", head=rank)] == \
            pytest.approx(r["losses"], rel=1e-6)
    runs = http_json(foreshockd, "/api/v1/runs")["runs"]
    assert [x["ended"] for x in runs if x["run"] == run] == [True]  # both ranks said goodbye


def test_tensor_parallel_ranks_send_their_own_heads(foreshockd, tmp_path):
    run = "tp"
    results = torchrun(2, "tp", foreshockd.endpoint, run, tmp_path)
    assert_training_untouched(results)
    for rank, r in results.items():
        assert_delivered(r)
        assert r["stats"]["probes"] == 3
        qk = [x for x in r["sent"] if x["kind"] == "qk"]
        assert sorted({x["step"] for x in qk}) == PROBE_STEPS
        assert {x["probe_id"] for x in qk} == {f"tp{rank}"}
        assert all(x["shape"] == [2, 2 * 16, 8] for x in qk)  # its 2 heads of 4
        # Its heads of the whole model's Q/K (bf16 on the wire: ~0.4 % rounding).
        assert len(r["qk_rel_errors"]) == 2 and max(r["qk_rel_errors"]) < 1e-2, r
    # Every rank computed the same loss (the logits are all-reduced): the
    # run's loss is that loss, exactly.
    assert results[0]["losses"] == results[1]["losses"]
    wait_processed(foreshockd)
    assert_run_loss_is_the_rank_mean(foreshockd, run, results)
    # Both ranks' probes reached the detectors: two samples per probe step.
    steps = [s for s, _ in points(foreshockd, run, "attention_entropy", layer=0)]
    assert steps == sorted(PROBE_STEPS * 2)
