// spectral_cond: the exact Jacobian of single-head attention, assembled column by column from
// the closed form of MATH.md §3 (the paper's Theorem 3.3), and the input Jacobian J_X.
//
//   J   = [ J_Q | J_K | J_V ] = d vec(A) / d [vec W_Q ; vec W_K ; vec W_V]   (N d_v) x (2 D d_k + D
//   d_v) J_X = d vec(A) / d vec(X)                                                  (N d_v) x (N D)
//
// vec is column-major (MATH.md §1): entry (i, j) of an m x n matrix sits at i + m j, so the
// column of J for W_Q(a, b) is a + D b, and the row for A(r, e) is r + N e.
#pragma once

#include "spectral_cond/core/attention.hpp"
#include "spectral_cond/jacobian/detail/rope_columns.hpp"

namespace spectral_cond {

/// Which block of the Jacobian (MATH.md §1): All = [J_Q | J_K | J_V] (parameters), or one of
/// J_Q, J_K, J_V, or the input Jacobian J_X (not part of All).
enum class JacobianBlock { All, Q, K, V, X };

inline const char* to_string(JacobianBlock b) {
  switch (b) {
    case JacobianBlock::All:
      return "all";
    case JacobianBlock::Q:
      return "Q";
    case JacobianBlock::K:
      return "K";
    case JacobianBlock::V:
      return "V";
    case JacobianBlock::X:
      return "X";
  }
  return "unknown";
}

/// Rows of every block: N d_v (one per entry of A).
inline Index jacobian_rows(Index N, Index d_v) {
  return N * d_v;
}

/// Columns of `block`: 2 D d_k + D d_v (All), D d_k (Q, K), D d_v (V), N D (X).
inline Index jacobian_cols(JacobianBlock block, Index N, Index D, Index d_k, Index d_v) {
  switch (block) {
    case JacobianBlock::All:
      return 2 * D * d_k + D * d_v;
    case JacobianBlock::Q:
    case JacobianBlock::K:
      return D * d_k;
    case JacobianBlock::V:
      return D * d_v;
    case JacobianBlock::X:
      return N * D;
  }
  return 0;
}

namespace detail {

/// out.col(j) = vec( s (P (u_j ∘ V) - (P u_j) ∘ A) ) for the columns u_j of U (N x m), so out is
/// (N d_v) x m. This is MATH.md §3's B_b (U = K), E_a (U = X) and the F_a of J_X (U = K W_Q^T):
/// one N x N by N x (m d_v) product. `wide` and `PU` are scratch.
template <typename Scalar>
void stacked_softmax_products(const Mat<Scalar>& P, const Mat<Scalar>& V, const Mat<Scalar>& A,
                              const CRef<Scalar>& U, Scalar s, Mat<Scalar>& wide, Mat<Scalar>& PU,
                              Mat<Scalar>& out) {
  const Index N = P.rows(), dv = V.cols(), m = U.cols();
  ensure_size(wide, N, m * dv);
  for (Index j = 0; j < m; ++j) wide.middleCols(j * dv, dv) = U.col(j).asDiagonal() * V;
  ensure_size(out, N * dv, m);
  // Column block j of the N x (m d_v) product is the N x d_v matrix whose vec is out.col(j).
  Eigen::Map<Mat<Scalar>> out_wide(out.data(), N, m * dv);
  out_wide.noalias() = P * wide;
  ensure_size(PU, N, m);
  PU.noalias() = P * U;
  for (Index j = 0; j < m; ++j) {
    Eigen::Map<Mat<Scalar>> Oj(out.col(j).data(), N, dv);
    Oj -= PU.col(j).asDiagonal() * A;
    Oj *= s;
  }
}

/// The structured pieces of MATH.md §3 shared by the Jacobian and its Gram matrices. Each is
/// computed only when a block needs it. The stacked matrices carry the scale c.
template <typename Scalar>
struct JacobianParts {
  AttentionCache<Scalar> fwd;  ///< Q, K, V, P, A and c
  Scalar c = 0;
  Mat<Scalar> B;  ///< 𝔅 = c [vec B_1 … vec B_{d_k}] (with RoPE the F_b), (N d_v) x d_k
  Mat<Scalar> E;  ///< 𝔈 = c [vec E_1 … vec E_D], (N d_v) x D
  Mat<Scalar> F;  ///< c [vec F_1 … vec F_D], F_a = P (u_a ∘ V) - (P u_a) ∘ A, u_a = (K W_Q^T)[:, a]
  Mat<Scalar> PX;  ///< P X, N x D
  Mat<Scalar> Wc;  ///< c Q W_K^T, N x D (the w_a of J_X, scaled)
  Mat<Scalar> wide, PU, tmp;

