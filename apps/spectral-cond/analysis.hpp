// spectral-cond: the analysis behind `analyze` and `demo` (docs/checkpoints.md): for each
// attention layer of a checkpoint, the condition numbers of W_Q, W_K, W_V (MATH.md §4, §8), after
// the λ I_k correction in both placements with the Weyl bound (§7), after the exact correction
// (§6), and optionally per head κ(J) with every term of Theorem 3.4 (§5). Layers are read one at
// a time from an io::CheckpointReader, so only the current layer's tensors are in memory.
#pragma once

#include "device.hpp"
#include "index_selection.hpp"
#include "parallel.hpp"

#include <spectral_cond/conditioning/bound.hpp>
#include <spectral_cond/conditioning/corrections.hpp>
#include <spectral_cond/conditioning/kappa.hpp>
#include <spectral_cond/io/attention_config.hpp>
#include <spectral_cond/io/paths.hpp>
#include "synthetic.hpp"

#include <sys/stat.h>

#include <array>
#include <chrono>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace spectral_cond::cli {

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
  bool causal = false;
  bool blocks = false;            ///< also κ(J_Q), κ(J_K), κ(J_V)
  IndexSelection jacobian_heads;  ///< heads for κ(J); empty: all
  bool verbose = false;           ///< log every tensor read on stderr
  std::string device = "cpu";     ///< cuda: κ(J) of the heads batched on the GPU
  /// With --jacobian, also κ(J) of the corrected weights (λ fused, λ per-head, exact)
  bool jacobian_corrections = true;
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
  std::string correction;  ///< "lambda_fused", "lambda_per_head" or "exact"
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
  Index tokens = 0;                ///< N of this layer's X (0 without --jacobian)
  std::string shared_by;           ///< a shared (ALBERT) layer: the layers it stands for
  std::string note;                ///< what the analysis of this layer left out, and why
  bool jacobian_analyzed = false;  ///< κ(J) was asked for this layer (some of its heads may be
                                   ///< in other shards)
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
  bool causal = false;
  std::vector<LayerStats> layers;
};

namespace detail_an {

/// One placement's addend E (MATH.md §7) and whether all its singular values are 1, which the
/// Weyl bound needs; kept per shape so that the check (a product E^T E) runs once per analysis,
/// not once per matrix.
struct Addend {
  Mat<double> E;
  bool unit_singular_values = false;
};

/// The addends of one analysis, by (rows, cols, heads, d, column offset, kind); kind 0 is the
/// identity of shape rows x cols, 1 the per-head stack, 2 a head's column slice of an identity.
class AddendCache {
 public:
  template <typename Make>
  const Addend& get(const std::array<Index, 6>& key, Make&& make) {
    auto it = cache_.find(key);
    if (it == cache_.end()) {
      Addend a;
      a.E = make();
      a.unit_singular_values = has_unit_singular_values<double>(a.E);
      it = cache_.emplace(key, std::move(a)).first;
    }
    return it->second;
  }

 private:
  std::map<std::array<Index, 6>, Addend> cache_;
};

inline CorrectedKappa corrected_kappa(const Mat<double>& W, const Addend& A, double lambda,
                                      double s) {
  const Mat<double>& E = A.E;
  const Mat<double> Wc = W + lambda * E;
  // W + λ E is usually well conditioned (λ = 10 against σ_1(W) of order 1): its Gram
  // eigenvalues then give κ at half the cost of an SVD and to ε κ^2 <= 1e-12; otherwise an SVD.
  const ConditionResult<double> c = kappa_via_gram_or_svd(Wc);
  CorrectedKappa r;
  r.sigma_max = c.sigma_max;
  r.sigma_min = c.sigma_min;
  r.kappa = c.kappa;
  r.weyl_applies = lambda > s && A.unit_singular_values;
  if (r.weyl_applies) r.weyl_bound = (lambda + s) / (lambda - s);
  return r;
}

}  // namespace detail_an

