// spectral_cond: κ(J) by the dense SVD of the assembled J (MATH.md §3, §12): the reference,
// accurate to about ε κ(J), for small sizes only (J has N d_v x D (2 d_k + d_v) entries).
#pragma once

#include "spectral_cond/conditioning/methods/common.hpp"

namespace spectral_cond {

/// κ(J) by the dense SVD of the assembled J (MATH.md §3–4): the reference.
template <typename Scalar>
ConditionResult<double> kappa_jacobian_dense(const CRef<Scalar>& X, const CRef<Scalar>& WQ,
                                             const CRef<Scalar>& WK, const CRef<Scalar>& WV,
                                             const AttentionOptions<Scalar>& opts,
                                             const JacobianKappaOptions& jo = {}) {
  jo.check("kappa_jacobian_dense");
  detail::refuse_include_biases("kappa_jacobian_dense", jo);
  const detail::KJInputs in = detail::kj_inputs<Scalar>(X, WQ, WK, WV, opts);
  const Mat<double> J = attention_jacobian(in.X, in.WQ, in.WK, in.WV, in.opts);
  KappaOptions<double> ko = detail::kappa_opts(jo);
  ko.svd = SvdMethod::Auto;
  ConditionResult<double> res = kappa(J, ko);
  res.method = "dense (" + res.method + " of J, " + detail::shape_str(in.rows, in.cols) + ")";
  return detail::validated(in, std::move(res), jo);
}

}  // namespace spectral_cond
