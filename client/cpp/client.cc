#include "foreshock/client.h"

#include <bit>
#include <chrono>
#include <cstring>
#include <random>

namespace foreshock::client {

namespace v1 = foreshock::v1;

uint16_t FloatToBFloat16(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

uint16_t FloatToHalf(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;                 // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;                // overflow (>= 65520) -> inf
  if (abs < 0x38800000u) {                                      // subnormal or zero in half
    if (abs < 0x33000000u) return sign;                         // below half of the smallest subnormal
    const uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
    const int shift = 126 - static_cast<int>(abs >> 23);        // 14..24
    uint32_t half = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (half & 1u))) ++half;
    return sign | static_cast<uint16_t>(half);
  }
  uint32_t half = ((abs >> 23) - 112) << 10 | ((abs >> 13) & 0x3ffu);
  const uint32_t rest = abs & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;
  return sign | static_cast<uint16_t>(half);
}

v1::Tensor MakeTensor(v1::DType dtype, std::vector<int64_t> shape, const float* values,
                      size_t count) {
  v1::Tensor tensor;
  tensor.set_dtype(dtype);
  for (int64_t d : shape) tensor.add_shape(d);
  std::string* data = tensor.mutable_data();
  if (dtype == v1::FLOAT32) {
    data->resize(count * 4);
    std::memcpy(data->data(), values, count * 4);  // x86 and ARM are little-endian
  } else {
    data->resize(count * 2);
    for (size_t i = 0; i < count; ++i) {
      const uint16_t h = dtype == v1::BFLOAT16 ? FloatToBFloat16(values[i]) : FloatToHalf(values[i]);
      std::memcpy(data->data() + 2 * i, &h, 2);
    }
  }
  return tensor;
}

namespace {
uint64_t RandomSenderId() {
  std::random_device device;
  std::mt19937_64 rng((uint64_t{device()} << 32) ^ device());
  return std::uniform_int_distribution<uint64_t>(1)(rng);
}
}  // namespace

SenderState::SenderState(size_t max_unacked_bytes)
    : max_unacked_bytes_(max_unacked_bytes),
      sender_id_(RandomSenderId()),
      next_seq_(static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                          std::chrono::system_clock::now().time_since_epoch())
                                          .count())) {}

uint64_t SenderState::first_seq() const {
  return unacked_.empty() ? next_seq_ : unacked_.begin()->first;
}

uint64_t SenderState::Assign(v1::Batch& batch) {
  const uint64_t seq = next_seq_++;
  batch.set_seq(seq);
  const size_t size = batch.ByteSizeLong();
  while (!unacked_.empty() && unacked_bytes_ + size > max_unacked_bytes_) {
    auto oldest = unacked_.begin();
    unacked_bytes_ -= oldest->second.ByteSizeLong();
    dropped_records_ += static_cast<uint64_t>(oldest->second.records_size());
    unacked_.erase(oldest);
  }
  unacked_.emplace(seq, batch);
  unacked_bytes_ += size;
  return seq;
}

void SenderState::Settle(const v1::Ack& ack) {
  auto it = unacked_.find(ack.seq());
  if (it == unacked_.end()) return;
  unacked_bytes_ -= it->second.ByteSizeLong();
  unacked_.erase(it);
}

IngestStream::IngestStream(std::shared_ptr<grpc::Channel> channel)
    : stub_(v1::Ingest::NewStub(channel)) {}

IngestStream::~IngestStream() {
  if (stream_ && !closed_) {
    context_->TryCancel();
    stream_->Finish();
  }
}

grpc::Status IngestStream::Open(const v1::Hello& hello) {
  context_ = std::make_unique<grpc::ClientContext>();
  stream_ = stub_->Stream(context_.get());
  v1::StreamRequest request;
  *request.mutable_hello() = hello;
  v1::StreamResponse response;
  if (!stream_->Write(request) || !stream_->Read(&response) || !response.has_hello_ack()) {
    closed_ = true;
    stream_->WritesDone();
    grpc::Status status = stream_->Finish();
    return status.ok() ? grpc::Status(grpc::StatusCode::INTERNAL, "no HelloAck") : status;
  }
  session_id_ = response.hello_ack().session_id();
  return grpc::Status::OK;
}

grpc::Status IngestStream::Open(const v1::Hello& hello, SenderState* sender) {
  v1::Hello with_seq = hello;
  with_seq.set_first_seq(sender->first_seq());
  with_seq.set_sender_id(sender->sender_id());
  grpc::Status status = Open(with_seq);
  if (!status.ok()) return status;
  sender_ = sender;
  for (const auto& [seq, batch] : sender->unacked()) {
    v1::StreamRequest request;
    *request.mutable_batch() = batch;
    if (!stream_->Write(request)) break;  // broken: the next stream resends
  }
  return grpc::Status::OK;
}

bool IngestStream::Send(v1::Batch batch, std::optional<uint64_t> seq) {
  if (sender_ != nullptr && !seq) seq = sender_->Assign(batch);
  batch.set_seq(seq.value_or(next_seq_));
  next_seq_ = std::max(next_seq_, batch.seq() + 1);
  v1::StreamRequest request;
  *request.mutable_batch() = std::move(batch);
  return stream_->Write(request);
}

std::optional<v1::Ack> IngestStream::ReadAck() {
  v1::StreamResponse response;
  while (stream_->Read(&response)) {
    if (!response.has_ack()) continue;
    if (sender_ != nullptr) sender_->Settle(response.ack());
    return response.ack();
  }
  return std::nullopt;
}

std::optional<v1::Ack> IngestStream::SendAndWait(v1::Batch batch, std::optional<uint64_t> seq) {
  if (!Send(std::move(batch), seq)) return std::nullopt;
  return ReadAck();
}

grpc::Status IngestStream::Close() {
  if (closed_) return grpc::Status::OK;
  closed_ = true;
  stream_->WritesDone();
  v1::StreamResponse response;
  while (stream_->Read(&response)) {
    if (sender_ != nullptr && response.has_ack()) sender_->Settle(response.ack());
  }
  return stream_->Finish();
}

}  // namespace foreshock::client
