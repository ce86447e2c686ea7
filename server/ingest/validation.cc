#include "server/ingest/validation.h"

#include <algorithm>

namespace foreshock::server {

namespace {

// Record-level codes first, then stream-level, as in docs/DESIGN.md §3.2.
constexpr std::string_view kRejectionReasons[] = {
    reason::kMissingPayload,
    reason::kUnknownDType,
    reason::kBadShape,
    reason::kByteLengthMismatch,
    reason::kShapeMismatch,
    reason::kShapeOverLimit,
    reason::kLayerOutOfRange,
    reason::kHeadsMismatch,
    reason::kBadSeqLen,
    reason::kBadOutputCheck,
    reason::kBadSoftcap,
    reason::kBadTopK,
    reason::kExpertsMismatch,
    reason::kNotMoeLayer,
    reason::kBadId,
    reason::kNonIncreasingSeq,
    reason::kNegativeStep,
    reason::kTensorTooLarge,
    reason::kTooManyLayers,
    reason::kTooManyRecords,
    reason::kStepOutOfRange,
    reason::kStepAheadOfRun,
    reason::kTooManyProbeIds,
    reason::kBatchBeforeHello,
    reason::kDuplicateHello,
    reason::kBadHello,
    reason::kBadLabels,
    reason::kBadRank,
    reason::kWorldSizeOverLimit,
    reason::kWorldSizeConflict,
    reason::kEmptyRequest,
    reason::kMalformedRequest,
    reason::kTooManyStreams,
    reason::kTooManyStreamsForTenant,
    reason::kTooManyRuns,
    reason::kTooManyRunsForTenant,
    reason::kRankInUse,
    reason::kMessageTooLarge,
    reason::kMemoryLimit,
    reason::kStateLimit,
    reason::kDiskFull,
    reason::kStoreUnavailable,
    reason::kHelloTimeout,
    reason::kStreamIdleTimeout,
};

}  // namespace

std::span<const std::string_view> RejectionReasons() { return kRejectionReasons; }

void AddRejections(foreshock::v1::Ack& ack, int64_t first, int64_t count, std::string_view code,
                   const std::string& reason_text) {
  const int64_t listed =
      std::clamp<int64_t>(kMaxAckRejections - ack.rejections_size(), 0, count);
  for (int64_t i = 0; i < listed; ++i) {
    auto* rejection = ack.add_rejections();
    rejection->set_index(static_cast<uint32_t>(first + i));
    rejection->set_reason(reason_text);
  }
  if (const int64_t omitted = count - listed; omitted > 0) {
    ack.set_omitted_rejections(ack.omitted_rejections() + static_cast<uint32_t>(omitted));
    (*ack.mutable_omitted_by_reason())[std::string(code)] += static_cast<uint32_t>(omitted);
  }
}

}  // namespace foreshock::server
