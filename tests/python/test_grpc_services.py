"""The daemon's standard gRPC services: health (what Kubernetes probes use)
and reflection (what grpcurl uses), checked with stubs generated from
Debian's grpc-proto definitions."""
import importlib
import shutil
import subprocess
import sys

import grpc
import pytest

GRPC_PROTO = "/usr/share/grpc-proto"


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    # Generated under another Python package name: "grpc.health" would collide
    # with the grpc package itself. The proto packages (and service names) stay.
    out = tmp_path_factory.mktemp("grpc_stubs")
    package = out / "grpc_std"
    package.mkdir()
    for source in ("grpc/health/v1/health.proto", "grpc/reflection/v1alpha/reflection.proto"):
        shutil.copy(f"{GRPC_PROTO}/{source}", package / source.split("/")[-1])
    subprocess.run(["protoc", f"--proto_path={out}", f"--python_out={out}", f"--grpc_out={out}",
                    "--plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin",
                    "grpc_std/health.proto", "grpc_std/reflection.proto"], check=True)
    sys.path.insert(0, str(out))
    try:
        yield {name: importlib.import_module(f"grpc_std.{name}") for name in (
            "health_pb2", "health_pb2_grpc", "reflection_pb2", "reflection_pb2_grpc")}
    finally:
        sys.path.remove(str(out))


def test_health_service_reports_serving(foreshockd, stubs):
    health_pb2 = stubs["health_pb2"]
    health_grpc = stubs["health_pb2_grpc"]
    with grpc.insecure_channel(foreshockd.endpoint) as channel:
        reply = health_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_ingest_service(foreshockd, stubs):
    reflection_pb2 = stubs["reflection_pb2"]
    reflection_grpc = stubs["reflection_pb2_grpc"]
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    with grpc.insecure_channel(foreshockd.endpoint) as channel:
        stub = reflection_grpc.ServerReflectionStub(channel)
        (reply,) = list(stub.ServerReflectionInfo(iter([request]), timeout=5))
    names = {s.name for s in reply.list_services_response.service}
    assert "foreshock.v1.Ingest" in names and "grpc.health.v1.Health" in names, names
