// spectral-cond: the three output formats of `analyze` (json, csv, table), documented field by
// field in docs/checkpoints.md. JSON numbers are written with round-trip precision; +inf and
// -inf are the strings "inf" and "-inf", NaN (undefined) is "nan" (as in docs/cli.md).
#pragma once

#include "analysis.hpp"
#include "number_text.hpp"
#include "report_json.hpp"

#include <nlohmann/json.hpp>

#include <cmath>
#include <iomanip>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace spectral_cond::cli {

/// The version of the JSON and CSV layouts; bumped on any incompatible change.
inline constexpr int kAnalyzeFormatVersion = 2;

/// Significant digits of the tables' numbers.
inline constexpr int kTableDigits = 4;

namespace detail_fmt {

inline nlohmann::json num(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  return x;
}

inline nlohmann::json corrected_json(const CorrectedKappa& c) {
  return {{"sigma_max", num(c.sigma_max)},
          {"sigma_min", num(c.sigma_min)},
          {"kappa", num(c.kappa)},
          {"weyl_applies", c.weyl_applies},
          {"weyl_bound", num(c.weyl_bound)},
          {"weyl_holds", c.weyl_applies ? nlohmann::json(c.kappa <= c.weyl_bound * (1 + 1e-12))
                                        : nlohmann::json(nullptr)}};
}

inline nlohmann::json cond_json(const ConditionResult<double>& c) {
  return {{"sigma_max", num(c.sigma_max)},
          {"sigma_min", num(c.sigma_min)},
          {"kappa", num(c.kappa)},
          {"kappa_plus", num(c.kappa_plus)},
          {"rank", c.rank},
          {"method", c.method},
          {"accuracy", num(c.accuracy)},
          {"info", to_string(c.info)},
          {"note", c.note}};
}

inline nlohmann::json matrix_json(const MatrixStats& m) {
  return {{"tensor", m.tensor},
          {"dtype", io::to_string(m.dtype)},
          {"sigma_max", num(m.cond.sigma_max)},
          {"sigma_min", num(m.cond.sigma_min)},
          {"kappa", num(m.cond.kappa)},
          {"rank", m.cond.rank},
          {"svd", m.cond.method},
          {"lambda_fused", corrected_json(m.fused)},
          {"lambda_per_head", corrected_json(m.per_head)},
          {"exact",
           {{"kappa", num(m.exact_kappa)},
            {"predicted", num(m.exact_predicted)},
            {"alpha", num(m.exact_alpha)}}}};
}

inline nlohmann::json jacobian_json(const JacobianStats& j) {
  const Theorem34Report& r = j.report;
  nlohmann::json out = {{"head", j.head},
                        {"kv_head", j.kv_head},
                        {"seconds", j.seconds},
                        {"J", cond_json(r.J)},
                        {"theorem34",
                         {{"kappa_X", cond_json(r.X)},
                          {"kappa_Lambda", cond_json(r.Lambda)},
                          {"kappa_WQ", cond_json(r.WQ)},
                          {"kappa_WK", cond_json(r.WK)},
                          {"kappa_WV", cond_json(r.WV)},
                          {"kappa_P", cond_json(r.P)},
                          {"applies", r.bound_applies},
                          {"bound", num(r.bound)},
                          {"bound_plus", num(r.bound_plus)},
                          {"ratio", num(r.ratio)},
                          {"ratio_plus", num(r.ratio_plus)},
                          {"holds", r.holds},
                          {"holds_plus", r.holds_plus},
                          {"vacuous", r.vacuous},
                          {"verdict", r.verdict}}}};
  if (r.have_blocks)
    out["blocks"] = {{"J_Q", cond_json(r.JQ)}, {"J_K", cond_json(r.JK)}, {"J_V", cond_json(r.JV)}};
  if (r.have_diagnostics) {
    out["attention"] = diagnostics_json(r.diagnostics);
    out["bound_free"] = free_bound_json(r.free_bound, r.J);
  }
  if (!j.corrected.empty()) {
    nlohmann::json c = nlohmann::json::object();
    for (const CorrectedJacobian& cj : j.corrected) {
      const Theorem34Report& t = cj.report;
      nlohmann::json e = {{"unchanged", cj.unchanged},
                          {"seconds", cj.seconds},
                          {"J", cond_json(t.J)},
                          {"theorem34",
                           {{"applies", t.bound_applies},
                            {"bound_plus", num(t.bound_plus)},
                            {"ratio_plus", num(t.ratio_plus)},
                            {"holds_plus", t.holds_plus}}}};
      if (t.have_diagnostics) {
        e["attention"] = diagnostics_json(t.diagnostics);
        e["bound_free"] = free_bound_json(t.free_bound, t.J);
      }
      c[cj.correction] = e;
    }
    out["corrected"] = c;
  }
  return out;
}

/// What the Jacobian analysis of a layer modelled beyond W (MATH.md §10): "biases" (b_Q, b_K,
/// b_V: the tensor, or null; "zero" lists those that are all zeros and so left out) and "rope"
/// (null, or pairing, theta, dims and where they came from).
inline void model_json(const LayerModel& m, Index d_k, nlohmann::json& l) {
  static const char* names[] = {"b_Q", "b_K", "b_V"};
  nlohmann::json b = nlohmann::json::object(), zero = nlohmann::json::array();
  for (std::size_t i = 0; i < 3; ++i) {
    b[names[i]] =
        m.bias_tensors[i].empty() ? nlohmann::json(nullptr) : nlohmann::json(m.bias_tensors[i]);
    if (m.bias_zero[i]) zero.push_back(names[i]);
  }
  b["zero"] = zero;
  l["biases"] = b;
  if (m.rope)
    l["rope"] = {{"pairing", to_string(m.rope->pairing)},
                 {"theta", m.rope->theta},
                 {"dims", m.rope->resolved_dims(d_k)},
                 {"source", m.rope_source}};
  else
    l["rope"] = nullptr;
  if (!m.rope && !m.rope_source.empty()) l["rope_source"] = m.rope_source;
}

/// The same for the table: "kappa(J) with biases b_Q, b_V and RoPE rotate_half (theta 10000, 64
/// of 64 columns; from config.json)", or "kappa(J) without biases or RoPE".
inline std::string model_text(const LayerStats& L) {
  static const char* names[] = {"b_Q", "b_K", "b_V"};
  const LayerModel& m = L.model;
  std::string b, z;
  for (std::size_t i = 0; i < 3; ++i) {
    if (m.bias_tensors[i].empty()) continue;
    std::string& t = m.bias_zero[i] ? z : b;
    t += (t.empty() ? "" : ", ") + std::string(names[i]);
  }
  std::ostringstream o;
  o << "kappa(J) " << (b.empty() ? "without biases" : "with biases " + b);
  if (!z.empty()) o << " (" << z << " all zero, left out)";
  if (m.rope) {
    o << (b.empty() ? ", with" : " and") << " RoPE " << to_string(m.rope->pairing) << " (theta "
      << number_text(m.rope->theta, 6) << ", " << m.rope->resolved_dims(L.heads.d_k) << " of "
      << L.heads.d_k << " columns; " << m.rope_source << ")";
  } else {
    o << (b.empty() ? " or RoPE" : ", without RoPE");
    if (!m.rope_source.empty()) o << " (" << m.rope_source << ")";
  }
  return o.str();
}

inline nlohmann::json shape_json(const MatrixStats& m, Index rows, Index cols) {
  nlohmann::json j = matrix_json(m);
  j["shape"] = {rows, cols};
  return j;
}

}  // namespace detail_fmt

