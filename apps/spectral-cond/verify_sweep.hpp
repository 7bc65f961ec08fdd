// spectral-cond verify's engine: a randomized sweep of the paper's statements over regimes
// (MATH.md §4–7), each instance checked against a dense SVD. It is the tool's experiment
// harness; the single checks it applies are the library's (spectral_cond/testing/checks.hpp).
//
//   proven (a failure is a bug in the library or in MATH.md): Theorem 3.5 (both forms), the
//     Weyl bound behind Theorem 3.8, the Kronecker and concatenation lemmas, on random
//     matrices and on the instance's own J = [J_Q | J_K | J_V];
//   open (a violation is a finding, reported, not a failure): Theorem 3.4 with kappa and with
//     kappa_plus (conditioning/bound.hpp, MATH.md §5).
//
// Regimes: shape class (N < D, N = D, N > D) x logit scale c (1, 1/sqrt(d_k)) x weight scale
// (0.02, 1/sqrt(D), 1) x mask (none, causal) x λ (the weights become W + λ I_k before
// Theorem 3.4 is evaluated). Every instance has its own seed, derived from the sweep's seed, and
// make_verify_instance(regime, shape, seed) rebuilds it exactly, with any compiler (the portable
// generator of core/random.hpp, MATH.md §16).
#pragma once

#include <spectral_cond/conditioning/bound.hpp>
#include <spectral_cond/core/random.hpp>
#include <spectral_cond/testing/checks.hpp>
#include <spectral_cond/testing/free_bound_check.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
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

/// The seed of instance k of regime number r (its index in verify_sweep's order; MATH.md §16,
/// derived seeds).
inline std::uint64_t verify_instance_seed(std::uint64_t seed, Index regime, Index k) {
  return splitmix64(splitmix64(seed ^ splitmix64(static_cast<std::uint64_t>(regime))) +
                    static_cast<std::uint64_t>(k));
}

/// Builds one instance from its regime, shape and seed (deterministic).
inline VerifyInstance make_verify_instance(const VerifyRegime& regime, const VerifyShape& shape,
                                           std::uint64_t seed) {
  VerifyInstance in;
  in.regime = regime;
  in.shape = shape;
  in.seed = seed;
  in.c = regime.c == LogitScale::One ? 1.0 : 1.0 / std::sqrt(static_cast<double>(shape.d_k));
  in.weight_scale = regime.weights == WeightScale::Small      ? 0.02
                    : regime.weights == WeightScale::InvSqrtD ? 1 / std::sqrt(double(shape.D))
                                                              : 1.0;
  Rng rng(seed);
  in.X = rng.normal_matrix(shape.N, shape.D, 1.0);
  in.W_Q = rng.normal_matrix(shape.D, shape.d_k, in.weight_scale);
  in.W_K = rng.normal_matrix(shape.D, shape.d_k, in.weight_scale);
  in.W_V = rng.normal_matrix(shape.D, shape.d_v, in.weight_scale);
  // Kronecker factors: both wide or both tall (each side 1..4).
  const bool wide = rng.integer(0, 1) == 0;
  for (Mat<double>* f : {&in.A, &in.B}) {
    const Index small = rng.integer(1, 3);
    const Index large = small + rng.integer(0, 2);
    *f = wide ? rng.normal_matrix(small, large, 1.0) : rng.normal_matrix(large, small, 1.0);
  }
  // Concatenation: 2-3 blocks with m rows and m..m+2 columns (full row rank almost surely).
  const Index m = rng.integer(1, 4), count = rng.integer(2, 3);
  for (Index i = 0; i < count; ++i)
    in.blocks.push_back(rng.normal_matrix(m, m + rng.integer(0, 2), 1.0));
  return in;
}

