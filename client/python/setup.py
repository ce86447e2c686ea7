"""Foreshock Python client. The gRPC stubs are generated from proto/ at build time.

Install from a checkout: pip install ./client/python
"""
import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import generate_stubs  # noqa: E402  (lives next to this file)


class BuildPyWithStubs(build_py):
    """Generates foreshock/v1/*_pb2*.py before collecting the package files."""

    def run(self):
        generate_stubs.ensure()
        super().run()


setup(
    name="foreshock",
    version="0.1.0",
    description="Streams samples of model internals to foreshockd, the training-instability monitor",
    packages=["foreshock", "foreshock.v1", "foreshock.integrations"],
    python_requires=">=3.9",
    # torch is deliberately not listed: users bring their own build (CPU, CUDA, distro).
    install_requires=["grpcio>=1.46", "protobuf>=4.21", "numpy"],
    cmdclass={"build_py": BuildPyWithStubs},
)
