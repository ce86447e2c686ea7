// MoE router statistics (docs/DESIGN.md §1.2) from one probe's logits.
//
// What the router is for is choosing experts; these numbers describe how
// sharply, how evenly and how stably it does so. Top-k ties are broken
// toward the lower expert index, as a stable sort would.
#pragma once

#include <cstdint>
#include <deque>
#include <span>
#include <vector>

#include <Eigen/Core>

namespace foreshock::detectors {

struct RouterOptions {
  int top_k = 1;
  double entropy_floor = 0.5;    // normalized entropy below which a token counts as low-entropy
  double capacity_factor = 1.25; // overloaded: load > capacity_factor / E
};

// Per-token routing decisions kept between samples for flip rate and JS divergence.
struct RouterDecisions {
  int tokens = 0;
  int experts = 0;
  int top_k = 0;
  std::vector<int32_t> topk;   // [tokens, top_k], expert indices ascending within a token
  // [tokens, experts], softmax of the logits. Aligned like Eigen's own
  // arrays: the vectorized softmax peels its first elements by address, so
  // with a plain vector the same logits gave last-bit different values
  // depending on where malloc put the buffer (and a restored detector would
  // not continue bit-identically).
  std::vector<float, Eigen::aligned_allocator<float>> probs;
  std::vector<double> entropy; // [tokens], H(p_t) in nats
};

struct RouterStats {
  double entropy_mean = 0;          // mean over tokens of H(p_t) / log E
  double low_entropy_fraction = 0;  // fraction of tokens whose normalized entropy < floor
  std::vector<double> load;         // f_e: share of the T*k assignments per expert (sums to 1)
  double load_cv = 0;               // std(f) / mean(f), population std
  double max_violation = 0;         // (max f - mean f) / mean f
  double load_entropy = 0;          // -sum f log f / log E
  double cv_noise_floor = 0;        // sqrt((E-k)/(k*T)): the CV of uniform random routing
  int overloaded_experts = 0;       // f_e > capacity_factor / E
  double topk_margin_mean = 0;      // mean over tokens of z_(k) - z_(k+1)
  double topk_margin_p10 = 0;       // 10th percentile (linear interpolation, as numpy)
  double z_loss = 0;                // mean over tokens of logsumexp(z_t)^2
  double max_abs_logit = 0;
};

// `logits` is [tokens, experts] row-major, all finite; 1 <= top_k < experts.
// Fills `decisions` for the next sample's flip rate.
RouterStats ComputeRouterStats(std::span<const float> logits, int tokens, int experts,
                               const RouterOptions& options, RouterDecisions& decisions);

// Fraction of tokens whose top-k set differs between two samples of the same
// probe (same tokens, experts and top_k).
double FlipRate(const RouterDecisions& previous, const RouterDecisions& current);

// Mean over tokens of the Jensen-Shannon divergence (nats) between the
// routing distributions of two samples of the same probe.
double MeanJensenShannon(const RouterDecisions& previous, const RouterDecisions& current);

// Experts whose mean load over `window` load vectors is below 0.1 / E.
int CountDeadExperts(const std::deque<std::vector<double>>& window);

// The mean load per expert over `window` (empty for an empty window).
std::vector<double> MeanLoads(const std::deque<std::vector<double>>& window);

// Experts that died during training: dead now (mean load over the window
// below 0.1 / E) although their windowed mean load once reached half the
// uniform share, 0.5 / E (`peak`: the highest windowed mean load per expert
// so far). Dead from initialization, or hovering at the threshold, is not died.
int CountDiedExperts(const std::vector<double>& mean_loads, const std::vector<double>& peak);

}  // namespace foreshock::detectors
