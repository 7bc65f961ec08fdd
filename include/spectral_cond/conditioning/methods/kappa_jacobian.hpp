// spectral_cond: κ(J) of an attention block by five methods, each saying what it computed and
// how accurate it is (MATH.md §3–4).
//
//   dense      SVD of the assembled J. The reference; accuracy about ε κ(J); small sizes only.
//   gram       eigenvalues of the structured Gram J J^T (or J^T J when J is tall), never forming
//              J. Squares J: σ_min has relative error about ε κ(J)^2 (MATH.md §3, "Squaring is
//              not affordable"), and singular values below about sqrt(n ε) σ_1 cannot be told
//              from zero.
//   iterative  matrix-free Lanczos (Spectra) on J J^T or J^T J through the JVP/VJP operators;
//              squares J too, and σ_min may not converge: then Info::NotConverging.
//   lobpcg     wide J: LOBPCG for the smallest eigenvalue of J J^T, preconditioned by the
//              Cholesky factor of gram's J J^T, with every product by J and J^T matrix-free and
//              the Rayleigh-Ritz step an SVD of J^T S. Gram's rounding only slows the iteration;
//              its fixed point is set by products with J: accuracy about ε κ(J), like qr, at
//              about gram's cost. Answers only when the preconditioned iteration converges and
//              σ_min is above the rank tolerance; otherwise (and for tall J, and when its stated
//              accuracy exceeds max(tol, 100 ε κ)) kappa_jacobian takes qr.
//   matfree    wide J: LOBPCG on J J^T preconditioned by its d_v channel blocks (mixed) plus a
//              coarse level on the smallest eigenvectors of S = (P X)(P X)^T times every channel,
//              with nothing of order (N d_v)^2 formed: memory O(d_v N^2 + N d_v D + (k d_v)^2),
//              cost the products with J. Accuracy ε κ(J) plus the recomputed residual bound η.
//              For context lengths where the Gram matrix does not fit.
//   qr         QR of the compressed Jacobian (MATH.md §3, "The compressed Jacobian"), then the
//              triangular factor: backward stable, accuracy about ε κ(J).
//   auto       dense when J is small; otherwise the accurate methods (matfree, lobpcg, qr) that
//              apply and fit the memory budget, cheapest by estimated time first, each tried
//              while the one before declines (plan.hpp; never gram, whose ε κ^2 is an
//              estimate). Nothing within the budget: declined with the sizes, before any
//              allocation. The note says which and why.
//
// All methods compute in double, whatever the scalar of the inputs.
#pragma once

#include "spectral_cond/detail/instances.hpp"

#include "spectral_cond/conditioning/methods/dense.hpp"
#include "spectral_cond/conditioning/methods/gram.hpp"
#include "spectral_cond/conditioning/methods/iterative.hpp"
#include "spectral_cond/conditioning/methods/lobpcg.hpp"
#include "spectral_cond/conditioning/methods/matfree.hpp"
#include "spectral_cond/conditioning/methods/plan.hpp"
#include "spectral_cond/conditioning/methods/qr.hpp"
#include "spectral_cond/core/scaling.hpp"

