// DurableSeriesStore: the series store on disk, as an append-only log.
//
// Layout under the data directory:
//   LOCK                      flock'ed while open: one process per directory
//   segments/00000001.seg     the log, rolled at segment_bytes (format:
//                             store/record_format.h, points: store/point_codec.h)
//   checkpoints/<name>.ckpt   atomic named blobs (store/checkpoint.h)
//
// Writes: every AppendBatch becomes one kPoints record (plus a kSeriesDef for
// each series new to the segment), written with one pwrite. Durability
// follows FsyncPolicy; with kEvery, data is on disk when AppendBatch returns
// (concurrent appenders share fsyncs: group commit).
//
// Recovery (Open) never fails on segment contents or a full disk, only on a
// held lock or an unreadable directory: every record's CRC32C is checked,
// damage is skipped to the next record that checks out (a flipped bit costs
// its own block), only a tail with no valid record after it is cut, and a
// segment with no valid record is quarantined; what was lost is reported
// (Problems, Stats). Write errors (ENOSPC, EIO, a failed fsync with kEvery)
// refuse the append, lose nothing written before it, and WriteHealth()
// reports them until a retry succeeds. The contract, and why, is
// docs/DESIGN.md §2.6; the passes are store/segment_recovery.cc.
//
// Reads: each series keeps its most recent `cache_points_per_series` points in
// memory; older points are read back from the segment files. Point encoding
// restarts every `block_bytes`, and a per-series, per-segment index (step
// range, point count, block range) says which blocks to decode.
//
// Memory bound (what ApproxMemoryBytes adds up), with S series, G segments
// retained, B blocks per segment, E bytes of retained events:
//   S x (cache_points_per_series x 32 B + ~300 B + twice the key's strings)
//   + 48 B per (series, segment it appears in)            (index spans)
//   + G x (B x 32 B + 4 B per series defined in it + ~250 B)
//   + E + 32 B per retained event
// With the default 2048-point cache that is ~66 KB per series, measured
// (tests/bench/store_bench.cc, docs/PERFORMANCE.md). Segment data is not
// otherwise held in memory (the kernel's page cache aside).
//
// Retention drops whole segments, oldest first, never the one being written:
// while the total size is over retention_max_bytes, and while the oldest
// segment's newest wall time is older than retention_max_age. It runs on
// open, on every segment roll and every retention_check_interval.
//
// Thread-safe: appenders serialize on one mutex for encoding and the write;
// readers share a reader lock to plan a read and decode blocks without it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "store/bounded_ring.h"
#include "store/file_util.h"
#include "store/point_codec.h"
#include "store/series_store.h"