/// The steps of verify_sweep: the checks of one instance and the counts they feed.
namespace sweep_steps {

inline VerifyViolation& record(VerifyReport& rep, RegimeStats& st, const VerifyInstance& in,
                               const std::string& statement, bool proven, const std::string& matrix,
                               const CheckResult& r) {
  if (proven) ++st.proven_failures;
  VerifyViolation v;
  v.statement = statement;
  v.proven = proven;
  v.regime = in.regime;
  v.shape = in.shape;
  v.seed = in.seed;
  v.c = in.c;
  v.weight_scale = in.weight_scale;
  v.matrix = matrix;
  v.lhs = r.lhs;
  v.rhs = r.rhs;
  v.detail = r.detail;
  rep.violations.push_back(v);
  return rep.violations.back();
}

inline void count_check(VerifyReport& rep, RegimeStats& st, const VerifyInstance& in,
                        CheckCounts& counts, const std::string& statement,
                        const std::string& matrix, const CheckResult& r) {
  counts.add(r.status);
  if (r.status == CheckStatus::Violated) record(rep, st, in, statement, true, matrix, r);
}

/// A proven check with an extended-precision re-check: a float64 failure, or a verdict resting
/// on an uncertain rank decision, is recomputed by `recheck` and counts by what it says there.
/// A float64 failure still failed there, or unresolved there (a rank decision uncertain even
/// there), is a failure; held or not applicable there with certain ranks overturns it (an
/// artefact). A verdict that was no failure in float64 and is none in extended precision counts
/// as what extended precision says, certain or not (then it is also counted unresolved): nothing
/// failed at either precision.
inline void count_check_rechecked(VerifyReport& rep, RegimeStats& st, const VerifyInstance& in,
                                  CheckCounts& counts, const std::string& statement,
                                  const std::string& matrix, const CheckResult& r,
                                  const std::function<CheckResult()>& recheck) {
  if (!recheck || (r.status != CheckStatus::Violated && r.rank_certain)) {
    count_check(rep, st, in, counts, statement, matrix, r);
    return;
  }
  ++counts.rechecked;
  const CheckResult e = recheck();
  const bool resolved = e.rank_certain;
  if (r.status != CheckStatus::Violated && e.status != CheckStatus::Violated) {
    counts.add(e.status);
    if (!resolved) ++counts.unresolved;
    return;
  }
  if (resolved && e.status != CheckStatus::Violated) {
    counts.add(e.status);
    if (r.status != CheckStatus::Violated) return;
    ++counts.artefacts;  // listed, not counted as a failure
    VerifyViolation& v = record(rep, st, in, statement, true, matrix, r);
    --st.proven_failures;
    v.proven = false;
    v.classification = "artefact";
    v.extended_detail = e.detail;
    return;
  }
  counts.add(CheckStatus::Violated);
  if (!resolved) ++counts.unresolved;
  VerifyViolation& v = record(rep, st, in, statement, true, matrix, r);
  v.classification = resolved ? "real" : "unresolved";
  v.extended_detail = e.detail;
}

/// κ(J) of the raw weights beside that of W + λ I_k (t.J), and whether attention collapsed.
inline void record_lambda_effect(const VerifyInstance& in, const AttentionOptions<double>& ao,
                                 const Theorem34Report& t, RegimeStats& st) {
  double before = t.J.kappa;
  if (in.regime.lambda != 0) {
    JacobianKappaOptions jo;
    jo.method = JacobianKappaMethod::Dense;
    before = kappa_jacobian<double>(in.X, in.W_Q, in.W_K, in.W_V, ao, jo).kappa;
  }
  st.kappa_J_before.push_back(before);
  st.kappa_J_after.push_back(t.J.kappa);
  if (t.J.kappa < before) ++st.lowered;
  if (t.have_diagnostics && t.diagnostics.collapsed) ++st.collapsed;
}

/// The median of `v` (+inf counts as the largest value; NaN entries are ignored).
inline double median_of(std::vector<double> v) {
  v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return std::isnan(x); }), v.end());
  if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  if (n % 2 == 1) return v[n / 2];
  const double a = v[n / 2 - 1], b = v[n / 2];
  return std::isinf(b) ? b : 0.5 * (a + b);
}

/// The medians of a regime's κ(J) before and after λ, once its instances are done.
inline void finish_regime(RegimeStats& st) {
  st.median_kappa_J_before = median_of(st.kappa_J_before);
  st.median_kappa_J_after = median_of(st.kappa_J_after);
}

