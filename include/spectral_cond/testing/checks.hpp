// spectral_cond: the single checks of the proven statements (MATH.md §5–7), each against a fresh
// dense SVD, public so that users can check their own matrices:
//
//   Theorem 3.5   kappa(W + σ_1 U V^T) = 2 σ_1 / (σ_1 + σ_r), and kappa(W + α U V^T) = t exactly
//                 for a target t with σ_1 > t σ_r (MATH.md §6);
//   Theorem 3.8   kappa(W + λ I_k) <= (λ + s) / (λ - s) whenever λ > s = σ_1(W) (Weyl, §7);
//   Kronecker     kappa(A ⊗ B) = kappa(A) kappa(B) when A and B have the same orientation (§5);
//   concatenation kappa([A_1 | … | A_m]) <= Σ kappa(A_i) for blocks of full row rank (§5),
//                 through σ_min([A_i]) >= max σ_min(A_i) and σ_max([A_i]) <= sqrt(Σ σ_max(A_i)^2).
//
// The randomized sweep over regimes that applies them (and Theorem 3.4) is the tool's
// (apps/spectral-cond/verify_sweep.hpp).
#pragma once

#include "spectral_cond/conditioning/corrections.hpp"
#include "spectral_cond/conditioning/kappa.hpp"

#include <unsupported/Eigen/KroneckerProduct>

#include <algorithm>
#include <string>
#include <vector>

