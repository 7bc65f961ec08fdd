// spectral_cond: single-head attention, its JVP and VJP (MATH.md §1–2, §10).
//
//   A = softmax_row(c Q~ K~^T + M) V,   Q = X W_Q + 1 b_Q^T,  K = X W_K + 1 b_K^T,
//                                       V = X W_V + 1 b_V^T,
//
// with Q~ = Q, K~ = K, or their rows rotated by RoPE (rope.hpp). The biases and RoPE are
// optional (AttentionOptions); without them this is the paper's block.
//
// Every routine comes in two forms: an out-parameter form that writes into caller storage and
// a workspace, allocating nothing once the buffers have their shapes (for hot loops and the GPU
// path), and a by-value form for people.
#pragma once

#include "spectral_cond/core/common.hpp"
#include "spectral_cond/core/detail/attention_qkv.hpp"
#include "spectral_cond/core/rope.hpp"

#include <optional>

namespace spectral_cond {

/// Options of an attention block (MATH.md §1).
template <typename Scalar>
struct AttentionOptions {
  /// Logit scale c. Unset means the default 1/sqrt(d_k); c = 1 is the paper's theory.
  /// Must be finite and > 0 when set.
  std::optional<Scalar> scale;
  /// Mask M added to the logits: none, causal (M_ij = -inf for j > i) or a user N x N matrix.
  MaskKind mask = MaskKind::None;
  /// The user's additive mask, used when mask == MaskKind::Additive. Entries are finite or
  /// -inf; a row that is entirely -inf is an input error.
  Mat<Scalar> additive_mask;
  /// Biases of the projections (MATH.md §10); an empty vector is no bias. Lengths d_k, d_k,
  /// d_v (for a multi-head layer: the fused widths).
  Vec<Scalar> bias_q, bias_k, bias_v;
  /// Rotary position embeddings of Q and K (MATH.md §10); unset is none.
  std::optional<RopeOptions> rope;

  bool has_biases() const { return bias_q.size() > 0 || bias_k.size() > 0 || bias_v.size() > 0; }
  /// Whether anything beyond the paper's block (biases, RoPE) is set.
  bool extended() const { return has_biases() || rope.has_value(); }

  /// The scale actually used for key width d_k.
  Scalar resolved_scale(Index d_k) const {
    return scale ? *scale : Scalar(1) / Eigen::numext::sqrt(static_cast<Scalar>(d_k));
  }

  /// Throws std::invalid_argument naming `fn` when the options cannot apply to N tokens.
  void check(const char* fn, Index n_tokens) const {
    if (scale && !(Eigen::numext::isfinite(*scale) && *scale > Scalar(0))) {
      std::ostringstream s;
      s << "scale must be finite and > 0 (got " << *scale << ")";
      detail::fail(fn, s.str());
    }
    if (mask == MaskKind::Additive) {
      detail::require_shape(fn, "additive_mask", "N x N", n_tokens, n_tokens, additive_mask);
      detail::check_additive_mask(fn, additive_mask);
    }
    if (rope && rope->has_tables() && rope->cos.rows() != n_tokens) {
      std::ostringstream s;
      s << "rope tables must have one row per token, N = " << n_tokens << " (got "
        << rope->cos.rows() << ")";
      detail::fail(fn, s.str());
    }
  }

  /// Throws std::invalid_argument naming `fn` when the biases or RoPE do not fit projections of
  /// widths wq, wk, wv (d_k, d_k, d_v for one head) with heads of width d_k.
  void check_projections(const char* fn, Index wq, Index wk, Index wv, Index d_k) const {
    auto bias = [&](const char* name, const Vec<Scalar>& b, Index w) {
      if (b.size() == 0) return;
      if (b.size() != w) {
        std::ostringstream s;
        s << name << " must have length " << w << " (got " << b.size() << ")";
        detail::fail(fn, s.str());
      }
      if (!b.allFinite()) detail::fail(fn, std::string(name) + " must be finite");
    };
    bias("bias_q", bias_q, wq);
    bias("bias_k", bias_k, wk);
    bias("bias_v", bias_v, wv);
    if (rope) rope->check(fn, d_k);
  }

