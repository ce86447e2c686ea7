// foreshock_load: drives a foreshockd with many concurrent ingest streams, as a
// cluster's training ranks would, and reports what the daemon accepted, how fast
// it acknowledged, what it refused and whether anything acknowledged was lost.
//
// Each stream is one rank of one run (--runs x --ranks_per_run streams, each on
// its own TCP connection, as separate rank processes would be). Every step a rank
// sends one Batch: a StepScalars record, and on probe steps (every --probe_every
// steps) one QKSample per layer the rank owns plus one RouterSample for its MoE
// layer. Batches carry seqs and the Hello carries first_seq/sender_id, so a
// stream the daemon ends (RESOURCE_EXHAUSTED, a restart) reconnects after the
// retry hint and resends its unacknowledged batches, like the real clients.
//
// Batch contents are a pure function of (stream, seq), so nothing is kept per
// unacknowledged batch but its seq and send time, and a resend is byte-identical.
//
// At the end the generator drains (waits for every outstanding ack), closes the
// streams and checks through foreshock.v1.Query that every acknowledged QK and
// router record is in the daemon's store exactly once: one attention_entropy
// point per (run, layer, step) for QK, one router_entropy point for router.
// "lost" counts acknowledged records missing there, "duplicated" extra points.
// Exit status: 0 when both are 0, 1 otherwise, 2 on a usage or connection error.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "foreshock/client.h"
#include "foreshock/v1/ingest.grpc.pb.h"
#include "foreshock/v1/query.grpc.pb.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "foreshockd gRPC address, HOST:PORT.");
ABSL_FLAG(int, runs, 32, "Runs to simulate; each has --ranks_per_run streams.");
ABSL_FLAG(int, ranks_per_run, 8,
          "Ranks (streams) per run. Rank j owns --layers_per_rank consecutive layers and "
          "probes them (Monitor's probe_all_ranks).");
ABSL_FLAG(int, layers_per_rank, 2, "Attention layers each rank probes (QK samples per probe).");
ABSL_FLAG(double, duration_s, 60, "Seconds of sending (then the generator drains and verifies).");
ABSL_FLAG(double, steps_per_s, 1,
          "Training steps per second per rank; one Batch per step. Steps start at a random "
          "phase per stream so that the ranks do not send in lock step.");
ABSL_FLAG(int, probe_every, 10,
          "A probe (QK samples for the rank's layers + a router sample) every this many steps.");
ABSL_FLAG(int, heads, 8, "Query heads per QK sample.");
ABSL_FLAG(int, tokens, 64, "Probe tokens per QK and router sample.");
ABSL_FLAG(int, head_dim, 64, "head_dim of the QK samples (q and k are bf16).");
ABSL_FLAG(int, experts, 64, "Experts per router sample (logits are fp32).");
ABSL_FLAG(int, top_k, 2, "Router top-k.");
ABSL_FLAG(int, max_unacked, 64,
          "Batches a stream may have sent but not yet seen acknowledged. A step that finds "
          "the window full is skipped and counted (client_skipped), as the real client drops "
          "samples rather than block training.");
ABSL_FLAG(int, daemon_pid, 0,
          "PID of the foreshockd under test (same machine): its resident memory is sampled "
          "every 100 ms and its peak (VmHWM) reported. 0: not measured.");
ABSL_FLAG(std::string, run_prefix, "",
          "Prefix of the run ids (load-<pid>-<time> by default, so repeated runs against one "
          "daemon do not mix).");
ABSL_FLAG(std::string, json, "", "Also write the report as JSON to this file.");
ABSL_FLAG(double, drain_timeout_s, 60, "Longest wait for outstanding acks after sending stops.");
ABSL_FLAG(bool, verify, true,
          "After the run, check the store through foreshock.v1.Query (lost and duplicated).");

