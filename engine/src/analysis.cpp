// spectral-cond: analyze_checkpoint (analysis.hpp), as the steps of CheckpointAnalysis::run.
#include <spectral_cond/engine/advice.hpp>
#include <spectral_cond/engine/analysis.hpp>

#include <spectral_cond/engine/analysis_inputs.hpp>
#include <spectral_cond/engine/device.hpp>
#include <spectral_cond/engine/inputs.hpp>
#include <spectral_cond/engine/matrix_stats.hpp>
#include <spectral_cond/engine/parallel.hpp>
#include <spectral_cond/engine/synthetic.hpp>

#include <spectral_cond/conditioning/bound.hpp>
#include <spectral_cond/conditioning/corrections.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <iostream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace spectral_cond::engine {
namespace {

/// W_Q, W_K, W_V of one layer, or the weights one head sees after a correction (MATH.md §6–7):
/// W_Q's head slice and W_K's, W_V's group slices. Fused: the slice of W + λ I(D, width);
/// per-head: the slice plus λ I(D, d); exact: the slice of the whole projection's W + α U V^T.
struct Weights {
  Mat<double> q, k, v;
  bool operator==(const Weights& b) const { return q == b.q && k == b.k && v == b.v; }
};

/// The names of the corrected variants of a head, in the order of CheckpointAnalysis::variants:
/// the three corrections, then each --placements entry.
std::vector<std::string> correction_names(const AnalysisOptions& o) {
  std::vector<std::string> names{"lambda_fused", "lambda_per_head", "exact"};
  for (const CorrectionPlacement& p : o.placements) names.push_back("lambda_" + p.name());
  return names;
}

/// What the κ(J) of every head of one layer shares: X, the options, and the device's results.
struct LayerJacobianJob {
  const io::AttentionLayerSpec* L = nullptr;
  const io::LayerHeads* H = nullptr;
  const LayerModel* model = nullptr;
  Mat<double> X;
  AttentionOptions<double> ao;
  BoundOptions bo;
  std::vector<ConditionResult<double>> device_J;  ///< --device cuda: by slot, else empty
  std::string where;                              ///< "<file>: layer L", for messages
};

class CheckpointAnalysis {
 public:
  CheckpointAnalysis(const std::string& path, const AnalysisOptions& o, const ProgressFn& progress,
                     std::uint64_t& next_item)
      : path_(path),
        o_(o),
        progress_(progress),
        next_item_(next_item),
        src_(io::open_checkpoint(path)) {}

  CheckpointReport run() {
    src_.open_all_shards();  // a bad shard is an error at once, even one without attention
    detect_layers();
    open_inputs();
    check_heads();
    count_work();
    for (std::size_t i = 0; i < todo_.size(); ++i) rep_.layers.push_back(layer(i));
    return std::move(rep_);
  }

 private:
  bool mine(std::uint64_t item) const { return item % o_.shard_count == o_.shard_index; }

  /// The report's header, the attention layers of the checkpoint and the selected ones.
  void detect_layers() {
    rep_.path = path_;
    rep_.kind = src_.format();
    rep_.lambda = o_.lambda;
    rep_.target = o_.target;
    rep_.mask = o_.mask;
    if (o_.scale) rep_.scale = *o_.scale;
    const io::LayerMap map = io::parse_layer_map(o_.map);
    match_ = io::detect_layers(src_.layout_view(&map), io::parse_layout(o_.layout), path_, &map);
    rep_.layout = match_.layout;
    if (!o_.scale && match_.layout == io::Layout::T5) rep_.scale = 1.0;
    rep_.head_config = head_config(src_, o_.heads, o_.kv_heads);

    const IndexSelection sel = IndexSelection::parse(o_.layers, "--layers");
    std::vector<std::int64_t> indices;
    for (const auto& L : match_.layers) indices.push_back(L.index);  // sorted by detect_layers
    sel.require_within(indices, "attention layer", path_);
    for (auto& L : match_.layers)
      if (sel.contains(L.index)) todo_.push_back(&L);
  }

