// spectral_cond: central finite differences, the test oracle for every derivative in the
// library, public so that users can check their own layers (MATH.md §3: an oracle only).
#pragma once

#include "spectral_cond/core/common.hpp"

#include <algorithm>

namespace spectral_cond {

/// The default step for x: cbrt(ε) · max(1, max|x|), which balances the O(h^2) truncation error
/// of a central difference against its O(ε/h) rounding error.
template <typename Scalar>
Scalar default_fd_step(const CRef<Scalar>& x) {
  const Scalar scale = x.size() > 0 ? std::max(Scalar(1), x.cwiseAbs().maxCoeff()) : Scalar(1);
  return ScalarTraits<Scalar>::fd_step() * scale;
}

/// (f(x + h v) - f(x - h v)) / (2 h): the derivative of the matrix function f at x along v.
/// `f` maps a Mat<Scalar> to a Mat<Scalar>. A step h <= 0 means default_fd_step(x).
template <typename Scalar, typename F>
Mat<Scalar> central_difference(F&& f, const Mat<Scalar>& x, const Mat<Scalar>& v,
                               Scalar h = Scalar(0)) {
  detail::require_shape("central_difference", "v", "shape of x", x.rows(), x.cols(), v);
  if (h <= Scalar(0)) h = default_fd_step<Scalar>(x);
  const Mat<Scalar> xp = x + h * v;
  const Mat<Scalar> xm = x - h * v;
  const Mat<Scalar> fp = f(xp);
  const Mat<Scalar> fm = f(xm);
  return (fp - fm) / (Scalar(2) * h);
}

/// The full Jacobian d vec f / d vec x by central differences, one column per entry of x
/// (column-major vec, MATH.md §1). Costs 2 x.size() evaluations of f: a test oracle only.
template <typename Scalar, typename F>
Mat<Scalar> numerical_jacobian(F&& f, const Mat<Scalar>& x, Scalar h = Scalar(0)) {
  if (h <= Scalar(0)) h = default_fd_step<Scalar>(x);
  Mat<Scalar> xp = x;
  Mat<Scalar> J;
  for (Index k = 0; k < x.size(); ++k) {
    const Scalar saved = xp.data()[k];
    xp.data()[k] = saved + h;
    const Mat<Scalar> fp = f(xp);
    xp.data()[k] = saved - h;
    const Mat<Scalar> fm = f(xp);
    xp.data()[k] = saved;
    const Mat<Scalar> d = (fp - fm) / (Scalar(2) * h);
    if (k == 0) J.resize(d.size(), x.size());
    J.col(k) = Eigen::Map<const Vec<Scalar>>(d.data(), d.size());
  }
  return J;
}

}  // namespace spectral_cond
