// spectral_cond: the compressed Jacobians (MATH.md §3, "The compressed Jacobian").
//
// Parameter Jacobian. With the thin SVD X = U_X Σ_X V_X^T truncated at rank r (tolerance
// max(N, D) · ε · σ_1(X)) and L = U_X Σ_X (N x r), J = J~ T with T = blockdiag(I_{d_k} ⊗ V_X^T,
// I_{d_k} ⊗ V_X^T, I_{d_v} ⊗ V_X^T) (rows orthonormal), so J and the (N d_v) x r (2 d_k + d_v)
//   J~ = [ J~_Q | J~_K | J~_V ],   J~_Q[:, k + r b] = c vec(diag(l_k) B_b),
//                                  J~_K[:, k + r b] = c vec(diag(q_b) E~_k),
//                                  J~_V[:, k + r b] = e_b ⊗ (P l_k),
//   B_b = P (k_b ∘ V) - (P k_b) ∘ A,   E~_k = P (l_k ∘ V) - (P l_k) ∘ A
// have the same nonzero singular values and J J^T = J~ J~^T. J~ is assembled from X's SVD and
// the forward pass, never from J.
//
// Input Jacobian. dX enters A only through dX W_cat, W_cat = [W_Q | W_K | W_V] (D x s0,
// s0 = 2 d_k + d_v). With W_cat's thin SVD U_W Σ_W V_W^T truncated at rank s (tolerance
// max(D, s0) · ε · σ_1(W_cat)), dX W_cat = (dX U_W)(U_W^T W_cat), so with Y = dX U_W,
//   J_X = M (U_W^T ⊗ I_N),   M = d vec A / d vec Y   ((N d_v) x (N s)),
// and U_W^T ⊗ I_N has orthonormal rows: J_X and M have the same nonzero singular values and
// J_X J_X^T = M M^T. M is the input Jacobian of the same block with X' = X U_W and
// W'_• = U_W^T W_• (X' W'_• = X W_•). Column i + N t of M (Y = e_i e_t^T) is, with
// w_Q = W'_Q^T e_t, w_K = W'_K^T e_t, w_V = W'_V^T e_t, κ = K w_Q, ρ = Q w_K:
//   dA[i, :] += c ((p_i ∘ κ)^T V - (p_i^T κ) A[i, :])            (dQ = e_i w_Q^T)
//   dA[a, :] += c ρ_a P_ai (V[i, :] - A[a, :])   for every a    (dK = e_i w_K^T)
//   dA       += P[:, i] w_V^T                                   (dV = e_i w_V^T)
#pragma once

#include "spectral_cond/detail/instances.hpp"

#include "spectral_cond/core/attention.hpp"
#include "spectral_cond/core/common.hpp"
#include "spectral_cond/jacobian/detail/rope_columns.hpp"

#include "spectral_cond/linalg/svd.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

