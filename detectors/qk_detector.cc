// The QK detector (docs/DESIGN.md §1.1).
//
// Per sample and head: attention entropy and max logit. Between consecutive
// finite samples of one (run, layer, probe_id): the spectrum of the
// first-order increment of the QK logits, computed from factors
// (qk_spectrum.h), and the overlap of consecutive top directions.
//
// Conventions:
// - A sample with any NaN/Inf in q or k is reported with Emitter::NonFinite
//   and otherwise ignored: the previous finite sample stays the reference, so
//   the next increment spans the gap.
// - The reference of an increment is kept per query head (the model's index:
//   a client may probe a rotating subset of the heads, QKSample.heads): the
//   increment of head h spans from its previous finite sample, whenever that
//   was. A change of tokens, head_dim or dtype restarts that head.
// - A zero increment (q and k identical to the previous sample) yields no
//   increment signals for that head, and the next overlap needs two new
//   increments in a row.
// - Every signal is emitted per head (head >= 0) and aggregated over the heads
//   that produced it (head = kAllHeads) with the spec's aggregation.
#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "detectors/attention_stats.h"
#include "detectors/detector.h"
#include "detectors/dtype.h"
#include "detectors/qk_detector.h"
#include "detectors/qk_spectrum.h"

namespace foreshock::detectors {
namespace {

enum QKSignal : size_t {
  kIncrementEntropy,
  kIncrementEffectiveRank,
  kIncrementTop1Share,
  kSecondOrderRatio,
  kIncrementTop1Overlap,
  kAttentionEntropy,
  kAttentionMaxLogit,
  kHeadSignalCount,  // the signals above are per head; those below per layer
  kProbeHeads = kHeadSignalCount,
  kProbeTokens,
  kAttentionComputeBits,
  kAttentionOutputBias,
  kAttentionOutputError,
  kQKSignalCount,
};

constexpr std::array<SignalSpec, kQKSignalCount> kQKSignals = {{
    {"qk_increment_entropy",
     "Normalized spectral entropy (0 to 1) of the first-order change of the attention logits "
     "between consecutive probe samples; per layer, the minimum over heads.",
     SignalScope::kLayerHead, HeadAggregation::kMin},
    {"qk_increment_effective_rank",
     "Effective rank exp(H) of the first-order change of the attention logits between "
     "consecutive probe samples; per layer, the minimum over heads.",
     SignalScope::kLayerHead, HeadAggregation::kMin},
    {"qk_increment_top1_share",
     "Share of the squared norm of the first-order attention logit change carried by its top "
     "singular direction; per layer, the maximum over heads.",
     SignalScope::kLayerHead, HeadAggregation::kMax},
    {"qk_second_order_ratio",
     "Norm of the second-order attention logit change dQ dK^T relative to the first-order "
     "change; per layer, the maximum over heads.",
     SignalScope::kLayerHead, HeadAggregation::kMax},
    {"qk_increment_top1_overlap",
     "Absolute cosine between the top token-space directions of consecutive attention logit "
     "changes (1 means the same direction every step); per layer, the minimum over heads.",
     SignalScope::kLayerHead, HeadAggregation::kMin},
    {"attention_entropy",
     "Softmax attention entropy in nats, averaged over probe queries with the sample's mask; "
     "per layer, the minimum over heads.",
     SignalScope::kLayerHead, HeadAggregation::kMin},
    {"attention_max_logit",
     "Largest attention logit q.k/sqrt(head_dim) over the probe's unmasked query-key pairs; "
     "per layer, the maximum over heads.",
     SignalScope::kLayerHead, HeadAggregation::kMax},
    {"qk_probe_heads",
     "Query heads in the layer's latest QK sample: all of them, or the rotating subset the "
     "client probes (Monitor(probe_heads=...)); the others keep their latest values.",
     SignalScope::kLayer},
    {"qk_probe_tokens",
     "Tokens in the layer's latest QK sample (the probe batch, or the subset the client sends: "
     "Monitor(probe_tokens=...)).",
     SignalScope::kLayer},
    {"attention_compute_bits",
     "Bits of the floating-point type the model computes the layer's attention in, as the "
     "client reports it (32: fp32; 16: bf16 or fp16); absent when the client does not say. "
     "fp32 attention rules out a low-precision-attention fault.",
     SignalScope::kLayer},
    {"attention_output_bias",
     "Rounding bias of the layer's attention output on the probe against the client's fp32 "
     "reference O_ref: |mean((O - O_ref) sign(O_ref))| less 4 standard errors (rms error / "
     "sqrt(values)), floored at 0, over mean|O_ref|, in units of the unit roundoff of the "
     "attention compute dtype (bf16 2^-8, fp16 2^-11, fp32 2^-24). Round-to-nearest kernels "
     "read 0 or nearly; plain truncation about 0.5 to 1.5. Present when the client checks the "
     "output (QKSample.output_check) and says the dtype.",
     SignalScope::kLayer},
    {"attention_output_error",
     "Root-mean-square error of the layer's attention output on the probe against the client's "
     "fp32 reference, over mean|O_ref|, in units of the attention compute dtype's unit roundoff "
     "(round-to-nearest: about 0.3 to 1). Present with attention_output_bias.",
     SignalScope::kLayer},
}};

// attention_output_bias is the mean signed error less this many standard errors.
constexpr double kBiasStandardErrors = 4.0;

// Unit roundoff (half an ulp at 1) of a compute dtype: 2^-(mantissa bits + 1).
double UnitRoundoff(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return 0x1p-8;
    case DType::kFloat16: return 0x1p-11;
    case DType::kFloat32: break;
  }
  return 0x1p-24;
}

// The output-check signals, when the sample has a check and says its dtype.
// Non-finite figures mean the kernel's output held NaN/Inf: reported as such.
void EmitOutputCheck(const QKSample& qk, Emitter& emitter) {
  if (!qk.output_check || !qk.attention_dtype) return;
  const AttentionOutputCheck& c = *qk.output_check;
  if (!std::isfinite(c.mean_signed_error) || !std::isfinite(c.rms_error) ||
      !std::isfinite(c.mean_abs_reference)) {
    emitter.NonFinite(SampleKind::kQK, 1);
    return;
  }
  if (c.mean_abs_reference <= 0) return;  // an all-zero output has no scale to err against
  const double unit = c.mean_abs_reference * UnitRoundoff(*qk.attention_dtype);
  // A lower confidence bound on the bias: round-to-nearest's mean error on a
  // small probe (a few hundred values) can reach a fifth of a unit roundoff
  // by chance; biased rounding's mean is most of its rms, on any probe.
  const double standard_error = c.rms_error / std::sqrt(static_cast<double>(c.elements));
  const double bias = std::max(0.0, std::abs(c.mean_signed_error) - kBiasStandardErrors * standard_error);
  emitter.Emit(Observation{kQKSignals[kAttentionOutputBias].name, qk.layer, kAllHeads, bias / unit});
  emitter.Emit(Observation{kQKSignals[kAttentionOutputError].name, qk.layer, kAllHeads,
                           c.rms_error / unit});
}

// The per-layer value of a signal from its per-head values (never empty).
double Aggregate(HeadAggregation aggregation, const std::vector<double>& values) {
  switch (aggregation) {
    case HeadAggregation::kMin: return *std::min_element(values.begin(), values.end());
    case HeadAggregation::kMax: return *std::max_element(values.begin(), values.end());
    case HeadAggregation::kMean:
    case HeadAggregation::kNone: break;
  }
  double sum = 0;
  for (double v : values) sum += v;
  return sum / static_cast<double>(values.size());
}

// q [heads, tokens, dim] and k [kv_heads, tokens, dim] pair up: either
// kv_head_of names a K head for every query head, or (empty) k has a head per
// query head. What the server's validation guarantees, checked again here and
// on restored state: a sample is never trusted blindly.
bool ValidPairing(const std::vector<int64_t>& q, const std::vector<int64_t>& k,
                  const std::vector<int32_t>& kv_head_of) {
  if (q.size() != 3 || k.size() != 3 || q[1] != k[1] || q[2] != k[2]) return false;
  if (kv_head_of.empty()) return q[0] == k[0];
  if (static_cast<int64_t>(kv_head_of.size()) != q[0]) return false;
  return std::all_of(kv_head_of.begin(), kv_head_of.end(),
                     [&](int32_t kv) { return kv >= 0 && kv < k[0]; });
}

class QKDetector final : public Detector {
 public:
  static constexpr std::string_view kName = "qk";
  static constexpr SampleKind kKind = SampleKind::kQK;
  static std::span<const SignalSpec> Signals() { return kQKSignals; }