/// Every check on one instance.
inline void verify_instance(const VerifyInstance& in, const VerifyOptions& o, VerifyReport& rep,
                            RegimeStats& st) {
  const Mat<double> WQ = in.corrected(in.W_Q), WK = in.corrected(in.W_K), WV = in.corrected(in.W_V);
  const std::pair<const char*, const Mat<double>*> weights[] = {
      {"W_Q", &in.W_Q}, {"W_K", &in.W_K}, {"W_V", &in.W_V}};
  const std::pair<const char*, const Mat<double>*> corrected[] = {
      {"W_Q + lambda I_k", &WQ}, {"W_K + lambda I_k", &WK}, {"W_V + lambda I_k", &WV}};
  for (const auto& w : corrected) {
    count_check(rep, st, in, rep.theorem35, "theorem35", w.first,
                check_exact_correction(*w.second, o.rel_tol));
    count_check(rep, st, in, rep.theorem35_target, "theorem35_target", w.first,
                check_exact_correction_target(*w.second, o.target, o.rel_tol));
  }
  for (const auto& w : weights)
    count_check(rep, st, in, rep.weyl, "weyl", w.first,
                check_weyl(*w.second, in.regime.lambda, o.rel_tol));
  count_check(rep, st, in, rep.kronecker, "kronecker", "A (x) B",
              check_kronecker(in.A, in.B, o.rel_tol));
  std::function<CheckResult()> concat_recheck;
  if (o.rechecks.concatenation)
    concat_recheck = [&o, &in] { return o.rechecks.concatenation(in.blocks); };
  count_check_rechecked(rep, st, in, rep.concatenation, "concatenation", "[A_1 | ...]",
                        check_concatenation(in.blocks), concat_recheck);

  AttentionOptions<double> ao;
  ao.scale = in.c;
  ao.mask = in.regime.mask;
  std::vector<Mat<double>> jblocks;
  for (JacobianBlock b : {JacobianBlock::Q, JacobianBlock::K, JacobianBlock::V})
    jblocks.push_back(attention_jacobian(in.X, WQ, WK, WV, ao, b));
  std::function<CheckResult()> concat_j_recheck;
  if (o.rechecks.concatenation)
    concat_j_recheck = [&o, &jblocks] { return o.rechecks.concatenation(jblocks); };
  count_check_rechecked(rep, st, in, rep.concatenation_J, "concatenation_J", "[J_Q | J_K | J_V]",
                        check_concatenation(jblocks), concat_j_recheck);

  BoundOptions bo;
  bo.jacobian.method = JacobianKappaMethod::Dense;
  bo.blocks = false;
  const Theorem34Report t = theorem34(in.X, WQ, WK, WV, ao, bo);
  ++st.instances;
  (t.holds ? st.held : st.violated)++;
  if (t.vacuous) ++st.vacuous;
  if (std::isinf(t.J.kappa)) ++st.kappa_J_infinite;
  st.worst_ratio = min_ignoring_nan(st.worst_ratio, t.ratio);
  const BoundClassification bc = classify_theorem34_plus(t, in.shape);
  switch (bc.verdict) {
    case BoundVerdict::Held:
      ++st.held_plus;
      break;
    case BoundVerdict::Violated:
      ++st.violated_plus;
      break;
    case BoundVerdict::Inconclusive:
      ++st.inconclusive_plus;
      break;
  }
  if (bc.verdict != BoundVerdict::Inconclusive) {
    st.worst_ratio_plus = min_ignoring_nan(st.worst_ratio_plus, bc.ratio);
    st.max_ratio_plus = max_ignoring_nan(st.max_ratio_plus, bc.ratio);
  }
  count_check(rep, st, in, rep.bound_free, "bound_free", "J",
              check_hypothesis_free_bound(t.free_bound, t.J));
  record_lambda_effect(in, ao, t, st);
  if (!t.holds)
    record(rep, st, in, "theorem34", false, "J",
           check_result(CheckStatus::Violated, t.J.kappa, t.bound, "kappa(J) against the bound"));
  std::ostringstream d;
  d.precision(6);
  d << "kappa_plus(J) = " << t.J.kappa_plus << " (rank " << t.J.rank << ") vs bound_plus "
    << t.bound_plus << ", ratio " << bc.ratio << " (relative errors: J " << bc.acc_J << ", bound "
    << bc.acc_bound << "); kappa_plus of X " << t.X.kappa_plus << ", Lambda " << t.Lambda.kappa_plus
    << " (rank " << t.Lambda.rank << "), W_Q " << t.WQ.kappa_plus << ", W_K " << t.WK.kappa_plus
    << ", W_V " << t.WV.kappa_plus << ", P " << t.P.kappa_plus;
  // Every float64 violation, and every verdict resting on an uncertain rank decision, is
  // recomputed in extended precision and counts by what it says there (MATH.md §4–5).
  bool certain = true;
  for (const ConditionResult<double>* c : {&t.X, &t.WQ, &t.WK, &t.WV, &t.P, &t.Lambda, &t.J})
    certain = certain && c->rank_certain;
  if (!certain) ++st.rank_uncertain;
  const bool violated = bc.verdict == BoundVerdict::Violated;
  if (!(violated || !certain) || !o.rechecks.theorem34) {
    if (violated) {
      ++st.final_unchecked;
      record(rep, st, in, "theorem34_plus", false, "J",
             {CheckStatus::Violated, t.J.kappa_plus, t.bound_plus, d.str()});
    } else {
      (bc.verdict == BoundVerdict::Held ? st.final_held : st.final_inconclusive)++;
    }
    return;
  }
  ++st.rechecked;
  const ExtendedBoundCheck e = o.rechecks.theorem34(in.X, WQ, WK, WV, ao);
  switch (e.verdict) {
    case ExtendedVerdict::Held:
      ++st.final_held;
      if (violated) ++st.artefacts;
      break;
    case ExtendedVerdict::Violated:
      ++st.final_violated;
      if (!violated) ++st.missed;
      st.worst_real_ratio = min_ignoring_nan(st.worst_real_ratio, e.ratio);
      break;
    case ExtendedVerdict::Unresolved:
      ++st.final_unresolved;
      break;
  }
  if (!violated && e.verdict != ExtendedVerdict::Violated) return;
  if (!violated) d << " (float64: " << to_string(bc.verdict) << ", rank decision uncertain)";
  VerifyViolation& v = record(rep, st, in, "theorem34_plus", false, "J",
                              {CheckStatus::Violated, t.J.kappa_plus, t.bound_plus, d.str()});
  v.classification = e.verdict == ExtendedVerdict::Violated ? "real"
                     : e.verdict == ExtendedVerdict::Held   ? "artefact"
                                                            : "unresolved";
  v.exact_ratio = e.ratio;
  v.exact_ratio_text = e.ratio_text;
  v.digits = e.digits;
  v.extended_detail = e.detail;
}

}  // namespace sweep_steps

