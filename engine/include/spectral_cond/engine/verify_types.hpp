// spectral-cond verify: what the sweep of verify_sweep.hpp works on and reports: its regimes and
// options, one random instance, the counts of each statement's checks, the violations, and the
// classification of Theorem 3.4 against rounding (also used by `kappa --bound`). Header-only, as
// the sweep: tests/test_verify.cpp and the Python extension use it too.
#pragma once

#include <spectral_cond/conditioning/bound.hpp>
#include <spectral_cond/conditioning/corrections.hpp>
#include <spectral_cond/testing/checks.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace spectral_cond {

namespace sweep_steps {

/// Throws std::invalid_argument("fn: msg"), as the library's own option checks do.
[[noreturn]] inline void invalid_option(const char* fn, const std::string& msg) {
  throw std::invalid_argument(std::string(fn) + ": " + msg);
}

}  // namespace sweep_steps

/// Shape class of an instance: N < D ("wide" X), N = D, N > D ("tall" X).
enum class ShapeClass { Wide, Square, Tall };
/// The logit scale c: 1 (the paper's theory) or 1/sqrt(d_k) (practice).
enum class LogitScale { One, InvSqrtDk };
/// The weights' entry scale: N(0, s^2) with s = 0.02 (GPT/BERT init), 1/sqrt(D), or 1.
enum class WeightScale { Small, InvSqrtD, One };

inline const char* to_string(ShapeClass s) {
  return s == ShapeClass::Wide ? "N<D" : s == ShapeClass::Square ? "N=D" : "N>D";
}
inline const char* to_string(LogitScale c) {
  return c == LogitScale::One ? "1" : "1/sqrt(d_k)";
}
inline const char* to_string(WeightScale w) {
  return w == WeightScale::Small ? "0.02" : w == WeightScale::InvSqrtD ? "1/sqrt(D)" : "1";
}

/// Sizes of one instance: X is N x D, W_Q and W_K are D x d_k, W_V is D x d_v.
struct VerifyShape {
  Index N = 0, D = 0, d_k = 0, d_v = 0;
  ShapeClass shape_class() const {
    return N < D ? ShapeClass::Wide : N == D ? ShapeClass::Square : ShapeClass::Tall;
  }
};

/// The default shapes: two per class, small enough that dense kappa(J) is the reference. The
/// last one has a tall J (N d_v > 2 D d_k + D d_v), where the gauge null space makes
/// kappa(J) = +inf (MATH.md §4).
inline std::vector<VerifyShape> default_verify_shapes() {
  return {{4, 8, 4, 4}, {3, 7, 2, 2}, {6, 6, 3, 3}, {4, 4, 4, 4}, {8, 4, 2, 2}, {16, 4, 2, 2}};
}

/// One regime of the sweep.
struct VerifyRegime {
  ShapeClass shape = ShapeClass::Wide;
  LogitScale c = LogitScale::One;
  WeightScale weights = WeightScale::InvSqrtD;
  MaskKind mask = MaskKind::None;
  double lambda = 0;  ///< W_Q, W_K, W_V become W + λ I_k
};

/// The recomputations in extended precision the sweep asks for (testing/extended.hpp:
/// recheck_theorem34, check_concatenation_extended). Supplied by the caller so that this header
/// needs neither Boost nor MPFR; an empty member re-checks nothing of its kind, and what it
/// would have re-checked is then reported as unchecked.
struct VerifyRechecks {
  /// Theorem 3.4 with kappa_plus on an instance's inputs (W + λ I_k), with c and the mask.
  std::function<ExtendedBoundCheck(const Mat<double>& X, const Mat<double>& WQ,
                                   const Mat<double>& WK, const Mat<double>& WV,
                                   const AttentionOptions<double>& opts)>
      theorem34;
  /// The concatenation lemma on the given blocks.
  std::function<CheckResult(const std::vector<Mat<double>>& blocks)> concatenation;
};