  explicit QKDetector(const DetectorOptions& options)
      : options_(options.Get<QKDetectorOptions>()) {}
  static std::optional<RetainedFootprint> RetainedBy(const Sample& sample,
                                                     const DetectorOptions& options);

  void Process(const Sample& sample, Emitter& emitter) override;

  void ForgetRun(const std::string& run) override {
    auto it = series_.lower_bound(SeriesKey{run, std::numeric_limits<int>::min(), ""});
    while (it != series_.end() && std::get<0>(it->first) == run) it = series_.erase(it);
  }

  // State, version 3: U64 series count, then per series (in key order):
  //   run, I32 layer, probe_id, U64 head count, per head (ascending):
  //   I32 head, tensor q, tensor k (that head's previous finite Q and its K,
  //   each [tokens, head_dim]), Vector<double> top direction (empty when unknown),
  //   kHeadSignalCount Double: its latest value of each per-head signal (NaN: none).
  // a tensor is U8 dtype, Vector<i64> shape, Bytes data.
  // Versions 1 and 2 (read too) kept the previous sample whole: per series
  //   tensor q [heads, tokens, dim], tensor k [kv_heads, tokens, dim],
  //   (version 2) Vector<i32> kv_head_of, U64 heads, per head Vector<double>.
  void SaveState(codec::StateWriter& writer) const override;
  bool RestoreState(codec::StateReader& reader, const SeriesFilter& keep) override;

