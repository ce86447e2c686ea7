"""The PyPI venv is what the other pypi_* tests claim it is: torch 2.x from
PyPI, and the client imported from `pip install ./client/python` (with
grpcio and protobuf from PyPI), not from the checkout or Debian."""
import os
import sys

import google.protobuf
import grpc
import torch

import foreshock
import foreshock.v1.ingest_pb2 as pb


def test_client_is_the_installed_package_with_pypi_dependencies():
    prefix = os.path.realpath(sys.prefix)
    assert prefix != os.path.realpath(sys.base_prefix), "not running in a venv"
    for module in (foreshock, pb, grpc, google.protobuf, torch):
        assert os.path.realpath(module.__file__).startswith(prefix), module.__file__
    assert int(torch.__version__.split(".")[0]) >= 2, torch.__version__
    assert not any(p.startswith("/usr/lib/python3/dist-packages") for p in sys.path)
    # The stubs built against Debian's protoc load under PyPI's protobuf runtime.
    hello = pb.Hello(run_id="r", rank=3)
    assert pb.Hello.FromString(hello.SerializeToString()).rank == 3
