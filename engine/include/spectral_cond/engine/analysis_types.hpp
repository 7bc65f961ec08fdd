// spectral-cond: what the analysis behind `analyze` and `demo` is asked (AnalysisOptions, one
// field per command-line option) and what it reports, per checkpoint, layer, projection and head
// (docs/checkpoints.md). analysis.hpp computes them; analysis_format.hpp writes them.
#pragma once

#include <spectral_cond/conditioning/advisor.hpp>
#include <spectral_cond/conditioning/bound.hpp>
#include <spectral_cond/conditioning/methods/options.hpp>
#include <spectral_cond/core/rope.hpp>
#include <spectral_cond/io/checkpoint.hpp>
#include <spectral_cond/io/layouts/detect.hpp>
#include "index_selection.hpp"

#include <array>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace spectral_cond::engine {

/// What to compute. Every field is a command-line option of `analyze` (docs/checkpoints.md).
struct AnalysisOptions {
  std::string layout = "auto";
  std::string map;               ///< --map q=REGEX,k=REGEX,v=REGEX (replaces the layouts)
  std::int64_t heads = 0;        ///< 0: from config.json
  std::int64_t kv_heads = 0;     ///< 0: from config.json, else = heads
  double lambda = 10;            ///< λ of W + λ I_k (MATH.md §7)
  std::optional<double> target;  ///< target κ of the exact correction (none: 2 σ_1 / (σ_1 + σ_r))
  bool per_head = false;         ///< also every head's D x d block
  std::string layers;            ///< "0,3,5-7"; empty: all
  bool jacobian = false;         ///< κ(J) and Theorem 3.4 per head
  std::string inputs;            ///< X.npy (N x D); empty: synthetic tokens
  Index tokens = 64;             ///< N of the synthetic tokens
  std::uint64_t seed = 0;        ///< seed of the synthetic tokens
  JacobianKappaMethod method = JacobianKappaMethod::Auto;
  double tol = 1e-6;
  std::optional<double> scale;  ///< logit scale; none: 1/sqrt(d_k)
  /// The mask of κ(J): "auto" (causal for decoder self-attention, by the layout or a config that
  /// names a causal language model; none otherwise), "none" or "causal".
  std::string mask = "auto";
  bool blocks = false;            ///< also κ(J_Q), κ(J_K), κ(J_V)
  IndexSelection jacobian_heads;  ///< heads for κ(J); empty: all
  bool verbose = false;           ///< log every tensor read on stderr
  std::string device = "cpu";     ///< cuda: κ(J) of the heads batched on the GPU
  /// With --jacobian, also κ(J) of the corrected weights (λ fused, λ per-head, exact)
  bool jacobian_corrections = true;
  /// --placements: further placements of λ I (MATH.md §7: packed, subsets such as fused:qk)
  /// whose κ(J) follows the three corrections above, each named "lambda_" + its name.
  std::vector<CorrectionPlacement> placements;
  /// With --jacobian, the Q/K/V biases beside the weights (MATH.md §10); false: --no-biases
  bool biases = true;
  std::string rope = "auto";         ///< --rope auto|none|rotate_half|interleaved
  std::optional<double> rope_theta;  ///< --rope-theta (none: the model's, else 10000)
  std::int64_t rope_dims = 0;        ///< --rope-dims (0: the model's, else all of d_k)
  /// --jobs: threads over the three projections of a layer and over its heads for κ(J) (0, the
  /// default: one per hardware thread). The report is the serial one whatever the number.
  unsigned jobs = 0;
  /// --shard i/n: of the κ(J) work items (one per selected head of every self-attention layer,
  /// numbered across the checkpoints in report order), only those with number % count == index.
  std::uint64_t shard_index = 0, shard_count = 1;
  /// `advise`: the λ advisor's grid and criteria (MATH.md §17) in place of κ(J)'s report, on
  /// `advice_heads` heads per layer drawn at random with `seed` (0: every selected head).
  std::optional<AdviceOptions> advice;
  std::int64_t advice_heads = 2;
};

