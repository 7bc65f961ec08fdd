// spectral-cond: the JSON of `analyze` and `demo` (analysis_format.hpp; keys in
// docs/checkpoints.md). Numbers are written with round-trip precision; +inf and -inf are the
// strings "inf" and "-inf", NaN (undefined) is "nan" (as in docs/cli.md).
#include <spectral_cond/engine/analysis_format.hpp>
#include <spectral_cond/engine/report_json.hpp>

#include <string>
#include <vector>

namespace spectral_cond::engine {
namespace {

/// κ of W + λ E and its Weyl bound (CorrectedKappa, docs/checkpoints.md: CORRECTED).
nlohmann::json corrected_json(const CorrectedKappa& c) {
  return {{"sigma_max", json_number(c.sigma_max)},
          {"sigma_min", json_number(c.sigma_min)},
          {"kappa", json_number(c.kappa)},
          {"weyl_applies", c.weyl_applies},
          {"weyl_bound", json_number(c.weyl_bound)},
          {"weyl_holds", c.weyl_applies ? nlohmann::json(c.kappa <= c.weyl_bound * (1 + 1e-12))
                                        : nlohmann::json(nullptr)}};
}

/// A projection of `rows` x `cols` or a head's block of it (docs/checkpoints.md: MATRIX): the
/// part of its ConditionResult the table shows, the SVD that computed it, and the corrections.
nlohmann::json matrix_json(const MatrixStats& m, Index rows, Index cols) {
  nlohmann::json j = only(condition_json(m.cond), {"sigma_max", "sigma_min", "kappa", "rank"});
  j.update({{"tensor", m.tensor},
            {"dtype", io::to_string(m.dtype)},
            {"shape", {rows, cols}},
            {"svd", m.cond.method},
            {"lambda_fused", corrected_json(m.fused)},
            {"lambda_per_head", corrected_json(m.per_head)},
            {"exact",
             {{"kappa", json_number(m.exact_kappa)},
              {"predicted", json_number(m.exact_predicted)},
              {"alpha", json_number(m.exact_alpha)}}}});
  return j;
}

/// Theorem 3.4 of a head as analyze reports it (docs/checkpoints.md: JACOBIAN's "theorem34"):
/// theorem34_json with each factor's condition summary, J's blocks being in "blocks".
nlohmann::json head_theorem34_json(const Theorem34Report& t) {
  nlohmann::json j = theorem34_json(t);
  for (const char* block : {"kappa_JQ", "kappa_JK", "kappa_JV"}) j.erase(block);
  for (nlohmann::json& value : j)
    if (value.is_object()) value = condition_summary(value);
  return j;
}

/// What a head's entry and each of its corrected variants report: κ(J) ("J"), the time, the
/// attention pattern and the bound without hypothesis.
nlohmann::json head_report_json(const Theorem34Report& t, double seconds) {
  nlohmann::json j = {{"J", condition_summary_json(t.J)}, {"seconds", json_number(seconds)}};
  if (t.have_diagnostics) {
    j["attention"] = diagnostics_json(t.diagnostics);
    j["bound_free"] = free_bound_json(t.free_bound, t.J);
  }
  return j;
}

/// One head's κ(J) with Theorem 3.4, and after each correction (docs/checkpoints.md: JACOBIAN).
nlohmann::json jacobian_json(const JacobianStats& j) {
  const Theorem34Report& r = j.report;
  nlohmann::json out = head_report_json(r, j.seconds);
  out.update({{"head", j.head}, {"kv_head", j.kv_head}, {"theorem34", head_theorem34_json(r)}});
  if (r.have_blocks)
    out["blocks"] = {{"J_Q", condition_summary_json(r.JQ)},
                     {"J_K", condition_summary_json(r.JK)},
                     {"J_V", condition_summary_json(r.JV)}};
  if (j.corrected.empty()) return out;
  nlohmann::json& c = out["corrected"] = nlohmann::json::object();
  for (const CorrectedJacobian& cj : j.corrected) {
    nlohmann::json e = head_report_json(cj.report, cj.seconds);
    e["unchanged"] = cj.unchanged;
    e["theorem34"] =
        only(theorem34_json(cj.report), {"applies", "bound_plus", "ratio_plus", "holds_plus"});
    c[cj.correction] = e;
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
                 {"theta", json_number(m.rope->theta)},
                 {"dims", m.rope->resolved_dims(d_k)},
                 {"source", m.rope_source}};
  else
    l["rope"] = nullptr;
  if (!m.rope && !m.rope_source.empty()) l["rope_source"] = m.rope_source;
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
                        {"W_Q", matrix_json(L.q, D, L.spec.q.width)},
                        {"W_K", matrix_json(L.k, D, L.spec.k.width)},
                        {"W_V", matrix_json(L.v, D, L.spec.v.width)}};
    l["attention"] = L.spec.cross ? "cross" : "self";
    if (L.tokens > 0) l["tokens"] = L.tokens;
    if (L.jacobian_analyzed) l["mask"] = L.causal ? "causal" : "none";
    if (!L.shared_by.empty()) l["shared_by"] = L.shared_by;
    if (!L.note.empty()) l["note"] = L.note;
    if (!L.per_head.empty()) {
      nlohmann::json hs = nlohmann::json::array();
      for (const HeadStats& h : L.per_head)
        hs.push_back({{"head", h.head},
                      {"kv_head", h.kv_head},
                      {"W_Q", matrix_json(h.q, D, L.heads.d_k)},
                      {"W_K", matrix_json(h.k, D, L.heads.d_k)},
                      {"W_V", matrix_json(h.v, D, L.heads.d_v)}});
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
          {"lambda", json_number(rep.lambda)},
          {"target", rep.target ? json_number(*rep.target) : nlohmann::json(nullptr)},
          {"tokens", rep.tokens},
          {"inputs", rep.inputs},
          {"scale", json_number(rep.scale)},
          {"mask", rep.mask},
          {"layers", layers}};
}

}  // namespace