namespace {

namespace v1 = foreshock::v1;
using Clock = std::chrono::steady_clock;

struct Config {
  int runs, ranks_per_run, layers_per_rank, probe_every, heads, tokens, head_dim, experts, top_k;
  int max_unacked;
  double steps_per_s;
  std::string run_prefix;
  int n_layers() const { return ranks_per_run * layers_per_rank; }
};

// Random bf16/fp32 payloads shared by all streams; a sample picks one by
// (stream, seq, layer) so that consecutive probes of a layer differ.
struct Payloads {
  static constexpr int kVariants = 8;
  std::vector<std::string> q, k, logits;
  explicit Payloads(const Config& c) {
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.f, 1.f);
    const size_t qk_count = size_t(c.heads) * c.tokens * c.head_dim;
    const size_t router_count = size_t(c.tokens) * c.experts;
    std::vector<float> values;
    for (int v = 0; v < kVariants; ++v) {
      values.resize(qk_count);
      for (float& x : values) x = normal(rng);
      q.push_back(foreshock::client::MakeTensor(v1::BFLOAT16, {c.heads, c.tokens, c.head_dim},
                                                values.data(), values.size())
                      .data());
      for (float& x : values) x = normal(rng);
      k.push_back(foreshock::client::MakeTensor(v1::BFLOAT16, {c.heads, c.tokens, c.head_dim},
                                                values.data(), values.size())
                      .data());
      values.resize(router_count);
      for (float& x : values) x = 2.f * normal(rng);
      logits.push_back(foreshock::client::MakeTensor(v1::FLOAT32, {c.tokens, c.experts},
                                                     values.data(), values.size())
                           .data());
    }
  }
};

// The Batch for (stream, seq): step = seq; a probe on steps divisible by probe_every.
void BuildBatch(const Config& c, const Payloads& p, int stream, uint64_t seq,
                v1::StreamRequest& out) {
  v1::Batch& batch = *out.mutable_batch();
  batch.Clear();
  batch.set_seq(seq);
  const int64_t step = static_cast<int64_t>(seq);
  v1::Record& scalars = *batch.add_records();
  scalars.set_step(step);
  scalars.mutable_scalars()->set_loss(3.0 + 1.0 / (1.0 + step));
  scalars.mutable_scalars()->set_grad_norm(1.0);
  scalars.mutable_scalars()->set_lr(3e-4);
  if (step % c.probe_every != 0) return;
  const int rank = stream % c.ranks_per_run;
  for (int i = 0; i < c.layers_per_rank; ++i) {
    const int layer = rank * c.layers_per_rank + i;
    const size_t variant = (size_t(stream) * 31 + seq / c.probe_every + i) % Payloads::kVariants;
    v1::Record& r = *batch.add_records();
    r.set_step(step);
    v1::QKSample& qk = *r.mutable_qk();
    qk.set_layer(layer);
    qk.set_probe_id("load-probe");
    qk.set_causal(true);
    qk.set_seq_len(c.tokens);
    for (v1::Tensor* t : {qk.mutable_q(), qk.mutable_k()}) {
      t->set_dtype(v1::BFLOAT16);
      t->add_shape(c.heads);
      t->add_shape(c.tokens);
      t->add_shape(c.head_dim);
    }
    qk.mutable_q()->set_data(p.q[variant]);
    qk.mutable_k()->set_data(p.k[(variant + 3) % Payloads::kVariants]);
  }
  v1::Record& r = *batch.add_records();
  r.set_step(step);
  v1::RouterSample& router = *r.mutable_router();
  router.set_layer(rank * c.layers_per_rank);
  router.set_probe_id("load-probe");
  router.set_top_k(c.top_k);
  v1::Tensor& logits = *router.mutable_logits();
  logits.set_dtype(v1::FLOAT32);
  logits.add_shape(c.tokens);
  logits.add_shape(c.experts);
  logits.set_data(p.logits[(size_t(stream) + seq / c.probe_every) % Payloads::kVariants]);
}

