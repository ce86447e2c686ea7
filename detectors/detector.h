// The detector extension point.
//
// A detector is one file in detectors/ that consumes samples of one kind and
// emits named signal values. It registers itself with one line:
//
//   FORESHOCK_REGISTER_DETECTOR(QKDetector);
//
// The daemon creates one instance per worker thread. Samples of a given
// (run, layer) always reach the same instance, in order, so a detector keeps
// per-series state without locks. Detectors are pure computation: no gRPC,
// no Prometheus, no threads.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "detectors/detector_options.h"
#include "detectors/retained_state.h"
#include "detectors/sample.h"
#include "codec/state_codec.h"

namespace foreshock::detectors {

// Where a signal lives. Its Prometheus labels follow: {run}, {run,layer},
// {run,layer} for the head aggregate plus {run,layer,head} per head, and
// {run,block} for per-transformer-block values of run-level samples (the
// block index travels in Observation::layer).
enum class SignalScope : uint8_t { kRun, kLayer, kLayerHead, kRunBlock };

// How per-head values fold into the per-layer value (docs/DESIGN.md §4.4:
// min for entropies, max for logits and shares).
enum class HeadAggregation : uint8_t { kNone, kMin, kMax, kMean };

// One exported signal. `name` is the series name and, with the "foreshock_"
// prefix, the metric name; it is public contract once released.
struct SignalSpec {
  std::string_view name;
  std::string_view help;
  SignalScope scope;
  HeadAggregation aggregation = HeadAggregation::kNone;
};

inline constexpr int kNoLayer = -1;  // run-level signal
inline constexpr int kAllHeads = -1;  // value aggregated over heads

struct Observation {
  std::string_view signal;  // a SignalSpec::name of the emitting detector
  int layer = kNoLayer;
  int head = kAllHeads;
  double value = 0;
  // False for values that are recorded and exported but must not drive
  // detection, e.g. a curvature estimate that did not converge.
  bool for_detection = true;
};

// Receives what a detector computes from one sample. The sample's run and
// step are known to the caller; Emit only carries the signal value.
class Emitter {
 public:
  virtual ~Emitter() = default;
  virtual void Emit(const Observation& observation) = 0;
  // Non-finite values found in the sample (NaN or +-Inf). The sample is then
  // not used for computation: non-finite input is a signal, not an error.
  virtual void NonFinite(SampleKind kind, int64_t count) = 0;
};

// Which series a restore keeps: called with the run and the layer of a
// series (kNoLayer for run-level state, as Sample::layer() reports it). An
// empty filter keeps everything.
using SeriesFilter = std::function<bool(std::string_view run, int layer)>;

class Detector {
 public:
  virtual ~Detector() = default;
  virtual void Process(const Sample& sample, Emitter& emitter) = 0;
  // Drop all state kept for `run` (its series are gone or restarted).
  virtual void ForgetRun(const std::string& run) = 0;

  // Checkpointing: the state that matters for detection (previous samples,
  // baselines), so that a restarted daemon continues instead of re-learning.
  // Decoding buffers and options are not state. A detector without
  // cross-sample state keeps the defaults (writes nothing, reads nothing).
  //
  // SaveState appends the whole state, starting with the detector's own
  // format version, deterministically (the same state gives the same bytes).
  virtual void SaveState(codec::StateWriter& writer) const {}
  // Adds the series in `reader` (written by SaveState of the same detector
  // kind) for which `keep(run, layer)` is true; a series already present is
  // replaced. Several blobs can be restored one after the other (the daemon
  // restores every worker's blob, each keeping its own shard). Reads exactly
  // what SaveState wrote. On truncated, corrupt or unsupported input it
  // returns false (reader.error() says why) and leaves the detector empty,
  // as newly created. Options are the detector's current ones, not the saved.
  virtual bool RestoreState(codec::StateReader& reader, const SeriesFilter& keep) { return true; }
  bool RestoreState(codec::StateReader& reader) { return RestoreState(reader, SeriesFilter()); }

  // The per-series probe state it holds, head by head, sized with the
  // functions of retained_state.h (the daemon's per-run state budget counts
  // it again from this after a restore). Detectors whose state is a few
  // numbers per run report nothing.
  virtual void VisitRetained(const RetainedVisitor& visit) const {}
};

struct DetectorInfo {
  std::string_view name;
  SampleKind kind;  // the sample kind this detector consumes
  std::span<const SignalSpec> signals;
  std::function<std::unique_ptr<Detector>(const DetectorOptions&)> create;
  // What processing a sample leaves behind in this detector (retained_state.h),
  // for one that keeps per-series probe state (T::RetainedBy, registered with
  // it); empty for the others.
  std::function<std::optional<RetainedFootprint>(const Sample&, const DetectorOptions&)> retained_by;
};

// Every detector linked into the binary, in registration order.
class DetectorRegistry {
 public:
  static DetectorRegistry& Instance();
  void Register(DetectorInfo info);
  const std::vector<DetectorInfo>& detectors() const { return detectors_; }
  // The spec of a signal by name, or nullptr.
  const SignalSpec* FindSignal(std::string_view name) const;

 private:
  std::vector<DetectorInfo> detectors_;
};

namespace internal {
// T::RetainedBy when T declares one.
template <typename T>
std::function<std::optional<RetainedFootprint>(const Sample&, const DetectorOptions&)>
RetainedByOf() {
  if constexpr (requires(const Sample& s, const DetectorOptions& o) { T::RetainedBy(s, o); }) {
    return &T::RetainedBy;
  } else {
    return {};
  }
}

struct DetectorRegistration {
  explicit DetectorRegistration(DetectorInfo info) {
    DetectorRegistry::Instance().Register(std::move(info));
  }
};
}  // namespace internal

// A detector class T provides:
//   static constexpr std::string_view kName;
//   static constexpr SampleKind kKind;
//   static std::span<const SignalSpec> Signals();
//   explicit T(const DetectorOptions&);
// and, when it keeps per-series probe state that the daemon's per-run state
// budget must count before a worker has the sample (retained_state.h):
//   static std::optional<RetainedFootprint> RetainedBy(const Sample&,
//                                                      const DetectorOptions&);
#define FORESHOCK_REGISTER_DETECTOR(T)                                              \
  static const ::foreshock::detectors::internal::DetectorRegistration               \
      foreshock_detector_registration_##T{::foreshock::detectors::DetectorInfo{     \
          T::kName, T::kKind, T::Signals(),                                         \
          [](const ::foreshock::detectors::DetectorOptions& options)                \
              -> std::unique_ptr<::foreshock::detectors::Detector> {                \
            return std::make_unique<T>(options);                                    \
          },                                                                        \
          ::foreshock::detectors::internal::RetainedByOf<T>()}}

}  // namespace foreshock::detectors