  /// The inputs X of the Jacobian analysis: one for all layers, one per layer, or synthetic; and
  /// RoPE of the self-attention layers.
  void open_inputs() {
    if (!o_.jacobian) return;
    inputs_ = std::make_unique<LayerInputs>(o_.inputs);
    if (!inputs_->empty()) {
      rep_.inputs = inputs_->describe();
    } else {
      if (o_.tokens < 1)
        throw BadInput("--tokens must be >= 1 (got " + std::to_string(o_.tokens) + ")");
      // One head's attention holds a few N x N matrices (logits, P and their products): refused
      // here, naming the flag, rather than by the allocator halfway through the run.
      const double n = static_cast<double>(o_.tokens);
      const double need = 4 * 8 * n * n;
      const double budget = memory_budget_bytes();
      if (need > budget) {
        std::ostringstream e;
        e << "--tokens " << o_.tokens << ": one head's attention (" << o_.tokens << " x "
          << o_.tokens << ", four such matrices) needs about " << need / 1e9
          << " GB, more than the memory budget of " << budget / 1e9
          << " GB (a quarter of physical memory, or SPECTRAL_COND_MEMORY_BUDGET); use --tokens "
          << static_cast<long long>(std::sqrt(budget / 32)) << " or fewer";
        throw BadInput(e.str());
      }
      rep_.inputs = "synthetic (seed " + std::to_string(o_.seed) + ")";
    }
    rope_ = rope_config(src_, match_.layout, o_);
  }

  /// The heads of every selected layer, and the refusals of --jacobian, before any tensor is read.
  void check_heads() {
    for (io::AttentionLayerSpec* L : todo_) {
      heads_.push_back(io::resolve_heads(*L, rep_.head_config, path_));
      if (!o_.jacobian || L->cross) continue;
      if (!rope_.refusal.empty())
        throw BadInput(path_ + ": layer " + std::to_string(L->index) +
                       ": its positions cannot be modelled for --jacobian: " + rope_.refusal +
                       ". Pass --rope none to analyse the block without RoPE, or --rope "
                       "rotate_half|interleaved [--rope-theta T] [--rope-dims R] to model plain "
                       "RoPE");
      std::vector<std::int64_t> heads(static_cast<std::size_t>(heads_.back().heads));
      for (std::size_t h = 0; h < heads.size(); ++h) heads[h] = static_cast<std::int64_t>(h);
      o_.jacobian_heads.require_within(heads, "head",
                                       path_ + ": layer " + std::to_string(L->index));
    }
  }

  /// The units of work the progress is counted in: one per layer's weights, one per κ(J).
  void count_work() {
    std::uint64_t k = next_item_;
    for (std::size_t i = 0; i < todo_.size(); ++i) {
      units_ += 1;
      if (o_.advice && !todo_[i]->cross)
        units_ += static_cast<double>(advised_heads(*todo_[i], heads_[i]).size());
      else if (o_.jacobian && !todo_[i]->cross)
        for (std::int64_t h = 0; h < heads_[i].heads; ++h)
          if (o_.jacobian_heads.contains(h) && mine(k++))
            units_ +=
                o_.jacobian_corrections ? 4.0 + static_cast<double>(o_.placements.size()) : 1.0;
    }
  }

  void tick(double n) {
    std::lock_guard<std::mutex> lock(tick_mutex_);  // heads run on several threads with --jobs
    done_ += n;
    if (progress_) progress_(units_ > 0 ? done_ / units_ : 1.0);
  }

  /// Layer number i of the selection: its weights' statistics, then κ(J) of its heads.
  LayerStats layer(std::size_t i) {
    const io::AttentionLayerSpec& L = *todo_[i];
    LayerStats ls;
    ls.spec = L;
    ls.heads = heads_[i];
    ls.shared_by = io::shared_by(L, rep_.head_config);
    if (L.unscaled)
      ls.note =
          "logits are not divided by sqrt(d_k) in this model (T5); its relative position bias "
          "(an additive logit term) is not modelled";
    const Weights W = read_weights(L);
    whole_stats(L, ls.heads, W, ls);
    if (o_.per_head) ls.per_head = head_stats(L, ls.heads, W);
    tick(1);
    if (o_.jacobian && L.cross) {
      ls.note =
          "cross-attention: kappa(J) not computed (its queries and its keys and values "
          "come from different inputs; the Jacobian of MATH.md section 3 has one X)" +
          (ls.note.empty() ? std::string() : "; " + ls.note);
    } else if (o_.advice) {
      advise_layer(L, W, ls);
    } else if (o_.jacobian) {
      jacobians(L, W, ls);
    }
    return ls;
  }

