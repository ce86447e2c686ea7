// Helpers for the store tests: scratch directories, file surgery, and a
// reference model that says what Range must return.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "store/series_store.h"

namespace foreshock::store::testing {

namespace fs = std::filesystem;

// A fresh directory under gtest's temp dir, removed at scope exit.
class ScratchDir {
 public:
  ScratchDir() {
    std::string pattern = ::testing::TempDir() + "foreshock_store_XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) ADD_FAILURE() << "mkdtemp failed";
    path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string Sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline std::vector<std::string> SegmentFiles(const std::string& data_dir) {
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(data_dir + "/segments")) {
    files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

inline void CopyDir(const std::string& from, const std::string& to) {
  fs::remove_all(to);
  fs::copy(from, to, fs::copy_options::recursive);
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

inline void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline void FlipByte(const std::string& path, size_t offset, uint8_t mask = 0xFF) {
  std::string bytes = ReadFile(path);
  ASSERT_LT(offset, bytes.size());
  bytes[offset] = static_cast<char>(bytes[offset] ^ mask);
  WriteFile(path, bytes);
}

inline SeriesKey Key(const std::string& run, const std::string& signal, int layer = -1,
                     int head = -1) {
  return SeriesKey{run, signal, layer, head};
}

inline std::string KeyName(const SeriesKey& k) {
  return k.run + "/" + k.signal + "/" + std::to_string(k.layer) + "/" + std::to_string(k.head);
}

inline bool SamePoint(const Point& a, const Point& b) {
  // Bitwise value equality: NaN payloads and -0.0 must survive too.
  return a.step == b.step && a.wall_time_ms == b.wall_time_ms &&
         std::memcmp(&a.value, &b.value, sizeof(double)) == 0;
}

inline ::testing::AssertionResult SamePoints(const std::vector<Point>& expected,
                                             const std::vector<Point>& actual) {
  if (expected.size() != actual.size()) {
    return ::testing::AssertionFailure()
           << "expected " << expected.size() << " points, got " << actual.size();
  }
  for (size_t i = 0; i < expected.size(); ++i) {
    if (!SamePoint(expected[i], actual[i])) {
      return ::testing::AssertionFailure()
             << "point " << i << ": expected step " << expected[i].step << " value "
             << expected[i].value << " wall " << expected[i].wall_time_ms << ", got step "
             << actual[i].step << " value " << actual[i].value << " wall "
             << actual[i].wall_time_ms;
    }
  }
  return ::testing::AssertionSuccess();
}

// Everything appended, in arrival order, per series.
class ReferenceModel {
 public:
  void Add(const std::vector<KeyedPoint>& batch) {
    for (const auto& [key, point] : batch) {
      auto [it, inserted] = series_.try_emplace(KeyName(key), Entry{key, {}});
      it->second.points.push_back(point);
    }
  }
  std::vector<Point> Range(const SeriesKey& key, int64_t from, int64_t to) const {
    std::vector<Point> out;
    auto it = series_.find(KeyName(key));
    if (it == series_.end()) return out;
    for (const Point& p : it->second.points) {
      if (p.step >= from && p.step <= to) out.push_back(p);
    }
    std::stable_sort(out.begin(), out.end(),
                     [](const Point& a, const Point& b) { return a.step < b.step; });
    return out;
  }
  std::vector<SeriesKey> Keys() const {
    std::vector<SeriesKey> keys;
    for (const auto& [name, entry] : series_) keys.push_back(entry.key);
    return keys;
  }
  size_t TotalPoints() const {
    size_t n = 0;
    for (const auto& [name, entry] : series_) n += entry.points.size();
    return n;
  }

 private:
  struct Entry {
    SeriesKey key;
    std::vector<Point> points;
  };
  std::map<std::string, Entry> series_;
};

}  // namespace foreshock::store::testing
