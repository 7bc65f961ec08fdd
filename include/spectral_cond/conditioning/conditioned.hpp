// spectral_cond: spectrally conditioned attention (the paper's §3; MATH.md §6–7).
//
//   A = attention(X, W_Q + C_Q, W_K + C_K, W_V + C_V),   C fixed (not trained)
//
// so dA/dW = dA/d(W + C): the JVP and VJP are those of the attention core evaluated at W + C.
// The layer holds the corrections, not the weights (the optimiser owns those): every call takes
// the current W and forms W + C in buffers that are reused, so repeated calls with the same
// shapes allocate nothing beyond what the attention core does.
#pragma once

#include "spectral_cond/conditioning/corrections.hpp"
#include "spectral_cond/core/multihead.hpp"

namespace spectral_cond {

/// How one projection is corrected.
enum class CorrectionKind {
  None,    ///< C = 0
  Lambda,  ///< C = λ E, E the rectangular identity placed per Placement (MATH.md §7)
  Exact,   ///< C = α U V^T per head block, recomputed by refresh() (MATH.md §6)
};

inline const char* to_string(CorrectionKind k) {
  switch (k) {
    case CorrectionKind::None:
      return "none";
    case CorrectionKind::Lambda:
      return "lambda";
    case CorrectionKind::Exact:
      return "exact";
  }
  return "unknown";
}

/// The correction of one projection: a kind and its parameters.
template <typename Scalar>
struct Correction {
  CorrectionKind kind = CorrectionKind::None;
  /// λ for Lambda; the paper uses 10. Must be finite and >= 0.
  Scalar lambda = Scalar(10);
  /// Where λ I goes in a multi-head projection (Lambda only; irrelevant with one head).
  Placement placement = Placement::Fused;
  /// Target kappa t > 1 for Exact; unset means C = σ_1 U V^T (kappa <= 2).
  std::optional<Scalar> target;

  static Correction none() { return {}; }
  static Correction with_lambda(Scalar l, Placement p = Placement::Fused) {
    Correction c;
    c.kind = CorrectionKind::Lambda;
    c.lambda = l;
    c.placement = p;
    return c;
  }
  static Correction with_exact(std::optional<Scalar> t = {}) {
    Correction c;
    c.kind = CorrectionKind::Exact;
    c.target = t;
    return c;
  }

  void check(const char* fn) const {
    if (kind == CorrectionKind::Lambda && !(std::isfinite(lambda) && lambda >= Scalar(0))) {
      std::ostringstream s;
      s << "lambda must be finite and >= 0 (got " << lambda << ")";
      detail::fail(fn, s.str());
    }
    if (kind == CorrectionKind::Exact) detail::check_target<Scalar>(fn, target);
  }
};

/// One correction for each of W_Q, W_K, W_V.
template <typename Scalar>
struct ConditioningSpec {
  Correction<Scalar> q, k, v;

  /// The same correction for all three projections (the paper's setting).
  static ConditioningSpec shared(const Correction<Scalar>& c) { return {c, c, c}; }
  /// λ I under a named placement (MATH.md §7): the projections of its subset get
  /// Correction::with_lambda(λ, its layout), the others none.
  static ConditioningSpec placed(Scalar lambda, const CorrectionPlacement& p) {
    ConditioningSpec s;
    const Correction<Scalar> c = Correction<Scalar>::with_lambda(lambda, p.layout);
    if (p.q) s.q = c;
    if (p.k) s.k = c;
    if (p.v) s.v = c;
    return s;
  }
  void check(const char* fn) const {
    q.check(fn);
    k.check(fn);
    v.check(fn);
  }
};

/// W + C for the three projections: the weights to use at inference.
template <typename Scalar>
struct FoldedWeights {
  Mat<Scalar> WQ, WK, WV;
};

/// Attention with fixed spectral corrections added to its projections (paper §3, MATH.md §6–7).
///
/// Single-head is `heads = 1` (the default of MultiHeadOptions); multi-head and grouped-query
/// layers use the fused weights of multihead.hpp. Lambda corrections depend only on shapes and
/// are built once. Exact corrections are computed **per head block** (each head's D x d_k or
/// D x d_v slice of the fused projection gets its own α U V^T, so every head's projection has
/// kappa <= 2, or t), since each head's Jacobian sees only its own block (MATH.md §8); they are
/// built by the constructor and rebuilt only by refresh(). Between refreshes C is a constant:
/// the gradient is dL/d(W + C), the paper's stop-gradient convention.
template <typename Scalar>
class ConditionedAttention {
 public:
  /// Fixes the shapes from the weights, checks the spec and computes every correction.
  ConditionedAttention(const CRef<Scalar>& WQ, const CRef<Scalar>& WK, const CRef<Scalar>& WV,
                       const ConditioningSpec<Scalar>& spec,
                       const MultiHeadOptions<Scalar>& opts = {})
      : spec_(spec), opts_(opts) {
    constexpr const char* fn = "ConditionedAttention";
    spec_.check(fn);
    set_shape(fn, WQ, WK, WV);
    // Packed: the projections' first columns in [W_Q | W_K | W_V].
    const Index ok = heads_ * d_k_, ov = ok + kv_heads_ * d_k_;
    info_ = build(spec_.q, CQ_, WQ, heads_, d_k_, /*lambda_too=*/true, 0);
    info_ = worst(info_, build(spec_.k, CK_, WK, kv_heads_, d_k_, true, ok));
    info_ = worst(info_, build(spec_.v, CV_, WV, kv_heads_, d_v_, true, ov));
  }