// Shared tallies; every field is guarded by `mu`.
struct Report {
  std::mutex mu;
  uint64_t batches_sent = 0, batches_acked = 0, bytes_acked = 0, batches_resent = 0;
  uint64_t scalars_acked = 0, qk_acked = 0, router_acked = 0, duplicate_records = 0;
  uint64_t client_skipped = 0, reconnects = 0;
  std::map<std::string, uint64_t> rejected;       // record rejections, by reason code
  std::map<std::string, uint64_t> stream_errors;  // streams ended by the daemon, by reason
  std::vector<double> ack_latency_ms;
  // Acknowledged records per (run, layer) for the store check.
  std::map<std::pair<std::string, int>, uint64_t> qk_by_layer, router_by_layer;
};

std::string ReasonOf(const std::string& message) {
  const size_t colon = message.find(':');
  return colon == std::string::npos ? message : message.substr(0, colon);
}

class LoadStream;

// One connection attempt of a stream: a callback reactor that lives until OnDone.
class Attempt final : public grpc::ClientBidiReactor<v1::StreamRequest, v1::StreamResponse> {
 public:
  Attempt(LoadStream& owner, v1::Ingest::Stub& stub, v1::StreamRequest hello);
  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnDone(const grpc::Status& status) override;
  // Queues a batch; called with the owner's lock held.
  void Enqueue(uint64_t seq);
  void CloseWrites();  // owner's lock held

 private:
  void WriteNextLocked();
  LoadStream& owner_;
  grpc::ClientContext context_;
  v1::StreamRequest writing_;
  v1::StreamResponse response_;
  std::deque<uint64_t> to_write_;
  bool write_in_flight_ = false;
  bool hello_acked_ = false;
  bool writes_closed_ = false;
  bool close_requested_ = false;
  friend class LoadStream;
};