namespace spectral_cond {

namespace detail {

/// Thin SVD of M truncated at max(rows, cols) · ε · σ_1: returns U Σ (rows x r) and V (cols x r).
/// False, with US and V untouched, when the SVD reports a failure.
template <typename Scalar>
[[nodiscard]] bool truncated_svd(const CRef<Scalar>& M, Mat<Scalar>& US, Mat<Scalar>& V) {
  Eigen::BDCSVD<Mat<Scalar>> svd(M, Eigen::ComputeThinU | Eigen::ComputeThinV);
  if (svd.info() != Eigen::Success) return false;
  const Vec<Scalar>& s = svd.singularValues();
  const Scalar tol = s.size() > 0 ? static_cast<Scalar>(std::max(M.rows(), M.cols())) *
                                        ScalarTraits<Scalar>::eps() * s(0)
                                  : Scalar(0);
  Index r = 0;
  while (r < s.size() && s(r) > tol) ++r;
  US = svd.matrixU().leftCols(r) * s.head(r).asDiagonal();
  V = svd.matrixV().leftCols(r);
  return true;
}

template <typename Scalar>
void require_finite(const char* fn, const CRef<Scalar>& X, const CRef<Scalar>& WQ,
                    const CRef<Scalar>& WK, const CRef<Scalar>& WV) {
  if (!(X.allFinite() && WQ.allFinite() && WK.allFinite() && WV.allFinite()))
    fail(fn, "X, W_Q, W_K and W_V must be finite (got NaN or Inf)");
}

template <typename Scalar>
void check_block(const char* fn, Index j0, Index m, Index cols, Index rows,
                 const Ref<Scalar>& out) {
  if (j0 < 0 || m < 0 || j0 + m > cols) {
    std::ostringstream s;
    s << "columns [j0, j0 + m) must lie in [0, " << cols << ") (got j0 = " << j0 << ", m = " << m
      << ")";
    fail(fn, s.str());
  }
  require_shape(fn, "out", "rows() x m", rows, m, out);
}

}  // namespace detail

/// The compressed parameter Jacobian J~ of MATH.md §3: the forward pass, X's truncated SVD and
/// the N x d_v matrices B_b, E~_k, from which any column of J~ costs O(N d_v).
template <typename Scalar>
class CompressedJacobian {
 public:
  CompressedJacobian() = default;
  CompressedJacobian(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                     const CRef<Scalar>& WV, const AttentionOptions<Scalar>& opts = {}) {
    compute(X, WQ, WK, WV, opts);
  }

  /// Forward pass, X = L V_X^T, and the B_b, E~_k and P L of MATH.md §3. Cost: an SVD of X
  /// plus (d_k + r) products of N x N by N x d_v. Throws std::invalid_argument on bad shapes and
  /// std::runtime_error where the SVD of X fails.
  void compute(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
               const CRef<Scalar>& WV, const AttentionOptions<Scalar>& opts = {}) {
    attention_forward<Scalar>(X, WQ, WK, WV, opts, cache_);
    detail::require_finite<Scalar>("CompressedJacobian", X, WQ, WK, WV);
    if (!detail::truncated_svd<Scalar>(X, L_, VX_))
      throw std::runtime_error("CompressedJacobian: the SVD of X did not converge");
    D_ = X.cols();
    const Index N = X.rows(), dk = cache_.d_k(), dv = cache_.d_v(), r = L_.cols();
    const Mat<Scalar>& P = cache_.P;
    const Mat<Scalar>& V = cache_.V;
    const Mat<Scalar>& A = cache_.A;
    B_.resize(N, dk * dv);
    E_.resize(N, r * dv);
    Mat<Scalar> tmp(N, dv);
    Vec<Scalar> Pw(N);
    for (Index b = 0; b < dk; ++b)
      detail::rank_one_logit_response(P, V, A, cache_.K.col(b), B_.middleCols(b * dv, dv), tmp, Pw);
    detail::rope_mix_query_factors<Scalar>(cache_.rope, dk,
                                           [&](Index b) { return B_.middleCols(b * dv, dv); });
    if (cache_.rope.active) E_.resize(0, 0);  // J~_K's columns are formed one by one
    for (Index k = 0; k < r && !cache_.rope.active; ++k)
      detail::rank_one_logit_response(P, V, A, L_.col(k), E_.middleCols(k * dv, dv), tmp, Pw);
    PL_.noalias() = P * L_;
  }

  Index rows() const { return cache_.P.rows() * cache_.d_v(); }                 ///< N d_v
  Index cols() const { return L_.cols() * (2 * cache_.d_k() + cache_.d_v()); }  ///< r (2 d_k + d_v)
  Index rank() const { return L_.cols(); }       ///< r, the numerical rank of X
  const Mat<Scalar>& L() const { return L_; }    ///< U_X Σ_X, N x r
  const Mat<Scalar>& VX() const { return VX_; }  ///< V_X, D x r (orthonormal columns)
  const Mat<Scalar>& PL() const { return PL_; }  ///< P L, N x r (J~_V = I_{d_v} ⊗ P L)
  const AttentionCache<Scalar>& cache() const { return cache_; }
  /// Rows and columns of the uncompressed J: N d_v and D (2 d_k + d_v).
  Index full_rows() const { return rows(); }
  Index full_cols() const { return D_ * (2 * cache_.d_k() + cache_.d_v()); }

