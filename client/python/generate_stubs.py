"""Generates the Python gRPC stubs of the Foreshock wire contract.

The stubs (foreshock/v1/ingest_pb2*.py) are build outputs, never written by
hand: CMake generates them for the source tree, and setup.py calls this when
building a wheel from a checkout that has not been built with CMake.
"""
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_ROOT = os.path.normpath(os.path.join(HERE, "..", "..", "proto"))
PROTOS = ["foreshock/v1/ingest.proto", "foreshock/v1/query.proto"]
STUBS = [p[:-len(".proto")] + suffix for p in PROTOS for suffix in ("_pb2.py", "_pb2_grpc.py")]


def stubs_present(out_dir=HERE):
    return all(os.path.exists(os.path.join(out_dir, s)) for s in STUBS)


def generate(out_dir=HERE, proto_root=PROTO_ROOT):
    """Runs protoc with the gRPC Python plugin; raises with a clear message if it cannot."""
    protoc = shutil.which("protoc")
    plugin = shutil.which("grpc_python_plugin")
    if protoc is None or plugin is None:
        raise RuntimeError(
            "protoc and grpc_python_plugin are needed to generate the Foreshock stubs "
            "(Debian: apt-get install protobuf-compiler protobuf-compiler-grpc)")
    for proto in PROTOS:
        if not os.path.exists(os.path.join(proto_root, proto)):
            raise RuntimeError(f"{proto} not found under {proto_root}")
    subprocess.run(
        [protoc, f"--proto_path={proto_root}", f"--python_out={out_dir}",
         f"--grpc_out={out_dir}", f"--plugin=protoc-gen-grpc={plugin}", *PROTOS],
        check=True)


def ensure(out_dir=HERE):
    """Generates the stubs unless they are already there."""
    if not stubs_present(out_dir):
        generate(out_dir)


if __name__ == "__main__":
    generate()
    print("generated:", ", ".join(STUBS), file=sys.stderr)
