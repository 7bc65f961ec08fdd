// spectral-cond: the CSV of `analyze` and `demo` (analysis_format.hpp; columns in
// docs/checkpoints.md).
#include <spectral_cond/engine/analysis_format.hpp>
#include <spectral_cond/engine/csv_text.hpp>

#include <cmath>
#include <sstream>
#include <string>
#include <vector>

namespace spectral_cond::engine {

/// One CSV row per (checkpoint, layer, head, matrix) and per Jacobian (matrix "J").
std::string reports_csv(const std::vector<CheckpointReport>& reps) {
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

}  // namespace spectral_cond::engine
