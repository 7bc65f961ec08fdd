// spectral_cond._core: condition numbers (MATH.md §4), κ(J) (§12), Theorem 3.4 (§5) and the
// corrections (§6–7). The attention family is in attention.cpp. Every function returns plain
// Python values; spectral_cond/__init__.py wraps them in result objects.
#include <spectral_cond/engine/blas_threads.hpp>  // the engine's pin of OpenBLAS to one thread, as the tool's
#include "binding.hpp"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

namespace spectral_cond::python {
namespace {

KappaOptions<double> kappa_options_d(std::optional<double> rtol, const std::string& svd) {
  KappaOptions<double> o;
  if (rtol) o.rtol = *rtol;
  if (svd == "auto")
    o.svd = SvdMethod::Auto;
  else if (svd == "jacobi")
    o.svd = SvdMethod::Jacobi;
  else if (svd == "bdc")
    o.svd = SvdMethod::BDC;
  else if (svd == "lapack")
    o.svd = SvdMethod::Lapack;
  else
    value_error("kappa", "svd must be 'auto', 'jacobi', 'bdc' or 'lapack' (got '" + svd + "')");
  return o;
}

template <typename Scalar>
KappaOptions<Scalar> kappa_options(std::optional<double> rtol, const std::string& svd) {
  const KappaOptions<double> d = kappa_options_d(rtol, svd);
  KappaOptions<Scalar> o;
  o.rtol = static_cast<Scalar>(d.rtol);
  o.svd = d.svd;
  return o;
}

nb::dict kappa_py(const Array& M, std::optional<double> rtol, const std::string& svd) {
  constexpr const char* fn = "kappa";
  return dispatch(check_matrix(fn, "M", M), [&](auto tag) {
    using S = decltype(tag);
    const CRef<S> m = view<S>(M);
    const KappaOptions<S> o = kappa_options<S>(rtol, svd);
    ConditionResult<S> r;
    {
      nb::gil_scoped_release release;
      r = kappa(m, o);
    }
    raise_if_invalid(fn, r);
    return to_dict(r);
  });
}

nb::object singular_values_py(const Array& M, const std::string& svd) {
  constexpr const char* fn = "singular_values";
  return dispatch(check_matrix(fn, "M", M), [&](auto tag) {
    using S = decltype(tag);
    const CRef<S> m = view<S>(M);
    require_finite<S>(fn, "M", m);
    const SvdMethod method = kappa_options_d(std::nullopt, svd).svd;
    Vec<S> sv;
    {
      nb::gil_scoped_release release;
      sv = singular_values(m, method);
    }
    return to_numpy<S>(std::move(sv));
  });
}

JacobianKappaOptions jacobian_options(const char* fn, const std::string& method, double tol,
                                      std::optional<double> rtol, unsigned threads,
                                      int64_t block_cols, std::optional<uint64_t> seed) {
  JacobianKappaOptions jo;
  try {
    jo.method = parse_jacobian_kappa_method(method);
  } catch (const std::invalid_argument& e) {
    value_error(fn, e.what());
  }
  jo.tol = tol;
  if (rtol) jo.rtol = *rtol;
  jo.qr.threads = threads;
  if (block_cols < 0) value_error(fn, "block_cols must be >= 0");
  jo.qr.block_cols = Index(block_cols);
  if (seed) {
    jo.lanczos.seed = *seed;
    jo.lobpcg.seed = *seed;
    jo.qr.lanczos.seed = *seed;
  }
  return jo;
}

nb::dict kappa_jacobian_py(const Array& X, const Array& WQ, const Array& WK, const Array& WV,
                           const std::string& method, double tol, std::optional<double> scale,
                           const nb::object& mask, std::optional<double> rtol, unsigned threads,
                           int64_t block_cols, std::optional<uint64_t> seed,
                           const nb::object& progress, const nb::object& extras,
                           bool include_biases, uint64_t memory_budget) {
  constexpr const char* fn = "kappa_jacobian";
  const Dtype d = check_same_dtype(fn, {{"X", &X}, {"W_Q", &WQ}, {"W_K", &WK}, {"W_V", &WV}});
  return dispatch(d, [&](auto tag) {
    using S = decltype(tag);
    const Inputs<S> in(fn, X, WQ, WK, WV);
    const CRef<S>&x = in.X, &wq = in.WQ, &wk = in.WK, &wv = in.WV;
    const AttentionOptions<S> o = attention_options<S>(fn, scale, mask, extras);
    JacobianKappaOptions jo = jacobian_options(fn, method, tol, rtol, threads, block_cols, seed);
    jo.include_biases = include_biases;
    jo.memory_budget = memory_budget;
    Progress bridge(progress);
    jo.progress = bridge.function();
    const ConditionResult<double> r =
        bridge.run([&] { return kappa_jacobian<S>(x, wq, wk, wv, o, jo); });
    raise_if_invalid(fn, r);
    nb::dict out = to_dict(r);
    out["method_requested"] = method;
    out["tol"] = tol;
    out["scale"] = double(o.resolved_scale(wq.cols()));
    out["mask"] = std::string(to_string(o.mask));
    out["N"] = int64_t(x.rows());
    out["D"] = int64_t(x.cols());
    out["d_k"] = int64_t(wq.cols());
    out["d_v"] = int64_t(wv.cols());
    out["biases"] = o.has_biases();
    out["include_biases"] = include_biases;
    out["rope"] = o.rope ? nb::object(nb::str(to_string(o.rope->pairing))) : nb::none();
    return out;
  });
}

/// The attention pattern, the block norms of J and the bound without hypothesis (MATH.md §5,
/// §11), in double whatever the inputs' dtype.
nb::dict attention_diagnostics_py(const Array& X, const Array& WQ, const Array& WK, const Array& WV,
                                  std::optional<double> scale, const nb::object& mask,
                                  const nb::object& extras) {
  constexpr const char* fn = "attention_diagnostics";
  const Dtype d = check_same_dtype(fn, {{"X", &X}, {"W_Q", &WQ}, {"W_K", &WK}, {"W_V", &WV}});
  return dispatch(d, [&](auto tag) {
    using S = decltype(tag);
    const Inputs<S> in(fn, X, WQ, WK, WV);
    const CRef<S>&x = in.X, &wq = in.WQ, &wk = in.WK, &wv = in.WV;
    const AttentionOptions<double> o = attention_options<double>(fn, scale, mask, extras);
    const Mat<double> xd = x.template cast<double>(), qd = wq.template cast<double>(),
                      kd = wk.template cast<double>(), vd = wv.template cast<double>();
    AttentionDiagnostics diag;
    HypothesisFreeBound free;
    {
      nb::gil_scoped_release release;
      const Mat<double> P = attention_forward(xd, qd, kd, vd, o).P;
      diag = attention_diagnostics(xd, qd, kd, vd, o, P);
      free = hypothesis_free_bound(xd, qd, kd, vd, o, P);
    }
    nb::dict out = diagnostics_dict(diag);
    out["free_bound"] = free_bound_dict(free);
    return out;
  });
}

nb::dict theorem34_py(const Array& X, const Array& WQ, const Array& WK, const Array& WV,
                      const std::string& method, double tol, std::optional<double> scale,
                      const nb::object& mask, std::optional<double> rtol, bool blocks,
                      unsigned threads, const nb::object& progress, const nb::object& extras,
                      const nb::object& jacobian) {
  constexpr const char* fn = "theorem34";
  std::optional<ConditionResult<double>> given;
  if (!jacobian.is_none()) {
    if (!nb::isinstance<nb::dict>(jacobian))
      type_error(fn, "jacobian must be a kappa_jacobian result (or None)");
    given = condition_from_dict(fn, nb::cast<nb::dict>(jacobian));
  }
  const Dtype d = check_same_dtype(fn, {{"X", &X}, {"W_Q", &WQ}, {"W_K", &WK}, {"W_V", &WV}});
  return dispatch(d, [&](auto tag) {
    using S = decltype(tag);
    const Inputs<S> in(fn, X, WQ, WK, WV);
    const CRef<S>&x = in.X, &wq = in.WQ, &wk = in.WK, &wv = in.WV;
    const AttentionOptions<S> o = attention_options<S>(fn, scale, mask, extras);
    BoundOptions bo;
    bo.jacobian = jacobian_options(fn, method, tol, rtol, threads, 0, std::nullopt);
    if (rtol) bo.rtol = *rtol;
    bo.blocks = blocks;
    Progress bridge(progress);
    bo.jacobian.progress = bridge.function();
    const Theorem34Report r = bridge.run([&] {
      return given ? theorem34<S>(x, wq, wk, wv, o, bo, *given)
                   : theorem34<S>(x, wq, wk, wv, o, bo);
    });
    nb::dict out;
    out["X"] = to_dict(r.X);
    out["Lambda"] = to_dict(r.Lambda);
    out["WQ"] = to_dict(r.WQ);
    out["WK"] = to_dict(r.WK);
    out["WV"] = to_dict(r.WV);
    out["P"] = to_dict(r.P);
    out["J"] = to_dict(r.J);
    if (r.have_blocks) {
      out["JQ"] = to_dict(r.JQ);
      out["JK"] = to_dict(r.JK);
      out["JV"] = to_dict(r.JV);
    } else {
      out["JQ"] = out["JK"] = out["JV"] = nb::none();
    }
    out["bound_applies"] = r.bound_applies;
    out["bound"] = r.bound;
    out["bound_plus"] = r.bound_plus;
    out["ratio"] = r.ratio;
    out["ratio_plus"] = r.ratio_plus;
    out["holds"] = r.holds;
    out["holds_plus"] = r.holds_plus;
    out["vacuous"] = r.vacuous;
    out["verdict"] = r.verdict;
    if (r.have_diagnostics) {
      out["diagnostics"] = diagnostics_dict(r.diagnostics);
      out["free_bound"] = free_bound_dict(r.free_bound);
      out["free_bound_holds"] = r.free_bound_holds;
    } else {
      out["diagnostics"] = out["free_bound"] = out["free_bound_holds"] = nb::none();
    }
    return out;
  });
}

nb::dict exact_correction_py(const Array& W, std::optional<double> target) {
  constexpr const char* fn = "exact_correction";
  return dispatch(check_matrix(fn, "W", W), [&](auto tag) {
    using S = decltype(tag);
    const CRef<S> w = view<S>(W);
    require_finite<S>(fn, "W", w);
    std::optional<S> t;
    if (target) t = static_cast<S>(*target);
    ExactCorrection<S> r;
    {
      nb::gil_scoped_release release;
      r = exact_correction(w, t);
    }
    nb::dict out;
    out["alpha"] = double(r.alpha);
    out["target"] = r.target ? nb::cast(double(*r.target)) : nb::none();
    out["kappa_before"] = double(r.kappa_before);
    out["kappa_after"] = double(r.kappa_after);
    out["kappa_predicted"] = double(r.kappa_predicted);
    out["corrected"] = r.corrected;
    out["info"] = std::string(to_string(r.info));
    out["note"] = r.note;
    out["C"] = to_numpy<S>(std::move(r.C));
    out["W_corrected"] = to_numpy<S>(std::move(r.W_corrected));
    return out;
  });
}

nb::dict lambda_correction_py(const Array& W, double lambda) {
  constexpr const char* fn = "lambda_correction";
  return dispatch(check_matrix(fn, "W", W), [&](auto tag) {
    using S = decltype(tag);
    const CRef<S> w = view<S>(W);
    require_finite<S>(fn, "W", w);
    LambdaCorrection<S> r;
    {
      nb::gil_scoped_release release;
      r = lambda_correction(w, static_cast<S>(lambda));
    }
    nb::dict out;
    out["lam"] = double(r.lambda);
    out["s"] = double(r.s);
    out["kappa_before"] = double(r.kappa_before);
    out["kappa_after"] = double(r.kappa_after);
    out["isometric_addend"] = r.isometric_addend;
    out["weyl_applies"] = r.weyl_applies;
    out["weyl_bound"] = double(r.weyl_bound);
    out["lambda_min"] = double(r.lambda_min);
    out["improvement_guaranteed"] = r.improvement_guaranteed;
    out["info"] = std::string(to_string(r.info));
    out["note"] = r.note;
    out["W_corrected"] = to_numpy<S>(std::move(r.W_corrected));
    return out;
  });
}

nb::object lambda_identity_py(int64_t D, int64_t heads, int64_t d_head,
                              const std::string& placement, int64_t packed_offset) {
  CorrectionPlacement p;
  try {
    p = parse_placement(placement, "placement");
  } catch (const std::invalid_argument& e) {
    value_error("lambda_identity", e.what());
  }
  if (!(p.q && p.k && p.v))
    value_error("lambda_identity",
                "placement '" + placement +
                    "': E is one projection's matrix, so a subset of projections does not apply");
  if (packed_offset != 0 && p.layout != Placement::Packed)
    value_error("lambda_identity", "packed_offset applies to placement 'packed' only");
  return to_numpy<double>(lambda_identity<double>(Index(D), Index(heads), Index(d_head), p.layout,
                                                  Index(packed_offset)));
}

/// Whether the binding reads `a` in place (no copy): true for a Fortran-order array, which maps
/// onto the library's column-major storage; false for C order, which is copied once.
bool input_is_borrowed(const Array& a) {
  return dispatch(check_matrix("input_is_borrowed", "a", a), [&](auto tag) {
    using S = decltype(tag);
    const CRef<S> v = view<S>(a);
    return static_cast<const void*>(v.data()) == a.data();
  });
}

}  // namespace
}  // namespace spectral_cond::python

