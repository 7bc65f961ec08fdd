// spectral_cond: condition numbers of any dense matrix (MATH.md §4).
//
//   kappa(M)      = σ_1 / σ_r,  r = min(m, n)            (+inf when M is numerically singular)
//   kappa_plus(M) = σ_1 / σ_k,  σ_k the smallest singular value above the rank tolerance
//
// The singular values come from a dense, backward-stable SVD (Eigen's JacobiSVD or BDCSVD, or
// LAPACK's gesdd when the build defines SPECTRAL_COND_HAVE_LAPACKE), so every σ_i carries an
// absolute error of about ε σ_1 and σ_min a relative error of about ε kappa.
#pragma once

#include "spectral_cond/common.hpp"

#include "spectral_cond/detail/svd.hpp"

#include <Eigen/Eigenvalues>

#include <algorithm>
#include <optional>
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

/// Options of kappa() (MATH.md §4).
template <typename Scalar>
struct KappaOptions {
  /// Rank tolerance relative to σ_1: σ_i counts towards the rank when σ_i > rtol · σ_1.
  /// A negative value (the default, -1) means max(m, n) · ε, the usual numerical-rank rule.
  /// rtol = 0 counts every nonzero σ_i, so kappa is +inf only when σ_min is exactly 0.
  /// Must be finite and < 1.
  Scalar rtol = Scalar(-1);
  /// The SVD to use (default Auto).
  SvdMethod svd = SvdMethod::Auto;

  /// The relative tolerance actually used for an m x n matrix.
  Scalar resolved_rtol(Index m, Index n) const {
    return rtol < Scalar(0) ? static_cast<Scalar>(std::max(m, n)) * ScalarTraits<Scalar>::eps()
                            : rtol;
  }

  void check(const char* fn) const {
    if (!std::isfinite(rtol) || rtol >= Scalar(1)) {
      std::ostringstream s;
      s << "rtol must be finite and < 1 (negative for the default) (got " << rtol << ")";
      detail::fail(fn, s.str());
    }
  }
};

/// Condition numbers of one matrix, with the evidence behind them (MATH.md §4).
///
/// Semantics, for an m x n matrix with r = min(m, n):
/// - rank = #{ i : σ_i > rank_tol }, rank_tol = rtol · σ_1 (absolute).
/// - kappa = σ_1 / σ_r when rank == r, and exactly +inf when rank < r (numerically singular,
///   info = Singular): never a huge finite number for a singular matrix. With rtol = 0 this is
///   MATH.md's literal rule (+inf iff σ_r = 0).
/// - kappa_plus = σ_1 / sigma_min_plus, sigma_min_plus = σ_rank, the smallest σ above rank_tol;
///   equal to kappa for a full-rank matrix.
/// - The zero matrix has no singular value above any tolerance: rank 0, kappa = +inf,
///   sigma_min_plus = kappa_plus = NaN (undefined), info = Singular.
/// - NaN or Inf in the input: info = InvalidInput, every Scalar field NaN, rank = -1.
template <typename Scalar>
struct ConditionResult {
  Scalar sigma_max = 0;       ///< σ_1
  Scalar sigma_min = 0;       ///< σ_r, r = min(m, n), as computed (noise-level when singular)
  Scalar kappa = 0;           ///< σ_1 / σ_r, or +inf when rank < r
  Scalar sigma_min_plus = 0;  ///< σ_rank, the smallest singular value above rank_tol
  Scalar kappa_plus = 0;      ///< σ_1 / sigma_min_plus
  Index rank = 0;             ///< number of singular values above rank_tol
  Scalar rank_tol = 0;        ///< the absolute tolerance used: rtol · σ_1
  std::string
      method;  ///< "jacobi_svd", "bdc_svd", "lapack_gesdd", "gram_eigen" or an iterative one
  /// Estimated relative error of sigma_min. A dense backward-stable SVD computes every σ_i to
  /// an absolute error of about ε σ_1 (times a modest polynomial in m, n, omitted here), so
  /// this is ε · kappa; +inf when singular (the computed σ_min is then rounding noise).
  Scalar accuracy = 0;
  Index iterations = 0;       ///< iterations of an iterative method (0 for a dense SVD)
  Scalar residual = 0;        ///< final residual of an iterative method (0 for a dense SVD)
  Info info = Info::Success;  ///< Success, Singular (kappa = +inf), InvalidInput, NotConverging
  std::string note;           ///< human explanation of anything unusual
};

namespace detail {

template <typename Scalar>
void check_nonempty(const char* fn, const CRef<Scalar>& M) {
  if (M.rows() < 1 || M.cols() < 1)
    fail(fn,
         "M must have at least one row and one column (got " + shape_str(M.rows(), M.cols()) + ")");
}

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
  (void)info;  // written only by the LAPACK backend
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
  if (method == SvdMethod::Jacobi) {
    name = "jacobi_svd";
    return Eigen::JacobiSVD<Mat<Scalar>>(M).singularValues();
  }
  name = "bdc_svd";
  return Eigen::BDCSVD<Mat<Scalar>>(M).singularValues();
}

