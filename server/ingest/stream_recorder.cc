#include "server/ingest/stream_recorder.h"

#include <grpcpp/support/slice.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <filesystem>
#include <vector>

#include "absl/strings/str_cat.h"
#include "record/recording.h"

namespace foreshock::server {

struct StreamRecorder::File {
  uint64_t session = 0;
  std::string path;
  std::unique_ptr<record::RecordingWriter> writer;
  bool failed = false;     // frames from now on are dropped
  bool logged = false;     // the failure was logged
  uint64_t unflushed = 0;  // frames appended since the last successful flush
  uint64_t frames = 0;
  uint64_t bytes = 0;      // the file's size once flushed: header and frames
  bool bound_logged = false;  // a frame was dropped at the size bound (logged)
};

StreamRecorder::StreamRecorder(StreamRecorderOptions options, DaemonMetrics& metrics)
    : options_(std::move(options)),
      written_(metrics.record_frames_total.Add({{"outcome", "written"}})),
      dropped_(metrics.record_frames_total.Add({{"outcome", "dropped"}})),
      deleted_for_size_(metrics.record_files_deleted_total.Add({{"reason", "size"}})),
      deleted_for_age_(metrics.record_files_deleted_total.Add({{"reason", "age"}})),
      bytes_gauge_(metrics.record_bytes.Add({})) {
  std::error_code error;
  std::filesystem::create_directories(options_.dir, error);
  if (error) {
    spdlog::error("--record_dir {}: cannot create the directory: {}; streams will not be recorded",
                  options_.dir, error.message());
  } else {
    spdlog::info("recording ingest streams to {} (at most {} MiB{})", options_.dir,
                 options_.max_total_bytes >> 20,
                 options_.max_age.count() > 0
                     ? absl::StrCat(", closed recordings kept ", options_.max_age.count(), " s")
                     : std::string());
    ScanDirectory();
  }
  thread_ = std::thread([this] { Run(); });
}

StreamRecorder::~StreamRecorder() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_one();
  thread_.join();
}

std::string StreamRecorder::FileName(int64_t start_unix_us, std::string_view run, int rank,
                                     uint64_t session) {
  return record::CompactUtcTime(start_unix_us) + "-" + record::SanitizeForFileName(run) + "-rank" +
         (rank >= 0 ? std::to_string(rank) : std::string("NA")) + "-s" + std::to_string(session) +
         std::string(record::kRecordingExtension);
}

void StreamRecorder::Open(uint64_t session, std::string name) {
  Op op(Op::kOpen);
  op.session = session;
  op.name = std::move(name);
  Enqueue(std::move(op));
}

bool StreamRecorder::Record(uint64_t session, const grpc::ByteBuffer& message,
                            int64_t recv_unix_us, bool force) {
  Op op(Op::kFrame);
  op.session = session;
  op.message = message;  // shares the slices, copies no bytes
  op.recv_unix_us = recv_unix_us;
  op.bytes = message.Length();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!force && queued_bytes_ + op.bytes > options_.max_queued_bytes) {
      dropped_.Increment();
      return false;
    }
    queued_bytes_ += op.bytes;
    queue_.push_back(std::move(op));
  }
  wake_.notify_one();
  return true;
}

void StreamRecorder::Close(uint64_t session) {
  Op op(Op::kClose);
  op.session = session;
  Enqueue(std::move(op));
}

void StreamRecorder::Flush() {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t request = ++flush_requests_;
  queue_.push_back(Op(Op::kFlush));
  wake_.notify_one();
  flushed_.wait(lock, [&] { return flushes_done_ >= request; });
}

void StreamRecorder::Enqueue(Op op) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(op));
  }
  wake_.notify_one();
}

