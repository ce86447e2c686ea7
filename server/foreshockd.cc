// foreshockd: the Foreshock sidecar. Training ranks stream samples over gRPC;
// detectors run on worker threads; signals are exported to Prometheus.
#include <malloc.h>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <pthread.h>
#include <thread>

#include <spdlog/spdlog.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "server/alerting/alertmanager_url.h"
#include "server/daemon.h"
#include "server/security/listen_address.h"
#include "server/security/secret_file.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "HOST:PORT for the gRPC ingest service (foreshock.v1.Ingest), the gRPC health "
          "service and reflection, or a comma-separated list of them; IPv6 as [ADDRESS]:PORT, "
          "or unix:PATH for a Unix socket. Port 0 picks a free port (the first address's is "
          "logged at start). A malformed list (an empty element, a missing or bad port, junk) "
          "is refused at start (exit 2), as is any non-loopback address without TLS and "
          "tokens (see --insecure).");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9464",
          "HOST:PORT for HTTP: Prometheus exposition at /metrics, a liveness probe at "
          "/-/healthy, the JSON API under /api/v1/ and the web UI at /; or a comma-separated "
          "list of them, IPv6 as [ADDRESS]:PORT. With --tls_cert every address speaks HTTPS "
          "only (with client certificates under --tls_client_ca). Port 0 picks a free port "
          "(the first address's is logged at start). Refused at start (exit 2) like --listen.");
ABSL_FLAG(int32_t, http_threads, 32,
          "Worker threads of the HTTP port (--metrics_listen). An open connection holds one "
          "from when a worker takes it until it is closed (one request per connection: no "
          "keep-alive); further connections wait in a queue. Idle or slow connections from "
          "fewer than --http_threads / --http_max_connections_per_ip client addresses cannot "
          "keep /metrics, /-/healthy and the API from answering.");
ABSL_FLAG(int32_t, http_request_timeout_ms, 5000,
          "How long an HTTP connection may take to send its complete request (however slowly "
          "it trickles in); then it is closed and its worker thread freed.");
ABSL_FLAG(int32_t, http_max_connections_per_ip, 8,
          "HTTP connections one client address may hold at once. A further one is answered "
          "503 and closed before its request is read, and counted in "
          "foreshock_http_connections_refused_total, so that one address cannot take every "
          "--http_threads worker. Clients behind one proxy or NAT share an address. 0: no "
          "limit.");
ABSL_FLAG(int, workers, 0,
          "Detector worker threads. Samples are sharded by (run, layer), so each series is "
          "processed in order by one worker. 0 means one per CPU core.");
ABSL_FLAG(bool, per_head_metrics, false,
          "Also export per-head values with a `head` label. Per-layer values (aggregated over "
          "heads: min for entropies, max for logits and shares) are always exported. Per-head "
          "series multiply Prometheus cardinality by the head count.");
ABSL_FLAG(int64_t, max_metrics_series, 50000,
          "Most detector signal series (foreshock_<signal>{run, layer, head, ...}) that "
          "/metrics exports, over all runs, so that a scrape stays small and fast however many "
          "runs and layers arrive (about 75 bytes and 3 us of scrape time per series). New "
          "series past it are still stored, alerted on and shown by the Query API and the web "
          "UI, but not exported; they are counted in foreshock_metrics_series_dropped_total, "
          "and foreshock_metrics_signal_series says how many exist. Series already exported "
          "keep updating. 0: no bound.");
ABSL_FLAG(int64_t, series_capacity, 4096,
          "Without --data_dir: the points kept in memory per (run, signal, layer, head) series "
          "(older points are overwritten).");
ABSL_FLAG(int64_t, series_cache_points, 256,
          "With --data_dir: the newest points of each series kept in memory for fast reads "
          "(about 32 bytes each); older points are read back from the segment files.");
ABSL_FLAG(int64_t, max_tokens, 4096,
          "Largest probe token count accepted in a QK or router sample; larger samples are "
          "rejected with reason shape_over_limit.");
ABSL_FLAG(int64_t, max_head_dim, 256,
          "Largest head_dim accepted in a QK sample (reason shape_over_limit above it).");
ABSL_FLAG(int64_t, max_heads, 256,
          "Largest head count accepted in a QK sample (reason shape_over_limit above it).");
ABSL_FLAG(int64_t, max_layers, 1024,
          "Largest layer count a Hello may declare; layers are checked against n_layers from "
          "the Hello, or against this limit when the Hello does not say: a QK or router layer "
          "outside [0, n_layers) is rejected with reason layer_out_of_range, a curvature "
          "sample with more layer_rayleigh values than n_layers with reason too_many_layers, "
          "and a Hello whose moe_layers are more than n_layers or out of range with bad_hello. "
          "So every per-layer series of a run has a layer below n_layers.");
ABSL_FLAG(int64_t, max_experts, 1024,
          "Largest expert count accepted in a router sample (reason shape_over_limit above "
          "it).");