/// The whole JSON document for several checkpoints. With shard_count > 1 (--shard i/n) it
/// carries "shard": {"index": i, "count": n} and the shard form of report_json.
nlohmann::json reports_document(const std::vector<CheckpointReport>& reps,
                                std::uint64_t shard_index, std::uint64_t shard_count) {
  nlohmann::json all = nlohmann::json::array();
  for (const auto& r : reps) all.push_back(checkpoint_json(r, shard_count > 1));
  nlohmann::json doc = {{"tool", "spectral-cond analyze"},
                        {"format_version", kAnalyzeFormatVersion},
                        {"checkpoints", all}};
  if (shard_count > 1) doc["shard"] = {{"index", shard_index}, {"count", shard_count}};
  return doc;
}

std::string reports_json(const std::vector<CheckpointReport>& reps, std::uint64_t shard_index,
                         std::uint64_t shard_count) {
  return json_text(reports_document(reps, shard_index, shard_count));
}

std::vector<std::string> declined_kappa_j(const nlohmann::json& doc) {
  std::vector<std::string> out;
  const nlohmann::json none = nlohmann::json::array();
  const auto text = [](const nlohmann::json& v) {
    return v.is_string() ? v.get<std::string>() : v.dump();
  };
  const auto check = [&](const nlohmann::json& entry, const std::string& where) {
    if (!entry.is_object() || !entry.contains("J") || !entry["J"].is_object()) return;
    const nlohmann::json& J = entry["J"];
    const std::string info = J.contains("info") ? text(J["info"]) : "";
    const bool nan = J.contains("kappa") && J["kappa"] == "nan";
    if (info == "not_converging" || info == "inaccurate" || info == "too_large" ||
        info == "invalid_input" || nan)
      out.push_back(where + ": " + (info.empty() || info == "success" ? "kappa nan" : info));
  };
  const auto array = [&](const nlohmann::json& o, const char* key) -> const nlohmann::json& {
    return o.is_object() && o.contains(key) && o[key].is_array() ? o[key] : none;
  };
  for (const nlohmann::json& c : array(doc, "checkpoints"))
    for (const nlohmann::json& L : array(c, "layers"))
      for (const nlohmann::json& h : array(L, "jacobian")) {
        const std::string where = text(c.value("path", nlohmann::json("?"))) + " layer " +
                                  text(L.value("index", nlohmann::json("?"))) + " head " +
                                  text(h.value("head", nlohmann::json("?")));
        check(h, where);
        if (h.contains("corrected") && h["corrected"].is_object())
          for (const auto& v : h["corrected"].items())
            check(v.value(), where + " (" + v.key() + ")");
      }
  return out;
}

}  // namespace spectral_cond::engine