/// The statistics of W (D x width) or of one head's block of it. `E_fused` and `E_per_head`
/// are the matching blocks of the two placements of MATH.md §7; `same_placements` skips the
/// second SVD when they are equal (one head, or head 0).
inline MatrixStats matrix_stats_unscaled(const std::string& role, const std::string& tensor,
                                         io::Dtype dtype, const Mat<double>& W,
                                         const detail_an::Addend& E_fused,
                                         const detail_an::Addend& E_per_head, bool same_placements,
                                         double lambda, const std::optional<double>& target) {
  MatrixStats m;
  m.role = role;
  m.tensor = tensor;
  m.dtype = dtype;
  const ThinSvd<double> svd = thin_svd(W);
  const std::string method = std::min(W.rows(), W.cols()) <= auto_jacobi_max_size ? "jacobi_svd"
                             : have_lapacke() && W.allFinite()                    ? "lapack_dgesdd"
                                                                                  : "bdc_svd";
  m.cond = condition_from_singular_values<double>(svd.S, W.rows(), W.cols(), {}, method);
  const ExactCorrection<double> ex = exact_correction_from_svd<double>(W, svd, target);
  m.exact_kappa = ex.kappa_after;
  m.exact_predicted = ex.kappa_predicted;
  m.exact_alpha = ex.alpha;
  m.fused = detail_an::corrected_kappa(W, E_fused, lambda, m.cond.sigma_max);
  m.per_head = same_placements
                   ? m.fused
                   : detail_an::corrected_kappa(W, E_per_head, lambda, m.cond.sigma_max);
  return m;
}

/// The statistics of W (see matrix_stats_unscaled), computed on W / s and λ / s with s the power
/// of two at the top of max |W_ij|: every κ (of W, of W + λ E, of W + C) and the Weyl bound are
/// unchanged by that scaling (MATH.md §4, §6, §7) and the scaling is exact, so weights near the
/// overflow or underflow threshold of double give the same κ as moderate ones; the singular
/// values and α are scaled back.
inline MatrixStats matrix_stats(const std::string& role, const std::string& tensor, io::Dtype dtype,
                                const Mat<double>& W, const detail_an::Addend& E_fused,
                                const detail_an::Addend& E_per_head, bool same_placements,
                                double lambda, const std::optional<double>& target) {
  int e = 1;
  const double wmax = W.size() > 0 ? W.cwiseAbs().maxCoeff() : 0.0;
  if (wmax > 0) (void)std::frexp(wmax, &e);
  if (e == 1)
    return matrix_stats_unscaled(role, tensor, dtype, W, E_fused, E_per_head, same_placements,
                                 lambda, target);
  const double down = std::ldexp(1.0, 1 - e), s = std::ldexp(1.0, e - 1);
  MatrixStats m = matrix_stats_unscaled(role, tensor, dtype, Mat<double>(W * down), E_fused,
                                        E_per_head, same_placements, lambda * down, target);
  for (double* x : {&m.cond.sigma_max, &m.cond.sigma_min, &m.cond.sigma_min_plus, &m.cond.rank_tol,
                    &m.fused.sigma_max, &m.fused.sigma_min, &m.per_head.sigma_max,
                    &m.per_head.sigma_min, &m.exact_alpha})
    *x *= s;
  return m;
}

/// The weights one head sees after a correction (MATH.md §6–7): W_Q's head slice and W_K's, W_V's
/// group slices. Fused: the slice of W + λ I(D, width); per-head: the slice plus λ I(D, d);
/// exact: the slice of the whole projection's W + α U V^T.
struct HeadWeights {
  Mat<double> q, k, v;
};

namespace detail_an {

inline Mat<double> fused_slice(const Mat<double>& W, Index col, Index d, double lambda) {
  Mat<double> s = W.middleCols(col, d);
  for (Index j = 0; j < d; ++j)
    if (col + j < W.rows()) s(col + j, j) += lambda;
  return s;
}

inline Mat<double> per_head_slice(const Mat<double>& W, Index col, Index d, double lambda) {
  Mat<double> s = W.middleCols(col, d);
  for (Index j = 0; j < std::min<Index>(d, W.rows()); ++j) s(j, j) += lambda;
  return s;
}

inline bool same_weights(const HeadWeights& a, const HeadWeights& b) {
  return a.q == b.q && a.k == b.k && a.v == b.v;
}

}  // namespace detail_an