  const Mat<Scalar>* additive_or_null() const {
    return mask == MaskKind::Additive ? &additive_mask : nullptr;
  }
};

/// What the forward pass keeps for the derivative routines: Q, K, V, P and A, and the scale.
template <typename Scalar>
struct AttentionCache {
  Mat<Scalar> Q, K, V;  ///< N x d_k, N x d_k, N x d_v
  Mat<Scalar> P;        ///< N x N, rows sum to one
  Mat<Scalar> A;        ///< N x d_v, the output
  Scalar scale = 0;     ///< the c that was used
  Vec<Scalar> rowbuf;   ///< scratch for the softmax
  /// RoPE's tables when it is on; then Q and K above are the rotated Q~ and K~ (MATH.md §10).
  detail::RopeTable<Scalar> rope;
  Mat<Scalar> rope_scratch;  ///< scratch for the forward pass

  Index n_tokens() const { return P.rows(); }
  Index d_k() const { return Q.cols(); }
  Index d_v() const { return V.cols(); }
};

/// Scratch buffers for the JVP and VJP, sized on first use and reused.
template <typename Scalar>
struct AttentionWorkspace {
  Mat<Scalar> dQ, dK, dV;  ///< tangents or cotangents of Q, K, V
  Mat<Scalar> NxN;         ///< dZ/dP or dL/dP, dL/dZ
  Vec<Scalar> r;           ///< row sums
  Mat<Scalar> rope;        ///< scratch for RoPE
};

/// Tangents for attention_jvp; an empty (0 x 0, or length 0) member is a zero tangent.
template <typename Scalar>
struct AttentionTangents {
  Mat<Scalar> dWQ, dWK, dWV, dX;
  Vec<Scalar> dbQ{}, dbK{}, dbV{};  ///< tangents of the biases (MATH.md §10)
};

/// Cotangents returned by attention_vjp: dL/dW_Q, dL/dW_K, dL/dW_V, dL/dX, and those of the
/// biases, dL/db = column sums of dL/dQ, dL/dK, dL/dV (MATH.md §10).
template <typename Scalar>
struct AttentionGradients {
  Mat<Scalar> dWQ, dWK, dWV, dX;
  Vec<Scalar> dbQ{}, dbK{}, dbV{};
};

namespace detail {

template <typename Scalar>
void check_attention_inputs(const char* fn, const CRef<Scalar>& X, const CRef<Scalar>& WQ,
                            const CRef<Scalar>& WK, const CRef<Scalar>& WV) {
  const Index N = X.rows(), D = X.cols();
  if (N < 1 || D < 1)
    fail(fn, "X must have at least one row and one column (got " + shape_str(N, D) + ")");
  if (WQ.cols() < 1 || WV.cols() < 1) fail(fn, "W_Q and W_V must have at least one column");
  require_shape(fn, "W_Q", "D x d_k", D, WQ.cols(), WQ);
  require_shape(fn, "W_K", "D x d_k", D, WQ.cols(), WK);
  require_shape(fn, "W_V", "D x d_v", D, WV.cols(), WV);
}

template <typename Scalar>
void check_cache(const char* fn, const AttentionCache<Scalar>& c, Index N, Index dk, Index dv) {
  if (c.P.rows() != N || c.P.cols() != N || c.Q.cols() != dk || c.V.cols() != dv ||
      c.A.rows() != N || c.A.cols() != dv)
    fail(fn, "cache does not match the inputs (run attention_forward on the same X, W first)");
}

/// Q = X W (+ 1 b^T when b is not empty).
template <typename Scalar>
void biased_projection(const CRef<Scalar>& X, const CRef<Scalar>& W, const Vec<Scalar>& b,
                       Mat<Scalar>& dst) {
  ensure_size(dst, X.rows(), W.cols());
  dst.noalias() = X * W;
  if (b.size() > 0) dst.rowwise() += b.transpose();
}

/// dst = X dW + dX W for tangents that may be empty (zero).
template <typename Scalar>
void projection_tangent(const CRef<Scalar>& X, const CRef<Scalar>& W, const CRef<Scalar>& dW,
                        const CRef<Scalar>& dX, Mat<Scalar>& dst) {
  ensure_size(dst, X.rows(), W.cols());
  if (dW.size() > 0)
    dst.noalias() = X * dW;
  else
    dst.setZero();
  if (dX.size() > 0) dst.noalias() += dX * W;
}

}  // namespace detail

/// Forward pass A = softmax_row(c Q~ K~^T + M) V into `cache` (MATH.md §1, §10): with
/// neither biases nor RoPE, A = softmax_row(c X W_Q (X W_K)^T + M) X W_V.
/// Allocates nothing when `cache` already has the shapes of a previous call.
template <typename Scalar>
void attention_forward(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                       const CRef<Scalar>& WV, const AttentionOptions<Scalar>& opts,
                       AttentionCache<Scalar>& cache) {
  constexpr const char* fn = "attention_forward";
  detail::check_attention_inputs<Scalar>(fn, X, WQ, WK, WV);
  opts.check(fn, X.rows());
  opts.check_projections(fn, WQ.cols(), WK.cols(), WV.cols(), WQ.cols());
  const Index N = X.rows();
  detail::biased_projection<Scalar>(X, WQ, opts.bias_q, cache.Q);
  detail::biased_projection<Scalar>(X, WK, opts.bias_k, cache.K);
  detail::biased_projection<Scalar>(X, WV, opts.bias_v, cache.V);
  if (opts.rope) {
    cache.rope.build(*opts.rope, N, WQ.cols());
    cache.rope.apply(cache.Q, false, cache.rope_scratch);
    cache.rope.apply(cache.K, false, cache.rope_scratch);
  } else {
    cache.rope.clear();
  }
  cache.scale = opts.resolved_scale(WQ.cols());
  detail::ensure_size(cache.A, N, WV.cols());
  detail::forward_qkv<Scalar>(cache.Q, cache.K, cache.V, cache.scale, opts.mask,
                              opts.additive_or_null(), cache.P, cache.A, cache.rowbuf);
}

/// By-value forward: returns the cache (A is `cache.A`).
template <typename DX, typename DQ, typename DK, typename DV>
AttentionCache<typename DX::Scalar> attention_forward(
    const Eigen::MatrixBase<DX>& X, const Eigen::MatrixBase<DQ>& WQ,
    const Eigen::MatrixBase<DK>& WK, const Eigen::MatrixBase<DV>& WV,
    const AttentionOptions<typename DX::Scalar>& opts = {}) {
  using Scalar = typename DX::Scalar;
  AttentionCache<Scalar> cache;
  attention_forward<Scalar>(X, WQ, WK, WV, opts, cache);
  return cache;
}

/// The attention output A alone.
template <typename DX, typename DQ, typename DK, typename DV>
Mat<typename DX::Scalar> attention(const Eigen::MatrixBase<DX>& X, const Eigen::MatrixBase<DQ>& WQ,
                                   const Eigen::MatrixBase<DK>& WK, const Eigen::MatrixBase<DV>& WV,
                                   const AttentionOptions<typename DX::Scalar>& opts = {}) {
  return attention_forward(X, WQ, WK, WV, opts).A;
}

/// JVP (MATH.md §2): dA for tangents of any subset of (W_Q, W_K, W_V, X); an empty (0 x 0)
/// tangent is zero. `cache` must come from attention_forward on the same X and W, whose
/// biases and RoPE it carries (RoPE rotates dQ and dK as it rotates Q and K, MATH.md §10).
/// Cost: at most six N x D x d products and three N x N x d products.
template <typename Scalar>
void attention_jvp(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                   const CRef<Scalar>& WV, const AttentionCache<Scalar>& cache,
                   const CRef<Scalar>& dWQ, const CRef<Scalar>& dWK, const CRef<Scalar>& dWV,
                   const CRef<Scalar>& dX, AttentionWorkspace<Scalar>& ws, Ref<Scalar> dA) {
  constexpr const char* fn = "attention_jvp";
  detail::check_attention_inputs<Scalar>(fn, X, WQ, WK, WV);
  const Index N = X.rows(), D = X.cols(), dk = WQ.cols(), dv = WV.cols();
  detail::check_cache(fn, cache, N, dk, dv);
  if (dWQ.size() > 0) detail::require_shape(fn, "dW_Q", "D x d_k", D, dk, dWQ);
  if (dWK.size() > 0) detail::require_shape(fn, "dW_K", "D x d_k", D, dk, dWK);
  if (dWV.size() > 0) detail::require_shape(fn, "dW_V", "D x d_v", D, dv, dWV);
  if (dX.size() > 0) detail::require_shape(fn, "dX", "N x D", N, D, dX);
  detail::require_shape(fn, "dA", "N x d_v", N, dv, dA);

  const bool q_moves = dWQ.size() > 0 || dX.size() > 0;
  const bool k_moves = dWK.size() > 0 || dX.size() > 0;
  const bool v_moves = dWV.size() > 0 || dX.size() > 0;
  if (q_moves) detail::projection_tangent<Scalar>(X, WQ, dWQ, dX, ws.dQ);
  if (k_moves) detail::projection_tangent<Scalar>(X, WK, dWK, dX, ws.dK);
  if (v_moves) detail::projection_tangent<Scalar>(X, WV, dWV, dX, ws.dV);
  if (q_moves) cache.rope.apply(ws.dQ, false, ws.rope);
  if (k_moves) cache.rope.apply(ws.dK, false, ws.rope);
  const Mat<Scalar> zero;
  detail::jvp_qkv<Scalar>(cache.Q, cache.K, cache.V, cache.P, cache.scale, q_moves ? ws.dQ : zero,
                          k_moves ? ws.dK : zero, v_moves ? ws.dV : zero, ws.NxN, ws.r, dA);
}

/// By-value JVP, with the bias tangents of `t` too (db enters as dQ = 1 db_Q^T, …).
template <typename Scalar>
Mat<Scalar> attention_jvp(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                          const CRef<Scalar>& WV, const AttentionCache<Scalar>& cache,
                          const AttentionTangents<Scalar>& t) {
  constexpr const char* fn = "attention_jvp";
  AttentionWorkspace<Scalar> ws;
  Mat<Scalar> dA(X.rows(), WV.cols());
  attention_jvp<Scalar>(X, WQ, WK, WV, cache, t.dWQ, t.dWK, t.dWV, t.dX, ws, dA);
  if (t.dbQ.size() == 0 && t.dbK.size() == 0 && t.dbV.size() == 0) return dA;
  // The map is linear: add the response to (dQ, dK, dV) = (1 db_Q^T, 1 db_K^T, 1 db_V^T).
  const Index N = X.rows(), dk = WQ.cols(), dv = WV.cols();
  auto ones_times = [&](const char* name, const Vec<Scalar>& db, Index w, Mat<Scalar>& dst) {
    if (db.size() == 0) return false;
    if (db.size() != w) detail::fail(fn, std::string(name) + " has the wrong length");
    dst = Mat<Scalar>::Ones(N, 1) * db.transpose();
    return true;
  };
  Mat<Scalar> dQ, dK, dV, dB(N, dv);
  const bool q = ones_times("dbQ", t.dbQ, dk, dQ), k = ones_times("dbK", t.dbK, dk, dK),
             v = ones_times("dbV", t.dbV, dv, dV);
  if (q) cache.rope.apply(dQ, false, ws.rope);
  if (k) cache.rope.apply(dK, false, ws.rope);
  const Mat<Scalar> zero;
  detail::jvp_qkv<Scalar>(cache.Q, cache.K, cache.V, cache.P, cache.scale, q ? dQ : zero,
                          k ? dK : zero, v ? dV : zero, ws.NxN, ws.r, dB);
  dA += dB;
  return dA;
}

/// VJP (MATH.md §2): cotangents of W_Q, W_K, W_V and X for G = dL/dA. An output passed with
/// size 0 x 0 (for example `Eigen::Map<Mat<Scalar>>(nullptr, 0, 0)`) is not computed. After
/// the call ws.dQ, ws.dK, ws.dV hold dL/dQ, dL/dK, dL/dV (before RoPE), whose column sums are
/// the cotangents of the biases.
template <typename Scalar>
void attention_vjp(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                   const CRef<Scalar>& WV, const AttentionCache<Scalar>& cache,
                   const CRef<Scalar>& G, AttentionWorkspace<Scalar>& ws, Ref<Scalar> gWQ,
                   Ref<Scalar> gWK, Ref<Scalar> gWV, Ref<Scalar> gX) {
  constexpr const char* fn = "attention_vjp";
  detail::check_attention_inputs<Scalar>(fn, X, WQ, WK, WV);
  const Index N = X.rows(), D = X.cols(), dk = WQ.cols(), dv = WV.cols();
  detail::check_cache(fn, cache, N, dk, dv);
  detail::require_shape(fn, "G", "N x d_v", N, dv, G);
  if (gWQ.size() > 0) detail::require_shape(fn, "dW_Q", "D x d_k", D, dk, gWQ);
  if (gWK.size() > 0) detail::require_shape(fn, "dW_K", "D x d_k", D, dk, gWK);
  if (gWV.size() > 0) detail::require_shape(fn, "dW_V", "D x d_v", D, dv, gWV);
  if (gX.size() > 0) detail::require_shape(fn, "dX", "N x D", N, D, gX);

  detail::ensure_size(ws.dQ, N, dk);
  detail::ensure_size(ws.dK, N, dk);
  detail::ensure_size(ws.dV, N, dv);
  detail::vjp_qkv<Scalar>(cache.Q, cache.K, cache.V, cache.P, cache.scale, G, ws.NxN, ws.r, ws.dQ,
                          ws.dK, ws.dV, /*accumulate=*/false);
  cache.rope.apply(ws.dQ, true, ws.rope);  // dL/dQ = dL/dQ~ R^T, row by row
  cache.rope.apply(ws.dK, true, ws.rope);
  if (gWQ.size() > 0) gWQ.noalias() = X.transpose() * ws.dQ;
  if (gWK.size() > 0) gWK.noalias() = X.transpose() * ws.dK;
  if (gWV.size() > 0) gWV.noalias() = X.transpose() * ws.dV;
  if (gX.size() > 0) {
    gX.noalias() = ws.dQ * WQ.transpose();
    gX.noalias() += ws.dK * WK.transpose();
    gX.noalias() += ws.dV * WV.transpose();
  }
}

/// By-value VJP: all four cotangents, and those of the biases.
template <typename Scalar>
AttentionGradients<Scalar> attention_vjp(const CRef<Scalar>& X, const CRef<Scalar>& WQ,
                                         const CRef<Scalar>& WK, const CRef<Scalar>& WV,
                                         const AttentionCache<Scalar>& cache,
                                         const CRef<Scalar>& G) {
  AttentionWorkspace<Scalar> ws;
  AttentionGradients<Scalar> g;
  g.dWQ.resize(WQ.rows(), WQ.cols());
  g.dWK.resize(WK.rows(), WK.cols());
  g.dWV.resize(WV.rows(), WV.cols());
  g.dX.resize(X.rows(), X.cols());
  attention_vjp<Scalar>(X, WQ, WK, WV, cache, G, ws, g.dWQ, g.dWK, g.dWV, g.dX);
  g.dbQ = ws.dQ.colwise().sum().transpose();
  g.dbK = ws.dK.colwise().sum().transpose();
  g.dbV = ws.dV.colwise().sum().transpose();
  return g;
}

}  // namespace spectral_cond
