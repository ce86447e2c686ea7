#pragma once

#include <chrono>
#include <cstdint>

namespace foreshock::server {

// Wall-clock time as Unix epoch milliseconds (series points, alert times).
inline int64_t NowUnixMillis() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace foreshock::server
