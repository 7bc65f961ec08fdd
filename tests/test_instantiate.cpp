// Instantiates every public class template of the library for float and double, so that a
// template that does not compile for one scalar is caught here and not by a user.
#include <spectral_cond/spectral_cond.hpp>

#include "support/test_helpers.hpp"

namespace sc = spectral_cond;

template struct sc::AttentionOptions<float>;
template struct sc::AttentionOptions<double>;
template struct sc::AttentionCache<float>;
template struct sc::AttentionCache<double>;
template struct sc::AttentionWorkspace<float>;
template struct sc::AttentionWorkspace<double>;
template struct sc::MultiHeadOptions<float>;
template struct sc::MultiHeadOptions<double>;
template struct sc::MultiHeadCache<float>;
template struct sc::MultiHeadCache<double>;
template class sc::JacobianOp<float>;
template class sc::JacobianOp<double>;
template class sc::JacobianTransposeOp<float>;
template class sc::JacobianTransposeOp<double>;
template class sc::GramOp<float>;
template class sc::GramOp<double>;
template class sc::NormalOp<float>;
template class sc::NormalOp<double>;
template class sc::ConditionedAttention<float>;
template class sc::ConditionedAttention<double>;
template struct sc::ConditionResult<float>;
template struct sc::ConditionResult<double>;
template struct sc::ExactCorrection<float>;
template struct sc::ExactCorrection<double>;
template struct sc::LambdaCorrection<float>;
template struct sc::LambdaCorrection<double>;
template class sc::CompressedJacobian<float>;
template class sc::CompressedJacobian<double>;
template class sc::CompressedInputJacobian<float>;
template class sc::CompressedInputJacobian<double>;
template struct sc::ScalarTraits<float>;
template struct sc::ScalarTraits<double>;

TEST_CASE_TEMPLATE("every public function template compiles and runs", Scalar, float, double) {
  using M = sc::Mat<Scalar>;
  const M X = M::Random(3, 4), WQ = M::Random(4, 2), WK = M::Random(4, 2), WV = M::Random(4, 2);
  const auto cache = sc::attention_forward(X, WQ, WK, WV);
  const M A = sc::attention(X, WQ, WK, WV);
  const M dA = sc::attention_jvp<Scalar>(X, WQ, WK, WV, cache,
                                         sc::AttentionTangents<Scalar>{WQ, {}, {}, {}});
  const auto g = sc::attention_vjp<Scalar>(X, WQ, WK, WV, cache, A);
  sc::MultiHeadOptions<Scalar> mo;
  mo.heads = 2;
  const auto mc = sc::multihead_forward(X, WQ, WK, WV, mo);
  const M mdA = sc::multihead_jvp<Scalar>(X, WQ, WK, WV, mo, mc,
                                          sc::AttentionTangents<Scalar>{{}, WK, {}, {}});
  const auto mg = sc::multihead_vjp<Scalar>(X, WQ, WK, WV, mo, mc, mc.A);
  const M fd = sc::central_difference<Scalar>(
      [&](const M& w) { return sc::attention(X, w, WK, WV); }, WQ, WQ);
  const M J =
      sc::numerical_jacobian<Scalar>([&](const M& w) { return sc::attention(X, w, WK, WV); }, WQ);
  const M Jfull = sc::attention_jacobian(X, WQ, WK, WV);
  const M G = sc::attention_gram(X, WQ, WK, WV);
  const M JtJ = sc::attention_normal(X, WQ, WK, WV, {}, sc::JacobianBlock::X);
  const M Jl = sc::multihead_jacobian<Scalar>(X, WQ, WK, WV, mo);
  const M Jh = sc::multihead_jacobian_head<Scalar>(X, WQ, WK, WV, mo, 1);
  const auto kr = sc::kappa(Jfull);
  const auto ec = sc::exact_correction(WQ);
  const auto lc = sc::lambda_correction(WQ, Scalar(10));
  const M I = sc::rectangular_identity<Scalar>(4, 2);
  const M Lf = sc::lambda_identity<Scalar>(4, 2, 1, sc::Placement::Fused);
  const auto rep = sc::multihead_lambda_report(WQ, 2, Scalar(2), sc::Placement::PerHead);
  sc::ConditionedAttention<Scalar> ca(
      WQ, WK, WV, sc::ConditioningSpec<Scalar>::shared(sc::Correction<Scalar>::with_exact()), mo);
  const M Ac = ca.attention(X, WQ, WK, WV);
  const M Jc = sc::compressed_jacobian(X, WQ, WK, WV);
  const auto kq = sc::kappa_jacobian_qr<Scalar>(X, WQ, WK, WV, sc::AttentionOptions<Scalar>{});
  const auto kqx =
      sc::kappa_input_jacobian_qr<Scalar>(X, WQ, WK, WV, sc::AttentionOptions<Scalar>{});
  const auto kj = sc::kappa_jacobian(X, WQ, WK, WV);
  const auto t34 = sc::theorem34(X, WQ, WK, WV);
  CHECK(Jc.rows() == Jfull.rows());
  CHECK(kq.sigma_max > 0);
  CHECK(kqx.sigma_max > 0);
  CHECK(kj.sigma_max > 0);
  CHECK(t34.X.sigma_max > 0);
  CHECK(kr.sigma_max > 0);
  CHECK(ec.W_corrected.rows() == 4);
  CHECK(lc.W_corrected.rows() == 4);
  CHECK(I(1, 1) == Scalar(1));
  CHECK(Lf.cols() == 2);
  CHECK(rep.size() == 2);
  CHECK(Ac.allFinite());
  CHECK(Jfull.rows() == G.rows());
  CHECK(JtJ.rows() == 12);
  CHECK(Jl.rows() == 6);
  CHECK(Jh.rows() == 3);
  CHECK(A.allFinite());
  CHECK(dA.allFinite());
  CHECK(g.dX.allFinite());
  CHECK(mdA.allFinite());
  CHECK(mg.dWQ.allFinite());
  CHECK(fd.rows() == 3);
  CHECK(J.rows() == 6);
  CHECK(J.cols() == 8);
}