class LoadStream {
 public:
  LoadStream(const Config& config, const Payloads& payloads, Report& report, int index,
             std::shared_ptr<grpc::Channel> channel, uint64_t first_seq)
      : config_(config),
        payloads_(payloads),
        report_(report),
        index_(index),
        stub_(v1::Ingest::NewStub(channel)),
        next_seq_(first_seq),
        sender_id_(0x10ad0000ull + index) {
    std::mt19937_64 rng(index * 7919 + 1);
    const double period = 1.0 / config.steps_per_s;
    next_step_at_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(
                                           std::uniform_real_distribution<double>(0, period)(rng)));
  }

  std::string run_id() const {
    return absl::StrCat(config_.run_prefix, "-run", index_ / config_.ranks_per_run);
  }
  int rank() const { return index_ % config_.ranks_per_run; }

  // Called by the driver thread: sends due steps, reconnects when due.
  void Tick(Clock::time_point now, bool sending) {
    std::lock_guard<std::mutex> lock(mu_);
    // While draining, a stream with unacknowledged batches still reconnects.
    if (!attempt_ && (!closing_ || !unacked_.empty()) && now >= reconnect_at_) {
      StartAttemptLocked();
    }
    if (!sending) return;
    const auto period = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(1.0 / config_.steps_per_s));
    while (now >= next_step_at_) {
      next_step_at_ += period;
      if (unacked_.size() >= size_t(config_.max_unacked)) {
        std::lock_guard<std::mutex> r(report_.mu);
        ++report_.client_skipped;
        continue;
      }
      const uint64_t seq = next_seq_++;
      unacked_.emplace(seq, Clock::time_point{});
      if (attempt_ && attempt_->hello_acked_) attempt_->Enqueue(seq);
    }
  }

  // Stop sending new steps; when every batch is acked, close the stream.
  void BeginClose() {
    std::lock_guard<std::mutex> lock(mu_);
    closing_ = true;
    MaybeCloseLocked();
  }
  bool Finished() {
    std::lock_guard<std::mutex> lock(mu_);
    return closing_ && unacked_.empty() && !attempt_;
  }
  size_t Unacked() {
    std::lock_guard<std::mutex> lock(mu_);
    return unacked_.size();
  }
  bool Idle() {
    std::lock_guard<std::mutex> lock(mu_);
    return attempt_ == nullptr;
  }
  // Drain timed out: cancel whatever is left.
  void Cancel() {
    std::lock_guard<std::mutex> lock(mu_);
    closing_ = true;
    if (attempt_) attempt_->context_.TryCancel();
  }

 private:
  friend class Attempt;

  void StartAttemptLocked() {
    v1::StreamRequest hello;
    v1::Hello& h = *hello.mutable_hello();
    h.set_run_id(run_id());
    h.set_job("foreshock_load");
    h.set_rank(rank());
    v1::ModelInfo& m = *h.mutable_model();
    m.set_n_layers(config_.n_layers());
    m.set_n_heads(config_.heads);
    m.set_head_dim(config_.head_dim);
    m.set_n_experts(config_.experts);
    m.set_top_k(config_.top_k);
    for (int r = 0; r < config_.ranks_per_run; ++r) m.add_moe_layers(r * config_.layers_per_rank);
    h.set_sender_id(sender_id_);
    h.set_first_seq(unacked_.empty() ? next_seq_ : unacked_.begin()->first);
    attempt_ = new Attempt(*this, *stub_, std::move(hello));
  }

  void OnHelloAck() {  // attempt's lock context: called with mu_ held
    // Resend everything unacknowledged, oldest first.
    for (auto& [seq, sent_at] : unacked_) {
      if (sent_at != Clock::time_point{}) {
        std::lock_guard<std::mutex> r(report_.mu);
        ++report_.batches_resent;
      }
      attempt_->Enqueue(seq);
    }
  }

  void OnAck(const v1::Ack& ack) {
    const auto now = Clock::now();
    std::lock_guard<std::mutex> lock(mu_);
    auto it = unacked_.find(ack.seq());
    if (it == unacked_.end()) return;  // an ack for a batch already settled
    const Clock::time_point sent_at = it->second;
    unacked_.erase(it);
    v1::StreamRequest request;
    BuildBatch(config_, payloads_, index_, ack.seq(), request);
    std::set<uint32_t> rejected_indices;
    {
      std::lock_guard<std::mutex> r(report_.mu);
      ++report_.batches_acked;
      report_.bytes_acked += request.ByteSizeLong();
      report_.ack_latency_ms.push_back(std::chrono::duration<double, std::milli>(now - sent_at).count());
      report_.duplicate_records += ack.duplicates();
      for (const v1::Rejection& rej : ack.rejections()) {
        ++report_.rejected[ReasonOf(rej.reason())];
        rejected_indices.insert(rej.index());
      }
      // Beyond the 256 listed, rejections are counted, not indexed: those
      // records are then not told apart from accepted ones below.
      for (const auto& [code, count] : ack.omitted_by_reason()) report_.rejected[code] += count;
      // Accepted records: every record the ack does not reject (a duplicate ack
      // means the first copy was stored).
      const auto& records = request.batch().records();
      for (int i = 0; i < records.size(); ++i) {
        if (rejected_indices.count(i)) continue;
        const v1::Record& rec = records[i];
        if (rec.has_scalars()) ++report_.scalars_acked;
        if (rec.has_qk()) {
          ++report_.qk_acked;
          ++report_.qk_by_layer[{run_id(), rec.qk().layer()}];
        }
        if (rec.has_router()) {
          ++report_.router_acked;
          ++report_.router_by_layer[{run_id(), rec.router().layer()}];
        }
      }
    }
    MaybeCloseLocked();
  }

  void OnAttemptDone(const grpc::Status& status) {
    std::lock_guard<std::mutex> lock(mu_);
    attempt_ = nullptr;
    if (closing_ && (unacked_.empty() || status.error_code() == grpc::CANCELLED)) {
      if (unacked_.empty()) return;
      reconnect_at_ = Clock::time_point::max();  // cancelled at the drain deadline
      return;
    }
    {
      std::lock_guard<std::mutex> r(report_.mu);
      ++report_.stream_errors[absl::StrCat(absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())), " ",
                                           ReasonOf(status.error_message()))];
      ++report_.reconnects;
    }
    // Retry after the daemon's hint, else exponential backoff with jitter.
    std::mt19937_64 rng(index_ * 131 + failures_);
    int64_t delay_ms = std::min<int64_t>(5000, 100 << std::min(failures_++, 6));
    if (retry_after_ms_ > 0) delay_ms = retry_after_ms_;
    delay_ms = delay_ms / 2 + std::uniform_int_distribution<int64_t>(0, delay_ms)(rng);
    reconnect_at_ = Clock::now() + std::chrono::milliseconds(delay_ms);
  }

  void MaybeCloseLocked() {
    if (closing_ && unacked_.empty() && attempt_) attempt_->CloseWrites();
  }

  const Config& config_;
  const Payloads& payloads_;
  Report& report_;
  const int index_;
  std::unique_ptr<v1::Ingest::Stub> stub_;
  std::mutex mu_;
  Attempt* attempt_ = nullptr;  // null between attempts
  std::map<uint64_t, Clock::time_point> unacked_;  // seq -> time of its latest write
  uint64_t next_seq_;
  const uint64_t sender_id_;
  Clock::time_point next_step_at_;
  Clock::time_point reconnect_at_{};
  int failures_ = 0;
  int64_t retry_after_ms_ = 0;
  bool closing_ = false;
};

