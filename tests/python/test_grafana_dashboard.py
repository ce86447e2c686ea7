"""deploy/grafana/foreshock.json against real components.

A real foreshockd (with a real Alertmanager and --record_dir, so the delivery
and drop counters exist), scraped every second by Debian's Prometheus, watches
a short demo training with a low-precision fault that fires alerts. One stream
is rejected and one run reports a NaN loss, so the ingest-health counters that
only appear with their first event exist too. Then every PromQL expression of
the dashboard (panel targets, the run variable's query, the annotation query),
with Grafana's variables substituted, must be valid and return data from
Prometheus, and every metric the dashboard names must be in the daemon's
/metrics. Grafana itself is not run (it is not packaged in Debian).
"""
import json
import math
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import grpc
import pytest
import yaml

from conftest import ROOT, free_port, wait_until
from demo import train
from foreshock import Monitor
from foreshock.v1 import ingest_pb2 as pb
from foreshock.v1 import ingest_pb2_grpc as pb_grpc

GRAFANA = os.path.join(ROOT, "deploy", "grafana")
DASHBOARD = os.path.join(GRAFANA, "foreshock.json")
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
ALERTMANAGER = shutil.which("prometheus-alertmanager") or "/usr/bin/prometheus-alertmanager"

RUN = "grafana-lowprec"
STEPS = 520
# --keep-run-open: the run's alerts stay active after the training, as in a
# live run, so that Prometheus scrapes them (closing would end the run and
# resolve them within a second or two).
TRAIN_ARGS = ["--run-id", RUN, "--steps", str(STEPS), "--fault", "lowprec", "--fault-step", "300",
              "--fault-strength", "64", "--log-every", "0", "--keep-run-open"]
# What Grafana puts in for its built-in variables (the scrape interval here is 1s).
ANNOTATION_EXPR = 'max_over_time(foreshock_alert_active{run="$run"}[15s]) == 1'
GRAFANA_VARS = {"__rate_interval": "1m", "__interval": "15s", "__range": "10m"}

# Panels that draw the layer x time maps, and the metric each must show.
LAYER_MAPS = {
    "foreshock_qk_increment_entropy", "foreshock_attention_max_logit",
    "foreshock_router_entropy", "foreshock_router_flip_rate",
}


# Steps an alert must fire for the test to expect a scrape while it fired:
# this training runs at most ~40 steps/s, so 100 steps span several 1 s scrapes.
MIN_SCRAPED_SPAN = 100


def firing_spans(events, last_step):
    """{(alertname, layer): the most steps it fired for in one episode}
    from the training's alert events (still firing at the end: up to last_step)."""
    since, spans = {}, {}
    for e in sorted(events, key=lambda e: e.step):
        key = (e.alert.alertname, e.alert.layer)
        if e.to_state == "firing":
            since.setdefault(key, e.step)
            spans.setdefault(key, 0)
        elif key in since:
            spans[key] = max(spans[key], e.step - since.pop(key))
    for key, step in since.items():
        spans[key] = max(spans[key], last_step - step)
    return spans


def load_dashboard():
    with open(DASHBOARD, encoding="utf-8") as f:
        return json.load(f)


def all_panels(dashboard):
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # panels inside a collapsed row