namespace foreshock::store {

enum class FsyncPolicy {
  kEvery,     // fsync before AppendBatch / AppendEvent returns
  kInterval,  // a background thread fsyncs every fsync_interval
  kNone,      // only when a segment is sealed, on Sync() and on close
};
std::optional<FsyncPolicy> ParseFsyncPolicy(std::string_view name);  // every|interval|none
std::string_view FsyncPolicyName(FsyncPolicy policy);

enum class StoreFileOp { kCreate, kWrite, kSync };

struct DurableStoreOptions {
  std::string data_dir = "./foreshock-data";
  uint64_t segment_bytes = uint64_t{64} << 20;
  // Point encoding restarts every block_bytes, or every block_bytes_per_series
  // times the number of series in the block if that is more. Smaller blocks
  // make reads of old data cheaper (a read decodes whole blocks, all series
  // in them); larger ones compress better (a restart codes each series' next
  // point in full, ~12 bytes: 400 bytes per series keeps that near 3%).
  uint64_t block_bytes = uint64_t{8} << 10;
  uint64_t block_bytes_per_series = 200;
  FsyncPolicy fsync = FsyncPolicy::kInterval;
  std::chrono::milliseconds fsync_interval{1000};
  size_t cache_points_per_series = 2048;
  size_t events_per_kind = 1024;
  // And at most this many bytes of them per kind (the oldest go first), so
  // that large events (a Hello with many labels) cannot make the in-memory
  // log large; the newest event is always kept.
  size_t event_bytes_per_kind = size_t{4} << 20;
  uint64_t retention_max_bytes = 0;         // 0: no size limit
  std::chrono::milliseconds retention_max_age{0};  // 0: no age limit
  std::chrono::milliseconds retention_check_interval{60000};
  // Unix milliseconds for segment creation times and age retention; empty:
  // the system clock. Tests inject one.
  std::function<int64_t()> clock;
  // After a failed write, how long WriteHealth reports the failure before it
  // lets the next append try again.
  std::chrono::milliseconds write_retry_interval{1000};
  // Test hook, a fault-injecting file layer: called before each segment
  // create, write and fsync; a non-zero errno makes that call fail with it.
  std::function<int(StoreFileOp)> inject_fault;
};

struct DurableStoreStats {
  // Since Open.
  uint64_t points_appended = 0;
  uint64_t batches_appended = 0;
  uint64_t events_appended = 0;
  uint64_t points_dropped = 0;  // in appends refused for a write error
  uint64_t events_dropped = 0;
  uint64_t appends_refused = 0;  // AppendBatch/AppendEvent calls that failed
  uint64_t bytes_written = 0;   // log bytes, headers included
  uint64_t segments_created = 0;
  uint64_t fsyncs = 0;
  uint64_t write_errors = 0;      // failed writes, creates and fsyncs
  uint64_t disk_full_errors = 0;  // of which ENOSPC or EDQUOT
  uint64_t read_errors = 0;       // segment reads for Range that failed
  uint64_t disk_bytes_read = 0;   // by Range, for points not in the cache
  uint64_t checkpoints_written = 0;
  uint64_t corrupt_checkpoints = 0;
  // Now.
  uint64_t segments = 0;
  uint64_t segment_bytes_on_disk = 0;
  uint64_t series = 0;
  // Recovery, at Open.
  uint64_t recovered_segments = 0;
  uint64_t recovered_records = 0;
  uint64_t recovered_points = 0;
  uint64_t recovered_events = 0;
  uint64_t truncated_bytes = 0;   // torn tail cut off the newest segment
  uint64_t corrupt_records = 0;   // damaged regions skipped (bad records, garbage)
  uint64_t corrupt_segments = 0;  // segments with damage
  uint64_t skipped_bytes = 0;     // bytes of the damaged regions
  uint64_t lost_points = 0;       // points known lost to damage (at least)
  uint64_t quarantined_segments = 0;  // moved to quarantine/: no valid record
  // Retention.
  uint64_t retention_deleted_segments = 0;
  uint64_t retention_deleted_bytes = 0;
};

class DurableSeriesStore final : public SeriesStore {
 public:
  // Creates the directory if needed, recovers what is there, applies
  // retention and starts a new segment.
  static absl::StatusOr<std::unique_ptr<DurableSeriesStore>> Open(DurableStoreOptions options);
  // Clean close: fsyncs and releases the directory.
  ~DurableSeriesStore() override;

  absl::Status AppendBatch(const std::vector<KeyedPoint>& points) override;
  absl::Status WriteHealth() const override;
  std::vector<Point> Range(const SeriesKey& key, int64_t from_step,
                           int64_t to_step) const override;
  std::vector<RunInfo> ListRuns() const override;
  std::vector<SeriesInfo> ListSeries(const std::string& run) const override;
  absl::Status AppendEvent(std::string_view kind, std::string_view bytes) override;
  // One write holds the points' records and the event record.
  absl::Status AppendBatchWithEvent(const std::vector<KeyedPoint>& points, std::string_view kind,
                                    std::string_view bytes) override;
  std::vector<std::string> Events(std::string_view kind) const override;
  bool WriteCheckpoint(std::string_view name, std::string_view bytes) override;
  std::optional<std::string> ReadCheckpoint(std::string_view name) const override;
  std::optional<CheckpointBytes> ReadLargeCheckpoint(std::string_view name) const override;
  // Straight to the file (store/checkpoint.h, CheckpointFileWriter).
  bool WriteCheckpointStreamed(std::string_view name,
                               const std::function<bool(codec::StateSink&)>& fill) override;

  // Makes everything appended so far durable. Returns false on an fsync error.
  bool Sync();
  // Applies retention now; returns the number of segments deleted.
  size_t EnforceRetention();

