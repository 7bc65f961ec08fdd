// spectral_cond: Jacobians of a multi-head / grouped-query attention layer (MATH.md §3, §8).
//
// Fused weights as in multihead.hpp: W_Q (D x h d_k), W_K (D x h_kv d_k), W_V (D x h_kv d_v);
// query head j reads key/value head g = j / (h / h_kv). The layer's output is
// A_layer = [A_0 | … | A_{h-1}] (N x h d_v), so with column-major vec
//   rows of J_layer:     head j owns rows [j N d_v, (j+1) N d_v)
//   columns of J_layer:  [vec W_Q | vec W_K | vec W_V] (fused); head j's W_Q slice is columns
//                        [j D d_k, (j+1) D d_k), key/value head g's W_K slice is
//                        h D d_k + [g D d_k, (g+1) D d_k), its W_V slice
//                        (h + h_kv) D d_k + [g D d_v, (g+1) D d_v).
// Every slice is contiguous, so J_layer is block-diagonal across heads up to a permutation
// (MATH.md §8), except that with grouped-query heads the K and V columns of group g are shared
// by the h / h_kv query heads that read it: the row bands of those heads all have blocks there.
#pragma once

#include "spectral_cond/core/multihead.hpp"
#include "spectral_cond/jacobian/jacobian.hpp"

