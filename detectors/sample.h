// Plain, validated samples as detectors see them. No protobuf, no gRPC: the
// wire/validation.h translates the wire contract into these types.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace foreshock::detectors {

enum class DType : uint8_t { kFloat32, kBFloat16, kFloat16 };

// Size in bytes of one element of `dtype`.
constexpr size_t DTypeSize(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }
const char* DTypeName(DType dtype);

// Raw little-endian row-major tensor bytes, exactly as they came off the wire.
// Invariant (checked by the server before a sample reaches a detector):
// data.size() == product(shape) * DTypeSize(dtype), every dim > 0.
struct RawTensor {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::string data;

  int64_t num_elements() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

struct ScalarsSample {
  bool has_loss = false;
  bool has_grad_norm = false;
  bool has_lr = false;
  double loss = 0;
  double grad_norm = 0;
  double lr = 0;
};

// The model's attention output O against the client's fp32 reference O_ref
// on the probe (QKSample.output_check on the wire).
struct AttentionOutputCheck {
  double mean_signed_error = 0;   // mean of (O - O_ref) * sign(O_ref)
  double rms_error = 0;           // sqrt(mean((O - O_ref)^2))
  double mean_abs_reference = 0;  // mean |O_ref|
  int64_t elements = 0;
};

struct QKSample {
  int layer = 0;
  std::string probe_id;
  RawTensor q;  // [heads, tokens, head_dim]
  RawTensor k;  // [kv_heads, tokens, head_dim]
  // Query head h attends with K head kv_head_of[h] (grouped-query attention);
  // one entry per query head. Empty: K head h (kv_heads == heads).
  std::vector<int32_t> kv_head_of;
  // The model's index of each query head in q, when the client probed a
  // subset of the heads (distinct, ascending). Empty: q holds heads 0..heads-1.
  std::vector<int32_t> heads;
  bool causal = false;
  int seq_len = 0;  // > 0: block-diagonal mask over back-to-back sequences
  // The dtype the model computes this layer's attention in, when the client
  // says (not the wire dtype of q and k).
  std::optional<DType> attention_dtype;
  std::optional<AttentionOutputCheck> output_check;
  // > 0: the model soft-caps its logits at this value (cap * tanh(x / cap));
  // attention_max_logit is then of the capped logits. 0: no cap.
  double logit_softcap = 0;
};

struct RouterSample {
  int layer = 0;
  std::string probe_id;
  RawTensor logits;  // [tokens, experts]
  int top_k = 1;
};

struct CurvatureSample {
  double lambda_max = 0;
  double residual = 0;
  int hvps = 0;
  bool preconditioned = false;
  double lr = 0;
  double beta1 = 0;
  double overlap = 0;
  std::vector<double> layer_rayleigh;
};

enum class SampleKind : uint8_t { kScalars, kQK, kRouter, kCurvature };
const char* SampleKindName(SampleKind kind);  // "scalars", "qk", "router", "curvature"

struct Sample {
  std::string run;  // run_id from the stream's Hello
  int32_t rank = 0;
  // Ranks that report scalars for the run, as the stream's Hello says (label
  // world_size); 0: not said. Used to merge ranks' scalars (wire/rank_scalars.h).
  int32_t world_size = 0;
  int64_t step = 0;
  std::variant<ScalarsSample, QKSample, RouterSample, CurvatureSample> payload;

  SampleKind kind() const { return static_cast<SampleKind>(payload.index()); }
  // Layer the sample belongs to, or -1 for run-level samples (scalars, curvature).
  int layer() const;
};

}  // namespace foreshock::detectors