namespace spectral_cond {

/// κ(J) by the method in `jo` (MATH.md §3–4, §12); see the top of this header for what each does.
template <typename Scalar>
ConditionResult<double> kappa_jacobian(const CRef<Scalar>& X, const CRef<Scalar>& WQ,
                                       const CRef<Scalar>& WK, const CRef<Scalar>& WV,
                                       const AttentionOptions<Scalar>& opts,
                                       const JacobianKappaOptions& jo = {}) {
  if (jo.include_biases) {  // J with respect to weights and biases (MATH.md §10)
    const BiasParameters<Scalar> bp = with_bias_parameters<Scalar>(X, WQ, WK, WV, opts);
    JacobianKappaOptions inner = jo;
    inner.include_biases = false;
    ConditionResult<double> r = kappa_jacobian<Scalar>(bp.X, bp.WQ, bp.WK, bp.WV, bp.opts, inner);
    const std::string what = "J with respect to the weights and biases, [J_W | J_b]";
    r.note = r.note.empty() ? what : what + "; " + r.note;
    return r;
  }
  if (auto bad = detail::check_kj_inputs<Scalar>("kappa_jacobian", X, WQ, WK, WV, opts, jo,
                                                 to_string(jo.method)))
    return *bad;
  // κ(J) is the same for (X 2^k, W 2^-k) (Q, K, V and P do not change; J scales by 2^k,
  // MATH.md §3). With max |X| 2^k in [1, 2) the rescaling is exact (core/scaling.hpp), and
  // every method then works on X of order 1, so that J_V = P X (x) I is of order 1 and what
  // underflows in J is negligible against its norm: one answer for every scale of X, from
  // denormal to near overflow. The singular values are scaled back.
  if (const int k = balancing_exponent<Scalar>(X); k != 0) {
    const Mat<Scalar> Xs = times_pow2<Scalar>(X, k);
    const Mat<Scalar> Qs = times_pow2<Scalar>(WQ, -k), Ks = times_pow2<Scalar>(WK, -k),
                      Vs = times_pow2<Scalar>(WV, -k);
    if (Qs.allFinite() && Ks.allFinite() && Vs.allFinite()) {
      ConditionResult<double> r = kappa_jacobian<Scalar>(Xs, Qs, Ks, Vs, opts, jo);
      detail::scale_back(r, k);
      return r;
    }
  }
  const detail::KJInputs in = detail::kj_inputs<Scalar>(X, WQ, WK, WV, opts);
  if (auto over = detail::overflowing(in, to_string(jo.method))) return *over;
  auto qr = [&] {
    QrKappaOptions qo = jo.qr;
    qo.rtol = jo.rtol;
    qo.progress = jo.progress;
    return kappa_jacobian_qr<double>(in.X, in.WQ, in.WK, in.WV, in.opts, qo);
  };
  switch (jo.method) {
    case JacobianKappaMethod::Dense:
      return kappa_jacobian_dense<Scalar>(X, WQ, WK, WV, opts, jo);
    case JacobianKappaMethod::Gram:
      return detail::validated(in, detail::gram_condition(in, jo, nullptr), jo);
    case JacobianKappaMethod::Iterative:
      return kappa_jacobian_iterative<Scalar>(X, WQ, WK, WV, opts, jo);
    case JacobianKappaMethod::Qr:
      return qr();
    case JacobianKappaMethod::Matfree:
      return detail::validated(in, detail::matfree_condition(in, jo), jo);
    case JacobianKappaMethod::Lobpcg:
    case JacobianKappaMethod::Auto:
      break;
  }
  // lobpcg where it answers, else qr (kappa_jacobian_lobpcg's comment says when it does not).
  std::ostringstream why;
  auto lobpcg_good = [&](const ConditionResult<double>& r) {
    // qr's accuracy is about ε κ: lobpcg's answer stands when it is within 100 ε κ or tol.
    const double good_enough = std::max(jo.tol, 100 * ScalarTraits<double>::eps() * r.kappa);
    if (r.info == Info::Success && r.accuracy <= good_enough) return true;
    if (r.info == Info::Success)
      why << "lobpcg's stated accuracy " << r.accuracy
          << " exceeds max(tol, 100 eps kappa) = " << good_enough;
    else
      why << "lobpcg did not answer (" << r.note << ")";
    return false;
  };
  auto lobpcg = [&] { return detail::validated(in, detail::lobpcg_condition(in, jo, {}), jo); };
  if (jo.method == JacobianKappaMethod::Lobpcg) {
    ConditionResult<double> res = lobpcg();
    if (lobpcg_good(res)) return res;
    res = qr();
    res.note = why.str() + ", so qr; " + res.note;
    return res;
  }
  // auto: the plan (plan.hpp) ranks the accurate methods by estimated time within the memory
  // budget; each is tried in turn while the one before it declines.
  KappaShape shape;
  shape.N = X.rows();
  shape.D = X.cols();
  shape.d_k = WQ.cols();
  shape.d_v = WV.cols();
  const KappaPlan plan = plan_kappa_jacobian(shape, jo);
  why << plan.why;
  ConditionResult<double> res;
  if (plan.order.empty()) {
    res.method = "auto";
    res.info = Info::TooLarge;
    res.sigma_max = res.sigma_min = res.kappa = res.sigma_min_plus = res.kappa_plus = res.accuracy =
        std::numeric_limits<double>::quiet_NaN();
    res.rank = -1;
    res.note = why.str() + " (N = " + std::to_string(shape.N) + ", D = " + std::to_string(shape.D) +
               ", d_k = " + std::to_string(shape.d_k) + ", d_v = " + std::to_string(shape.d_v) +
               "): declined before allocating anything";
    return res;
  }
  for (std::size_t i = 0; i < plan.order.size(); ++i) {
    const JacobianKappaMethod m = plan.order[i].method;
    if (i > 0) why << "; so " << to_string(m);
    switch (m) {
      case JacobianKappaMethod::Dense:
        res = kappa_jacobian_dense<Scalar>(X, WQ, WK, WV, opts, jo);
        break;
      case JacobianKappaMethod::Matfree:
        res = detail::validated(in, detail::matfree_condition(in, jo), jo);
        break;
      case JacobianKappaMethod::Lobpcg:
        res = lobpcg();
        break;
      default:
        res = qr();
        break;
    }
    const bool answered = m == JacobianKappaMethod::Lobpcg
                              ? lobpcg_good(res)
                              : res.info == Info::Success || res.info == Info::Singular;
    if (answered || i + 1 == plan.order.size()) break;
    if (m != JacobianKappaMethod::Lobpcg)
      why << "; " << to_string(m) << " did not answer (" << to_string(res.info) << ": " << res.note
          << ")";
  }
  res.note = res.note.empty() ? why.str() : why.str() + "; " + res.note;
  return res;
}

/// By-value convenience form.
template <typename DX, typename DQ, typename DK, typename DV>
ConditionResult<double> kappa_jacobian(const Eigen::MatrixBase<DX>& X,
                                       const Eigen::MatrixBase<DQ>& WQ,
                                       const Eigen::MatrixBase<DK>& WK,
                                       const Eigen::MatrixBase<DV>& WV,
                                       const AttentionOptions<typename DX::Scalar>& opts = {},
                                       const JacobianKappaOptions& jo = {}) {
  return kappa_jacobian<typename DX::Scalar>(X, WQ, WK, WV, opts, jo);
}

}  // namespace spectral_cond
SPECTRAL_COND_DECLARE_EXTERN(kappa_jacobian)
