// Multi-head and grouped-query attention (MATH.md §8): equal to the per-head computation, and
// its JVP/VJP checked against finite differences and the adjoint identity.
#include <spectral_cond/spectral_cond.hpp>

#include "support/test_helpers.hpp"

using namespace spectral_cond;
using sc_test::randn;
using sc_test::rel_err;

TEST_CASE_TEMPLATE("multi-head equals per-head attention, with and without GQA", Scalar, double,
                   float) {
  const double tol = 100 * sc_test::eps<Scalar>();
  for (Index kv : {4, 2, 1}) {
    std::mt19937_64 rng(100 + static_cast<std::uint64_t>(kv));
    INFO("kv_heads=" << kv << " seed=" << 100 + kv);
    const Index N = 7, D = 8, h = 4, dk = 3, dv = 2;
    const Mat<Scalar> X = randn<Scalar>(N, D, rng), WQ = randn<Scalar>(D, h * dk, rng, 0.4);
    const Mat<Scalar> WK = randn<Scalar>(D, kv * dk, rng, 0.4),
                      WV = randn<Scalar>(D, kv * dv, rng, 0.4);
    MultiHeadOptions<Scalar> o;
    o.heads = h;
    o.kv_heads = kv;
    o.mask = MaskKind::Causal;
    const auto mh = multihead_forward(X, WQ, WK, WV, o);
    const Mat<Scalar> G = randn<Scalar>(N, h * dv, rng);
    const auto g = multihead_vjp<Scalar>(X, WQ, WK, WV, o, mh, G);
    Mat<Scalar> gWQ = Mat<Scalar>::Zero(D, h * dk), gWK = Mat<Scalar>::Zero(D, kv * dk);
    Mat<Scalar> gWV = Mat<Scalar>::Zero(D, kv * dv), gX = Mat<Scalar>::Zero(N, D);
    AttentionOptions<Scalar> one;
    one.mask = MaskKind::Causal;
    for (Index j = 0; j < h; ++j) {
      const Index gi = j / (h / kv);
      const Mat<Scalar> wq = WQ.middleCols(j * dk, dk), wk = WK.middleCols(gi * dk, dk);
      const Mat<Scalar> wv = WV.middleCols(gi * dv, dv);
      const auto c1 = attention_forward(X, wq, wk, wv, one);
      CHECK(rel_err(mh.A.middleCols(j * dv, dv), c1.A) < tol);
      CHECK(rel_err(mh.P[static_cast<size_t>(j)], c1.P) < tol);
      const auto g1 = attention_vjp<Scalar>(X, wq, wk, wv, c1, G.middleCols(j * dv, dv));
      gWQ.middleCols(j * dk, dk) += g1.dWQ;
      gWK.middleCols(gi * dk, dk) += g1.dWK;
      gWV.middleCols(gi * dv, dv) += g1.dWV;
      gX += g1.dX;
    }
    CHECK(rel_err(g.dWQ, gWQ) < tol);
    CHECK(rel_err(g.dWK, gWK) < tol);
    CHECK(rel_err(g.dWV, gWV) < tol);
    CHECK(rel_err(g.dX, gX) < tol);
  }
}

TEST_CASE("multi-head JVP: finite differences and the adjoint identity (double)") {
  std::mt19937_64 rng(2024);
  const Index N = 5, D = 6, h = 4, kv = 2, dk = 2, dv = 3;
  const Mat<double> X = randn<double>(N, D, rng), WQ = randn<double>(D, h * dk, rng, 0.5);
  const Mat<double> WK = randn<double>(D, kv * dk, rng, 0.5),
                    WV = randn<double>(D, kv * dv, rng, 0.5);
  MultiHeadOptions<double> o;
  o.heads = h;
  o.kv_heads = kv;
  o.scale = 1.0;
  const auto cache = multihead_forward(X, WQ, WK, WV, o);
  const AttentionTangents<double> t{randn<double>(D, h * dk, rng), randn<double>(D, kv * dk, rng),
                                    randn<double>(D, kv * dv, rng), randn<double>(N, D, rng)};
  const Mat<double> jvp = multihead_jvp<double>(X, WQ, WK, WV, o, cache, t);
  const double step = 1e-6;
  auto A_at = [&](double s) {
    return multihead_forward(Mat<double>(X + s * t.dX), Mat<double>(WQ + s * t.dWQ),
                             Mat<double>(WK + s * t.dWK), Mat<double>(WV + s * t.dWV), o)
        .A;
  };
  const Mat<double> fd = (A_at(step) - A_at(-step)) / (2 * step);
  CHECK(rel_err(jvp, fd) < 1e-7);
  const Mat<double> G = randn<double>(N, h * dv, rng);
  const auto g = multihead_vjp<double>(X, WQ, WK, WV, o, cache, G);
  const double lhs = (jvp.array() * G.array()).sum();
  const double rhs = (g.dWQ.array() * t.dWQ.array()).sum() + (g.dWK.array() * t.dWK.array()).sum() +
                     (g.dWV.array() * t.dWV.array()).sum() + (g.dX.array() * t.dX.array()).sum();
  CHECK(std::abs(lhs - rhs) <= 1e-12 * (std::abs(lhs) + std::abs(rhs)));
}

TEST_CASE("multi-head misuse names the head counts") {
  const Mat<double> X = Mat<double>::Ones(3, 4), W6 = Mat<double>::Ones(4, 6);
  MultiHeadOptions<double> o;
  o.heads = 4;
  CHECK_THROWS_WITH_AS(multihead_forward(X, W6, W6, W6, o),
                       "multihead_forward: W_Q has 6 columns, not a positive multiple of heads = 4",
                       std::invalid_argument);
  o.heads = 3;
  o.kv_heads = 2;
  CHECK_THROWS_WITH_AS(multihead_forward(X, W6, W6, W6, o),
                       "multihead_forward: kv_heads must be >= 1 and divide heads = 3 (got 2)",
                       std::invalid_argument);
  o.heads = 0;
  o.kv_heads = 0;
  CHECK_THROWS_AS(multihead_forward(X, W6, W6, W6, o), std::invalid_argument);
}