  void VisitRetained(const RetainedVisitor& visit) const override {
    for (const auto& [key, state] : series_) {
      const auto& [run, layer, probe_id] = key;
      for (const auto& [head, head_state] : state.heads) {
        if (head_state.q.shape.size() != 2 || head_state.k == nullptr) continue;
        // The K copy's owners are the query heads that attended with it.
        visit(run, kKind, layer, probe_id, head,
              QKHeadRetainedBytes(head_state.q.shape[0], head_state.q.shape[1], head_state.q.dtype,
                                  head_state.k->dtype, head_state.k.use_count(),
                                  options_.track_top_vector));
      }
    }
  }

 private:
  using SeriesKey = std::tuple<std::string, int, std::string>;  // run, layer, probe_id
  struct HeadState {
    // The head's previous finite Q and the K it attended with, [tokens, dim],
    // as raw bytes (decoded only when needed: half the memory for 16-bit
    // dtypes). The query heads of one grouped-query K share its copy: a K head
    // is kept once per sample it came from, not once per query head.
    RawTensor q;
    std::shared_ptr<const RawTensor> k;
    // The previous increment's top direction; empty when unknown.
    std::vector<double> top_vector;
    // Per head signal: its value from this head's latest sample (NaN: that
    // sample gave none). The per-layer value aggregates these over every
    // head, so that a rotating subset of heads still yields a value for the
    // whole layer (each head's at most one rotation old), not a different
    // subset's extreme every probe.
    std::array<double, kHeadSignalCount> latest;
    HeadState() { latest.fill(std::numeric_limits<double>::quiet_NaN()); }
  };
  struct SeriesState {
    std::map<int, HeadState> heads;  // by the model's query head index
  };