  /// Recomputes the Exact corrections from the current weights (an SVD per head block);
  /// Lambda and None corrections are fixed and left alone. Returns the worst outcome over the
  /// blocks: Success, or InvalidInput when a block holds NaN/Inf (its correction is then NaN, so
  /// the next forward pass shows it rather than hiding it).
  Info refresh(const CRef<Scalar>& WQ, const CRef<Scalar>& WK, const CRef<Scalar>& WV) {
    check_weights("ConditionedAttention::refresh", WQ, WK, WV);
    Info info = Info::Success;
    info = worst(info, build(spec_.q, CQ_, WQ, heads_, d_k_, false));
    info = worst(info, build(spec_.k, CK_, WK, kv_heads_, d_k_, false));
    info = worst(info, build(spec_.v, CV_, WV, kv_heads_, d_v_, false));
    ++refreshes_;
    info_ = info;
    return info;
  }

  const Mat<Scalar>& C_Q() const { return CQ_; }
  const Mat<Scalar>& C_K() const { return CK_; }
  const Mat<Scalar>& C_V() const { return CV_; }
  const ConditioningSpec<Scalar>& spec() const { return spec_; }
  const MultiHeadOptions<Scalar>& options() const { return opts_; }
  /// Number of refresh() calls so far.
  Index refreshes() const { return refreshes_; }
  /// Outcome of the last construction or refresh (InvalidInput: some correction is NaN).
  Info info() const { return info_; }

  /// The corrected weights W + C, to fold into the layer at inference (MATH.md §7).
  FoldedWeights<Scalar> fold(const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                             const CRef<Scalar>& WV) const {
    check_weights("ConditionedAttention::fold", WQ, WK, WV);
    return {WQ + CQ_, WK + CK_, WV + CV_};
  }

  /// Forward pass at W + C into `cache` (A is cache.A).
  void forward(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
               const CRef<Scalar>& WV, MultiHeadCache<Scalar>& cache) {
    effective("ConditionedAttention::forward", WQ, WK, WV);
    multihead_forward<Scalar>(X, WQe_, WKe_, WVe_, opts_, cache);
  }

  /// The output A at W + C, by value.
  Mat<Scalar> attention(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                        const CRef<Scalar>& WV) {
    MultiHeadCache<Scalar> cache;
    forward(X, WQ, WK, WV, cache);
    return cache.A;
  }

  /// JVP: dA for tangents of W (equal to tangents of W + C, C being fixed) and X. `cache` comes
  /// from forward() on the same X and W. Empty tangents are zero.
  void jvp(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
           const CRef<Scalar>& WV, const MultiHeadCache<Scalar>& cache, const CRef<Scalar>& dWQ,
           const CRef<Scalar>& dWK, const CRef<Scalar>& dWV, const CRef<Scalar>& dX,
           MultiHeadWorkspace<Scalar>& ws, Ref<Scalar> dA) {
    effective("ConditionedAttention::jvp", WQ, WK, WV);
    multihead_jvp<Scalar>(X, WQe_, WKe_, WVe_, opts_, cache, dWQ, dWK, dWV, dX, ws, dA);
  }

  /// By-value JVP.
  Mat<Scalar> jvp(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                  const CRef<Scalar>& WV, const MultiHeadCache<Scalar>& cache,
                  const AttentionTangents<Scalar>& t) {
    MultiHeadWorkspace<Scalar> ws;
    Mat<Scalar> dA(X.rows(), cache.A.cols());
    jvp(X, WQ, WK, WV, cache, t.dWQ, t.dWK, t.dWV, t.dX, ws, dA);
    return dA;
  }

  /// VJP: dL/dW (= dL/d(W + C)) and dL/dX for G = dL/dA. Outputs of size 0 x 0 are skipped.
  void vjp(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
           const CRef<Scalar>& WV, const MultiHeadCache<Scalar>& cache, const CRef<Scalar>& G,
           MultiHeadWorkspace<Scalar>& ws, Ref<Scalar> gWQ, Ref<Scalar> gWK, Ref<Scalar> gWV,
           Ref<Scalar> gX) {
    effective("ConditionedAttention::vjp", WQ, WK, WV);
    multihead_vjp<Scalar>(X, WQe_, WKe_, WVe_, opts_, cache, G, ws, gWQ, gWK, gWV, gX);
  }