  DurableStoreStats Stats() const;
  // What recovery found and what went wrong since (write errors, corrupt
  // checkpoints), one human-readable line each, oldest first; the last 256.
  std::vector<std::string> Problems() const;
  // False while the last write, create or fsync failed (WriteHealth says why).
  bool healthy() const { return write_errno_.load() == 0; }
  // Heap bytes held (see the bound at the top of this file).
  size_t ApproxMemoryBytes() const;
  const DurableStoreOptions& options() const { return options_; }

  // Test hook: stops the store as a killed process would (no fsync, nothing
  // more written). The object must then only be destroyed.
  void AbandonForTesting();

 private:
  struct Block {
    uint64_t offset = 0;         // of its kBlockStart record
    uint64_t first_ordinal = 0;  // of its first point (see SeriesState::cache)
    uint64_t end = 0;            // after its last readable kPoints record
    bool skips_damage = false;   // holds a damaged series definition to step over
    int64_t min_step = std::numeric_limits<int64_t>::max();
    int64_t max_step = std::numeric_limits<int64_t>::min();
  };
  struct Segment {
    uint64_t sequence = 0;
    std::string path;
    uint64_t file_bytes = 0;   // on disk
    uint64_t valid_bytes = 0;  // readable prefix (all of it, unless corrupt)
    uint64_t first_ordinal = 0;
    uint64_t end_ordinal = 0;  // one past its last point
    int64_t newest_wall_time_ms = 0;
    std::vector<Block> blocks;
    std::vector<uint32_t> series_ids;  // local id -> index into series_
  };
  // The points of one series in one segment.
  struct SeriesSpan {
    uint64_t segment = 0;  // sequence number
    uint32_t local_id = 0;
    uint32_t first_block = 0;
    uint32_t last_block = 0;
    uint64_t points = 0;
    int64_t min_step = 0;
    int64_t max_step = 0;
  };
  // Points carry their ordinal (position in the log, counted from Open) so
  // a read knows which points on disk are also in the cache.
  struct CachedPoint {
    Point point;
    uint64_t ordinal = 0;
  };
  struct SeriesState {
    explicit SeriesState(SeriesKey k, size_t cache_points) : key(std::move(k)), cache(cache_points) {}
    SeriesKey key;
    std::vector<SeriesSpan> spans;  // oldest segment first
    BoundedRing<CachedPoint> cache;
    uint64_t points = 0;
    int64_t min_step = 0;
    int64_t max_step = 0;
    int64_t last_wall_time_ms = 0;
  };
  // The segment being written.
  struct ActiveSegment {
    ActiveSegment() {}  // user-provided: clang checks optional<> before the initializers below
    Segment* segment = nullptr;
    std::shared_ptr<FileHandle> file;
    std::vector<uint32_t> local_ids;  // series index -> local id, kNoLocalId if none
    PointBlockCodec codec;
    uint64_t block_offset = 0;
  };
  static constexpr uint32_t kNoLocalId = ~uint32_t{0};

  // A planned read of one series' points from one segment.
  struct ByteRange {
    uint64_t begin = 0;  // a block start
    uint64_t end = 0;
    uint64_t first_ordinal = 0;
    bool skips_damage = false;
  };
  struct SegmentRead {
    std::string path;
    uint32_t local_id = 0;
    uint32_t series_defined = 0;
    std::vector<ByteRange> ranges;
  };

  explicit DurableSeriesStore(DurableStoreOptions options);
  absl::Status OpenImpl();
  // Recovery of one segment file at Open, in passes (segment_recovery.cc).
  struct SegmentScan;
  void RecoverSegmentLocked(uint64_t sequence, const std::string& path, bool newest);
  static void FrameRecords(SegmentScan& scan);
  static void CutUnfinishedWrite(SegmentScan& scan);
  void DefineSeriesLocked(SegmentScan& scan);
  void ReadContentsLocked(SegmentScan& scan);
  std::string CountDamageLocked(const SegmentScan& scan);
  void FinishRecoveryLocked(SegmentScan& scan, bool newest);
  void QuarantineLocked(const std::string& path, const std::string& why);
  void StopMaintenance();
  int64_t Now() const;
  std::string SegmentPath(uint64_t sequence) const;
  void Report(std::string problem) const;
  // A checkpoint read's outcome: corrupt ones are counted and reported.
  bool CheckpointUsable(CheckpointStatus status, const std::string& error) const;