  /// Columns [j0, j0 + m) of J~ into `out` (rows() x m), nothing else formed. Allocates nothing
  /// without RoPE; with it, J~_K's columns are rope_key_column's (two softmax products each,
  /// rope_columns.hpp) and their scratch is allocated once per call.
  void columns(Index j0, Index m, Ref<Scalar> out) const {
    detail::check_block<Scalar>("CompressedJacobian::columns", j0, m, cols(), rows(), out);
    const Index N = cache_.P.rows(), dk = cache_.d_k(), dv = cache_.d_v(), r = rank();
    const Scalar c = cache_.scale;
    detail::RopeColumnScratch<Scalar> rs;
    for (Index t = 0; t < m; ++t) {
      const Index j = j0 + t;
      auto col = out.col(t);
      if (j < r * dk) {  // J~_Q: c vec(diag(l_k) B_b)
        const Index k = j % r, b = j / r;
        for (Index q = 0; q < dv; ++q)
          col.segment(q * N, N) = c * L_.col(k).cwiseProduct(B_.col(b * dv + q));
      } else if (j < 2 * r * dk) {  // J~_K: c vec(diag(q_b) E~_k)
        const Index k = (j - r * dk) % r, b = (j - r * dk) / r;
        if (cache_.rope.active) {
          detail::rope_key_column<Scalar>(cache_, L_.col(k), b,
                                          Eigen::Map<Mat<Scalar>>(col.data(), N, dv), rs);
          continue;
        }
        for (Index q = 0; q < dv; ++q)
          col.segment(q * N, N) = c * cache_.Q.col(b).cwiseProduct(E_.col(k * dv + q));
      } else {  // J~_V: e_b ⊗ (P l_k)
        const Index k = (j - 2 * r * dk) % r, b = (j - 2 * r * dk) / r;
        col.setZero();
        col.segment(b * N, N) = PL_.col(k);
      }
    }
  }

  /// The whole J~ into `out` (rows() x cols()).
  void assemble(Ref<Scalar> out) const { columns(0, cols(), out); }
  /// The whole J~, by value.
  Mat<Scalar> matrix() const {
    Mat<Scalar> J(rows(), cols());
    assemble(J);
    return J;
  }