template <typename Scalar>
ConditionResult<Scalar> invalid_condition(const char* what) {
  const Scalar nan = std::numeric_limits<Scalar>::quiet_NaN();
  ConditionResult<Scalar> r;
  r.sigma_max = r.sigma_min = r.kappa = r.sigma_min_plus = r.kappa_plus = nan;
  r.rank_tol = r.accuracy = r.residual = nan;
  r.rank = -1;
  r.info = Info::InvalidInput;
  r.note = what;
  return r;
}

}  // namespace detail

/// Condition numbers from singular values already computed (sorted decreasingly, length
/// min(m, n), of an m x n matrix), by the rules documented at ConditionResult (MATH.md §4).
/// For code that has its own SVD; `method` is copied into the result.
template <typename Scalar>
ConditionResult<Scalar> condition_from_singular_values(const CRef<Scalar>& sv, Index m, Index n,
                                                       const KappaOptions<Scalar>& opts = {},
                                                       const std::string& method = "given") {
  constexpr const char* fn = "condition_from_singular_values";
  opts.check(fn);
  if (m < 1 || n < 1)
    detail::fail(fn, "m and n must be >= 1 (got " + detail::shape_str(m, n) + ")");
  detail::require_shape(fn, "sv", "min(m, n) x 1", std::min(m, n), 1, sv);
  ConditionResult<Scalar> res;
  res.method = method;
  if (!sv.allFinite()) return detail::invalid_condition<Scalar>("NaN or Inf singular values");
  const Index r = sv.size();
  for (Index i = 0; i < r; ++i)
    if (sv(i, 0) < 0 || (i > 0 && sv(i, 0) > sv(i - 1, 0)))
      detail::fail(
          fn, "sv must be non-negative and in decreasing order (sv(" + std::to_string(i) +
                  ") = " + std::to_string(sv(i, 0)) +
                  (i > 0 ? ", sv(" + std::to_string(i - 1) + ") = " + std::to_string(sv(i - 1, 0))
                         : std::string()) +
                  ")");
  const Scalar inf = ScalarTraits<Scalar>::inf();
  res.sigma_max = sv(0, 0);
  res.sigma_min = sv(r - 1, 0);
  res.rank_tol = opts.resolved_rtol(m, n) * res.sigma_max;
  res.rank = 0;
  while (res.rank < r && sv(res.rank, 0) > res.rank_tol) ++res.rank;
  std::ostringstream note;
  if (res.rank == 0) {
    const Scalar nan = std::numeric_limits<Scalar>::quiet_NaN();
    res.kappa = res.accuracy = inf;
    res.sigma_min_plus = res.kappa_plus = nan;
    res.info = Info::Singular;
    note << "zero matrix: no singular value above the tolerance; kappa = +inf, kappa_plus "
            "undefined (NaN)";
  } else {
    res.sigma_min_plus = sv(res.rank - 1, 0);
    res.kappa_plus = res.sigma_max / res.sigma_min_plus;
    if (res.rank < r) {
      res.kappa = res.accuracy = inf;
      res.info = Info::Singular;
      note << "numerically singular: rank " << res.rank << " < min(m, n) = " << r
           << " at tolerance " << res.rank_tol << " (sigma_min = " << res.sigma_min
           << "); kappa = +inf, kappa_plus = sigma_1 / sigma_" << res.rank;
    } else {
      res.kappa = res.sigma_max / res.sigma_min;
      res.accuracy = ScalarTraits<Scalar>::eps() * res.kappa;
    }
  }
  res.note = note.str();
  return res;
}

/// Singular values of M in decreasing order (MATH.md §4). Throws std::invalid_argument for an
/// empty M; a vector of NaN (length min(m, n)) when M holds NaN or Inf.
template <typename D>
Vec<typename D::Scalar> singular_values(const Eigen::MatrixBase<D>& M,
                                        SvdMethod method = SvdMethod::Auto) {
  using Scalar = typename D::Scalar;
  const CRef<Scalar> m(M);
  detail::check_nonempty<Scalar>("singular_values", m);
  if (!m.allFinite())
    return Vec<Scalar>::Constant(std::min(m.rows(), m.cols()),
                                 std::numeric_limits<Scalar>::quiet_NaN());
  std::string name, note;
  Info info = Info::Success;
  return detail::svd_values<Scalar>(m, method, name, note, info);
}