ABSL_FLAG(int64_t, max_queue_mb, 256,
          "Memory bound, in MiB, for accepted samples waiting for a worker. At the bound, "
          "streams stop reading and gRPC flow control slows the senders.");
ABSL_FLAG(int64_t, max_tensor_elements, int64_t{1} << 24,
          "Largest element count of one tensor in a record (q, k, router logits; the "
          "values of a curvature sample's layer_rayleigh); larger records are rejected with "
          "reason tensor_too_large. Together with the shape limits it bounds what one record "
          "costs to process.");
ABSL_FLAG(int64_t, max_streams, 1024,
          "Ingest streams open at once. A stream beyond it ends at once with "
          "RESOURCE_EXHAUSTED (\"too_many_streams: ... retry after 1000 ms\", trailing "
          "metadata retry-after-ms) and counts in "
          "foreshock_ingest_rejected_total{reason=\"too_many_streams\"}. 0: no limit.");
ABSL_FLAG(int64_t, max_runs, 1000,
          "Distinct runs (Hello run_id) the daemon serves, counting those recovered from "
          "--data_dir. A Hello for a new run beyond it ends its stream with "
          "RESOURCE_EXHAUSTED (reason too_many_runs, counted, retry-after-ms); Hellos for "
          "runs that still count are always admitted. A run with no open stream stops "
          "counting after --empty_run_release_s if it never stored a sample, else once it is "
          "forgotten (--forget_runs_idle_s), so a long-lived daemon keeps admitting new runs "
          "as old ones finish. Shared per tenant: see --max_runs_per_tenant. 0: no limit.");
ABSL_FLAG(int64_t, max_runs_per_tenant, -1,
          "Runs one tenant may have counting toward --max_runs at once, so that no tenant can "
          "make another's new run fail. With --token_file a tenant is a token; without it, the "
          "Hello's job (runs recovered from --data_dir count for their job; with tokens, in "
          "the total only). A new run beyond it ends its stream with RESOURCE_EXHAUSTED "
          "(\"too_many_runs_for_tenant: ...\", retry-after-ms), counted in "
          "foreshock_ingest_rejected_total{reason=\"too_many_runs_for_tenant\"}. -1: a quarter "
          "of --max_runs, at least 1 (250 with the default --max_runs). 0: no per-tenant limit.");
ABSL_FLAG(int64_t, empty_run_release_s, 120,
          "A run that has stored no sample and has no stream open stops counting toward "
          "--max_runs and its tenant's share after this many seconds, so that Hellos that "
          "send nothing cannot hold run slots. Runs with samples stop counting once they are "
          "forgotten (--forget_runs_idle_s).");
ABSL_FLAG(int64_t, forget_runs_idle_s, 86400,
          "A run with no stream open and nothing sent (no Hello, record or goodbye) for this "
          "many seconds, ended or not, is forgotten: its detector state, alert baselines, "
          "series count and /metrics series (signals, run_info, last_step, "
          "nonfinite_values_total, alert_active) are dropped, it stops counting toward "
          "--max_runs, and alerts still open resolve with resolved_reason run_idle. Its stored "
          "points, alert records (ListAlerts, the UI) and ListRuns entry stay; a later stream "
          "of it continues as a new attempt or a reconnect and learns its baselines afresh. "
          "Counted in foreshock_runs_forgotten_total. Runs recovered from --data_dir count "
          "from their end, or from the restart. Must be at least 1 (a daemon that never "
          "forgets grows with every run it sees): use a large value to keep runs longer.");
ABSL_FLAG(int64_t, max_ranks_per_run, 65536,
          "Ranks one run may have. A Hello whose world_size label is above it is refused "
          "(INVALID_ARGUMENT world_size_over_limit), and a Hello's rank must be in "
          "[0, world_size), or [0, this) without the label (INVALID_ARGUMENT bad_rank); both "
          "counted in foreshock_ingest_rejected_total. A run ends once world_size ranks said "
          "goodbye, so this also bounds how long one Hello can keep a run open. 0: only the "
          "label's own range (at most 2^20).");
ABSL_FLAG(int64_t, rank_takeover_grace_ms, 60000,
          "A rank of a run belongs to the live ingest stream that holds it. A Hello for it from "
          "another sender (another Hello.sender_id, or another token) is refused with "
          "ALREADY_EXISTS (\"rank_in_use: ...\", retry-after-ms, counted in "
          "foreshock_ingest_rejected_total{reason=\"rank_in_use\"}) while the holder's stream "
          "is open and has been active (a message, an Ack, a batch in process) within this many "
          "milliseconds; past it the holder counts as gone (a host that vanished without closing "
          "its connection) and the new sender takes the rank over. The holder's own reconnect "
          "(same sender_id) always takes its rank over. Clients retry after the hint.");
