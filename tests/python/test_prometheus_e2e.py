"""A real Prometheus scrapes a real foreshockd fed by a real training run, and
its HTTP API returns foreshock_qk_increment_entropy for every layer."""
import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import torch

from conftest import ROOT, free_port
from demo import tiny_moe_gpt
from foreshock import Monitor

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


def _query(port, expr):
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body["data"]["result"]


def _train_with_monitor(endpoint, run_id, steps=40, every=10):
    torch.manual_seed(0)
    text = tiny_moe_gpt.load_text("gnu")
    vocab = tiny_moe_gpt.CharVocab([text])
    data = tiny_moe_gpt.CharDataset(vocab.encode(text), block_size=32)
    cfg = tiny_moe_gpt.GPTConfig(vocab_size=len(vocab), block_size=32)
    model = tiny_moe_gpt.TinyMoEGPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    monitor = Monitor(endpoint, run_id=run_id, job="prometheus-e2e", model=model,
                      probe_batch=data.probe_batch(2), every=every)
    try:
        for step in range(steps + 1):
            x, y = data.batch(8, generator)
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            monitor.step(step, loss=loss.item())
    finally:
        monitor.close(timeout=10)
    return cfg.n_layer, monitor.stats()


def test_prometheus_scrapes_qk_entropy_for_every_layer(foreshockd, tmp_path):
    assert os.access(PROMETHEUS, os.X_OK), "Debian's prometheus is required (scripts/test installs it)"
    n_layers, stats = _train_with_monitor(foreshockd.endpoint, "prom-e2e")
    assert stats["acked_records"] > 0, stats

    # The shipped scrape config, pointed at this test's daemon.
    with open(os.path.join(ROOT, "deploy", "prometheus", "prometheus.yml")) as f:
        config = f.read().replace("127.0.0.1:9464", f"127.0.0.1:{foreshockd.metrics_port}")
    config = config.replace("scrape_interval: 5s", "scrape_interval: 1s")
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(config)
    port = free_port()
    log = open(tmp_path / "prometheus.log", "wb")
    prometheus = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config_path}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        result = []
        while time.monotonic() < deadline:
            try:
                result = _query(port, 'foreshock_qk_increment_entropy{run="prom-e2e"}')
            except OSError:
                result = []
            if len(result) >= n_layers:
                break
            assert prometheus.poll() is None, (tmp_path / "prometheus.log").read_text()
            time.sleep(0.5)
        layers = sorted(int(r["metric"]["layer"]) for r in result)
        assert layers == list(range(n_layers)), result
        for r in result:
            assert r["metric"]["job"] == "foreshock"  # Prometheus's own label, untouched
            assert 0.0 < float(r["value"][1]) <= 1.0
        info = _query(port, 'foreshock_run_info{run="prom-e2e"}')
        assert info and info[0]["metric"]["job_name"] == "prometheus-e2e", info
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/targets"))
        assert targets["data"]["activeTargets"][0]["health"] == "up", targets
    finally:
        prometheus.terminate()
        try:
            prometheus.wait(20)
        except subprocess.TimeoutExpired:
            prometheus.kill()
            prometheus.wait()
        log.close()