 private:
  AttentionCache<Scalar> cache_;
  Mat<Scalar> L_, VX_, PL_;
  Mat<Scalar> B_;  ///< [B_1 … B_{d_k}], N x (d_k d_v)
  Mat<Scalar> E_;  ///< [E~_1 … E~_r], N x (r d_v)
  Index D_ = 0;
};

/// J~ of MATH.md §3 into `out` ((N d_v) x r (2 d_k + d_v)); r = rank of X, which the caller
/// can get from CompressedJacobian::rank(). Throws std::invalid_argument when `out` has another
/// shape.
template <typename Scalar>
void compressed_jacobian(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                         const CRef<Scalar>& WV, const AttentionOptions<Scalar>& opts,
                         Ref<Scalar> out) {
  const CompressedJacobian<Scalar> cj(X, WQ, WK, WV, opts);
  detail::require_shape("compressed_jacobian", "out", "N d_v x r (2 d_k + d_v)", cj.rows(),
                        cj.cols(), out);
  cj.assemble(out);
}

/// J~ of MATH.md §3, by value.
template <typename DX, typename DQ, typename DK, typename DV>
Mat<typename DX::Scalar> compressed_jacobian(
    const Eigen::MatrixBase<DX>& X, const Eigen::MatrixBase<DQ>& WQ,
    const Eigen::MatrixBase<DK>& WK, const Eigen::MatrixBase<DV>& WV,
    const AttentionOptions<typename DX::Scalar>& opts = {}) {
  using Scalar = typename DX::Scalar;
  return CompressedJacobian<Scalar>(X, WQ, WK, WV, opts).matrix();
}

/// J~ of MATH.md §3 ("The compressed Jacobian") with its query–key part reduced (used by the
/// qr method, qr_kappa.hpp): the same singular values as J with fewer columns. The reduction is
/// derived here (MATH.md does not have it); the tests check it against J built from JVPs. J~_QK = T
/// C where T maps a logit perturbation dL (N x N) to dA and C = c [K ⊗ L | (L ⊗ Q) Π] (Π the
/// vec-transpose permutation), so with K = L K^, Q = L Q^ (K^ = V_X^T W_K, Q^ = V_X^T W_Q, r x
/// d_k):
///   C C^T = c^2 (L ⊗ L) (K^K^^T ⊗ I_r + I_r ⊗ Q^Q^^T) (L ⊗ L)^T,
/// a Kronecker sum between the same factors. With the full SVDs Q^ = E_Q Σ_Q .., K^ = E_K Σ_K ..
/// (λ_Q,a = σ_Q,a^2, zero past d_k) its square root F has the columns
///   f_ab = c sqrt(λ_Q,a + λ_K,b) vec(u_a v_b^T),   u_a = L E_Q e_a,  v_b = L E_K e_b,
/// one for each pair with λ_Q,a + λ_K,b > 0: r^2 - max(0, r - d_k)^2 < 2 r d_k of them
/// (4096 instead of 8192 at N = D = d_k = d_v = 64). The logit perturbation u v^T is rank one,
/// so T f_ab = c sqrt(λ_Q,a + λ_K,b) vec(diag(u_a) B(v_b)), B(v) = P (v ∘ V) - (P v) ∘ A, as
/// for J~'s own columns. J_QK J_QK^T = T F F^T T^T exactly, so [T F | J~_V] has the singular
/// values of J. The SVDs of Q^ and K^ are backward stable, so the computed F is the exact F of
/// W_Q, W_K perturbed by O(ε) relatively: the reduction keeps the qr method's ε κ(J) accuracy.
/// Columns: [the pairs (a, b), b-major | J~_V as in CompressedJacobian].
template <typename Scalar>
class ReducedCompressedJacobian {
 public:
  ReducedCompressedJacobian() = default;
  ReducedCompressedJacobian(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                            const CRef<Scalar>& WV, const AttentionOptions<Scalar>& opts = {})
      : cj_(X, WQ, WK, WV, opts) {
    if (opts.extended())
      detail::fail("ReducedCompressedJacobian",
                   "the reduction needs Q = X W_Q and K = X W_K: without biases or RoPE (use "
                   "CompressedJacobian)");
    const AttentionCache<Scalar>& ca = cj_.cache();
    const Mat<Scalar>& L = cj_.L();
    const Index N = L.rows(), r = L.cols(), dv = ca.d_v();
    const Mat<Scalar> Qh = cj_.VX().transpose() * WQ, Kh = cj_.VX().transpose() * WK;
    Vec<Scalar> lq, lk;
    Mat<Scalar> EQ, EK;
    squared_spectrum(Qh, EQ, lq);
    squared_spectrum(Kh, EK, lk);
    U_.noalias() = L * EQ;
    Mat<Scalar> Vb = L * EK;
    Bv_.resize(N, r * dv);
    Mat<Scalar> tmp(N, dv);
    Vec<Scalar> Pw(N);
    for (Index b = 0; b < r; ++b)  // B(v_b)
      detail::rank_one_logit_response(ca.P, ca.V, ca.A, Vb.col(b), Bv_.middleCols(b * dv, dv), tmp,
                                      Pw);
    for (Index b = 0; b < r; ++b)
      for (Index a = 0; a < r; ++a) {
        const Scalar w = ca.scale * std::sqrt(lq(a) + lk(b));
        if (w > Scalar(0)) pairs_.push_back({a, b, w});
      }
  }

  Index rows() const { return cj_.rows(); }  ///< N d_v
  /// The pairs, then r d_v columns of J~_V.
  Index cols() const { return reduced_cols() + cj_.rank() * cj_.cache().d_v(); }
  Index reduced_cols() const { return static_cast<Index>(pairs_.size()); }  ///< the pairs
  Index rank() const { return cj_.rank(); }                                 ///< r = rank(X)
  const Mat<Scalar>& PL() const { return cj_.PL(); }  ///< J~_V = I_{d_v} ⊗ P L
  const CompressedJacobian<Scalar>& compressed() const { return cj_; }

