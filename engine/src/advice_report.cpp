// spectral-cond advise: the three output formats of the λ advisor (advice_format.hpp), documented
// key by key in docs/cli.md ("advise").
#include <spectral_cond/engine/advice_format.hpp>
#include <spectral_cond/engine/csv_text.hpp>
#include <spectral_cond/engine/number_text.hpp>
#include <spectral_cond/engine/report_json.hpp>

#include <nlohmann/json.hpp>

#include <sstream>
#include <string>
#include <vector>

namespace spectral_cond::engine {
namespace {

nlohmann::json choice_json(const AdviceChoice& c) {
  return {{"found", c.found},
          {"lambda", json_number(c.lambda)},
          {"placement", c.placement},
          {"kappa_J", json_number(c.kappa_J)},
          {"baseline_kappa_J", json_number(c.baseline_kappa_J)},
          {"reason", c.reason}};
}

nlohmann::json point_json(const AdvicePoint& p) {
  return {{"lambda", json_number(p.lambda)},
          {"placement", p.placement},
          {"kappa_WQ", json_number(p.kappa_W[0].kappa)},
          {"kappa_WK", json_number(p.kappa_W[1].kappa)},
          {"kappa_WV", json_number(p.kappa_W[2].kappa)},
          {"J", condition_json(p.J)},
          {"attention", diagnostics_json(p.diagnostics)},
          {"bound_free", free_bound_json(p.free_bound, p.J)},
          {"admissible", p.admissible},
          {"reason", p.reason},
          {"same_as", p.same_as},
          {"seconds", json_number(p.seconds)}};
}

nlohmann::json head_json(const HeadAdvice& a, const std::vector<std::string>& placements) {
  nlohmann::json onsets = nlohmann::json::array();
  for (std::size_t i = 0; i < placements.size(); ++i)
    onsets.push_back({{"placement", placements[i]},
                      {"predicted", json_number(a.predicted_onset[i])},
                      {"measured", json_number(a.measured_onset[i])},
                      {"token_variance", json_number(a.token_variance[i])}});
  nlohmann::json points = nlohmann::json::array();
  for (const AdvicePoint& p : a.points) points.push_back(point_json(p));
  return {{"head", a.position.head},
          {"kv_head", a.position.head / (a.position.heads / a.position.kv())},
          {"N", a.N},
          {"D", a.D},
          {"d_k", a.d_k},
          {"d_v", a.d_v},
          {"scale", json_number(a.scale)},
          {"weyl_threshold",
           {{"W_Q", json_number(a.weyl_threshold[0])},
            {"W_K", json_number(a.weyl_threshold[1])},
            {"W_V", json_number(a.weyl_threshold[2])}}},
          {"onsets", onsets},
          {"best", choice_json(a.best)},
          {"baseline", a.baseline},
          {"points", points}};
}

/// `s` padded with spaces to `width` (one space at least).
std::string advice_pad(const std::string& s, std::size_t width) {
  return s + std::string(s.size() + 1 < width ? width - s.size() : 1, ' ');
}

std::vector<std::string> placement_names(const AdviceOptions& o) {
  std::vector<std::string> out;
  for (const CorrectionPlacement& p : o.placements) out.push_back(p.name());
  return out;
}

}  // namespace

std::string advice_json(const std::vector<CheckpointReport>& reps, const AnalysisOptions& o,
                        const AdviceChoice& best, const std::string& sampling) {
  const AdviceOptions& a = *o.advice;
  const std::vector<std::string> names = placement_names(a);
  nlohmann::json lambdas = nlohmann::json::array();
  for (const double l : a.lambdas) lambdas.push_back(json_number(l));
  nlohmann::json checkpoints = nlohmann::json::array();
  for (const CheckpointReport& rep : reps) {
    nlohmann::json layers = nlohmann::json::array();
    for (const LayerStats& L : rep.layers) {
      nlohmann::json heads = nlohmann::json::array();
      for (const HeadAdvice& h : L.advice) heads.push_back(head_json(h, names));
      layers.push_back({{"layer", L.spec.index},
                        {"tokens", L.tokens},
                        {"causal", L.causal},
                        {"note", L.note},
                        {"heads", heads}});
    }
    checkpoints.push_back({{"path", rep.path},
                           {"layout", io::to_string(rep.layout)},
                           {"inputs", rep.inputs},
                           {"tokens", rep.tokens},
                           {"layers", layers}});
  }
  const nlohmann::json doc = {{"advice",
                               {{"format_version", kAdviseFormatVersion},
                                {"lambdas", lambdas},
                                {"placements", names},
                                {"max_saturated_fraction", json_number(a.max_saturated_fraction)},
                                {"min_qk_ratio", json_number(a.min_qk_ratio)},
                                {"method", to_string(a.jacobian.method)},
                                {"tol", json_number(a.jacobian.tol)},
                                {"sampling", sampling},
                                {"best", choice_json(best)},
                                {"checkpoints", checkpoints}}}};
  return json_text(doc);
}

std::string advice_csv(const std::vector<CheckpointReport>& reps) {
  std::ostringstream o;
  o << "checkpoint,layer,head,lambda,placement,kappa_WQ,kappa_WK,kappa_WV,kappa_J,kappa_plus_J,"
       "rank_J,method,accuracy,info,bound_free,saturated_fraction,row_max_mean,entropy_mean,"
       "ratio_QK_V,collapsed,admissible,reason\n";
  for (const CheckpointReport& rep : reps)
    for (const LayerStats& L : rep.layers)
      for (const HeadAdvice& h : L.advice)
        for (const AdvicePoint& p : h.points) {
          const AttentionPattern& pat = p.diagnostics.pattern;
          o << csv_field(rep.path) << ',' << L.spec.index << ',' << h.position.head << ','
            << csv_number(p.lambda) << ',' << csv_field(p.placement) << ','
            << csv_number(p.kappa_W[0].kappa) << ',' << csv_number(p.kappa_W[1].kappa) << ','
            << csv_number(p.kappa_W[2].kappa) << ',' << csv_number(p.J.kappa) << ','
            << csv_number(p.J.kappa_plus) << ',' << p.J.rank << ',' << csv_field(p.J.method) << ','
            << csv_number(p.J.accuracy) << ',' << to_string(p.J.info) << ','
            << csv_number(p.free_bound.bound) << ',' << csv_number(pat.saturated_fraction) << ','
            << csv_number(pat.row_max_mean) << ',' << csv_number(pat.entropy_mean) << ','
            << csv_number(p.diagnostics.norms.ratio_QK_V) << ','
            << (p.diagnostics.collapsed ? "true" : "false") << ','
            << (p.admissible ? "true" : "false") << ',' << csv_field(p.reason) << '\n';
        }
  return o.str();
}

std::string advice_table(const std::vector<CheckpointReport>& reps, const AnalysisOptions& o,
                         const AdviceChoice& best, const std::string& sampling) {
  const std::vector<std::string> names = placement_names(*o.advice);
  std::ostringstream t;
  auto num = [](double x) { return number_text(x, 4); };
  for (const CheckpointReport& rep : reps) {
    t << rep.path << " (" << io::to_string(rep.layout) << "; X: " << rep.inputs << ")\n";
    for (const LayerStats& L : rep.layers)
      for (const HeadAdvice& h : L.advice) {
        t << "\nlayer " << L.spec.index << " head " << h.position.head << " (N " << h.N << ", D "
          << h.D << ", d_k " << h.d_k << (L.causal ? ", causal" : "") << ")\n";
        t << "  " << advice_pad("placement", 14) << advice_pad("lambda", 8)
          << advice_pad("kappa(J)", 10) << advice_pad("method", 10) << advice_pad("sat%", 7)
          << advice_pad("QK/V", 12) << "admissible\n";
        for (const AdvicePoint& p : h.points) {
          const double sat = 100 * p.diagnostics.pattern.saturated_fraction;
          t << "  " << advice_pad(p.placement, 14) << advice_pad(num(p.lambda), 8)
            << advice_pad(num(p.J.kappa), 10)
            << advice_pad(p.J.method.substr(0, p.J.method.find(' ')), 10) << advice_pad(num(sat), 7)
            << advice_pad(num(p.diagnostics.norms.ratio_QK_V), 12)
            << (p.admissible ? "yes" : "no: " + p.reason) << '\n';
        }
        for (std::size_t i = 0; i < names.size(); ++i)
          t << "  onset of saturation, " << names[i] << ": predicted " << num(h.predicted_onset[i])
            << ", measured " << num(h.measured_onset[i]) << '\n';
        t << "  this head: " << h.best.reason << '\n';
      }
  }
  t << "\nsampling: " << sampling << "\nrecommendation: " << best.reason << '\n';
  t << "(a point is admissible while at most " << num(100 * o.advice->max_saturated_fraction)
    << "% of the rows of P are saturated and ||J_QK||/||J_V|| stays above "
    << num(o.advice->min_qk_ratio) << " x its lambda = 0 value; MATH.md section 17)\n";
  return t.str();
}

}  // namespace spectral_cond::engine
