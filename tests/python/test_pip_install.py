"""`pip install ./client/python` works offline into a virtualenv that sees
Debian's grpcio/protobuf/numpy, and the installed package carries the
generated stubs (they are build outputs, not checked in)."""
import os
import shutil
import subprocess

from conftest import ROOT


def test_pip_install_from_a_clean_checkout(tmp_path):
    # A copy without previously generated stubs, laid out like the repository.
    checkout = tmp_path / "checkout"
    shutil.copytree(os.path.join(ROOT, "proto"), checkout / "proto")
    shutil.copytree(os.path.join(ROOT, "client", "python"), checkout / "client" / "python",
                    ignore=shutil.ignore_patterns("*_pb2.py", "*_pb2_grpc.py", "__pycache__",
                                                  "build", "*.egg-info"))
    venv = tmp_path / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", str(venv)],
                   check=True)
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "--no-index",
                          "--no-build-isolation", str(checkout / "client" / "python")],
                         capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    probe = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import foreshock, foreshock.v1.ingest_pb2, foreshock.v1.query_pb2_grpc;"
         "print(foreshock.__file__); print(foreshock.Monitor.__name__)"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert probe.returncode == 0, probe.stderr
    installed_at, name = probe.stdout.split()
    assert installed_at.startswith(str(venv)) and name == "Monitor"
