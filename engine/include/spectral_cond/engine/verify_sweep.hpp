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

#include "number_text.hpp"
#include "verify_types.hpp"

#include <spectral_cond/conditioning/bound.hpp>
#include <spectral_cond/core/random.hpp>
#include <spectral_cond/testing/checks.hpp>
#include <spectral_cond/testing/free_bound_check.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace spectral_cond {

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

/// The proven statements on one instance (a failure is a bug): Theorem 3.5 in both forms on
/// W + λ I_k (WQ, WK, WV), the Weyl bound on the raw weights, the Kronecker lemma, and the
/// concatenation lemma on random blocks and on J's blocks.
inline void check_proven(const VerifyInstance& in, const VerifyOptions& o, const Mat<double>& WQ,
                         const Mat<double>& WK, const Mat<double>& WV,
                         const AttentionOptions<double>& ao, VerifyReport& rep, RegimeStats& st) {
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

  std::vector<Mat<double>> jblocks;
  for (JacobianBlock b : {JacobianBlock::Q, JacobianBlock::K, JacobianBlock::V})
    jblocks.push_back(attention_jacobian(in.X, WQ, WK, WV, ao, b));
  std::function<CheckResult()> concat_j_recheck;
  if (o.rechecks.concatenation)
    concat_j_recheck = [&o, &jblocks] { return o.rechecks.concatenation(jblocks); };
  count_check_rechecked(rep, st, in, rep.concatenation_J, "concatenation_J", "[J_Q | J_K | J_V]",
                        check_concatenation(jblocks), concat_j_recheck);
}

/// Theorem 3.4 in float64 on one instance: the counts with kappa and with kappa_plus (judged
/// against rounding by classify_theorem34_plus, which it returns), the bound without hypothesis
/// (proven), κ(J) before and after λ, and the violation of the plain bound when it fails.
inline BoundClassification count_theorem34(const VerifyInstance& in,
                                           const AttentionOptions<double>& ao,
                                           const Theorem34Report& t, VerifyReport& rep,
                                           RegimeStats& st) {
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
  return bc;
}

/// What a violation of Theorem 3.4 with kappa_plus rests on: both sides, the ratio, their
/// estimated errors, and kappa_plus of every factor.
inline std::string theorem34_plus_detail(const Theorem34Report& t, const BoundClassification& bc) {
  auto num = [](double x) { return engine::number_text(x, 6); };
  std::ostringstream d;
  d << "kappa_plus(J) = " << num(t.J.kappa_plus) << " (rank " << t.J.rank << ") vs bound_plus "
    << num(t.bound_plus) << ", ratio " << num(bc.ratio) << " (relative errors: J " << num(bc.acc_J)
    << ", bound " << num(bc.acc_bound) << "); kappa_plus of X " << num(t.X.kappa_plus)
    << ", Lambda " << num(t.Lambda.kappa_plus) << " (rank " << t.Lambda.rank << "), W_Q "
    << num(t.WQ.kappa_plus) << ", W_K " << num(t.WK.kappa_plus) << ", W_V " << num(t.WV.kappa_plus)
    << ", P " << num(t.P.kappa_plus);
  return d.str();
}

/// Theorem 3.4 with kappa_plus after the extended-precision re-check (MATH.md §4–5): every
/// float64 violation, and every verdict resting on an uncertain rank decision, is recomputed by
/// o.rechecks.theorem34 on the inputs Theorem 3.4 saw and counts by what it says there; the
/// others keep their float64 verdict. Lists the violations with their classification.
inline void settle_theorem34_plus(const VerifyInstance& in, const VerifyOptions& o,
                                  const Mat<double>& WQ, const Mat<double>& WK,
                                  const Mat<double>& WV, const AttentionOptions<double>& ao,
                                  const Theorem34Report& t, const BoundClassification& bc,
                                  VerifyReport& rep, RegimeStats& st) {
  std::string detail = theorem34_plus_detail(t, bc);
  bool certain = true;
  for (const ConditionResult<double>* c : {&t.X, &t.WQ, &t.WK, &t.WV, &t.P, &t.Lambda, &t.J})
    certain = certain && c->rank_certain;
  if (!certain) ++st.rank_uncertain;
  const bool violated = bc.verdict == BoundVerdict::Violated;
  if (!(violated || !certain) || !o.rechecks.theorem34) {
    if (violated) {
      ++st.final_unchecked;
      record(rep, st, in, "theorem34_plus", false, "J",
             {CheckStatus::Violated, t.J.kappa_plus, t.bound_plus, detail});
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
  if (!violated)
    detail += std::string(" (float64: ") + to_string(bc.verdict) + ", rank decision uncertain)";
  VerifyViolation& v = record(rep, st, in, "theorem34_plus", false, "J",
                              {CheckStatus::Violated, t.J.kappa_plus, t.bound_plus, detail});
  v.classification = e.verdict == ExtendedVerdict::Violated ? "real"
                     : e.verdict == ExtendedVerdict::Held   ? "artefact"
                                                            : "unresolved";
  v.exact_ratio = e.ratio;
  v.exact_ratio_text = e.ratio_text;
  v.digits = e.digits;
  v.extended_detail = e.detail;
}

/// Every check on one instance: the proven statements, then Theorem 3.4 on W + λ I_k (κ(J) by
/// dense SVD) in float64 and, where needed, in extended precision.
inline void verify_instance(const VerifyInstance& in, const VerifyOptions& o, VerifyReport& rep,
                            RegimeStats& st) {
  const Mat<double> WQ = in.corrected(in.W_Q), WK = in.corrected(in.W_K), WV = in.corrected(in.W_V);
  AttentionOptions<double> ao;
  ao.scale = in.c;
  ao.mask = in.regime.mask;
  check_proven(in, o, WQ, WK, WV, ao, rep, st);
  BoundOptions bo;
  bo.jacobian.method = JacobianKappaMethod::Dense;
  bo.blocks = false;
  const Theorem34Report t = theorem34(in.X, WQ, WK, WV, ao, bo);
  const BoundClassification bc = count_theorem34(in, ao, t, rep, st);
  settle_theorem34_plus(in, o, WQ, WK, WV, ao, t, bc, rep, st);
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
