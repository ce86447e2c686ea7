#include "wire/validation.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace foreshock::wire {

namespace {

namespace v1 = foreshock::v1;
using detectors::DType;

std::optional<DType> ToDType(v1::DType dtype) {
  switch (dtype) {
    case v1::FLOAT32: return DType::kFloat32;
    case v1::BFLOAT16: return DType::kBFloat16;
    case v1::FLOAT16: return DType::kFloat16;
    default: return std::nullopt;
  }
}

Rejection Reject(const char* code, std::string detail) { return Rejection{code, std::move(detail)}; }

std::string ShapeString(const v1::Tensor& t) {
  return absl::StrCat("[", absl::StrJoin(t.shape(), ","), "]");
}

// Checks dtype, rank and positive dims. The byte length is checked separately,
// after the shape limits, so that the shape product cannot overflow.
std::optional<Rejection> CheckTensor(const v1::Tensor& t, const char* name, int rank) {
  if (!ToDType(t.dtype())) {
    return Reject(reason::kUnknownDType,
                  absl::StrCat(name, " has dtype ", static_cast<int>(t.dtype()),
                               "; expected FLOAT32, BFLOAT16 or FLOAT16"));
  }
  if (t.shape_size() != rank) {
    return Reject(reason::kBadShape, absl::StrCat(name, " has shape ", ShapeString(t),
                                                  "; expected ", rank, " dimensions"));
  }
  for (int64_t d : t.shape()) {
    if (d <= 0) {
      return Reject(reason::kBadShape,
                    absl::StrCat(name, " has shape ", ShapeString(t), "; dimensions must be > 0"));
    }
  }
  return std::nullopt;
}

std::optional<Rejection> CheckByteLength(const v1::Tensor& t, const char* name) {
  size_t elements = 1;
  for (int64_t d : t.shape()) elements *= static_cast<size_t>(d);  // dims already bounded
  const size_t expected = elements * detectors::DTypeSize(*ToDType(t.dtype()));
  if (t.data().size() != expected) {
    return Reject(reason::kByteLengthMismatch,
                  absl::StrCat(name, " has ", t.data().size(), " bytes; shape ", ShapeString(t),
                               " of ", v1::DType_Name(t.dtype()), " needs ", expected));
  }
  return std::nullopt;
}

// After the shape limits, so that the product of the dims cannot overflow.
std::optional<Rejection> CheckElements(const v1::Tensor& t, const char* name,
                                       const RecordLimits& limits) {
  int64_t elements = 1;
  for (int64_t d : t.shape()) elements *= d;
  if (elements > limits.max_tensor_elements) {
    return Reject(reason::kTensorTooLarge,
                  absl::StrCat(name, " has ", elements, " elements (shape ", ShapeString(t),
                               "); the limit is ", limits.max_tensor_elements,
                               " (--max_tensor_elements)"));
  }
  return std::nullopt;
}

detectors::RawTensor TakeTensor(v1::Tensor& t) {
  detectors::RawTensor raw;
  raw.dtype = *ToDType(t.dtype());
  raw.shape.assign(t.shape().begin(), t.shape().end());
  raw.data = std::move(*t.mutable_data());
  return raw;
}

std::optional<Rejection> CheckLayer(int32_t layer, const StreamContext& context,
                                    const RecordLimits& limits) {
  const int64_t n_layers = context.model.n_layers() > 0 ? context.model.n_layers() : limits.max_layers;
  if (layer < 0 || layer >= n_layers) {
    return Reject(reason::kLayerOutOfRange,
                  absl::StrCat("layer ", layer, " is outside [0, ", n_layers, ")",
                               context.model.n_layers() > 0 ? " (n_layers from Hello)"
                                                            : " (--max_layers)"));
  }
  return std::nullopt;
}

std::optional<Rejection> CheckId(const std::string& id, const char* name,
                                 const RecordLimits& limits) {
  if (id.size() > limits.max_id_bytes) {
    return Reject(reason::kBadId, absl::StrCat(name, " is ", id.size(), " bytes; the limit is ",
                                               limits.max_id_bytes));
  }
  return std::nullopt;
}

std::optional<Rejection> ValidateQK(v1::QKSample& qk, const StreamContext& context,
                                    const RecordLimits& limits, detectors::Sample& out) {
  if (auto r = CheckLayer(qk.layer(), context, limits)) return r;
  if (auto r = CheckId(qk.probe_id(), "probe_id", limits)) return r;
  if (auto r = CheckTensor(qk.q(), "q", 3)) return r;
  if (auto r = CheckTensor(qk.k(), "k", 3)) return r;
  if (qk.q().shape(1) != qk.k().shape(1) || qk.q().shape(2) != qk.k().shape(2) ||
      qk.k().shape(0) > qk.q().shape(0)) {
    return Reject(reason::kShapeMismatch,
                  absl::StrCat("q has shape ", ShapeString(qk.q()), " but k has ",
                               ShapeString(qk.k()),
                               "; k must be [kv_heads <= heads, tokens, head_dim]"));
  }
  const int64_t heads = qk.q().shape(0), tokens = qk.q().shape(1), head_dim = qk.q().shape(2);
  if (heads > limits.max_heads || tokens > limits.max_tokens || head_dim > limits.max_head_dim) {
    return Reject(reason::kShapeOverLimit,
                  absl::StrCat("q/k shape ", ShapeString(qk.q()), " exceeds the limits [heads ",
                               limits.max_heads, ", tokens ", limits.max_tokens, ", head_dim ",
                               limits.max_head_dim, "]"));
  }
  const int64_t kv_heads = qk.k().shape(0);
  // Which K head each query head pairs with: explicit, or contiguous groups
  // (after the limits: heads is bounded now).
  std::vector<int32_t> kv_head_of;
  if (qk.kv_head_of_size() > 0) {
    if (qk.kv_head_of_size() != heads) {
      return Reject(reason::kShapeMismatch,
                    absl::StrCat("kv_head_of has ", qk.kv_head_of_size(), " entries for ", heads,
                                 " query heads"));
    }
    for (int h = 0; h < qk.kv_head_of_size(); ++h) {
      if (qk.kv_head_of(h) < 0 || qk.kv_head_of(h) >= kv_heads) {
        return Reject(reason::kShapeMismatch,
                      absl::StrCat("kv_head_of[", h, "] = ", qk.kv_head_of(h),
                                   " is not a K head (k has ", kv_heads, ")"));
      }
    }
    kv_head_of.assign(qk.kv_head_of().begin(), qk.kv_head_of().end());
  } else if (heads % kv_heads != 0) {
    return Reject(reason::kShapeMismatch,
                  absl::StrCat(heads, " query heads cannot share ", kv_heads,
                               " K heads in contiguous groups; send kv_head_of"));
  } else {
    kv_head_of.resize(static_cast<size_t>(heads));
    const int64_t group = heads / kv_heads;
    for (int64_t h = 0; h < heads; ++h) kv_head_of[static_cast<size_t>(h)] = static_cast<int32_t>(h / group);
  }
  // One K head per query head, in order: the detectors' default (and what
  // their state holds for samples of clients that broadcast K).
  bool identity = kv_heads == heads;
  for (int64_t h = 0; identity && h < heads; ++h) identity = kv_head_of[static_cast<size_t>(h)] == h;
  if (identity) kv_head_of.clear();
  // A subset of the heads names them (QKSample.heads); all of them must be
  // Hello's n_heads.
  const int64_t model_heads = context.model.n_heads() > 0 ? context.model.n_heads() : limits.max_heads;
  if (qk.heads_size() > 0) {
    if (qk.heads_size() != heads) {
      return Reject(reason::kHeadsMismatch, absl::StrCat("heads names ", qk.heads_size(),
                                                         " heads for ", heads, " rows of q"));
    }
    for (int i = 0; i < qk.heads_size(); ++i) {
      if (qk.heads(i) < 0 || qk.heads(i) >= model_heads || (i > 0 && qk.heads(i) <= qk.heads(i - 1))) {
        return Reject(reason::kHeadsMismatch,
                      absl::StrCat("heads[", i, "] = ", qk.heads(i),
                                   ": heads must be strictly ascending in [0, ", model_heads, ")"));
      }
    }
  } else if (context.model.n_heads() > 0 && heads != context.model.n_heads()) {
    return Reject(reason::kHeadsMismatch,
                  absl::StrCat("q has ", heads, " heads; Hello said n_heads = ",
                               context.model.n_heads(), " (a subset must name its heads)"));
  }
  if (qk.seq_len() < 0 || (qk.seq_len() > 0 && tokens % qk.seq_len() != 0)) {
    return Reject(reason::kBadSeqLen, absl::StrCat("seq_len ", qk.seq_len(),
                                                   " does not divide ", tokens, " tokens"));
  }
  if (auto r = CheckElements(qk.q(), "q", limits)) return r;
  if (auto r = CheckByteLength(qk.q(), "q")) return r;
  if (auto r = CheckByteLength(qk.k(), "k")) return r;
  std::optional<DType> attention_dtype;
  if (qk.attention_dtype() != v1::DTYPE_UNSPECIFIED) {
    attention_dtype = ToDType(qk.attention_dtype());
    if (!attention_dtype) {
      return Reject(reason::kUnknownDType, absl::StrCat("attention_dtype ",
                                                        static_cast<int>(qk.attention_dtype()),
                                                        " is not a known DType"));
    }
  }
  if (!std::isfinite(qk.logit_softcap()) || qk.logit_softcap() < 0) {
    return Reject(reason::kBadSoftcap, absl::StrCat("logit_softcap ", qk.logit_softcap(),
                                                    " must be finite and >= 0 (0: no cap)"));
  }
  std::optional<detectors::AttentionOutputCheck> output_check;
  if (qk.has_output_check()) {
    const v1::AttentionOutputCheck& c = qk.output_check();
    // Non-finite figures pass (the kernel's output held NaN/Inf: a signal the
    // detector reports); finite ones must be consistent. |mean(e * s)| <=
    // mean|e| <= rms(e) for any errors e and signs s, up to rounding.
    const bool finite = std::isfinite(c.mean_signed_error()) && std::isfinite(c.rms_error()) &&
                        std::isfinite(c.mean_abs_reference());
    if (c.elements() <= 0 ||
        (finite && (c.rms_error() < 0 || c.mean_abs_reference() < 0 ||
                    std::abs(c.mean_signed_error()) > c.rms_error() * (1 + 1e-6)))) {
      return Reject(reason::kBadOutputCheck,
                    absl::StrCat("output_check: elements ", c.elements(), ", mean_signed_error ",
                                 c.mean_signed_error(), ", rms_error ", c.rms_error(),
                                 ", mean_abs_reference ", c.mean_abs_reference(),
                                 "; needs elements > 0, rms_error and mean_abs_reference >= 0, "
                                 "|mean_signed_error| <= rms_error"));
    }
    output_check = detectors::AttentionOutputCheck{c.mean_signed_error(), c.rms_error(),
                                                   c.mean_abs_reference(), c.elements()};
  }

  detectors::QKSample sample;
  sample.layer = qk.layer();
  sample.probe_id = qk.probe_id();
  sample.causal = qk.causal();
  sample.seq_len = qk.seq_len();
  sample.q = TakeTensor(*qk.mutable_q());
  sample.k = TakeTensor(*qk.mutable_k());
  sample.kv_head_of = std::move(kv_head_of);
  sample.attention_dtype = attention_dtype;
  sample.output_check = output_check;
  sample.logit_softcap = qk.logit_softcap();
  // The names are dropped only when they say what no names say: every head
  // of the model, in order. Heads 0..n-1 of a larger model are a subset (a
  // rotation window), and a sample without names holds every head: the
  // detector would forget the state of heads >= n.
  const bool every_head = context.model.n_heads() > 0 && qk.heads_size() == context.model.n_heads();
  if (qk.heads_size() > 0 && !every_head) sample.heads.assign(qk.heads().begin(), qk.heads().end());
  out.payload = std::move(sample);
  return std::nullopt;
}

std::optional<Rejection> ValidateRouter(v1::RouterSample& router, const StreamContext& context,
                                        const RecordLimits& limits, detectors::Sample& out) {
  if (auto r = CheckLayer(router.layer(), context, limits)) return r;
  if (auto r = CheckId(router.probe_id(), "probe_id", limits)) return r;
  const auto& moe = context.model.moe_layers();
  if (!moe.empty() && std::find(moe.begin(), moe.end(), router.layer()) == moe.end()) {
    return Reject(reason::kNotMoeLayer, absl::StrCat("layer ", router.layer(),
                                                     " is not in moe_layers from Hello"));
  }
  if (auto r = CheckTensor(router.logits(), "logits", 2)) return r;
  const int64_t tokens = router.logits().shape(0), experts = router.logits().shape(1);
  if (tokens > limits.max_tokens || experts > limits.max_experts) {
    return Reject(reason::kShapeOverLimit,
                  absl::StrCat("logits shape ", ShapeString(router.logits()),
                               " exceeds the limits [tokens ", limits.max_tokens, ", experts ",
                               limits.max_experts, "]"));
  }
  if (context.model.n_experts() > 0 && experts != context.model.n_experts()) {
    return Reject(reason::kExpertsMismatch,
                  absl::StrCat("logits have ", experts, " experts; Hello said n_experts = ",
                               context.model.n_experts()));
  }
  if (router.top_k() < 1 || router.top_k() >= experts) {
    return Reject(reason::kBadTopK, absl::StrCat("top_k ", router.top_k(), " must be in [1, ",
                                                 experts, ") for ", experts, " experts"));
  }
  if (auto r = CheckElements(router.logits(), "logits", limits)) return r;
  if (auto r = CheckByteLength(router.logits(), "logits")) return r;

  detectors::RouterSample sample;
  sample.layer = router.layer();
  sample.probe_id = router.probe_id();
  sample.top_k = router.top_k();
  sample.logits = TakeTensor(*router.mutable_logits());
  out.payload = std::move(sample);
  return std::nullopt;
}

}  // namespace