  /// W_Q, W_K, W_V of layer L, each tensor read once (q, k, v may share one fused tensor).
  Weights read_weights(const io::AttentionLayerSpec& L) const {
    std::map<std::string, Mat<double>> tensors;
    auto proj = [&](const io::ProjectionSlot& s) {
      auto it = tensors.find(s.tensor);
      if (it == tensors.end()) {
        if (o_.verbose)
          std::cerr << "spectral-cond: reading " << s.tensor << " from " << src_.file_of(s.tensor)
                    << '\n';
        it = tensors.emplace(s.tensor, src_.matrix(s.tensor)).first;
      }
      return io::extract_projection(s, it->second);
    };
    Weights W;
    W.q = proj(L.q);
    W.k = proj(L.k);
    W.v = proj(L.v);
    return W;
  }

  /// The statistics of the three whole projections, on --jobs threads: the addends are taken
  /// from the cache (not thread-safe) first, then each task writes only its own MatrixStats.
  void whole_stats(const io::AttentionLayerSpec& L, const io::LayerHeads& H, const Weights& W,
                   LayerStats& ls) {
    struct Task {
      const char* role;
      const std::string* tensor;
      io::Dtype dtype;
      const Mat<double>* matrix;
      const Addend *fused, *per_head;
      bool one_head;
      MatrixStats* out;
    };
    std::vector<Task> tasks;
    auto add = [&](const char* role, const io::ProjectionSlot& s, const Mat<double>& M, Index nh,
                   Index d, MatrixStats& out) {
      const Index D = L.D;
      const Addend& Ef = addends_.get({D, M.cols(), 0, 0, 0, 0},
                                      [&] { return Mat<double>::Identity(D, M.cols()); });
      const Addend& Ep = addends_.get({D, M.cols(), nh, d, 0, 1}, [&] {
        return lambda_identity<double>(D, nh, d, Placement::PerHead);
      });
      tasks.push_back({role, &s.tensor, src_.dtype(s.tensor), &M, &Ef, &Ep, nh == 1, &out});
    };
    add("W_Q", L.q, W.q, H.heads, H.d_k, ls.q);
    add("W_K", L.k, W.k, H.kv_heads, H.d_k, ls.k);
    add("W_V", L.v, W.v, H.kv_heads, H.d_v, ls.v);
    parallel_for(tasks.size(), resolved_jobs(o_.jobs, tasks.size()), [&](std::size_t i) {
      const Task& t = tasks[i];
      *t.out = matrix_stats(t.role, *t.tensor, t.dtype, *t.matrix, *t.fused, *t.per_head,
                            t.one_head, o_.lambda, o_.target);
    });
  }

  /// --per-head: the statistics of every head's D x d block (a key/value group's once).
  std::vector<HeadStats> head_stats(const io::AttentionLayerSpec& L, const io::LayerHeads& H,
                                    const Weights& W) {
    const Index D = L.D;
    auto block = [&](const std::string& role, const io::ProjectionSlot& s, const Mat<double>& M,
                     Index j, Index d) {
      const Addend& Ef = addends_.get({D, M.cols(), 0, d, j * d, 2}, [&] {
        return Mat<double>(Mat<double>::Identity(D, M.cols()).middleCols(j * d, d));
      });
      const Addend& Ep =
          addends_.get({D, d, 0, 0, 0, 0}, [&] { return Mat<double>::Identity(D, d); });
      return matrix_stats(role, s.tensor, src_.dtype(s.tensor), M.middleCols(j * d, d), Ef, Ep,
                          j == 0, o_.lambda, o_.target);
    };
    std::vector<MatrixStats> ks, vs;
    for (Index g = 0; g < H.kv_heads; ++g) {
      ks.push_back(block("W_K", L.k, W.k, g, H.d_k));
      vs.push_back(block("W_V", L.v, W.v, g, H.d_v));
    }
    const Index group = H.heads / H.kv_heads;
    std::vector<HeadStats> out;
    for (Index h = 0; h < H.heads; ++h) {
      HeadStats hs;
      hs.head = h;
      hs.kv_head = h / group;
      hs.q = block("W_Q", L.q, W.q, h, H.d_k);
      hs.k = ks[static_cast<std::size_t>(hs.kv_head)];
      hs.v = vs[static_cast<std::size_t>(hs.kv_head)];
      out.push_back(std::move(hs));
    }
    return out;
  }

