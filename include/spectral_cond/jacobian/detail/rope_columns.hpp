// spectral_cond: the pieces of the Jacobian's columns that RoPE changes (MATH.md §10, rope.hpp).
//
// With RoPE the cache holds Q~ and K~. A tangent dW_Q = e_a e_b^T moves row i of Q~ by
// x_a[i] (C[i, b] e_b + S[i, b] e_p)^T (p = p(b)), so MATH.md §3's columns become
//
//   J_Q[:, a + D b] = c vec( diag(x_a) F_b ),   F_b = diag(C_b) B~_b + diag(S_b) B~_p
//   J_K[:, a + D b] = c vec( diag(q~_b) E(x_a ∘ C_b) + diag(q~_p) E(x_a ∘ S_b) )
//
// with B~_b = E(k~_b) and E(y) = P (y ∘ V) - (P y) ∘ A, the response of A to the rank-one logit
// perturbation 1 y^T. J_V does not change (V is not rotated). Without RoPE, C = 1 and S = 0.
#pragma once

#include "spectral_cond/core/attention.hpp"

#include <vector>

namespace spectral_cond {
namespace detail {

/// out = P (w ∘ V) - (P w) ∘ A (N x d_v): dA for the rank-one logit perturbation u w^T with
/// u = 1, which MATH.md §3's columns scale row-wise by u. `tmp` (N x d_v) and `Pw` (N) are
/// scratch.
template <typename Scalar, typename W, typename Out>
void rank_one_logit_response(const Mat<Scalar>& P, const Mat<Scalar>& V, const Mat<Scalar>& A,
                             const W& w, Out&& out, Mat<Scalar>& tmp, Vec<Scalar>& Pw) {
  tmp.noalias() = w.asDiagonal() * V;
  out.noalias() = P * tmp;
  Pw.noalias() = P * w;
  out -= Pw.asDiagonal() * A;
}

/// Scratch of rope_key_column.
template <typename Scalar>
struct RopeColumnScratch {
  Vec<Scalar> y, Pw;
  Mat<Scalar> E, tmp;
};

/// out (N x d_v) = c [diag(q~_b) E(x ∘ C_b) + diag(q~_p) E(x ∘ S_b)]: the column of J_K for
/// the input column x (x_a, or l_k of the compressed form, or 1 for the key bias) and key
/// column b, with RoPE on (the cache's tables).
template <typename Scalar, typename X, typename Out>
void rope_key_column(const AttentionCache<Scalar>& ca, const X& x, Index b, Out&& out,
                     RopeColumnScratch<Scalar>& s) {
  const Index p = ca.rope.partner[static_cast<std::size_t>(b)];
  s.y = x.cwiseProduct(ca.rope.C.col(b));
  rank_one_logit_response(ca.P, ca.V, ca.A, s.y, s.E, s.tmp, s.Pw);
  out.noalias() = ca.scale * (ca.Q.col(b).asDiagonal() * s.E);
  if (p == b) return;  // an unrotated column: S_b = 0
  s.y = x.cwiseProduct(ca.rope.S.col(b));
  rank_one_logit_response(ca.P, ca.V, ca.A, s.y, s.E, s.tmp, s.Pw);
  out.noalias() += ca.scale * (ca.Q.col(p).asDiagonal() * s.E);
}

/// F_b = diag(C_b) B~_b + diag(S_b) B~_p for every b, in place: `block(b)` returns the
/// N x d_v view of B~_b in the caller's storage. Nothing happens without RoPE.
template <typename Scalar, typename Block>
void rope_mix_query_factors(const RopeTable<Scalar>& rope, Index d_k, Block&& block) {
  if (!rope.active) return;
  std::vector<Mat<Scalar>> orig(static_cast<std::size_t>(d_k));
  for (Index b = 0; b < d_k; ++b) orig[static_cast<std::size_t>(b)] = block(b);
  for (Index b = 0; b < d_k; ++b) {
    const Index p = rope.partner[static_cast<std::size_t>(b)];
    auto Fb = block(b);
    Fb = rope.C.col(b).asDiagonal() * orig[static_cast<std::size_t>(b)];
    if (p != b) Fb += rope.S.col(b).asDiagonal() * orig[static_cast<std::size_t>(p)];
  }
}

}  // namespace detail
}  // namespace spectral_cond
