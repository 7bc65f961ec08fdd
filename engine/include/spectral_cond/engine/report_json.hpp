// spectral-cond: the one JSON writer of each result the tool reports, documented key by key in
// docs/cli.md (kappa, verify) and docs/checkpoints.md (analyze); the key names are a stable
// interface. Every command writes through these: `kappa` (kappa_json), `analyze`, `demo`,
// `merge` and spectral-cond-mpi (analysis_json.cpp, json_text), `verify` and the Python
// package's verify (verify_json). Non-finite numbers are the strings "inf", "-inf" and "nan",
// since JSON has no literal for them.
//
// A writer gives every field of its result; where a report documents fewer (analyze's COND, or
// the flat Theorem 3.4 of `kappa --bound`), it takes them from the writer's object, so that a
// value is written one way only.
//
// Header-only and free of the CLI's other parts, so that tests/test_verify.cpp and the Python
// extension can use it.
#pragma once

#include <spectral_cond/conditioning/bound.hpp>
#include "verify_types.hpp"

#include <nlohmann/json.hpp>

#include <cmath>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

namespace spectral_cond::engine {

/// A number, or "inf" / "-inf" / "nan" for the values JSON cannot hold.
inline nlohmann::json json_number(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return v;
}

/// The text of a JSON document as every command writes it: indented by 2, one newline at the
/// end, invalid UTF-8 in strings (a tensor name) replaced.
inline std::string json_text(const nlohmann::json& doc) {
  return doc.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

/// The members `keys` of the object `j`: the part of a result that a report documents.
inline nlohmann::json only(const nlohmann::json& j, std::initializer_list<const char*> keys) {
  nlohmann::json out = nlohmann::json::object();
  for (const char* k : keys) out[k] = j.at(k);
  return out;
}

/// Every field of a ConditionResult (kappa.hpp) under its own name: sigma_max, sigma_min,
/// kappa, sigma_min_plus, kappa_plus, rank, rank_tol, sigma_dropped, rank_gap, rank_certain,
/// method, accuracy, iterations, residual, info, note.
inline nlohmann::json condition_json(const ConditionResult<double>& r) {
  return {{"sigma_max", json_number(r.sigma_max)},
          {"sigma_min", json_number(r.sigma_min)},
          {"kappa", json_number(r.kappa)},
          {"sigma_min_plus", json_number(r.sigma_min_plus)},
          {"kappa_plus", json_number(r.kappa_plus)},
          {"rank", r.rank},
          {"rank_tol", json_number(r.rank_tol)},
          {"sigma_dropped", json_number(r.sigma_dropped)},
          {"rank_gap", json_number(r.rank_gap)},
          {"rank_certain", r.rank_certain},
          {"method", r.method},
          {"accuracy", json_number(r.accuracy)},
          {"iterations", r.iterations},
          {"residual", json_number(r.residual)},
          {"info", to_string(r.info)},
          {"note", r.note}};
}

/// The fields of a condition_json object that analyze reports for every κ (docs/checkpoints.md,
/// COND): sigma_max, sigma_min, kappa, kappa_plus, rank, method, accuracy, info, note.
inline nlohmann::json condition_summary(const nlohmann::json& condition) {
  return only(condition, {"sigma_max", "sigma_min", "kappa", "kappa_plus", "rank", "method",
                          "accuracy", "info", "note"});
}

inline nlohmann::json condition_summary_json(const ConditionResult<double>& r) {
  return condition_summary(condition_json(r));
}

/// The factors of Theorem 3.4 (MATH.md §5) in a report, by name: X, Lambda, WQ, WK, WV, P, and
/// J's blocks JQ, JK, JV when the report has them.
inline std::vector<std::pair<std::string, const ConditionResult<double>*>> theorem34_factors(
    const Theorem34Report& t) {
  std::vector<std::pair<std::string, const ConditionResult<double>*>> f = {
      {"X", &t.X}, {"Lambda", &t.Lambda}, {"WQ", &t.WQ}, {"WK", &t.WK}, {"WV", &t.WV}, {"P", &t.P}};
  if (t.have_blocks) f.insert(f.end(), {{"JQ", &t.JQ}, {"JK", &t.JK}, {"JV", &t.JV}});
  return f;
}

/// A Theorem34Report (bound.hpp): "kappa_<F>" for every factor F (its condition_json), and the
/// bound: applies, bound, bound_plus, ratio, ratio_plus, holds, holds_plus, vacuous, verdict.
/// κ(J), the attention diagnostics and the bound without hypothesis have writers of their own.
inline nlohmann::json theorem34_json(const Theorem34Report& t) {
  nlohmann::json j = {{"applies", t.bound_applies},
                      {"bound", json_number(t.bound)},
                      {"bound_plus", json_number(t.bound_plus)},
                      {"ratio", json_number(t.ratio)},
                      {"ratio_plus", json_number(t.ratio_plus)},
                      {"holds", t.holds},
                      {"holds_plus", t.holds_plus},
                      {"vacuous", t.vacuous},
                      {"verdict", t.verdict}};
  for (const auto& [name, r] : theorem34_factors(t)) j["kappa_" + name] = condition_json(*r);
  return j;
}

/// The classification of Theorem 3.4 with kappa_plus against rounding (verify_types.hpp):
/// verdict_plus, kappa_plus_accuracy, bound_plus_accuracy.
inline nlohmann::json classification_json(const BoundClassification& c) {
  return {{"verdict_plus", to_string(c.verdict)},
          {"kappa_plus_accuracy", json_number(c.acc_J)},
          {"bound_plus_accuracy", json_number(c.acc_bound)}};
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
          {"forced_rows", p.forced},
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

/// The JSON of `spectral-cond kappa` (docs/cli.md): "input" ("matrix" or "attention"), "rows"
/// and "cols" of the matrix whose κ it is (M or J), its condition_json fields, and with `bound`
/// (attention inputs of sizes `shape`) Theorem 3.4 flat beside them: "kappa_<F>" and
/// "kappa_plus_<F>" for every factor F, the bound's fields but "applies" (these inputs have no
/// biases or RoPE), the classification, "attention" and "bound_free".
inline nlohmann::json kappa_json(const std::string& input, Index rows, Index cols,
                                 const ConditionResult<double>& r,
                                 const Theorem34Report* bound = nullptr,
                                 const VerifyShape& shape = {}) {
  nlohmann::json j = condition_json(r);
  j["input"] = input;
  j["rows"] = rows;
  j["cols"] = cols;
  if (bound == nullptr) return j;
  const nlohmann::json t = theorem34_json(*bound);
  for (auto it = t.begin(); it != t.end(); ++it) {
    if (it.key() == "applies") continue;
    if (!it->is_object()) {
      j[it.key()] = *it;
      continue;
    }
    const std::string factor = it.key().substr(std::string("kappa_").size());
    j["kappa_" + factor] = it->at("kappa");
    j["kappa_plus_" + factor] = it->at("kappa_plus");
  }
  j.update(classification_json(classify_theorem34_plus(*bound, shape)));
  if (bound->have_diagnostics) {
    j["attention"] = diagnostics_json(bound->diagnostics);
    j["bound_free"] = free_bound_json(bound->free_bound, r);
  }
  return j;
}

/// The counts of one statement's checks in `verify` (CheckCounts).
inline nlohmann::json counts_json(const CheckCounts& c) {
  return {
      {"held", c.held},           {"violated", c.violated},   {"not_applicable", c.not_applicable},
      {"rechecked", c.rechecked}, {"artefacts", c.artefacts}, {"unresolved", c.unresolved}};
}

/// A regime of `verify` by its dimensions.
inline nlohmann::json regime_json(const VerifyRegime& r) {
  return {{"shape_class", to_string(r.shape)},
          {"c", to_string(r.c)},
          {"weight_scale", to_string(r.weights)},
          {"mask", to_string(r.mask)},
          {"lambda", json_number(r.lambda)}};
}

/// Theorem 3.4 over a set of instances of `verify` (RegimeStats: one regime, or the whole sweep
/// from combined()): the float64 counts with kappa and kappa_plus, the ratios, the collapsed
/// instances, and under "final" the counts after the extended-precision re-checks.
inline nlohmann::json theorem34_counts_json(const RegimeStats& s) {
  return {{"instances", s.instances},
          {"held", s.held},
          {"violated", s.violated},
          {"vacuous", s.vacuous},
          {"held_plus", s.held_plus},
          {"violated_plus", s.violated_plus},
          {"inconclusive_plus", s.inconclusive_plus},
          {"kappa_J_infinite", s.kappa_J_infinite},
          {"worst_ratio_plus", json_number(s.worst_ratio_plus)},
          {"max_ratio_plus", json_number(s.max_ratio_plus)},
          {"collapsed", s.collapsed},
          {"final",
           {{"held", s.final_held},
            {"violated", s.final_violated},
            {"inconclusive", s.final_inconclusive},
            {"unresolved", s.final_unresolved},
            {"unchecked", s.final_unchecked},
            {"rechecked", s.rechecked},
            {"rank_uncertain", s.rank_uncertain},
            {"artefacts", s.artefacts},
            {"missed", s.missed},
            {"worst_real_ratio", json_number(s.worst_real_ratio)}}}};
}

/// One regime of `verify`: its dimensions, theorem34_counts_json, and what only a regime has
/// (the plain worst ratio, failed proven checks, κ(J) before and after λ).
inline nlohmann::json regime_stats_json(const RegimeStats& s) {
  nlohmann::json r = theorem34_counts_json(s);
  r.update(regime_json(s.regime));
  r["worst_ratio"] = json_number(s.worst_ratio);
  r["proven_failures"] = s.proven_failures;
  r["median_kappa_J_before"] = json_number(s.median_kappa_J_before);
  r["median_kappa_J_after"] = json_number(s.median_kappa_J_after);
  r["lowered"] = s.lowered;
  return r;
}

/// One failed check of `verify`, with what rebuilds its instance.
inline nlohmann::json violation_json(const VerifyViolation& v) {
  nlohmann::json e = regime_json(v.regime);
  e.update({{"statement", v.statement},
            {"proven", v.proven},
            {"seed", v.seed},
            {"N", v.shape.N},
            {"D", v.shape.D},
            {"d_k", v.shape.d_k},
            {"d_v", v.shape.d_v},
            {"c_value", json_number(v.c)},
            {"weight_scale_value", json_number(v.weight_scale)},
            {"matrix", v.matrix},
            {"lhs", json_number(v.lhs)},
            {"rhs", json_number(v.rhs)},
            {"detail", v.detail},
            {"classification", v.classification},
            {"exact_ratio", json_number(v.exact_ratio)},
            {"exact_ratio_text", v.exact_ratio_text},
            {"digits", v.digits},
            {"extended_detail", v.extended_detail}});
  return e;
}

/// The JSON of `spectral-cond verify` (see docs/cli.md for every key).
inline nlohmann::json verify_json(const VerifyReport& rep) {
  nlohmann::json regimes = nlohmann::json::array(), violations = nlohmann::json::array();
  for (const RegimeStats& s : rep.regimes) regimes.push_back(regime_stats_json(s));
  for (const VerifyViolation& v : rep.violations) violations.push_back(violation_json(v));
  return {{"seed", rep.seed},
          {"instances_per_regime", rep.instances_per_regime},
          {"instances", rep.instances},
          {"proven_ok", rep.proven_ok()},
          {"proven",
           {{"theorem35", counts_json(rep.theorem35)},
            {"theorem35_target", counts_json(rep.theorem35_target)},
            {"weyl", counts_json(rep.weyl)},
            {"kronecker", counts_json(rep.kronecker)},
            {"concatenation", counts_json(rep.concatenation)},
            {"concatenation_J", counts_json(rep.concatenation_J)},
            {"bound_free", counts_json(rep.bound_free)}}},
          {"theorem34", theorem34_counts_json(combined(rep.regimes))},
          {"regimes", regimes},
          {"violations", violations}};
}

}  // namespace spectral_cond::engine