/// The regimes of a sweep, in the order verify_sweep visits them: shape class (those present
/// in opts.shapes), c, weight scale, mask, λ.
inline std::vector<VerifyRegime> verify_regimes(const VerifyOptions& o) {
  std::vector<VerifyRegime> out;
  for (ShapeClass sc : {ShapeClass::Wide, ShapeClass::Square, ShapeClass::Tall}) {
    if (std::none_of(o.shapes.begin(), o.shapes.end(),
                     [sc](const VerifyShape& s) { return s.shape_class() == sc; }))
      continue;
    for (LogitScale c : o.logit_scales)
      for (WeightScale w : o.weight_scales)
        for (MaskKind m : o.masks)
          for (double l : o.lambdas) out.push_back({sc, c, w, m, l});
  }
  return out;
}

/// Runs the sweep (see the top of this header). Deterministic for given options. Throws
/// std::invalid_argument for invalid options; every numerical outcome is in the report.
inline VerifyReport verify_sweep(const VerifyOptions& o) {
  o.check("verify_sweep");
  VerifyReport rep;
  rep.seed = o.seed;
  rep.instances_per_regime = o.instances_per_regime;
  const std::vector<VerifyRegime> regimes = verify_regimes(o);
  const Index total = static_cast<Index>(regimes.size()) * o.instances_per_regime;
  for (size_t r = 0; r < regimes.size(); ++r) {
    RegimeStats st;
    st.regime = regimes[r];
    std::vector<VerifyShape> shapes;
    for (const VerifyShape& s : o.shapes)
      if (s.shape_class() == regimes[r].shape) shapes.push_back(s);
    for (Index k = 0; k < o.instances_per_regime; ++k) {
      const VerifyShape& shape = shapes[static_cast<size_t>(k) % shapes.size()];
      const VerifyInstance in = make_verify_instance(
          regimes[r], shape, verify_instance_seed(o.seed, static_cast<Index>(r), k));
      sweep_steps::verify_instance(in, o, rep, st);
      ++rep.instances;
      if (o.progress) o.progress(static_cast<double>(rep.instances) / static_cast<double>(total));
    }
    sweep_steps::finish_regime(st);
    rep.regimes.push_back(st);
  }
  return rep;
}

}  // namespace spectral_cond