void StreamRecorder::Run() {
  std::map<uint64_t, std::unique_ptr<File>> files;
  auto last_flush = std::chrono::steady_clock::now();
  for (;;) {
    Op op;
    bool have_op = false;
    bool stop = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait_for(lock, options_.flush_interval, [&] { return stop_ || !queue_.empty(); });
      if (!queue_.empty()) {
        op = std::move(queue_.front());
        queue_.pop_front();
        have_op = true;
      }
      stop = stop_;
    }
    if (have_op) {
      Apply(op, files);
      if (op.bytes > 0) {
        std::lock_guard<std::mutex> lock(mu_);
        queued_bytes_ -= op.bytes;
      }
      if (op.kind == Op::kFlush) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          ++flushes_done_;
        }
        flushed_.notify_all();
      }
    }
    const auto now = std::chrono::steady_clock::now();
    if (now - last_flush >= options_.flush_interval) {
      for (auto& [session, file] : files) FlushFile(*file);
      last_flush = now;
    }
    if (options_.max_age.count() > 0 && now - last_expiry_check_ >= std::chrono::seconds(10)) {
      DeleteExpired();
      last_expiry_check_ = now;
    }
    if (stop && !have_op) break;
  }
  while (!files.empty()) {  // streams still open when the daemon stops
    Op close(Op::kClose);
    close.session = files.begin()->first;
    Apply(close, files);
  }
}

void StreamRecorder::Apply(Op& op, std::map<uint64_t, std::unique_ptr<File>>& files) {
  switch (op.kind) {
    case Op::kOpen: {
      auto file = std::make_unique<File>();
      file->session = op.session;
      file->writer = std::make_unique<record::RecordingWriter>(options_.file_buffer_bytes);
      std::string error;
      // Another daemon (or this one before a restart) may have used the name.
      const std::filesystem::path dir(options_.dir);
      std::string stem = op.name, extension;
      if (const size_t dot = stem.rfind('.'); dot != std::string::npos) {
        extension = stem.substr(dot);
        stem.resize(dot);
      }
      for (int attempt = 1;; ++attempt) {
        file->path = (dir / (attempt == 1 ? op.name : absl::StrCat(stem, "-", attempt, extension)))
                         .string();
        if (file->writer->Create(file->path, &error)) {
          file->bytes = record::kFileHeaderBytes;
          total_bytes_ += file->bytes;
          bytes_gauge_.Set(static_cast<double>(total_bytes_));
          break;
        }
        std::error_code ec;
        if (attempt >= 100 || !std::filesystem::exists(file->path, ec)) {
          file->failed = true;
          file->logged = true;
          spdlog::error("recording of stream s{}: {}; its messages are dropped", op.session, error);
          break;
        }
      }
      files[op.session] = std::move(file);
      return;
    }
    case Op::kFrame: {
      auto it = files.find(op.session);
      if (it == files.end()) {
        dropped_.Increment();
        return;
      }
      File& file = *it->second;
      if (file.failed) {
        dropped_.Increment();
        return;
      }
      const uint64_t frame_bytes = record::kFrameHeaderBytes + op.bytes;
      if (!MakeRoom(frame_bytes)) {
        dropped_.Increment();
        if (!file.bound_logged) {
          file.bound_logged = true;
          spdlog::warn("recording of stream s{}: --record_max_mb reached with only open "
                       "recordings left; its further messages are not recorded (the file so far "
                       "is intact)", file.session);
        }
        return;
      }
      std::vector<grpc::Slice> slices;
      if (op.bytes > 0 && !op.message.Dump(&slices).ok()) {
        Drop(file, 1, "cannot read the received message's bytes");
        return;
      }
      std::vector<std::string_view> parts;
      parts.reserve(slices.size());
      for (const grpc::Slice& slice : slices) {
        parts.emplace_back(reinterpret_cast<const char*>(slice.begin()), slice.size());
      }
      std::string error;
      if (!file.writer->Append(parts.data(), parts.size(), op.recv_unix_us, &error)) {
        Drop(file, file.unflushed + 1, error);
        file.unflushed = 0;
        return;
      }
      ++file.unflushed;
      ++file.frames;
      file.bytes += frame_bytes;
      total_bytes_ += frame_bytes;
      bytes_gauge_.Set(static_cast<double>(total_bytes_));
      return;
    }
    case Op::kClose: {
      auto it = files.find(op.session);
      if (it == files.end()) return;
      File& file = *it->second;
      FlushFile(file);
      std::string error;
      if (!file.failed && !file.writer->Close(&error)) Drop(file, 0, error);
      if (!file.failed) {
        spdlog::info("stream s{} recorded to {} ({} messages)", file.session, file.path,
                     file.frames);
      }
      // What is on disk now is what retention counts and may delete.
      std::error_code ec;
      const uint64_t on_disk = file.bytes > 0 ? std::filesystem::file_size(file.path, ec) : 0;
      total_bytes_ = total_bytes_ - file.bytes + (ec ? 0 : on_disk);
      if (file.bytes > 0 && !ec) {
        closed_.push_back({file.path, on_disk, std::filesystem::last_write_time(file.path, ec)});
      }
      bytes_gauge_.Set(static_cast<double>(total_bytes_));
      files.erase(it);
      return;
    }
    case Op::kFlush:
      for (auto& [session, file] : files) FlushFile(*file);
      return;
  }
}