ABSL_FLAG(int64_t, max_series_per_run, 100000,
          "Distinct (signal, layer, head) series one run may create, the cardinality guard "
          "for Prometheus, the store and the alert engine. Observations that would open a "
          "further series are dropped (not exported, stored or alerted on), counted in "
          "foreshock_series_limited_total and logged once per run. 0: no limit.");
ABSL_FLAG(int64_t, max_message_mb, 64,
          "Largest ingest message (one Batch) accepted, in MiB. A larger one ends its stream "
          "with RESOURCE_EXHAUSTED (\"message_too_large: ...\") and counts in "
          "foreshock_ingest_rejected_total{reason=\"message_too_large\"}; the batches acked "
          "before it stay stored. gRPC's transport refuses messages over twice this before "
          "they are read (RESOURCE_EXHAUSTED, not counted). Also the limit for Query requests.");
ABSL_FLAG(int64_t, max_records_per_batch, 262144,
          "Records one ingest Batch may carry. A batch with more is not parsed (in memory a "
          "record costs some 50 bytes, an empty one only 2 on the wire, so a 10 MB batch of "
          "empty records would parse into hundreds of MB): every one of its records is "
          "rejected in the Ack with reason too_many_records (counted in "
          "foreshock_ingest_rejected_total{reason=\"too_many_records\"}) and the stream goes "
          "on. The Python and C++ clients send batches of at most 1 MiB, far below it. An Ack "
          "lists at most 256 rejections whatever the batch; the rest are counted in its "
          "omitted_rejections and omitted_by_reason. 0: no limit.");
ABSL_FLAG(int64_t, grpc_stream_window_kb, 1024,
          "HTTP/2 receive window of each gRPC stream, in KiB, with gRPC's BDP probing off: "
          "how much of a message the transport buffers for a stream before the daemon asks "
          "for it. By default gRPC grows the windows by bandwidth-delay probing to many MiB "
          "per stream, and under CPU contention a client that keeps many batches in flight "
          "fills them: memory that --max_memory_mb cannot refuse (a flood of 8 MiB batches "
          "from 4 streams peaked at 1.5x the bound with it, 1.1-1.3x without). 1024 KiB "
          "still moves about 10 GB/s per stream at a 0.1 ms round trip and 100 MB/s at "
          "10 ms. 0: gRPC's defaults (BDP probing on).");
ABSL_FLAG(int64_t, max_probe_ids_per_run, 64,
          "Distinct probe_ids (QK and router samples) one run may use since the daemon started; "
          "the detectors keep the previous sample per (run, layer, probe_id), so this bounds "
          "their state. Records with a further new probe_id are rejected with reason "
          "too_many_probe_ids. 0: no limit.");
ABSL_FLAG(int64_t, hello_timeout_ms, 10000,
          "An ingest stream whose first message (the Hello) has not arrived this long after it "
          "opened ends with DEADLINE_EXCEEDED (\"hello_timeout: ...\", counted in "
          "foreshock_ingest_rejected_total{reason=\"hello_timeout\"}), so that connections that "
          "never speak do not hold --max_streams slots. 0: no timeout.");
ABSL_FLAG(int64_t, stream_idle_timeout_ms, 300000,
          "An ingest stream that has sent its Hello and then no message for this long, while "
          "nothing of it is in progress (no batch waiting for the queue or being processed; the "
          "time counts from the last message or Ack), ends with DEADLINE_EXCEEDED "
          "(\"stream_idle_timeout: ...\", counted in "
          "foreshock_ingest_rejected_total{reason=\"stream_idle_timeout\"}), so that streams "
          "that say Hello and then nothing do not hold --max_streams slots for ever. HTTP/2 "
          "keepalive pings are not messages. Nothing is lost: every batch of such a stream was "
          "acknowledged, and a batch that crosses the end is not acked, so the client still has "
          "it. Clients that are alive but have nothing to send should open a new stream (and "
          "resend their unacknowledged batches) when they next have data, as the Python and C++ "
          "clients do, or send a Batch (an empty one is acked too) within the timeout. 0: no "
          "timeout.");
ABSL_FLAG(int64_t, max_streams_per_tenant, -1,
          "Ingest streams one tenant may hold open at once, so that no tenant can take every "
          "--max_streams slot. With --token_file a tenant is a token, counted when the stream "
          "opens (before its Hello); without it, a run_id, counted at the Hello. A stream "
          "beyond it ends with RESOURCE_EXHAUSTED (\"too_many_streams_for_tenant: ... retry "
          "after 1000 ms\", trailing metadata retry-after-ms), counted in "
          "foreshock_ingest_rejected_total{reason=\"too_many_streams_for_tenant\"}; the "
          "clients retry after the hint. A job whose ranks share one token (or one run) and "
          "that sends more streams than this to one daemon needs a higher value. -1: a quarter "
          "of --max_streams, at least 64 (256 with the default --max_streams). 0: no limit.");