  uint32_t InternSeriesLocked(const SeriesKey& key);
  void IndexPointLocked(Segment& segment, uint32_t series, uint32_t local_id, const Point& point);
  void IndexEventLocked(std::string_view kind, std::string_view bytes);
  // AppendBatch, with an event record in the same write when `kind` is set.
  absl::Status AppendInternal(
      const std::vector<KeyedPoint>& batch,
      const std::optional<std::pair<std::string_view, std::string_view>>& event);
  absl::Status EnsureWritableLocked();
  absl::Status RollSegmentLocked();
  void SealActiveLocked();
  absl::Status WriteLocked(const std::string& bytes);
  // Records a failed create/write/fsync (errno `error`) and returns its status.
  absl::Status WriteFailed(int error, const std::string& what);
  void WriteSucceeded();
  int InjectedFault(StoreFileOp op) const;
  absl::Status SyncTo(uint64_t written_bytes);
  // With sync_mu_: bytes up to `written` failed to sync (see unsynced_ranges_).
  void MarkUnsyncedLocked(uint64_t written);
  bool InUnsyncedRangeLocked(uint64_t target) const;
  size_t EnforceRetentionLocked();
  void DropOldestSegmentLocked();
  void RecomputeSeriesStatsLocked(SeriesState& s);
  void MaintenanceLoop();
  void ReadFromSegment(const SegmentRead& read, int64_t from_step, int64_t to_step,
                       uint64_t cache_start, std::vector<Point>* out) const;

  const DurableStoreOptions options_;
  const std::string segments_dir_;
  const std::string checkpoints_dir_;
  std::unique_ptr<FileHandle> lock_file_;

  mutable std::shared_mutex mu_;  // everything below, unless noted
  std::unordered_map<SeriesKey, uint32_t, SeriesKeyHash> series_index_;
  std::vector<SeriesState> series_;
  std::map<uint64_t, Segment> segments_;  // by sequence number
  std::optional<ActiveSegment> active_;
  uint64_t next_sequence_ = 1;
  uint64_t next_ordinal_ = 0;
  uint64_t total_segment_bytes_ = 0;
  bool roll_pending_ = false;       // the active segment is full
  bool abandon_pending_ = false;    // after an fsync error: leave it unsealed
  bool restart_block_ = false;      // after a failed write: encoder state unknown
  std::map<std::string, BoundedRing<std::string>, std::less<>> events_;
  std::map<std::string, size_t, std::less<>> event_bytes_;  // bytes in events_, by kind
  DurableStoreStats stats_;  // the counters below are kept apart
  std::string scratch_;
  std::string payload_scratch_;
  std::vector<LocalPoint> points_scratch_;
  std::vector<uint32_t> series_scratch_;
  std::vector<uint32_t> new_series_scratch_;

  std::atomic<bool> abandoned_{false};
  // The last create/write/fsync failure (0: the last one succeeded) and when.
  std::atomic<int> write_errno_{0};
  std::atomic<int64_t> write_error_at_ms_{0};  // steady clock
  mutable std::mutex write_error_mu_;
  std::string write_error_;
  mutable std::atomic<uint64_t> fsyncs_{0};
  mutable std::atomic<uint64_t> read_errors_{0};
  mutable std::atomic<uint64_t> disk_bytes_read_{0};
  mutable std::atomic<uint64_t> corrupt_checkpoints_{0};
  std::atomic<uint64_t> checkpoints_written_{0};
  std::atomic<uint64_t> write_errors_{0};
  std::atomic<uint64_t> disk_full_errors_{0};

  // Group commit: bytes_written (stats_) known durable, and whether an fsync
  // is running. Never held while taking mu_.
  std::mutex sync_mu_;
  std::condition_variable sync_cv_;
  uint64_t synced_bytes_ = 0;
  bool sync_running_ = false;
  // Byte ranges (of bytes_written) whose fsync failed: never durable, even
  // after a later fsync of another segment succeeds. The newest few.
  std::vector<std::pair<uint64_t, uint64_t>> unsynced_ranges_;

  std::mutex checkpoint_mu_;  // serializes checkpoint writes

  mutable std::mutex problems_mu_;
  mutable std::vector<std::string> problems_;

  std::mutex maintenance_mu_;
  std::condition_variable maintenance_cv_;
  bool stopping_ = false;
  std::thread maintenance_;
};

}  // namespace foreshock::store