static std::optional<Rejection> CheckLabels(const v1::Hello& hello, const RecordLimits& limits) {
  const auto& labels = hello.labels();
  if (limits.max_labels > 0 && static_cast<int64_t>(labels.size()) > limits.max_labels) {
    return Reject(reason::kBadLabels, absl::StrCat(labels.size(), " labels; the limit is ",
                                                   limits.max_labels));
  }
  int64_t total = 0;
  for (const auto& [key, value] : labels) {
    if (limits.max_label_key_bytes > 0 &&
        static_cast<int64_t>(key.size()) > limits.max_label_key_bytes) {
      return Reject(reason::kBadLabels,
                    absl::StrCat("a label key of ", key.size(), " bytes; the limit is ",
                                 limits.max_label_key_bytes));
    }
    if (limits.max_label_value_bytes > 0 &&
        static_cast<int64_t>(value.size()) > limits.max_label_value_bytes) {
      return Reject(reason::kBadLabels,
                    absl::StrCat("the value of label '", key, "' is ", value.size(),
                                 " bytes; the limit is ", limits.max_label_value_bytes));
    }
    total += static_cast<int64_t>(key.size() + value.size());
  }
  if (limits.max_labels_bytes > 0 && total > limits.max_labels_bytes) {
    return Reject(reason::kBadLabels, absl::StrCat("labels of ", total,
                                                   " bytes in all; the limit is ",
                                                   limits.max_labels_bytes));
  }
  return std::nullopt;
}