ABSL_FLAG(int64_t, max_step_jump, 100000000,
          "A record whose step is more than this beyond the highest step accepted for its run "
          "(0 before the run's first; after a restart, the last step in --data_dir) is "
          "rejected with reason step_out_of_range, so that one corrupt step (2^63-1, a "
          "timestamp, a token count) cannot become the run's last step and make every real "
          "later step stale. Steps may still go back (a run resumed from a checkpoint). Real "
          "training runs take far fewer than 10^8 steps; raise it if yours counts steps "
          "otherwise. 0: no bound.");
ABSL_FLAG(int64_t, max_memory_mb, -1,
          "Resident memory, in MiB, at which the daemon refuses probes: QK and router records, "
          "and curvature records that carry per-layer values (layer_rayleigh: a series each), "
          "are rejected in the Ack with reason memory_limit (counted in "
          "foreshock_ingest_rejected_total{reason=\"memory_limit\"}), while step scalars, "
          "curvature records without per-layer values, and new streams, are still accepted. "
          "Probes are accepted again "
          "once memory falls below 90% of the bound, or once nothing is queued and memory has "
          "stopped falling for a second (what stays is retained detector state, which refusing "
          "cannot free). Data already accepted is processed and stored. Set it below the "
          "container's or unit's memory limit. -1: 85% of the cgroup memory limit when there "
          "is one, else half of the machine's memory. 0: no bound.");
ABSL_FLAG(int64_t, max_state_mb_per_run, -1,
          "Detector state, in MiB, that one run's probes may keep in the daemon: the QK "
          "detector keeps the previous Q and K of every (layer, probe_id, head) for the next "
          "increment, the router detector the previous routing and a window of expert loads, "
          "for as long as the run lives; a curvature record's per-layer values (layer_rayleigh) "
          "count 8 KiB each, the series each of them opens. A QK, router or curvature record "
          "that would grow its run's state "
          "past this (a new layer, probe_id or head, or a larger shape; more per-layer values) "
          "is rejected in the Ack "
          "with reason state_limit (counted in foreshock_ingest_rejected_total{reason="
          "\"state_limit\"}); records that replace state of the same shape, step scalars and "
          "curvature records without per-layer values are still accepted, and other runs are "
          "not affected. The state "
          "is freed when the run ends or starts a new attempt; foreshock_run_state_bytes{run} "
          "shows it. -1: a quarter of --max_memory_mb, so that one run cannot hold the daemon "
          "at its memory bound and starve the other runs' probes (no bound when "
          "--max_memory_mb is 0). 0: no bound.");
ABSL_FLAG(int64_t, max_alert_episodes, -1,
          "Closed alert episodes the daemon keeps over all runs, for the record of what fired "
          "(ListAlerts with include_resolved, /api/v1/alerts?include_resolved=1, foreshockctl "
          "alerts --all, the web UI): about 1 KiB each, and fed by step scalars, which "
          "--max_memory_mb never refuses, so a run whose alerts flap could otherwise grow "
          "memory past it. Each run keeps at most 4,096. Past this bound the run that keeps "
          "the most drops its oldest episode that never fired (else its oldest), so one "
          "flapping run pays for itself and other runs keep theirs; dropped episodes count in "
          "foreshock_alert_episodes_dropped_total and foreshock_alert_episodes_kept shows the "
          "total. Open episodes are never dropped. -1: one KiB per episode in a sixteenth of "
          "--max_memory_mb, at least 4,096 (1,048,576 when --max_memory_mb is 0). 0: no bound "
          "beyond the per-run one.");
ABSL_FLAG(int64_t, max_query_mb, 64,
          "Memory, in MiB, one query answer may take (GetSeries over gRPC, /api/v1/points): "
          "the points read from the store and the answer encoded, about 220 bytes a raw point "
          "and 320 a downsampled bucket. A larger answer is refused with RESOURCE_EXHAUSTED "
          "(HTTP 413) and a message that says how to page through the range (the from_step "
          "and to_step of the first page, and where the next begins) or to downsample it "
          "(max_points); counted in foreshock_query_refused_total{reason=\"too_large\"}. "
          "64 MiB is about 300k raw points. 0: no limit.");
ABSL_FLAG(int64_t, max_query_total_mb, -1,
          "Memory, in MiB, all query answers in progress may take together: a request that "
          "does not fit beside the others now is refused with UNAVAILABLE (HTTP 503, trailing "
          "metadata retry-after-ms over gRPC), counted in "
          "foreshock_query_refused_total{reason=\"busy\"}; retry it. A request larger than "
          "the whole budget is refused as too_large. foreshock_query_bytes shows what is "
          "taken. -1: a quarter of --max_memory_mb, at least --max_query_mb (--max_query_mb "
          "when --max_memory_mb is 0). 0: no bound.");
ABSL_FLAG(int64_t, shutdown_grace_ms, 5000,
          "On SIGTERM or SIGINT, how long open streams may stay open before they are "
          "cancelled. Everything already accepted is processed before exit.");