  /// X of layer L (synthetic tokens made once per D), checked against the layer's D.
  Mat<double> layer_X(const io::AttentionLayerSpec& L) {
    std::string from = "synthetic tokens";
    Mat<double> X;
    if (inputs_->empty()) {
      auto it = synthetic_.find(L.D);
      if (it == synthetic_.end())
        it = synthetic_.emplace(L.D, synthetic_tokens(o_.tokens, L.D, o_.seed)).first;
      X = it->second;
    } else {
      X = inputs_->for_layer(L, from);
    }
    if (X.cols() != L.D)
      throw BadInput(from + ": X must be N x D with D = " + std::to_string(L.D) + " (layer " +
                     std::to_string(L.index) + ", tensor " + L.q.tensor + "), got " +
                     shape_str(X.rows(), X.cols()));
    return X;
  }

  /// Biases and RoPE of layer L as the model computes attention (MATH.md §10).
  LayerModel layer_model(const io::AttentionLayerSpec& L, const io::LayerHeads& H) const {
    LayerModel m;
    if (o_.biases) read_layer_biases(src_, L, m);
    m.rope_source = rope_.source;
    if (rope_.present) m.rope = rope_.for_head(H.d_k);
    if (m.extended() && o_.device == "cuda")
      throw BadInput(path_ + ": layer " + std::to_string(L.index) +
                     ": --device cuda does not model biases or RoPE; use --device cpu, or "
                     "--no-biases --rope none for the block without them");
    return m;
  }

  /// This shard's heads of a layer for κ(J) (all of them without --shard).
  std::vector<Index> shard_heads(const io::LayerHeads& H) {
    std::vector<Index> heads;
    for (Index h = 0; h < H.heads; ++h)
      if (o_.jacobian_heads.contains(h) && mine(next_item_++)) heads.push_back(h);
    return heads;
  }

  /// Every head of `heads` with its corrected variants: [original, fused, per-head, exact,
  /// then one per --placements entry].
  std::vector<std::vector<Weights>> variants(const io::AttentionLayerSpec& L, const Weights& W,
                                             const io::LayerHeads& H,
                                             const std::vector<Index>& heads) const {
    // The exact correction of each whole projection (MATH.md §6), sliced per head below.
    Weights exact;
    if (o_.jacobian_corrections && !heads.empty()) {
      exact.q = exact_correction(W.q, o_.target).W_corrected;
      exact.k = exact_correction(W.k, o_.target).W_corrected;
      exact.v = exact_correction(W.v, o_.target).W_corrected;
    }
    const Index group = H.heads / H.kv_heads;
    const double l = o_.lambda;
    std::vector<std::vector<Weights>> out;
    for (const Index h : heads) {
      const Index cq = h * H.d_k, ck = h / group * H.d_k, cv = h / group * H.d_v;
      std::vector<Weights> w;
      w.push_back(
          {W.q.middleCols(cq, H.d_k), W.k.middleCols(ck, H.d_k), W.v.middleCols(cv, H.d_v)});
      if (o_.jacobian_corrections) {
        HeadPosition pos{h, H.heads, H.kv_heads, {-1, -1, -1}};
        auto placed = [&](const CorrectionPlacement& p) {
          if (p.layout == Placement::Packed)
            pos.packed_columns =
                packed_columns(L, H, h, path_ + ": layer " + std::to_string(L.index));
          auto c = corrected_head_weights(w[0].q, w[0].k, w[0].v, p, pos, l);
          return Weights{std::move(c[0]), std::move(c[1]), std::move(c[2])};
        };
        w.push_back(placed({Placement::Fused}));
        w.push_back(placed({Placement::PerHead}));
        w.push_back({exact.q.middleCols(cq, H.d_k), exact.k.middleCols(ck, H.d_k),
                     exact.v.middleCols(cv, H.d_v)});
        for (const CorrectionPlacement& p : o_.placements) w.push_back(placed(p));
      }
      out.push_back(std::move(w));
    }
    return out;
  }