/// Options of verify_sweep. Every list must be non-empty.
struct VerifyOptions {
  std::uint64_t seed = default_seed;  ///< the sweep's seed; instance seeds derive from it
  Index instances_per_regime = 16;  ///< instance k of a regime uses shape k mod (its class's count)
  std::vector<VerifyShape> shapes = default_verify_shapes();  ///< all dimensions >= 1
  std::vector<LogitScale> logit_scales = {LogitScale::One, LogitScale::InvSqrtDk};
  std::vector<WeightScale> weight_scales = {WeightScale::Small, WeightScale::InvSqrtD,
                                            WeightScale::One};
  std::vector<MaskKind> masks = {MaskKind::None, MaskKind::Causal};  ///< None or Causal
  std::vector<double> lambdas = {0, 1, 2, 10};                       ///< each finite, >= 0
  double target = 1.5;                   ///< t of Theorem 3.5's target form (> 1)
  double rel_tol = 1e-12;                ///< relative tolerance of the proven equalities
  std::function<void(double)> progress;  ///< fraction of instances done; may be empty
  /// Every would-be violation (Theorem 3.4 with kappa_plus, and a failed concatenation check)
  /// and every instance with an uncertain rank decision is recomputed by these (MATH.md §4–5).
  VerifyRechecks rechecks;

  void check(const char* fn) const {
    if (instances_per_regime < 1)
      sweep_steps::invalid_option(fn, "instances_per_regime must be >= 1");
    if (shapes.empty() || logit_scales.empty() || weight_scales.empty() || masks.empty() ||
        lambdas.empty())
      sweep_steps::invalid_option(
          fn, "shapes, logit_scales, weight_scales, masks and lambdas must be non-empty");
    for (const VerifyShape& s : shapes)
      if (s.N < 1 || s.D < 1 || s.d_k < 1 || s.d_v < 1)
        sweep_steps::invalid_option(fn, "every shape needs N, D, d_k, d_v >= 1");
    for (MaskKind m : masks)
      if (m == MaskKind::Additive) sweep_steps::invalid_option(fn, "masks must be None or Causal");
    for (double l : lambdas)
      if (!(std::isfinite(l) && l >= 0))
        sweep_steps::invalid_option(fn, "every lambda must be finite and >= 0");
    if (!(std::isfinite(target) && target > 1))
      sweep_steps::invalid_option(fn, "target must be > 1");
    if (!(rel_tol > 0)) sweep_steps::invalid_option(fn, "rel_tol must be > 0");
  }
};

/// One random instance, rebuilt exactly from (regime, shape, seed) by make_verify_instance.
struct VerifyInstance {
  VerifyRegime regime;
  VerifyShape shape;
  std::uint64_t seed = 0;
  double c = 1;                     ///< the logit scale used
  double weight_scale = 1;          ///< the standard deviation of the weights' entries
  Mat<double> X;                    ///< N x D, entries N(0, 1)
  Mat<double> W_Q, W_K, W_V;        ///< raw weights, entries N(0, weight_scale^2)
  Mat<double> A, B;                 ///< Kronecker lemma: small, same orientation, N(0, 1)
  std::vector<Mat<double>> blocks;  ///< concatenation lemma: 2-3 wide N(0, 1) blocks
  /// W + λ I_k: what Theorem 3.4 sees.
  Mat<double> corrected(const Mat<double>& W) const {
    return W + regime.lambda * rectangular_identity<double>(W.rows(), W.cols());
  }
};

/// Counts of one statement's checks. A check re-checked in extended precision counts by its
/// extended verdict; `artefacts` of the float64 failures were overturned there (counted as held
/// or not applicable), `unresolved` stayed unresolved: counted as violated when float64 failed
/// (a proven statement is failed until shown to hold), else as what extended precision says.
struct CheckCounts {
  Index held = 0, violated = 0, not_applicable = 0;
  Index rechecked = 0, artefacts = 0, unresolved = 0;
  void add(CheckStatus s) {
    (s == CheckStatus::Held ? held : s == CheckStatus::Violated ? violated : not_applicable)++;
  }
  Index total() const { return held + violated + not_applicable; }
};