ABSL_FLAG(std::string, config, "",
          "YAML file with the alert engine's per-signal thresholds, windows and persistence "
          "(see deploy/foreshock.yaml for every key and its default). Empty: the built-in "
          "defaults.");
ABSL_FLAG(std::string, alertmanager_url, "",
          "Base URL of an Alertmanager (e.g. http://127.0.0.1:9093). Alerts are POSTed to "
          "<url>/api/v2/alerts, re-sent while they fire, sent with endsAt when they resolve, "
          "and retried with backoff while Alertmanager is unreachable. http:// or https://, "
          "a host, an optional port and path; user:password@ before the host is sent as basic "
          "auth and is never logged (logs show ***@). A malformed URL (another scheme, no "
          "host, a bad port, a query, whitespace) is refused at start (exit 2). Empty: no "
          "delivery (alerts still reach WatchAlerts and foreshock_alert_active).");
ABSL_FLAG(int64_t, alertmanager_resend_s, 60,
          "Seconds between re-sends of firing alerts to Alertmanager.");
ABSL_FLAG(std::string, record_dir, "",
          "Directory in which to record every ingest stream as received, for replay with "
          "`foreshockctl replay`: one file per stream, named "
          "<UTC yyyymmddThhmmss>-<run>-rank<rank>-<session>.fsrec, holding each StreamRequest "
          "(Hello and Batches, including ones that are then rejected) with its receive time. "
          "The directory is created if missing. Recording never fails or slows a stream: when "
          "the disk cannot keep up or a write fails, frames are dropped, logged once per stream "
          "and counted in foreshock_record_frames_total{outcome=\"dropped\"}. Empty: no "
          "recording. Bounded by --record_max_mb and --record_max_age_h.");
ABSL_FLAG(int64_t, record_max_mb, 10240,
          "At most this many MiB of recordings (*.fsrec) in --record_dir, those there at start "
          "included. Closed recordings are deleted oldest first to make room "
          "(foreshock_record_files_deleted_total{reason=\"size\"}); an open recording (a live "
          "stream) is never deleted: when only open ones are left, further messages are not "
          "recorded (counted as dropped, logged once per stream) and each file stays a complete "
          "prefix of its stream. foreshock_record_bytes says how much the directory holds. "
          "0: no bound.");
ABSL_FLAG(int64_t, record_max_age_h, 168,
          "Closed recordings in --record_dir older than this many hours (by modification time) "
          "are deleted, checked every 10 s (foreshock_record_files_deleted_total"
          "{reason=\"age\"}). 0: kept until --record_max_mb needs the room.");
ABSL_FLAG(std::string, data_dir, "./foreshock-data",
          "Directory of the durable series store: every signal value of every step, alert "
          "transitions, run Hellos and the detector/alert-engine checkpoints, in an append-only "
          "log of checksummed segments. On start the daemon recovers it (a torn tail is cut, "
          "corrupt records are reported and skipped) and continues detection from the last "
          "checkpoint. One daemon per directory (it is locked). Empty: keep series in memory "
          "only (--series_capacity points each), lost on restart.");
ABSL_FLAG(std::string, fsync, "interval",
          "When appended data is fsync'ed: 'every' (before each sample's points are "
          "acknowledged as stored; safest, slowest), 'interval' (every --fsync_interval_ms; a "
          "machine crash loses at most that much), 'none' (only when a segment is sealed and "
          "at shutdown; a daemon crash alone loses nothing, the kernel still has the data).");
ABSL_FLAG(int64_t, fsync_interval_ms, 1000, "Milliseconds between fsyncs with --fsync=interval.");
ABSL_FLAG(int64_t, segment_mb, 64, "Size in MiB at which the store starts a new segment file.");
ABSL_FLAG(double, retention_max_age_h, 720,
          "Delete whole segments whose newest point is older than this many hours (the segment "
          "being written is never deleted). 0: no age limit.");
ABSL_FLAG(double, retention_max_gb, 10,
          "Delete the oldest segments while the store holds more than this many GiB. 0: no "
          "size limit.");
ABSL_FLAG(int64_t, checkpoint_interval_s, 30,
          "Seconds between checkpoints of the detector and alert-engine state (previous probe "
          "samples, baselines, alert lifecycles) into the data directory; also written at a "
          "clean shutdown. The detector state is streamed to the file as it is serialized, so "
          "a checkpoint does not copy it in memory. 0: only at shutdown.");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate (chain) of the daemon: with --tls_key, the gRPC port speaks TLS only "
          "and the HTTP port (--metrics_listen) HTTPS only, both TLS 1.2 or later. Empty: "
          "plaintext gRPC and HTTP.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: with it, every gRPC and HTTPS client (trainers, foreshockctl, "
          "Prometheus, browsers) must present a certificate signed by one of these CAs (mutual "
          "TLS). Needs --tls_cert.");