def prometheus_queries(dashboard):
    """(where, expression) for every PromQL expression in the dashboard."""
    queries = []
    for panel in all_panels(dashboard):
        for target in panel.get("targets", []):
            queries.append((f"panel {panel['title']!r} target {target['refId']}", target["expr"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            if isinstance(query, dict):
                query = query["query"]
            queries.append((f"variable {variable['name']}", query))
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            queries.append((f"annotation {annotation['name']!r}", annotation["expr"]))
    return queries


def substitute(expr, values):
    def one(match):
        name = match.group(1) or match.group(2)
        assert name in values, f"unknown variable ${name} in {expr}"
        return values[name]
    out = re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)
    assert "$" not in out, out
    return out


def metric_names(expr):
    return set(re.findall(r"\bforeshock_[a-zA-Z0-9_]+", expr))


def exported_names(metrics_text):
    return {re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0)
            for line in metrics_text.splitlines() if line and not line.startswith("#")}


# -- structure (no processes) ---------------------------------------------

def test_dashboard_structure():
    d = load_dashboard()
    assert 36 <= d["schemaVersion"] <= 39, d["schemaVersion"]
    assert d["uid"] == "foreshock" and d["id"] is None
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["run"]["type"] == "query"
    assert variables["run"]["query"] == "label_values(foreshock_last_step, run)"
    assert variables["run"]["datasource"]["uid"] == "${datasource}"

    ids = [p["id"] for p in all_panels(d)]
    assert len(ids) == len(set(ids)), ids
    shown = {}
    for panel in all_panels(d):
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], panel["title"]
            for name in metric_names(target["expr"]):
                shown.setdefault(name, []).append((panel, target))

    # The four layer x time maps: one status-history row per layer.
    for name in LAYER_MAPS:
        maps = [(p, t) for p, t in shown.get(name, []) if p["type"] == "status-history"]
        assert maps, f"no status-history panel for {name}"
        for panel, target in maps:
            assert target["expr"] == f'{name}{{run="$run"}}', target["expr"]
            assert target["legendFormat"] == "{{layer}}"
            assert panel["maxDataPoints"] <= 300  # status-history draws nothing when overfull

    # Curvature with its edge line at 1.
    rho = [p for p, _ in shown["foreshock_curvature_eos_ratio"] if p["type"] == "timeseries"]
    assert rho, "no curvature time series"
    steps = rho[0]["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert rho[0]["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"].startswith("line")
    assert [s["value"] for s in steps if s["value"] is not None] == [1]

    # Loss and grad norm panels, and the alert annotation.
    for name in ("foreshock_loss", "foreshock_grad_norm"):
        assert any(p["type"] == "timeseries" for p, _ in shown[name]), name
    annotation = [a for a in d["annotations"]["list"] if "expr" in a]
    assert len(annotation) == 1 and annotation[0]["enable"]
    # Any 1 within the annotation's step: an alert that fires and resolves
    # between two evaluations (a 15 s step) still shows.
    assert annotation[0]["expr"] == ANNOTATION_EXPR, annotation[0]["expr"]
    assert annotation[0]["step"] == "15s"
    assert annotation[0]["datasource"]["uid"] == "${datasource}"
    assert "{{alertname}}" in annotation[0]["titleFormat"]
    assert "{{layer}}" in annotation[0]["textFormat"]

    # Ingest health.
    for name in ("foreshock_ingest_records_total", "foreshock_ingest_rejected_total",
                 "foreshock_queue_depth", "foreshock_queue_bytes", "foreshock_record_frames_total",
                 "foreshock_alertmanager_dropped_total", "foreshock_alert_active"):
        assert name in shown, name


def test_provisioning_files():
    with open(os.path.join(GRAFANA, "provisioning", "dashboards", "foreshock.yaml")) as f:
        dashboards = yaml.safe_load(f)
    assert dashboards["apiVersion"] == 1
    provider = dashboards["providers"][0]
    assert provider["type"] == "file" and provider["options"]["path"]
    with open(os.path.join(GRAFANA, "provisioning", "datasources", "prometheus.yaml")) as f:
        datasources = yaml.safe_load(f)
    assert datasources["apiVersion"] == 1
    assert datasources["datasources"][0]["type"] == "prometheus"


# -- against a real daemon and a real Prometheus ---------------------------

class Process:
    """A subprocess with its log in tmp_path; stop() terminates it by PID."""

    def __init__(self, argv, log_path):
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)

    def alive(self):
        return self.process.poll() is None

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()

    def log_text(self):
        with open(self.log_path, "rb") as f:
            return f.read()[-4000:].decode("utf-8", "replace")


def http_json(url):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def http_ready(url):
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


class PromAPI:
    def __init__(self, port):
        self.base = f"http://127.0.0.1:{port}/api/v1"

    def get(self, path, **params):
        url = f"{self.base}/{path}?" + urllib.parse.urlencode(params, doseq=True)
        try:
            body = http_json(url)
        except urllib.error.HTTPError as e:  # 400 for a bad expression: say which
            body = json.load(e)
        assert body["status"] == "success", (params, body)
        return body["data"]

    def query(self, expr, at=None):
        params = {"query": expr}
        if at is not None:
            params["time"] = at
        return self.get("query", **params)["result"]

    def query_range(self, expr, start, end, step):
        return self.get("query_range", query=expr, start=start, end=end, step=step)["result"]


