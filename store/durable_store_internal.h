// Constants and small helpers shared by the files that implement
// DurableSeriesStore (durable_store.cc, segment_recovery.cc,
// durable_store_write.cc, durable_store_read.cc, durable_store_retention.cc).
// Not part of the store's API.
#pragma once

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace foreshock::store::durable_internal {

// Splits huge batches so that no record comes near kMaxRecordPayloadBytes.
inline constexpr size_t kMaxPointsPerRecord = 8192;
inline constexpr size_t kMaxProblems = 256;

inline std::optional<uint64_t> ParseSegmentFileName(std::string_view name) {
  constexpr std::string_view kSuffix = ".seg";
  if (name.size() <= kSuffix.size() || !name.ends_with(kSuffix)) return std::nullopt;
  const std::string_view digits = name.substr(0, name.size() - kSuffix.size());
  if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return std::nullopt;
  }
  uint64_t sequence = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), sequence);
  if (ec != std::errc() || end != digits.data() + digits.size()) return std::nullopt;
  return sequence;
}

// A local id whose series definition was lost to damage.
inline constexpr uint32_t kUnknownSeries = ~uint32_t{0};

inline int64_t SteadyMillis() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Heap bytes of a string (short ones live inside the object).
inline size_t HeapBytes(const std::string& s) { return s.capacity() > 15 ? s.capacity() + 1 : 0; }

inline bool Overlaps(int64_t min_step, int64_t max_step, int64_t from_step, int64_t to_step) {
  return max_step >= from_step && min_step <= to_step;
}


}  // namespace foreshock::store::durable_internal
