// The reference for the κ(J) methods: a dense SVD of the assembled J (MATH.md §3-4), in
// double, of the same data as a sc_test::Problem.
#pragma once

#include <spectral_cond/conditioning/kappa.hpp>
#include <spectral_cond/jacobian/jacobian.hpp>

#include "test_helpers.hpp"

namespace sc_test {

template <typename Scalar>
spectral_cond::ConditionResult<double> dense_reference(
    const Problem<Scalar>& p,
    spectral_cond::JacobianBlock block = spectral_cond::JacobianBlock::All,
    spectral_cond::SvdMethod svd = spectral_cond::SvdMethod::BDC) {
  spectral_cond::AttentionOptions<double> o;
  if (p.opts.scale) o.scale = static_cast<double>(*p.opts.scale);
  o.mask = p.opts.mask;
  const Mat<double> J = spectral_cond::attention_jacobian(
      p.X.template cast<double>().eval(), p.WQ.template cast<double>().eval(),
      p.WK.template cast<double>().eval(), p.WV.template cast<double>().eval(), o, block);
  spectral_cond::KappaOptions<double> ko;
  ko.svd = svd;
  return spectral_cond::kappa(J, ko);
}

}  // namespace sc_test
