// spectral_cond: the dense SVDs every condition number and correction goes through (MATH.md §4):
// Eigen's JacobiSVD and BDCSVD, and LAPACK's ?gesdd where the build defines
// SPECTRAL_COND_HAVE_LAPACKE (CMake option SPECTRAL_COND_USE_LAPACK). Each is backward stable:
// every σ_i carries an absolute error of about ε σ_1.
#pragma once

#include "spectral_cond/detail/instances.hpp"

#include "spectral_cond/core/common.hpp"

#include <Eigen/SVD>

#include <algorithm>
#include <limits>
#include <string>
#include <type_traits>

#ifdef SPECTRAL_COND_HAVE_LAPACKE
#include <cblas.h>
#include <lapacke.h>
#endif

namespace spectral_cond {

/// The dense SVD that computes the singular values.
enum class SvdMethod {
  Auto,  ///< Jacobi when min(m, n) <= auto_jacobi_max_size, else gesdd if built with LAPACKE, else
         ///< BDC
  Jacobi,  ///< Eigen::JacobiSVD (one-sided Jacobi after a QR): slow, the most accurate
  BDC,     ///< Eigen::BDCSVD (bidiagonal divide and conquer): fast for large matrices
  Lapack,  ///< LAPACK ?gesdd through LAPACKE; falls back to BDC (with a note) when not built in
};

inline const char* to_string(SvdMethod m) {
  switch (m) {
    case SvdMethod::Auto:
      return "auto";
    case SvdMethod::Jacobi:
      return "jacobi";
    case SvdMethod::BDC:
      return "bdc";
    case SvdMethod::Lapack:
      return "lapack";
  }
  return "unknown";
}

/// SvdMethod::Auto uses JacobiSVD up to this min(m, n), a faster method above.
inline constexpr Index auto_jacobi_max_size = 64;

/// True when the build links LAPACKE (CMake option SPECTRAL_COND_USE_LAPACK).
inline constexpr bool have_lapacke() {
#ifdef SPECTRAL_COND_HAVE_LAPACKE
  return true;
#else
  return false;
#endif
}

namespace detail {

#ifdef SPECTRAL_COND_HAVE_LAPACKE
/// Singular values by ?gesdd (jobz = 'N'); returns LAPACK's info (> 0: no convergence).
template <typename Scalar>
lapack_int lapack_singular_values(const CRef<Scalar>& M, Vec<Scalar>& s) {
  Mat<Scalar> a = M;  // gesdd overwrites its input
  const lapack_int m = static_cast<lapack_int>(a.rows()), n = static_cast<lapack_int>(a.cols());
  s.resize(std::min(a.rows(), a.cols()));
  Scalar u = 0, vt = 0;  // not referenced for jobz = 'N'
  if constexpr (std::is_same<Scalar, double>::value) {
    return LAPACKE_dgesdd(LAPACK_COL_MAJOR, 'N', m, n, a.data(), m, s.data(), &u, 1, &vt, 1);
  } else {
    return LAPACKE_sgesdd(LAPACK_COL_MAJOR, 'N', m, n, a.data(), m, s.data(), &u, 1, &vt, 1);
  }
}

/// Thin SVD M = U diag(s) V^T by ?gesdd (jobz = 'S'); returns LAPACK's info (> 0: no
/// convergence). U is m x r, V is n x r, r = min(m, n).
template <typename Scalar>
lapack_int lapack_thin_svd(const CRef<Scalar>& M, Mat<Scalar>& U, Vec<Scalar>& s, Mat<Scalar>& V) {
  Mat<Scalar> a = M;  // gesdd overwrites its input
  const Index r = std::min(a.rows(), a.cols());
  const lapack_int m = static_cast<lapack_int>(a.rows()), n = static_cast<lapack_int>(a.cols());
  s.resize(r);
  U.resize(a.rows(), r);
  Mat<Scalar> vt(r, a.cols());
  const lapack_int ldvt = static_cast<lapack_int>(r);
  lapack_int rc;
  if constexpr (std::is_same<Scalar, double>::value)
    rc = LAPACKE_dgesdd(LAPACK_COL_MAJOR, 'S', m, n, a.data(), m, s.data(), U.data(), m, vt.data(),
                        ldvt);
  else
    rc = LAPACKE_sgesdd(LAPACK_COL_MAJOR, 'S', m, n, a.data(), m, s.data(), U.data(), m, vt.data(),
                        ldvt);
  V = vt.transpose();
  return rc;
}
#endif

/// Singular values of a finite, non-empty M in decreasing order; names the method used and
/// explains any fallback in `note`. `info` becomes NotConverging when LAPACK says so.
template <typename Scalar>
Vec<Scalar> svd_values(const CRef<Scalar>& M, SvdMethod method, std::string& name,
                       std::string& note, Info& info) {
  const Index r = std::min(M.rows(), M.cols());
  constexpr bool lapack_type =
      std::is_same<Scalar, double>::value || std::is_same<Scalar, float>::value;
  if (method == SvdMethod::Auto) {
    method = r <= auto_jacobi_max_size         ? SvdMethod::Jacobi
             : (have_lapacke() && lapack_type) ? SvdMethod::Lapack
                                               : SvdMethod::BDC;
  }
  if (method == SvdMethod::Lapack && !(have_lapacke() && lapack_type)) {
    note =
        "SvdMethod::Lapack requested but SPECTRAL_COND_HAVE_LAPACKE is not defined (or the "
        "scalar is not float/double); used bdc_svd";
    method = SvdMethod::BDC;
  }
#ifdef SPECTRAL_COND_HAVE_LAPACKE
  if constexpr (lapack_type) {
    if (method == SvdMethod::Lapack) {
      name = std::is_same<Scalar, double>::value ? "lapack_dgesdd" : "lapack_sgesdd";
      Vec<Scalar> s;
      const lapack_int rc = lapack_singular_values<Scalar>(M, s);
      if (rc != 0) {
        info = Info::NotConverging;
        note = "LAPACK ?gesdd returned info = " + std::to_string(rc);
      }
      return s;
    }
  }
#endif
  // Eigen leaves the singular values unset when it refuses its input (NaN or Inf): NaN then.
  auto values = [&](const auto& svd) {
    if (svd.info() == Eigen::Success) return Vec<Scalar>(svd.singularValues());
    info = Info::NotConverging;
    note = name + " failed (Eigen's info " + std::to_string(static_cast<int>(svd.info())) + ")";
    return Vec<Scalar>(Vec<Scalar>::Constant(r, std::numeric_limits<Scalar>::quiet_NaN()));
  };
  if (method == SvdMethod::Jacobi) {
    name = "jacobi_svd";
    return values(Eigen::JacobiSVD<Mat<Scalar>>(M));
  }
  name = "bdc_svd";
  return values(Eigen::BDCSVD<Mat<Scalar>>(M));
}

}  // namespace detail

/// A thin SVD W = U diag(S) V^T: U is m x r, V is n x r, r = min(m, n), S decreasing.
template <typename Scalar>
struct ThinSvd {
  Mat<Scalar> U, V;
  Vec<Scalar> S;
};

/// The thin SVD of W by JacobiSVD (min(m, n) <= auto_jacobi_max_size), else LAPACK's gesdd where
/// the build has LAPACKE (SPECTRAL_COND_HAVE_LAPACKE) and W is finite, else BDCSVD. Throws for
/// an empty W; U, S and V are NaN where the SVD fails (W holds NaN or Inf).
template <typename D>
ThinSvd<typename D::Scalar> thin_svd(const Eigen::MatrixBase<D>& W) {
  using Scalar = typename D::Scalar;
  const CRef<Scalar> w(W);
  detail::check_nonempty<Scalar>("thin_svd", w);
  constexpr int opts = Eigen::ComputeThinU | Eigen::ComputeThinV;
  ThinSvd<Scalar> out;
  const Index r = std::min(w.rows(), w.cols());
  auto take = [&](const auto& svd) {
    if (svd.info() != Eigen::Success) {  // Eigen leaves U, S, V unset: NaN, never garbage
      const Scalar nan = std::numeric_limits<Scalar>::quiet_NaN();
      out.U = Mat<Scalar>::Constant(w.rows(), r, nan);
      out.V = Mat<Scalar>::Constant(w.cols(), r, nan);
      out.S = Vec<Scalar>::Constant(r, nan);
      return;
    }
    out.U = svd.matrixU();
    out.V = svd.matrixV();
    out.S = svd.singularValues();
  };
  if (std::min(w.rows(), w.cols()) <= auto_jacobi_max_size) {
    take(Eigen::JacobiSVD<Mat<Scalar>>(w, opts));
    return out;
  }
#ifdef SPECTRAL_COND_HAVE_LAPACKE
  if (w.allFinite() && detail::lapack_thin_svd<Scalar>(w, out.U, out.S, out.V) == 0) return out;
#endif
  take(Eigen::BDCSVD<Mat<Scalar>>(w, opts));
  return out;
}

}  // namespace spectral_cond
SPECTRAL_COND_DECLARE_EXTERN(svd)