namespace spectral_cond {

/// Columns of the layer Jacobian for `block`: D (h d_k + h_kv d_k + h_kv d_v) (All),
/// D h d_k (Q), D h_kv d_k (K), D h_kv d_v (V), N D (X). Rows: N h d_v.
inline Index multihead_jacobian_cols(JacobianBlock block, const MultiHeadShape& s) {
  switch (block) {
    case JacobianBlock::All:
      return s.D * (s.heads * s.d_k + s.kv_heads * (s.d_k + s.d_v));
    case JacobianBlock::Q:
      return s.D * s.heads * s.d_k;
    case JacobianBlock::K:
      return s.D * s.kv_heads * s.d_k;
    case JacobianBlock::V:
      return s.D * s.kv_heads * s.d_v;
    case JacobianBlock::X:
      return s.N * s.D;
  }
  return 0;
}

inline Index multihead_jacobian_rows(const MultiHeadShape& s) {
  return s.N * s.heads * s.d_v;
}

namespace detail {
/// The single-head options of query head j of a multi-head layer: the same scale (c resolved
/// from the per-head d_k), mask and RoPE, and the head's slices of the fused biases.
template <typename Scalar>
AttentionOptions<Scalar> head_options(const MultiHeadOptions<Scalar>& opts, const MultiHeadShape& s,
                                      Index j) {
  AttentionOptions<Scalar> h = static_cast<const AttentionOptions<Scalar>&>(opts);
  const Index g = s.kv_of(j);
  if (opts.bias_q.size() > 0) h.bias_q = opts.bias_q.segment(j * s.d_k, s.d_k);
  if (opts.bias_k.size() > 0) h.bias_k = opts.bias_k.segment(g * s.d_k, s.d_k);
  if (opts.bias_v.size() > 0) h.bias_v = opts.bias_v.segment(g * s.d_v, s.d_v);
  return h;
}
}  // namespace detail

/// The single-head Jacobian block `block` of query head `head` (MATH.md §3), with respect to that
/// head's slices W_Q[:, j d_k : (j+1) d_k], W_K[:, g d_k : …], W_V[:, g d_v : …] (g its
/// key/value head) or X: (N d_v) x jacobian_cols(block, N, D, d_k, d_v), written into `out`.
template <typename Scalar>
void multihead_jacobian_head(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                             const CRef<Scalar>& WV, const MultiHeadOptions<Scalar>& opts,
                             Index head, JacobianBlock block, Ref<Scalar> out) {
  constexpr const char* fn = "multihead_jacobian_head";
  const MultiHeadShape s = opts.check(fn, X, WQ, WK, WV);
  if (head < 0 || head >= s.heads) {
    std::ostringstream e;
    e << "head must be in [0, " << s.heads << ") (got " << head << ")";
    detail::fail(fn, e.str());
  }
  const Index g = s.kv_of(head);
  attention_jacobian<Scalar>(X, WQ.middleCols(head * s.d_k, s.d_k), WK.middleCols(g * s.d_k, s.d_k),
                             WV.middleCols(g * s.d_v, s.d_v), detail::head_options(opts, s, head),
                             block, out);
}

/// By-value form of multihead_jacobian_head.
template <typename Scalar>
Mat<Scalar> multihead_jacobian_head(const CRef<Scalar>& X, const CRef<Scalar>& WQ,
                                    const CRef<Scalar>& WK, const CRef<Scalar>& WV,
                                    const MultiHeadOptions<Scalar>& opts, Index head,
                                    JacobianBlock block = JacobianBlock::All) {
  const MultiHeadShape s = opts.check("multihead_jacobian_head", X, WQ, WK, WV);
  Mat<Scalar> J(jacobian_rows(s.N, s.d_v), jacobian_cols(block, s.N, s.D, s.d_k, s.d_v));
  multihead_jacobian_head<Scalar>(X, WQ, WK, WV, opts, head, block, J);
  return J;
}

/// The layer's Jacobian block `block` (rows vec(A_layer), N h d_v; columns
/// multihead_jacobian_cols(block, shape)), assembled head by head into `out`: head j's J_Q,
/// J_K, J_V (or J_X) are written straight into their sub-blocks (see the file comment) and
/// everything else is zero. With block == X, head j's J_X fills its row band.
template <typename Scalar>
void multihead_jacobian(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                        const CRef<Scalar>& WV, const MultiHeadOptions<Scalar>& opts,
                        JacobianBlock block, Ref<Scalar> out) {
  constexpr const char* fn = "multihead_jacobian";
  const MultiHeadShape s = opts.check(fn, X, WQ, WK, WV);
  detail::require_shape(fn, "out", "multihead_jacobian_rows x multihead_jacobian_cols",
                        multihead_jacobian_rows(s), multihead_jacobian_cols(block, s), out);
  const Index R = jacobian_rows(s.N, s.d_v), D = s.D;
  const bool all = block == JacobianBlock::All;
  const Index q_cols = (all || block == JacobianBlock::Q) ? D * s.heads * s.d_k : 0;
  const Index k_cols = (all || block == JacobianBlock::K) ? D * s.kv_heads * s.d_k : 0;
  if (block != JacobianBlock::X) out.setZero();
  detail::JacobianParts<Scalar> jp;  // one forward pass and one set of factors per head
  Vec<Scalar> scratch;
  for (Index j = 0; j < s.heads; ++j) {
    const Index g = s.kv_of(j);
    const CRef<Scalar> wq = WQ.middleCols(j * s.d_k, s.d_k);
    const CRef<Scalar> wk = WK.middleCols(g * s.d_k, s.d_k);
    const CRef<Scalar> wv = WV.middleCols(g * s.d_v, s.d_v);
    jp.compute(X, wq, wk, wv, detail::head_options(opts, s, j), block);
    auto band = out.middleRows(j * R, R);
    if (block == JacobianBlock::X) {
      detail::write_jacobian_x<Scalar>(jp, wv, scratch, band);
      continue;
    }
    if (all || block == JacobianBlock::Q)
      detail::write_jacobian_qk<Scalar>(jp, X, true, band.middleCols(j * D * s.d_k, D * s.d_k));
    if (all || block == JacobianBlock::K)
      detail::write_jacobian_qk<Scalar>(jp, X, false,
                                        band.middleCols(q_cols + g * D * s.d_k, D * s.d_k));
    if (all || block == JacobianBlock::V)
      detail::write_jacobian_v<Scalar>(jp,
                                       band.middleCols(q_cols + k_cols + g * D * s.d_v, D * s.d_v));
  }
}

/// By-value form of multihead_jacobian.
template <typename Scalar>
Mat<Scalar> multihead_jacobian(const CRef<Scalar>& X, const CRef<Scalar>& WQ,
                               const CRef<Scalar>& WK, const CRef<Scalar>& WV,
                               const MultiHeadOptions<Scalar>& opts,
                               JacobianBlock block = JacobianBlock::All) {
  const MultiHeadShape s = opts.check("multihead_jacobian", X, WQ, WK, WV);
  Mat<Scalar> J(multihead_jacobian_rows(s), multihead_jacobian_cols(block, s));
  multihead_jacobian<Scalar>(X, WQ, WK, WV, opts, block, J);
  return J;
}

}  // namespace spectral_cond