/// kappa(M) and kappa_plus(M) by a dense SVD (MATH.md §4); see ConditionResult for the exact
/// semantics of singular, zero and invalid inputs. Throws std::invalid_argument for an empty M
/// or invalid options. Cost: one dense SVD, O(m n min(m, n)).
template <typename D>
ConditionResult<typename D::Scalar> kappa(const Eigen::MatrixBase<D>& M,
                                          const KappaOptions<typename D::Scalar>& opts = {}) {
  using Scalar = typename D::Scalar;
  constexpr const char* fn = "kappa";
  opts.check(fn);
  const CRef<Scalar> m(M);
  detail::check_nonempty<Scalar>(fn, m);
  if (!m.allFinite()) {
    auto bad = detail::invalid_condition<Scalar>("M contains NaN or Inf");
    bad.method = "none";
    return bad;
  }
  std::string name, svd_note;
  Info svd_info = Info::Success;
  const Vec<Scalar> sv = detail::svd_values<Scalar>(m, opts.svd, name, svd_note, svd_info);
  ConditionResult<Scalar> res =
      condition_from_singular_values<Scalar>(sv, m.rows(), m.cols(), opts, name);
  if (svd_info != Info::Success) res.info = svd_info;
  if (!svd_note.empty()) res.note = res.note.empty() ? svd_note : svd_note + "; " + res.note;
  return res;
}

/// The same result as kappa(): kappa_plus, rank and rank_tol are fields of it (MATH.md §4).
template <typename D>
ConditionResult<typename D::Scalar> kappa_plus(const Eigen::MatrixBase<D>& M,
                                               const KappaOptions<typename D::Scalar>& opts = {}) {
  return kappa(M, opts);
}

/// kappa(M) from the eigenvalues of its Gram matrix (M^T M or M M^T, whichever is smaller), for
/// a double matrix expected to be well conditioned, such as W + λ I_k or an exactly corrected
/// W (MATH.md §7). Forming the Gram matrix squares κ: σ_min then carries a relative error of
/// about ε κ^2 instead of ε κ (MATH.md §3, "Squaring is not affordable"), in exchange for half
/// the work of an SVD (a symmetric rank-k update and a symmetric eigensolver; BLAS syrk and
/// LAPACK syevd where the build has LAPACKE). So the result is given only when its own estimate
/// ε κ^2 is at most `max_error`; otherwise (and for NaN or Inf in M) the answer is empty and the
/// caller takes an SVD (`kappa`). The result's method is "gram_eigen", its accuracy ε κ^2.
/// Throws std::invalid_argument for an empty M or max_error outside (0, 1).
template <typename = void>
std::optional<ConditionResult<double>> kappa_via_gram(const CRef<double>& M,
                                                      double max_error = 1e-12) {
  constexpr const char* fn = "kappa_via_gram";
  detail::check_nonempty<double>(fn, M);
  if (!(max_error > 0 && max_error < 1))
    detail::fail(fn, "max_error must be in (0, 1) (got " + std::to_string(max_error) + ")");
  if (!M.allFinite()) return std::nullopt;
  const Index m = M.rows(), n = M.cols(), k = std::min(m, n);
  const bool tall = n <= m;  // G = M^T M (k = n), else G = M M^T (k = m)
  Mat<double> G(k, k);
  Vec<double> lambda(k);  // ascending
#ifdef SPECTRAL_COND_HAVE_LAPACKE
  cblas_dsyrk(CblasColMajor, CblasLower, tall ? CblasTrans : CblasNoTrans, static_cast<int>(k),
              static_cast<int>(tall ? m : n), 1.0, M.data(), static_cast<int>(M.outerStride()), 0.0,
              G.data(), static_cast<int>(k));
  if (LAPACKE_dsyevd(LAPACK_COL_MAJOR, 'N', 'L', static_cast<lapack_int>(k), G.data(),
                     static_cast<lapack_int>(k), lambda.data()) != 0)
    return std::nullopt;
#else
  G.setZero();
  if (tall)
    G.selfadjointView<Eigen::Lower>().rankUpdate(M.transpose());
  else
    G.selfadjointView<Eigen::Lower>().rankUpdate(M);
  Eigen::SelfAdjointEigenSolver<Mat<double>> es(G, Eigen::EigenvaluesOnly);
  if (es.info() != Eigen::Success) return std::nullopt;
  lambda = es.eigenvalues();
#endif
  if (!(lambda(0) > 0)) return std::nullopt;
  const double error = ScalarTraits<double>::eps() * (lambda(k - 1) / lambda(0));
  if (!(error <= max_error)) return std::nullopt;
  Vec<double> sv(k);
  for (Index i = 0; i < k; ++i) sv(i) = std::sqrt(lambda(k - 1 - i));
  ConditionResult<double> res = condition_from_singular_values<double>(sv, m, n, {}, "gram_eigen");
  res.accuracy = error;
  return res;
}

namespace detail {
/// κ of a double matrix expected to be well conditioned: kappa_via_gram where it answers, else
/// the SVD of `kappa` (MATH.md §4).
template <typename = void>
ConditionResult<double> kappa_via_gram_or_svd(const CRef<double>& M) {
  if (auto g = kappa_via_gram(M)) return *g;
  return kappa(M);
}
}  // namespace detail

}  // namespace spectral_cond
