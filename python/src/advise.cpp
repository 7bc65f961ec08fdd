// spectral_cond._core.advise_head: the λ advisor of one head (conditioning/advisor.hpp, MATH.md
// §17), with its grid points, onsets and recommendation as plain Python values.
#include "binding.hpp"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace spectral_cond::python {
namespace {

nb::dict choice_dict(const AdviceChoice& c) {
  nb::dict out;
  out["found"] = c.found;
  out["lambda"] = c.lambda;
  out["placement"] = c.placement;
  out["kappa_J"] = c.kappa_J;
  out["baseline_kappa_J"] = c.baseline_kappa_J;
  out["reason"] = c.reason;
  return out;
}

nb::dict advice_dict(const HeadAdvice& a) {
  nb::dict out;
  out["head"] = int64_t(a.position.head);
  out["heads"] = int64_t(a.position.heads);
  out["kv_heads"] = int64_t(a.position.kv());
  out["N"] = int64_t(a.N);
  out["D"] = int64_t(a.D);
  out["d_k"] = int64_t(a.d_k);
  out["d_v"] = int64_t(a.d_v);
  out["scale"] = a.scale;
  out["baseline"] = int64_t(a.baseline);
  out["weyl_threshold"] = std::vector<double>(a.weyl_threshold.begin(), a.weyl_threshold.end());
  out["predicted_onset"] = a.predicted_onset;
  out["measured_onset"] = a.measured_onset;
  out["token_variance"] = a.token_variance;
  out["best"] = choice_dict(a.best);
  nb::list points;
  for (const AdvicePoint& p : a.points) {
    nb::dict d;
    d["lambda"] = p.lambda;
    d["placement"] = p.placement;
    d["kappa_WQ"] = p.kappa_W[0].kappa;
    d["kappa_WK"] = p.kappa_W[1].kappa;
    d["kappa_WV"] = p.kappa_W[2].kappa;
    d["J"] = to_dict(p.J);
    nb::dict diag = diagnostics_dict(p.diagnostics);
    diag["free_bound"] = free_bound_dict(p.free_bound);
    d["diagnostics"] = diag;
    d["same_as"] = int64_t(p.same_as);
    d["admissible"] = p.admissible;
    d["reason"] = p.reason;
    d["seconds"] = p.seconds;
    points.append(d);
  }
  out["points"] = points;
  return out;
}

nb::dict advise_head_py(const Array& X, const Array& WQ, const Array& WK, const Array& WV,
                        std::optional<double> scale, const nb::object& mask,
                        const nb::object& extras, int64_t head, int64_t heads, int64_t kv_heads,
                        const std::optional<std::vector<int64_t>>& packed_columns,
                        const std::vector<double>& lambdas,
                        const std::vector<std::string>& placements, double max_saturated_fraction,
                        double min_qk_ratio, const std::string& method, double tol,
                        uint64_t memory_budget, const nb::object& progress) {
  constexpr const char* fn = "advise_head";
  const Dtype dt = check_same_dtype(fn, {{"X", &X}, {"W_Q", &WQ}, {"W_K", &WK}, {"W_V", &WV}});
  // The advisor computes in double: float32 inputs are widened once.
  Mat<double> x, wq, wk, wv;
  dispatch(dt, [&](auto tag) {
    using S = decltype(tag);
    const Inputs<S> in(fn, X, WQ, WK, WV);
    x = in.X.template cast<double>();
    wq = in.WQ.template cast<double>();
    wk = in.WK.template cast<double>();
    wv = in.WV.template cast<double>();
    return 0;
  });
  const AttentionOptions<double> o = attention_options<double>(fn, scale, mask, extras);
  AdviceOptions ao;
  ao.lambdas = lambdas;
  ao.placements.clear();
  for (const std::string& p : placements) {
    try {
      ao.placements.push_back(parse_placement(p, "placements"));
    } catch (const std::invalid_argument& e) {
      value_error(fn, e.what());
    }
  }
  ao.max_saturated_fraction = max_saturated_fraction;
  ao.min_qk_ratio = min_qk_ratio;
  try {
    ao.jacobian.method = parse_jacobian_kappa_method(method);
  } catch (const std::invalid_argument& e) {
    value_error(fn, e.what());
  }
  ao.jacobian.tol = tol;
  ao.jacobian.memory_budget = memory_budget;
  Progress bridge(progress);
  ao.progress = bridge.function();
  HeadPosition pos{Index(head), Index(heads), Index(kv_heads)};
  if (packed_columns) {
    if (packed_columns->size() != 3)
      value_error(fn, "packed_columns must hold three columns (of W_Q, W_K, W_V)");
    for (std::size_t i = 0; i < 3; ++i) pos.packed_columns[i] = Index((*packed_columns)[i]);
  }
  // The library's std::invalid_argument (a bad grid, position or criterion) becomes ValueError
  // through the module's exception translator.
  const HeadAdvice a = bridge.run([&] { return advise_head(x, wq, wk, wv, o, pos, ao); });
  return advice_dict(a);
}

/// The parts of a head's advice that the recommendation reads, from advice_dict's output.
HeadAdvice head_from_dict(const nb::handle& h) {
  const nb::dict d = nb::cast<nb::dict>(h);
  HeadAdvice a;
  a.position.head = Index(nb::cast<int64_t>(d["head"]));
  a.baseline = Index(nb::cast<int64_t>(d["baseline"]));
  for (const nb::handle p : nb::cast<nb::list>(d["points"])) {
    const nb::dict pd = nb::cast<nb::dict>(p);
    const nb::dict J = nb::cast<nb::dict>(pd["J"]);
    AdvicePoint pt;
    pt.lambda = nb::cast<double>(pd["lambda"]);
    pt.placement = nb::cast<std::string>(pd["placement"]);
    pt.admissible = nb::cast<bool>(pd["admissible"]);
    pt.reason = nb::cast<std::string>(pd["reason"]);
    pt.J.kappa = nb::cast<double>(J["kappa"]);
    pt.J.kappa_plus = nb::cast<double>(J["kappa_plus"]);
    a.points.push_back(std::move(pt));
  }
  if (a.baseline < 0 || a.baseline >= Index(a.points.size()))
    throw std::invalid_argument("recommend: a head's baseline index is out of range");
  return a;
}

/// The recommendation over heads (advisor.hpp `recommend`) from their advice dicts.
nb::dict recommend_py(const nb::list& heads) {
  std::vector<HeadAdvice> all;
  for (const nb::handle h : heads) all.push_back(head_from_dict(h));
  std::vector<const HeadAdvice*> ptrs;
  for (const HeadAdvice& a : all) ptrs.push_back(&a);
  return choice_dict(recommend(ptrs));
}

}  // namespace

