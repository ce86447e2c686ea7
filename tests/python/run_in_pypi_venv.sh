#!/usr/bin/env bash
# Runs a test with the PyPI venv's interpreter ($1), failing with a clear line
# when the venv has not been built (scripts/test builds it).
python="$1"; shift
if [ ! -x "$python" ]; then
  echo "no PyPI venv at ${python%/bin/python}: run scripts/test (or source scripts/setup.sh; foreshock_pypi_venv)" >&2
  exit 1
fi
# The tests must exercise the installed client, not the checkout's copy.
exec "$python" "$@"