/// Theorem 3.4 in one regime.
struct RegimeStats {
  VerifyRegime regime;
  Index instances = 0;
  Index held = 0, violated = 0;  ///< with kappa: kappa(J) <= bound
  Index vacuous = 0;             ///< bound = +inf (𝚲 is singular: always)
  /// With kappa_plus, classified by classify_theorem34_plus: held, violated, or inconclusive
  /// (the two sides are within the rounding error of the kappa_plus values they are built from).
  Index held_plus = 0, violated_plus = 0, inconclusive_plus = 0;
  Index kappa_J_infinite = 0;                                     ///< kappa(J) = +inf (J singular)
  double worst_ratio = std::numeric_limits<double>::quiet_NaN();  ///< min bound / kappa(J)
  /// min and max of bound_plus / kappa_plus(J) over the conclusive (held or violated) instances
  double worst_ratio_plus = std::numeric_limits<double>::quiet_NaN();
  double max_ratio_plus = std::numeric_limits<double>::quiet_NaN();
  Index proven_failures = 0;  ///< failed proven checks on this regime's instances
  /// κ(J) of the raw weights and of W + λ I_k (equal when λ = 0), one per instance, by dense SVD
  std::vector<double> kappa_J_before, kappa_J_after;
  double median_kappa_J_before = std::numeric_limits<double>::quiet_NaN();
  double median_kappa_J_after = std::numeric_limits<double>::quiet_NaN();
  Index lowered = 0;    ///< instances with κ(J) after < before
  Index collapsed = 0;  ///< instances whose attention collapsed to the identity after λ (§11)
  /// Theorem 3.4 with kappa_plus after the extended-precision re-checks (VerifyRechecks): every
  /// float64 violation and every instance with an uncertain rank decision is recomputed and
  /// counts by its extended verdict; the others keep their float64 verdict. held + violated +
  /// inconclusive + unresolved = instances (+ unchecked when no recheck was supplied).
  Index final_held = 0, final_violated = 0, final_inconclusive = 0, final_unresolved = 0;
  Index final_unchecked = 0;  ///< float64 violations left unchecked (no recheck supplied)
  Index rechecked = 0;        ///< instances recomputed in extended precision
  Index rank_uncertain = 0;   ///< instances with an uncertain float64 rank decision
  Index artefacts = 0;        ///< float64 violations that extended precision overturned
  Index missed = 0;           ///< extended violations float64 called held or inconclusive
  /// min and max of the exact ratio bound_plus / kappa_plus(J) over the real violations
  double worst_real_ratio = std::numeric_limits<double>::quiet_NaN();
};

/// One failed check, with everything needed to rebuild its instance.
struct VerifyViolation {
  std::string statement;  ///< theorem34, theorem34_plus, theorem35, theorem35_target, weyl,
                          ///< kronecker, concatenation, concatenation_J
  bool proven = false;    ///< true: a proven statement failed (a bug)
  VerifyRegime regime;
  VerifyShape shape;
  std::uint64_t seed = 0;
  double c = 1, weight_scale = 1;
  std::string matrix;  ///< the matrix checked (W_Q, ...), when it matters
  double lhs = 0, rhs = 0;
  std::string detail;
  /// What the extended-precision re-check said: "real" (it fails there too), "artefact" (it
  /// holds there: float64 rounding), "unresolved", or "unchecked" (no recheck for it).
  std::string classification = "unchecked";
  double exact_ratio = std::numeric_limits<double>::quiet_NaN();  ///< Theorem 3.4: extended ratio
  std::string exact_ratio_text;  ///< the same as text (beyond double's range for artefacts)
  unsigned digits = 0;           ///< the working precision of the re-check
  std::string extended_detail;   ///< the re-check's own numbers
};

/// The sweep's results.
struct VerifyReport {
  std::uint64_t seed = 0;
  Index instances_per_regime = 0;
  Index instances = 0;
  std::vector<RegimeStats> regimes;
  CheckCounts theorem35, theorem35_target, weyl, kronecker, concatenation, concatenation_J;
  /// κ(J) <= σ_max(J) / σ_N(P X) (MATH.md §5, proven), on W + λ I_k
  CheckCounts bound_free;
  std::vector<VerifyViolation> violations;

  /// Every proven statement held wherever its hypothesis was met (after the extended-precision
  /// re-checks: a float64 failure overturned there is an artefact, not a failure).
  bool proven_ok() const {
    return theorem35.violated + theorem35_target.violated + weyl.violated + kronecker.violated +
               concatenation.violated + concatenation_J.violated + bound_free.violated ==
           0;
  }
};

