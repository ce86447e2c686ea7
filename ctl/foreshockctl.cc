// foreshockctl: the command-line client of foreshockd. Reads runs, alerts and
// series over foreshock.v1.Query, follows alerts as they change, and replays
// recordings (foreshockd --record_dir) into a daemon over foreshock.v1.Ingest.
//
// Exit status: 0 success; 1 the daemon answered with an error (NOT_FOUND for
// an unknown run, ...), a replayed stream failed, or a watch ended on its
// own; 2 usage error, or the daemon cannot be reached (at once when the
// connection fails, e.g. is refused; after --timeout_s when it never
// completes).
#include <google/protobuf/util/json_util.h>
#include <grpc/support/log.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <future>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "alerts/config.h"
#include "ctl/backtest.h"
#include "ctl/cli.h"
#include "ctl/connection.h"
#include "ctl/recording_commands.h"
#include "ctl/replay.h"
#include "foreshock/v1/query.grpc.pb.h"

namespace foreshock::ctl {
namespace {

namespace v1 = foreshock::v1;

const std::vector<OptionSpec> kGlobalOptions = {
    {"endpoint", true}, {"json", false}, {"timeout_s", true}, {"help", false},
    {"token", true},    {"token_file", true}, {"tls_ca", true}, {"tls_cert", true},
    {"tls_key", true}};

const char kGlobalHelp[] =
    "Global options (before or after the command):\n"
    "  --endpoint HOST:PORT  foreshockd's gRPC address (default 127.0.0.1:50051, the daemon's\n"
    "                        default --listen)\n"
    "  --json                machine-readable output: the proto response as JSON (proto field\n"
    "                        names, every field printed; 64-bit integers are JSON strings, as\n"
    "                        the proto3 JSON mapping has it); one document per command, one\n"
    "                        line per event for watch\n"
    "  --timeout_s N         seconds to wait for the connection and for each reply (default 10);\n"
    "                        a connection that fails (refused, unknown host, TLS handshake)\n"
    "                        ends the command at once\n"
    "  --token_file PATH     file holding the bearer token for a daemon with --token_file\n"
    "                        (default: $FORESHOCK_TOKEN; --token TOKEN also works, but shows\n"
    "                        the token to other users in the process list)\n"
    "  --tls_ca PATH         PEM CA that signed the daemon's --tls_cert: connect with TLS\n"
    "  --tls_cert PATH, --tls_key PATH\n"
    "                        client certificate and key, for a daemon with --tls_client_ca\n"
    "  --help                this text, or a command's own with the command\n";

const char kExitHelp[] =
    "Exit status: 0 success; 1 the daemon answered with an error (e.g. NOT_FOUND for an unknown\n"
    "run), a replayed stream failed or a watch ended on its own; 2 usage error or the daemon\n"
    "cannot be reached (one line on stderr naming the endpoint and why).\n";

struct Command {
  std::string name;
  std::string summary;  // one line, for the command list
  std::string help;     // the command's --help, after its usage line
  std::string usage;
  std::vector<OptionSpec> options;
  size_t min_positional = 0;
  size_t max_positional = 0;
  std::function<int(const Args&, const Globals&)> run;
};

// ---------------------------------------------------------------- output

bool PrintJson(const google::protobuf::Message& message, bool one_line) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = !one_line;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string text;
  if (!google::protobuf::util::MessageToJsonString(message, &text, options).ok()) {
    std::fprintf(stderr, "foreshockctl: cannot print the response as JSON\n");
    return false;
  }
  while (!text.empty() && text.back() == '\n') text.pop_back();
  std::cout << text << '\n' << std::flush;
  return true;
}

std::string Cause(const v1::Alert& a) {
  if (a.probable_cause().empty()) return "-";
  return a.probable_cause() + (a.probable_cause_settled() ? "" : " (provisional)");
}

std::string StepOrDash(int64_t step) { return step < 0 ? "-" : std::to_string(step); }

// ---------------------------------------------------------------- commands

int RunRuns(const Args& args, const Globals& g) {
  auto channel = Connect(g);
  if (!channel) return kExitUsage;
  auto stub = v1::Query::NewStub(channel);
  grpc::ClientContext context;
  SetDeadline(context, g);
  v1::ListRunsResponse response;
  const grpc::Status status = stub->ListRuns(&context, v1::ListRunsRequest(), &response);
  if (!status.ok()) return RpcFailed("runs", "ListRuns", status, g);
  if (g.json) return PrintJson(response, false) ? kExitOk : kExitFailed;
  if (response.runs().empty()) {
    std::cout << "no runs\n";
    return kExitOk;
  }
  // ATTEMPT > 1: the run resumed (from a checkpoint, or after it ended);
  // ENDED: when every sender said goodbye, "-" while the run is live.
  Table table({"RUN", "JOB", "FIRST_STEP", "LAST_STEP", "SERIES", "ACTIVE_ALERTS", "LAST_SEEN",
               "ATTEMPT", "ENDED"});
  for (const v1::RunInfo& run : response.runs()) {
    table.AddRow({run.run(), run.job_name().empty() ? "-" : run.job_name(),
                  std::to_string(run.first_step()), std::to_string(run.last_step()),
                  std::to_string(run.series()), std::to_string(run.active_alerts()),
                  UtcTime(run.last_seen_unix_ms()), std::to_string(std::max(1, run.attempt())),
                  run.ended() ? UtcTime(run.ended_unix_ms()) : "-"});
  }
  std::cout << table.Render();
  return kExitOk;
}

int RunAlerts(const Args& args, const Globals& g) {
  auto channel = Connect(g);
  if (!channel) return kExitUsage;
  auto stub = v1::Query::NewStub(channel);
  grpc::ClientContext context;
  SetDeadline(context, g);
  v1::ListAlertsRequest request;
  request.set_run(args.Get("run"));
  request.set_include_resolved(args.Flag("all"));
  v1::ListAlertsResponse response;
  const grpc::Status status = stub->ListAlerts(&context, request, &response);
  if (!status.ok()) return RpcFailed("alerts", "ListAlerts", status, g);
  if (g.json) return PrintJson(response, false) ? kExitOk : kExitFailed;
  if (response.alerts().empty()) {
    std::cout << (request.include_resolved() ? "no alerts\n" : "no active alerts\n");
    return kExitOk;
  }
  Table table({"STATE", "ALERTNAME", "RUN", "ATTEMPT", "EPISODE", "LAYER", "SEVERITY", "FIRST_STEP",
               "FIRING_STEP", "RESOLVED_STEP", "VALUE", "PROBABLE_CAUSE", "SUMMARY"});
  for (const v1::Alert& a : response.alerts()) {
    // A resolution by the run's lifecycle, not its signals, says so: resolved:run_ended.
    const std::string state =
        a.resolved_reason().empty() ? a.state() : a.state() + ":" + a.resolved_reason();
    // The attempt (1, 2 after a resume, ...); "-" from a daemon that does not say.
    table.AddRow({state, a.alertname(), a.run(),
                  a.attempt() > 0 ? std::to_string(a.attempt()) : std::string("-"),
                  a.episode() > 0 ? std::to_string(a.episode()) : std::string("-"), a.layer(),
                  a.severity(), std::to_string(a.first_step()), StepOrDash(a.firing_step()),
                  StepOrDash(a.resolved_step()), ShortNumber(a.value()), Cause(a), a.summary()});
  }
  std::cout << table.Render();
  return kExitOk;
}

std::string EventLine(const v1::AlertEvent& event) {
  const v1::Alert& a = event.alert();
  const int64_t now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  std::string line = UtcTime(now_ms) + "  step " + std::to_string(event.step()) + "  " +
                     a.alertname() + " run=" + a.run() + " layer=" + a.layer() + "  " +
                     event.from_state() + " -> " + event.to_state() +
                     "  value=" + ShortNumber(a.value());
  if (!std::isnan(a.baseline())) line += " baseline=" + ShortNumber(a.baseline());
  if (!std::isnan(a.z())) line += " z=" + ShortNumber(a.z());
  line += " first_step=" + std::to_string(a.first_step()) + "  cause=" + Cause(a);
  return line;
}

int RunWatch(const Args& args, const Globals& g) {
  // Only the waiter thread below takes SIGINT/SIGTERM: block them before
  // gRPC starts its threads, which inherit the mask.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  auto channel = Connect(g);
  if (!channel) return kExitUsage;
  auto stub = v1::Query::NewStub(channel);
  grpc::ClientContext context;
  AddCallToken(context);
  std::atomic<bool> interrupted{false};
  std::thread waiter([&] {
    int received = 0;
    sigwait(&stop_signals, &received);
    interrupted = true;
    context.TryCancel();
  });
  waiter.detach();  // still waiting if the stream ends on its own; exit ends it

  v1::WatchAlertsRequest request;
  request.set_run(args.Get("run"));
  request.set_send_active(true);
  auto reader = stub->WatchAlerts(&context, request);
  v1::AlertEvent event;
  while (reader->Read(&event)) {
    if (g.json) {
      if (!PrintJson(event, true)) return kExitFailed;
    } else {
      std::cout << EventLine(event) << '\n' << std::flush;
    }
  }
  const grpc::Status status = reader->Finish();
  if (interrupted) return kExitOk;
  if (status.ok()) {
    std::fprintf(stderr, "foreshockctl watch: the daemon ended the stream\n");
    return kExitFailed;
  }
  return RpcFailed("watch", "WatchAlerts", status, g) == kExitUsage ? kExitUsage : kExitFailed;
}

// A raw answer over the daemon's --max_query_mb is refused
// (RESOURCE_EXHAUSTED): the range is then fetched in step windows, a window
// the daemon still refuses halved, one it is too busy for (UNAVAILABLE,
// --max_query_total_mb held by other queries) retried after a second, and
// the pages joined into one answer.
grpc::Status GetSeriesPaged(v1::Query::Stub& stub, const v1::GetSeriesRequest& request,
                            const Globals& g, v1::GetSeriesResponse* out) {
  auto call = [&](const v1::GetSeriesRequest& query, v1::GetSeriesResponse* answer) {
    for (int attempt = 0;; ++attempt) {
      grpc::ClientContext context;
      SetDeadline(context, g);
      answer->Clear();
      const grpc::Status status = stub.GetSeries(&context, query, answer);
      if (status.error_code() != grpc::StatusCode::UNAVAILABLE || attempt >= 60) return status;
      std::this_thread::sleep_for(std::chrono::seconds(1));
    }
  };
  const grpc::Status status = call(request, out);
  if (status.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED || request.max_points() != 0) {
    return status;
  }
  // The series' steps, for the windows.
  v1::ListSeriesRequest list;
  list.set_run(request.run());
  v1::ListSeriesResponse series;
  {
    grpc::ClientContext context;
    SetDeadline(context, g);
    if (!stub.ListSeries(&context, list, &series).ok()) return status;
  }
  const int32_t layer = request.has_layer() ? request.layer() : -1;
  const int32_t head = request.has_head() ? request.head() : -1;
  const auto info = std::find_if(series.series().begin(), series.series().end(),
                                 [&](const v1::SeriesInfo& s) {
                                   return s.signal() == request.signal() && s.layer() == layer &&
                                          s.head() == head;
                                 });
  if (info == series.series().end()) return status;
  int64_t lo = std::max(request.has_from_step() ? request.from_step() : INT64_MIN, info->first_step());
  const int64_t end = std::min(request.has_to_step() ? request.to_step() : INT64_MAX, info->last_step());
  uint64_t width = (static_cast<uint64_t>(end - lo) >> 1) + 1;
  uint64_t total = 0;
  out->Clear();
  while (lo <= end) {
    const int64_t hi = static_cast<uint64_t>(end - lo) < width
                           ? end
                           : static_cast<int64_t>(static_cast<uint64_t>(lo) + width - 1);
    v1::GetSeriesRequest page_request = request;
    page_request.set_from_step(lo);
    page_request.set_to_step(hi);
    v1::GetSeriesResponse page;
    const grpc::Status page_status = call(page_request, &page);
    if (page_status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED && width > 1) {
      width >>= 1;
      continue;
    }
    if (!page_status.ok()) return page_status;
    if (out->run().empty()) {
      out->set_run(page.run());
      out->set_signal(page.signal());
      out->set_layer(page.layer());
      out->set_head(page.head());
    }
    total += page.total_points();
    for (v1::SeriesPoint& point : *page.mutable_points()) *out->add_points() = std::move(point);
    if (hi == end) break;
    lo = hi + 1;
  }
  out->set_total_points(total);
  return grpc::Status::OK;
}

int RunSeries(const Args& args, const Globals& g) {
  if (args.Flag("csv") && g.json) {
    std::fprintf(stderr, "foreshockctl series: --csv and --json exclude each other\n");
    return kExitUsage;
  }
  v1::GetSeriesRequest request;
  request.set_run(args.positional[0]);
  request.set_signal(args.positional[1]);
  struct IntOption {
    const char* name;
    std::function<void(int64_t)> set;
    int64_t min, max;
  };
  const IntOption int_options[] = {
      {"layer", [&](int64_t v) { request.set_layer(static_cast<int32_t>(v)); }, -1, INT32_MAX},
      {"head", [&](int64_t v) { request.set_head(static_cast<int32_t>(v)); }, -1, INT32_MAX},
      {"from", [&](int64_t v) { request.set_from_step(v); }, INT64_MIN, INT64_MAX},
      {"to", [&](int64_t v) { request.set_to_step(v); }, INT64_MIN, INT64_MAX},
      {"max_points", [&](int64_t v) { request.set_max_points(static_cast<uint32_t>(v)); }, 0,
       UINT32_MAX},
  };
  for (const IntOption& option : int_options) {
    if (!args.Has(option.name)) continue;
    const std::optional<int64_t> value = ParseInt(args.Get(option.name));
    if (!value || *value < option.min || *value > option.max) {
      std::fprintf(stderr, "foreshockctl series: --%s wants an integer in [%lld, %lld], not '%s'\n",
                   option.name, static_cast<long long>(option.min),
                   static_cast<long long>(option.max), args.Get(option.name).c_str());
      return kExitUsage;
    }
    option.set(*value);
  }
  auto channel = Connect(g);
  if (!channel) return kExitUsage;
  auto stub = v1::Query::NewStub(channel);
  v1::GetSeriesResponse response;
  const grpc::Status status = GetSeriesPaged(*stub, request, g, &response);
  if (!status.ok()) return RpcFailed("series", "GetSeries", status, g);
  if (g.json) return PrintJson(response, false) ? kExitOk : kExitFailed;
  if (args.Flag("csv")) {
    std::cout << SeriesCsv(response) << std::flush;
    return kExitOk;
  }
  std::cout << "run " << response.run() << ", signal " << response.signal() << ", layer "
            << (response.layer() < 0 ? std::string("- (run-level)") : std::to_string(response.layer()))
            << ", head "
            << (response.head() < 0 ? std::string("- (over heads)") : std::to_string(response.head()))
            << ": " << response.total_points() << " points"
            << (response.downsampled()
                    ? " in " + std::to_string(response.buckets_size()) + " buckets"
                    : std::string())
            << "\n";
  if (response.downsampled()) {
    Table table({"FIRST_STEP", "LAST_STEP", "COUNT", "MIN", "MEAN", "MAX", "LAST"});
    for (const v1::SeriesBucket& b : response.buckets()) {
      table.AddRow({std::to_string(b.first_step()), std::to_string(b.last_step()),
                    std::to_string(b.count()), ShortNumber(b.min()), ShortNumber(b.mean()),
                    ShortNumber(b.max()), ShortNumber(b.last())});
    }
    std::cout << table.Render();
  } else {
    Table table({"STEP", "VALUE", "WALL_TIME"});
    for (const v1::SeriesPoint& p : response.points()) {
      table.AddRow({std::to_string(p.step()), ShortNumber(p.value()),
                    UtcTime(p.wall_time_unix_ms())});
    }
    std::cout << table.Render();
  }
  return kExitOk;
}


// ---------------------------------------------------------------- table

std::vector<Command> Commands() {
  std::vector<Command> commands;
  commands.push_back(Command{
      "runs",
      "the runs the daemon knows (Query/ListRuns)",
      "Lists every run the daemon's store holds, newest activity first: job name, step range,\n"
      "number of series, alerts pending or firing now, and the wall time of its newest point\n"
      "(foreshock.v1.Query/ListRuns).\n",
      "foreshockctl runs [--endpoint HOST:PORT] [--json]",
      {},
      0,
      0,
      RunRuns});
  commands.push_back(Command{
      "alerts",
      "alerts, active by default (Query/ListAlerts)",
      "Lists alerts: the pending and firing ones by default; with --all every episode of every\n"
      "alert, one row each (an alert that fired, resolved and fired again is two rows, EPISODE\n"
      "1 and 2, each with its own steps), oldest attempt first, then by alertname, layer and\n"
      "episode. PROBABLE_CAUSE says \"(provisional)\" while the run's cause may still change\n"
      "(foreshock.v1.Query/ListAlerts).\n\n"
      "An unknown RUN is an error (NOT_FOUND, status 1), as for series; a run without alerts\n"
      "prints \"no active alerts\" (\"no alerts\" with --all), status 0.\n\n"
      "Options:\n"
      "  --run RUN  only this run\n"
      "  --all      every episode, resolved and cleared ones included\n",
      "foreshockctl alerts [--run RUN] [--all] [--json]",
      {{"run", true}, {"all", false}},
      0,
      0,
      RunAlerts});
  commands.push_back(Command{
      "watch",
      "follow alert transitions until Ctrl-C (Query/WatchAlerts)",
      "Prints the alerts active now, then one line per alert transition as it happens:\n"
      "  <time>  step <step>  <alertname> run=<run> layer=<layer>  <from> -> <to>  value=...\n"
      "With --json, one AlertEvent per line (JSON lines). Ctrl-C (SIGINT) or SIGTERM ends it\n"
      "with status 0; if the daemon ends the stream, status is 1 (2 if it went away)\n"
      "(foreshock.v1.Query/WatchAlerts with send_active). watch does not wait for a daemon to\n"
      "start: no daemon at the endpoint is status 2, as for every command. It does wait for a\n"
      "run: --run may name a run that has not sent anything yet.\n\n"
      "Options:\n"
      "  --run RUN  only this run (known to the daemon or not)\n",
      "foreshockctl watch [--run RUN] [--json]",
      {{"run", true}},
      0,
      0,
      RunWatch});
  commands.push_back(Command{
      "series",
      "the points of one series (Query/GetSeries)",
      "Prints the points of one series in a step range. SIGNAL is the metric name without the\n"
      "foreshock_ prefix: loss, grad_norm, lr, qk_increment_entropy, attention_max_logit,\n"
      "router_flip_rate, curvature_eos_ratio, ... Run-level signals have no layer; per-layer\n"
      "signals need --layer. Values aggregated over heads unless --head is given (per-head\n"
      "series exist only with foreshockd --per_head_metrics). foreshock.v1.Query/GetSeries.\n\n"
      "Options:\n"
      "  --layer L         layer index (default: run-level, -1)\n"
      "  --head H          head index (default: the aggregate over heads, -1)\n"
      "  --from S          first step, inclusive (default: the first point)\n"
      "  --to S            last step, inclusive (default: the last point)\n"
      "  --max_points N    at most N rows: above that the daemon returns buckets of\n"
      "                    min/mean/max (default 0: every point; a range larger than\n"
      "                    the daemon's --max_query_mb answer is fetched page by page)\n"
      "  --csv             CSV on stdout, one header line then one row per point:\n"
      "                      step,value,wall_time_unix_ms\n"
      "                    or, when the daemon downsampled, one row per bucket:\n"
      "                      step,value,min,max,count,first_step,last_step,last\n"
      "                    where step is the bucket's last_step and value its mean (count\n"
      "                    includes non-finite points, min/max/mean leave them out).\n"
      "                    Numbers are printed exactly (shortest round-trip form; nan, inf).\n",
      "foreshockctl series RUN SIGNAL [--layer L] [--head H] [--from S] [--to S] "
      "[--max_points N] [--csv | --json]",
      {{"layer", true}, {"head", true}, {"from", true}, {"to", true}, {"max_points", true},
       {"csv", false}},
      2,
      2,
      RunSeries});
  commands.push_back(Command{
      "replay",
      "stream recordings (foreshockd --record_dir) into a daemon",
      "Sends each recording's StreamRequests (the bytes the recording daemon received: its\n"
      "Hello, then its Batches) to foreshock.v1.Ingest/Stream on the daemon at --to, one gRPC\n"
      "stream per file, all files at once. Every response is read and checked: a HelloAck for\n"
      "the Hello and one Ack per Batch, in order, with the Batch's seq. Prints per file the\n"
      "messages sent, the records accepted and rejected (by reason code) and the stream's\n"
      "status; --json prints a JSON array with one object per file. A recording that ends in\n"
      "a torn frame (the daemon stopped mid-write) is replayed up to it. Status 1 when a\n"
      "stream fails, an ack is missing or out of order, or a recording has a corrupt frame;\n"
      "rejected records alone are not a failure (the daemon judges them as it did live).\n\n"
      "Options:\n"
      "  --to HOST:PORT           the daemon to replay into (required; --endpoint is not used)\n"
      "  --speed max|realtime     max (default): as fast as the daemon acks; realtime: keep\n"
      "                           the recorded gaps between messages, across all files\n",
      "foreshockctl replay FILE... --to HOST:PORT [--speed max|realtime] [--json]",
      {{"to", true}, {"speed", true}},
      1,
      SIZE_MAX,
      RunReplay});
  commands.push_back(Command{
      "backtest",
      "score the alerts of recorded runs, replayed in process (no daemon)",
      "Replays recordings (foreshockd --record_dir; FILE may be a directory, searched for\n"
      "*.fsrec) through the daemon's validation, detectors and alert engine in this process,\n"
      "with the alert configuration of --config (default: the built-in defaults), one thread,\n"
      "so the result is deterministic. The files of one run (ranks, reconnects) are merged by\n"
      "receive time. Per run it prints the first alert, the divergence step, the lead, the\n"
      "probable cause, false alarms and the first alarm of the baselines; then a summary. This\n"
      "is how to tune thresholds on your own past runs.\n\n"
      "Labels come from the recording's Hello labels (Monitor(labels=...)):\n"
      "  injection_step   the step a fault (or a benign change) began\n"
      "  expected_cause   set on fault runs: low_precision_attention, learning_rate_too_high,\n"
      "                   combined\n"
      "  scenario, config names, for the table\n"
      "  warmup_steps     the divergence rule's warm-up (else --divergence_warmup)\n"
      "Divergence: the first step after the warm-up where the 20-step mean loss exceeds 1.3x\n"
      "its running minimum, or the loss is not finite (docs/DESIGN.md §6.3). A run with\n"
      "expected_cause is a fault run; one with injection_step or scenario but no\n"
      "expected_cause is a control; an unlabeled run is a fault run when it diverged.\n"
      "False alarms: any alert that fired in a control, or before injection_step in a fault\n"
      "run. Lead: divergence - the step of the first alert fired at or after the injection;\n"
      "lead%: the lead over (divergence - injection). Cause: the probable cause last given\n"
      "before the divergence. Baselines (docs/DESIGN.md §6.4): olmo (6 sigma over 128 steps,\n"
      "loss or grad norm), megatron (loss above 10x its running max), nan, gradnorm_z (robust\n"
      "z of the grad norm over its trailing 200 steps, 10 back, above --gradnorm_z on 3\n"
      "steps in a row); \"(early)\" marks one that also alarmed before the injection.\n\n"
      "With --json: one document {\"runs\": [...], \"summary\": {...}, \"errors\": [...]}, a\n"
      "row per run with run_id, first_alert_step, divergence_step, lead, lead_fraction,\n"
      "cause, false_alarms, baselines and every fired alert. Status 1 when a file cannot be\n"
      "read or holds a corrupt frame (the rest is still scored).\n\n"
      "Options:\n"
      "  --config FILE            alert configuration (foreshockd --config format)\n"
      "  --divergence_warmup N    warm-up of the divergence rule without a warmup_steps\n"
      "                           label (default 100)\n"
      "  --gradnorm_z Z           threshold of the gradnorm_z baseline (default 8)\n"
      "  --signals MODE           which detector outputs reach the alert engine: all\n"
      "                           (default); mechanism: all but the learning rate the job\n"
      "                           streams (signals lr, lr_over_held_max) and the attention\n"
      "                           output check (attention_output_bias, attention_output_error),\n"
      "                           as if the job streamed neither; direct: only those\n"
      "                           (docs/EVALUATION.md's three rows); no_lr: all but what\n"
      "                           reads the LR (lr, lr_over_held_max, curvature_eos_ratio,\n"
      "                           curvature_eos_threshold), as if the job did not stream it\n"
      "  --dump_series S1,S2      with --json, every value of these signals (per head and\n"
      "                           the layer aggregate, head -1) per run under \"series\":\n"
      "                           [[step, layer, head, value], ...] (tests/eval/reference.py)\n",
      "foreshockctl backtest FILE|DIR... [--config FILE] [--divergence_warmup N] "
      "[--gradnorm_z Z] [--signals all|mechanism|direct|no_lr] [--dump_series S,...] [--json]",
      {{"config", true}, {"divergence_warmup", true}, {"gradnorm_z", true}, {"signals", true},
       {"dump_series", true}},
      1,
      SIZE_MAX,
      RunBacktestCommand});
  return commands;
}

void PrintUsage(std::FILE* out, const std::vector<Command>& commands) {
  std::fprintf(out,
               "foreshockctl: the command-line client of foreshockd.\n\n"
               "Usage: foreshockctl [global options] COMMAND [args] [options]\n\nCommands:\n");
  for (const Command& c : commands) {
    std::fprintf(out, "  %-8s %s\n", c.name.c_str(), c.summary.c_str());
  }
  std::fprintf(out, "  %-8s %s\n\n", "help", "help [COMMAND]: this text, or a command's");
  std::fprintf(out, "%s\n%s\nRun 'foreshockctl COMMAND --help' for a command's arguments.\n",
               kGlobalHelp, kExitHelp);
}

void PrintCommandHelp(std::FILE* out, const Command& c) {
  std::fprintf(out, "Usage: %s\n\n%s\n%s\n%s", c.usage.c_str(), c.help.c_str(), kGlobalHelp,
               kExitHelp);
}

int Main(int argc, char** argv) {
  gpr_set_log_function(GrpcLog);
  const std::vector<Command> commands = Commands();
  // The command is the first argument that is not a global option (or its value).
  int command_at = -1;
  bool help = false;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      help = true;
      continue;
    }
    if (arg.substr(0, 2) == "--") {
      const std::string_view name = arg.substr(2, arg.find('=') - 2);
      if (arg.find('=') == std::string_view::npos &&
          (name == "endpoint" || name == "timeout_s" || name == "token" || name == "token_file" ||
           name == "tls_ca" || name == "tls_cert" || name == "tls_key")) {
        ++i;
      }
      continue;
    }
    command_at = i;
    break;
  }
  if (command_at < 0) {
    PrintUsage(help ? stdout : stderr, commands);
    return help ? kExitOk : kExitUsage;
  }
  std::string name = argv[command_at];
  if (name == "help") {
    if (command_at + 1 < argc) {
      for (const Command& c : commands) {
        if (c.name == argv[command_at + 1]) {
          PrintCommandHelp(stdout, c);
          return kExitOk;
        }
      }
      std::fprintf(stderr, "foreshockctl: unknown command '%s'\n\n", argv[command_at + 1]);
      PrintUsage(stderr, commands);
      return kExitUsage;
    }
    PrintUsage(stdout, commands);
    return kExitOk;
  }
  const Command* command = nullptr;
  for (const Command& c : commands) {
    if (c.name == name) command = &c;
  }
  if (!command) {
    std::fprintf(stderr, "foreshockctl: unknown command '%s'\n\n", name.c_str());
    PrintUsage(stderr, commands);
    return kExitUsage;
  }
  std::vector<OptionSpec> specs = kGlobalOptions;
  specs.insert(specs.end(), command->options.begin(), command->options.end());
  Args args;
  std::string error;
  std::vector<const char*> rest;  // argv without the command name
  for (int i = 0; i < argc; ++i) {
    if (i != command_at) rest.push_back(argv[i]);
  }
  if (!ParseArgs(static_cast<int>(rest.size()), rest.data(), 1, specs, &args, &error)) {
    std::fprintf(stderr, "foreshockctl %s: %s\nUsage: %s\nRun 'foreshockctl %s --help' for more.\n",
                 name.c_str(), error.c_str(), command->usage.c_str(), name.c_str());
    return kExitUsage;
  }
  if (args.Flag("help")) {
    PrintCommandHelp(stdout, *command);
    return kExitOk;
  }
  if (args.positional.size() < command->min_positional ||
      args.positional.size() > command->max_positional) {
    std::fprintf(stderr, "foreshockctl %s: %s\nUsage: %s\nRun 'foreshockctl %s --help' for more.\n",
                 name.c_str(),
                 args.positional.size() < command->min_positional ? "missing arguments"
                                                                  : "too many arguments",
                 command->usage.c_str(), name.c_str());
    return kExitUsage;
  }
  Globals globals;
  globals.endpoint = args.Get("endpoint", kDefaultEndpoint);
  globals.json = args.Flag("json");
  if (args.Has("timeout_s")) {
    const std::optional<int64_t> timeout = ParseInt(args.Get("timeout_s"));
    if (!timeout || *timeout < 1 || *timeout > 86400) {
      std::fprintf(stderr, "foreshockctl: --timeout_s wants whole seconds in [1, 86400], not '%s'\n",
                   args.Get("timeout_s").c_str());
      return kExitUsage;
    }
    globals.timeout_s = *timeout;
  }
  // Security: files are read once here; the token never goes to the output.
  auto read_file = [](const std::string& flag, const std::string& path, std::string* out) {
    std::ifstream in(path, std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "foreshockctl: --%s: cannot read %s\n", flag.c_str(), path.c_str());
      return false;
    }
    std::ostringstream text;
    text << in.rdbuf();
    *out = text.str();
    return true;
  };
  std::string token;
  if (args.Has("token_file")) {
    if (!read_file("token_file", args.Get("token_file"), &token)) return kExitUsage;
    while (!token.empty() && std::isspace(static_cast<unsigned char>(token.back()))) token.pop_back();
  } else if (args.Has("token")) {
    token = args.Get("token");
  } else if (const char* env = std::getenv("FORESHOCK_TOKEN")) {
    token = env;
  }
  SetCallToken(token);
  if (args.Has("tls_cert") != args.Has("tls_key")) {
    std::fprintf(stderr, "foreshockctl: --tls_cert and --tls_key go together\n");
    return kExitUsage;
  }
  for (const char* flag : {"tls_ca", "tls_cert", "tls_key"}) {
    if (!args.Has(flag)) continue;
    std::string* out = std::string_view(flag) == "tls_ca"     ? &globals.tls_ca
                       : std::string_view(flag) == "tls_cert" ? &globals.tls_cert
                                                              : &globals.tls_key;
    if (!read_file(flag, args.Get(flag), out)) return kExitUsage;
    globals.tls = true;
  }
  return command->run(args, globals);
}

}  // namespace
}  // namespace foreshock::ctl

int main(int argc, char** argv) { return foreshock::ctl::Main(argc, argv); }