/// One checkpoint's JSON object. `shard_form` (a --shard report): every layer whose κ(J) was
/// asked has "jacobian" and its model fields even where all its heads are in other shards, so
/// that shards merge field by field (merge.hpp).
inline nlohmann::json report_json(const CheckpointReport& rep, bool shard_form = false) {
  using namespace detail_fmt;
  nlohmann::json layers = nlohmann::json::array();
  for (const LayerStats& L : rep.layers) {
    const Index D = L.spec.D;
    nlohmann::json l = {{"index", L.spec.index},
                        {"prefix", L.spec.prefix},
                        {"D", D},
                        {"heads", L.heads.heads},
                        {"kv_heads", L.heads.kv_heads},
                        {"d_k", L.heads.d_k},
                        {"d_v", L.heads.d_v},
                        {"W_Q", shape_json(L.q, D, L.spec.q.width)},
                        {"W_K", shape_json(L.k, D, L.spec.k.width)},
                        {"W_V", shape_json(L.v, D, L.spec.v.width)}};
    l["attention"] = L.spec.cross ? "cross" : "self";
    if (L.tokens > 0) l["tokens"] = L.tokens;
    if (!L.shared_by.empty()) l["shared_by"] = L.shared_by;
    if (!L.note.empty()) l["note"] = L.note;
    if (!L.per_head.empty()) {
      nlohmann::json hs = nlohmann::json::array();
      for (const HeadStats& h : L.per_head)
        hs.push_back({{"head", h.head},
                      {"kv_head", h.kv_head},
                      {"W_Q", shape_json(h.q, D, L.heads.d_k)},
                      {"W_K", shape_json(h.k, D, L.heads.d_k)},
                      {"W_V", shape_json(h.v, D, L.heads.d_v)}});
      l["per_head"] = hs;
    }
    if (!L.jacobian.empty() || (shard_form && L.jacobian_analyzed)) {
      model_json(L.model, L.heads.d_k, l);
      nlohmann::json js = nlohmann::json::array();
      for (const JacobianStats& j : L.jacobian) js.push_back(jacobian_json(j));
      l["jacobian"] = js;
    }
    layers.push_back(l);
  }
  return {{"path", rep.path},
          {"source", to_string(rep.kind)},
          {"layout", io::to_string(rep.layout)},
          {"heads_from", rep.head_config.source},
          {"lambda", rep.lambda},
          {"target", rep.target ? nlohmann::json(*rep.target) : nlohmann::json(nullptr)},
          {"tokens", rep.tokens},
          {"inputs", rep.inputs},
          {"scale", num(rep.scale)},
          {"mask", rep.causal ? "causal" : "none"},
          {"layers", layers}};
}