/// Theorem 3.4's counts of the regimes that `in` selects (all of them by default) added up, with
/// the smallest and largest of their ratios: the whole sweep, or the regimes that share one
/// value of one dimension. Its regime, medians and κ(J) lists are left empty.
inline RegimeStats combined(const std::vector<RegimeStats>& regimes,
                            const std::function<bool(const VerifyRegime&)>& in = {}) {
  static constexpr Index RegimeStats::*kCounts[] = {
      &RegimeStats::instances,         &RegimeStats::held,
      &RegimeStats::violated,          &RegimeStats::vacuous,
      &RegimeStats::held_plus,         &RegimeStats::violated_plus,
      &RegimeStats::inconclusive_plus, &RegimeStats::kappa_J_infinite,
      &RegimeStats::proven_failures,   &RegimeStats::lowered,
      &RegimeStats::collapsed,         &RegimeStats::final_held,
      &RegimeStats::final_violated,    &RegimeStats::final_inconclusive,
      &RegimeStats::final_unresolved,  &RegimeStats::final_unchecked,
      &RegimeStats::rechecked,         &RegimeStats::rank_uncertain,
      &RegimeStats::artefacts,         &RegimeStats::missed};
  RegimeStats t;
  for (const RegimeStats& s : regimes) {
    if (in && !in(s.regime)) continue;
    for (Index RegimeStats::*c : kCounts) t.*c += s.*c;
    t.worst_ratio = min_ignoring_nan(t.worst_ratio, s.worst_ratio);
    t.worst_ratio_plus = min_ignoring_nan(t.worst_ratio_plus, s.worst_ratio_plus);
    t.max_ratio_plus = max_ignoring_nan(t.max_ratio_plus, s.max_ratio_plus);
    t.worst_real_ratio = min_ignoring_nan(t.worst_real_ratio, s.worst_real_ratio);
  }
  return t;
}

/// Theorem 3.4 with kappa_plus on one instance, judged against rounding.
enum class BoundVerdict { Held, Violated, Inconclusive };

inline const char* to_string(BoundVerdict v) {
  return v == BoundVerdict::Held       ? "held"
         : v == BoundVerdict::Violated ? "violated"
                                       : "inconclusive";
}

struct BoundClassification {
  BoundVerdict verdict = BoundVerdict::Inconclusive;
  double ratio = 0;      ///< bound_plus / kappa_plus(J)
  double acc_J = 0;      ///< estimated relative error of kappa_plus(J)
  double acc_bound = 0;  ///< estimated relative error of bound_plus
};

/// Classifies kappa_plus(J) <= bound_plus for inputs of the given sizes. A dense SVD computes
/// every σ_i to an absolute error of about max(m, n) ε σ_1, so kappa_plus(M) = σ_1 / σ_rank
/// has a relative error of about a(M) = safety · max(m, n) ε kappa_plus(M); the bound's is at
/// most 3 a(X) + a(𝚲) + a(W_V) + a(W_Q) + a(W_K) + a(P) (first order). `safety` (default 10)
/// covers the estimate's unsharp constants and the rounding of J's own assembly (a saturated
/// softmax makes J's small entries differences of nearly equal terms). Held when
/// kappa_plus(J) (1 + a(J)) <= bound_plus (1 - a(bound)), violated when
/// kappa_plus(J) (1 - a(J)) > bound_plus (1 + a(bound)), inconclusive otherwise (or when a
/// kappa_plus is undefined or an error estimate reaches 1). Theorem34Report::holds_plus is not
/// used: it discounts by the accuracy of plain kappa(J), which is +inf whenever J is singular
/// (a tall J always is), and so never reports a violation there.
inline BoundClassification classify_theorem34_plus(const Theorem34Report& t, const VerifyShape& s,
                                                   double safety = 10) {
  const double eps = safety * ScalarTraits<double>::eps();
  auto acc = [eps](const ConditionResult<double>& r, Index m, Index n) {
    return static_cast<double>(std::max(m, n)) * eps * r.kappa_plus;
  };
  BoundClassification c;
  const Index rows = jacobian_rows(s.N, s.d_v);
  const Index cols = jacobian_cols(JacobianBlock::All, s.N, s.D, s.d_k, s.d_v);
  c.acc_J = acc(t.J, rows, cols);
  c.acc_bound = 3 * acc(t.X, s.N, s.D) + acc(t.Lambda, s.N * s.N, s.N * s.N) +
                acc(t.WV, s.D, s.d_v) + acc(t.WQ, s.D, s.d_k) + acc(t.WK, s.D, s.d_k) +
                acc(t.P, s.N, s.N);
  c.ratio = t.bound_plus / t.J.kappa_plus;
  if (!(std::isfinite(c.ratio) && c.acc_J < 1 && c.acc_bound < 1)) return c;
  if (t.J.kappa_plus * (1 + c.acc_J) <= t.bound_plus * (1 - c.acc_bound))
    c.verdict = BoundVerdict::Held;
  else if (t.J.kappa_plus * (1 - c.acc_J) > t.bound_plus * (1 + c.acc_bound))
    c.verdict = BoundVerdict::Violated;
  return c;
}

}  // namespace spectral_cond