  void compute(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
               const CRef<Scalar>& WV, const AttentionOptions<Scalar>& opts, JacobianBlock block) {
    attention_forward<Scalar>(X, WQ, WK, WV, opts, fwd);
    c = fwd.scale;
    const bool all = block == JacobianBlock::All;
    if (block == JacobianBlock::X && opts.rope)
      fail("attention_jacobian",
           "the closed form of J_X does not model RoPE; JacobianOp with JacobianBlock::X gives "
           "its exact products (MATH.md §10)");
    if (all || block == JacobianBlock::Q) {
      stacked_softmax_products<Scalar>(fwd.P, fwd.V, fwd.A, fwd.K, c, wide, PU, B);
      const Index N = X.rows(), dv = fwd.V.cols();
      rope_mix_query_factors<Scalar>(fwd.rope, fwd.d_k(), [&](Index b) {
        return Eigen::Map<Mat<Scalar>>(B.col(b).data(), N, dv);
      });
    }
    if ((all || block == JacobianBlock::K) && !fwd.rope.active)
      stacked_softmax_products<Scalar>(fwd.P, fwd.V, fwd.A, X, c, wide, PU, E);
    if (all || block == JacobianBlock::V || block == JacobianBlock::X) {
      ensure_size(PX, X.rows(), X.cols());
      PX.noalias() = fwd.P * X;
    }
    if (block == JacobianBlock::X) {
      ensure_size(tmp, X.rows(), X.cols());
      tmp.noalias() = fwd.K * WQ.transpose();
      stacked_softmax_products<Scalar>(fwd.P, fwd.V, fwd.A, tmp, c, wide, PU, F);
      ensure_size(Wc, X.rows(), X.cols());
      Wc.noalias() = c * (fwd.Q * WK.transpose());
    }
  }
};

/// Column of `out` as the N x d_v matrix whose vec it is.
template <typename Scalar>
Eigen::Map<Mat<Scalar>> column_as_matrix(Ref<Scalar>& out, Index j, Index N, Index dv) {
  return Eigen::Map<Mat<Scalar>>(out.col(j).data(), N, dv);
}

/// J_Q[:, a + D b] = vec(diag(x_a) 𝔅_b) and J_K[:, a + D b] = vec(diag(q_b) 𝔈_a) (MATH.md §3).
/// Each column is one streaming, vectorised write; the N x d_v factor stays in cache. With
/// RoPE, 𝔅_b is F_b and J_K's columns are rope_key_column's (two softmax products each).
template <typename Scalar>
void write_jacobian_qk(const JacobianParts<Scalar>& jp, const CRef<Scalar>& X, bool q_block,
                       Ref<Scalar> out) {
  const Index N = X.rows(), D = X.cols(), dv = jp.fwd.V.cols(), dk = jp.fwd.Q.cols();
  if (q_block) {
    for (Index b = 0; b < dk; ++b) {
      const Eigen::Map<const Mat<Scalar>> Bb(jp.B.col(b).data(), N, dv);
      for (Index a = 0; a < D; ++a)
        column_as_matrix<Scalar>(out, a + D * b, N, dv).noalias() = X.col(a).asDiagonal() * Bb;
    }
  } else if (jp.fwd.rope.active) {
    RopeColumnScratch<Scalar> s;
    for (Index b = 0; b < dk; ++b)
      for (Index a = 0; a < D; ++a)
        rope_key_column<Scalar>(jp.fwd, X.col(a), b,
                                column_as_matrix<Scalar>(out, a + D * b, N, dv), s);
  } else {
    for (Index a = 0; a < D; ++a) {
      const Eigen::Map<const Mat<Scalar>> Ea(jp.E.col(a).data(), N, dv);
      for (Index b = 0; b < dk; ++b)
        column_as_matrix<Scalar>(out, a + D * b, N, dv).noalias() =
            jp.fwd.Q.col(b).asDiagonal() * Ea;
    }
  }
}

/// J_V[:, a + D b] = e_b ⊗ (P x_a) (MATH.md §3): zero but for one segment of length N.
template <typename Scalar>
void write_jacobian_v(const JacobianParts<Scalar>& jp, Ref<Scalar> out) {
  const Index N = jp.PX.rows(), D = jp.PX.cols(), dv = jp.fwd.V.cols();
  for (Index b = 0; b < dv; ++b)
    for (Index a = 0; a < D; ++a) {
      auto col = out.col(a + D * b);
      col.head(b * N).setZero();
      col.segment(b * N, N) = jp.PX.col(a);
      col.tail((dv - 1 - b) * N).setZero();
    }
}

/// The input Jacobian, derived from MATH.md §2 with dX = e_i e_a^T (column i + N a), so that
/// dQ = e_i (W_Q)[a, :], dK = e_i (W_K)[a, :], dV = e_i (W_V)[a, :]:
///
///   J_X[:, i + N a] = vec( e_i (c F_a)[i, :] + diag(c w_a ∘ p^i) (1 v_i^T - A) + p^i (W_V)[a, :] )
///
/// with p^i = P[:, i], v_i = V[i, :], u_a = (K W_Q^T)[:, a], w_a = (Q W_K^T)[:, a] and
/// F_a = P (u_a ∘ V) - (P u_a) ∘ A. The three terms come from dQ (row i of dZ), dK (column i of
/// dZ) and dV. Building every F_a costs D products of N x N by N x d_v; each column is then one
/// vectorised pass over N x d_v plus a row update.
template <typename Scalar>
void write_jacobian_x(const JacobianParts<Scalar>& jp, const CRef<Scalar>& WV, Vec<Scalar>& s,
                      Ref<Scalar> out) {
  const Mat<Scalar>& P = jp.fwd.P;
  const Mat<Scalar>& V = jp.fwd.V;
  const Mat<Scalar>& A = jp.fwd.A;
  const Index N = P.rows(), D = jp.PX.cols(), dv = V.cols();
  ensure_size(s, N, 1);
  for (Index a = 0; a < D; ++a) {
    const Eigen::Map<const Mat<Scalar>> Fa(jp.F.col(a).data(), N, dv);
    for (Index i = 0; i < N; ++i) {
      auto M = column_as_matrix<Scalar>(out, i + N * a, N, dv);
      s = jp.Wc.col(a).cwiseProduct(P.col(i));
      for (Index e = 0; e < dv; ++e)
        M.col(e) = V(i, e) * s - s.cwiseProduct(A.col(e)) + WV(a, e) * P.col(i);
      M.row(i) += Fa.row(i);
    }
  }
}

}  // namespace detail

/// The exact Jacobian block `block` of A = softmax_row(c X W_Q (X W_K)^T + M) X W_V, written into
/// caller storage `out` (for example a Map over a memory-mapped file), which must be
/// jacobian_rows(N, d_v) x jacobian_cols(block, N, D, d_k, d_v). Parameter blocks are assembled
/// by the column formulas of MATH.md §3 (d_k + D products of N x N by N x d_v, then every
/// column written once); J_X by the formula in detail::write_jacobian_x. Scratch is
/// O(N d_v (d_k + D) + N^2); `out` is never copied.
template <typename Scalar>
void attention_jacobian(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                        const CRef<Scalar>& WV, const AttentionOptions<Scalar>& opts,
                        JacobianBlock block, Ref<Scalar> out) {
  constexpr const char* fn = "attention_jacobian";
  detail::check_attention_inputs<Scalar>(fn, X, WQ, WK, WV);
  const Index N = X.rows(), D = X.cols(), dk = WQ.cols(), dv = WV.cols();
  detail::require_shape(fn, "out", "jacobian_rows x jacobian_cols", jacobian_rows(N, dv),
                        jacobian_cols(block, N, D, dk, dv), out);
  detail::JacobianParts<Scalar> jp;
  jp.compute(X, WQ, WK, WV, opts, block);
  switch (block) {
    case JacobianBlock::All:
      detail::write_jacobian_qk<Scalar>(jp, X, true, out.leftCols(D * dk));
      detail::write_jacobian_qk<Scalar>(jp, X, false, out.middleCols(D * dk, D * dk));
      detail::write_jacobian_v<Scalar>(jp, out.rightCols(D * dv));
      break;
    case JacobianBlock::Q:
      detail::write_jacobian_qk<Scalar>(jp, X, true, out);
      break;
    case JacobianBlock::K:
      detail::write_jacobian_qk<Scalar>(jp, X, false, out);
      break;
    case JacobianBlock::V:
      detail::write_jacobian_v<Scalar>(jp, out);
      break;
    case JacobianBlock::X: {
      Vec<Scalar> s;
      detail::write_jacobian_x<Scalar>(jp, WV, s, out);
      break;
    }
  }
}

/// By-value form of attention_jacobian.
template <typename DX, typename DQ, typename DK, typename DV>
Mat<typename DX::Scalar> attention_jacobian(const Eigen::MatrixBase<DX>& X,
                                            const Eigen::MatrixBase<DQ>& WQ,
                                            const Eigen::MatrixBase<DK>& WK,
                                            const Eigen::MatrixBase<DV>& WV,
                                            const AttentionOptions<typename DX::Scalar>& opts = {},
                                            JacobianBlock block = JacobianBlock::All) {
  using Scalar = typename DX::Scalar;
  Mat<Scalar> J(jacobian_rows(X.rows(), WV.cols()),
                jacobian_cols(block, X.rows(), X.cols(), WQ.cols(), WV.cols()));
  attention_jacobian<Scalar>(X, WQ, WK, WV, opts, block, J);
  return J;
}

/// Columns of attention_bias_jacobian: 2 d_k + d_v.
inline Index bias_jacobian_cols(Index d_k, Index d_v) {
  return 2 * d_k + d_v;
}

/// The Jacobian with respect to the biases, J_b = d vec(A) / d [b_Q; b_K; b_V] (MATH.md §10),
/// (N d_v) x (2 d_k + d_v), into `out`. Each column is the weight column of MATH.md §3 with the
/// input column x_a replaced by 1 (a bias is a weight row on a constant input):
///   J_bQ[:, b] = c vec(F_b),  J_bV[:, b] = e_b ⊗ (P 1) = e_b ⊗ 1_N,
///   J_bK[:, b] = c vec(diag(q~_b) E(1) + …) = 0 exactly without RoPE, since E(1) = P V - A = 0
///   (a key bias adds a constant to each row's logits, which the softmax ignores).
/// The biases need not be set in `opts` (J_b at zero biases is the same formula).
template <typename Scalar>
void attention_bias_jacobian(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                             const CRef<Scalar>& WV, const AttentionOptions<Scalar>& opts,
                             Ref<Scalar> out) {
  constexpr const char* fn = "attention_bias_jacobian";
  detail::check_attention_inputs<Scalar>(fn, X, WQ, WK, WV);
  const Index N = X.rows(), dk = WQ.cols(), dv = WV.cols();
  detail::require_shape(fn, "out", "N d_v x (2 d_k + d_v)", jacobian_rows(N, dv),
                        bias_jacobian_cols(dk, dv), out);
  detail::JacobianParts<Scalar> jp;
  jp.compute(X, WQ, WK, WV, opts, JacobianBlock::Q);
  const Mat<Scalar> ones = Mat<Scalar>::Ones(N, 1);
  detail::write_jacobian_qk<Scalar>(jp, ones, true, out.leftCols(dk));
  if (jp.fwd.rope.active) {
    detail::write_jacobian_qk<Scalar>(jp, ones, false, out.middleCols(dk, dk));
  } else {
    out.middleCols(dk, dk).setZero();  // exactly: E(1) = P V - A = 0
  }
  jp.PX = ones;  // P 1 = 1
  detail::write_jacobian_v<Scalar>(jp, out.rightCols(dv));
}

/// By-value form of attention_bias_jacobian.
template <typename DX, typename DQ, typename DK, typename DV>
Mat<typename DX::Scalar> attention_bias_jacobian(
    const Eigen::MatrixBase<DX>& X, const Eigen::MatrixBase<DQ>& WQ,
    const Eigen::MatrixBase<DK>& WK, const Eigen::MatrixBase<DV>& WV,
    const AttentionOptions<typename DX::Scalar>& opts = {}) {
  using Scalar = typename DX::Scalar;
  Mat<Scalar> J(jacobian_rows(X.rows(), WV.cols()), bias_jacobian_cols(WQ.cols(), WV.cols()));
  attention_bias_jacobian<Scalar>(X, WQ, WK, WV, opts, J);
  return J;
}

/// Inputs in which the biases are weights: X+ = [X 1], W+ = [W; b^T] (a zero row for an absent
/// bias), and the options without biases (MATH.md §10).
template <typename Scalar>
struct BiasParameters {
  Mat<Scalar> X, WQ, WK, WV;
  AttentionOptions<Scalar> opts;
};

/// The reparametrisation X+ W+ = X W + 1 b^T that makes the biases weights: A is unchanged and
/// the parameter Jacobian of (X+, W+) is [J_W | J_b] with its columns permuted (vec W+ puts
/// b[j] at entry D + (D + 1) j), so every routine of the parameter Jacobian (J, its Gram
/// matrices, the operators, every κ(J) method) applied to the result gives the singular values,
/// κ and κ+ of J with respect to the weights and the biases together.
template <typename Scalar>
BiasParameters<Scalar> with_bias_parameters(const CRef<Scalar>& X, const CRef<Scalar>& WQ,
                                            const CRef<Scalar>& WK, const CRef<Scalar>& WV,
                                            const AttentionOptions<Scalar>& opts) {
  constexpr const char* fn = "with_bias_parameters";
  detail::check_attention_inputs<Scalar>(fn, X, WQ, WK, WV);
  opts.check_projections(fn, WQ.cols(), WK.cols(), WV.cols(), WQ.cols());
  const Index N = X.rows(), D = X.cols();
  BiasParameters<Scalar> p;
  p.X.resize(N, D + 1);
  p.X << X, Mat<Scalar>::Ones(N, 1);
  auto stack = [D](const CRef<Scalar>& W, const Vec<Scalar>& b, Mat<Scalar>& out) {
    out.resize(D + 1, W.cols());
    out.topRows(D) = W;
    if (b.size() > 0)
      out.row(D) = b.transpose();
    else
      out.row(D).setZero();
  };
  stack(WQ, opts.bias_q, p.WQ);
  stack(WK, opts.bias_k, p.WK);
  stack(WV, opts.bias_v, p.WV);
  p.opts = opts;
  p.opts.bias_q.resize(0);
  p.opts.bias_k.resize(0);
  p.opts.bias_v.resize(0);
  return p;
}

}  // namespace spectral_cond