  QKDetectorOptions options_;
  std::map<SeriesKey, SeriesState> series_;
  // Decoding buffers, reused across samples.
  std::vector<float> q_, k_, q_prev_, k_prev_;
  // Within one Process call: the previous K that k_prev_ holds, and the G_B
  // of (that previous K, this sample's K row key_gram_kv_). The query heads of
  // a group sampled together share both, so each is computed once per group.
  std::shared_ptr<const RawTensor> k_prev_decoded_, key_gram_prev_;
  int64_t key_gram_kv_ = -1;
  QKKeyGram key_gram_;
  bool RestoreWholeSample(codec::StateReader& reader, uint32_t version, SeriesState& state);
};

// One head's rows of a raw [heads, tokens, dim] tensor, as a [tokens, dim] tensor.
RawTensor HeadSlice(const RawTensor& tensor, int64_t head) {
  RawTensor out;
  out.dtype = tensor.dtype;
  out.shape = {tensor.shape[1], tensor.shape[2]};
  const size_t bytes = static_cast<size_t>(tensor.shape[1] * tensor.shape[2]) * DTypeSize(tensor.dtype);
  out.data.assign(tensor.data, static_cast<size_t>(head) * bytes, bytes);
  return out;
}

// q rows name distinct model heads in ascending order (or none: 0..heads-1).
bool ValidHeads(const std::vector<int32_t>& heads, int64_t rows) {
  if (heads.empty()) return true;
  if (static_cast<int64_t>(heads.size()) != rows || heads.front() < 0) return false;
  return std::adjacent_find(heads.begin(), heads.end(),
                            [](int32_t a, int32_t b) { return a >= b; }) == heads.end();
}

void QKDetector::Process(const Sample& sample, Emitter& emitter) {
  const auto& qk = std::get<QKSample>(sample.payload);
  // The server validates shapes; a malformed sample is dropped, never trusted.
  if (!ValidPairing(qk.q.shape, qk.k.shape, qk.kv_head_of) || !ValidHeads(qk.heads, qk.q.shape[0])) {
    return;
  }

  const int64_t non_finite = CountNonFinite(qk.q) + CountNonFinite(qk.k);
  if (non_finite > 0) {
    emitter.NonFinite(SampleKind::kQK, non_finite);
    return;
  }
  EmitOutputCheck(qk, emitter);

  const int64_t rows = qk.q.shape[0];
  const int64_t tokens = qk.q.shape[1];
  const int64_t head_dim = qk.q.shape[2];
  const int64_t head_size = tokens * head_dim;
  const std::vector<int64_t> head_shape{tokens, head_dim};

  SeriesState& state = series_[SeriesKey{sample.run, qk.layer, qk.probe_id}];
  DecodeTensor(qk.q, q_);
  DecodeTensor(qk.k, k_);

  // values[signal] holds one entry per head that produced the signal.
  std::array<std::vector<std::pair<int, double>>, kHeadSignalCount> values;
  const AttentionMask mask{qk.causal, qk.seq_len};
  const QKSpectrumOptions spectrum_options{options_.track_top_vector};
  using HeadMap = Eigen::Map<const RowMajorMatrix<float>>;
  std::vector<std::shared_ptr<const RawTensor>> k_heads(static_cast<size_t>(qk.k.shape[0]));
  for (int64_t row = 0; row < rows; ++row) {
    const int head = qk.heads.empty() ? static_cast<int>(row) : qk.heads[static_cast<size_t>(row)];
    // Grouped-query attention: this query head's K head (K is sent once per group).
    const int64_t kv = qk.kv_head_of.empty() ? row : qk.kv_head_of[static_cast<size_t>(row)];
    const HeadMap q(q_.data() + row * head_size, tokens, head_dim);
    const HeadMap k(k_.data() + kv * head_size, tokens, head_dim);

    AttentionStats attention = ComputeAttentionStats<float>(q, k, mask);
    if (!std::isfinite(attention.mean_entropy) || !std::isfinite(attention.max_logit)) {
      // Finite inputs whose logits overflow float: redo this head in double.
      const RowMajorMatrix<double> q64 = q.cast<double>();
      const RowMajorMatrix<double> k64 = k.cast<double>();
      attention = ComputeAttentionStats<double>(q64, k64, mask);
    }
    values[kAttentionEntropy].emplace_back(head, attention.mean_entropy);
    // Soft-capped logits (Gemma 2): the max of cap * tanh(x / cap) is the capped max.
    values[kAttentionMaxLogit].emplace_back(
        head, qk.logit_softcap > 0
                  ? qk.logit_softcap * std::tanh(attention.max_logit / qk.logit_softcap)
                  : attention.max_logit);

    HeadState& previous = state.heads[head];
    const bool has_previous = previous.q.shape == head_shape && previous.q.dtype == qk.q.dtype &&
                              previous.k != nullptr && previous.k->dtype == qk.k.dtype;
    if (has_previous) {
      DecodeTensor(previous.q, q_prev_);
      if (previous.k != k_prev_decoded_) {
        DecodeTensor(*previous.k, k_prev_);
        k_prev_decoded_ = previous.k;
      }
      const HeadMap q_prev(q_prev_.data(), tokens, head_dim);
      const HeadMap k_prev(k_prev_.data(), tokens, head_dim);
      QKSpectrumOptions options = spectrum_options;
      if (tokens >= 2 * head_dim) {  // the Gram route (ComputeQKIncrementSpectrum<float>)
        if (key_gram_kv_ != kv || key_gram_prev_ != previous.k) {
          ComputeQKKeyGram<float>(k_prev, k, key_gram_);
          key_gram_kv_ = kv;
          key_gram_prev_ = previous.k;
        }
        options.key_gram = &key_gram_;
      }
      QKIncrementSpectrum spectrum = ComputeQKIncrementSpectrum<float>(q_prev, k_prev, q, k, options);
      if (!std::isfinite(spectrum.normalized_entropy) || !std::isfinite(spectrum.top1_share) ||
          !std::isfinite(spectrum.second_order_ratio)) {
        // Finite inputs whose increment overflows float (|values| near 3e38): use double.
        const RowMajorMatrix<double> q_prev64 = q_prev.cast<double>(), k_prev64 = k_prev.cast<double>();
        const RowMajorMatrix<double> q64 = q.cast<double>(), k64 = k.cast<double>();
        spectrum = ComputeQKIncrementSpectrum<double>(q_prev64, k_prev64, q64, k64, spectrum_options);
      }
      if (spectrum.zero_increment) {
        previous.top_vector.clear();
      } else {
        values[kIncrementEntropy].emplace_back(head, spectrum.normalized_entropy);
        values[kIncrementEffectiveRank].emplace_back(head, spectrum.effective_rank);
        values[kIncrementTop1Share].emplace_back(head, spectrum.top1_share);
        values[kSecondOrderRatio].emplace_back(head, spectrum.second_order_ratio);
        if (options_.track_top_vector) {
          if (!previous.top_vector.empty()) {
            values[kIncrementTop1Overlap].emplace_back(
                head, TopVectorOverlap(previous.top_vector, spectrum.top_vector));
          }
          previous.top_vector = std::move(spectrum.top_vector);
        }
      }
    } else {
      previous.top_vector.clear();  // a restarted head: no direction to compare with
    }
    previous.q = HeadSlice(qk.q, row);
    std::shared_ptr<const RawTensor>& k_copy = k_heads[static_cast<size_t>(kv)];
    if (k_copy == nullptr) k_copy = std::make_shared<const RawTensor>(HeadSlice(qk.k, kv));
    previous.k = k_copy;
  }
  // Release the previous K copies held above (the retained-bytes accounting counts owners).
  k_prev_decoded_.reset();
  key_gram_prev_.reset();
  key_gram_kv_ = -1;

  // What was sampled: the per-layer values above are over these heads and tokens.
  emitter.Emit(Observation{kQKSignals[kProbeHeads].name, qk.layer, kAllHeads, static_cast<double>(rows)});
  emitter.Emit(Observation{kQKSignals[kProbeTokens].name, qk.layer, kAllHeads, static_cast<double>(tokens)});
  if (qk.attention_dtype) {
    emitter.Emit(Observation{kQKSignals[kAttentionComputeBits].name, qk.layer, kAllHeads,
                             8.0 * static_cast<double>(DTypeSize(*qk.attention_dtype))});
  }
  // A full sample (no head names) holds every head there is: forget heads of
  // an earlier, larger shape, so that their values leave the layer's.
  if (qk.heads.empty()) state.heads.erase(state.heads.lower_bound(static_cast<int>(rows)), state.heads.end());
  // Each sampled head's latest values: what it gave now, NaN for what it did not.
  for (int64_t row = 0; row < rows; ++row) {
    const int head = qk.heads.empty() ? static_cast<int>(row) : qk.heads[static_cast<size_t>(row)];
    state.heads[head].latest.fill(std::numeric_limits<double>::quiet_NaN());
  }
  for (size_t signal = 0; signal < kHeadSignalCount; ++signal) {
    for (const auto& [head, value] : values[signal]) state.heads[head].latest[signal] = value;
  }
  std::vector<double> head_values;
  for (size_t signal = 0; signal < kHeadSignalCount; ++signal) {
    if (values[signal].empty()) continue;
    const SignalSpec& spec = kQKSignals[signal];
    for (const auto& [head, value] : values[signal]) {
      emitter.Emit(Observation{spec.name, qk.layer, head, value});
    }
    // Over every head's latest value: the sampled heads' fresh ones and, when
    // the client probes a rotating subset, the others' from their latest sample.
    head_values.clear();
    for (const auto& [head, head_state] : state.heads) {
      if (!std::isnan(head_state.latest[signal])) head_values.push_back(head_state.latest[signal]);
    }
    emitter.Emit(
        Observation{spec.name, qk.layer, kAllHeads, Aggregate(spec.aggregation, head_values)});
  }
}

constexpr uint32_t kQKStateVersion = 3;

void PutTensor(codec::StateWriter& writer, const RawTensor& tensor) {
  writer.PutU8(static_cast<uint8_t>(tensor.dtype));
  writer.PutVector(tensor.shape);
  writer.PutBytes(tensor.data);
}

// Reads a tensor as PutTensor wrote it and checks the sample invariant
// (data.size() == product(shape) * DTypeSize, every dim > 0); an empty shape
// with no data is "no tensor". The data stays a view into the input.
bool GetTensor(codec::StateReader& reader, DType& dtype, std::vector<int64_t>& shape,
               std::string_view& data) {
  uint8_t dtype_byte = 0;
  if (!reader.GetU8(dtype_byte) || !reader.GetVector(shape) || !reader.GetStringView(data)) {
    return false;
  }
  if (dtype_byte > static_cast<uint8_t>(DType::kFloat16)) return reader.Fail("unknown dtype");
  dtype = static_cast<DType>(dtype_byte);
  if (shape.empty()) return data.empty() ? true : reader.Fail("tensor data without a shape");
  const uint64_t max_elements = data.size() / DTypeSize(dtype);
  uint64_t elements = 1;
  for (int64_t d : shape) {
    if (d <= 0 || static_cast<uint64_t>(d) > max_elements / elements) {
      return reader.Fail("tensor shape does not match its data");
    }
    elements *= static_cast<uint64_t>(d);
  }
  if (elements * DTypeSize(dtype) != data.size()) {
    return reader.Fail("tensor shape does not match its data");
  }
  return true;
}

void QKDetector::SaveState(codec::StateWriter& writer) const {
  writer.PutU32(kQKStateVersion);
  writer.PutU64(series_.size());
  for (const auto& [key, state] : series_) {
    const auto& [run, layer, probe_id] = key;
    writer.PutString(run);
    writer.PutI32(layer);
    writer.PutString(probe_id);
    writer.PutU64(state.heads.size());
    for (const auto& [head, head_state] : state.heads) {
      writer.PutI32(head);
      PutTensor(writer, head_state.q);
      PutTensor(writer, head_state.k != nullptr ? *head_state.k : RawTensor{});
      writer.PutVector(head_state.top_vector);
      for (double value : head_state.latest) writer.PutDouble(value);
    }
  }
}

// Versions 1 and 2: the previous sample whole, split here into its heads.
bool QKDetector::RestoreWholeSample(codec::StateReader& reader, uint32_t version,
                                    SeriesState& state) {
  DType q_dtype{}, k_dtype{};
  std::vector<int64_t> q_shape, k_shape;
  std::string_view q_data, k_data;
  std::vector<int32_t> kv_head_of;
  uint64_t heads = 0;
  if (!GetTensor(reader, q_dtype, q_shape, q_data) || !GetTensor(reader, k_dtype, k_shape, k_data) ||
      (version >= 2 && !reader.GetVector(kv_head_of)) || !reader.GetCount(heads, 8)) {
    return false;
  }
  if (q_shape.empty() != k_shape.empty() ||
      (!q_shape.empty() && !ValidPairing(q_shape, k_shape, kv_head_of))) {
    return reader.Fail("q, k and kv_head_of do not pair up");
  }
  if (heads > (q_shape.empty() ? 0 : static_cast<uint64_t>(q_shape[0]))) {
    return reader.Fail("more top directions than heads");
  }
  std::vector<std::vector<double>> top_vectors(static_cast<size_t>(heads));
  for (std::vector<double>& top : top_vectors) {
    if (!reader.GetVector(top)) return false;
    // A direction lives in token space (its length is the probe's token count).
    if (!top.empty() && top.size() != static_cast<uint64_t>(q_shape[1])) {
      return reader.Fail("top direction length does not match the probe");
    }
  }
  if (q_shape.empty()) return true;
  RawTensor q{q_dtype, q_shape, std::string(q_data)}, k{k_dtype, k_shape, std::string(k_data)};
  if (CountNonFinite(q) + CountNonFinite(k) > 0) return reader.Fail("a kept sample has non-finite values");
  std::vector<std::shared_ptr<const RawTensor>> k_heads(static_cast<size_t>(k_shape[0]));
  for (int64_t h = 0; h < q_shape[0]; ++h) {
    HeadState& head = state.heads[static_cast<int>(h)];
    head.q = HeadSlice(q, h);
    const int64_t kv = kv_head_of.empty() ? h : kv_head_of[static_cast<size_t>(h)];
    if (k_heads[static_cast<size_t>(kv)] == nullptr) {
      k_heads[static_cast<size_t>(kv)] = std::make_shared<const RawTensor>(HeadSlice(k, kv));
    }
    head.k = k_heads[static_cast<size_t>(kv)];
    if (static_cast<uint64_t>(h) < heads) head.top_vector = std::move(top_vectors[static_cast<size_t>(h)]);
  }
  return true;
}

bool QKDetector::RestoreState(codec::StateReader& reader, const SeriesFilter& keep) {
  std::map<SeriesKey, SeriesState> restored;
  auto read = [&]() -> bool {
    uint32_t version = 0;
    uint64_t count = 0;
    if (!reader.GetVersion("qk", 1, kQKStateVersion, version) || !reader.GetCount(count)) {
      return false;
    }
    for (uint64_t i = 0; i < count; ++i) {
      std::string run, probe_id;
      int32_t layer = 0;
      if (!reader.GetString(run) || !reader.GetI32(layer) || !reader.GetString(probe_id)) {
        return false;
      }
      SeriesState state;
      if (version < 3) {
        if (!RestoreWholeSample(reader, version, state)) return false;
      } else {
        uint64_t heads = 0;
        if (!reader.GetCount(heads, 8)) return false;
        std::map<std::string_view, std::shared_ptr<const RawTensor>> k_copies;  // by bytes
        for (uint64_t h = 0; h < heads; ++h) {
          int32_t head = 0;
          HeadState head_state;
          DType q_dtype{}, k_dtype{};
          std::vector<int64_t> q_shape, k_shape;
          std::string_view q_data, k_data;
          if (!reader.GetI32(head) || !GetTensor(reader, q_dtype, q_shape, q_data) ||
              !GetTensor(reader, k_dtype, k_shape, k_data) || !reader.GetVector(head_state.top_vector)) {
            return false;
          }
          for (double& value : head_state.latest) {
            if (!reader.GetDouble(value)) return false;
          }
          if (head < 0 || q_shape.size() != 2 || q_shape != k_shape) {
            return reader.Fail("a head's q and k are not both [tokens, dim]");
          }
          if (!head_state.top_vector.empty() &&
              head_state.top_vector.size() != static_cast<uint64_t>(q_shape[0])) {
            return reader.Fail("top direction length does not match the probe");
          }
          head_state.q = RawTensor{q_dtype, std::move(q_shape), std::string(q_data)};
          // Only finite samples are kept: anything else is a corrupt state.
          if (CountNonFinite(head_state.q) > 0 ||
              CountNonFinite(RawTensor{k_dtype, k_shape, std::string(k_data)}) > 0) {
            return reader.Fail("a kept sample has non-finite values");
          }
          // Heads that shared a K copy when saved share one again (identical bytes).
          std::shared_ptr<const RawTensor>& k_copy = k_copies[k_data];
          if (k_copy == nullptr || k_copy->dtype != k_dtype || k_copy->shape != k_shape) {
            k_copy = std::make_shared<const RawTensor>(
                RawTensor{k_dtype, std::move(k_shape), std::string(k_data)});
          }
          head_state.k = k_copy;
          if (!state.heads.emplace(head, std::move(head_state)).second) {
            return reader.Fail("head saved twice");
          }
        }
      }
      SeriesKey key{std::move(run), layer, std::move(probe_id)};
      if (keep && !keep(std::get<0>(key), layer)) continue;
      if (!restored.emplace(std::move(key), std::move(state)).second) {
        return reader.Fail("series saved twice");
      }
    }
    return true;
  };
  if (!read()) {
    series_.clear();
    return false;
  }
  for (auto& [key, state] : restored) series_.insert_or_assign(key, std::move(state));
  return true;
}


// What a QK sample leaves: each of its heads' previous Q and K share
// (kRetainedOverheadBytes included); nullopt for a sample it would drop.
std::optional<RetainedFootprint> QKDetector::RetainedBy(const Sample& sample,
                                                        const DetectorOptions& options) {
  const auto* qk = std::get_if<QKSample>(&sample.payload);
  if (qk == nullptr) return std::nullopt;
  const auto& q = qk->q.shape;
  const auto& k = qk->k.shape;
  if (q.size() != 3 || k.size() != 3) return std::nullopt;
  const int64_t rows = q[0];
  if (!qk->heads.empty() && static_cast<int64_t>(qk->heads.size()) != rows) return std::nullopt;
  // Query heads per K head in this sample: they share one copy of it.
  std::map<int64_t, int64_t> sharers;
  for (int64_t row = 0; row < rows; ++row) {
    ++sharers[qk->kv_head_of.empty() ? row : qk->kv_head_of[static_cast<size_t>(row)]];
  }
  RetainedFootprint footprint{SampleKind::kQK, qk->layer, qk->probe_id, qk->heads.empty(), {}};
  footprint.heads.reserve(static_cast<size_t>(rows));
  const bool track_top_vector = options.Get<QKDetectorOptions>().track_top_vector;
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t kv = qk->kv_head_of.empty() ? row : qk->kv_head_of[static_cast<size_t>(row)];
    const int head = qk->heads.empty() ? static_cast<int>(row) : qk->heads[static_cast<size_t>(row)];
    footprint.heads.emplace_back(
        head, QKHeadRetainedBytes(q[1], q[2], qk->q.dtype, qk->k.dtype, sharers[kv],
                                  track_top_vector));
  }
  return footprint;
}

}  // namespace

// The QK detector's retained state per head (retained_state.h).
int64_t QKHeadRetainedBytes(int64_t tokens, int64_t head_dim, DType q_dtype, DType k_dtype,
                            int64_t k_sharers, bool top_vector) {
  const int64_t elements = tokens * head_dim;
  const int64_t k_bytes = elements * static_cast<int64_t>(DTypeSize(k_dtype));
  const int64_t sharers = std::max<int64_t>(1, k_sharers);
  return elements * static_cast<int64_t>(DTypeSize(q_dtype)) + (k_bytes + sharers - 1) / sharers +
         (top_vector ? tokens * static_cast<int64_t>(sizeof(double)) : 0) + kRetainedOverheadBytes;
}

FORESHOCK_REGISTER_DETECTOR(QKDetector);

}  // namespace foreshock::detectors
