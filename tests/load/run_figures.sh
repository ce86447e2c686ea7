#!/bin/bash
# The "Ingest under load" figures in docs/PERFORMANCE.md: three 60-second runs
# of 256 streams, each against a fresh foreshockd with its own data dir.
#   tests/load/run_figures.sh [OUT_DIR]      (after scripts/setup.sh; ~4 minutes)
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
B=${FORESHOCK_BUILD:-$ROOT/build}
OUT=${1:-/tmp/foreshock-load}
rm -rf "$OUT"; mkdir -p "$OUT"
run() {  # NAME DAEMON_FLAGS... -- LOAD_FLAGS...
  local name=$1; shift
  local dflags=(); while [ "$1" != "--" ]; do dflags+=("$1"); shift; done; shift
  local port=$((50100 + RANDOM % 5000))
  "$B/server/foreshockd" --listen=127.0.0.1:$port --metrics_listen=127.0.0.1:$((port + 10000)) \
      --data_dir="$OUT/$name.data" "${dflags[@]}" > "$OUT/$name.daemon.log" 2>&1 &
  local pid=$!
  sleep 2
  "$B/tests/load/foreshock_load" --target=127.0.0.1:$port --daemon_pid=$pid \
      --json="$OUT/$name.json" "$@" > /dev/null 2> "$OUT/$name.err"
  echo "$name: exit $?"
  curl -s 127.0.0.1:$((port + 10000))/metrics \
      | grep -E '^foreshock_(ingest_rejected_total|memory_)' > "$OUT/$name.metrics"
  kill $pid; wait $pid
}
run realistic -- --duration_s=60
run heavy -- --duration_s=60 --steps_per_s=10
run heavy_bounded --max_memory_mb=600 -- --duration_s=60 --steps_per_s=10 --drain_timeout_s=30
echo "reports: $OUT/*.json"