/// Progress callback: fraction of the whole analysis done, in [0, 1].
using ProgressFn = std::function<void(double)>;

/// The head counts of a checkpoint: config.json beside it (when there is one), with --heads and
/// --kv-heads (0: not given) taking precedence. --heads alone keeps config.json's key/value head
/// count, as --help says; `source` names where each number came from.
inline io::HeadConfig head_config(const CheckpointReader& src, std::int64_t heads,
                                  std::int64_t kv_heads) {
  io::HeadConfig hc;
  const std::string cfg = io::join_path(src.directory(), "config.json");
  if (io::is_regular_file(cfg)) {
    hc = io::read_head_config(cfg);
  } else if (const io::GgufFile* g = src.gguf()) {  // <arch>.attention.head_count, ...
    const std::string arch = g->get_string("general.architecture").value_or("");
    hc.heads = g->get_int(arch + ".attention.head_count").value_or(0);
    hc.kv_heads = g->get_int(arch + ".attention.head_count_kv").value_or(0);
    hc.hidden = g->get_int(arch + ".embedding_length").value_or(0);
    if (hc.heads > 0) hc.source = g->path() + " (GGUF metadata)";
  }
  if (heads > 0) {
    const bool kv_from_config = kv_heads == 0 && hc.kv_heads > 0;
    hc.heads = heads;
    hc.source = kv_from_config ? "--heads and the kv heads of " + hc.source : "--heads";
    if (!kv_from_config) hc.kv_heads = 0;
  }
  if (kv_heads > 0) hc.kv_heads = kv_heads;
  return hc;
}

/// The inputs X of the Jacobian analysis (--inputs; docs/checkpoints.md): one N x D .npy for
/// every layer, or one X per layer in an .npz or a folder of .npy files, keyed by the layer's
/// index ("3", "layer_3", "layer.3") or its prefix ("blocks.3.attn.", with or without the last
/// dot). Each X is checked finite and 2-D when it is read.
class LayerInputs {
 public:
  explicit LayerInputs(const std::string& path) : path_(path) {
    if (path.empty()) return;
    struct stat st {};
    const bool dir = ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
    if (dir || io::has_suffix(path, ".npz")) {
      per_layer_ = std::make_unique<io::CheckpointReader>(path);
      const auto f = per_layer_->format();
      if (f != CheckpointFormat::Npz && f != CheckpointFormat::NpyDir)
        throw BadInput(path +
                       ": --inputs: expected an .npy file, an .npz or a folder of .npy "
                       "files (one X per layer), found " +
                       to_string(f));
    } else {
      X_ = load_matrix(path, "X");
      check(X_, path);
    }
  }
  bool empty() const { return path_.empty(); }
  /// What the report says the inputs were.
  std::string describe() const { return per_layer_ ? path_ + " (one X per layer)" : path_; }
  /// X of layer L; `which` is set to where it came from, for messages.
  Mat<double> for_layer(const io::AttentionLayerSpec& L, std::string& which) const {
    if (!per_layer_) {
      which = path_;
      return X_;
    }
    const std::string i = std::to_string(L.index);
    std::vector<std::string> keys = {i, "layer_" + i, "layer." + i};
    if (!L.prefix.empty()) keys.push_back(L.prefix);
    if (L.prefix.size() > 1 && L.prefix.back() == '.')
      keys.push_back(L.prefix.substr(0, L.prefix.size() - 1));
    for (const std::string& k : keys)
      if (per_layer_->contains(k)) {
        which = path_ + " [" + k + "]";
        Mat<double> X = per_layer_->matrix(k);
        check(X, which);
        return X;
      }
    std::string looked;
    for (const std::string& k : keys) looked += (looked.empty() ? "" : ", ") + k;
    throw BadInput(path_ + ": --inputs: no X for layer " + i + " (looked for " + looked + ")");
  }

 private:
  static void check(const Mat<double>& X, const std::string& where) {
    if (X.rows() < 1 || X.cols() < 1)
      throw BadInput(where + ": X must be N x D with N, D >= 1 (got " +
                     shape_str(X.rows(), X.cols()) + ")");
  }
  std::string path_;
  Mat<double> X_;
  std::unique_ptr<io::CheckpointReader> per_layer_;
};

