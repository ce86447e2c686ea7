#include "ctl/replay.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/impl/codegen/proto_utils.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include <nlohmann/json.hpp>

#include "foreshock/v1/ingest.pb.h"

namespace foreshock::ctl {
namespace {

namespace v1 = foreshock::v1;

constexpr char kStreamMethod[] = "/foreshock.v1.Ingest/Stream";

// One bidirectional stream with blocking writes (one outstanding, as gRPC
// allows) and responses checked as they arrive on gRPC's threads.
class ReplayReactor final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  explicit ReplayReactor(ReplayResult& result) : result_(result) {}

  void Start(grpc::GenericStub& stub) {
    AddCallToken(context_);
    stub.PrepareBidiStreamingCall(&context_, kStreamMethod, grpc::StubOptions(), this);
    AddHold();  // no OnDone before Finish: writes stay valid even on a dead stream
    StartRead(&response_);
    StartCall();
  }

  // What the daemon must answer to the message about to be sent.
  void Expect(std::optional<uint64_t> batch_seq, bool hello) {
    std::lock_guard<std::mutex> lock(mu_);
    if (hello) ++expected_hello_acks_;
    if (batch_seq) expected_seqs_.push_back(*batch_seq);
  }

  // Blocks until the write completes; false once the stream is broken.
  bool Write(const std::string& payload) {
    grpc::Slice slice(payload);
    grpc::ByteBuffer buffer(&slice, 1);
    std::unique_lock<std::mutex> lock(mu_);
    write_done_ = false;
    StartWrite(&buffer);
    cv_.wait(lock, [&] { return write_done_; });
    return write_ok_;
  }

  // Half-closes (after a good last write) and waits for the final status.
  grpc::Status Finish(bool half_close) {
    if (half_close) StartWritesDone();
    RemoveHold();
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_; });
    result_.missing_acks = expected_seqs_.size();
    return status_;
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    write_ok_ = ok;
    write_done_ = true;
    cv_.notify_all();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream is ending; OnDone follows
    v1::StreamResponse response;
    const bool parsed =
        grpc::SerializationTraits<v1::StreamResponse>::Deserialize(&response_, &response).ok();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!parsed) {
        ++result_.ack_mismatches;
      } else if (response.has_hello_ack()) {
        ++result_.hello_acks;
        result_.session_id = response.hello_ack().session_id();
        if (expected_hello_acks_ == 0) ++result_.ack_mismatches;
        else --expected_hello_acks_;
      } else if (response.has_ack()) {
        const v1::Ack& ack = response.ack();
        ++result_.acks;
        result_.accepted += ack.accepted();
        // The daemon lists at most 256 rejections and counts the rest by code.
        result_.rejected += static_cast<uint64_t>(ack.rejections_size()) + ack.omitted_rejections();
        for (const v1::Rejection& rejection : ack.rejections()) {
          const std::string& reason = rejection.reason();
          ++result_.rejection_reasons[reason.substr(0, reason.find(':'))];
        }
        for (const auto& [code, count] : ack.omitted_by_reason()) {
          result_.rejection_reasons[code] += count;
        }
        if (expected_seqs_.empty() || expected_seqs_.front() != ack.seq()) {
          ++result_.ack_mismatches;
        } else {
          expected_seqs_.pop_front();
        }
      } else {
        ++result_.ack_mismatches;
      }
    }
    StartRead(&response_);
  }

  void OnDone(const grpc::Status& status) override {
    std::lock_guard<std::mutex> lock(mu_);
    status_ = status;
    done_ = true;
    write_done_ = true;  // a writer still waiting gives up
    cv_.notify_all();
  }

 private:
  ReplayResult& result_;
  grpc::ClientContext context_;
  grpc::ByteBuffer response_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool write_done_ = false;
  bool write_ok_ = false;
  bool done_ = false;
  grpc::Status status_;
  uint64_t expected_hello_acks_ = 0;
  std::deque<uint64_t> expected_seqs_;
};

}  // namespace

bool ReplayResult::ok() const {
  return opened && tail != record::ReadStatus::kError && status.ok() && ack_mismatches == 0 &&
         missing_acks == 0 && hello_acks == hellos;
}