std::optional<Rejection> ValidateHello(const v1::Hello& hello, const RecordLimits& limits) {
  if (hello.run_id().empty()) return Reject(reason::kBadHello, "run_id is empty");
  // Labels first: they are the part of a Hello that can be large.
  if (auto r = CheckLabels(hello, limits)) return r;
  if (auto r = CheckId(hello.run_id(), "run_id", limits)) return Reject(reason::kBadHello, r->detail);
  if (auto r = CheckId(hello.job(), "job", limits)) return Reject(reason::kBadHello, r->detail);
  const v1::ModelInfo& m = hello.model();
  if (m.n_layers() < 0 || m.n_layers() > limits.max_layers) {
    return Reject(reason::kBadHello, absl::StrCat("model.n_layers ", m.n_layers(),
                                                  " is outside [0, ", limits.max_layers, "]"));
  }
  if (m.n_heads() < 0 || m.n_heads() > limits.max_heads) {
    return Reject(reason::kBadHello, absl::StrCat("model.n_heads ", m.n_heads(),
                                                  " is outside [0, ", limits.max_heads, "]"));
  }
  if (m.head_dim() < 0 || m.head_dim() > limits.max_head_dim) {
    return Reject(reason::kBadHello, absl::StrCat("model.head_dim ", m.head_dim(),
                                                  " is outside [0, ", limits.max_head_dim, "]"));
  }
  if (m.n_experts() < 0 || m.n_experts() > limits.max_experts) {
    return Reject(reason::kBadHello, absl::StrCat("model.n_experts ", m.n_experts(),
                                                  " is outside [0, ", limits.max_experts, "]"));
  }
  // moe_layers names layers: as many as the model has at most, each in range.
  const int64_t n_layers = m.n_layers() > 0 ? m.n_layers() : limits.max_layers;
  if (m.moe_layers_size() > n_layers) {
    return Reject(reason::kBadHello, absl::StrCat("model.moe_layers has ", m.moe_layers_size(),
                                                  " entries; the model has ", n_layers,
                                                  " layers"));
  }
  for (int32_t layer : m.moe_layers()) {
    if (layer < 0 || layer >= n_layers) {
      return Reject(reason::kBadHello, absl::StrCat("model.moe_layers has layer ", layer,
                                                    ", outside [0, ", n_layers, ")"));
    }
  }
  if (m.n_experts() > 0 && (m.top_k() < 0 || m.top_k() >= m.n_experts())) {
    return Reject(reason::kBadHello, absl::StrCat("model.top_k ", m.top_k(), " must be below n_experts ",
                                                  m.n_experts()));
  }
  // The ranks: a world_size label within --max_ranks_per_run, and a rank in
  // [0, world_size), so that one Hello cannot keep a run from ever ending
  // (it ends once world_size ranks said goodbye) nor send as rank -1.
  const int64_t max_ranks = limits.max_ranks_per_run;
  int64_t world_size = 0;
  if (const auto it = hello.labels().find("world_size"); it != hello.labels().end()) {
    if (absl::SimpleAtoi(it->second, &world_size) && max_ranks > 0 && world_size > max_ranks) {
      return Reject(reason::kWorldSizeOverLimit,
                    absl::StrCat("label world_size ", world_size, " is above ", max_ranks,
                                 " (--max_ranks_per_run)"));
    }
    world_size = WorldSizeOf(hello);
  }
  if (hello.rank() < 0 || (world_size > 0 && hello.rank() >= world_size) ||
      (world_size == 0 && max_ranks > 0 && hello.rank() >= max_ranks)) {
    return Reject(reason::kBadRank,
                  world_size > 0
                      ? absl::StrCat("rank ", hello.rank(), " is outside [0, ", world_size,
                                     ") (label world_size)")
                      : absl::StrCat("rank ", hello.rank(), " is outside [0, ",
                                     max_ranks > 0 ? max_ranks : int64_t{1} << 31,
                                     ")", max_ranks > 0 ? " (--max_ranks_per_run)" : ""));
  }
  return std::nullopt;
}