  /// X of layer L, its biases and RoPE (ls.model), its mask and logit scale: the attention of
  /// every head's κ(J), as the model computes it (MATH.md §10).
  AttentionOptions<double> layer_attention(const io::AttentionLayerSpec& L, LayerStats& ls,
                                           Mat<double>& X) {
    X = layer_X(L);
    ls.tokens = X.rows();
    rep_.tokens = std::max(rep_.tokens, X.rows());
    ls.model = layer_model(L, ls.heads);
    AttentionOptions<double> ao;
    ao.scale = o_.scale;
    if (!o_.scale && L.unscaled) ao.scale = 1.0;
    ls.causal = o_.mask == "causal" ||
                (o_.mask == "auto" && (L.causal || (rep_.head_config.causal_lm && !L.cross)));
    ao.mask = ls.causal ? MaskKind::Causal : MaskKind::None;
    return ao;
  }

  /// Head h's attention options: the layer's, with its slices of the biases and RoPE.
  static AttentionOptions<double> head_attention(const AttentionOptions<double>& layer,
                                                 const LayerModel& m, const io::LayerHeads& H,
                                                 Index h) {
    const Index g = h / (H.heads / H.kv_heads);
    AttentionOptions<double> ao = layer;
    if (m.bq.size() > 0) ao.bias_q = m.bq.segment(h * H.d_k, H.d_k);
    if (m.bk.size() > 0) ao.bias_k = m.bk.segment(g * H.d_k, H.d_k);
    if (m.bv.size() > 0) ao.bias_v = m.bv.segment(g * H.d_v, H.d_v);
    ao.rope = m.rope;
    return ao;
  }

  /// `advise`: the heads of layer L to advise (the --jacobian-heads selection, sampled).
  std::vector<Index> advised_heads(const io::AttentionLayerSpec& L, const io::LayerHeads& H) const {
    std::vector<Index> allowed;
    for (Index h = 0; h < H.heads; ++h)
      if (o_.jacobian_heads.contains(h)) allowed.push_back(h);
    return sample_heads(allowed, o_.advice_heads, o_.seed, L.index);
  }

  /// `advise`: the λ advisor on the sampled heads of layer L (MATH.md §17), on --jobs threads.
  void advise_layer(const io::AttentionLayerSpec& L, const Weights& W, LayerStats& ls) {
    const io::LayerHeads& H = ls.heads;
    ls.jacobian_analyzed = true;
    Mat<double> X;
    const AttentionOptions<double> ao = layer_attention(L, ls, X);
    const std::string where = src_.file_of(L.q.tensor) + ": layer " + std::to_string(L.index);
    check_placements(L, o_.advice->placements, where);
    const std::vector<Index> heads = advised_heads(L, H);
    std::vector<HeadPosition> pos;
    for (const Index h : heads) {
      pos.push_back({h, H.heads, H.kv_heads});
      if (packed_layer(L)) pos.back().packed_columns = packed_columns(L, H, h, where);
    }
    const unsigned threads = resolved_jobs(o_.jobs, heads.size());
    AdviceOptions opt = *o_.advice;
    if (threads > 1)
      opt.jacobian.qr.threads =
          std::max(1u, std::max(1u, std::thread::hardware_concurrency()) / threads);
    ls.advice.assign(heads.size(), HeadAdvice{});
    parallel_for(heads.size(), threads, [&](std::size_t i) {
      const Index h = heads[i], g = h / (H.heads / H.kv_heads);
      const Mat<double> q = W.q.middleCols(h * H.d_k, H.d_k), k = W.k.middleCols(g * H.d_k, H.d_k),
                        v = W.v.middleCols(g * H.d_v, H.d_v);
      const AttentionOptions<double> hao = head_attention(ao, ls.model, H, h);
      require_finite_attention(
          X, q, k, v, hao,
          where + " head " + std::to_string(h) + " (tensor " + io::quote(L.q.tensor) + ")");
      ls.advice[i] = advise_head(X, q, k, v, hao, pos[i], opt);
      tick(1);
    });
  }