Attempt::Attempt(LoadStream& owner, v1::Ingest::Stub& stub, v1::StreamRequest hello)
    : owner_(owner), writing_(std::move(hello)) {
  stub.async()->Stream(&context_, this);
  write_in_flight_ = true;
  StartWrite(&writing_);
  StartRead(&response_);
  // Writes start from the driver thread too, outside the reactions: the hold
  // keeps the call alive until the writes are closed (or the read side ends).
  AddHold();
  StartCall();
}

// Owner's lock held.
void Attempt::Enqueue(uint64_t seq) {
  if (writes_closed_) return;  // the call is ending; the next attempt resends
  to_write_.push_back(seq);
  if (!write_in_flight_) WriteNextLocked();
}

void Attempt::WriteNextLocked() {
  if (to_write_.empty()) {
    if (close_requested_ && !writes_closed_) {
      writes_closed_ = true;
      StartWritesDone();
      RemoveHold();
    }
    return;
  }
  const uint64_t seq = to_write_.front();
  to_write_.pop_front();
  auto it = owner_.unacked_.find(seq);
  if (it == owner_.unacked_.end()) {  // acked meanwhile (a resend raced its ack)
    WriteNextLocked();
    return;
  }
  BuildBatch(owner_.config_, owner_.payloads_, owner_.index_, seq, writing_);
  it->second = Clock::now();
  {
    std::lock_guard<std::mutex> r(owner_.report_.mu);
    ++owner_.report_.batches_sent;
  }
  write_in_flight_ = true;
  StartWrite(&writing_);
}

void Attempt::CloseWrites() {
  close_requested_ = true;
  if (!write_in_flight_) WriteNextLocked();
}

void Attempt::OnWriteDone(bool ok) {
  std::lock_guard<std::mutex> lock(owner_.mu_);
  write_in_flight_ = false;
  if (!ok) {  // the stream is broken; OnDone follows
    to_write_.clear();
    if (!writes_closed_) {
      writes_closed_ = true;
      RemoveHold();
    }
    return;
  }
  WriteNextLocked();
}

