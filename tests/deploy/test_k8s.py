"""deploy/k8s: the manifests parse, fit together (labels, ports, volume, probes),
pass only flags foreshockd has, and the PrometheusRule carries exactly the rule
groups of deploy/prometheus/rules.yml (which promtool checks and unit-tests)."""
import glob
import os
import re
import subprocess
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K8S = os.path.join(ROOT, "deploy", "k8s")
FORESHOCKD = os.environ.get("FORESHOCKD", os.path.join(ROOT, "build", "server", "foreshockd"))
LABELS = {"app.kubernetes.io/name": "foreshock", "app.kubernetes.io/component": "foreshockd"}


def load_all():
    docs = {}
    for path in sorted(glob.glob(os.path.join(K8S, "*.yaml"))):
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if doc is None:
                    continue
                assert "apiVersion" in doc and "kind" in doc, path
                if doc["kind"] == "Kustomization":
                    docs[("Kustomization", os.path.basename(path))] = doc
                    continue
                name = doc["metadata"]["name"]
                assert (doc["kind"], name) not in docs, f"duplicate {doc['kind']}/{name}"
                docs[(doc["kind"], name)] = doc
    return docs


DOCS = load_all()


def one(kind):
    found = [doc for (k, _), doc in DOCS.items() if k == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def test_every_manifest_is_listed_in_the_kustomization():
    resources = one("Kustomization")["resources"]
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(K8S, "*.yaml"))
                   if os.path.basename(p) != "kustomization.yaml")
    assert sorted(resources) == files


def test_prometheusrule_groups_are_rules_yml():
    with open(os.path.join(ROOT, "deploy", "prometheus", "rules.yml")) as f:
        rules = yaml.safe_load(f)
    rule = one("PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"]["groups"] == rules["groups"]


def test_prometheusrule_is_up_to_date_with_its_generator():
    result = subprocess.run(
        [sys.executable, os.path.join(K8S, "generate_prometheusrule.py"), "--check"],
        capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_deployment_pvc_and_probes():
    deployment = one("Deployment")
    pvc = one("PersistentVolumeClaim")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    assert spec["selector"]["matchLabels"] == LABELS
    pod = spec["template"]["spec"]
    assert spec["template"]["metadata"]["labels"] == LABELS
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    args = container["args"]
    assert "--listen=0.0.0.0:50051" in args
    assert "--metrics_listen=0.0.0.0:9464" in args
    assert "--insecure=true" in args  # foreshockd refuses 0.0.0.0 without TLS and tokens otherwise
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": 50051, "metrics": 9464}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": 50051}, probe
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(container["resources"][kind]), kind
    # The data directory is the PVC.
    data_dir = next(a.split("=", 1)[1] for a in args if a.startswith("--data_dir="))
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts[data_dir]]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]


def test_deployment_flags_are_foreshockd_flags():
    assert os.path.exists(FORESHOCKD), f"{FORESHOCKD} not built"
    help_text = subprocess.run([FORESHOCKD, "--help"], capture_output=True, text=True).stdout
    known = set(re.findall(r"--([a-z_]+) \(", help_text))
    assert "data_dir" in known, help_text[:500]
    (container,) = one("Deployment")["spec"]["template"]["spec"]["containers"]
    for arg in container["args"]:
        name = re.match(r"--([a-z_]+)=", arg)
        assert name and name.group(1) in known, arg


def test_service_and_servicemonitor_select_the_pod():
    service = one("Service")
    # The Prometheus Operator's job label is the Service name; rules.yml
    # (ForeshockDaemonDown) and prometheus.yml use job="foreshock".
    assert service["metadata"]["name"] == "foreshock"
    assert service["spec"]["selector"] == LABELS
    ports = {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]}
    assert ports == {"grpc": (50051, "grpc"), "metrics": (9464, "metrics")}
    monitor = one("ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