  /// Columns [j0, j0 + m) into `out` (rows() x m). Allocates nothing.
  void columns(Index j0, Index m, Ref<Scalar> out) const {
    detail::check_block<Scalar>("ReducedCompressedJacobian::columns", j0, m, cols(), rows(), out);
    const Index N = U_.rows(), dv = cj_.cache().d_v(), np = reduced_cols();
    for (Index t = 0; t < m; ++t) {
      const Index j = j0 + t;
      if (j < np) {
        const Pair& p = pairs_[static_cast<std::size_t>(j)];
        for (Index q = 0; q < dv; ++q)
          out.col(t).segment(q * N, N) = p.w * U_.col(p.a).cwiseProduct(Bv_.col(p.b * dv + q));
      } else {  // J~_V's column j - np, J~'s column j - np + 2 r d_k
        cj_.columns(j - np + 2 * cj_.rank() * cj_.cache().d_k(), 1, out.col(t));
      }
    }
  }

  /// The whole matrix, by value.
  Mat<Scalar> matrix() const {
    Mat<Scalar> M(rows(), cols());
    columns(0, cols(), M);
    return M;
  }

 private:
  struct Pair {
    Index a, b;
    Scalar w;
  };
  /// M (r x d) = E diag(σ) .. with E square orthogonal (r x r); lambda = σ^2 padded with zeros.
  static void squared_spectrum(const Mat<Scalar>& M, Mat<Scalar>& E, Vec<Scalar>& lambda) {
    const Index r = M.rows();
    if (r == 0 || M.cols() == 0) {  // X = 0 (rank 0), or no columns: no pairs
      E = Mat<Scalar>::Identity(r, r);
      lambda = Vec<Scalar>::Zero(r);
      return;
    }
    Eigen::JacobiSVD<Mat<Scalar>> svd(M, Eigen::ComputeFullU);
    E = svd.matrixU();
    lambda = Vec<Scalar>::Zero(r);
    const Vec<Scalar>& s = svd.singularValues();
    lambda.head(s.size()) = s.cwiseAbs2();
  }

  CompressedJacobian<Scalar> cj_;
  Mat<Scalar> U_;   ///< L E_Q, N x r
  Mat<Scalar> Bv_;  ///< [B(v_1) … B(v_r)], N x (r d_v)
  std::vector<Pair> pairs_;
};

/// The compressed input Jacobian M of J_X = d vec A / d vec X (see the header comment):
/// (N d_v) x (N s), s = rank([W_Q | W_K | W_V]), J_X = M (U_W^T ⊗ I_N), same nonzero singular
/// values as J_X. Any column costs O(N (d_v + d_k)) after the setup.
template <typename Scalar>
class CompressedInputJacobian {
 public:
  CompressedInputJacobian() = default;
  CompressedInputJacobian(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                          const CRef<Scalar>& WV, const AttentionOptions<Scalar>& opts = {}) {
    compute(X, WQ, WK, WV, opts);
  }

  /// Forward pass, W_cat's truncated SVD, and κ = K W'_Q^T, ρ = Q W'_K^T for every t.
  void compute(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
               const CRef<Scalar>& WV, const AttentionOptions<Scalar>& opts = {}) {
    if (opts.rope)
      detail::fail("CompressedInputJacobian",
                   "the closed form of J_X does not model RoPE; JacobianOp with "
                   "JacobianBlock::X gives its exact products (MATH.md §10)");
    attention_forward<Scalar>(X, WQ, WK, WV, opts, cache_);
    detail::require_finite<Scalar>("CompressedInputJacobian", X, WQ, WK, WV);
    const Index D = X.cols(), dk = WQ.cols(), dv = WV.cols();
    Mat<Scalar> Wcat(D, 2 * dk + dv);
    Wcat << WQ, WK, WV;
    Mat<Scalar> SV;  // Σ_W V_W^T appears as (V_W Σ_W)^T of the SVD of W_cat^T
    if (!detail::truncated_svd<Scalar>(Wcat.transpose(), SV, UW_))  // W_cat^T = (V_W Σ_W) U_W^T
      throw std::runtime_error(
          "CompressedInputJacobian: the SVD of [W_Q, W_K, W_V] did not converge");
    WQr_ = SV.topRows(dk).transpose();               // U_W^T W_Q, s x d_k
    WKr_ = SV.middleRows(dk, dk).transpose();        // U_W^T W_K
    WVr_ = SV.bottomRows(dv).transpose();            // U_W^T W_V, s x d_v
    kappa_.noalias() = cache_.K * WQr_.transpose();  // N x s: K w_Q for every t
    rho_.noalias() = cache_.Q * WKr_.transpose();    // N x s: Q w_K for every t
    PT_ = cache_.P.transpose();
  }

