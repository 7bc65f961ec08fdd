// spectral_cond: multi-head and grouped-query attention (MATH.md §1–2, §8).
//
// Fused projections W_Q (D x h d_k), W_K (D x h_kv d_k), W_V (D x h_kv d_v). Head j owns columns
// [j d_k, (j+1) d_k) of W_Q; it shares key/value head g = j / (h / h_kv). The output is the
// concatenation A = [A_0 | … | A_{h-1}], N x h d_v (no output projection).
#pragma once

#include "spectral_cond/core/attention.hpp"

#include <vector>

namespace spectral_cond {

/// Sizes of a multi-head layer, derived from the fused weights and the head counts.
struct MultiHeadShape {
  Index N = 0, D = 0, heads = 1, kv_heads = 1, d_k = 0, d_v = 0;
  Index group() const { return heads / kv_heads; }
  /// The key/value head that query head j reads.
  Index kv_of(Index j) const { return j / group(); }
};

/// Options of a multi-head layer: those of one head, plus the head counts.
template <typename Scalar>
struct MultiHeadOptions : AttentionOptions<Scalar> {
  Index heads = 1;     ///< h, the number of query heads
  Index kv_heads = 0;  ///< h_kv, key/value heads (grouped-query when < h); 0 means h

  /// Checks the head counts against the fused weights and returns the layer's shape.
  MultiHeadShape check(const char* fn, const CRef<Scalar>& X, const CRef<Scalar>& WQ,
                       const CRef<Scalar>& WK, const CRef<Scalar>& WV) const {
    MultiHeadShape s;
    s.N = X.rows();
    s.D = X.cols();
    s.heads = heads;
    s.kv_heads = kv_heads == 0 ? heads : kv_heads;
    std::ostringstream e;
    if (s.heads < 1) {
      e << "heads must be >= 1 (got " << heads << ")";
    } else if (s.kv_heads < 1 || s.heads % s.kv_heads != 0) {
      e << "kv_heads must be >= 1 and divide heads = " << s.heads << " (got " << kv_heads << ")";
    } else if (s.N < 1 || s.D < 1) {
      e << "X must be non-empty (got " << detail::shape_str(s.N, s.D) << ")";
    } else if (WQ.cols() < s.heads || WQ.cols() % s.heads != 0) {
      e << "W_Q has " << WQ.cols() << " columns, not a positive multiple of heads = " << s.heads;
    } else if (WV.cols() < s.kv_heads || WV.cols() % s.kv_heads != 0) {
      e << "W_V has " << WV.cols()
        << " columns, not a positive multiple of kv_heads = " << s.kv_heads;
    }
    if (!e.str().empty()) detail::fail(fn, e.str());
    s.d_k = WQ.cols() / s.heads;
    s.d_v = WV.cols() / s.kv_heads;
    detail::require_shape(fn, "W_Q", "D x (heads d_k)", s.D, s.heads * s.d_k, WQ);
    detail::require_shape(fn, "W_K", "D x (kv_heads d_k)", s.D, s.kv_heads * s.d_k, WK);
    detail::require_shape(fn, "W_V", "D x (kv_heads d_v)", s.D, s.kv_heads * s.d_v, WV);
    AttentionOptions<Scalar>::check(fn, s.N);
    this->check_projections(fn, WQ.cols(), WK.cols(), WV.cols(), s.d_k);
    return s;
  }
};

/// What the multi-head forward pass keeps: fused Q, K, V, each head's P, and A.
template <typename Scalar>
struct MultiHeadCache {
  MultiHeadShape shape;
  Mat<Scalar> Q, K, V;         ///< N x h d_k, N x h_kv d_k, N x h_kv d_v
  std::vector<Mat<Scalar>> P;  ///< one N x N matrix per query head
  Mat<Scalar> A;               ///< N x h d_v
  Scalar scale = 0;
  Vec<Scalar> rowbuf;
  /// RoPE's tables (per head of width d_k) when it is on; then Q and K are rotated.
  detail::RopeTable<Scalar> rope;
  Mat<Scalar> rope_scratch;
};

template <typename Scalar>
struct MultiHeadWorkspace {
  Mat<Scalar> dQ, dK, dV, NxN;
  Vec<Scalar> r;
  Mat<Scalar> rope;
};

namespace detail {
template <typename Scalar>
void check_mh_cache(const char* fn, const MultiHeadCache<Scalar>& c, const MultiHeadShape& s) {
  if (c.shape.N != s.N || c.shape.D != s.D || c.shape.heads != s.heads ||
      c.shape.kv_heads != s.kv_heads || c.shape.d_k != s.d_k || c.shape.d_v != s.d_v ||
      static_cast<Index>(c.P.size()) != s.heads)
    fail(fn, "cache does not match the inputs (run multihead_forward on the same X, W first)");
}
}  // namespace detail

/// Multi-head forward pass into `cache`; allocates nothing when the shapes repeat.
template <typename Scalar>
void multihead_forward(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                       const CRef<Scalar>& WV, const MultiHeadOptions<Scalar>& opts,
                       MultiHeadCache<Scalar>& cache) {
  const MultiHeadShape s = opts.check("multihead_forward", X, WQ, WK, WV);
  cache.shape = s;
  detail::ensure_size(cache.Q, s.N, WQ.cols());
  detail::ensure_size(cache.K, s.N, WK.cols());
  detail::ensure_size(cache.V, s.N, WV.cols());
  detail::ensure_size(cache.A, s.N, s.heads * s.d_v);
  if (static_cast<Index>(cache.P.size()) != s.heads) cache.P.resize(static_cast<size_t>(s.heads));
  detail::biased_projection<Scalar>(X, WQ, opts.bias_q, cache.Q);
  detail::biased_projection<Scalar>(X, WK, opts.bias_k, cache.K);
  detail::biased_projection<Scalar>(X, WV, opts.bias_v, cache.V);
  if (opts.rope) {
    cache.rope.build(*opts.rope, s.N, s.d_k);
    cache.rope.apply(cache.Q, false, cache.rope_scratch);
    cache.rope.apply(cache.K, false, cache.rope_scratch);
  } else {
    cache.rope.clear();
  }
  cache.scale = opts.resolved_scale(s.d_k);
  for (Index j = 0; j < s.heads; ++j) {
    const Index g = s.kv_of(j);
    detail::forward_qkv<Scalar>(
        cache.Q.middleCols(j * s.d_k, s.d_k), cache.K.middleCols(g * s.d_k, s.d_k),
        cache.V.middleCols(g * s.d_v, s.d_v), cache.scale, opts.mask, opts.additive_or_null(),
        cache.P[static_cast<size_t>(j)], cache.A.middleCols(j * s.d_v, s.d_v), cache.rowbuf);
  }
}

/// By-value multi-head forward.
template <typename DX, typename DQ, typename DK, typename DV>
MultiHeadCache<typename DX::Scalar> multihead_forward(
    const Eigen::MatrixBase<DX>& X, const Eigen::MatrixBase<DQ>& WQ,
    const Eigen::MatrixBase<DK>& WK, const Eigen::MatrixBase<DV>& WV,
    const MultiHeadOptions<typename DX::Scalar>& opts) {
  using Scalar = typename DX::Scalar;
  MultiHeadCache<Scalar> cache;
  multihead_forward<Scalar>(X, WQ, WK, WV, opts, cache);
  return cache;
}

/// Multi-head JVP: dA (N x h d_v) for tangents of any subset of the fused weights and X.
template <typename Scalar>
void multihead_jvp(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                   const CRef<Scalar>& WV, const MultiHeadOptions<Scalar>& opts,
                   const MultiHeadCache<Scalar>& cache, const CRef<Scalar>& dWQ,
                   const CRef<Scalar>& dWK, const CRef<Scalar>& dWV, const CRef<Scalar>& dX,
                   MultiHeadWorkspace<Scalar>& ws, Ref<Scalar> dA) {
  constexpr const char* fn = "multihead_jvp";
  const MultiHeadShape s = opts.check(fn, X, WQ, WK, WV);
  detail::check_mh_cache(fn, cache, s);
  if (dWQ.size() > 0) detail::require_shape(fn, "dW_Q", "shape of W_Q", s.D, WQ.cols(), dWQ);
  if (dWK.size() > 0) detail::require_shape(fn, "dW_K", "shape of W_K", s.D, WK.cols(), dWK);
  if (dWV.size() > 0) detail::require_shape(fn, "dW_V", "shape of W_V", s.D, WV.cols(), dWV);
  if (dX.size() > 0) detail::require_shape(fn, "dX", "N x D", s.N, s.D, dX);
  detail::require_shape(fn, "dA", "N x (heads d_v)", s.N, s.heads * s.d_v, dA);
  const bool q_moves = dWQ.size() > 0 || dX.size() > 0;
  const bool k_moves = dWK.size() > 0 || dX.size() > 0;
  const bool v_moves = dWV.size() > 0 || dX.size() > 0;
  if (q_moves) detail::projection_tangent<Scalar>(X, WQ, dWQ, dX, ws.dQ);
  if (k_moves) detail::projection_tangent<Scalar>(X, WK, dWK, dX, ws.dK);
  if (v_moves) detail::projection_tangent<Scalar>(X, WV, dWV, dX, ws.dV);
  if (q_moves) cache.rope.apply(ws.dQ, false, ws.rope);
  if (k_moves) cache.rope.apply(ws.dK, false, ws.rope);
  const Mat<Scalar> zero;
  for (Index j = 0; j < s.heads; ++j) {
    const Index g = s.kv_of(j);
    detail::jvp_qkv<Scalar>(
        cache.Q.middleCols(j * s.d_k, s.d_k), cache.K.middleCols(g * s.d_k, s.d_k),
        cache.V.middleCols(g * s.d_v, s.d_v), cache.P[static_cast<size_t>(j)], cache.scale,
        q_moves ? CRef<Scalar>(ws.dQ.middleCols(j * s.d_k, s.d_k)) : CRef<Scalar>(zero),
        k_moves ? CRef<Scalar>(ws.dK.middleCols(g * s.d_k, s.d_k)) : CRef<Scalar>(zero),
        v_moves ? CRef<Scalar>(ws.dV.middleCols(g * s.d_v, s.d_v)) : CRef<Scalar>(zero), ws.NxN,
        ws.r, dA.middleCols(j * s.d_v, s.d_v));
  }
}

/// Multi-head VJP: cotangents of the fused weights and X for G = dL/dA (N x h d_v). Outputs of
/// size 0 x 0 are skipped.
template <typename Scalar>
void multihead_vjp(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                   const CRef<Scalar>& WV, const MultiHeadOptions<Scalar>& opts,
                   const MultiHeadCache<Scalar>& cache, const CRef<Scalar>& G,
                   MultiHeadWorkspace<Scalar>& ws, Ref<Scalar> gWQ, Ref<Scalar> gWK,
                   Ref<Scalar> gWV, Ref<Scalar> gX) {
  constexpr const char* fn = "multihead_vjp";
  const MultiHeadShape s = opts.check(fn, X, WQ, WK, WV);
  detail::check_mh_cache(fn, cache, s);
  detail::require_shape(fn, "G", "N x (heads d_v)", s.N, s.heads * s.d_v, G);
  if (gWQ.size() > 0) detail::require_shape(fn, "dW_Q", "shape of W_Q", s.D, WQ.cols(), gWQ);
  if (gWK.size() > 0) detail::require_shape(fn, "dW_K", "shape of W_K", s.D, WK.cols(), gWK);
  if (gWV.size() > 0) detail::require_shape(fn, "dW_V", "shape of W_V", s.D, WV.cols(), gWV);
  if (gX.size() > 0) detail::require_shape(fn, "dX", "N x D", s.N, s.D, gX);
  detail::ensure_size(ws.dQ, s.N, WQ.cols());
  detail::ensure_size(ws.dK, s.N, WK.cols());
  detail::ensure_size(ws.dV, s.N, WV.cols());
  ws.dK.setZero();
  ws.dV.setZero();
  for (Index j = 0; j < s.heads; ++j) {
    const Index g = s.kv_of(j);
    detail::vjp_qkv<Scalar>(cache.Q.middleCols(j * s.d_k, s.d_k),
                            cache.K.middleCols(g * s.d_k, s.d_k),
                            cache.V.middleCols(g * s.d_v, s.d_v), cache.P[static_cast<size_t>(j)],
                            cache.scale, G.middleCols(j * s.d_v, s.d_v), ws.NxN, ws.r,
                            ws.dQ.middleCols(j * s.d_k, s.d_k), ws.dK.middleCols(g * s.d_k, s.d_k),
                            ws.dV.middleCols(g * s.d_v, s.d_v), /*accumulate=*/true);
  }
  cache.rope.apply(ws.dQ, true, ws.rope);
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

/// By-value multi-head VJP.
template <typename Scalar>
AttentionGradients<Scalar> multihead_vjp(const CRef<Scalar>& X, const CRef<Scalar>& WQ,
                                         const CRef<Scalar>& WK, const CRef<Scalar>& WV,
                                         const MultiHeadOptions<Scalar>& opts,
                                         const MultiHeadCache<Scalar>& cache,
                                         const CRef<Scalar>& G) {
  MultiHeadWorkspace<Scalar> ws;
  AttentionGradients<Scalar> g;
  g.dWQ.resize(WQ.rows(), WQ.cols());
  g.dWK.resize(WK.rows(), WK.cols());
  g.dWV.resize(WV.rows(), WV.cols());
  g.dX.resize(X.rows(), X.cols());
  multihead_vjp<Scalar>(X, WQ, WK, WV, opts, cache, G, ws, g.dWQ, g.dWK, g.dWV, g.dX);
  g.dbQ = ws.dQ.colwise().sum().transpose();
  g.dbK = ws.dK.colwise().sum().transpose();
  g.dbV = ws.dV.colwise().sum().transpose();
  return g;
}

/// By-value multi-head JVP.
template <typename Scalar>
Mat<Scalar> multihead_jvp(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                          const CRef<Scalar>& WV, const MultiHeadOptions<Scalar>& opts,
                          const MultiHeadCache<Scalar>& cache, const AttentionTangents<Scalar>& t) {
  MultiHeadWorkspace<Scalar> ws;
  Mat<Scalar> dA(X.rows(), cache.A.cols());
  multihead_jvp<Scalar>(X, WQ, WK, WV, opts, cache, t.dWQ, t.dWK, t.dWV, t.dX, ws, dA);
  return dA;
}

}  // namespace spectral_cond
