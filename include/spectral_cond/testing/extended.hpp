// spectral_cond: Theorem 3.4 (MATH.md §5) and the concatenation lemma recomputed in extended
// precision, for the verdicts float64 cannot give (MATH.md §4, "rank certification").
//
// The library's templates are instantiated with `Extended`, an MPFR number of run-time
// precision (Boost.Multiprecision's mpfr_float_backend<0>, expression templates off; Debian
// packages libboost-dev and libmpfr-dev, link -lmpfr -lgmp). The inputs are the float64 matrices
// themselves, taken as exact: what is recomputed is the same instance, free of float64's
// rounding, in particular of the rank cuts that drop exactly nonzero singular values of size
// e^-spread on a saturated softmax.
//
// Not included by the umbrella header: only code that asks for it needs Boost and MPFR.
#pragma once

#include "spectral_cond/conditioning/kappa.hpp"
#include "spectral_cond/jacobian/jacobian.hpp"
#include "spectral_cond/testing/checks.hpp"

#include <boost/multiprecision/mpfr.hpp>

#include <Eigen/Eigenvalues>
#include <Eigen/SVD>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

namespace spectral_cond {

/// An MPFR floating-point number whose precision is chosen at run time (ExtendedPrecision).
using Extended = boost::multiprecision::number<boost::multiprecision::mpfr_float_backend<0>,
                                               boost::multiprecision::et_off>;

/// Sets the precision, in decimal digits, of every Extended created while it lives (on this
/// thread) and restores the previous one on exit.
class ExtendedPrecision {
 public:
  explicit ExtendedPrecision(unsigned digits) : saved_(Extended::default_precision()) {
    Extended::default_precision(digits);
  }
  ~ExtendedPrecision() { Extended::default_precision(saved_); }
  ExtendedPrecision(const ExtendedPrecision&) = delete;
  ExtendedPrecision& operator=(const ExtendedPrecision&) = delete;

