// spectral_cond: the Gram matrices of the attention Jacobian without forming J (MATH.md §3).
//
//   attention_gram:   G = J J^T, (N d_v) x (N d_v), for any block (wide J: its eigenvalues are
//                     the squared singular values of J)
//   attention_normal: J^T J, cols x cols, for any block (tall J: N d_v > cols)
//
// Squaring costs accuracy: σ_min from either has relative error about ε κ(J)^2 (MATH.md §3).
#pragma once

#include "spectral_cond/jacobian/compressed.hpp"
#include "spectral_cond/jacobian/jacobian.hpp"

namespace spectral_cond {

namespace detail {

/// out (+)= (1 1^T ⊗ S) ∘ (Z Z^T) for Z (N d_v) x m and S N x N (MATH.md §3), on the lower
/// block triangle of d_v x d_v blocks of size N x N (mirror_lower fills the rest). One product
/// of (N d_v - e N) x m by m x N per block column e: O((N d_v)^2 m / 2) in all. `T` is scratch.
template <typename Scalar>
void add_tiled_gram(const Mat<Scalar>& Z, const Mat<Scalar>& S, Index N, bool accumulate,
                    Mat<Scalar>& T, Ref<Scalar> out) {
  const Index R = Z.rows(), dv = R / N;
  ensure_size(T, R, N);
  for (Index e2 = 0; e2 < dv; ++e2) {
    const Index rows = R - e2 * N;
    T.topRows(rows).noalias() = Z.bottomRows(rows) * Z.middleRows(e2 * N, N).transpose();
    for (Index e = e2; e < dv; ++e) {
      auto blk = out.block(e * N, e2 * N, N, N);
      if (accumulate)
        blk.array() += S.array() * T.middleRows((e - e2) * N, N).array();
      else
        blk.array() = S.array() * T.middleRows((e - e2) * N, N).array();
    }
  }
}

/// Copies the lower block triangle (blocks of N x N) of the symmetric `out` to the upper one.
template <typename Scalar>
void mirror_lower(Index N, Ref<Scalar> out) {
  const Index dv = out.rows() / N;
  for (Index e2 = 0; e2 < dv; ++e2)
    for (Index e = e2 + 1; e < dv; ++e)
      out.block(e2 * N, e * N, N, N) = out.block(e * N, e2 * N, N, N).transpose();
}

/// J_X J_X^T (MATH.md §3 extended to the input). Each of the three terms of J_X (see
/// detail::write_jacobian_x) is a row-wise Kronecker product, J_X = Σ_s α_s • β_s with rows
/// ρ = (r, e) and columns (i, a):
///   α_1 = c 𝔉,            β_1[(r,e), i] = δ_ri
///   α_2 = 1 ⊗ c Q W_K^T,  β_2[(r,e), i] = 𝒬[(r,e), i] = P[r,i] (V[i,e] - A[r,e])
///   α_3[(r,e), a] = W_V[a,e], β_3[(r,e), i] = P[r,i]
/// so J_X J_X^T = Σ_{s,t} (α_s α_t^T) ∘ (β_s β_t^T). The only large product is 𝒬 𝒬^T, of
/// (N d_v) x N by N x (N d_v); every other factor is (N d_v) x N or smaller, so the cost is
/// O((N d_v)^2 N + N d_v^2 D) and J_X (N d_v x N D) is never formed.
template <typename Scalar>
void gram_input(const JacobianParts<Scalar>& jp, const CRef<Scalar>& WV, Ref<Scalar> out) {
  const Mat<Scalar>& P = jp.fwd.P;
  const Mat<Scalar>& V = jp.fwd.V;
  const Mat<Scalar>& A = jp.fwd.A;
  const Index N = P.rows(), dv = V.cols(), R = N * dv;
  Mat<Scalar> Qs(R, N);  // 𝒬
  for (Index e = 0; e < dv; ++e)
    for (Index i = 0; i < N; ++i)
      Qs.col(i).segment(e * N, N) =
          P.col(i).cwiseProduct(V(i, e) * Vec<Scalar>::Ones(N) - A.col(e));
  const Mat<Scalar> QsT = Qs.transpose();
  const Mat<Scalar> PT = P.transpose();
  const Mat<Scalar> WW = jp.Wc * jp.Wc.transpose();                       // α_2 α_2^T
  const Mat<Scalar> VV = WV.transpose() * WV;                             // α_3 α_3^T
  const Mat<Scalar> PP = P * PT;                                          // β_3 β_3^T
  const Mat<Scalar> FW = jp.F * jp.Wc.transpose(), FWT = FW.transpose();  // α_1 α_2^T
  const Mat<Scalar> FV = jp.F * WV;                                       // α_1 α_3^T
  const Mat<Scalar> WcV = jp.Wc * WV;                                     // α_2 α_3^T
  const Mat<Scalar> QP = Qs * PT, QPT = QP.transpose();                   // β_2 β_3^T
  const Mat<Scalar> FT = jp.F.transpose();
  out.noalias() = Qs * QsT;  // β_2 β_2^T
  for (Index e2 = 0; e2 < dv; ++e2)
    for (Index r2 = 0; r2 < N; ++r2) {
      const Index rho2 = r2 + N * e2;
      for (Index e = 0; e < dv; ++e) {
        auto seg = out.col(rho2).segment(e * N, N);
        seg = WW.col(r2).cwiseProduct(seg) + VV(e, e2) * PP.col(r2) +
              FW.col(r2).segment(e * N, N).cwiseProduct(QsT.col(rho2)) +
              FWT.col(rho2).cwiseProduct(Qs.col(r2).segment(e * N, N)) +
              FV.col(e2).segment(e * N, N).cwiseProduct(PT.col(r2)) + FV(rho2, e) * P.col(r2) +
              WcV.col(e2).cwiseProduct(QP.col(r2).segment(e * N, N)) + WcV(r2, e) * QPT.col(rho2);
        seg(r2) += FT.col(r2 + N * e).dot(FT.col(rho2));  // α_1 α_1^T ∘ β_1 β_1^T
      }
    }
  for (Index j = 0; j < R; ++j)  // exactly symmetric: average the two rounded triangles
    for (Index i = j + 1; i < R; ++i) out(i, j) = out(j, i) = (out(i, j) + out(j, i)) / Scalar(2);
}

/// J_X^T J_X, accumulated over the d_v row blocks R_e (N x N D; rows (·, e)) of J_X:
/// J_X^T J_X = Σ_e R_e^T R_e. This goes through blocks (it never holds more than N x N D of
/// J_X but costs what J_X^T J_X from J_X costs, O(N d_v (N D)^2)): unlike the parameter blocks,
/// the columns of J_X mix three terms without a shared row factor to contract first.
template <typename Scalar>
void normal_input(const JacobianParts<Scalar>& jp, const CRef<Scalar>& WV, Ref<Scalar> out) {
  const Mat<Scalar>& P = jp.fwd.P;
  const Index N = P.rows(), D = jp.PX.cols(), dv = jp.fwd.V.cols();
  Mat<Scalar> Re(N, N * D);
  out.setZero();
  for (Index e = 0; e < dv; ++e) {
    for (Index a = 0; a < D; ++a)
      for (Index i = 0; i < N; ++i) {
        auto col = Re.col(i + N * a);
        col = jp.Wc.col(a).cwiseProduct(P.col(i)).cwiseProduct(
                  jp.fwd.V(i, e) * Vec<Scalar>::Ones(N) - jp.fwd.A.col(e)) +
              WV(a, e) * P.col(i);
        col(i) += jp.F(i + N * e, a);
      }
    out.template selfadjointView<Eigen::Lower>().rankUpdate(Re.transpose());
  }
  for (Index j = 1; j < out.cols(); ++j) out.col(j).head(j) = out.row(j).head(j).transpose();
}

/// J_K J_K^T = J~_K J~_K^T with RoPE (MATH.md §10), into `out` (overwritten, both triangles):
/// the structured form (1 1^T ⊗ Q Q^T) ∘ (𝔈 𝔈^T) needs J_K's columns to share the row factor
/// diag(q_b), which RoPE breaks (each column mixes q~_b and q~_p). J~_K's r d_k columns are
/// streamed in blocks into a symmetric rank update: O((N d_v)^2 r d_k) time, one block of
/// memory beyond `out`.
template <typename Scalar>
void rope_key_gram(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                   const CRef<Scalar>& WV, const AttentionOptions<Scalar>& opts, Ref<Scalar> out) {
  const CompressedJacobian<Scalar> cj(X, WQ, WK, WV, opts);
  const Index R = cj.rows(), n = cj.rank() * cj.cache().d_k(), step = 256;
  out.setZero();
  Mat<Scalar> blk(R, std::min(step, std::max<Index>(n, 1)));
  for (Index j = 0; j < n; j += step) {
    const Index m = std::min(step, n - j);
    cj.columns(n + j, m, blk.leftCols(m));
    out.template selfadjointView<Eigen::Lower>().rankUpdate(blk.leftCols(m));
  }
  out.template triangularView<Eigen::StrictlyUpper>() = out.transpose();
}

/// J^T J for the parameter blocks from the structured factors, never forming J. With column
/// a + D b inside each block, 𝔅_b = column b of 𝔅 as N x d_v, 𝔈^(e) = rows (·, e) of 𝔈 (N x D):
///   QQ (b,b') = X^T diag(Σ_e 𝔅_b[:,e] ∘ 𝔅_b'[:,e]) X
///   KK (b,b') = Σ_r Q[r,b] Q[r,b'] S_r,  S_r = 𝔈_r^T 𝔈_r (𝔈_r: rows (r, ·) of 𝔈, d_v x D)
///   QK (b,b') = X^T diag(q_b') H_b,      H_b = Σ_e diag(𝔅_b[:,e]) 𝔈^(e)   (N x D)
///   QV (b,b') = X^T diag(𝔅_b[:,b']) P X,  KV (b,b') = 𝔈^(b')^T diag(q_b) P X
///   VV        = I_{d_v} ⊗ (P X)^T P X
/// Cost O(N D^2 (d_k + d_v)^2 + N d_v D^2): about d_v times less than J^T J from J.
template <typename Scalar>
void normal_params(const JacobianParts<Scalar>& jp, const CRef<Scalar>& X, JacobianBlock block,
                   Ref<Scalar> out) {
  const Mat<Scalar>& Q = jp.fwd.Q;
  const Index N = X.rows(), D = X.cols(), dk = Q.cols(), dv = jp.fwd.V.cols();
  const bool all = block == JacobianBlock::All, wq = all || block == JacobianBlock::Q,
             wk = all || block == JacobianBlock::K, wv = all || block == JacobianBlock::V;
  const Index oQ = 0, oK = wq ? D * dk : 0, oV = (wq ? D * dk : 0) + (wk ? D * dk : 0);
  out.setZero();
  Mat<Scalar> T(N, D);
  Vec<Scalar> t(N);
  if (wq)  // QQ
    for (Index b = 0; b < dk; ++b)
      for (Index b2 = 0; b2 < dk; ++b2) {
        t.setZero();
        for (Index e = 0; e < dv; ++e)
          t += jp.B.col(b).segment(e * N, N).cwiseProduct(jp.B.col(b2).segment(e * N, N));
        T.noalias() = t.asDiagonal() * X;
        out.block(oQ + D * b, oQ + D * b2, D, D).noalias() = X.transpose() * T;
      }
  if (wk) {  // KK through 𝒮 = [vec S_1 … vec S_N] (D^2 x N)
    Mat<Scalar> S(D * D, N), QQb(N, dk), Y(D * D, dk);
    const Index R = N * dv;
    for (Index r = 0; r < N; ++r) {
      const Eigen::Map<const Mat<Scalar>, 0, Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>> Er(
          jp.E.data() + r, dv, D, Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>(R, N));
      Eigen::Map<Mat<Scalar>>(S.col(r).data(), D, D).noalias() = Er.transpose() * Er;
    }
    for (Index b = 0; b < dk; ++b) {
      QQb.noalias() = Q.col(b).asDiagonal() * Q;
      Y.noalias() = S * QQb;
      for (Index b2 = 0; b2 < dk; ++b2)
        out.block(oK + D * b, oK + D * b2, D, D) =
            Eigen::Map<const Mat<Scalar>>(Y.col(b2).data(), D, D);
    }
  }
  if (wq && wk)  // QK and its transpose KQ
    for (Index b = 0; b < dk; ++b) {
      Mat<Scalar> H = Mat<Scalar>::Zero(N, D);
      for (Index e = 0; e < dv; ++e)
        H += jp.B.col(b).segment(e * N, N).asDiagonal() * jp.E.middleRows(e * N, N);
      for (Index b2 = 0; b2 < dk; ++b2) {
        T.noalias() = Q.col(b2).asDiagonal() * H;
        out.block(oQ + D * b, oK + D * b2, D, D).noalias() = X.transpose() * T;
        out.block(oK + D * b2, oQ + D * b, D, D) =
            out.block(oQ + D * b, oK + D * b2, D, D).transpose();
      }
    }
  if (wq && wv)  // QV and VQ
    for (Index b = 0; b < dk; ++b)
      for (Index b2 = 0; b2 < dv; ++b2) {
        T.noalias() = jp.B.col(b).segment(b2 * N, N).asDiagonal() * jp.PX;
        out.block(oQ + D * b, oV + D * b2, D, D).noalias() = X.transpose() * T;
        out.block(oV + D * b2, oQ + D * b, D, D) =
            out.block(oQ + D * b, oV + D * b2, D, D).transpose();
      }
  if (wk && wv)  // KV and VK
    for (Index b = 0; b < dk; ++b)
      for (Index b2 = 0; b2 < dv; ++b2) {
        T.noalias() = Q.col(b).asDiagonal() * jp.PX;
        out.block(oK + D * b, oV + D * b2, D, D).noalias() =
            jp.E.middleRows(b2 * N, N).transpose() * T;
        out.block(oV + D * b2, oK + D * b, D, D) =
            out.block(oK + D * b, oV + D * b2, D, D).transpose();
      }
  if (wv) {  // VV
    const Mat<Scalar> G = jp.PX.transpose() * jp.PX;
    for (Index b = 0; b < dv; ++b) out.block(oV + D * b, oV + D * b, D, D) = G;
  }
}

}  // namespace detail

/// G = J J^T of block `block` (N d_v x N d_v, MATH.md §3) without forming J, into `out`
/// (with RoPE, J_K J_K^T has no such structure and comes from the columns of J~_K, see
/// detail::rope_key_gram):
///   All: c^2 [ (1 1^T ⊗ X X^T) ∘ (𝔅 𝔅^T) + (1 1^T ⊗ Q Q^T) ∘ (𝔈 𝔈^T) ] + I_{d_v} ⊗ (P X X^T P^T)
///   Q, K, V: the corresponding single term (J_Q J_Q^T, J_K J_K^T, J_V J_V^T);
///   X: J_X J_X^T by the expansion in detail::gram_input.
/// Time O((N d_v)^2 (D + d_k)) (X: O((N d_v)^2 N)), memory O((N d_v)^2) (`out`) plus
/// O(N d_v (N + D + d_k)) scratch.
template <typename Scalar>
void attention_gram(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                    const CRef<Scalar>& WV, const AttentionOptions<Scalar>& opts,
                    JacobianBlock block, Ref<Scalar> out) {
  constexpr const char* fn = "attention_gram";
  detail::check_attention_inputs<Scalar>(fn, X, WQ, WK, WV);
  const Index N = X.rows(), R = jacobian_rows(N, WV.cols());
  detail::require_shape(fn, "out", "N d_v x N d_v", R, R, out);
  detail::JacobianParts<Scalar> jp;
  jp.compute(X, WQ, WK, WV, opts, block);
  if (block == JacobianBlock::X) {
    detail::gram_input<Scalar>(jp, WV, out);
    return;
  }
  const bool all = block == JacobianBlock::All;
  bool written = false;
  Mat<Scalar> T;
  if ((all || block == JacobianBlock::K) && jp.fwd.rope.active) {
    detail::rope_key_gram<Scalar>(X, WQ, WK, WV, opts, out);
    written = true;
  }
  if (all || block == JacobianBlock::Q) {
    const Mat<Scalar> XX = X * X.transpose();
    detail::add_tiled_gram<Scalar>(jp.B, XX, N, written, T, out);
    written = true;
  }
  if ((all || block == JacobianBlock::K) && !jp.fwd.rope.active) {
    const Mat<Scalar> QQ = jp.fwd.Q * jp.fwd.Q.transpose();
    detail::add_tiled_gram<Scalar>(jp.E, QQ, N, written, T, out);
    written = true;
  }
  if (written) detail::mirror_lower<Scalar>(N, out);
  if (all || block == JacobianBlock::V) {
    const Mat<Scalar> PXXP = jp.PX * jp.PX.transpose();
    if (!written) out.setZero();
    for (Index e = 0; e < WV.cols(); ++e) out.block(e * N, e * N, N, N) += PXXP;
  }
}

/// By-value form of attention_gram.
template <typename DX, typename DQ, typename DK, typename DV>
Mat<typename DX::Scalar> attention_gram(const Eigen::MatrixBase<DX>& X,
                                        const Eigen::MatrixBase<DQ>& WQ,
                                        const Eigen::MatrixBase<DK>& WK,
                                        const Eigen::MatrixBase<DV>& WV,
                                        const AttentionOptions<typename DX::Scalar>& opts = {},
                                        JacobianBlock block = JacobianBlock::All) {
  using Scalar = typename DX::Scalar;
  const Index R = jacobian_rows(X.rows(), WV.cols());
  Mat<Scalar> G(R, R);
  attention_gram<Scalar>(X, WQ, WK, WV, opts, block, G);
  return G;
}

/// The normal matrix J^T J of block `block` (cols x cols, cols = jacobian_cols(block, …)),
/// without forming J: the one to use when J is tall (N d_v > cols), where J J^T is larger and
/// rank-deficient. Parameter blocks come from the structured factors (detail::normal_params,
/// about d_v times cheaper than from J); X goes through row blocks of J_X (detail::normal_input).
/// With RoPE, J_K's blocks come from the assembled J (cols x rows doubles: what a tall J costs).
template <typename Scalar>
void attention_normal(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                      const CRef<Scalar>& WV, const AttentionOptions<Scalar>& opts,
                      JacobianBlock block, Ref<Scalar> out) {
  constexpr const char* fn = "attention_normal";
  detail::check_attention_inputs<Scalar>(fn, X, WQ, WK, WV);
  const Index C = jacobian_cols(block, X.rows(), X.cols(), WQ.cols(), WV.cols());
  detail::require_shape(fn, "out", "cols x cols", C, C, out);
  detail::JacobianParts<Scalar> jp;
  jp.compute(X, WQ, WK, WV, opts, block);
  if (block == JacobianBlock::X) {
    detail::normal_input<Scalar>(jp, WV, out);
  } else if (jp.fwd.rope.active && (block == JacobianBlock::All || block == JacobianBlock::K)) {
    // RoPE breaks the shared row factor diag(q_b) of J_K's columns that the structured blocks
    // KK, QK and KV use (rope_key_gram): J^T J from J itself.
    const Mat<Scalar> J = attention_jacobian(X, WQ, WK, WV, opts, block);
    out.setZero();
    out.template selfadjointView<Eigen::Lower>().rankUpdate(J.transpose());
    out.template triangularView<Eigen::StrictlyUpper>() = out.transpose();
  } else {
    detail::normal_params<Scalar>(jp, X, block, out);
  }
}

/// By-value form of attention_normal.
template <typename DX, typename DQ, typename DK, typename DV>
Mat<typename DX::Scalar> attention_normal(const Eigen::MatrixBase<DX>& X,
                                          const Eigen::MatrixBase<DQ>& WQ,
                                          const Eigen::MatrixBase<DK>& WK,
                                          const Eigen::MatrixBase<DV>& WV,
                                          const AttentionOptions<typename DX::Scalar>& opts = {},
                                          JacobianBlock block = JacobianBlock::All) {
  using Scalar = typename DX::Scalar;
  const Index C = jacobian_cols(block, X.rows(), X.cols(), WQ.cols(), WV.cols());
  Mat<Scalar> G(C, C);
  attention_normal<Scalar>(X, WQ, WK, WV, opts, block, G);
  return G;
}

}  // namespace spectral_cond
