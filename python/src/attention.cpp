// spectral_cond._core: attention, its JVP and VJP (MATH.md §1–2), J and its blocks in closed form
// (§3) and the Gram matrix J J^T without J, for float32 and float64 arrays (the result has the
// inputs' dtype).
#include "binding.hpp"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

namespace spectral_cond::python {
namespace {

JacobianBlock parse_block(const char* fn, const std::string& b) {
  if (b == "all") return JacobianBlock::All;
  if (b == "q") return JacobianBlock::Q;
  if (b == "k") return JacobianBlock::K;
  if (b == "v") return JacobianBlock::V;
  if (b == "x") return JacobianBlock::X;
  value_error(fn, "block must be 'all', 'q', 'k', 'v', 'x' or 'bias' (got '" + b + "')");
}

nb::object attention_py(const Array& X, const Array& WQ, const Array& WK, const Array& WV,
                        std::optional<double> scale, const nb::object& mask,
                        const nb::object& extras) {
  constexpr const char* fn = "attention";
  const Dtype d = check_same_dtype(fn, {{"X", &X}, {"W_Q", &WQ}, {"W_K", &WK}, {"W_V", &WV}});
  return dispatch(d, [&](auto tag) {
    using S = decltype(tag);
    const Inputs<S> in(fn, X, WQ, WK, WV);
    const AttentionOptions<S> o = attention_options<S>(fn, scale, mask, extras);
    AttentionCache<S> cache;
    {
      nb::gil_scoped_release release;
      attention_forward<S>(in.X, in.WQ, in.WK, in.WV, o, cache);
    }
    return to_numpy<S>(std::move(cache.A));
  });
}

/// An optional tangent: None is a zero tangent (the library's empty matrix).
template <typename Scalar>
Mat<Scalar> optional_matrix(const char* fn, const char* name, const std::optional<Array>& a) {
  if (!a) return Mat<Scalar>();
  const CRef<Scalar> v = view<Scalar>(*a);
  require_finite<Scalar>(fn, name, v);
  if (v.size() == 0) value_error(fn, std::string(name) + " must not be empty (pass None for zero)");
  return v;
}

nb::object attention_jvp_py(const Array& X, const Array& WQ, const Array& WK, const Array& WV,
                            const std::optional<Array>& dWQ, const std::optional<Array>& dWK,
                            const std::optional<Array>& dWV, const std::optional<Array>& dX,
                            std::optional<double> scale, const nb::object& mask,
                            const nb::object& extras) {
  constexpr const char* fn = "attention_jvp";
  const Dtype d = check_same_dtype(fn, {{"X", &X},
                                        {"W_Q", &WQ},
                                        {"W_K", &WK},
                                        {"W_V", &WV},
                                        {"dW_Q", dWQ ? &*dWQ : nullptr},
                                        {"dW_K", dWK ? &*dWK : nullptr},
                                        {"dW_V", dWV ? &*dWV : nullptr},
                                        {"dX", dX ? &*dX : nullptr}});
  return dispatch(d, [&](auto tag) {
    using S = decltype(tag);
    const Inputs<S> in(fn, X, WQ, WK, WV);
    const AttentionOptions<S> o = attention_options<S>(fn, scale, mask, extras);
    AttentionTangents<S> t;
    t.dWQ = optional_matrix<S>(fn, "dW_Q", dWQ);
    t.dWK = optional_matrix<S>(fn, "dW_K", dWK);
    t.dWV = optional_matrix<S>(fn, "dW_V", dWV);
    t.dX = optional_matrix<S>(fn, "dX", dX);
    Mat<S> dA;
    {
      nb::gil_scoped_release release;
      AttentionCache<S> cache;
      attention_forward<S>(in.X, in.WQ, in.WK, in.WV, o, cache);
      dA = attention_jvp<S>(in.X, in.WQ, in.WK, in.WV, cache, t);
    }
    return to_numpy<S>(std::move(dA));
  });
}

nb::dict attention_vjp_py(const Array& X, const Array& WQ, const Array& WK, const Array& WV,
                          const Array& G, std::optional<double> scale, const nb::object& mask,
                          const nb::object& extras) {
  constexpr const char* fn = "attention_vjp";
  const Dtype d =
      check_same_dtype(fn, {{"X", &X}, {"W_Q", &WQ}, {"W_K", &WK}, {"W_V", &WV}, {"G", &G}});
  return dispatch(d, [&](auto tag) {
    using S = decltype(tag);
    const Inputs<S> in(fn, X, WQ, WK, WV);
    const CRef<S> g = view<S>(G);
    require_finite<S>(fn, "G", g);
    const AttentionOptions<S> o = attention_options<S>(fn, scale, mask, extras);
    AttentionGradients<S> grads;
    {
      nb::gil_scoped_release release;
      AttentionCache<S> cache;
      attention_forward<S>(in.X, in.WQ, in.WK, in.WV, o, cache);
      grads = attention_vjp<S>(in.X, in.WQ, in.WK, in.WV, cache, g);
    }
    nb::dict out;
    out["dWQ"] = to_numpy<S>(std::move(grads.dWQ));
    out["dWK"] = to_numpy<S>(std::move(grads.dWK));
    out["dWV"] = to_numpy<S>(std::move(grads.dWV));
    out["dX"] = to_numpy<S>(std::move(grads.dX));
    out["dbQ"] = to_numpy<S>(Mat<S>(grads.dbQ));
    out["dbK"] = to_numpy<S>(Mat<S>(grads.dbK));
    out["dbV"] = to_numpy<S>(Mat<S>(grads.dbV));
    return out;
  });
}

nb::object attention_jacobian_py(const Array& X, const Array& WQ, const Array& WK, const Array& WV,
                                 const std::string& block, std::optional<double> scale,
                                 const nb::object& mask, const nb::object& extras) {
  constexpr const char* fn = "attention_jacobian";
  const Dtype d = check_same_dtype(fn, {{"X", &X}, {"W_Q", &WQ}, {"W_K", &WK}, {"W_V", &WV}});
  const bool bias = block == "bias";
  const JacobianBlock b = bias ? JacobianBlock::All : parse_block(fn, block);
  return dispatch(d, [&](auto tag) {
    using S = decltype(tag);
    const Inputs<S> in(fn, X, WQ, WK, WV);
    const AttentionOptions<S> o = attention_options<S>(fn, scale, mask, extras);
    const Index N = in.X.rows(), D = in.X.cols(), dk = in.WQ.cols(), dv = in.WV.cols();
    Mat<S> J;
    {
      nb::gil_scoped_release release;
      if (bias) {
        J = attention_bias_jacobian(in.X, in.WQ, in.WK, in.WV, o);
      } else {
        J.resize(jacobian_rows(N, dv), jacobian_cols(b, N, D, dk, dv));
        attention_jacobian<S>(in.X, in.WQ, in.WK, in.WV, o, b, J);
      }
    }
    return to_numpy<S>(std::move(J));
  });
}

nb::object attention_gram_py(const Array& X, const Array& WQ, const Array& WK, const Array& WV,
                             const std::string& block, std::optional<double> scale,
                             const nb::object& mask, const nb::object& extras) {
  constexpr const char* fn = "attention_gram";
  const Dtype d = check_same_dtype(fn, {{"X", &X}, {"W_Q", &WQ}, {"W_K", &WK}, {"W_V", &WV}});
  const JacobianBlock b = parse_block(fn, block);
  return dispatch(d, [&](auto tag) {
    using S = decltype(tag);
    const Inputs<S> in(fn, X, WQ, WK, WV);
    const AttentionOptions<S> o = attention_options<S>(fn, scale, mask, extras);
    const Index R = jacobian_rows(in.X.rows(), in.WV.cols());
    Mat<S> G;
    {
      nb::gil_scoped_release release;
      G.resize(R, R);
      attention_gram<S>(in.X, in.WQ, in.WK, in.WV, o, b, G);
    }
    return to_numpy<S>(std::move(G));
  });
}

}  // namespace

void bind_attention(nb::module_& m) {
  const auto none = nb::none();
  m.def("attention", &attention_py, nb::arg("X"), nb::arg("WQ"), nb::arg("WK"), nb::arg("WV"),
        nb::arg("scale") = none, nb::arg("mask") = none, nb::arg("extras") = none,
        "A = softmax(c Q K^T + M) V, Q = X W_Q (+ biases, RoPE) (MATH.md §1, §10)");
  m.def("attention_jvp", &attention_jvp_py, nb::arg("X"), nb::arg("WQ"), nb::arg("WK"),
        nb::arg("WV"), nb::arg("dWQ") = none, nb::arg("dWK") = none, nb::arg("dWV") = none,
        nb::arg("dX") = none, nb::arg("scale") = none, nb::arg("mask") = none,
        nb::arg("extras") = none, "dA for tangents of W_Q, W_K, W_V, X; None is zero (MATH.md §2)");
  m.def("attention_vjp", &attention_vjp_py, nb::arg("X"), nb::arg("WQ"), nb::arg("WK"),
        nb::arg("WV"), nb::arg("G"), nb::arg("scale") = none, nb::arg("mask") = none,
        nb::arg("extras") = none,
        "dL/dW_Q, dL/dW_K, dL/dW_V, dL/dX for G = dL/dA (MATH.md §2), as a dict");
  m.def("attention_jacobian", &attention_jacobian_py, nb::arg("X"), nb::arg("WQ"), nb::arg("WK"),
        nb::arg("WV"), nb::arg("block") = "all", nb::arg("scale") = none, nb::arg("mask") = none,
        nb::arg("extras") = none,
        "J = d vec(A) / d [vec W_Q; vec W_K; vec W_V] or one block (MATH.md §3)");
  m.def("attention_gram", &attention_gram_py, nb::arg("X"), nb::arg("WQ"), nb::arg("WK"),
        nb::arg("WV"), nb::arg("block") = "all", nb::arg("scale") = none, nb::arg("mask") = none,
        nb::arg("extras") = none, "J J^T of J or one block, without forming J (MATH.md §3)");
}

}  // namespace spectral_cond::python