  /// κ(J) and Theorem 3.4 of every selected head of layer L and of its corrected variants, on
  /// --jobs threads (or batched on the GPU with --device cuda).
  void jacobians(const io::AttentionLayerSpec& L, const Weights& W, LayerStats& ls) {
    const io::LayerHeads& H = ls.heads;
    ls.jacobian_analyzed = true;
    LayerJacobianJob job;
    job.L = &L;
    job.H = &H;
    job.ao = layer_attention(L, ls, job.X);
    job.model = &ls.model;
    job.bo.blocks = o_.blocks;
    job.bo.jacobian.method = o_.method;
    job.bo.jacobian.tol = o_.tol;
    const std::vector<Index> heads = shard_heads(H);
    if (o_.jacobian_corrections)
      check_placements(L, o_.placements, path_ + ": layer " + std::to_string(L.index));
    const std::vector<std::vector<Weights>> w = variants(L, W, H, heads);
    if (o_.device == "cuda" && !heads.empty()) job.device_J = device_jacobians(job, w);
    std::vector<std::vector<std::size_t>> first;
    const std::vector<std::pair<std::size_t, std::size_t>> tasks = distinct_variants(w, first);
    const unsigned threads = o_.device == "cuda" ? 1u : resolved_jobs(o_.jobs, tasks.size());
    if (threads > 1) {
      const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
      job.bo.jacobian.qr.threads = std::max(1u, hw / threads);
    }
    // Named once, before the threads start (a sharded checkpoint finds a tensor's file lazily).
    job.where = src_.file_of(L.q.tensor) + ": layer " + std::to_string(L.index);
    std::vector<std::vector<Theorem34Report>> reports(heads.size());
    std::vector<std::vector<double>> seconds(heads.size());
    for (std::size_t i = 0; i < heads.size(); ++i) {
      reports[i].resize(w[i].size());
      seconds[i].assign(w[i].size(), 0.0);
    }
    parallel_for(tasks.size(), threads, [&](std::size_t t) {
      const auto [i, v] = tasks[t];
      reports[i][v] = theorem34_of(job, w[i][v], heads[i], i * w[i].size() + v, seconds[i][v]);
      tick(1);
    });
    ls.jacobian.clear();
    for (std::size_t i = 0; i < heads.size(); ++i)
      ls.jacobian.push_back(head_jacobians(*job.H, heads[i], first[i], reports[i], seconds[i]));
  }

  /// The distinct (head, variant) pairs of w, one task each: a variant equal to an earlier one of
  /// its head reuses that report (the original's, or the fused one's for the per-head placement
  /// of one head). first[i][v] is the first variant of head i whose weights equal variant v's.
  static std::vector<std::pair<std::size_t, std::size_t>> distinct_variants(
      const std::vector<std::vector<Weights>>& w, std::vector<std::vector<std::size_t>>& first) {
    std::vector<std::pair<std::size_t, std::size_t>> tasks;
    first.assign(w.size(), {});
    for (std::size_t i = 0; i < w.size(); ++i)
      for (std::size_t v = 0; v < w[i].size(); ++v) {
        const auto b = w[i].begin();
        first[i].push_back(
            static_cast<std::size_t>(std::find(b, b + static_cast<long>(v), w[i][v]) - b));
        if (first[i][v] == v) tasks.emplace_back(i, v);
      }
    return tasks;
  }

