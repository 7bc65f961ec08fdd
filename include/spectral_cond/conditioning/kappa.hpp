// spectral_cond: condition numbers of any dense matrix (MATH.md §4).
//
//   kappa(M)      = σ_1 / σ_r,  r = min(m, n)            (+inf when M is numerically singular)
//   kappa_plus(M) = σ_1 / σ_k,  σ_k the smallest singular value above the rank tolerance
//
// The singular values come from a dense, backward-stable SVD (Eigen's JacobiSVD or BDCSVD, or
// LAPACK's gesdd when the build defines SPECTRAL_COND_HAVE_LAPACKE), so every σ_i carries an
// absolute error of about ε σ_1 and σ_min a relative error of about ε kappa.
#pragma once

#include "spectral_cond/core/common.hpp"
#include "spectral_cond/core/scaling.hpp"

#include "spectral_cond/linalg/svd.hpp"

#include <Eigen/Eigenvalues>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace spectral_cond {

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
  /// Margin of a certain rank decision (MATH.md §4): the cut is certain when the smallest kept
  /// singular value exceeds rank_margin · rank_tol and the largest dropped one is at most
  /// rank_tol / rank_margin. A singular value within that factor of the tolerance sits where
  /// rounding (about ε σ_1 per singular value, the tolerance's own scale) can move it across the
  /// cut: the rank is then uncertain. Must be finite and >= 1.
  Scalar rank_margin = Scalar(10);

  /// The relative tolerance actually used for an m x n matrix.
  Scalar resolved_rtol(Index m, Index n) const {
    return rtol < Scalar(0) ? static_cast<Scalar>(std::max(m, n)) * ScalarTraits<Scalar>::eps()
                            : rtol;
  }

  void check(const char* fn) const {
    if (!Eigen::numext::isfinite(rtol) || rtol >= Scalar(1)) {
      std::ostringstream s;
      s << "rtol must be finite and < 1 (negative for the default) (got " << rtol << ")";
      detail::fail(fn, s.str());
    }
    if (!Eigen::numext::isfinite(rank_margin) || rank_margin < Scalar(1)) {
      std::ostringstream s;
      s << "rank_margin must be finite and >= 1 (got " << rank_margin << ")";
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
/// - The rank decision is certified (detail::certify_rank): sigma_dropped is the largest
///   singular value at or below rank_tol (0 when none is), rank_gap = sigma_min_plus /
///   sigma_dropped (+inf when nothing is dropped or the dropped ones are exactly 0), and
///   rank_certain says that no singular value lies within KappaOptions::rank_margin of the
///   tolerance, so that rounding of the size the tolerance stands for cannot change the rank. An
///   uncertain rank makes kappa and kappa_plus uncertain too: a check built on them needs a
///   recomputation in higher precision (testing/extended.hpp) before its verdict counts.
template <typename Scalar>
struct ConditionResult {
  Scalar sigma_max = 0;       ///< σ_1
  Scalar sigma_min = 0;       ///< σ_r, r = min(m, n), as computed (noise-level when singular)
  Scalar kappa = 0;           ///< σ_1 / σ_r, or +inf when rank < r
  Scalar sigma_min_plus = 0;  ///< σ_rank, the smallest singular value above rank_tol
  Scalar kappa_plus = 0;      ///< σ_1 / sigma_min_plus
  Index rank = 0;             ///< number of singular values above rank_tol
  Scalar rank_tol = 0;        ///< the absolute tolerance used: rtol · σ_1
  Scalar sigma_dropped = 0;   ///< σ_{rank+1}, the largest σ at or below rank_tol (0: none)
  Scalar rank_gap = 0;        ///< sigma_min_plus / sigma_dropped (+inf: nothing dropped)
  /// No singular value within rank_margin of rank_tol (see above); false when not decided by
  /// detail::certify_rank (an iterative method that sees σ_min alone, or invalid input).
  bool rank_certain = false;
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
ConditionResult<Scalar> invalid_condition(const char* what) {
  const Scalar nan = std::numeric_limits<Scalar>::quiet_NaN();
  ConditionResult<Scalar> r;
  r.sigma_max = r.sigma_min = r.kappa = r.sigma_min_plus = r.kappa_plus = nan;
  r.rank_tol = r.accuracy = r.residual = nan;
  r.sigma_dropped = r.rank_gap = nan;
  r.rank = -1;
  r.info = Info::InvalidInput;
  r.note = what;
  return r;
}

/// The one rule that certifies a rank decision (MATH.md §4): given the smallest kept singular
/// value `kept` (NaN or absent when nothing is kept: pass rank 0) and the largest dropped one
/// `dropped` (0 when nothing is dropped), fills sigma_dropped, rank_gap and rank_certain of
/// `res` from its rank_tol: certain when kept > margin · rank_tol (or nothing is kept) and
/// dropped <= rank_tol / margin. Used by condition_from_singular_values and by every method
/// that decides a rank from fewer singular values (then `dropped` is what it knows of them).
template <typename Scalar>
void certify_rank(ConditionResult<Scalar>& res, const Scalar& kept, const Scalar& dropped,
                  const Scalar& margin) {
  res.sigma_dropped = dropped;
  const bool any_kept = res.rank > 0;
  res.rank_gap = !any_kept             ? std::numeric_limits<Scalar>::quiet_NaN()
                 : dropped > Scalar(0) ? kept / dropped
                                       : ScalarTraits<Scalar>::inf();
  res.rank_certain =
      (!any_kept || kept > margin * res.rank_tol) && dropped * margin <= res.rank_tol;
}

/// `r`, computed on a matrix 2^k times the one asked about (an exact rescaling into range: of M
/// in kappa, of J through (X 2^k, W 2^-k) in kappa_jacobian), made that matrix's: the singular
/// values, the rank tolerance and the largest dropped singular value scaled by 2^-k (κ, κ₊, the
/// rank gap and the stated accuracy are ratios, unchanged), and every number of the note that
/// prints as one of them (ostream's default format, the one the methods write them in) replaced by
/// its scaled value, so that the note and the fields agree (MATH.md §12, "Scaling into range").
template <typename Scalar>
void scale_back(ConditionResult<Scalar>& r, int k) {
  if (k == 0) return;
  std::vector<std::pair<std::string, std::string>> swap;
  for (Scalar* x : {&r.sigma_max, &r.sigma_min, &r.sigma_min_plus, &r.rank_tol, &r.sigma_dropped}) {
    if (!std::isfinite(*x) || *x == 0) continue;
    const Scalar y = std::ldexp(*x, -k);
    std::ostringstream a, b;
    a << *x;
    b << y;
    // A value that prints as a plain integer could be any count in the note: left as it is.
    if (a.str().find_first_of(".e") != std::string::npos) swap.emplace_back(a.str(), b.str());
    *x = y;
  }
  if (swap.empty()) return;
  const std::string& s = r.note;
  const auto digit = [&](std::size_t i) {
    return i < s.size() && std::isdigit(static_cast<unsigned char>(s[i])) != 0;
  };
  std::string out;
  std::size_t i = 0;
  while (i < s.size()) {
    const bool starts =
        digit(i) && (i == 0 || !(std::isalnum(static_cast<unsigned char>(s[i - 1])) ||
                                 s[i - 1] == '.' || s[i - 1] == '_'));
    if (!starts) {
      out += s[i++];
      continue;
    }
    std::size_t j = i;
    while (digit(j) || (j < s.size() && s[j] == '.') ||
           (j < s.size() && s[j] == 'e' &&
            (digit(j + 1) || ((s[j + 1] == '-' || s[j + 1] == '+') && digit(j + 2)))) ||
           (j > i && (s[j] == '-' || s[j] == '+') && s[j - 1] == 'e'))
      ++j;
    std::string token = s.substr(i, j - i), tail;
    while (!token.empty() && token.back() == '.') {  // a sentence's full stop
      token.pop_back();
      tail += '.';
    }
    for (const auto& p : swap)
      if (token == p.first) {
        token = p.second;
        break;
      }
    out += token + tail;
    i = j;
  }
  r.note = out;
}

}  // namespace detail

/// Condition numbers from singular values already computed (sorted decreasingly, length
/// min(m, n), of an m x n matrix), by the rules documented at ConditionResult (MATH.md §4).
/// For code that has its own SVD; `method` is copied into the result. Throws
/// std::invalid_argument when finite values are negative or not in decreasing order (they then
/// are not singular values).
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
  for (Index i = 0; i < sv.size(); ++i)
    if (sv(i, 0) < Scalar(0) || (i > 0 && sv(i, 0) > sv(i - 1, 0))) {
      std::ostringstream e;
      e << "sv must be nonnegative and in decreasing order (sv[" << i << "] = " << sv(i, 0)
        << (i > 0 ? " after " + std::to_string(static_cast<double>(sv(i - 1, 0))) : std::string())
        << ")";
      detail::fail(fn, e.str());
    }
  const Scalar inf = ScalarTraits<Scalar>::inf();
  const Index r = sv.size();
  res.sigma_max = sv(0, 0);
  res.sigma_min = sv(r - 1, 0);
  res.rank_tol = opts.resolved_rtol(m, n) * res.sigma_max;
  res.rank = 0;
  while (res.rank < r && sv(res.rank, 0) > res.rank_tol) ++res.rank;
  detail::certify_rank<Scalar>(res, res.rank > 0 ? Scalar(sv(res.rank - 1, 0)) : Scalar(0),
                               res.rank < r ? Scalar(sv(res.rank, 0)) : Scalar(0),
                               opts.rank_margin);
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
  // The SVD runs on M 2^k with max |M_ij| 2^k in [1, 2) (exact, core/scaling.hpp): entries
  // near the underflow or overflow threshold give the κ of moderate ones; σ are scaled back.
  // (float and double; an extended type such as MPFR has the range it needs.)
  int k = 0;
  if constexpr (std::is_floating_point<Scalar>::value) k = balancing_exponent<Scalar>(m);
  std::string name, svd_note;
  Info svd_info = Info::Success;
  Vec<Scalar> sv;
  if constexpr (std::is_floating_point<Scalar>::value) {
    if (k != 0)
      sv = detail::svd_values<Scalar>(times_pow2<Scalar>(m, k), opts.svd, name, svd_note, svd_info);
  }
  if (k == 0) sv = detail::svd_values<Scalar>(m, opts.svd, name, svd_note, svd_info);
  if (!sv.allFinite()) {
    auto bad = detail::invalid_condition<Scalar>("the SVD returned NaN or Inf");
    bad.method = name;
    bad.info = Info::NotConverging;
    bad.note = "the SVD (" + name + ") returned NaN or Inf singular values" +
               (svd_note.empty() ? std::string() : "; " + svd_note);
    return bad;
  }
  ConditionResult<Scalar> res =
      condition_from_singular_values<Scalar>(sv, m.rows(), m.cols(), opts, name);
  if constexpr (std::is_floating_point<Scalar>::value) detail::scale_back(res, k);
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

/// κ of a double matrix expected to be well conditioned (W + λ I_k, an exactly corrected W):
/// kappa_via_gram with its default max_error (1e-12) where it answers, else the dense SVD of
/// `kappa` with default options (MATH.md §4). The result's method and accuracy say which
/// answered. Throws std::invalid_argument for an empty M.
template <typename = void>
ConditionResult<double> kappa_via_gram_or_svd(const CRef<double>& M) {
  if (auto g = kappa_via_gram(M)) return *g;
  return kappa(M);
}

namespace detail {
using spectral_cond::kappa_via_gram_or_svd;  // exact_correction's name for it
}  // namespace detail

}  // namespace spectral_cond
