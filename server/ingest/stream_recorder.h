// foreshockd --record_dir: every ingest stream is recorded, message by
// message and byte for byte, to its own file (record/recording.h):
//
//   <record_dir>/<UTC yyyymmddThhmmss>-<run>-rank<rank>-s<session>.fsrec
//
// Reactor threads only enqueue (a reference to the gRPC ByteBuffer's slices,
// no copy); one background thread writes and flushes the files. The queue is
// bounded in bytes: when the disk does not keep up, or a file cannot be
// created or written, frames are dropped, counted in
// foreshock_record_frames_total{outcome="dropped"} and logged once per
// stream. Recording never fails or stalls a stream.
//
// Retention (issue 36): the directory's recordings, closed and open, stay
// within max_total_bytes. Closed recordings go first, oldest first (those
// already in the directory at start included), and those older than max_age;
// an open recording is never deleted: when only open ones are left and the
// next frame would pass the bound, that frame is dropped (logged once per
// stream), so a live recording is always a complete prefix of its stream.
#pragma once

#include <grpcpp/support/byte_buffer.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "server/common/metrics.h"

namespace foreshock::server {

struct StreamRecorderOptions {
  StreamRecorderOptions() = default;
  StreamRecorderOptions(std::string directory) : dir(std::move(directory)) {}  // NOLINT: implicit
  std::string dir;
  // Bytes of received messages waiting for the writer thread, all streams together.
  size_t max_queued_bytes = size_t{64} << 20;
  // Write buffer per open file.
  size_t file_buffer_bytes = size_t{256} << 10;
  // Open files are flushed to the kernel at least this often while idle.
  std::chrono::milliseconds flush_interval{200};
  // Bytes of *.fsrec files in `dir` (0: no bound).
  uint64_t max_total_bytes = 0;
  // Closed recordings older than this (by modification time) are deleted
  // (0: kept).
  std::chrono::seconds max_age{0};
};

class StreamRecorder {
 public:
  StreamRecorder(StreamRecorderOptions options, DaemonMetrics& metrics);
  // Writes out everything queued and closes every file.
  ~StreamRecorder();
  StreamRecorder(const StreamRecorder&) = delete;
  StreamRecorder& operator=(const StreamRecorder&) = delete;

  // The file name (without directory) for a stream: `run` is sanitized for
  // file names; `rank` < 0 is written "NA".
  static std::string FileName(int64_t start_unix_us, std::string_view run, int rank,
                              uint64_t session);

  // Starts the recording of stream `session` in file `name` (FileName()).
  void Open(uint64_t session, std::string name);
  // Queues one received message. False when it was dropped (the queue is
  // full); `force` queues it regardless (a stream's first message, so that a
  // recording always starts with what the stream started with).
  bool Record(uint64_t session, const grpc::ByteBuffer& message, int64_t recv_unix_us,
              bool force = false);
  // The stream ended: its file is flushed and closed.
  void Close(uint64_t session);

  // Blocks until everything queued so far is written and flushed (tests).
  void Flush();

  const std::string& dir() const { return options_.dir; }

 private:
  struct Op {
    enum Kind { kOpen, kFrame, kClose, kFlush };
    Op() = default;
    explicit Op(Kind k) : kind(k) {}
    Kind kind = kFlush;
    uint64_t session = 0;
    std::string name;          // kOpen
    grpc::ByteBuffer message;  // kFrame
    int64_t recv_unix_us = 0;  // kFrame
    size_t bytes = 0;          // kFrame
  };
  struct File;
  // A closed recording that retention may delete.
  struct Closed {
    std::string path;
    uint64_t bytes = 0;
    std::filesystem::file_time_type modified;
  };

  void Enqueue(Op op);
  // The *.fsrec files already in the directory, oldest first.
  void ScanDirectory();
  // Deletes closed recordings, oldest first, until `incoming` more bytes fit
  // the bound. False when they do not fit even with none left.
  bool MakeRoom(uint64_t incoming);
  void DeleteExpired();
  void DeleteClosed(const Closed& closed, const char* reason);
  void Run();
  void Apply(Op& op, std::map<uint64_t, std::unique_ptr<File>>& files);
  void FlushFile(File& file);
  void Drop(File& file, uint64_t frames, const std::string& why);

  const StreamRecorderOptions options_;
  prometheus::Counter& written_;
  prometheus::Counter& dropped_;
  prometheus::Counter& deleted_for_size_;
  prometheus::Counter& deleted_for_age_;
  prometheus::Gauge& bytes_gauge_;

  // Writer thread only: closed recordings oldest first, and the bytes of
  // every recording in the directory (closed and open).
  std::deque<Closed> closed_;
  uint64_t total_bytes_ = 0;
  std::chrono::steady_clock::time_point last_expiry_check_{};

  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable flushed_;
  std::deque<Op> queue_;
  size_t queued_bytes_ = 0;
  uint64_t flush_requests_ = 0;
  uint64_t flushes_done_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace foreshock::server
