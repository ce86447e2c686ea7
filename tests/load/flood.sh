#!/bin/bash
# A probe flood against a bounded daemon (docs/PERFORMANCE.md#memory-under-a-probe-flood):
#   tests/load/flood.sh BUILD_DIR LIMIT_MB LOAD_ARGS...
# starts BUILD_DIR/server/foreshockd --max_memory_mb=LIMIT_MB (QUEUE_ARGS, default
# --max_queue_mb=16; DAEMON_ARGS, default --checkpoint_interval_s=1 --workers=2), runs
# BUILD_DIR/tests/load/foreshock_load with LOAD_ARGS, prints the report's memory and
# refusal figures, the daemon's RSS 3 s later and its memory log lines.
B=$1; LIMIT=$2; shift 2
D=$(mktemp -d /tmp/flood.XXXX)
port=$((52000 + RANDOM % 3000))
$B/server/foreshockd --listen=127.0.0.1:$port --metrics_listen=127.0.0.1:$((port+10000)) --data_dir=$D/data \
  --max_memory_mb=$LIMIT ${QUEUE_ARGS:---max_queue_mb=16} ${DAEMON_ARGS:---checkpoint_interval_s=1 --workers=2} > $D/log 2>&1 &
pid=$!
sleep 1.5
idle=$(grep VmRSS /proc/$pid/status | awk '{print $2}')
$B/tests/load/foreshock_load --target=127.0.0.1:$port --daemon_pid=$pid --json=$D/r.json "$@" > /dev/null 2>$D/err
echo "exit $? idle_kb=$idle"
python3 -c "
import json; r=json.load(open('$D/r.json'))
print({k:r[k] for k in ['daemon_vmhwm_mb','daemon_rss_mb_peak','rejected','stream_errors','scalars_acked','qk_acked','lost','verified','client_skipped_steps']})"
sleep 3
echo "after: $(grep VmRSS /proc/$pid/status)"
curl -s 127.0.0.1:$((port+10000))/metrics | grep -E "^foreshock_(memory|queue_bytes|ingest_rejected_total\{reason=\"memory)"
grep -E "memory|settled" $D/log | tail -5
kill $pid; wait $pid 2>/dev/null
echo $D