void bind_advise(nb::module_& m) {
  const auto none = nb::none();
  m.def("advise_head", &advise_head_py, nb::arg("X"), nb::arg("WQ"), nb::arg("WK"), nb::arg("WV"),
        nb::arg("scale") = none, nb::arg("mask") = none, nb::arg("extras") = none,
        nb::arg("head") = 0, nb::arg("heads") = 1, nb::arg("kv_heads") = 0,
        nb::arg("packed_columns") = none,
        nb::arg("lambdas") = std::vector<double>{0, 0.25, 0.5, 1, 2, 3, 5, 10},
        nb::arg("placements") = std::vector<std::string>{"fused", "per_head", "packed"},
        nb::arg("max_saturated_fraction") = 0.01, nb::arg("min_qk_ratio") = 0.1,
        nb::arg("method") = "auto", nb::arg("tol") = 1e-6, nb::arg("memory_budget") = uint64_t(0),
        nb::arg("progress") = none,
        "The lambda advisor of one head (MATH.md §17): grid points, onsets, recommendation");
  m.def(
      "placement_name",
      [](const std::string& text) { return parse_placement(text, "placements").name(); },
      nb::arg("text"), "The canonical name of a placement (MATH.md §7); ValueError if unknown");
  m.def("recommend", &recommend_py, nb::arg("heads"),
        "The recommendation over heads advised on one grid (MATH.md §17), from advise_head's "
        "dicts");
}

}  // namespace spectral_cond::python