  /// --device cuda: κ(J) of every head and variant in one batch on the GPU (the other terms of
  /// Theorem 3.4 stay on the CPU), in the order of the slots head_jacobians uses.
  static std::vector<ConditionResult<double>> device_jacobians(
      const LayerJacobianJob& job, const std::vector<std::vector<Weights>>& w) {
    std::vector<Mat<double>> qs, ks, vs;
    for (const auto& head : w)
      for (const Weights& hw : head) {
        qs.push_back(hw.q);
        ks.push_back(hw.k);
        vs.push_back(hw.v);
      }
    AttentionOptions<double> ao = job.ao;
    ao.scale = job.ao.resolved_scale(job.H->d_k);
    return device_kappa_jacobian(job.X, qs, ks, vs, ao, job.bo.jacobian);
  }

  /// Head h's statistics from the reports of its weights (variant 0) and of each corrected
  /// variant; first[v] is the first variant whose weights equal variant v's, whose report it
  /// takes (unchanged where that is the original's).
  JacobianStats head_jacobians(const io::LayerHeads& H, Index h,
                               const std::vector<std::size_t>& first,
                               const std::vector<Theorem34Report>& reports,
                               const std::vector<double>& seconds) {
    JacobianStats js;
    js.head = h;
    js.kv_head = h / (H.heads / H.kv_heads);
    js.report = reports[0];
    js.seconds = seconds[0];
    const std::vector<std::string> names = correction_names(o_);
    for (std::size_t v = 1; v < reports.size(); ++v) {
      CorrectedJacobian cj;
      cj.correction = names[v - 1];
      cj.unchanged = first[v] == 0;
      cj.report = reports[first[v]];
      cj.seconds = seconds[v];  // 0 for a variant that reuses a report
      if (first[v] != v) tick(1);
      js.corrected.push_back(std::move(cj));
    }
    return js;
  }

  /// Theorem 3.4 (with κ(J)) of head h on weights w, with the head's biases and RoPE; its time.
  Theorem34Report theorem34_of(const LayerJacobianJob& job, const Weights& w, Index h,
                               std::size_t slot, double& seconds) const {
    const auto t0 = std::chrono::steady_clock::now();
    const BoundOptions& bo = job.bo;
    const io::LayerHeads& H = *job.H;
    const AttentionOptions<double> ao = head_attention(job.ao, *job.model, H, h);
    require_finite_attention(
        job.X, w.q, w.k, w.v, ao,
        job.where + " head " + std::to_string(h) + " (tensor " + io::quote(job.L->q.tensor) + ")");
    // κ(J) is an input where the GPU computed it (--device cuda).
    Theorem34Report r = job.device_J.empty()
                            ? theorem34<double>(job.X, w.q, w.k, w.v, ao, bo)
                            : theorem34<double>(job.X, w.q, w.k, w.v, ao, bo, job.device_J[slot]);
    if (r.J.info == Info::InvalidInput)
      throw NumericalFailure(path_ + ": layer " + std::to_string(job.L->index) + " head " +
                             std::to_string(h) + ": kappa(J) could not be computed (" + r.J.note +
                             ")");
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
  }

  const std::string& path_;
  const AnalysisOptions& o_;
  const ProgressFn& progress_;
  std::uint64_t& next_item_;
  CheckpointReader src_;
  CheckpointReport rep_;
  io::LayoutMatch match_;
  std::vector<io::AttentionLayerSpec*> todo_;  ///< the selected layers, in match_
  std::vector<io::LayerHeads> heads_;          ///< of each of todo_
  std::unique_ptr<LayerInputs> inputs_;        ///< with --jacobian
  std::map<Index, Mat<double>> synthetic_;     ///< synthetic tokens, by D
  io::RopeConfig rope_;                        ///< with --jacobian
  AddendCache addends_;
  double units_ = 0, done_ = 0;
  std::mutex tick_mutex_;
};

}  // namespace

CheckpointReport analyze_checkpoint(const std::string& path, const AnalysisOptions& o,
                                    const ProgressFn& progress, std::uint64_t* item) {
  std::uint64_t local_item = 0;
  return CheckpointAnalysis(path, o, progress, item ? *item : local_item).run();
}

}  // namespace spectral_cond::engine
