// spectral_cond: attention on given Q, K, V (MATH.md §2). Shared by the single-head and
// multi-head layers; all buffers come from the caller.
#pragma once

#include "spectral_cond/core/common.hpp"

namespace spectral_cond {
namespace detail {

/// Every entry finite or -inf, and every row with at least one finite entry.
template <typename Scalar>
void check_additive_mask(const char* fn, const Mat<Scalar>& M) {
  const Index N = M.rows();
  for (Index i = 0; i < N; ++i) {
    bool any_finite = false;
    for (Index j = 0; j < N; ++j) {
      const Scalar m = M(i, j);
      if (Eigen::numext::isnan(m) || m == ScalarTraits<Scalar>::inf()) {
        std::ostringstream s;
        s << "additive_mask entry (" << i << ", " << j << ") is " << m
          << "; expected a finite value or -inf";
        fail(fn, s.str());
      }
      any_finite = any_finite || Eigen::numext::isfinite(m);
    }
    if (!any_finite) {
      std::ostringstream s;
      s << "additive_mask row " << i << " is fully masked (every entry -inf)";
      fail(fn, s.str());
    }
  }
}

/// In place: P <- softmax_row(P + M), max-subtracted so that logits of any finite magnitude
/// give finite probabilities. `rowbuf` is scratch of length N.
template <typename Scalar, typename DerivedP>
void softmax_rows_inplace(Eigen::MatrixBase<DerivedP>& P, MaskKind mask, const Mat<Scalar>* M,
                          Vec<Scalar>& rowbuf) {
  const Index N = P.rows();
  if (mask == MaskKind::Causal) {
    for (Index j = 1; j < P.cols(); ++j)
      P.col(j).head(std::min(j, N)).setConstant(-ScalarTraits<Scalar>::inf());
  } else if (mask == MaskKind::Additive) {
    P += *M;
  }
  ensure_size(rowbuf, N, 1);
  rowbuf.noalias() = P.rowwise().maxCoeff();
  P.derived().array().colwise() -= rowbuf.array();
  P.derived().array() = P.derived().array().exp();
  rowbuf.noalias() = P.rowwise().sum();
  rowbuf = rowbuf.cwiseInverse();
  P.derived() = rowbuf.asDiagonal() * P.derived();
}

/// P = softmax_row(c Q K^T + M), A = P V.
template <typename Scalar>
void forward_qkv(const CRef<Scalar>& Q, const CRef<Scalar>& K, const CRef<Scalar>& V, Scalar c,
                 MaskKind mask, const Mat<Scalar>* M, Mat<Scalar>& P, Ref<Scalar> A,
                 Vec<Scalar>& rowbuf) {
  const Index N = Q.rows();
  ensure_size(P, N, N);
  P.noalias() = c * (Q * K.transpose());
  softmax_rows_inplace<Scalar>(P, mask, M, rowbuf);
  A.noalias() = P * V;
}

/// dA = dP V + P dV with dP = P ∘ (dZ - rowsum(P ∘ dZ) 1^T), dZ = c (dQ K^T + Q dK^T).
/// An empty (0 x 0) tangent is zero. `NxN` and `r` are scratch.
template <typename Scalar>
void jvp_qkv(const CRef<Scalar>& Q, const CRef<Scalar>& K, const CRef<Scalar>& V,
             const CRef<Scalar>& P, Scalar c, const CRef<Scalar>& dQ, const CRef<Scalar>& dK,
             const CRef<Scalar>& dV, Mat<Scalar>& NxN, Vec<Scalar>& r, Ref<Scalar> dA) {
  const Index N = Q.rows();
  const bool hq = dQ.size() > 0, hk = dK.size() > 0, hv = dV.size() > 0;
  if (hq || hk) {
    ensure_size(NxN, N, N);
    ensure_size(r, N, 1);
    if (hq && hk) {
      NxN.noalias() = dQ * K.transpose();
      NxN.noalias() += Q * dK.transpose();
    } else if (hq) {
      NxN.noalias() = dQ * K.transpose();
    } else {
      NxN.noalias() = Q * dK.transpose();
    }
    NxN.array() *= P.array();           // P ∘ dZ / c
    r.noalias() = NxN.rowwise().sum();  // rowsum(P ∘ dZ) / c
    NxN -= r.asDiagonal() * P;          // P ∘ (dZ - rowsum(P ∘ dZ) 1^T) / c
    NxN *= c;
    dA.noalias() = NxN * V;
    if (hv) dA.noalias() += P * dV;
  } else if (hv) {
    dA.noalias() = P * dV;
  } else {
    dA.setZero();
  }
}

/// Cotangents of Q, K, V for G = dL/dA (MATH.md §2). With `accumulate`, gK and gV are added to
/// (grouped-query heads share K and V). `NxN` and `r` are scratch.
template <typename Scalar>
void vjp_qkv(const CRef<Scalar>& Q, const CRef<Scalar>& K, const CRef<Scalar>& V,
             const CRef<Scalar>& P, Scalar c, const CRef<Scalar>& G, Mat<Scalar>& NxN,
             Vec<Scalar>& r, Ref<Scalar> gQ, Ref<Scalar> gK, Ref<Scalar> gV, bool accumulate) {
  const Index N = Q.rows();
  ensure_size(NxN, N, N);
  ensure_size(r, N, 1);
  if (accumulate)
    gV.noalias() += P.transpose() * G;
  else
    gV.noalias() = P.transpose() * G;
  NxN.noalias() = G * V.transpose();                  // dL/dP
  r.noalias() = P.cwiseProduct(NxN).rowwise().sum();  // rowsum(P ∘ dL/dP)
  NxN.colwise() -= r;
  NxN.array() *= P.array();  // dL/dZ
  gQ.noalias() = c * (NxN * K);
  if (accumulate)
    gK.noalias() += c * (NxN.transpose() * Q);
  else
    gK.noalias() = c * (NxN.transpose() * Q);
}

}  // namespace detail
}  // namespace spectral_cond