std::string ReplayResult::Summary() const {
  if (!opened) return file + ": " + open_error;
  std::string text = file + ": sent " + std::to_string(hellos + batches + unparsed + empty) +
                     " messages (" + std::to_string(hellos) + " hello, " +
                     std::to_string(batches) + " batches, " + std::to_string(records) +
                     " records";
  if (unparsed) text += ", " + std::to_string(unparsed) + " unparseable";
  if (empty) text += ", " + std::to_string(empty) + " empty";
  char seconds_text[32];
  std::snprintf(seconds_text, sizeof(seconds_text), "%.2f", seconds);
  text += ") in " + std::string(seconds_text) + " s; acks " + std::to_string(acks) +
          ": accepted " + std::to_string(accepted) + ", rejected " + std::to_string(rejected);
  if (!rejection_reasons.empty()) {
    text += " (";
    bool first = true;
    for (const auto& [reason, n] : rejection_reasons) {
      text += (first ? "" : ", ") + reason + " " + std::to_string(n);
      first = false;
    }
    text += ")";
  }
  if (ack_mismatches) text += "; " + std::to_string(ack_mismatches) + " unexpected responses";
  if (missing_acks) text += "; " + std::to_string(missing_acks) + " batches never acked";
  if (hello_acks != hellos) text += "; no HelloAck";
  text += "; stream ";
  text += status.ok() ? std::string("OK")
                      : "failed: " + std::to_string(static_cast<int>(status.error_code())) + " " +
                            status.error_message();
  if (tail == record::ReadStatus::kTruncated) text += "; the recording ends in a torn frame: " + tail_error;
  if (tail == record::ReadStatus::kError) text += "; replay stopped at a bad frame: " + tail_error;
  return text;
}

std::string ReplayResult::Json() const {
  nlohmann::json j;
  j["file"] = file;
  j["ok"] = ok();
  if (!opened) {
    j["error"] = open_error;
    return j.dump();
  }
  j["frames"] = frames;
  j["hellos"] = hellos;
  j["batches"] = batches;
  j["records"] = records;
  j["unparsed"] = unparsed;
  j["empty"] = empty;
  j["tail"] = record::ReadStatusName(tail);
  if (!tail_error.empty()) j["tail_error"] = tail_error;
  j["session_id"] = session_id;
  j["hello_acks"] = hello_acks;
  j["acks"] = acks;
  j["accepted"] = accepted;
  j["rejected"] = rejected;
  j["rejection_reasons"] = rejection_reasons;
  j["ack_mismatches"] = ack_mismatches;
  j["missing_acks"] = missing_acks;
  j["status_code"] = static_cast<int>(status.error_code());
  j["status_message"] = status.error_message();
  j["seconds"] = seconds;
  return j.dump();
}

std::optional<int64_t> FirstFrameTime(const std::string& path) {
  record::RecordingReader reader;
  if (!reader.Open(path)) return std::nullopt;
  record::Frame frame;
  if (reader.Next(&frame) != record::ReadStatus::kFrame) return std::nullopt;
  return frame.recv_unix_us;
}

namespace {
std::string& CallToken() {
  static std::string token;
  return token;
}
}  // namespace

void SetCallToken(std::string token) { CallToken() = std::move(token); }

void AddCallToken(grpc::ClientContext& context) {
  if (!CallToken().empty()) context.AddMetadata("authorization", "Bearer " + CallToken());
}

ReplayResult ReplayFile(const std::shared_ptr<grpc::Channel>& channel, const std::string& path,
                        ReplaySpeed speed, int64_t origin_unix_us,
                        std::chrono::steady_clock::time_point start) {
  ReplayResult result;
  result.file = path;
  record::RecordingReader reader;
  if (!reader.Open(path)) {
    result.open_error = reader.error();
    return result;
  }
  result.opened = true;
  const auto began = std::chrono::steady_clock::now();

  grpc::GenericStub stub(channel);
  ReplayReactor reactor(result);
  reactor.Start(stub);
  bool stream_ok = true;
  record::Frame frame;
  v1::StreamRequest request;
  for (;;) {
    const record::ReadStatus status = reader.Next(&frame);
    if (status != record::ReadStatus::kFrame) {
      result.tail = status;
      result.tail_error = reader.error();
      break;
    }
    ++result.frames;
    if (speed == ReplaySpeed::kRealtime && frame.recv_unix_us > origin_unix_us) {
      std::this_thread::sleep_until(start +
                                    std::chrono::microseconds(frame.recv_unix_us - origin_unix_us));
    }
    std::optional<uint64_t> seq;
    bool hello = false;
    if (!request.ParseFromString(frame.payload)) {
      ++result.unparsed;
    } else if (request.has_hello()) {
      hello = true;
      ++result.hellos;
    } else if (request.has_batch()) {
      seq = request.batch().seq();
      ++result.batches;
      result.records += static_cast<uint64_t>(request.batch().records_size());
    } else {
      ++result.empty;
    }
    reactor.Expect(seq, hello);
    if (!reactor.Write(frame.payload)) {
      stream_ok = false;  // the daemon ended the stream; its status says why
      break;
    }
  }
  result.status = reactor.Finish(stream_ok);
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  if (!result.status.ok()) result.missing_acks = 0;  // moot: the failure is the status
  return result;
}

}  // namespace foreshock::ctl