/// The RoPE of a checkpoint's self-attention layers (MATH.md §10; docs/checkpoints.md):
/// config.json beside it, else GGUF metadata, else the layout (absolute positions for BERT, ViT,
/// GPT-2, T5, Whisper and the like; undecided for Llama-, GPT-NeoX- and Falcon-named tensors and
/// --map), with --rope, --rope-theta and --rope-dims taking precedence. A refusal or an undecided
/// answer is returned as RopeConfig::refusal; the caller throws it only where κ(J) is computed.
inline io::RopeConfig rope_config(const CheckpointReader& src, io::Layout layout,
                                  const AnalysisOptions& o) {
  io::RopeConfig c;
  if (o.rope == "none") {
    if (o.rope_theta || o.rope_dims > 0)
      throw BadInput("--rope-theta and --rope-dims need RoPE, not --rope none");
    c.decided = true;
    c.source = "--rope none";
    return c;
  }
  const std::string cfg = io::join_path(src.directory(), "config.json");
  if (io::is_regular_file(cfg))
    c = io::read_rope_config(cfg);
  else if (const io::GgufFile* g = src.gguf())
    c = io::rope_config_from_gguf(*g);
  if (!c.decided) {
    using io::Layout;
    if (layout == Layout::Llama || layout == Layout::GptNeox || layout == Layout::Falcon ||
        layout == Layout::Map) {
      c.refusal = std::string("no config.json says whether the ") + io::to_string(layout) +
                  " layers rotate their queries and keys";
    } else {
      c.decided = true;
      c.source = std::string("the ") + io::to_string(layout) + " layout (no RoPE)";
    }
  }
  if (o.rope == "rotate_half" || o.rope == "interleaved") {
    const std::string from = c.present ? " (base and width from " + c.source + ")" : "";
    if (!c.present) c = io::RopeConfig{};
    c.decided = c.present = true;
    c.refusal.clear();
    c.pairing = parse_rope_pairing(o.rope);
    c.source = "--rope " + o.rope + from;
  }
  if (o.rope_theta || o.rope_dims > 0) {
    if (!c.present)
      throw BadInput(src.path() + ": --rope-theta and --rope-dims need RoPE, and " +
                     (c.decided ? c.source + " has none" : c.refusal) +
                     "; pass --rope rotate_half or --rope interleaved");
    if (o.rope_theta) {
      if (!(std::isfinite(*o.rope_theta) && *o.rope_theta > 1))
        throw BadInput("--rope-theta must be finite and > 1");
      c.theta = *o.rope_theta;
      c.source += ", --rope-theta";
    }
    if (o.rope_dims > 0) {
      c.dims = o.rope_dims;
      c.source += ", --rope-dims";
    }
  }
  return c;
}

/// The biases of a layer's W_Q, W_K, W_V (MATH.md §10): the tensor beside each weight
/// (io::bias_name_for) when the checkpoint holds it, sliced like the weight. An all-zero bias is
/// recorded and left out (the block is then the one without it).
inline void read_layer_biases(const CheckpointReader& src, const io::AttentionLayerSpec& L,
                              LayerModel& m) {
  std::map<std::string, Vec<double>> read;
  const io::ProjectionSlot* slots[3] = {&L.q, &L.k, &L.v};
  Vec<double>* out[3] = {&m.bq, &m.bk, &m.bv};
  for (int i = 0; i < 3; ++i) {
    const io::ProjectionSlot& s = *slots[i];
    const std::string name = io::bias_name_for(s.tensor);
    if (name.empty() || !src.contains(name)) continue;
    auto it = read.find(name);
    if (it == read.end()) it = read.emplace(name, src.vector(name)).first;
    const std::vector<std::int64_t> shape = src.shape(s.tensor);
    const std::int64_t len = shape.size() == 2 ? shape[s.transposed ? 0 : 1] : -1;
    const Vec<double> b =
        io::extract_bias(s, it->second, len, src.file_of(name) + ": tensor " + io::quote(name));
    m.bias_tensors[static_cast<std::size_t>(i)] = name;
    if (b.isZero(0)) {
      m.bias_zero[static_cast<std::size_t>(i)] = true;
      continue;
    }
    *out[i] = b;
  }
}

