// spectral-cond: the table of `analyze` and `demo` (analysis_format.hpp; for people, its layout
// may change: docs/checkpoints.md).
#include <spectral_cond/engine/analysis_format.hpp>
#include <spectral_cond/engine/number_text.hpp>

#include <cmath>
#include <iomanip>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace spectral_cond::engine {
namespace {

/// A number in the tables: 4 significant digits, and an empty cell for NaN (a value that was
/// not computed), as in the CSV.
std::string table_number(double x) {
  return std::isnan(x) ? std::string() : number_text(x, 4);
}

/// The same for the table: "kappa(J) with biases b_Q, b_V and RoPE rotate_half (theta 10000, 64
/// of 64 columns; from config.json)", or "kappa(J) without biases or RoPE".
std::string model_text(const LayerStats& L) {
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

/// With --blocks: κ and κ₊ of J_Q, J_K and J_V of every head (MATH.md §5), as in JSON's "blocks".
std::string jacobian_blocks_table(const CheckpointReport& rep) {
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
        o << std::setw(12) << table_number(c->kappa) << std::setw(12)
          << table_number(c->kappa_plus);
      o << '\n';
    }
  return o.str();
}

/// A corrected variant's row label: "+lambda I fused", "+lambda I per-head", "exact", or
/// "+lambda I " and the --placements name ("+lambda I packed", "+lambda I fused:qk").
std::string correction_label(const std::string& correction) {
  if (correction == "lambda_per_head") return "+lambda I per-head";
  if (correction.rfind("lambda_", 0) == 0) return "+lambda I " + correction.substr(7);
  return correction;
}

/// The table part of κ(J) before and after the corrections, the bound without hypothesis and
/// the attention pattern of every head (MATH.md §5, §11).
std::string jacobian_corrections_table(const CheckpointReport& rep) {
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
          << what << std::right << std::setw(11) << table_number(t.J.kappa) << std::setw(11)
          << table_number(t.J.kappa_plus) << std::setw(11)
          << (t.have_diagnostics ? table_number(t.free_bound.bound) : std::string("-"))
          << std::setw(11) << table_number(t.X.kappa) << std::setw(11)
          << (t.have_diagnostics ? (t.diagnostics.collapsed ? "YES" : "no") : "-") << '\n';
      };
      row("original", j.report);
      for (const CorrectedJacobian& c : j.corrected) row(correction_label(c.correction), c.report);
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
          << what << std::right << std::setw(12) << table_number(p.row_max_min) << std::setw(12)
          << table_number(p.row_max_mean) << std::setw(12) << table_number(p.entropy_mean)
          << std::setw(12) << (std::to_string(p.saturated) + "/" + std::to_string(p.rows))
          << std::setw(12) << p.saturated_diagonal << std::setw(14)
          << table_number(t.diagnostics.norms.ratio_QK_V) << '\n';
        if (!t.diagnostics.note.empty())
          notes.push_back("layer " + std::to_string(L.spec.index) + " head " +
                          std::to_string(j.head) + " (" + what + "): " + t.diagnostics.note);
      };
      row("original", j.report);
      for (const CorrectedJacobian& c : j.corrected)
        if (!c.unchanged) row(correction_label(c.correction), c.report);
    }
  for (const std::string& n : notes) o << "  " << n << '\n';
  return o.str();
}

}  // namespace

/// A human-readable table, with a legend.
std::string reports_table(const std::vector<CheckpointReport>& reps) {
  std::ostringstream o;
  auto weyl = [&](const CorrectedKappa& c) {
    return table_number(c.kappa) +
           (c.weyl_applies ? " (<=" + table_number(c.weyl_bound) + ")" : " (no bound)");
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
          << table_number(m.cond.sigma_max) << std::setw(11) << table_number(m.cond.sigma_min)
          << std::setw(11) << table_number(m.cond.kappa) << std::setw(24) << weyl(m.fused)
          << std::setw(24) << weyl(m.per_head) << std::setw(10) << table_number(m.exact_kappa)
          << '\n';
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
      if (!L.jacobian.empty()) parts.push_back(model_text(L));
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
            << std::setw(11) << table_number(r.J.kappa) << std::setw(11)
            << table_number(r.J.kappa_plus) << std::setw(7) << r.J.rank << std::setw(10)
            << table_number(r.X.kappa) << std::setw(10) << table_number(r.Lambda.kappa_plus)
            << std::setw(10) << table_number(r.WQ.kappa) << std::setw(10)
            << table_number(r.WK.kappa) << std::setw(10) << table_number(r.WV.kappa)
            << std::setw(10) << table_number(r.P.kappa_plus) << std::setw(11)
            << table_number(r.bound_plus) << std::setw(7)
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

}  // namespace spectral_cond::engine