NB_MODULE(_core, m) {
  using namespace spectral_cond::python;
  namespace sc = spectral_cond;
  m.doc() = "spectral_cond's C++ library (MATH.md); use the spectral_cond package, not this module";
  // One BLAS thread (or SPECTRAL_COND_BLAS_THREADS), as in the tool: the same reports as its.
  spectral_cond::engine::pin_blas_to_one_thread();

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const std::bad_alloc&) {
      PyErr_SetString(PyExc_MemoryError, "spectral_cond: out of memory");
    }
  });

  const auto none = nb::none();
  m.def("kappa", &kappa_py, nb::arg("M"), nb::arg("rtol") = none, nb::arg("svd") = "auto",
        "kappa(M) and kappa_plus(M) by a dense SVD (MATH.md §4), as a dict");
  m.def(
      "have_lapacke", []() -> bool { return sc::have_lapacke(); },
      "Whether the library was built with LAPACKE (svd='lapack', the qr method's BLAS)");
  m.def("singular_values", &singular_values_py, nb::arg("M"), nb::arg("svd") = "auto",
        "Singular values of M in decreasing order (MATH.md §4)");
  m.def("kappa_jacobian", &kappa_jacobian_py, nb::arg("X"), nb::arg("WQ"), nb::arg("WK"),
        nb::arg("WV"), nb::arg("method") = "auto", nb::arg("tol") = 1e-6, nb::arg("scale") = none,
        nb::arg("mask") = none, nb::arg("rtol") = none, nb::arg("threads") = 0u,
        nb::arg("block_cols") = 0, nb::arg("seed") = none, nb::arg("progress") = none,
        nb::arg("extras") = none, nb::arg("include_biases") = false,
        nb::arg("memory_budget") = uint64_t(0),
        "kappa(J) of one attention block (MATH.md §12), as a dict");
  m.def("theorem34", &theorem34_py, nb::arg("X"), nb::arg("WQ"), nb::arg("WK"), nb::arg("WV"),
        nb::arg("method") = "auto", nb::arg("tol") = 1e-6, nb::arg("scale") = none,
        nb::arg("mask") = none, nb::arg("rtol") = none, nb::arg("blocks") = true,
        nb::arg("threads") = 0u, nb::arg("progress") = none, nb::arg("extras") = none,
        nb::arg("jacobian") = none, "Every term of Theorem 3.4 (MATH.md §5), as a dict");
  m.def("attention_diagnostics", &attention_diagnostics_py, nb::arg("X"), nb::arg("WQ"),
        nb::arg("WK"), nb::arg("WV"), nb::arg("scale") = none, nb::arg("mask") = none,
        nb::arg("extras") = none,
        "The attention pattern, J's block norms and the bound without hypothesis (MATH.md §5, "
        "§11)");
  m.def("exact_correction", &exact_correction_py, nb::arg("W"), nb::arg("target") = none,
        "The exact correction of Theorem 3.5 (MATH.md §6), as a dict");
  m.def("lambda_correction", &lambda_correction_py, nb::arg("W"), nb::arg("lam") = 10.0,
        "W + lam I_k and the Weyl bound (MATH.md §7), as a dict");
  m.def("lambda_identity", &lambda_identity_py, nb::arg("D"), nb::arg("heads"), nb::arg("d_head"),
        nb::arg("placement") = "fused", nb::arg("packed_offset") = 0,
        "The D x (heads d_head) matrix E added as lam E (MATH.md §7: fused, per-head or packed)");
  m.def("input_is_borrowed", &input_is_borrowed, nb::arg("a"),
        "True when the binding reads the array in place (Fortran order), False when it copies");
  bind_attention(m);
  bind_checkpoint(m);
  bind_verify(m);
  bind_advise(m);
}
