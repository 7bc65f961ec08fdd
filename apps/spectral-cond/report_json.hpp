// spectral-cond: the JSON reports of `kappa` and `verify` (documented in docs/cli.md; the key
// names are a stable interface). Non-finite numbers are written as the strings "inf", "-inf"
// and "nan", since JSON has no literal for them.
//
// Header-only and free of the CLI's other parts, so that tests/test_verify.cpp can check the
// keys.
#pragma once

#include <spectral_cond/conditioning/bound.hpp>
#include "verify_types.hpp"

#include <nlohmann/json.hpp>

#include <cmath>
#include <string>

namespace spectral_cond::cli {

/// A number, or "inf" / "-inf" / "nan" for the values JSON cannot hold.
inline nlohmann::json json_number(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return v;
}

/// The fields of a ConditionResult under their own names (kappa.hpp): sigma_max, sigma_min,
/// kappa, sigma_min_plus, kappa_plus, rank, rank_tol, sigma_dropped, rank_gap, rank_certain,
/// method, accuracy, iterations, residual, info, note.
inline void put_condition(nlohmann::json& j, const ConditionResult<double>& r) {
  j["sigma_max"] = json_number(r.sigma_max);
  j["sigma_min"] = json_number(r.sigma_min);
  j["kappa"] = json_number(r.kappa);
  j["sigma_min_plus"] = json_number(r.sigma_min_plus);
  j["kappa_plus"] = json_number(r.kappa_plus);
  j["rank"] = r.rank;
  j["rank_tol"] = json_number(r.rank_tol);
  j["sigma_dropped"] = json_number(r.sigma_dropped);
  j["rank_gap"] = json_number(r.rank_gap);
  j["rank_certain"] = r.rank_certain;
  j["method"] = r.method;
  j["accuracy"] = json_number(r.accuracy);
  j["iterations"] = r.iterations;
  j["residual"] = json_number(r.residual);
  j["info"] = to_string(r.info);
  j["note"] = r.note;
}

/// Theorem 3.4's terms (MATH.md §5): kappa_<T> and kappa_plus_<T> for T in X, Lambda, WQ, WK,
/// WV, P (and JQ, JK, JV when the report has the blocks), then bound, bound_plus, ratio,
/// ratio_plus, holds, holds_plus, vacuous, verdict; and verdict_plus, kappa_plus_accuracy,
/// bound_plus_accuracy from classify_theorem34_plus for inputs of sizes `s`.
inline void put_bound(nlohmann::json& j, const Theorem34Report& t, const VerifyShape& s) {
  auto term = [&j](const char* name, const ConditionResult<double>& r) {
    j[std::string("kappa_") + name] = json_number(r.kappa);
    j[std::string("kappa_plus_") + name] = json_number(r.kappa_plus);
  };
  term("X", t.X);
  term("Lambda", t.Lambda);
  term("WQ", t.WQ);
  term("WK", t.WK);
  term("WV", t.WV);
  term("P", t.P);
  if (t.have_blocks) {
    term("JQ", t.JQ);
    term("JK", t.JK);
    term("JV", t.JV);
  }
  j["bound"] = json_number(t.bound);
  j["bound_plus"] = json_number(t.bound_plus);
  j["ratio"] = json_number(t.ratio);
  j["ratio_plus"] = json_number(t.ratio_plus);
  j["holds"] = t.holds;
  j["holds_plus"] = t.holds_plus;
  j["vacuous"] = t.vacuous;
  j["verdict"] = t.verdict;
  const BoundClassification c = classify_theorem34_plus(t, s);
  j["verdict_plus"] = to_string(c.verdict);
  j["kappa_plus_accuracy"] = json_number(c.acc_J);
  j["bound_plus_accuracy"] = json_number(c.acc_bound);
}

/// The attention diagnostics of one block (MATH.md §11; keys in docs/cli.md): the pattern of P
/// and the spectral norms of J's blocks.
inline nlohmann::json diagnostics_json(const AttentionDiagnostics& d) {
  const AttentionPattern& p = d.pattern;
  const JacobianBlockNorms& n = d.norms;
  return {{"row_max_min", json_number(p.row_max_min)},
          {"row_max_mean", json_number(p.row_max_mean)},
          {"entropy_mean", json_number(p.entropy_mean)},
          {"saturated_rows", p.saturated},
          {"saturated_diagonal", p.saturated_diagonal},
          {"saturated_fraction", json_number(p.saturated_fraction)},
          {"collapsed", d.collapsed},
          {"norm", "spectral"},
          {"sigma_max_JQ", json_number(n.sigma_max_JQ)},
          {"sigma_max_JK", json_number(n.sigma_max_JK)},
          {"sigma_max_JQK", json_number(n.sigma_max_JQK)},
          {"sigma_max_JV", json_number(n.sigma_max_JV)},
          {"ratio_QK_V", json_number(n.ratio_QK_V)},
          {"norms_converged", n.converged},
          {"note", d.note}};
}

/// The bound that needs no hypothesis, κ(J) <= σ_max(J) / σ_N(P X) (MATH.md §5), beside the
/// κ(J) it bounds (keys in docs/cli.md).
inline nlohmann::json free_bound_json(const HypothesisFreeBound& b,
                                      const ConditionResult<double>& J) {
  return {{"applicable", b.applicable},
          {"bound", json_number(b.bound)},
          {"sigma_max_J", json_number(b.sigma_max_J)},
          {"sigma_max_residual", json_number(b.sigma_max_residual)},
          {"sigma_N_PX", json_number(b.PX.sigma_min)},
          {"sigma_max_PX", json_number(b.PX.sigma_max)},
          {"rank_PX", b.PX.rank},
          {"accuracy", json_number(b.accuracy)},
          {"ratio", json_number(b.bound / J.kappa)},
          {"holds", free_bound_holds(b, J)},
          {"info", to_string(b.info)},
          {"note", b.note}};
}

/// The JSON of `spectral-cond kappa`: "input" ("matrix" or "attention"), "rows" and "cols" of
/// the matrix whose kappa it is (M or J), the condition fields, and the bound's terms when
/// `bound` is given (for attention inputs of sizes `shape`).
inline nlohmann::json kappa_json(const std::string& input, Index rows, Index cols,
                                 const ConditionResult<double>& r,
                                 const Theorem34Report* bound = nullptr,
                                 const VerifyShape& shape = {}) {
  nlohmann::json j;
  j["input"] = input;
  j["rows"] = rows;
  j["cols"] = cols;
  put_condition(j, r);
  if (bound != nullptr) put_bound(j, *bound, shape);
  if (bound != nullptr && bound->have_diagnostics) {
    j["attention"] = diagnostics_json(bound->diagnostics);
    j["bound_free"] = free_bound_json(bound->free_bound, r);
  }
  return j;
}

inline nlohmann::json counts_json(const CheckCounts& c) {
  return {
      {"held", c.held},           {"violated", c.violated},   {"not_applicable", c.not_applicable},
      {"rechecked", c.rechecked}, {"artefacts", c.artefacts}, {"unresolved", c.unresolved}};
}

inline nlohmann::json regime_json(const VerifyRegime& r) {
  return {{"shape_class", to_string(r.shape)},
          {"c", to_string(r.c)},
          {"weight_scale", to_string(r.weights)},
          {"mask", to_string(r.mask)},
          {"lambda", r.lambda}};
}

/// The JSON of `spectral-cond verify` (see docs/cli.md for every key).
inline nlohmann::json verify_json(const VerifyReport& rep) {
  nlohmann::json j;
  j["seed"] = rep.seed;
  j["instances_per_regime"] = rep.instances_per_regime;
  j["instances"] = rep.instances;
  j["proven_ok"] = rep.proven_ok();
  j["proven"] = {{"theorem35", counts_json(rep.theorem35)},
                 {"theorem35_target", counts_json(rep.theorem35_target)},
                 {"weyl", counts_json(rep.weyl)},
                 {"kronecker", counts_json(rep.kronecker)},
                 {"concatenation", counts_json(rep.concatenation)},
                 {"concatenation_J", counts_json(rep.concatenation_J)},
                 {"bound_free", counts_json(rep.bound_free)}};
  Index held = 0, violated = 0, held_plus = 0, violated_plus = 0, inconclusive_plus = 0;
  Index vacuous = 0, inf_j = 0, collapsed = 0;
  Index f_held = 0, f_violated = 0, f_inconclusive = 0, f_unresolved = 0, f_unchecked = 0;
  Index rechecked = 0, uncertain = 0, artefacts = 0, missed = 0;
  double worst = std::numeric_limits<double>::quiet_NaN(), best = worst, worst_real = worst;
  nlohmann::json regimes = nlohmann::json::array();
  for (const RegimeStats& s : rep.regimes) {
    nlohmann::json r = regime_json(s.regime);
    r["instances"] = s.instances;
    r["held"] = s.held;
    r["violated"] = s.violated;
    r["vacuous"] = s.vacuous;
    r["held_plus"] = s.held_plus;
    r["violated_plus"] = s.violated_plus;
    r["inconclusive_plus"] = s.inconclusive_plus;
    r["kappa_J_infinite"] = s.kappa_J_infinite;
    r["worst_ratio"] = json_number(s.worst_ratio);
    r["worst_ratio_plus"] = json_number(s.worst_ratio_plus);
    r["max_ratio_plus"] = json_number(s.max_ratio_plus);
    r["proven_failures"] = s.proven_failures;
    r["median_kappa_J_before"] = json_number(s.median_kappa_J_before);
    r["median_kappa_J_after"] = json_number(s.median_kappa_J_after);
    r["lowered"] = s.lowered;
    r["collapsed"] = s.collapsed;
    collapsed += s.collapsed;
    r["final"] = {{"held", s.final_held},
                  {"violated", s.final_violated},
                  {"inconclusive", s.final_inconclusive},
                  {"unresolved", s.final_unresolved},
                  {"unchecked", s.final_unchecked},
                  {"rechecked", s.rechecked},
                  {"rank_uncertain", s.rank_uncertain},
                  {"artefacts", s.artefacts},
                  {"missed", s.missed},
                  {"worst_real_ratio", json_number(s.worst_real_ratio)}};
    regimes.push_back(r);
    f_held += s.final_held;
    f_violated += s.final_violated;
    f_inconclusive += s.final_inconclusive;
    f_unresolved += s.final_unresolved;
    f_unchecked += s.final_unchecked;
    rechecked += s.rechecked;
    uncertain += s.rank_uncertain;
    artefacts += s.artefacts;
    missed += s.missed;
    worst_real = min_ignoring_nan(worst_real, s.worst_real_ratio);
    held += s.held;
    violated += s.violated;
    held_plus += s.held_plus;
    violated_plus += s.violated_plus;
    inconclusive_plus += s.inconclusive_plus;
    vacuous += s.vacuous;
    inf_j += s.kappa_J_infinite;
    worst = min_ignoring_nan(worst, s.worst_ratio_plus);
    best = max_ignoring_nan(best, s.max_ratio_plus);
  }
  j["theorem34"] = {{"instances", rep.instances},
                    {"held", held},
                    {"violated", violated},
                    {"vacuous", vacuous},
                    {"held_plus", held_plus},
                    {"violated_plus", violated_plus},
                    {"inconclusive_plus", inconclusive_plus},
                    {"kappa_J_infinite", inf_j},
                    {"worst_ratio_plus", json_number(worst)},
                    {"max_ratio_plus", json_number(best)},
                    {"collapsed", collapsed},
                    {"final",
                     {{"held", f_held},
                      {"violated", f_violated},
                      {"inconclusive", f_inconclusive},
                      {"unresolved", f_unresolved},
                      {"unchecked", f_unchecked},
                      {"rechecked", rechecked},
                      {"rank_uncertain", uncertain},
                      {"artefacts", artefacts},
                      {"missed", missed},
                      {"worst_real_ratio", json_number(worst_real)}}}};
  j["regimes"] = regimes;
  nlohmann::json viol = nlohmann::json::array();
  for (const VerifyViolation& v : rep.violations) {
    nlohmann::json e = regime_json(v.regime);
    e["statement"] = v.statement;
    e["proven"] = v.proven;
    e["seed"] = v.seed;
    e["N"] = v.shape.N;
    e["D"] = v.shape.D;
    e["d_k"] = v.shape.d_k;
    e["d_v"] = v.shape.d_v;
    e["c_value"] = json_number(v.c);
    e["weight_scale_value"] = json_number(v.weight_scale);
    e["matrix"] = v.matrix;
    e["lhs"] = json_number(v.lhs);
    e["rhs"] = json_number(v.rhs);
    e["detail"] = v.detail;
    e["classification"] = v.classification;
    e["exact_ratio"] = json_number(v.exact_ratio);
    e["exact_ratio_text"] = v.exact_ratio_text;
    e["digits"] = v.digits;
    e["extended_detail"] = v.extended_detail;
    viol.push_back(e);
  }
  j["violations"] = viol;
  return j;
}

}  // namespace spectral_cond::cli