ABSL_FLAG(std::string, token_file, "",
          "File of bearer tokens, one grant per line: '<token> <run-prefix>[,...] "
          "<right>[,...]' with rights ingest, query, metrics ('*' as the prefix: every run; "
          "/metrics needs a '*' grant with the metrics right). Clients send "
          "'authorization: Bearer <token>'. The file must be the daemon's alone (chmod 600; "
          "group read is accepted when the group is one of the daemon's own, as a Kubernetes "
          "Secret with fsGroup, mode 0440): one that others may read or write, its group may "
          "write, or another group may read is refused at start (exit 2) unless "
          "--allow_insecure_token_file. Empty: no authorization, and the daemon only listens "
          "on loopback (unless --insecure).");
ABSL_FLAG(bool, allow_insecure_token_file, false,
          "Accept a --token_file that other users may read or write, its group may write, or a "
          "group that is not the daemon's may read (anyone who can read it holds every grant "
          "in it; anyone who can write it can add one), with a warning at start. Without it "
          "such a file is refused (exit 2). Use it only where the mode cannot be changed; "
          "prefer chmod 600.");
ABSL_FLAG(bool, insecure, false,
          "Allow --listen or --metrics_listen on a non-loopback address without both TLS "
          "(--tls_cert) and tokens (--token_file), e.g. inside a cluster network that is "
          "protected otherwise. Without it such a start is refused (exit 2). Checked per "
          "address of each comma list; loopback is 127.0.0.0/8, [::1], localhost and unix:. "
          "It never turns TLS off for some addresses: with --tls_cert every address of both "
          "flags speaks TLS.");
ABSL_FLAG(std::string, log_level, "info", "Log level: trace, debug, info, warn, error, off.");