/// Analyses one checkpoint (see the top of this file). Throws BadInput / io::IoError naming the
/// file and tensor for anything unusable.
/// `item` numbers the κ(J) work items across checkpoints for --shard (see AnalysisOptions); it is
/// advanced past this checkpoint's.
inline CheckpointReport analyze_checkpoint(const std::string& path, const AnalysisOptions& o,
                                           const ProgressFn& progress = {},
                                           std::uint64_t* item = nullptr) {
  std::uint64_t local_item = 0;
  std::uint64_t& next_item = item ? *item : local_item;
  auto mine = [&](std::uint64_t k) { return k % o.shard_count == o.shard_index; };
  CheckpointReader src = io::open_checkpoint(path);
  CheckpointReport rep;
  rep.path = path;
  rep.kind = src.format();
  rep.lambda = o.lambda;
  rep.target = o.target;
  rep.causal = o.causal;
  if (o.scale) rep.scale = *o.scale;
  const io::LayerMap map = io::parse_layer_map(o.map);
  io::LayoutMatch match =
      io::detect_layers(src.layout_view(&map), io::parse_layout(o.layout), path, &map);
  rep.layout = match.layout;
  if (!o.scale && match.layout == io::Layout::T5) rep.scale = 1.0;

  const io::HeadConfig hc = head_config(src, o.heads, o.kv_heads);
  rep.head_config = hc;

  const IndexSelection sel = IndexSelection::parse(o.layers, "--layers");
  std::vector<std::int64_t> indices;
  for (const auto& L : match.layers) indices.push_back(L.index);  // sorted by detect_layers
  sel.require_within(indices, "attention layer", path);
  std::vector<io::AttentionLayerSpec*> todo;
  for (auto& L : match.layers)
    if (sel.contains(L.index)) todo.push_back(&L);

  // The inputs X of the Jacobian analysis: one for all layers, one per layer, or synthetic.
  const LayerInputs inputs(o.jacobian ? o.inputs : std::string());
  std::map<Index, Mat<double>> synthetic;  // by D
  if (o.jacobian && !inputs.empty()) {
    rep.inputs = inputs.describe();
  } else if (o.jacobian) {
    if (o.tokens < 1)
      throw BadInput("--tokens must be >= 1 (got " + std::to_string(o.tokens) + ")");
    rep.inputs = "synthetic (seed " + std::to_string(o.seed) + ")";
  }

  // RoPE of the self-attention layers, decided before any tensor is read.
  const io::RopeConfig rope = o.jacobian ? rope_config(src, match.layout, o) : io::RopeConfig{};

  // Heads of every selected layer, checked before any tensor is read.
  std::vector<io::LayerHeads> lh;
  for (auto* L : todo) {
    lh.push_back(io::resolve_heads(*L, hc, path));
    if (o.jacobian && !L->cross && !rope.refusal.empty())
      throw BadInput(path + ": layer " + std::to_string(L->index) +
                     ": its positions cannot be modelled for --jacobian: " + rope.refusal +
                     ". Pass --rope none to analyse the block without RoPE, or --rope "
                     "rotate_half|interleaved [--rope-theta T] [--rope-dims R] to model plain "
                     "RoPE");
    if (o.jacobian && !L->cross) {
      std::vector<std::int64_t> heads(static_cast<std::size_t>(lh.back().heads));
      for (std::size_t h = 0; h < heads.size(); ++h) heads[h] = static_cast<std::int64_t>(h);
      o.jacobian_heads.require_within(heads, "head", path + ": layer " + std::to_string(L->index));
    }
  }

  double units = 0, done = 0;
  for (std::size_t i = 0, k = next_item; i < todo.size(); ++i) {
    units += 1;
    if (o.jacobian && !todo[i]->cross)
      for (std::int64_t h = 0; h < lh[i].heads; ++h)
        if (o.jacobian_heads.contains(h) && mine(k++)) units += o.jacobian_corrections ? 4.0 : 1.0;
  }
  std::mutex tick_mutex;  // heads run on several threads with --jobs
  auto tick = [&](double n) {
    std::lock_guard<std::mutex> lock(tick_mutex);
    done += n;
    if (progress) progress(units > 0 ? done / units : 1.0);
  };

  detail_an::AddendCache addends;
  for (std::size_t li = 0; li < todo.size(); ++li) {
    const io::AttentionLayerSpec& L = *todo[li];
    const io::LayerHeads& H = lh[li];
    LayerStats ls;
    ls.spec = L;
    ls.heads = H;
    ls.shared_by = io::shared_by(L, hc);
    if (L.unscaled)
      ls.note =
          "logits are not divided by sqrt(d_k) in this model (T5); its relative position bias "
          "(an additive logit term) is not modelled";
    // Read this layer's tensors once each (q, k, v may share one fused tensor).
    std::map<std::string, Mat<double>> tensors;
    auto proj = [&](const io::ProjectionSlot& s) {
      auto it = tensors.find(s.tensor);
      if (it == tensors.end()) {
        if (o.verbose)
          std::cerr << "spectral-cond: reading " << s.tensor << " from " << src.file_of(s.tensor)
                    << '\n';
        it = tensors.emplace(s.tensor, src.matrix(s.tensor)).first;
      }
      return io::extract_projection(s, it->second);
    };
    const Mat<double> WQ = proj(L.q), WK = proj(L.k), WV = proj(L.v);
    tensors.clear();
    const Index D = L.D;
    // The three projections' statistics on --jobs threads: the addends are taken from the cache
    // (not thread-safe) first, then each task writes only its own MatrixStats.
    std::vector<std::function<void()>> stats;
    auto whole = [&](const char* role, const io::ProjectionSlot& s, const Mat<double>& W, Index nh,
                     Index d, MatrixStats& out) {
      const detail_an::Addend& Ef = addends.get({D, W.cols(), 0, 0, 0, 0},
                                                [&] { return Mat<double>::Identity(D, W.cols()); });
      const detail_an::Addend& Ep = addends.get({D, W.cols(), nh, d, 0, 1}, [&] {
        return lambda_identity<double>(D, nh, d, Placement::PerHead);
      });
      const io::Dtype dt = src.dtype(s.tensor);
      const detail_an::Addend *ef = &Ef, *ep = &Ep;
      const std::string* tensor = &s.tensor;
      const Mat<double>* w = &W;
      MatrixStats* res = &out;
      stats.push_back([&o, role, dt, nh, ef, ep, tensor, w, res] {
        *res = matrix_stats(role, *tensor, dt, *w, *ef, *ep, nh == 1, o.lambda, o.target);
      });
    };
    whole("W_Q", L.q, WQ, H.heads, H.d_k, ls.q);
    whole("W_K", L.k, WK, H.kv_heads, H.d_k, ls.k);
    whole("W_V", L.v, WV, H.kv_heads, H.d_v, ls.v);
    parallel_for(stats.size(), resolved_jobs(o.jobs, stats.size()),
                 [&](std::size_t i) { stats[i](); });

    if (o.per_head) {
      auto head_block = [&](const std::string& role, const io::ProjectionSlot& s,
                            const Mat<double>& W, Index j, Index d) {
        const auto& Ef = addends.get({D, W.cols(), 0, d, j * d, 2}, [&] {
          return Mat<double>(Mat<double>::Identity(D, W.cols()).middleCols(j * d, d));
        });
        const auto& Ep =
            addends.get({D, d, 0, 0, 0, 0}, [&] { return Mat<double>::Identity(D, d); });
        return matrix_stats(role, s.tensor, src.dtype(s.tensor), W.middleCols(j * d, d), Ef, Ep,
                            j == 0, o.lambda, o.target);
      };
      std::vector<MatrixStats> ks, vs;
      for (Index g = 0; g < H.kv_heads; ++g) {
        ks.push_back(head_block("W_K", L.k, WK, g, H.d_k));
        vs.push_back(head_block("W_V", L.v, WV, g, H.d_v));
      }
      const Index group = H.heads / H.kv_heads;
      for (Index h = 0; h < H.heads; ++h) {
        HeadStats hs;
        hs.head = h;
        hs.kv_head = h / group;
        hs.q = head_block("W_Q", L.q, WQ, h, H.d_k);
        hs.k = ks[static_cast<std::size_t>(hs.kv_head)];
        hs.v = vs[static_cast<std::size_t>(hs.kv_head)];
        ls.per_head.push_back(std::move(hs));
      }
    }
    tick(1);

    if (o.jacobian && L.cross) {
      ls.note =
          "cross-attention: kappa(J) not computed (its queries and its keys and values "
          "come from different inputs; the Jacobian of MATH.md section 3 has one X)" +
          (ls.note.empty() ? std::string() : "; " + ls.note);
    } else if (o.jacobian) {
      ls.jacobian_analyzed = true;
      std::string x_from = "synthetic tokens";
      Mat<double> X;
      if (inputs.empty()) {
        auto it = synthetic.find(D);
        if (it == synthetic.end())
          it = synthetic.emplace(D, synthetic_tokens(o.tokens, D, o.seed)).first;
        X = it->second;
      } else {
        X = inputs.for_layer(L, x_from);
      }
      if (X.cols() != D)
        throw BadInput(x_from + ": X must be N x D with D = " + std::to_string(D) + " (layer " +
                       std::to_string(L.index) + ", tensor " + L.q.tensor + "), got " +
                       shape_str(X.rows(), X.cols()));
      ls.tokens = X.rows();
      rep.tokens = std::max(rep.tokens, X.rows());
      // Biases and RoPE as the model computes attention (MATH.md §10).
      if (o.biases) read_layer_biases(src, L, ls.model);
      ls.model.rope_source = rope.source;
      if (rope.present) ls.model.rope = rope.for_head(H.d_k);
      if (ls.model.extended() && o.device == "cuda")
        throw BadInput(path + ": layer " + std::to_string(L.index) +
                       ": --device cuda does not model biases or RoPE; use --device cpu, or "
                       "--no-biases --rope none for the block without them");
      AttentionOptions<double> ao;
      ao.scale = o.scale;
      if (!o.scale && L.unscaled) ao.scale = 1.0;
      ao.mask = o.causal ? MaskKind::Causal : MaskKind::None;
      BoundOptions bo;
      bo.blocks = o.blocks;
      bo.jacobian.method = o.method;
      bo.jacobian.tol = o.tol;
      const Index group = H.heads / H.kv_heads;
      // This shard's heads of the layer (all of them without --shard).
      std::vector<Index> heads;
      for (Index h = 0; h < H.heads; ++h)
        if (o.jacobian_heads.contains(h) && mine(next_item++)) heads.push_back(h);
      // The exact correction of each whole projection (MATH.md §6), sliced per head below.
      HeadWeights exact_whole;
      if (o.jacobian_corrections && !heads.empty()) {
        exact_whole.q = exact_correction(WQ, o.target).W_corrected;
        exact_whole.k = exact_correction(WK, o.target).W_corrected;
        exact_whole.v = exact_correction(WV, o.target).W_corrected;
      }
      // Every selected head with its corrected variants: [original, fused, per-head, exact].
      const char* names[] = {"lambda_fused", "lambda_per_head", "exact"};
      std::vector<std::vector<HeadWeights>> variants;
      for (const Index h : heads) {
        const Index g = h / group;
        const Index cq = h * H.d_k, ck = g * H.d_k, cv = g * H.d_v;
        std::vector<HeadWeights> w;
        w.push_back({WQ.middleCols(cq, H.d_k), WK.middleCols(ck, H.d_k), WV.middleCols(cv, H.d_v)});
        if (o.jacobian_corrections) {
          using detail_an::fused_slice;
          using detail_an::per_head_slice;
          w.push_back({fused_slice(WQ, cq, H.d_k, o.lambda), fused_slice(WK, ck, H.d_k, o.lambda),
                       fused_slice(WV, cv, H.d_v, o.lambda)});
          w.push_back({per_head_slice(WQ, cq, H.d_k, o.lambda),
                       per_head_slice(WK, ck, H.d_k, o.lambda),
                       per_head_slice(WV, cv, H.d_v, o.lambda)});
          w.push_back({exact_whole.q.middleCols(cq, H.d_k), exact_whole.k.middleCols(ck, H.d_k),
                       exact_whole.v.middleCols(cv, H.d_v)});
        }
        variants.push_back(std::move(w));
      }
      // --device cuda: κ(J) of every head and variant in one batch on the GPU; the other terms of
      // Theorem 3.4 on the CPU.
      std::vector<ConditionResult<double>> device_J;
      if (o.device == "cuda" && !heads.empty()) {
        std::vector<Mat<double>> qs, kvs_k, kvs_v;
        for (const auto& w : variants)
          for (const HeadWeights& hw : w) {
            qs.push_back(hw.q);
            kvs_k.push_back(hw.k);
            kvs_v.push_back(hw.v);
          }
        AttentionOptions<double> dao = ao;
        dao.scale = ao.resolved_scale(H.d_k);
        device_J = device_kappa_jacobian(X, qs, kvs_k, kvs_v, dao, bo.jacobian);
      }
      // Heads on --jobs threads: each writes only its own JacobianStats and reads shared inputs.
      const unsigned threads = o.device == "cuda" ? 1u : resolved_jobs(o.jobs, heads.size());
      if (threads > 1) {
        const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
        bo.jacobian.qr.threads = std::max(1u, hw / threads);
      }
      // Named once, before the threads start (a sharded checkpoint finds a tensor's file lazily).
      const std::string where = src.file_of(L.q.tensor) + ": layer " + std::to_string(L.index);
      // `slot`: the head's and variant's place in the device batch.
      auto run = [&](const HeadWeights& w, Index h, std::size_t slot, double& seconds) {
        const auto t0 = std::chrono::steady_clock::now();
        BoundOptions hbo = bo;
        if (!device_J.empty()) hbo.jacobian_result = &device_J[slot];
        AttentionOptions<double> hao = ao;
        const LayerModel& lm = ls.model;
        const Index g = h / group;
        if (lm.bq.size() > 0) hao.bias_q = lm.bq.segment(h * H.d_k, H.d_k);
        if (lm.bk.size() > 0) hao.bias_k = lm.bk.segment(g * H.d_k, H.d_k);
        if (lm.bv.size() > 0) hao.bias_v = lm.bv.segment(g * H.d_v, H.d_v);
        hao.rope = lm.rope;
        require_finite_attention(
            X, w.q, w.k, w.v, hao,
            where + " head " + std::to_string(h) + " (tensor " + io::quote(L.q.tensor) + ")");
        Theorem34Report r = theorem34<double>(X, w.q, w.k, w.v, hao, hbo);
        if (r.J.info == Info::InvalidInput)
          throw NumericalFailure(path + ": layer " + std::to_string(L.index) + " head " +
                                 std::to_string(h) + ": kappa(J) could not be computed (" +
                                 r.J.note + ")");
        seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        return r;
      };
      ls.jacobian.resize(heads.size());
      parallel_for(heads.size(), threads, [&](std::size_t i) {
        const Index h = heads[i];
        JacobianStats& js = ls.jacobian[i];
        js.head = h;
        js.kv_head = h / group;
        const std::vector<HeadWeights>& w = variants[i];
        js.report = run(w[0], h, i * w.size(), js.seconds);
        tick(1);
        for (std::size_t v = 1; v < w.size(); ++v) {
          CorrectedJacobian cj;
          cj.correction = names[v - 1];
          // Equal weights give the same report: the original's, or the fused one's for the
          // per-head placement (one head, or head 0).
          std::size_t same = v;
          for (std::size_t u = 0; u < v && same == v; ++u)
            if (detail_an::same_weights(w[u], w[v])) same = u;
          if (same == 0) {
            cj.unchanged = true;
            cj.report = js.report;
          } else if (same < v) {
            cj.report = js.corrected[same - 1].report;
          } else {
            cj.report = run(w[v], h, i * w.size() + v, cj.seconds);
          }
          js.corrected.push_back(std::move(cj));
          tick(1);
        }
      });
    }
    rep.layers.push_back(std::move(ls));
  }
  return rep;
}

}  // namespace spectral_cond::cli