void Attempt::OnReadDone(bool ok) {
  if (!ok) {  // the daemon ended the call: release the hold so that OnDone can run
    std::lock_guard<std::mutex> lock(owner_.mu_);
    to_write_.clear();
    if (!writes_closed_) {
      writes_closed_ = true;
      RemoveHold();
    }
    return;
  }
  if (response_.has_hello_ack()) {
    std::lock_guard<std::mutex> lock(owner_.mu_);
    hello_acked_ = true;
    owner_.failures_ = 0;
    owner_.retry_after_ms_ = 0;
    owner_.OnHelloAck();
    owner_.MaybeCloseLocked();
  } else if (response_.has_ack()) {
    owner_.OnAck(response_.ack());
  }
  StartRead(&response_);
}

void Attempt::OnDone(const grpc::Status& status) {
  {
    std::lock_guard<std::mutex> lock(owner_.mu_);
    const auto& trailers = context_.GetServerTrailingMetadata();
    auto it = trailers.find("retry-after-ms");
    if (it != trailers.end()) {
      owner_.retry_after_ms_ = std::atoll(std::string(it->second.data(), it->second.size()).c_str());
    }
  }
  owner_.OnAttemptDone(status);
  delete this;
}

int64_t ReadStatusKb(int pid, const char* field) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field, 0) == 0) return std::atoll(line.c_str() + std::strlen(field));
  }
  return -1;
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5));
  std::nth_element(v.begin(), v.begin() + i, v.end());
  return v[i];
}

struct Verification {
  bool done = false;
  std::string error;
  uint64_t expected = 0, stored = 0, lost = 0, duplicated = 0;
};

