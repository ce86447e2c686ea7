// Compact encoding of the points in one log record (a kPoints record).
//
// Points are encoded against per-series state that carries across the records
// of one block (DurableStoreOptions::block_bytes) and is reset at every block
// start, so a block can be decoded without reading what came before it.
// Per point, in a bit stream (store/bit_stream.h):
//   series   '0' = previous point's local id + 1, else '1' + varint id
//   step     first in block: varint zigzag(step); then delta-of-delta against
//            the series' previous step delta: '0' = same delta, else
//            '1' + varint zigzag(delta of delta)
//   value    first in block: 64 raw bits; then Gorilla-style XOR with the
//            series' previous value: '0' = same value; '10' + the XOR's
//            meaningful bits inside the previous leading/trailing-zero window;
//            '11' + 6 bits leading zeros + 6 bits (meaningful length - 1) +
//            the meaningful bits (a new window; the encoder also picks this
//            when it is shorter than reusing a much wider window)
//   wall     '0' = same wall time as the block's previous point, else
//            '1' + varint zigzag(difference)
// The payload is varint(point count) followed by the bit stream, padded to a
// byte. A daemon batch (one step, ~50 series in a stable order, one wall time)
// costs 3 bits per point plus the value's XOR bits.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "store/series_store.h"

namespace foreshock::store {

struct LocalPoint {
  uint32_t local_id = 0;  // the series' id within its segment
  Point point;
};

// Encoder and decoder share this state machine; one instance per block.
class PointBlockCodec {
 public:
  // Forgets all state: the next point of every series is encoded in full.
  void Reset();

  // Appends a kPoints payload for `points` to *payload.
  void Encode(std::span<const LocalPoint> points, std::string* payload);

  // Decodes a kPoints payload into *out (replacing its contents). Local ids
  // must be below `series_defined`. Returns false on malformed input; the
  // state is then unusable until Reset.
  bool Decode(std::string_view payload, uint32_t series_defined, std::vector<LocalPoint>* out);

  // Series whose first point in this block has been coded: each cost a full
  // step and value, which is what a block restart costs again.
  size_t series_started() const { return series_started_; }

  // Heap bytes held, for memory accounting.
  size_t ApproxMemoryBytes() const { return series_.capacity() * sizeof(SeriesState); }

 private:
  struct SeriesState {
    bool started = false;
    int64_t step = 0;
    uint64_t step_delta = 0;  // unsigned: wraps instead of overflowing
    uint64_t value_bits = 0;
    uint8_t window_leading = 0;
    uint8_t window_meaningful = 0;  // 0: no window yet
  };

  SeriesState& StateFor(uint32_t local_id);

  std::vector<SeriesState> series_;
  size_t series_started_ = 0;
  int64_t wall_time_ms_ = 0;
};

}  // namespace foreshock::store