 private:
  unsigned saved_;
};

/// An Extended value as text with `digits` significant digits (it may lie outside double's
/// range: κ₊(𝚲) of a saturated softmax reaches e^spread).
inline std::string extended_str(const Extended& x, int digits = 6) {
  if (boost::multiprecision::isnan(x)) return "nan";
  if (boost::multiprecision::isinf(x)) return x > 0 ? "inf" : "-inf";
  return x.str(digits, std::ios_base::fmtflags(0));
}

/// An Extended value as a double: ±inf beyond double's range, 0 below it.
inline double extended_to_double(const Extended& x) {
  return x.convert_to<double>();
}

/// The logit spread of one attention block (MATH.md §5): max over rows i of max_j Z_ij - min_j
/// Z_ij over the unmasked entries of Z = c Q K^T + M. A row of P then has entries down to
/// e^-spread / N.
template <typename = void>
double logit_spread(const CRef<double>& X, const CRef<double>& WQ, const CRef<double>& WK,
                    const AttentionOptions<double>& opts) {
  constexpr const char* fn = "logit_spread";
  if (X.cols() != WQ.rows() || WQ.rows() != WK.rows() || WQ.cols() != WK.cols() || WQ.cols() < 1)
    detail::fail(fn, "X (N x D), W_Q and W_K (D x d_k) do not fit");
  opts.check(fn, X.rows());
  if (opts.extended()) detail::fail(fn, "biases and RoPE are not modelled here (MATH.md §10)");
  const Mat<double> Z = opts.resolved_scale(WQ.cols()) * (X * WQ) * (X * WK).transpose();
  const Index N = Z.rows();
  double spread = 0;
  for (Index i = 0; i < N; ++i) {
    double lo = ScalarTraits<double>::inf(), hi = -ScalarTraits<double>::inf();
    for (Index j = 0; j < N; ++j) {
      double z = Z(i, j);
      if (opts.mask == MaskKind::Causal && j > i) continue;
      if (opts.mask == MaskKind::Additive) {
        if (std::isinf(opts.additive_mask(i, j))) continue;
        z += opts.additive_mask(i, j);
      }
      lo = std::min(lo, z);
      hi = std::max(hi, z);
    }
    spread = std::max(spread, hi - lo);
  }
  return spread;
}

/// The working precision, in decimal digits, for an instance of logit spread `spread` with N
/// tokens. Every Λ(p_i) = Diag(p_i) - p_i p_i^T is a rank-one downdate of Diag(p_i), so its
/// nonzero eigenvalues interlace the entries of p_i and lie at or above min_j p_ij >= e^-spread
/// / N; J's smallest nonzero singular values carry such factors, possibly squared. The working
/// ε is put 40 digits below e^(-2 spread) / N^2:
///   digits = 40 + ceil((2 spread log10 e) + 2 log10 N),
/// so that e^-spread is far above ε (at least 10^40 ε), and extended_rank_options' tolerance
/// (20 digits above ε) far below it.
inline unsigned extended_digits(double spread, Index N) {
  if (!(std::isfinite(spread) && spread >= 0))
    detail::fail("extended_digits", "the logit spread must be finite and >= 0");
  const double d = 40 + std::ceil(2 * spread / std::log(10.0) +
                                  2 * std::log10(std::max(static_cast<double>(N), 1.0)));
  return static_cast<unsigned>(std::min(d, 1e6));
}

/// The rank policy at extended precision: tolerance 10^20 ε σ_1 (20 digits above the working
/// precision, so that rounding, a few hundred ε at most, stays far below it), and a cut is
/// certain only with 10^8 of room on both sides. Create inside an ExtendedPrecision scope.
inline KappaOptions<Extended> extended_rank_options() {
  KappaOptions<Extended> ko;
  ko.rtol = Extended(1e20) * std::numeric_limits<Extended>::epsilon();
  ko.rank_margin = Extended(1e8);
  ko.svd = SvdMethod::Jacobi;
  return ko;
}

/// κ and κ₊ of an Extended matrix by Eigen's JacobiSVD (one-sided Jacobi after a QR, accurate to
/// about ε σ_1 per singular value), under the rank policy `ko`.
inline ConditionResult<Extended> extended_condition(const Mat<Extended>& M,
                                                    const KappaOptions<Extended>& ko) {
  detail::check_nonempty<Extended>("extended_condition", M);
  const Eigen::JacobiSVD<Mat<Extended>> svd(M);
  const Vec<Extended> sv = svd.singularValues();
  return condition_from_singular_values<Extended>(sv, M.rows(), M.cols(), ko,
                                                  "jacobi_svd (extended)");
}

/// κ and κ₊ of 𝚲 = Σ_i Λ(p_i) ⊗ e_i e_i^T from the eigenvalues of its blocks (as
/// softmax_jacobian_condition, MATH.md §3), in Extended arithmetic. `info` is NotConverging when
/// an eigensolver did not converge; Singular (expected) is reported as Success.
inline ConditionResult<Extended> extended_softmax_jacobian_condition(
    const Mat<Extended>& P, const KappaOptions<Extended>& ko) {
  const Index N = P.rows();
  Vec<Extended> all(N * N);
  Eigen::SelfAdjointEigenSolver<Mat<Extended>> es;
  for (Index i = 0; i < N; ++i) {
    const Vec<Extended> p = P.row(i).transpose();
    Mat<Extended> L = -p * p.transpose();
    L.diagonal() += p;
    es.compute(L, Eigen::EigenvaluesOnly);
    if (es.info() != Eigen::Success) {
      ConditionResult<Extended> bad = detail::invalid_condition<Extended>("");
      bad.info = Info::NotConverging;
      bad.note = "no convergence on Lambda(p_" + std::to_string(i) + ")";
      return bad;
    }
    for (Index k = 0; k < N; ++k)
      all(i * N + k) = es.eigenvalues()(k) < 0 ? Extended(0) : es.eigenvalues()(k);
  }
  std::sort(all.data(), all.data() + all.size(), std::greater<Extended>());
  ConditionResult<Extended> res = condition_from_singular_values<Extended>(
      all, N * N, N * N, ko, "eigenvalues of the blocks (extended)");
  if (res.info == Info::Singular) res.info = Info::Success;
  return res;
}

/// Every term of Theorem 3.4 with κ₊ (MATH.md §5) at one precision.
struct ExtendedTheorem34 {
  unsigned digits = 0;
  ConditionResult<Extended> X, WQ, WK, WV, P, Lambda, J;
  Extended bound_plus;  ///< κ₊(X)^3 κ₊(𝚲) κ₊(W_V) (κ₊(W_Q) + κ₊(W_K)) + κ₊(X) κ₊(P)
  Extended ratio_plus;  ///< bound_plus / κ₊(J)
  /// Every rank decision above is certain and every solver converged.
  bool ranks_certain = false;
};

/// Theorem 3.4 with κ₊ on the float64 inputs taken as exact, at `digits` decimal digits: X,
/// W_Q, W_K, W_V, P = softmax(c Q K^T + M) and J (assembled by attention_jacobian, MATH.md §3)
/// in Extended arithmetic, every κ₊ under extended_rank_options. The scale c is the float64
/// value opts.resolved_scale(d_k). Cost: one JacobiSVD of J in MPFR arithmetic (0.1 s for
/// 16 x 160 at 300 digits, 10 s for 64 x 192 at 100 digits).
template <typename = void>
ExtendedTheorem34 theorem34_extended(const CRef<double>& X, const CRef<double>& WQ,
                                     const CRef<double>& WK, const CRef<double>& WV,
                                     const AttentionOptions<double>& opts, unsigned digits) {
  constexpr const char* fn = "theorem34_extended";
  detail::check_attention_inputs<double>(fn, X, WQ, WK, WV);
  opts.check(fn, X.rows());
  if (opts.extended())
    detail::fail(fn, "Theorem 3.4 is stated for the block without biases or RoPE (MATH.md §10)");
  if (digits < 20) detail::fail(fn, "digits must be >= 20");
  const ExtendedPrecision precision(digits);
  const KappaOptions<Extended> ko = extended_rank_options();
  const Mat<Extended> Xe = X.cast<Extended>(), Qe = WQ.cast<Extended>(), Ke = WK.cast<Extended>(),
                      Ve = WV.cast<Extended>();
  AttentionOptions<Extended> eo;
  eo.scale = Extended(opts.resolved_scale(WQ.cols()));
  eo.mask = opts.mask;
  if (opts.mask == MaskKind::Additive) eo.additive_mask = opts.additive_mask.cast<Extended>();
  ExtendedTheorem34 r;
  r.digits = digits;
  r.X = extended_condition(Xe, ko);
  r.WQ = extended_condition(Qe, ko);
  r.WK = extended_condition(Ke, ko);
  r.WV = extended_condition(Ve, ko);
  const AttentionCache<Extended> cache = attention_forward(Xe, Qe, Ke, Ve, eo);
  r.P = extended_condition(cache.P, ko);
  r.Lambda = extended_softmax_jacobian_condition(cache.P, ko);
  r.J = extended_condition(attention_jacobian(Xe, Qe, Ke, Ve, eo), ko);
  const Extended kx = r.X.kappa_plus;
  r.bound_plus =
      kx * kx * kx * r.Lambda.kappa_plus * r.WV.kappa_plus * (r.WQ.kappa_plus + r.WK.kappa_plus) +
      kx * r.P.kappa_plus;
  r.ratio_plus = r.bound_plus / r.J.kappa_plus;
  r.ranks_certain = true;
  for (const ConditionResult<Extended>* c : {&r.X, &r.WQ, &r.WK, &r.WV, &r.P, &r.Lambda, &r.J})
    r.ranks_certain = r.ranks_certain && c->rank_certain && c->info != Info::NotConverging &&
                      c->info != Info::InvalidInput;
  return r;
}

/// Theorem 3.4 with κ₊ on the float64 inputs taken as exact (MATH.md §5): computed at
/// extended_digits(logit spread, N) digits and again at 3/2 of that, so that a singular value
/// that is exactly nonzero but below the first precision's tolerance shows as a disagreement.
/// Held when the ratio bound_plus / κ₊(J) is at least 1 + 1e-10 at both precisions, Violated
/// when at most 1 - 1e-10 at both, with every rank decision certain at both, the same ranks,
/// and ratios agreeing to 1e-20; Unresolved otherwise. `min_digits` is a floor on the precision.
template <typename = void>
ExtendedBoundCheck recheck_theorem34(const CRef<double>& X, const CRef<double>& WQ,
                                     const CRef<double>& WK, const CRef<double>& WV,
                                     const AttentionOptions<double>& opts,
                                     unsigned min_digits = 50) {
  ExtendedBoundCheck out;
  out.spread = logit_spread(X, WQ, WK, opts);
  out.digits = std::max(min_digits, extended_digits(out.spread, X.rows()));
  out.confirm_digits = out.digits + out.digits / 2;
  const ExtendedTheorem34 a = theorem34_extended(X, WQ, WK, WV, opts, out.digits);
  const ExtendedTheorem34 b = theorem34_extended(X, WQ, WK, WV, opts, out.confirm_digits);
  out.ratio = extended_to_double(a.ratio_plus);
  out.ratio_text = extended_str(a.ratio_plus);
  std::ostringstream d;
  d << "extended precision (" << out.digits << " and " << out.confirm_digits
    << " digits, logit spread " << out.spread
    << "): kappa_plus(J) = " << extended_str(a.J.kappa_plus) << " (rank " << a.J.rank
    << "), bound_plus = " << extended_str(a.bound_plus) << ", ratio " << out.ratio_text
    << "; kappa_plus of X " << extended_str(a.X.kappa_plus) << ", Lambda "
    << extended_str(a.Lambda.kappa_plus) << " (rank " << a.Lambda.rank << "), W_Q "
    << extended_str(a.WQ.kappa_plus) << ", W_K " << extended_str(a.WK.kappa_plus) << ", W_V "
    << extended_str(a.WV.kappa_plus) << ", P " << extended_str(a.P.kappa_plus) << " (rank "
    << a.P.rank << ")";
  const ConditionResult<Extended>* ca[] = {&a.X, &a.WQ, &a.WK, &a.WV, &a.P, &a.Lambda, &a.J};
  const ConditionResult<Extended>* cb[] = {&b.X, &b.WQ, &b.WK, &b.WV, &b.P, &b.Lambda, &b.J};
  bool same_ranks = true;
  for (int i = 0; i < 7; ++i) same_ranks = same_ranks && ca[i]->rank == cb[i]->rank;
  const bool finite = boost::multiprecision::isfinite(a.ratio_plus) &&
                      boost::multiprecision::isfinite(b.ratio_plus);
  const bool agree = finite && boost::multiprecision::abs(a.ratio_plus - b.ratio_plus) <=
                                   Extended(1e-20) * boost::multiprecision::abs(b.ratio_plus);
  const Extended hi = Extended(1) + Extended(1e-10), lo = Extended(1) - Extended(1e-10);
  if (!a.ranks_certain || !b.ranks_certain) {
    d << "; unresolved: a rank decision is uncertain even in extended precision";
  } else if (!same_ranks || !agree) {
    d << "; unresolved: the two precisions disagree (ratio " << extended_str(b.ratio_plus) << " at "
      << out.confirm_digits << " digits)";
  } else if (a.ratio_plus >= hi) {
    out.verdict = ExtendedVerdict::Held;
  } else if (a.ratio_plus <= lo) {
    out.verdict = ExtendedVerdict::Violated;
  } else {
    d << "; unresolved: the ratio is 1 to 1e-10";
  }
  out.detail = d.str();
  return out;
}

/// The concatenation lemma (check_concatenation, MATH.md §5) on the float64 blocks taken as
/// exact, at `digits` decimal digits under extended_rank_options.
template <typename = void>
CheckResult check_concatenation_extended(const std::vector<Mat<double>>& blocks,
                                         unsigned digits = 60) {
  const ExtendedPrecision precision(digits);
  std::vector<Mat<Extended>> eb;
  for (const Mat<double>& b : blocks) eb.push_back(b.cast<Extended>());
  CheckResult r = check_concatenation(eb, extended_rank_options());
  r.detail += " (extended precision, " + std::to_string(digits) + " digits)";
  return r;
}

}  // namespace spectral_cond
