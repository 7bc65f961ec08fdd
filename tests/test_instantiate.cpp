// Instantiates every public class template of the library for float and double, so that a
// template that does not compile for one scalar is caught here and not by a user.
#include <spectral_cond/spectral_cond.hpp>

#include "test_helpers.hpp"

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
template struct sc::ScalarTraits<float>;
template struct sc::ScalarTraits<double>;

TEST_CASE_TEMPLATE("every public function template compiles and runs", Scalar, float, double) {
  using M = sc::Mat<Scalar>;
  const M X = M::Random(3, 4), WQ = M::Random(4, 2), WK = M::Random(4, 2), WV = M::Random(4, 2);
  const auto cache = sc::attention_forward(X, WQ, WK, WV);
  const M A = sc::attention(X, WQ, WK, WV);
  const M dA = sc::attention_jvp<Scalar>(X, WQ, WK, WV, cache, sc::AttentionTangents<Scalar>{WQ, {}, {}, {}});
  const auto g = sc::attention_vjp<Scalar>(X, WQ, WK, WV, cache, A);
  sc::MultiHeadOptions<Scalar> mo;
  mo.heads = 2;
  const auto mc = sc::multihead_forward(X, WQ, WK, WV, mo);
  const M mdA = sc::multihead_jvp<Scalar>(X, WQ, WK, WV, mo, mc, sc::AttentionTangents<Scalar>{{}, WK, {}, {}});
  const auto mg = sc::multihead_vjp<Scalar>(X, WQ, WK, WV, mo, mc, mc.A);
  const M fd = sc::central_difference<Scalar>([&](const M& w) { return sc::attention(X, w, WK, WV); }, WQ, WQ);
  const M J = sc::numerical_jacobian<Scalar>([&](const M& w) { return sc::attention(X, w, WK, WV); }, WQ);
  CHECK(A.allFinite());
  CHECK(dA.allFinite());
  CHECK(g.dX.allFinite());
  CHECK(mdA.allFinite());
  CHECK(mg.dWQ.allFinite());
  CHECK(fd.rows() == 3);
  CHECK(J.rows() == 6);
  CHECK(J.cols() == 8);
}
