// `foreshockctl replay`: streams a recording (record/recording.h) into a
// daemon over foreshock.v1.Ingest/Stream, one stream per file. Each frame's
// payload is sent as is (the bytes the recording daemon received), in order;
// every response is read and checked: a HelloAck for the Hello, one Ack per
// Batch with the Batch's seq, in order.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "record/recording.h"

namespace foreshock::ctl {

enum class ReplaySpeed { kMax, kRealtime };

struct ReplayResult {
  std::string file;
  bool opened = false;  // the file is a readable recording
  std::string open_error;
  std::optional<int64_t> first_recv_unix_us;

  uint64_t frames = 0;   // whole frames read
  uint64_t hellos = 0;   // sent
  uint64_t batches = 0;  // sent
  uint64_t unparsed = 0;  // payloads that are not StreamRequests (sent all the same)
  uint64_t empty = 0;     // StreamRequests with neither hello nor batch
  uint64_t records = 0;   // records in the batches sent
  record::ReadStatus tail = record::ReadStatus::kEnd;  // how the file ended
  std::string tail_error;

  std::string session_id;  // from the HelloAck
  uint64_t hello_acks = 0;
  uint64_t acks = 0;
  uint64_t accepted = 0;
  uint64_t rejected = 0;
  std::map<std::string, uint64_t> rejection_reasons;  // by code (before the ": ")
  uint64_t ack_mismatches = 0;  // acks out of order, for an unknown seq, or unparseable
  uint64_t missing_acks = 0;    // batches never acked though the stream ended OK
  grpc::Status status;          // the stream's final status
  double seconds = 0;

  // The stream ended OK with every batch acked in order. Rejected records
  // are reported, not failures: the daemon judged them as it did live.
  bool ok() const;
  std::string Summary() const;  // one line for humans
  std::string Json() const;     // one JSON object
};

// Peeks at the receive time of the file's first frame (for --speed realtime
// across several files: they share the earliest first frame as time zero).
std::optional<int64_t> FirstFrameTime(const std::string& path);

// Replays one file. With kRealtime, the frame received at recv_us is sent at
// `start` + (recv_us - origin_unix_us).
ReplayResult ReplayFile(const std::shared_ptr<grpc::Channel>& channel, const std::string& path,
                        ReplaySpeed speed, int64_t origin_unix_us,
                        std::chrono::steady_clock::time_point start);

// The bearer token every call of this process carries (foreshockctl --token,
// --token_file or $FORESHOCK_TOKEN, for a daemon with --token_file); empty:
// none. Set once before the first call.
void SetCallToken(std::string token);
// Adds `authorization: Bearer <token>` to `context` when a token is set.
void AddCallToken(grpc::ClientContext& context);

}  // namespace foreshock::ctl