/// κ of W + λ E for one placement, computed from an SVD, with the Weyl bound when it applies.
struct CorrectedKappa {
  double sigma_max = 0, sigma_min = 0, kappa = 0;
  bool weyl_applies = false;  ///< E has unit singular values and λ > σ_1(W)
  double weyl_bound = std::numeric_limits<double>::quiet_NaN();  ///< (λ + s)/(λ - s)
};

/// One projection (whole, or one head's block).
struct MatrixStats {
  std::string role;    ///< "W_Q", "W_K", "W_V"
  std::string tensor;  ///< checkpoint tensor it comes from
  io::Dtype dtype = io::Dtype::F32;
  ConditionResult<double> cond;  ///< of W
  CorrectedKappa fused, per_head;
  double exact_kappa = 0, exact_predicted = 0, exact_alpha = 0;
};

struct HeadStats {
  Index head = 0, kv_head = 0;
  MatrixStats q, k, v;
};

/// κ(J), the bounds and the diagnostics of one head after one correction (MATH.md §6–7, §11).
struct CorrectedJacobian {
  /// "lambda_fused", "lambda_per_head", "exact", or "lambda_" + a --placements name
  std::string correction;
  /// The corrected weights equal the original ones (λ = 0, or α = 0 for the exact correction):
  /// the report is the original one.
  bool unchanged = false;
  Theorem34Report report;
  double seconds = 0;
};

struct JacobianStats {
  Index head = 0, kv_head = 0;
  Theorem34Report report;
  double seconds = 0;
  std::vector<CorrectedJacobian> corrected;  ///< when AnalysisOptions::jacobian_corrections
};

/// What the Jacobian analysis of a layer models beyond W_Q, W_K, W_V (MATH.md §10): the biases
/// it found beside them (whole projections) and RoPE.
struct LayerModel {
  std::array<std::string, 3> bias_tensors;  ///< of b_Q, b_K, b_V; empty: none
  std::array<bool, 3> bias_zero{};          ///< the tensor is all zeros (so it is left out)
  Vec<double> bq, bk, bv;                   ///< the nonzero ones; empty: none
  std::optional<RopeOptions> rope;          ///< for this layer's heads
  std::string rope_source;                  ///< where the RoPE decision came from
  bool extended() const { return bq.size() > 0 || bk.size() > 0 || bv.size() > 0 || rope; }
};

struct LayerStats {
  io::AttentionLayerSpec spec;
  io::LayerHeads heads;
  LayerModel model;  ///< with --jacobian, for self-attention layers
  MatrixStats q, k, v;
  std::vector<HeadStats> per_head;
  std::vector<JacobianStats> jacobian;
  std::vector<HeadAdvice> advice;  ///< `advise`: the advised heads, in head order
  Index tokens = 0;                ///< N of this layer's X (0 without --jacobian)
  std::string shared_by;           ///< a shared (ALBERT) layer: the layers it stands for
  std::string note;                ///< what the analysis of this layer left out, and why
  bool jacobian_analyzed = false;  ///< κ(J) was asked for this layer (some of its heads may be
                                   ///< in other shards)
  bool causal = false;             ///< κ(J) with the causal mask
};

struct CheckpointReport {
  std::string path;
  CheckpointFormat kind = CheckpointFormat::Safetensors;
  io::Layout layout = io::Layout::Auto;
  io::HeadConfig head_config;
  double lambda = 10;
  std::optional<double> target;
  Index tokens = 0;    ///< the largest N of the layers' X for κ(J) (0: no Jacobian)
  std::string inputs;  ///< "X.npy" or "synthetic (seed S)"
  double scale = std::numeric_limits<double>::quiet_NaN();  ///< NaN: 1/sqrt(d_k)
  std::string mask = "auto";  ///< the --mask asked for; each layer's is LayerStats::causal
  std::vector<LayerStats> layers;
};

/// Progress callback: fraction of the whole analysis done, in [0, 1].
using ProgressFn = std::function<void(double)>;

}  // namespace spectral_cond::engine
