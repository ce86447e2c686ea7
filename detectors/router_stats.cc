#include "detectors/router_stats.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include <Eigen/Core>

namespace foreshock::detectors {
namespace {

// numpy.percentile's default ("linear") on a copy of `values`.
double Percentile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  const double pos = q / 100.0 * static_cast<double>(values.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(values.size() - 1, lo + 1);
  std::nth_element(values.begin(), values.begin() + lo, values.end());
  const double v_lo = values[lo];
  const double v_hi = hi == lo ? v_lo : *std::min_element(values.begin() + lo + 1, values.end());
  return v_lo + (v_hi - v_lo) * (pos - static_cast<double>(lo));
}

}  // namespace

RouterStats ComputeRouterStats(std::span<const float> logits, int tokens, int experts,
                               const RouterOptions& options, RouterDecisions& decisions) {
  using RowArray = Eigen::Array<float, 1, Eigen::Dynamic>;
  const int k = options.top_k;
  const double log_e = std::log(static_cast<double>(experts));
  RouterStats stats;
  stats.load.assign(experts, 0.0);
  decisions.tokens = tokens;
  decisions.experts = experts;
  decisions.top_k = k;
  decisions.topk.resize(static_cast<size_t>(tokens) * k);
  decisions.probs.resize(static_cast<size_t>(tokens) * experts);
  decisions.entropy.resize(tokens);

  std::vector<double> margins(tokens);
  std::vector<int32_t> order(experts);
  RowArray shifted(experts);
  int low_entropy = 0;
  double entropy_sum = 0, z_loss_sum = 0, max_abs = 0;
  for (int t = 0; t < tokens; ++t) {
    const float* z = logits.data() + static_cast<size_t>(t) * experts;
    const Eigen::Map<const RowArray> row(z, experts);
    Eigen::Map<RowArray> p(decisions.probs.data() + static_cast<size_t>(t) * experts, experts);
    // Softmax and entropy with Eigen's vectorized exp, accumulated in double.
    const float z_max = row.maxCoeff();
    max_abs = std::max(max_abs, static_cast<double>(row.abs().maxCoeff()));
    shifted = row - z_max;
    p = shifted.exp();
    const double sum = p.template cast<double>().sum();
    const double log_sum = std::log(sum);
    p /= static_cast<float>(sum);
    // H = -sum p log p = log_sum - sum p (z - z_max): exact where p underflows.
    const double h = log_sum - (p.template cast<double>() * shifted.template cast<double>()).sum();
    decisions.entropy[t] = h;
    const double lse = z_max + log_sum;
    const double h_norm = h / log_e;
    entropy_sum += h_norm;
    if (h_norm < options.entropy_floor) ++low_entropy;
    z_loss_sum += lse * lse;

    // Top-(k+1) by logit, ties to the lower index.
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k + 1, order.end(),
                      [z](int32_t a, int32_t b) { return z[a] > z[b] || (z[a] == z[b] && a < b); });
    margins[t] = static_cast<double>(z[order[k - 1]]) - static_cast<double>(z[order[k]]);
    int32_t* chosen = decisions.topk.data() + static_cast<size_t>(t) * k;
    std::copy(order.begin(), order.begin() + k, chosen);
    std::sort(chosen, chosen + k);
    for (int i = 0; i < k; ++i) stats.load[chosen[i]] += 1.0;
  }

  const double assignments = static_cast<double>(tokens) * k;
  const double mean_load = 1.0 / experts;
  double var = 0, max_load = 0, load_entropy = 0;
  for (double& f : stats.load) {
    f /= assignments;
    var += (f - mean_load) * (f - mean_load);
    max_load = std::max(max_load, f);
    if (f > 0) load_entropy -= f * std::log(f);
    if (f > options.capacity_factor / experts) ++stats.overloaded_experts;
  }
  stats.entropy_mean = entropy_sum / tokens;
  stats.low_entropy_fraction = static_cast<double>(low_entropy) / tokens;
  stats.load_cv = std::sqrt(var / experts) / mean_load;
  stats.max_violation = (max_load - mean_load) / mean_load;
  stats.load_entropy = load_entropy / log_e;
  stats.cv_noise_floor = std::sqrt(static_cast<double>(experts - k) / (static_cast<double>(k) * tokens));
  stats.topk_margin_mean = std::accumulate(margins.begin(), margins.end(), 0.0) / tokens;
  stats.topk_margin_p10 = Percentile(std::move(margins), 10.0);
  stats.z_loss = z_loss_sum / tokens;
  stats.max_abs_logit = max_abs;
  return stats;
}

double FlipRate(const RouterDecisions& previous, const RouterDecisions& current) {
  const int k = current.top_k;
  int flipped = 0;
  for (int t = 0; t < current.tokens; ++t) {
    const auto* a = previous.topk.data() + static_cast<size_t>(t) * k;
    const auto* b = current.topk.data() + static_cast<size_t>(t) * k;
    if (!std::equal(a, a + k, b)) ++flipped;
  }
  return static_cast<double>(flipped) / current.tokens;
}

double MeanJensenShannon(const RouterDecisions& previous, const RouterDecisions& current) {
  // JS(p, q) = H(m) - (H(p) + H(q)) / 2 with m = (p + q) / 2: one log per
  // element, and H(p), H(q) are already known.
  using RowArray = Eigen::Array<float, 1, Eigen::Dynamic>;
  const int experts = current.experts;
  RowArray m(experts);
  double total = 0;
  for (int t = 0; t < current.tokens; ++t) {
    const Eigen::Map<const RowArray> p(previous.probs.data() + static_cast<size_t>(t) * experts, experts);
    const Eigen::Map<const RowArray> q(current.probs.data() + static_cast<size_t>(t) * experts, experts);
    m = 0.5f * (p + q);
    // m log m with 0 log 0 = 0 (m is 0 only where p and q both underflowed).
    const double h_m = -(m > 0.f).select(m * m.log(), 0.f).template cast<double>().sum();
    total += std::max(0.0, h_m - 0.5 * (previous.entropy[t] + current.entropy[t]));
  }
  return total / current.tokens;
}

std::vector<double> MeanLoads(const std::deque<std::vector<double>>& window) {
  if (window.empty()) return {};
  std::vector<double> mean(window.front().size(), 0.0);
  for (const auto& load : window) {
    for (size_t e = 0; e < mean.size(); ++e) mean[e] += load[e];
  }
  for (double& m : mean) m /= static_cast<double>(window.size());
  return mean;
}

int CountDiedExperts(const std::vector<double>& mean_loads, const std::vector<double>& peak) {
  const double experts = static_cast<double>(mean_loads.size());
  int died = 0;
  for (size_t e = 0; e < mean_loads.size() && e < peak.size(); ++e) {
    if (mean_loads[e] < 0.1 / experts && peak[e] >= 0.5 / experts) ++died;
  }
  return died;
}

int CountDeadExperts(const std::deque<std::vector<double>>& window) {
  if (window.empty()) return 0;
  const size_t experts = window.front().size();
  int dead = 0;
  for (size_t e = 0; e < experts; ++e) {
    double mean = 0;
    for (const auto& load : window) mean += load[e];
    mean /= static_cast<double>(window.size());
    if (mean < 0.1 / static_cast<double>(experts)) ++dead;
  }
  return dead;
}

}  // namespace foreshock::detectors