// One point per acknowledged QK record in attention_entropy (layer, head -1) and
// per router record in router_entropy, per run and layer.
Verification Verify(const std::string& target, Report& report, const Config& config) {
  Verification v;
  auto stub = v1::Query::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  std::map<std::pair<std::string, int>, int64_t> qk_points, router_points;
  for (int r = 0; r < config.runs; ++r) {
    const std::string run = absl::StrCat(config.run_prefix, "-run", r);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::ListSeriesRequest request;
    request.set_run(run);
    v1::ListSeriesResponse response;
    const grpc::Status status = stub->ListSeries(&context, request, &response);
    if (!status.ok()) {
      if (status.error_code() == grpc::NOT_FOUND) continue;  // nothing stored for the run
      v.error = absl::StrCat("ListSeries(", run, "): ", status.error_message());
      return v;
    }
    for (const v1::SeriesInfo& s : response.series()) {
      if (s.head() != -1) continue;
      if (s.signal() == "attention_entropy") qk_points[{run, s.layer()}] = s.points();
      if (s.signal() == "router_entropy") router_points[{run, s.layer()}] = s.points();
    }
  }
  auto compare = [&v](const std::map<std::pair<std::string, int>, uint64_t>& acked,
                      const std::map<std::pair<std::string, int>, int64_t>& stored) {
    std::set<std::pair<std::string, int>> keys;
    for (const auto& [key, n] : acked) keys.insert(key);
    for (const auto& [key, n] : stored) keys.insert(key);
    for (const auto& key : keys) {
      const int64_t a = acked.count(key) ? int64_t(acked.at(key)) : 0;
      const int64_t s = stored.count(key) ? stored.at(key) : 0;
      v.expected += a;
      v.stored += s;
      if (s < a) v.lost += a - s;
      if (s > a) v.duplicated += s - a;
    }
  };
  std::lock_guard<std::mutex> lock(report.mu);
  compare(report.qk_by_layer, qk_points);
  compare(report.router_by_layer, router_points);
  v.done = true;
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Drives foreshockd with concurrent ingest streams (QK, router and scalar samples) and "
      "reports records/s, bytes/s, ack latency, rejections, the daemon's peak memory and "
      "whether any acknowledged record was lost.\n"
      "Example: foreshock_load --target=127.0.0.1:50051 --runs=32 --ranks_per_run=8 "
      "--duration_s=60 --daemon_pid=$(pidof foreshockd)");
  absl::ParseCommandLine(argc, argv);
  Config config{};
  config.runs = absl::GetFlag(FLAGS_runs);
  config.ranks_per_run = absl::GetFlag(FLAGS_ranks_per_run);
  config.layers_per_rank = absl::GetFlag(FLAGS_layers_per_rank);
  config.probe_every = absl::GetFlag(FLAGS_probe_every);
  config.heads = absl::GetFlag(FLAGS_heads);
  config.tokens = absl::GetFlag(FLAGS_tokens);
  config.head_dim = absl::GetFlag(FLAGS_head_dim);
  config.experts = absl::GetFlag(FLAGS_experts);
  config.top_k = absl::GetFlag(FLAGS_top_k);
  config.max_unacked = absl::GetFlag(FLAGS_max_unacked);
  config.steps_per_s = absl::GetFlag(FLAGS_steps_per_s);
  config.run_prefix = absl::GetFlag(FLAGS_run_prefix);
  if (config.run_prefix.empty()) {
    config.run_prefix = absl::StrCat("load-", getpid(), "-", time(nullptr));
  }
  if (config.runs < 1 || config.ranks_per_run < 1 || config.layers_per_rank < 1 ||
      config.probe_every < 1 || config.steps_per_s <= 0 || config.max_unacked < 1 ||
      config.heads < 1 || config.tokens < 1 || config.head_dim < 1 || config.experts < 2 ||
      config.top_k < 1 || config.top_k >= config.experts) {
    std::fprintf(stderr, "foreshock_load: invalid flags (see --help)\n");
    return 2;
  }
  const std::string target = absl::GetFlag(FLAGS_target);
  const int daemon_pid = absl::GetFlag(FLAGS_daemon_pid);
  const int n_streams = config.runs * config.ranks_per_run;

  const Payloads payloads(config);
  Report report;
  std::vector<std::unique_ptr<LoadStream>> streams;
  const uint64_t first_seq = 1;
  for (int i = 0; i < n_streams; ++i) {
    grpc::ChannelArguments args;
    // One TCP connection per stream, as one process per rank would have.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt("foreshock_load.stream", i);
    args.SetMaxReceiveMessageSize(16 << 20);
    streams.push_back(std::make_unique<LoadStream>(
        config, payloads, report,
        i, grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args), first_seq));
  }

  std::atomic<int64_t> peak_rss_kb{0};
  std::atomic<bool> sampling{daemon_pid > 0};
  std::thread sampler([&] {
    while (sampling.load()) {
      const int64_t kb = ReadStatusKb(daemon_pid, "VmRSS:");
      if (kb > peak_rss_kb.load()) peak_rss_kb.store(kb);
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  const int64_t rss_before_kb = daemon_pid > 0 ? ReadStatusKb(daemon_pid, "VmRSS:") : -1;

  const double duration_s = absl::GetFlag(FLAGS_duration_s);
  const auto start = Clock::now();
  const auto send_until =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(duration_s));
  std::fprintf(stderr, "foreshock_load: %d streams (%d runs x %d ranks) to %s for %.0f s\n",
               n_streams, config.runs, config.ranks_per_run, target.c_str(), duration_s);
  while (Clock::now() < send_until) {
    const auto now = Clock::now();
    for (auto& s : streams) s->Tick(now, true);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  const double send_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  // Drain: no new steps; reconnect and resend until every batch is acked.
  for (auto& s : streams) s->BeginClose();
  const auto drain_deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                 std::chrono::duration<double>(
                                                     absl::GetFlag(FLAGS_drain_timeout_s)));
  size_t unacked_at_end = 0;
  while (true) {
    bool all = true;
    for (auto& s : streams) {
      s->Tick(Clock::now(), false);
      all &= s->Finished();
    }
    if (all) break;
    if (Clock::now() > drain_deadline) {
      for (auto& s : streams) {
        unacked_at_end += s->Unacked();
        s->Cancel();
      }
      // A cancelled call ends promptly; every attempt must be gone before the
      // streams it points to are destroyed.
      while (!std::all_of(streams.begin(), streams.end(), [](auto& s) { return s->Idle(); })) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const double total_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  sampling.store(false);
  sampler.join();
  const int64_t hwm_kb = daemon_pid > 0 ? ReadStatusKb(daemon_pid, "VmHWM:") : -1;

  Verification verification;
  if (absl::GetFlag(FLAGS_verify)) verification = Verify(target, report, config);

  std::lock_guard<std::mutex> lock(report.mu);
  const uint64_t records = report.scalars_acked + report.qk_acked + report.router_acked;
  const double p50 = Percentile(report.ack_latency_ms, 0.50);
  const double p99 = Percentile(report.ack_latency_ms, 0.99);
  const double pmax = Percentile(report.ack_latency_ms, 1.0);
  std::string rejected_json, errors_json;
  for (const auto& [reason, n] : report.rejected) {
    absl::StrAppend(&rejected_json, rejected_json.empty() ? "" : ", ", "\"", reason, "\": ", n);
  }
  for (const auto& [reason, n] : report.stream_errors) {
    absl::StrAppend(&errors_json, errors_json.empty() ? "" : ", ", "\"", reason, "\": ", n);
  }
  const std::string json = absl::StrCat(
      "{\n  \"streams\": ", n_streams, ",\n  \"send_seconds\": ", send_seconds,
      ",\n  \"total_seconds\": ", total_seconds, ",\n  \"batches_sent\": ", report.batches_sent,
      ",\n  \"batches_acked\": ", report.batches_acked, ",\n  \"batches_resent\": ",
      report.batches_resent, ",\n  \"records_acked\": ", records, ",\n  \"scalars_acked\": ",
      report.scalars_acked, ",\n  \"qk_acked\": ", report.qk_acked, ",\n  \"router_acked\": ",
      report.router_acked, ",\n  \"duplicate_records\": ", report.duplicate_records,
      ",\n  \"records_per_s\": ", records / send_seconds, ",\n  \"bytes_acked\": ",
      report.bytes_acked, ",\n  \"bytes_per_s\": ", report.bytes_acked / send_seconds,
      ",\n  \"ack_latency_ms_p50\": ", p50, ",\n  \"ack_latency_ms_p99\": ", p99,
      ",\n  \"ack_latency_ms_max\": ", pmax, ",\n  \"daemon_rss_mb_before\": ",
      rss_before_kb / 1024.0, ",\n  \"daemon_rss_mb_peak\": ", peak_rss_kb.load() / 1024.0,
      ",\n  \"daemon_vmhwm_mb\": ", hwm_kb / 1024.0, ",\n  \"client_skipped_steps\": ",
      report.client_skipped, ",\n  \"reconnects\": ", report.reconnects,
      ",\n  \"rejected\": {", rejected_json, "},\n  \"stream_errors\": {", errors_json,
      "},\n  \"unacked_at_end\": ", unacked_at_end, ",\n  \"verified\": ",
      verification.done ? "true" : "false", ",\n  \"verify_error\": \"", verification.error,
      "\",\n  \"expected_points\": ", verification.expected, ",\n  \"stored_points\": ",
      verification.stored, ",\n  \"lost\": ", verification.lost, ",\n  \"duplicated\": ",
      verification.duplicated, "\n}\n");
  std::fputs(json.c_str(), stdout);
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    std::ofstream(path) << json;
  }
  if (absl::GetFlag(FLAGS_verify) && !verification.done) {
    std::fprintf(stderr, "foreshock_load: verification failed: %s\n", verification.error.c_str());
    return 2;
  }
  if (report.batches_acked == 0) {
    std::fprintf(stderr, "foreshock_load: no batch was acknowledged (is foreshockd at %s?)\n",
                 target.c_str());
    return 2;
  }
  return verification.lost == 0 && verification.duplicated == 0 ? 0 : 1;
}
