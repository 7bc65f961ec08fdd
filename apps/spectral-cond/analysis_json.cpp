// spectral-cond: the JSON of `analyze` and `demo` (analysis_format.hpp; keys in
// docs/checkpoints.md). Numbers are written with round-trip precision; +inf and -inf are the
// strings "inf" and "-inf", NaN (undefined) is "nan" (as in docs/cli.md).
#include "analysis_format.hpp"
#include "report_json.hpp"

#include <string>
#include <vector>

namespace spectral_cond::cli {
namespace {

nlohmann::json num(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  return x;
}

nlohmann::json corrected_json(const CorrectedKappa& c) {
  return {{"sigma_max", num(c.sigma_max)},
          {"sigma_min", num(c.sigma_min)},
          {"kappa", num(c.kappa)},
          {"weyl_applies", c.weyl_applies},
          {"weyl_bound", num(c.weyl_bound)},
          {"weyl_holds", c.weyl_applies ? nlohmann::json(c.kappa <= c.weyl_bound * (1 + 1e-12))
                                        : nlohmann::json(nullptr)}};
}

nlohmann::json cond_json(const ConditionResult<double>& c) {
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

nlohmann::json matrix_json(const MatrixStats& m) {
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

nlohmann::json jacobian_json(const JacobianStats& j) {
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
void model_json(const LayerModel& m, Index d_k, nlohmann::json& l) {
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

nlohmann::json shape_json(const MatrixStats& m, Index rows, Index cols) {
  nlohmann::json j = matrix_json(m);
  j["shape"] = {rows, cols};
  return j;
}

/// One checkpoint's JSON object. `shard_form` (a --shard report): every layer whose κ(J) was
/// asked has "jacobian" and its model fields even where all its heads are in other shards, so
/// that shards merge field by field (merge.hpp).
nlohmann::json checkpoint_json(const CheckpointReport& rep, bool shard_form = false) {
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

}  // namespace

/// The text of an analyze JSON document (also of merged shards: merge.hpp).
std::string analyze_json_text(const nlohmann::json& doc) {
  return doc.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

/// The whole JSON document for several checkpoints. With shard_count > 1 (--shard i/n) it
/// carries "shard": {"index": i, "count": n} and the shard form of report_json.
std::string reports_json(const std::vector<CheckpointReport>& reps, std::uint64_t shard_index,
                         std::uint64_t shard_count) {
  nlohmann::json all = nlohmann::json::array();
  for (const auto& r : reps) all.push_back(checkpoint_json(r, shard_count > 1));
  nlohmann::json doc = {{"tool", "spectral-cond analyze"},
                        {"format_version", kAnalyzeFormatVersion},
                        {"checkpoints", all}};
  if (shard_count > 1) doc["shard"] = {{"index", shard_index}, {"count", shard_count}};
  return analyze_json_text(doc);
}

}  // namespace spectral_cond::cli