int32_t WorldSizeOf(const v1::Hello& hello) {
  const auto it = hello.labels().find("world_size");
  int32_t n = 0;
  if (it == hello.labels().end() || !absl::SimpleAtoi(it->second, &n)) return 0;
  return n >= 1 && n <= (1 << 20) ? n : 0;
}

std::optional<Rejection> ValidateRecord(v1::Record& record, const StreamContext& context,
                                        const RecordLimits& limits, detectors::Sample& out) {
  if (record.step() < 0) {
    return Reject(reason::kNegativeStep, absl::StrCat("step ", record.step(), " is negative"));
  }
  out.run = context.run_id;
  out.rank = context.rank;
  out.world_size = context.world_size;
  out.step = record.step();
  switch (record.payload_case()) {
    case v1::Record::kScalars: {
      const v1::StepScalars& s = record.scalars();
      detectors::ScalarsSample sample;
      sample.has_loss = s.has_loss();
      sample.has_grad_norm = s.has_grad_norm();
      sample.has_lr = s.has_lr();
      sample.loss = s.loss();
      sample.grad_norm = s.grad_norm();
      sample.lr = s.lr();
      out.payload = sample;
      return std::nullopt;
    }
    case v1::Record::kQk:
      return ValidateQK(*record.mutable_qk(), context, limits, out);
    case v1::Record::kRouter:
      return ValidateRouter(*record.mutable_router(), context, limits, out);
    case v1::Record::kCurvature: {
      const v1::CurvatureSample& c = record.curvature();
      if (c.layer_rayleigh_size() > limits.max_tensor_elements) {
        return Reject(reason::kTensorTooLarge,
                      absl::StrCat("layer_rayleigh has ", c.layer_rayleigh_size(),
                                   " values; the limit is ", limits.max_tensor_elements,
                                   " (--max_tensor_elements)"));
      }
      // One value per layer, and each becomes a series (curvature_block_rayleigh
      // with block = its index): no more values than the run has layers.
      const int64_t n_layers =
          context.model.n_layers() > 0 ? context.model.n_layers() : limits.max_layers;
      if (c.layer_rayleigh_size() > n_layers) {
        return Reject(reason::kTooManyLayers,
                      absl::StrCat("layer_rayleigh has ", c.layer_rayleigh_size(),
                                   " values, one per layer; the run has ", n_layers, " layers",
                                   context.model.n_layers() > 0 ? " (n_layers from Hello)"
                                                                : " (--max_layers)"));
      }
      detectors::CurvatureSample sample;
      sample.lambda_max = c.lambda_max();
      sample.residual = c.residual();
      sample.hvps = c.hvps();
      sample.preconditioned = c.preconditioned();
      sample.lr = c.lr();
      sample.beta1 = c.beta1();
      sample.overlap = c.overlap();
      sample.layer_rayleigh.assign(c.layer_rayleigh().begin(), c.layer_rayleigh().end());
      out.payload = std::move(sample);
      return std::nullopt;
    }
    case v1::Record::PAYLOAD_NOT_SET:
      break;
  }
  return Reject(reason::kMissingPayload, "record has no payload (scalars, qk, router or curvature)");
}

size_t SampleBytes(const detectors::Sample& sample) {
  size_t bytes = sizeof(detectors::Sample) + sample.run.size();
  if (const auto* qk = std::get_if<detectors::QKSample>(&sample.payload)) {
    bytes += qk->q.data.size() + qk->k.data.size() + qk->probe_id.size() +
             (qk->kv_head_of.size() + qk->heads.size()) * sizeof(int32_t);
  } else if (const auto* router = std::get_if<detectors::RouterSample>(&sample.payload)) {
    bytes += router->logits.data.size() + router->probe_id.size();
  } else if (const auto* curvature = std::get_if<detectors::CurvatureSample>(&sample.payload)) {
    bytes += curvature->layer_rayleigh.size() * sizeof(double);
  }
  return bytes;
}

}  // namespace foreshock::wire