def start_alertmanager(tmp_path):
    assert os.access(ALERTMANAGER, os.X_OK), "Debian's prometheus-alertmanager is required"
    config = tmp_path / "alertmanager.yml"
    config.write_text("route:\n  receiver: blackhole\n  group_wait: 0s\n"
                      "receivers:\n  - name: blackhole\n")
    port = free_port()
    am = Process([ALERTMANAGER, f"--config.file={config}", f"--storage.path={tmp_path / 'am'}",
                  f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
                 tmp_path / "alertmanager.log")
    am.url = f"http://127.0.0.1:{port}"
    return am


def start_prometheus(tmp_path, metrics_port):
    assert os.access(PROMETHEUS, os.X_OK), "Debian's prometheus is required (scripts/test installs it)"
    # The shipped scrape config, pointed at this test's daemon, scraping every second.
    with open(os.path.join(ROOT, "deploy", "prometheus", "prometheus.yml")) as f:
        config = f.read().replace("127.0.0.1:9464", f"127.0.0.1:{metrics_port}")
    config = config.replace("scrape_interval: 5s", "scrape_interval: 1s")
    (tmp_path / "prometheus.yml").write_text(config)
    port = free_port()
    prom = Process([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}"], tmp_path / "prometheus.log")
    prom.port = port
    return prom


def reject_one_stream(endpoint):
    """A Batch before the Hello: the daemon ends the stream, reason batch_before_hello."""
    with grpc.insecure_channel(endpoint) as channel:
        responses = pb_grpc.IngestStub(channel).Stream(
            iter([pb.StreamRequest(batch=pb.Batch(seq=1))]), timeout=10)
        with pytest.raises(grpc.RpcError) as error:
            list(responses)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value


def send_nan_loss(endpoint):
    monitor = Monitor(endpoint, run_id="grafana-nan", job="grafana-test")
    try:
        monitor.step(0, loss=float("nan"))
    finally:
        monitor.close(timeout=10)
    assert monitor.stats()["acked_records"] == 1, monitor.stats()


def test_every_dashboard_query_returns_data(start_foreshockd, tmp_path):
    dashboard = load_dashboard()
    am = start_alertmanager(tmp_path)
    prom = None
    try:
        assert wait_until(lambda: http_ready(f"{am.url}/-/ready"), timeout_s=30), am.log_text()
        daemon = start_foreshockd(f"--alertmanager_url={am.url}",
                                  f"--record_dir={tmp_path / 'records'}")
        prom = start_prometheus(tmp_path, daemon.metrics_port)
        api = PromAPI(prom.port)
        assert wait_until(lambda: http_ready(f"http://127.0.0.1:{prom.port}/-/ready"),
                          timeout_s=30), prom.log_text()
        start = time.time()

        # A short real training whose fault fires alerts.
        args = train.parse_args(["--endpoint", daemon.endpoint] + TRAIN_ARGS)
        result = train.run(args, out=lambda *a: None)
        fired = firing_spans(result["alert_events"], STEPS - 1)
        assert fired, [(e.step, e.alert.alertname, e.to_state) for e in result["alert_events"]]
        reject_one_stream(daemon.endpoint)
        send_nan_loss(daemon.endpoint)

        # Prometheus has the end of the run and the late counters, a few scrapes deep.
        def scraped():
            last = api.query(f'foreshock_last_step{{run="{RUN}"}}')
            return (last and float(last[0]["value"][1]) == STEPS - 1
                    and api.query("count_over_time(foreshock_ingest_rejected_total[1m]) >= 3")
                    and api.query("count_over_time(foreshock_nonfinite_values_total[1m]) >= 3"))
        assert wait_until(scraped, timeout_s=60, interval_s=0.5), prom.log_text()
        end = time.time()
        step = 5  # range queries evaluate at end - k*step, so the last point is `end`
        start = end - step * math.ceil((end - start) / step)

        values = dict(GRAFANA_VARS, run=RUN)
        queries = prometheus_queries(dashboard)
        assert len(queries) >= 25, queries
        referenced = set()
        empty = []
        for where, expr in queries:
            referenced |= metric_names(expr)
            label_values = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", expr)
            if label_values:  # Grafana's variable function, not PromQL
                metric, label = label_values.groups()
                found = api.get(f"label/{label}/values", **{"match[]": metric})
                if RUN not in found:
                    empty.append((where, expr, found))
                continue
            promql = substitute(expr, values)
            api.query(promql, at=end)  # valid at the current time
            series = api.query_range(promql, start, end, step)
            if not series or not any(s["values"] for s in series):
                empty.append((where, promql, series))
        assert not empty, "dashboard queries without data:\n" + "\n".join(map(str, empty))

        # The layer maps have one row per layer.
        n_layers = 4
        for name in LAYER_MAPS:
            layers = {s["metric"]["layer"]
                      for s in api.query_range(f'{name}{{run="{RUN}"}}', start, end, step)}
            if name.startswith("foreshock_router_"):
                assert layers and layers <= {str(i) for i in range(n_layers)}, (name, layers)
            else:
                assert layers == {str(i) for i in range(n_layers)}, (name, layers)

        # The annotation query sees each alert the training saw fire.
        # A gauge shows only what a scrape saw: an alert that fired for a few
        # steps (under a second of this training) may fall between two
        # scrapes, so only those that fired for MIN_SCRAPED_SPAN steps count.
        annotated = {(s["metric"]["alertname"], s["metric"]["layer"]) for s in api.query_range(
            substitute(ANNOTATION_EXPR, values), start, end, step)}
        long_enough = {key for key, span in fired.items() if span >= MIN_SCRAPED_SPAN}
        assert long_enough, fired
        assert long_enough <= annotated, (fired, annotated)

        # Curvature came through with finite values.
        rho = api.query(f'foreshock_curvature_eos_ratio{{run="{RUN}"}}')
        assert rho and math.isfinite(float(rho[0]["value"][1])), rho

        # No panel shows a metric the daemon does not export.
        exported = exported_names(daemon.metrics_text())
        missing = sorted(referenced - exported)
        assert not missing, f"the dashboard names metrics foreshockd does not export: {missing}"
    finally:
        if prom is not None:
            prom.stop()
        am.stop()