  Index rows() const { return cache_.P.rows() * cache_.d_v(); }  ///< N d_v
  Index cols() const { return cache_.P.rows() * UW_.cols(); }    ///< N s
  Index rank() const { return UW_.cols(); }                      ///< s = rank(W_cat)
  const Mat<Scalar>& UW() const { return UW_; }  ///< U_W, D x s (orthonormal columns)
  const AttentionCache<Scalar>& cache() const { return cache_; }

  /// Columns [j0, j0 + m) of M into `out` (rows() x m), nothing else formed. Allocates nothing.
  void columns(Index j0, Index m, Ref<Scalar> out) const {
    detail::check_block<Scalar>("CompressedInputJacobian::columns", j0, m, cols(), rows(), out);
    const Index N = cache_.P.rows(), dv = cache_.d_v();
    const Scalar c = cache_.scale;
    const Mat<Scalar>& P = cache_.P;
    const Mat<Scalar>& V = cache_.V;
    const Mat<Scalar>& A = cache_.A;
    for (Index u = 0; u < m; ++u) {
      const Index i = (j0 + u) % N, t = (j0 + u) / N;
      Eigen::Map<Mat<Scalar>> dA(out.col(u).data(), N, dv);
      dA.noalias() = P.col(i) * WVr_.row(t);  // dV = e_i w_V^T: P[:, i] w_V^T
      for (Index q = 0; q < dv; ++q) {        // dK = e_i w_K^T: c ρ_a P_ai (V_iq - A_aq)
        for (Index a = 0; a < N; ++a) dA(a, q) += c * rho_(a, t) * P(a, i) * (V(i, q) - A(a, q));
      }
      // dQ = e_i w_Q^T: row i gets c ((p_i ∘ κ)^T V - (p_i^T κ) A[i, :])
      const Scalar pk = PT_.col(i).dot(kappa_.col(t));
      for (Index q = 0; q < dv; ++q)
        dA(i, q) += c * (PT_.col(i).cwiseProduct(kappa_.col(t)).dot(V.col(q)) - pk * A(i, q));
    }
  }

  void assemble(Ref<Scalar> out) const { columns(0, cols(), out); }
  Mat<Scalar> matrix() const {
    Mat<Scalar> M(rows(), cols());
    assemble(M);
    return M;
  }

 private:
  AttentionCache<Scalar> cache_;
  Mat<Scalar> UW_, WQr_, WKr_, WVr_, kappa_, rho_, PT_;
};

/// The compressed input Jacobian M (see CompressedInputJacobian), by value.
template <typename DX, typename DQ, typename DK, typename DV>
Mat<typename DX::Scalar> compressed_input_jacobian(
    const Eigen::MatrixBase<DX>& X, const Eigen::MatrixBase<DQ>& WQ,
    const Eigen::MatrixBase<DK>& WK, const Eigen::MatrixBase<DV>& WV,
    const AttentionOptions<typename DX::Scalar>& opts = {}) {
  using Scalar = typename DX::Scalar;
  return CompressedInputJacobian<Scalar>(X, WQ, WK, WV, opts).matrix();
}

}  // namespace spectral_cond
SPECTRAL_COND_DECLARE_EXTERN(compressed)