  /// By-value VJP: all four cotangents.
  AttentionGradients<Scalar> vjp(const CRef<Scalar>& X, const CRef<Scalar>& WQ,
                                 const CRef<Scalar>& WK, const CRef<Scalar>& WV,
                                 const MultiHeadCache<Scalar>& cache, const CRef<Scalar>& G) {
    MultiHeadWorkspace<Scalar> ws;
    AttentionGradients<Scalar> g;
    g.dWQ.resize(WQ.rows(), WQ.cols());
    g.dWK.resize(WK.rows(), WK.cols());
    g.dWV.resize(WV.rows(), WV.cols());
    g.dX.resize(X.rows(), X.cols());
    vjp(X, WQ, WK, WV, cache, G, ws, g.dWQ, g.dWK, g.dWV, g.dX);
    return g;
  }

 private:
  static Info worst(Info a, Info b) { return a == Info::InvalidInput ? a : b; }

  void set_shape(const char* fn, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                 const CRef<Scalar>& WV) {
    heads_ = opts_.heads;
    kv_heads_ = opts_.kv_heads == 0 ? opts_.heads : opts_.kv_heads;
    std::ostringstream e;
    if (heads_ < 1)
      e << "heads must be >= 1 (got " << heads_ << ")";
    else if (kv_heads_ < 1 || heads_ % kv_heads_ != 0)
      e << "kv_heads must be >= 1 and divide heads = " << heads_ << " (got " << kv_heads_ << ")";
    else if (WQ.rows() < 1 || WQ.cols() < heads_ || WQ.cols() % heads_ != 0)
      e << "W_Q must have D >= 1 rows and a positive multiple of heads = " << heads_
        << " columns (got " << detail::shape_str(WQ.rows(), WQ.cols()) << ")";
    else if (WV.cols() < kv_heads_ || WV.cols() % kv_heads_ != 0)
      e << "W_V has " << WV.cols()
        << " columns, not a positive multiple of kv_heads = " << kv_heads_;
    if (!e.str().empty()) detail::fail(fn, e.str());
    D_ = WQ.rows();
    d_k_ = WQ.cols() / heads_;
    d_v_ = WV.cols() / kv_heads_;
    check_weights(fn, WQ, WK, WV);
  }

  void check_weights(const char* fn, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                     const CRef<Scalar>& WV) const {
    detail::require_shape(fn, "W_Q", "D x (heads d_k)", D_, heads_ * d_k_, WQ);
    detail::require_shape(fn, "W_K", "D x (kv_heads d_k)", D_, kv_heads_ * d_k_, WK);
    detail::require_shape(fn, "W_V", "D x (kv_heads d_v)", D_, kv_heads_ * d_v_, WV);
  }

  /// Builds C for one projection of `blocks` blocks of width d, whose first column in the packed
  /// weight is packed_offset. Lambda and None only when `lambda_too` (the constructor); Exact
  /// always. Returns InvalidInput for NaN/Inf weights.
  Info build(const Correction<Scalar>& c, Mat<Scalar>& C, const CRef<Scalar>& W, Index blocks,
             Index d, bool lambda_too, Index packed_offset = 0) {
    if (c.kind == CorrectionKind::None) {
      if (lambda_too) C = Mat<Scalar>::Zero(W.rows(), W.cols());
      return Info::Success;
    }
    if (c.kind == CorrectionKind::Lambda) {
      if (lambda_too)
        C = c.lambda * lambda_identity<Scalar>(W.rows(), blocks, d, c.placement, packed_offset);
      return Info::Success;
    }
    detail::ensure_size(C, W.rows(), W.cols());
    Info info = Info::Success;
    for (Index j = 0; j < blocks; ++j) {
      const CRef<Scalar> Wj = W.middleCols(j * d, d);
      if (!Wj.allFinite()) {
        C.middleCols(j * d, d).setConstant(std::numeric_limits<Scalar>::quiet_NaN());
        info = Info::InvalidInput;
        continue;
      }
      const ThinSvd<Scalar> svd = thin_svd(Wj);
      const Scalar alpha = detail::exact_alpha<Scalar>(svd.S(0), svd.S(svd.S.size() - 1), c.target);
      C.middleCols(j * d, d).noalias() = alpha * svd.U * svd.V.transpose();
    }
    return info;
  }

  /// W + C into the reusable buffers, after checking the shapes.
  void effective(const char* fn, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                 const CRef<Scalar>& WV) {
    check_weights(fn, WQ, WK, WV);
    detail::ensure_size(WQe_, WQ.rows(), WQ.cols());
    detail::ensure_size(WKe_, WK.rows(), WK.cols());
    detail::ensure_size(WVe_, WV.rows(), WV.cols());
    WQe_ = WQ + CQ_;
    WKe_ = WK + CK_;
    WVe_ = WV + CV_;
  }

  ConditioningSpec<Scalar> spec_;
  MultiHeadOptions<Scalar> opts_;
  Index D_ = 0, heads_ = 1, kv_heads_ = 1, d_k_ = 0, d_v_ = 0;
  Mat<Scalar> CQ_, CK_, CV_;     ///< the corrections, shapes of W_Q, W_K, W_V
  Mat<Scalar> WQe_, WKe_, WVe_;  ///< W + C, reused across calls
  Index refreshes_ = 0;
  Info info_ = Info::Success;
};

}  // namespace spectral_cond
