#!/usr/bin/env bash
# `scripts/package --wheel` builds the Python client's wheel offline, and the
# wheel carries the package, the generated gRPC stubs and the version of setup.py.
#   wheel.sh OUT_DIR
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out=$1
rm -rf "$out"
FORESHOCK_PACKAGE_OUT="$out" "$root/scripts/package" --wheel
version=$(sed -n 's/^ *version="\(.*\)",$/\1/p' "$root/client/python/setup.py")
wheel="$out/foreshock-${version}-py3-none-any.whl"
[ -f "$wheel" ] || { echo "FAIL: no $wheel" >&2; ls -l "$out" >&2; exit 1; }
/usr/bin/python3 - "$wheel" <<'PY'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
want = {"foreshock/__init__.py", "foreshock/monitor.py", "foreshock/sender.py",
        "foreshock/v1/ingest_pb2.py", "foreshock/v1/ingest_pb2_grpc.py",
        "foreshock/v1/query_pb2.py", "foreshock/v1/query_pb2_grpc.py"}
missing = want - names
assert not missing, f"missing from the wheel: {sorted(missing)}"
print(f"{sys.argv[1]}: {len(names)} files")
PY