void StreamRecorder::FlushFile(File& file) {
  if (file.failed || !file.writer || file.unflushed == 0) return;
  std::string error;
  if (file.writer->Flush(&error)) {
    written_.Increment(static_cast<double>(file.unflushed));
  } else {
    Drop(file, file.unflushed, error);
  }
  file.unflushed = 0;
}

void StreamRecorder::ScanDirectory() {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(options_.dir, ec)) {
    std::error_code entry_ec;
    if (!entry.is_regular_file(entry_ec) ||
        entry.path().extension() != record::kRecordingExtension) {
      continue;
    }
    Closed closed{entry.path().string(), entry.file_size(entry_ec), entry.last_write_time(entry_ec)};
    if (entry_ec) continue;
    total_bytes_ += closed.bytes;
    closed_.push_back(std::move(closed));
  }
  std::sort(closed_.begin(), closed_.end(),
            [](const Closed& a, const Closed& b) { return a.modified < b.modified; });
  bytes_gauge_.Set(static_cast<double>(total_bytes_));
  if (options_.max_total_bytes > 0 && total_bytes_ > options_.max_total_bytes) {
    MakeRoom(0);
  }
}

bool StreamRecorder::MakeRoom(uint64_t incoming) {
  if (options_.max_total_bytes == 0) return true;
  while (total_bytes_ + incoming > options_.max_total_bytes && !closed_.empty()) {
    const Closed oldest = closed_.front();
    closed_.pop_front();
    DeleteClosed(oldest, "size");
  }
  return total_bytes_ + incoming <= options_.max_total_bytes;
}

void StreamRecorder::DeleteExpired() {
  const auto cutoff = std::filesystem::file_time_type::clock::now() - options_.max_age;
  while (!closed_.empty() && closed_.front().modified < cutoff) {
    const Closed oldest = closed_.front();
    closed_.pop_front();
    DeleteClosed(oldest, "age");
  }
}

void StreamRecorder::DeleteClosed(const Closed& closed, const char* reason) {
  std::error_code ec;
  std::filesystem::remove(closed.path, ec);
  if (ec) {
    spdlog::warn("--record_dir retention: cannot delete {}: {}", closed.path, ec.message());
  } else {
    (std::string_view(reason) == "age" ? deleted_for_age_ : deleted_for_size_).Increment();
    spdlog::info("--record_dir retention: deleted {} ({} bytes, {})", closed.path, closed.bytes,
                 std::string_view(reason) == "age" ? "older than --record_max_age_h"
                                                   : "over --record_max_mb");
  }
  // Counted out either way: a file that cannot be deleted is not retried forever.
  total_bytes_ -= std::min(total_bytes_, closed.bytes);
  bytes_gauge_.Set(static_cast<double>(total_bytes_));
}

void StreamRecorder::Drop(File& file, uint64_t frames, const std::string& why) {
  dropped_.Increment(static_cast<double>(frames));
  file.failed = true;
  if (!file.logged) {
    file.logged = true;
    spdlog::error("recording of stream s{} stopped: {}; its further messages are dropped "
                  "(foreshock_record_frames_total{{outcome=\"dropped\"}})",
                  file.session, why);
  }
}

}  // namespace foreshock::server