namespace spectral_cond {

/// Outcome of one check of one statement on one input.
enum class CheckStatus {
  Held,           ///< the statement holds (within the stated rounding tolerance)
  Violated,       ///< it does not
  NotApplicable,  ///< its hypothesis is not met on this input; nothing is claimed
};

inline const char* to_string(CheckStatus s) {
  switch (s) {
    case CheckStatus::Held:
      return "held";
    case CheckStatus::Violated:
      return "violated";
    case CheckStatus::NotApplicable:
      return "not_applicable";
  }
  return "unknown";
}

/// One check: the computed quantity, what the statement says about it, and one line of detail
/// (the numbers, or the hypothesis that is not met).
struct CheckResult {
  CheckStatus status = CheckStatus::NotApplicable;
  double lhs = 0;  ///< the computed quantity (kappa(W + C), kappa(A ⊗ B), ...)
  double rhs = 0;  ///< its predicted value or bound
  std::string detail;
  /// Every rank decision the check made was certain (detail::certify_rank); when false, a
  /// violation (or a hypothesis found unmet) may be rounding and needs extended precision.
  bool rank_certain = true;
};

/// What extended precision says about one statement on one instance.
enum class ExtendedVerdict {
  Held,        ///< the statement holds in exact arithmetic (to the precision used)
  Violated,    ///< it fails in exact arithmetic
  Unresolved,  ///< the two precisions disagree, a rank decision stays uncertain, or a tie
};

inline const char* to_string(ExtendedVerdict v) {
  return v == ExtendedVerdict::Held       ? "held"
         : v == ExtendedVerdict::Violated ? "violated"
                                          : "unresolved";
}

/// Theorem 3.4 with κ₊ judged in extended precision, with the evidence (recheck_theorem34 in
/// testing/extended.hpp, which needs Boost and MPFR; the result types need neither).
struct ExtendedBoundCheck {
  ExtendedVerdict verdict = ExtendedVerdict::Unresolved;
  double spread = 0;            ///< the logit spread that set the precision
  unsigned digits = 0;          ///< the working precision
  unsigned confirm_digits = 0;  ///< the second, higher precision it was repeated at
  double ratio = 0;             ///< bound_plus / κ₊(J) at `digits` (±inf beyond double's range)
  std::string ratio_text;       ///< the same, as text (never out of range)
  std::string detail;           ///< the κ₊ values and ranks, or why it is unresolved
};

/// A check's result with its one line of detail written as every check of this header writes
/// it: "<what>: <lhs> vs <rhs>" when held, "<what>: <lhs> VIOLATES <rhs>" otherwise, the numbers
/// to 17 significant digits. For harnesses that judge a statement of MATH.md §5–7 themselves
/// (Theorem 3.4's bound against κ(J)) and report it beside these checks.
inline CheckResult check_result(CheckStatus s, double lhs, double rhs, const std::string& what) {
  std::ostringstream d;
  d.precision(17);
  d << what << ": " << lhs << (s == CheckStatus::Held ? " vs " : " VIOLATES ") << rhs;
  return {s, lhs, rhs, d.str()};
}

namespace detail {

using spectral_cond::check_result;  // the checks' name for it

inline double rel_diff(double a, double b) {
  if (a == b) return 0;  // also +inf == +inf
  return std::abs(a - b) / std::max(std::abs(b), std::numeric_limits<double>::min());
}

inline CheckResult not_applicable(const std::string& why) {
  return {CheckStatus::NotApplicable, 0, 0, why};
}

template <typename = void>
inline void check_matrix(const char* fn, const CRef<double>& M) {
  check_nonempty<double>(fn, M);
  if (!M.allFinite()) fail(fn, "the matrix contains NaN or Inf");
}

}  // namespace detail

/// Theorem 3.5, default form (MATH.md §6): kappa(W + σ_1 U V^T) = 2 σ_1 / (σ_1 + σ_r), from a
/// fresh SVD of exact_correction(W).W_corrected, to `rel_tol` relative. Not applicable to W = 0.
template <typename = void>
inline CheckResult check_exact_correction(const CRef<double>& W, double rel_tol = 1e-12) {
  detail::check_matrix("check_exact_correction", W);
  const Vec<double> s = singular_values(W);
  const double s1 = s(0), sr = s(s.size() - 1);
  if (!(s1 > 0)) return detail::not_applicable("W = 0: the correction is zero");
  const double predicted = 2 * s1 / (s1 + sr);
  const ExactCorrection<double> ec = exact_correction(W);
  const double actual = kappa(ec.W_corrected).kappa;
  const bool ok = detail::rel_diff(actual, predicted) <= rel_tol &&
                  detail::rel_diff(ec.kappa_predicted, predicted) <= rel_tol;
  return detail::check_result(ok ? CheckStatus::Held : CheckStatus::Violated, actual, predicted,
                              "kappa(W + C) against 2 s1/(s1 + sr)");
}

/// Theorem 3.5, target form (MATH.md §6): for t > 1 and σ_1 > t σ_r, kappa(W + α U V^T) = t
/// exactly, α = (σ_1 - t σ_r)/(t - 1), from a fresh SVD of exact_correction(W, t).W_corrected.
/// When σ_1 <= t σ_r nothing is claimed (not applicable), but the correction must then be zero.
template <typename = void>
inline CheckResult check_exact_correction_target(const CRef<double>& W, double t,
                                                 double rel_tol = 1e-12) {
  detail::check_matrix("check_exact_correction_target", W);
  if (!(std::isfinite(t) && t > 1)) detail::fail("check_exact_correction_target", "t must be > 1");
  const Vec<double> s = singular_values(W);
  const double s1 = s(0), sr = s(s.size() - 1);
  const ExactCorrection<double> ec = exact_correction(W, std::optional<double>(t));
  if (!(s1 > t * sr)) {
    if (ec.alpha != 0)
      return detail::check_result(CheckStatus::Violated, ec.alpha, 0,
                                  "alpha when sigma_1 <= t sigma_r (must be 0)");
    return detail::not_applicable("sigma_1 <= t sigma_r: kappa(W) <= t, no correction needed");
  }
  const double actual = kappa(ec.W_corrected).kappa;
  return detail::check_result(
      detail::rel_diff(actual, t) <= rel_tol ? CheckStatus::Held : CheckStatus::Violated, actual, t,
      "kappa(W + alpha U V^T) against the target t");
}

/// Theorem 3.8 as Weyl's inequality proves it (MATH.md §7): for λ > s = σ_1(W),
/// kappa(W + λ I_k) <= (λ + s)/(λ - s), I_k the rectangular identity of W's shape; kappa from a
/// fresh SVD, with `rel_tol` relative slack. lambda_correction(W, λ) must report the same
/// kappa and bound. Not applicable when λ <= s.
template <typename = void>
inline CheckResult check_weyl(const CRef<double>& W, double lambda, double rel_tol = 1e-12) {
  detail::check_matrix("check_weyl", W);
  const double s = singular_values(W)(0);
  if (!(lambda > s)) {
    std::ostringstream d;
    d << "lambda = " << lambda << " <= sigma_1(W) = " << s << ": Weyl gives no bound";
    return detail::not_applicable(d.str());
  }
  const Mat<double> Wl = W + lambda * rectangular_identity<double>(W.rows(), W.cols());
  const double k = kappa(Wl).kappa, bound = (lambda + s) / (lambda - s);
  if (!(k <= bound * (1 + rel_tol)))
    return detail::check_result(CheckStatus::Violated, k, bound,
                                "kappa(W + lambda I_k) against (lambda + s)/(lambda - s)");
  const LambdaCorrection<double> lc = lambda_correction(W, lambda);
  if (!lc.weyl_applies || detail::rel_diff(lc.kappa_after, k) > rel_tol ||
      detail::rel_diff(lc.weyl_bound, bound) > rel_tol)
    return detail::check_result(CheckStatus::Violated, lc.weyl_bound, bound,
                                "lambda_correction's reported Weyl bound (or kappa) disagrees");
  return detail::check_result(CheckStatus::Held, k, bound,
                              "kappa(W + lambda I_k) against (lambda + s)/(lambda - s)");
}

/// A ⊗ B in MATH.md §1's convention: (A ⊗ B)[i + m_B k, i' + n_B k'] = A[k, k'] B[i, i'] (Eigen's
/// kroneckerProduct).
inline Mat<double> kronecker(const CRef<double>& A, const CRef<double>& B) {
  return Eigen::kroneckerProduct(A, B).eval();
}

/// The Kronecker lemma (MATH.md §5): kappa(A ⊗ B) = kappa(A) kappa(B), kappa(A ⊗ B) from the SVD
/// of the assembled product, to a relative tolerance of rel_tol + 64 (m + n) ε kappa(A) kappa(B)
/// (the SVD's own error). The hypothesis: A and B have the same orientation (both m <= n or both
/// m >= n, or one square); otherwise A ⊗ B has more singular values than nonzero products
/// σ_i(A) σ_j(B), its kappa is +inf, and the check is not applicable.
template <typename = void>
inline CheckResult check_kronecker(const CRef<double>& A, const CRef<double>& B,
                                   double rel_tol = 1e-12) {
  detail::check_matrix("check_kronecker", A);
  detail::check_matrix("check_kronecker", B);
  const Index m = A.rows() * B.rows(), n = A.cols() * B.cols();
  if (std::min(m, n) != std::min(A.rows(), A.cols()) * std::min(B.rows(), B.cols()))
    return detail::not_applicable(
        "A and B have opposite orientations (one wide, one tall): A (x) B has more singular "
        "values than products sigma_i(A) sigma_j(B), so kappa(A (x) B) = +inf");
  const double ka = kappa(A).kappa, kb = kappa(B).kappa, prod = ka * kb;
  const double k = kappa(kronecker(A, B)).kappa;
  if (!std::isfinite(prod))  // a singular factor: the product must be singular too
    return detail::check_result(std::isinf(k) ? CheckStatus::Held : CheckStatus::Violated, k, prod,
                                "kappa(A (x) B) with a singular factor");
  const double tol = rel_tol + 64 * static_cast<double>(m + n) * ScalarTraits<double>::eps() * prod;
  return detail::check_result(
      detail::rel_diff(k, prod) <= tol ? CheckStatus::Held : CheckStatus::Violated, k, prod,
      "kappa(A (x) B) against kappa(A) kappa(B)");
}

/// The concatenation lemma (MATH.md §5) for blocks A_i with the same number of rows m, each of
/// full row rank, so n_i >= m: with M = [A_1 | … | A_m], σ_min(M) >= max σ_min(A_i) and
/// σ_max(M) <= sqrt(Σ σ_max(A_i)^2), hence kappa(M) <= Σ kappa(A_i).
///
/// One rank policy for the blocks and the whole: every rank is decided at the same absolute
/// tolerance, the one `opts` gives M (default max(m, n) ε σ_1(M), n = Σ n_i). Since σ_min(M) >=
/// σ_min(A_i), a block of full row rank then cannot leave M singular but within rounding, and
/// such a cut is flagged: CheckResult::rank_certain is false when any of the rank decisions is
/// uncertain (detail::certify_rank). Each inequality is checked with an absolute slack of
/// 64 (m + n) ε σ_max(M). Not applicable (with the reason) when a block is not of full row rank.
/// Any scalar: float, double, or Extended (testing/extended.hpp).
template <typename Scalar>
CheckResult check_concatenation(const std::vector<Mat<Scalar>>& blocks,
                                const KappaOptions<Scalar>& opts = {}) {
  constexpr const char* fn = "check_concatenation";
  if (blocks.empty()) detail::fail(fn, "no blocks");
  opts.check(fn);
  const Index m = blocks[0].rows();
  Index n = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    detail::check_nonempty<Scalar>(fn, blocks[i]);
    if (!blocks[i].allFinite()) detail::fail(fn, "the matrix contains NaN or Inf");
    if (blocks[i].rows() != m)
      detail::fail(fn, "every block must have " + std::to_string(m) + " rows (block " +
                           std::to_string(i) + " is " +
                           detail::shape_str(blocks[i].rows(), blocks[i].cols()) + ")");
    n += blocks[i].cols();
  }
  Mat<Scalar> M(m, n);
  for (Index i = 0, j = 0; i < static_cast<Index>(blocks.size()); ++i) {
    const Mat<Scalar>& b = blocks[static_cast<size_t>(i)];
    M.middleCols(j, b.cols()) = b;
    j += b.cols();
  }
  const ConditionResult<Scalar> c = kappa(M, opts);
  bool certain = c.rank_certain;
  Scalar smin_max = 0, smax_sq = 0, kappa_sum = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const Vec<Scalar> sv = singular_values(blocks[i], opts.svd);
    ConditionResult<Scalar> b;
    if (sv(0) > c.rank_tol) {  // the same absolute tolerance as M's
      KappaOptions<Scalar> bo = opts;
      bo.rtol = c.rank_tol / sv(0);
      b = condition_from_singular_values<Scalar>(sv, m, blocks[i].cols(), bo);
    } else {  // numerically zero at the whole's tolerance: certain when well below it
      b.rank = 0;
      b.rank_certain = sv(0) * opts.rank_margin <= c.rank_tol;
    }
    if (b.rank < m) {
      std::ostringstream d;
      d << "hypothesis not met: block " << i << " (" << detail::shape_str(m, blocks[i].cols())
        << ") has rank " << b.rank << " < " << m
        << " rows at the tolerance of the whole (not of full row rank)";
      CheckResult r = detail::not_applicable(d.str());
      // "Not of full row rank" is certain when fewer than m singular values could lie above
      // the tolerance (above rank_tol / margin), whatever the exact cut among them.
      Index possible = 0;
      for (Index k = 0; k < sv.size(); ++k)
        if (sv(k) * opts.rank_margin > c.rank_tol) ++possible;
      r.rank_certain = possible < m;
      return r;
    }
    certain = certain && b.rank_certain;
    smin_max = std::max(smin_max, b.sigma_min);
    smax_sq += b.sigma_max * b.sigma_max;
    kappa_sum += b.kappa;
  }
  const Scalar slack =
      Scalar(64) * static_cast<Scalar>(m + n) * ScalarTraits<Scalar>::eps() * c.sigma_max;
  const Scalar smax_bound = Eigen::numext::sqrt(smax_sq);
  CheckResult r;
  if (!(c.sigma_min >= smin_max - slack)) {
    r = detail::check_result(CheckStatus::Violated, static_cast<double>(c.sigma_min),
                             static_cast<double>(smin_max),
                             "sigma_min([A_i]) against max sigma_min(A_i)");
  } else if (!(c.sigma_max <= smax_bound + slack)) {
    r = detail::check_result(CheckStatus::Violated, static_cast<double>(c.sigma_max),
                             static_cast<double>(smax_bound),
                             "sigma_max([A_i]) against sqrt(sum sigma_max(A_i)^2)");
  } else {
    // kappa(M) = σ_max / σ_min, each within `slack` of the two bounds just checked.
    const Scalar k_slack = (Scalar(1) + slack / c.sigma_max) /
                           (Scalar(1) - std::min(Scalar(0.5), Scalar(slack / c.sigma_min)));
    r = detail::check_result(
        c.kappa <= kappa_sum * k_slack ? CheckStatus::Held : CheckStatus::Violated,
        static_cast<double>(c.kappa), static_cast<double>(kappa_sum),
        "kappa([A_i]) against sum kappa(A_i)");
  }
  r.rank_certain = certain;
  if (!certain) r.detail += " (a rank decision is within rounding of the tolerance: uncertain)";
  return r;
}

/// The double form, for braced lists of blocks: check_concatenation({A_1, A_2}).
inline CheckResult check_concatenation(const std::vector<Mat<double>>& blocks) {
  return check_concatenation<double>(blocks);
}

}  // namespace spectral_cond