/// The text of an analyze JSON document (also of merged shards: merge.hpp).
inline std::string analyze_json_text(const nlohmann::json& doc) {
  return doc.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

/// The whole JSON document for several checkpoints. With shard_count > 1 (--shard i/n) it
/// carries "shard": {"index": i, "count": n} and the shard form of report_json.
inline std::string reports_json(const std::vector<CheckpointReport>& reps,
                                std::uint64_t shard_index = 0, std::uint64_t shard_count = 1) {
  nlohmann::json all = nlohmann::json::array();
  for (const auto& r : reps) all.push_back(report_json(r, shard_count > 1));
  nlohmann::json doc = {{"tool", "spectral-cond analyze"},
                        {"format_version", kAnalyzeFormatVersion},
                        {"checkpoints", all}};
  if (shard_count > 1) doc["shard"] = {{"index", shard_index}, {"count", shard_count}};
  return analyze_json_text(doc);
}

namespace detail_fmt {

/// A CSV number: round-trip digits, and an empty field for NaN (docs/checkpoints.md).
inline std::string csv_number(double x) {
  return std::isnan(x) ? "" : number_text(x, 17);
}

inline std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

}  // namespace detail_fmt

/// One CSV row per (checkpoint, layer, head, matrix) and per Jacobian (matrix "J").
inline std::string reports_csv(const std::vector<CheckpointReport>& reps) {
  using detail_fmt::csv_field;
  using detail_fmt::csv_number;
  std::ostringstream o;
  o << "checkpoint,layer,head,kv_head,matrix,tensor,rows,cols,sigma_max,sigma_min,kappa,"
       "kappa_plus,rank,kappa_lambda_fused,weyl_bound_fused,kappa_lambda_per_head,"
       "weyl_bound_per_head,kappa_exact,kappa_exact_predicted,method,bound,bound_plus,"
       "holds_plus,bound_free,bound_free_holds,row_max_min,row_max_mean,entropy_mean,"
       "saturated_fraction,saturated_diagonal,ratio_QK_V,collapsed\n";
  for (const auto& rep : reps) {
    for (const LayerStats& L : rep.layers) {
      auto row = [&](const std::string& head, const std::string& kv, const MatrixStats& m,
                     Index cols) {
        o << csv_field(rep.path) << ',' << L.spec.index << ',' << head << ',' << kv << ',' << m.role
          << ',' << csv_field(m.tensor) << ',' << L.spec.D << ',' << cols << ','
          << csv_number(m.cond.sigma_max) << ',' << csv_number(m.cond.sigma_min) << ','
          << csv_number(m.cond.kappa) << ',' << csv_number(m.cond.kappa_plus) << ',' << m.cond.rank
          << ',' << csv_number(m.fused.kappa) << ',' << csv_number(m.fused.weyl_bound) << ','
          << csv_number(m.per_head.kappa) << ',' << csv_number(m.per_head.weyl_bound) << ','
          << csv_number(m.exact_kappa) << ',' << csv_number(m.exact_predicted) << ','
          << m.cond.method << ",,,,,,,,,,,\n";
      };
      row("all", "all", L.q, L.spec.q.width);
      row("all", "all", L.k, L.spec.k.width);
      row("all", "all", L.v, L.spec.v.width);
      for (const HeadStats& h : L.per_head) {
        const std::string hh = std::to_string(h.head), kk = std::to_string(h.kv_head);
        row(hh, kk, h.q, L.heads.d_k);
        row(hh, kk, h.k, L.heads.d_k);
        row(hh, kk, h.v, L.heads.d_v);
      }
      auto jrow = [&](const JacobianStats& j, const std::string& matrix, const Theorem34Report& t) {
        const auto& J = t.J;
        o << csv_field(rep.path) << ',' << L.spec.index << ',' << j.head << ',' << j.kv_head << ','
          << matrix << ",," << jacobian_rows(L.tokens, L.heads.d_v) << ','
          << jacobian_cols(JacobianBlock::All, L.tokens, L.spec.D, L.heads.d_k, L.heads.d_v) << ','
          << csv_number(J.sigma_max) << ',' << csv_number(J.sigma_min) << ',' << csv_number(J.kappa)
          << ',' << csv_number(J.kappa_plus) << ',' << J.rank << ",,,,,,," << csv_field(J.method)
          << ',' << csv_number(t.bound) << ',' << csv_number(t.bound_plus) << ','
          << (!t.bound_applies ? "n/a"
              : t.holds_plus   ? "true"
                               : "false");
        if (t.have_diagnostics) {
          const AttentionPattern& p = t.diagnostics.pattern;
          o << ',' << csv_number(t.free_bound.bound) << ','
            << (free_bound_holds(t.free_bound, J) ? "true" : "false") << ','
            << csv_number(p.row_max_min) << ',' << csv_number(p.row_max_mean) << ','
            << csv_number(p.entropy_mean) << ',' << csv_number(p.saturated_fraction) << ','
            << p.saturated_diagonal << ',' << csv_number(t.diagnostics.norms.ratio_QK_V) << ','
            << (t.diagnostics.collapsed ? "true" : "false");
        } else {
          o << ",,,,,,,,,";
        }
        o << '\n';
      };
      for (const JacobianStats& j : L.jacobian) {
        jrow(j, "J", j.report);
        for (const CorrectedJacobian& c : j.corrected) jrow(j, "J+" + c.correction, c.report);
      }
    }
  }
  return o.str();
}

/// With --blocks: κ and κ₊ of J_Q, J_K and J_V of every head (MATH.md §5), as in JSON's "blocks".
inline std::string jacobian_blocks_table(const CheckpointReport& rep) {
  std::ostringstream o;
  bool any = false;
  for (const LayerStats& L : rep.layers)
    for (const JacobianStats& j : L.jacobian) any = any || j.report.have_blocks;
  if (!any) return std::string();
  o << "\nkappa of the Jacobian's blocks (--blocks; J = [J_Q | J_K | J_V], MATH.md §5):\n";
  o << std::left << std::setw(6) << "layer" << std::setw(6) << "head" << std::right << std::setw(12)
    << "kappa(J_Q)" << std::setw(12) << "kappa+(J_Q)" << std::setw(12) << "kappa(J_K)"
    << std::setw(12) << "kappa+(J_K)" << std::setw(12) << "kappa(J_V)" << std::setw(12)
    << "kappa+(J_V)" << '\n';
  for (const LayerStats& L : rep.layers)
    for (const JacobianStats& j : L.jacobian) {
      const Theorem34Report& t = j.report;
      if (!t.have_blocks) continue;
      o << std::left << std::setw(6) << L.spec.index << std::setw(6) << j.head << std::right;
      for (const ConditionResult<double>* c : {&t.JQ, &t.JK, &t.JV})
        o << std::setw(12) << number_text(c->kappa, kTableDigits) << std::setw(12)
          << number_text(c->kappa_plus, kTableDigits);
      o << '\n';
    }
  return o.str();
}

/// The table part of κ(J) before and after the corrections, the bound without hypothesis and
/// the attention pattern of every head (MATH.md §5, §11).
inline std::string jacobian_corrections_table(const CheckpointReport& rep) {
  std::ostringstream o;
  bool any_corr = false;
  for (const LayerStats& L : rep.layers)
    for (const JacobianStats& j : L.jacobian) any_corr = any_corr || !j.corrected.empty();
  if (any_corr) {
    o << "\nkappa(J) before and after the corrections (lambda = " << number_text(rep.lambda, 6)
      << "), with the bound without hypothesis b = sigma_max(J)/sigma_N(P X) (MATH.md §5; inf: "
         "N > D or P X singular):\n";
    o << std::left << std::setw(6) << "layer" << std::setw(6) << "head" << std::setw(18)
      << "weights" << std::right << std::setw(11) << "kappa(J)" << std::setw(11) << "kappa+(J)"
      << std::setw(11) << "b" << std::setw(11) << "kappa(X)" << std::setw(11) << "collapsed"
      << '\n';
  }
  for (const LayerStats& L : rep.layers)
    for (const JacobianStats& j : L.jacobian) {
      if (j.corrected.empty()) continue;
      auto row = [&](const std::string& what, const Theorem34Report& t) {
        o << std::left << std::setw(6) << L.spec.index << std::setw(6) << j.head << std::setw(18)
          << what << std::right << std::setw(11) << number_text(t.J.kappa, kTableDigits)
          << std::setw(11) << number_text(t.J.kappa_plus, kTableDigits) << std::setw(11)
          << (t.have_diagnostics ? number_text(t.free_bound.bound, kTableDigits) : std::string("-"))
          << std::setw(11) << number_text(t.X.kappa, kTableDigits) << std::setw(11)
          << (t.have_diagnostics ? (t.diagnostics.collapsed ? "YES" : "no") : "-") << '\n';
      };
      row("original", j.report);
      for (const CorrectedJacobian& c : j.corrected)
        row(c.correction == "lambda_fused"      ? "+lambda I fused"
            : c.correction == "lambda_per_head" ? "+lambda I per-head"
                                                : "exact",
            c.report);
    }
  o << "\nAttention pattern of each head (MATH.md §11): row max m_i = max_j P_ij, entropy H_i, "
       "saturated rows (m_i > 1 - 1e-6, on the diagonal),\nand ||J_QK||_2/||J_V||_2 (spectral "
       "norms, J_QK = [J_Q | J_K]):\n";
  o << std::left << std::setw(6) << "layer" << std::setw(6) << "head" << std::setw(18) << "weights"
    << std::right << std::setw(12) << "min m_i" << std::setw(12) << "mean m_i" << std::setw(12)
    << "mean H_i" << std::setw(12) << "saturated" << std::setw(12) << "diagonal" << std::setw(14)
    << "|J_QK|/|J_V|" << '\n';
  std::vector<std::string> notes;
  for (const LayerStats& L : rep.layers)
    for (const JacobianStats& j : L.jacobian) {
      auto row = [&](const std::string& what, const Theorem34Report& t) {
        if (!t.have_diagnostics) return;
        const AttentionPattern& p = t.diagnostics.pattern;
        o << std::left << std::setw(6) << L.spec.index << std::setw(6) << j.head << std::setw(18)
          << what << std::right << std::setw(12) << number_text(p.row_max_min, kTableDigits)
          << std::setw(12) << number_text(p.row_max_mean, kTableDigits) << std::setw(12)
          << number_text(p.entropy_mean, kTableDigits) << std::setw(12)
          << (std::to_string(p.saturated) + "/" + std::to_string(p.rows)) << std::setw(12)
          << p.saturated_diagonal << std::setw(14)
          << number_text(t.diagnostics.norms.ratio_QK_V, kTableDigits) << '\n';
        if (!t.diagnostics.note.empty())
          notes.push_back("layer " + std::to_string(L.spec.index) + " head " +
                          std::to_string(j.head) + " (" + what + "): " + t.diagnostics.note);
      };
      row("original", j.report);
      for (const CorrectedJacobian& c : j.corrected)
        if (!c.unchanged)
          row(c.correction == "lambda_fused"      ? "+lambda I fused"
              : c.correction == "lambda_per_head" ? "+lambda I per-head"
                                                  : "exact",
              c.report);
    }
  for (const std::string& n : notes) o << "  " << n << '\n';
  return o.str();
}

/// A human-readable table, with a legend.
inline std::string reports_table(const std::vector<CheckpointReport>& reps) {
  std::ostringstream o;
  auto weyl = [&](const CorrectedKappa& c) {
    return number_text(c.kappa, kTableDigits) +
           (c.weyl_applies ? " (<=" + number_text(c.weyl_bound, kTableDigits) + ")"
                           : " (no bound)");
  };
  for (const auto& rep : reps) {
    o << rep.path << ": " << to_string(rep.kind) << ", layout " << io::to_string(rep.layout) << ", "
      << rep.layers.size() << " layer(s) analysed, heads from " << rep.head_config.source
      << ", lambda = " << number_text(rep.lambda, 6) << "\n\n";
    o << std::left << std::setw(6) << "layer" << std::setw(6) << "head" << std::setw(5) << "W"
      << std::setw(11) << "shape" << std::right << std::setw(11) << "sigma_max" << std::setw(11)
      << "sigma_min" << std::setw(11) << "kappa" << std::setw(24) << "+lambda I fused"
      << std::setw(24) << "+lambda I per-head" << std::setw(10) << "exact" << '\n';
    for (const LayerStats& L : rep.layers) {
      auto row = [&](const std::string& head, const MatrixStats& m, Index cols) {
        o << std::left << std::setw(6) << L.spec.index << std::setw(6) << head << std::setw(5)
          << m.role.substr(2) << std::setw(11)
          << (std::to_string(L.spec.D) + "x" + std::to_string(cols)) << std::right << std::setw(11)
          << number_text(m.cond.sigma_max, kTableDigits) << std::setw(11)
          << number_text(m.cond.sigma_min, kTableDigits) << std::setw(11)
          << number_text(m.cond.kappa, kTableDigits) << std::setw(24) << weyl(m.fused)
          << std::setw(24) << weyl(m.per_head) << std::setw(10)
          << number_text(m.exact_kappa, kTableDigits) << '\n';
      };
      row("all", L.q, L.spec.q.width);
      row("all", L.k, L.spec.k.width);
      row("all", L.v, L.spec.v.width);
      for (const HeadStats& h : L.per_head) {
        row(std::to_string(h.head), h.q, L.heads.d_k);
        if (h.head % (L.heads.heads / L.heads.kv_heads) == 0) {
          row(std::to_string(h.head), h.k, L.heads.d_k);
          row(std::to_string(h.head), h.v, L.heads.d_v);
        }
      }
    }
    for (const LayerStats& L : rep.layers) {
      std::vector<std::string> parts;
      if (L.spec.cross && L.note.find("cross-attention") == std::string::npos)
        parts.push_back("cross-attention");
      if (!L.shared_by.empty()) parts.push_back("shared by " + L.shared_by);
      if (!L.note.empty()) parts.push_back(L.note);
      if (!L.jacobian.empty()) parts.push_back(detail_fmt::model_text(L));
      std::string what;
      for (const std::string& p : parts) what += (what.empty() ? "" : "; ") + p;
      if (!what.empty())
        o << "  layer " << L.spec.index << " (" << L.spec.prefix << "): " << what << '\n';
    }
    bool any_j = false, any_na = false;
    for (const LayerStats& L : rep.layers) any_j = any_j || !L.jacobian.empty();
    if (any_j) {
      std::set<Index> ns;
      for (const LayerStats& L : rep.layers)
        if (L.tokens > 0) ns.insert(L.tokens);
      o << "\nJacobian of each head ("
        << (ns.size() > 1 ? "N per layer, up to " + std::to_string(rep.tokens)
                          : "N = " + std::to_string(rep.tokens))
        << " tokens, " << rep.inputs << "), Theorem 3.4 with kappa_plus:\n";
      o << std::left << std::setw(6) << "layer" << std::setw(6) << "head" << std::right
        << std::setw(11) << "kappa(J)" << std::setw(11) << "kappa+(J)" << std::setw(7) << "rank"
        << std::setw(10) << "kappa(X)" << std::setw(10) << "k+(Lam)" << std::setw(10) << "k(W_Q)"
        << std::setw(10) << "k(W_K)" << std::setw(10) << "k(W_V)" << std::setw(10) << "k+(P)"
        << std::setw(11) << "bound+" << std::setw(7) << "holds"
        << "  method\n";
      for (const LayerStats& L : rep.layers)
        for (const JacobianStats& j : L.jacobian) {
          const Theorem34Report& r = j.report;
          std::string m = r.J.method;
          o << std::left << std::setw(6) << L.spec.index << std::setw(6) << j.head << std::right
            << std::setw(11) << number_text(r.J.kappa, kTableDigits) << std::setw(11)
            << number_text(r.J.kappa_plus, kTableDigits) << std::setw(7) << r.J.rank
            << std::setw(10) << number_text(r.X.kappa, kTableDigits) << std::setw(10)
            << number_text(r.Lambda.kappa_plus, kTableDigits) << std::setw(10)
            << number_text(r.WQ.kappa, kTableDigits) << std::setw(10)
            << number_text(r.WK.kappa, kTableDigits) << std::setw(10)
            << number_text(r.WV.kappa, kTableDigits) << std::setw(10)
            << number_text(r.P.kappa_plus, kTableDigits) << std::setw(11)
            << number_text(r.bound_plus, kTableDigits) << std::setw(7)
            << (!r.bound_applies ? "n/a"
                : r.holds_plus   ? "yes"
                                 : "NO")
            << "  " << m << " (" << number_text(j.seconds, 3) << " s)\n";
          any_na = any_na || !r.bound_applies;
        }
      if (any_na)
        o << "  n/a: Theorem 3.4 is stated for the block without biases or RoPE (MATH.md §10); "
             "kappa(J) is that of the block with them, and --no-biases --rope none gives the "
             "bound for the block without them\n";
    }
    if (any_j) o << jacobian_blocks_table(rep) << jacobian_corrections_table(rep);
    o << '\n';
  }
  return o.str();
}

}  // namespace spectral_cond::cli