namespace {

// The listeners, HTTP, workers, metrics, ingest limits and memory bounds.
void ApplyLimitFlags(foreshock::server::DaemonOptions& options) {
  options.listen = absl::GetFlag(FLAGS_listen);
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  options.http_limits.threads = std::clamp(absl::GetFlag(FLAGS_http_threads), 1, 4096);
  options.http_limits.request_timeout_ms =
      std::max(1, absl::GetFlag(FLAGS_http_request_timeout_ms));
  options.http_limits.max_connections_per_ip =
      std::max(0, absl::GetFlag(FLAGS_http_max_connections_per_ip));
  options.workers = absl::GetFlag(FLAGS_workers);
  options.per_head_metrics = absl::GetFlag(FLAGS_per_head_metrics);
  options.max_metrics_series = std::max<int64_t>(0, absl::GetFlag(FLAGS_max_metrics_series));
  options.series_capacity = static_cast<size_t>(std::max<int64_t>(1, absl::GetFlag(FLAGS_series_capacity)));
  options.limits.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  options.limits.max_head_dim = absl::GetFlag(FLAGS_max_head_dim);
  options.limits.max_heads = absl::GetFlag(FLAGS_max_heads);
  options.limits.max_layers = absl::GetFlag(FLAGS_max_layers);
  options.limits.max_experts = absl::GetFlag(FLAGS_max_experts);
  options.limits.max_tensor_elements = std::max<int64_t>(1, absl::GetFlag(FLAGS_max_tensor_elements));
  options.limits.max_streams = std::max<int64_t>(0, absl::GetFlag(FLAGS_max_streams));
  options.limits.max_runs = std::max<int64_t>(0, absl::GetFlag(FLAGS_max_runs));
  options.limits.max_probe_ids_per_run =
      std::max<int64_t>(0, absl::GetFlag(FLAGS_max_probe_ids_per_run));
  options.limits.hello_timeout =
      std::chrono::milliseconds(std::max<int64_t>(0, absl::GetFlag(FLAGS_hello_timeout_ms)));
  options.limits.stream_idle_timeout =
      std::chrono::milliseconds(std::max<int64_t>(0, absl::GetFlag(FLAGS_stream_idle_timeout_ms)));
  options.limits.max_streams_per_tenant =
      std::max<int64_t>(-1, absl::GetFlag(FLAGS_max_streams_per_tenant));
  options.limits.max_step_jump = std::max<int64_t>(0, absl::GetFlag(FLAGS_max_step_jump));
  options.limits.max_runs_per_tenant =
      std::max<int64_t>(-1, absl::GetFlag(FLAGS_max_runs_per_tenant));
  options.limits.empty_run_release =
      std::chrono::seconds(std::max<int64_t>(0, absl::GetFlag(FLAGS_empty_run_release_s)));
  options.limits.max_ranks_per_run = std::max<int64_t>(0, absl::GetFlag(FLAGS_max_ranks_per_run));
  options.limits.rank_takeover_grace =
      std::chrono::milliseconds(std::max<int64_t>(0, absl::GetFlag(FLAGS_rank_takeover_grace_ms)));
  options.limits.max_records_per_batch =
      std::max<int64_t>(0, absl::GetFlag(FLAGS_max_records_per_batch));
  options.max_series_per_run = std::max<int64_t>(0, absl::GetFlag(FLAGS_max_series_per_run));
  options.max_queue_bytes = static_cast<size_t>(std::max<int64_t>(1, absl::GetFlag(FLAGS_max_queue_mb))) << 20;
  if (const int64_t mb = absl::GetFlag(FLAGS_max_memory_mb); mb >= 0) {
    options.max_memory_bytes = mb << 20;
  } else {
    options.max_memory_bytes = foreshock::server::MemoryGuard::DefaultLimitBytes();
  }
  if (const int64_t mb = absl::GetFlag(FLAGS_max_state_mb_per_run); mb >= 0) {
    options.max_state_bytes_per_run = mb << 20;
  } else {
    options.max_state_bytes_per_run = options.max_memory_bytes / 4;
  }
  if (const int64_t episodes = absl::GetFlag(FLAGS_max_alert_episodes); episodes >= 0) {
    options.max_alert_episodes = episodes;
  } else {
    options.max_alert_episodes =
        options.max_memory_bytes > 0
            ? std::max<int64_t>(4096, options.max_memory_bytes / 16 / 1024)
            : int64_t{1} << 20;
  }
  options.max_query_bytes = std::max<int64_t>(0, absl::GetFlag(FLAGS_max_query_mb)) << 20;
  if (const int64_t mb = absl::GetFlag(FLAGS_max_query_total_mb); mb >= 0) {
    options.max_query_total_bytes = mb << 20;
  } else {
    options.max_query_total_bytes =
        std::max(options.max_memory_bytes / 4, options.max_query_bytes);
  }
  options.max_message_bytes = static_cast<int>(std::clamp<int64_t>(absl::GetFlag(FLAGS_max_message_mb), 1, 2047)) << 20;
  options.grpc_stream_window_bytes =
      static_cast<int>(std::clamp<int64_t>(absl::GetFlag(FLAGS_grpc_stream_window_kb), 0, 1 << 20)) << 10;
}

// Recording, the store and checkpoints; false (after logging why) on a bad value.
bool ApplyStoreFlags(foreshock::server::DaemonOptions& options) {
  options.record_dir = absl::GetFlag(FLAGS_record_dir);
  options.record_max_bytes = static_cast<uint64_t>(std::max<int64_t>(0, absl::GetFlag(FLAGS_record_max_mb))) << 20;
  options.record_max_age = std::chrono::hours(std::max<int64_t>(0, absl::GetFlag(FLAGS_record_max_age_h)));
  options.store_options.data_dir = absl::GetFlag(FLAGS_data_dir);
  options.store_options.cache_points_per_series =
      static_cast<size_t>(std::max<int64_t>(1, absl::GetFlag(FLAGS_series_cache_points)));
  if (auto policy = foreshock::store::ParseFsyncPolicy(absl::GetFlag(FLAGS_fsync))) {
    options.store_options.fsync = *policy;
  } else {
    spdlog::critical("--fsync={}: must be every, interval or none", absl::GetFlag(FLAGS_fsync));
    return false;
  }
  options.store_options.fsync_interval =
      std::chrono::milliseconds(std::max<int64_t>(1, absl::GetFlag(FLAGS_fsync_interval_ms)));
  options.store_options.segment_bytes =
      static_cast<uint64_t>(std::clamp<int64_t>(absl::GetFlag(FLAGS_segment_mb), 1, 1 << 20)) << 20;
  options.store_options.retention_max_age = std::chrono::milliseconds(
      static_cast<int64_t>(std::max(0.0, absl::GetFlag(FLAGS_retention_max_age_h)) * 3600e3));
  options.store_options.retention_max_bytes = static_cast<uint64_t>(
      std::max(0.0, absl::GetFlag(FLAGS_retention_max_gb)) * double(uint64_t{1} << 30));
  options.checkpoint_interval =
      std::chrono::seconds(std::max<int64_t>(0, absl::GetFlag(FLAGS_checkpoint_interval_s)));
  const int64_t forget_s = absl::GetFlag(FLAGS_forget_runs_idle_s);
  if (forget_s < 1 || forget_s > int64_t{100} * 365 * 86400) {
    spdlog::critical("--forget_runs_idle_s={}: must be between 1 and 100 years of seconds "
                     "(a daemon that never forgets a run grows with every run it sees)",
                     forget_s);
    return false;
  }
  options.forget_runs_idle = std::chrono::seconds(forget_s);
  return true;
}

// Alertmanager and the alert configuration; false (after logging why) on a bad one.
bool ApplyAlertingFlags(foreshock::server::DaemonOptions& options) {
  if (const std::string url = absl::GetFlag(FLAGS_alertmanager_url); !url.empty()) {
    auto parsed = foreshock::server::ParseAlertmanagerUrl(url);
    if (!parsed.ok()) {
      // The reason quotes no part of the URL: it may hold a password.
      spdlog::critical("{}", std::string(parsed.status().message()));
      return false;
    }
    options.alertmanager_url = parsed->url;
  }
  options.alertmanager_resend_interval =
      std::chrono::seconds(std::max<int64_t>(1, absl::GetFlag(FLAGS_alertmanager_resend_s)));
  if (const std::string path = absl::GetFlag(FLAGS_config); !path.empty()) {
    auto config = foreshock::alerts::LoadAlertConfigFile(path);
    if (!config.ok()) {
      spdlog::critical("--config {}: {}", path, config.status().ToString());
      return false;
    }
    options.alert_config = *std::move(config);
    spdlog::info("alert configuration loaded from {}", path);
  }
  return true;
}

// TLS, tokens and the listen plan; false (after logging why) when the daemon
// would be half-secured or would listen beyond loopback unsecured.
bool ApplySecurityFlags(foreshock::server::DaemonOptions& options) {
  options.tls.cert = absl::GetFlag(FLAGS_tls_cert);
  options.tls.key = absl::GetFlag(FLAGS_tls_key);
  options.tls.client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  if (options.tls.cert.empty() != options.tls.key.empty()) {
    spdlog::critical("--tls_cert and --tls_key go together");
    return false;
  }
  if (!options.tls.client_ca.empty() && options.tls.cert.empty()) {
    spdlog::critical("--tls_client_ca needs --tls_cert and --tls_key");
    return false;
  }
  if (const std::string path = absl::GetFlag(FLAGS_token_file); !path.empty()) {
    // Before reading it: a file others can read has leaked its tokens already.
    if (absl::Status mode = foreshock::server::CheckSecretFileMode(
            "--token_file", path, "--allow_insecure_token_file");
        !mode.ok()) {
      if (!absl::IsFailedPrecondition(mode) || !absl::GetFlag(FLAGS_allow_insecure_token_file)) {
        spdlog::critical("{}", std::string(mode.message()));
        return false;
      }
      spdlog::warn("--allow_insecure_token_file: {}", std::string(mode.message()));
    }
    auto authorizer = foreshock::server::Authorizer::LoadFile(path);
    if (!authorizer.ok()) {
      spdlog::critical("--token_file: {}", std::string(authorizer.status().message()));
      return false;
    }
    options.authorizer = *std::move(authorizer);
  }
  {
    // One rule for every address of both ports (server/security/listen_address.h):
    // the daemon serves exactly the addresses planned here, or does not start.
    const bool insecure = absl::GetFlag(FLAGS_insecure);
    auto plan = foreshock::server::PlanListeners(
        options.listen, options.metrics_listen,
        {.tls = options.tls.enabled(), .tokens = options.authorizer != nullptr,
         .insecure = insecure});
    if (!plan.ok()) {
      spdlog::critical("{}", std::string(plan.status().message()));
      return false;
    }
    for (const std::string& warning : plan->warnings) spdlog::warn("{}", warning);
    options.listen_plan = *std::move(plan);
    if (!options.authorizer && !insecure) {
      spdlog::info("no --token_file: listening on loopback only; every local client is trusted");
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  // Freed memory goes back to the kernel, whichever thread freed it. By
  // default glibc raises its mmap and trim thresholds to 32-64 MiB as large
  // blocks come and go, and each thread's arena then keeps what it freed: a
  // query answer of 20 MB left 31 MiB resident in each HTTP thread that ever
  // answered one (eight threads: 250 MiB), and an ingest batch the same in
  // gRPC's threads. Fixed at 1 MiB: blocks above it are mapped and unmapped,
  // and an arena's free top above it is returned when memory is freed.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 20);
  absl::SetProgramUsageMessage(
      "foreshockd: the Foreshock sidecar. Training ranks stream Q/K, router, curvature and "
      "step samples over gRPC; detectors compute instability signals; Prometheus scrapes "
      "/metrics.\n\nUsage: foreshockd [--listen=HOST:PORT] [--metrics_listen=HOST:PORT] "
      "[flags]");
  // Block the signals before any thread starts, so that only the waiter below
  // receives them: gRPC must never be shut down from a signal handler.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  absl::ParseCommandLine(argc, argv);
  spdlog::set_level(spdlog::level::from_str(absl::GetFlag(FLAGS_log_level)));

  foreshock::server::DaemonOptions options;
  ApplyLimitFlags(options);
  if (!ApplyStoreFlags(options) || !ApplyAlertingFlags(options) ||
      !ApplySecurityFlags(options)) {
    return 2;  // fails closed: a configuration that cannot be honoured does not start
  }

  foreshock::server::Daemon daemon(options);
  if (absl::Status status = daemon.Start(); !status.ok()) {
    spdlog::critical("{}", status.ToString());
    return 1;
  }

  int received = 0;
  sigwait(&stop_signals, &received);
  spdlog::info("received {}; draining", received == SIGTERM ? "SIGTERM" : "SIGINT");
  daemon.Shutdown(std::chrono::milliseconds(absl::GetFlag(FLAGS_shutdown_grace_ms)));
  return 0;
}
