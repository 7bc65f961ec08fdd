// Theorem 3.4 term by term (MATH.md §5): the softmax Jacobian's spectrum against the assembled
// N^2 x N^2 matrix, the bound's arithmetic, and the verdicts.
#include <spectral_cond/conditioning/bound.hpp>

#include "support/test_helpers.hpp"

#include <Eigen/SVD>

using namespace spectral_cond;
using sc_test::randn;

TEST_CASE("softmax Jacobian condition from its blocks equals the SVD of the assembled 𝚲") {
  std::mt19937_64 rng(31);
  for (MaskKind mask : {MaskKind::None, MaskKind::Causal}) {
    const Index N = 6;
    const Mat<double> X = randn<double>(N, 4, rng), W = randn<double>(4, 3, rng, 0.6);
    AttentionOptions<double> o;
    o.mask = mask;
    const auto cache = attention_forward(X, W, W, W, o);
    Mat<double> Lam =
        Mat<double>::Zero(N * N, N * N);  // vec(P) column-major: entry (i, j) at i + N j
    for (Index i = 0; i < N; ++i)
      for (Index j = 0; j < N; ++j)
        for (Index k = 0; k < N; ++k)
          Lam(i + N * j, i + N * k) =
              (j == k ? cache.P(i, j) : 0.0) - cache.P(i, j) * cache.P(i, k);
    Eigen::JacobiSVD<Mat<double>> svd(Lam);
    const auto s = svd.singularValues();
    const auto r = softmax_jacobian_condition<double>(cache.P);
    INFO("mask " << to_string(mask));
    CHECK(std::isinf(r.kappa));
    CHECK(r.sigma_max == doctest::Approx(s(0)).epsilon(1e-12));
    const double tol = static_cast<double>(N * N) * sc_test::eps<double>() * s(0);
    Index rank = 0;
    while (rank < s.size() && s(rank) > tol) ++rank;
    CHECK(r.rank == rank);
    CHECK(r.kappa_plus == doctest::Approx(s(0) / s(rank - 1)).epsilon(1e-10));
    if (mask == MaskKind::None) CHECK(rank <= N * (N - 1));  // one null vector per block at least
  }
}

TEST_CASE("theorem34 evaluates every term and compares with kappa(J)") {
  std::mt19937_64 rng(77);
  const Mat<double> X = randn<double>(5, 7, rng), WQ = randn<double>(7, 3, rng, 0.5);
  const Mat<double> WK = randn<double>(7, 3, rng, 0.5), WV = randn<double>(7, 2, rng, 0.5);
  AttentionOptions<double> o;
  o.scale = 1.0;
  const Theorem34Report r = theorem34(X, WQ, WK, WV, o);
  CHECK(r.X.kappa == doctest::Approx(kappa(X).kappa));
  CHECK(r.WV.kappa == doctest::Approx(kappa(WV).kappa));
  CHECK(std::isinf(r.Lambda.kappa));
  CHECK(r.vacuous);
  CHECK(r.holds);  // +inf bound
  const double b = std::pow(r.X.kappa_plus, 3) * r.Lambda.kappa_plus * r.WV.kappa_plus *
                       (r.WQ.kappa_plus + r.WK.kappa_plus) +
                   r.X.kappa_plus * r.P.kappa_plus;
  CHECK(r.bound_plus == doctest::Approx(b).epsilon(1e-14));
  CHECK(r.ratio_plus == doctest::Approx(b / r.J.kappa_plus).epsilon(1e-14));
  CHECK(r.holds_plus == (r.J.kappa_plus <= r.bound_plus));
  REQUIRE(r.have_blocks);
  // J_V = I ⊗ (P X): its condition number is that of P X.
  const Mat<double> PX = attention_forward(X, WQ, WK, WV, o).P * X;
  CHECK(r.JV.kappa == doctest::Approx(kappa(PX).kappa).epsilon(1e-9));
  CHECK(!r.verdict.empty());
}
