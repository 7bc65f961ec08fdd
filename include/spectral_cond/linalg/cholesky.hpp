// spectral_cond: the Cholesky factorisation G = L L^T of a symmetric positive definite matrix in
// place, triangular solves with its factor, and the operator y = G^{-1} x (MATH.md §12): LAPACK's
// potrf and BLAS's trsm where the build has LAPACKE (multithreaded OpenBLAS), Eigen otherwise.
#pragma once

#include "spectral_cond/core/common.hpp"

#include <Eigen/Cholesky>

#ifdef SPECTRAL_COND_HAVE_LAPACKE
#include <cblas.h>
#include <lapacke.h>
#endif

namespace spectral_cond {

namespace detail {

/// G = L L^T in place (L in the lower triangle), by LAPACK's potrf when built with LAPACKE
/// (multithreaded OpenBLAS), else Eigen's blocked LLT. False when G is not positive definite.
template <typename = void>
inline bool cholesky_in_place(Mat<double>& G) {
#ifdef SPECTRAL_COND_HAVE_LAPACKE
  const lapack_int n = static_cast<lapack_int>(G.rows());
  return LAPACKE_dpotrf(LAPACK_COL_MAJOR, 'L', n, G.data(), n) == 0;
#else
  Eigen::LLT<Eigen::Ref<Mat<double>>> llt(G);
  return llt.info() == Eigen::Success;
#endif
}

/// y = G^{-1} x = L^{-T} L^{-1} x with the factor of cholesky_in_place, for Lanczos on the
/// inverse (its largest eigenvalue is 1 / λ_min(G)).
struct CholeskyInverseOp {
  using Scalar = double;
  const Mat<double>* L;
  Index rows() const { return L->rows(); }
  Index cols() const { return L->rows(); }
  void perform_op(const double* x, double* y) const {
    Eigen::Map<Vec<double>> out(y, L->rows());
    out = Eigen::Map<const Vec<double>>(x, L->rows());
    L->triangularView<Eigen::Lower>().solveInPlace(out);
    L->triangularView<Eigen::Lower>().transpose().solveInPlace(out);
  }
};

/// B <- L^{-1} B, or L^{-T} B with `transpose`, for the lower triangular L of cholesky_in_place:
/// BLAS trsm when built with LAPACKE, else Eigen's blocked triangular solve.
template <typename = void>
inline void lower_solve(const Mat<double>& L, Mat<double>& B, bool transpose) {
#ifdef SPECTRAL_COND_HAVE_LAPACKE
  const int n = static_cast<int>(L.rows());
  cblas_dtrsm(CblasColMajor, CblasLeft, CblasLower, transpose ? CblasTrans : CblasNoTrans,
              CblasNonUnit, n, static_cast<int>(B.cols()), 1.0, L.data(), n, B.data(),
              static_cast<int>(B.rows()));
#else
  if (transpose)
    L.triangularView<Eigen::Lower>().transpose().solveInPlace(B);
  else
    L.triangularView<Eigen::Lower>().solveInPlace(B);
#endif
}

/// G^{-1} = L^{-T} L^{-1} in place, both triangles, from the factor L of cholesky_in_place
/// (LAPACK's potri with LAPACKE, else one triangular solve and a symmetric rank update). For the
/// matfree preconditioner's blocks (MATH.md §12), applied to a few columns at a time: one pass over
/// G^{-1} (multiply_columns) instead of two triangular solves, which BLAS's trsm packs afresh on
/// every call. False when L has a zero on its diagonal or the inverse is not finite.
template <typename = void>
inline bool inverse_from_cholesky(Mat<double>& G) {
  const Index n = G.rows();
#ifdef SPECTRAL_COND_HAVE_LAPACKE
  if (LAPACKE_dpotri(LAPACK_COL_MAJOR, 'L', static_cast<lapack_int>(n), G.data(),
                     static_cast<lapack_int>(n)) != 0)
    return false;
#else
  Mat<double> Li = Mat<double>::Identity(n, n);
  G.triangularView<Eigen::Lower>().solveInPlace(Li);
  G.setZero();
  G.selfadjointView<Eigen::Lower>().rankUpdate(Li.transpose());
#endif
  G.triangularView<Eigen::StrictlyUpper>() = G.transpose();
  return G.allFinite();
}

/// Y = A B (Y sized by the caller) for a square A and a B of few columns, reading A once (the
/// matfree preconditioner's inverses, MATH.md §12): A's columns are taken in turn and each adds its
/// multiples to the columns of Y (a rank-1 update), with no packing of A (which BLAS's gemm does on
/// every call and which costs as much as the product when B has 1 to 8 columns). More columns go
/// to the ordinary product.
template <typename Lhs, typename Rhs, typename Dst>
inline void multiply_columns(const Lhs& A, const Rhs& B, Dst&& Y) {
  if (B.cols() > 8) {
    Y.noalias() = A * B;
    return;
  }
  Y.setZero();
  for (Index k = 0; k < A.cols(); ++k)
    for (Index c = 0; c < B.cols(); ++c) Y.col(c) += B(k, c) * A.col(k);
}

}  // namespace detail
}  // namespace spectral_cond
