#include "server/ingest/memory_guard.h"

#include <malloc.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include <spdlog/spdlog.h>

namespace foreshock::server {

MemoryGuard::MemoryGuard(int64_t limit_bytes, std::function<int64_t()> read_resident,
                         std::chrono::milliseconds interval)
    : limit_bytes_(limit_bytes), read_resident_(std::move(read_resident)), interval_(interval) {}

MemoryGuard::~MemoryGuard() { Stop(); }

void MemoryGuard::Start() {
  Sample();
  thread_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, interval_, [this] { return stop_; })) {
      lock.unlock();
      Sample();
      lock.lock();
    }
  });
}

void MemoryGuard::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void MemoryGuard::Sample() {
  int64_t resident = read_resident_();
  if (resident < 0) return;  // unreadable: keep the last state
  const int64_t resume_mark = resume_bytes();
  // Also while over and above the resume mark: ingest is refused then, so
  // memory would not climb back to the bound to trigger a trim.
  const int64_t reserved = reserved_bytes();
  const bool trim = limit_bytes_ > 0 && (resident + reserved >= limit_bytes_ ||
                                         (over_.load(std::memory_order_relaxed) &&
                                          resident + reserved >= resume_mark));
  if (trim) {
    // Freed heap that glibc keeps counts as resident; give it back before
    // refusing data (at most once a second: trimming walks the heap).
    const auto now = std::chrono::steady_clock::now();
    if (now - last_trim_ >= std::chrono::seconds(1)) {
      last_trim_ = now;
      malloc_trim(0);
      if (const int64_t after = read_resident_(); after >= 0) resident = after;
    }
  }
  resident_.store(resident, std::memory_order_relaxed);
  if (limit_bytes_ <= 0) return;
  const bool was_over = over_.load(std::memory_order_relaxed);
  // What streams may still bring counts as if it were here.
  const int64_t load = resident + reserved_bytes();
  bool over = was_over ? load >= resume_mark : load >= limit_bytes_;
  bool settled = false;
  if (was_over && over && in_flight_) {
    // Refusing probes frees what is in flight; once nothing is and memory
    // has stopped falling for kSettle, what stays is retained.
    const auto now = std::chrono::steady_clock::now();
    if (in_flight_() > 0) {
      idle_since_.reset();
    } else if (!idle_since_ || resident < idle_low_ - idle_low_ / 64) {
      idle_since_ = now;  // (again) nothing in flight, or memory still falling
      idle_low_ = resident;
    } else if (now - *idle_since_ >= kSettle) {
      over = false;
      settled = true;
    }
  }
  if (!over || !was_over) idle_since_.reset();
  if (over == was_over) return;
  over_.store(over, std::memory_order_relaxed);
  if (settled) {
    settled_resumes_.fetch_add(1, std::memory_order_relaxed);
    spdlog::warn("resident memory {} MiB has settled above the resume mark ({} MiB) with nothing "
                 "in flight: it is retained state (detector state of the runs' probes, caches), "
                 "so probes are accepted again; they are refused again if memory reaches "
                 "--max_memory_mb={}",
                 resident >> 20, resume_mark >> 20, limit_bytes_ >> 20);
  } else if (over) {
    times_over_.fetch_add(1, std::memory_order_relaxed);
    spdlog::warn("resident memory {} MiB, plus {} MiB reserved for the next batches of open "
                 "streams, reached --max_memory_mb={}: refusing probes (QK and router records, "
                 "and curvature with per-layer values, rejected with reason memory_limit; step "
                 "scalars are still accepted) until both are below {} MiB or memory has settled "
                 "with nothing in flight",
                 resident >> 20, reserved >> 20, limit_bytes_ >> 20, resume_mark >> 20);
  } else {
    spdlog::info("resident memory {} MiB is below the resume mark: ingest resumes",
                 resident >> 20);
  }
}

bool MemoryGuard::AdmitProbes(int64_t incoming_bytes) const {
  if (over_limit()) return false;
  if (limit_bytes_ <= 0 || incoming_bytes < kFreshCheckBytes) return true;
  const int64_t resident = read_resident_();  // one read of /proc/self/statm
  return resident < 0 || resident + incoming_bytes + reserved_bytes() < limit_bytes_;
}

int64_t MemoryGuard::ReadResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size_pages = 0, resident_pages = -1;
  if (!(statm >> size_pages >> resident_pages)) return -1;
  return resident_pages * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

namespace {
int64_t ReadLimitFile(const std::string& path) {
  std::ifstream in(path);
  std::string value;
  if (!(in >> value) || value == "max") return 0;
  try {
    const int64_t bytes = std::stoll(value);
    return bytes > 0 && bytes < (int64_t{1} << 50) ? bytes : 0;  // v1 says "none" with ~2^63
  } catch (...) {
    return 0;
  }
}

// The tightest memory limit on the way from this process's cgroup (from
// /proc/self/cgroup: a systemd unit's MemoryMax, a pod's limit) up to the
// root, cgroup v2 or v1; a container with its own cgroup namespace sees its
// limit at the top of /sys/fs/cgroup itself. 0: no limit.
int64_t ReadCgroupLimit() {
  int64_t tightest = 0;
  auto consider = [&tightest](int64_t bytes) {
    if (bytes > 0 && (tightest == 0 || bytes < tightest)) tightest = bytes;
  };
  std::ifstream cgroups("/proc/self/cgroup");
  std::string line;
  while (std::getline(cgroups, line)) {
    // "0::<path>" (v2) or "<n>:memory:<path>" (v1).
    std::string file, path;
    if (line.rfind("0::", 0) == 0) {
      path = line.substr(3);
      file = "/memory.max";
    } else if (const size_t at = line.find(":memory:"); at != std::string::npos) {
      path = line.substr(at + 8);
      file = "/memory.limit_in_bytes";
    } else {
      continue;
    }
    const std::string root = file == "/memory.max" ? "/sys/fs/cgroup" : "/sys/fs/cgroup/memory";
    while (true) {
      consider(ReadLimitFile(root + path + file));
      if (path.empty() || path == "/") break;
      path = path.substr(0, path.rfind('/'));
    }
  }
  consider(ReadLimitFile("/sys/fs/cgroup/memory.max"));
  consider(ReadLimitFile("/sys/fs/cgroup/memory/memory.limit_in_bytes"));
  return tightest;
}
}  // namespace

int64_t MemoryGuard::DefaultLimitBytes() {
  if (const int64_t cgroup = ReadCgroupLimit(); cgroup > 0) {
    return static_cast<int64_t>(0.85 * static_cast<double>(cgroup));
  }
  const int64_t pages = sysconf(_SC_PHYS_PAGES);
  const int64_t page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? pages * page / 2 : 0;
}

}  // namespace foreshock::server
