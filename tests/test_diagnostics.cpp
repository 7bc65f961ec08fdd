// The attention diagnostics (MATH.md §11) and the bound that needs no hypothesis (MATH.md §5),
// against direct computations: the pattern from P entry by entry, the block norms from JacobiSVD
// of the dense blocks of J, and κ(J) <= σ_max(J) / σ_N(P X) against JacobiSVD of the whole J.
#include <spectral_cond/conditioning/bound.hpp>
#include <spectral_cond/conditioning/corrections.hpp>
#include <spectral_cond/conditioning/diagnostics.hpp>

#include "support/test_helpers.hpp"

#include <Eigen/SVD>

using namespace spectral_cond;
using sc_test::randn;

namespace {

Eigen::VectorXd dense_sv(const Mat<double>& M) {
  return Eigen::JacobiSVD<Mat<double>>(M).singularValues();
}

}  // namespace

TEST_CASE("attention_pattern: row maxima, entropies and saturation, entry by entry") {
  const Index N = 4;
  Mat<double> P(N, N);
  P << 1, 0, 0, 0,                 // saturated on the diagonal
      0.25, 0.25, 0.25, 0.25,      // uniform
      0, 0, 0, 1,                  // saturated off the diagonal
      1e-7, 1e-7, 1e-7, 1 - 3e-7;  // saturated on the diagonal (m > 1 - 1e-6)
  const AttentionPattern a = attention_pattern(P);
  CHECK(a.rows == N);
  CHECK(a.row_max_min == 0.25);
  CHECK(a.row_max_mean == doctest::Approx((1 + 0.25 + 1 + (1 - 3e-7)) / 4).epsilon(1e-15));
  const double h3 = -(3 * 1e-7 * std::log(1e-7) + (1 - 3e-7) * std::log(1 - 3e-7));
  CHECK(a.entropy_mean == doctest::Approx((std::log(4.0) + h3) / 4).epsilon(1e-14));
  CHECK(a.saturated == 3);
  CHECK(a.saturated_diagonal == 2);
  CHECK(a.saturated_fraction == 0.75);
  CHECK(!a.identity());
  CHECK(attention_pattern(Mat<double>::Identity(5, 5)).identity());
  CHECK(attention_pattern(Mat<double>::Identity(5, 5)).entropy_mean == 0);
}

TEST_CASE("jacobian_block_norms equal the largest singular values of the dense blocks") {
  std::mt19937_64 rng(2024);
  struct Case {
    Index N, D, dk, dv;
    MaskKind mask;
    double ws;
  };
  for (const Case& c :
       {Case{4, 6, 3, 2, MaskKind::None, 0.5}, Case{5, 5, 2, 3, MaskKind::Causal, 1},
        Case{7, 4, 2, 2, MaskKind::None, 0.3}, Case{3, 8, 4, 4, MaskKind::None, 1}}) {
    const Mat<double> X = randn<double>(c.N, c.D, rng), WQ = randn<double>(c.D, c.dk, rng, c.ws);
    const Mat<double> WK = randn<double>(c.D, c.dk, rng, c.ws),
                      WV = randn<double>(c.D, c.dv, rng, c.ws);
    AttentionOptions<double> o;
    o.mask = c.mask;
    const Mat<double> P = attention_forward(X, WQ, WK, WV, o).P;
    const JacobianBlockNorms n = jacobian_block_norms(X, WQ, WK, WV, o, P, 1e-12, 5000);
    const Mat<double> JQ = attention_jacobian(X, WQ, WK, WV, o, JacobianBlock::Q);
    const Mat<double> JK = attention_jacobian(X, WQ, WK, WV, o, JacobianBlock::K);
    const Mat<double> JV = attention_jacobian(X, WQ, WK, WV, o, JacobianBlock::V);
    Mat<double> JQK(JQ.rows(), JQ.cols() + JK.cols());
    JQK << JQ, JK;
    INFO("N = " << c.N << ", D = " << c.D);
    CHECK(n.converged);
    CHECK(n.sigma_max_JQ == doctest::Approx(dense_sv(JQ)(0)).epsilon(1e-6));
    CHECK(n.sigma_max_JK == doctest::Approx(dense_sv(JK)(0)).epsilon(1e-6));
    CHECK(n.sigma_max_JQK == doctest::Approx(dense_sv(JQK)(0)).epsilon(1e-6));
    CHECK(n.sigma_max_JV == doctest::Approx(dense_sv(JV)(0)).epsilon(1e-13));
    CHECK(n.ratio_QK_V == doctest::Approx(dense_sv(JQK)(0) / dense_sv(JV)(0)).epsilon(1e-6));
    // Power iteration gives ‖J v‖ for a unit v: never above the norm (beyond rounding).
    CHECK(n.sigma_max_JQK <= dense_sv(JQK)(0) * (1 + 1e-13));
  }
}

TEST_CASE("hypothesis-free bound: kappa(J) <= sigma_max(J) / sigma_N(P X) whenever N <= D") {
  std::mt19937_64 rng(99);
  Index checked = 0;
  double worst = 1e300;
  for (int trial = 0; trial < 40; ++trial) {
    const Index D = 3 + trial % 5;
    const Index N = 1 + trial % D;  // N <= D
    const Index dk = 1 + trial % 3, dv = 1 + (trial / 3) % 3;
    const double ws = trial % 4 == 0 ? 0.02 : trial % 4 == 1 ? 0.3 : trial % 4 == 2 ? 1.0 : 2.5;
    const Mat<double> X = randn<double>(N, D, rng), WQ = randn<double>(D, dk, rng, ws);
    const Mat<double> WK = randn<double>(D, dk, rng, ws), WV = randn<double>(D, dv, rng, ws);
    AttentionOptions<double> o;
    o.mask = trial % 2 == 0 ? MaskKind::None : MaskKind::Causal;
    if (trial % 3 == 0) o.scale = 1.0;
    const Mat<double> P = attention_forward(X, WQ, WK, WV, o).P;
    const HypothesisFreeBound b = hypothesis_free_bound(X, WQ, WK, WV, o, P);
    const Mat<double> J = attention_jacobian(X, WQ, WK, WV, o);
    const Eigen::VectorXd s = dense_sv(J);
    INFO("trial " << trial << ": N = " << N << ", D = " << D << ", d_k = " << dk
                  << ", d_v = " << dv);
    REQUIRE(b.info == Info::Success);
    CHECK(b.sigma_max_J == doctest::Approx(s(0)).epsilon(1e-9));
    const Eigen::VectorXd sp = dense_sv(P * X);
    if (!b.applicable) {  // P X numerically rank-deficient (saturated rows on one token)
      CHECK(std::isinf(b.bound));
      CHECK(sp(N - 1) <= static_cast<double>(D) * sc_test::eps<double>() * sp(0) * 10);
      continue;
    }
    CHECK(b.PX.sigma_min == doctest::Approx(sp(N - 1)).epsilon(1e-12));
    const double eps = sc_test::eps<double>();
    const double kJ = s(0) / s(s.size() - 1);
    const double tol =
        static_cast<double>(std::max(J.rows(), J.cols())) * eps * kJ + 10 * b.accuracy;
    CHECK(kJ <= b.bound * (1 + tol));
    worst = std::min(worst, b.bound / kJ);
    ++checked;
  }
  CHECK(checked >= 30);
  MESSAGE("smallest bound / kappa(J) over " << checked << " instances: " << worst);
}

TEST_CASE("hypothesis-free bound is vacuous for N > D and for rank-deficient P X") {
  std::mt19937_64 rng(5);
  const Mat<double> X = randn<double>(6, 4, rng), W = randn<double>(4, 2, rng, 0.5);
  AttentionOptions<double> o;
  const Mat<double> P = attention_forward(X, W, W, W, o).P;
  const HypothesisFreeBound b = hypothesis_free_bound(X, W, W, W, o, P);
  CHECK(!b.applicable);
  CHECK(std::isinf(b.bound));
  // Rank-deficient X (two equal rows) with N <= D: P X loses rank too when P = I.
  Mat<double> Xr = randn<double>(3, 5, rng);
  Xr.row(2) = Xr.row(1);
  const Mat<double> I3 = Mat<double>::Identity(3, 3);
  const HypothesisFreeBound r = hypothesis_free_bound(Xr, Mat<double>(randn<double>(5, 2, rng)),
                                                      Mat<double>(randn<double>(5, 2, rng)),
                                                      Mat<double>(randn<double>(5, 2, rng)), o, I3);
  CHECK(!r.applicable);
  CHECK(std::isinf(r.bound));
}

TEST_CASE("collapse: with W = small + 10 I on LayerNorm-like tokens, kappa(J) = kappa(X)") {
  // d = D: the logits are c λ² x_i · x_j up to the noise, and rows of equal norm make the
  // diagonal the strict maximum of each row (Cauchy–Schwarz), by c λ² (D - x_i · x_j).
  std::mt19937_64 rng(11);
  const Index N = 8, D = 12, d = 12;
  Mat<double> X = randn<double>(N, D, rng);
  for (Index i = 0; i < N; ++i) {  // rows of mean 0 and variance 1
    X.row(i).array() -= X.row(i).mean();
    X.row(i) /= std::sqrt(X.row(i).squaredNorm() / static_cast<double>(D));
  }
  const Mat<double> E = rectangular_identity<double>(D, d);
  const Mat<double> WQ = randn<double>(D, d, rng, 0.02) + 10 * E;
  const Mat<double> WK = randn<double>(D, d, rng, 0.02) + 10 * E;
  const Mat<double> WV = randn<double>(D, d, rng, 0.02) + 10 * E;
  AttentionOptions<double> o;
  BoundOptions bo;
  bo.jacobian.method = JacobianKappaMethod::Dense;
  const Theorem34Report t = theorem34(X, WQ, WK, WV, o, bo);
  REQUIRE(t.have_diagnostics);
  CHECK(t.diagnostics.collapsed);
  CHECK(t.diagnostics.pattern.saturated == N);
  CHECK(t.diagnostics.norms.ratio_QK_V < 1e-20);
  CHECK(t.diagnostics.note.find("kappa(J) = kappa(X)") != std::string::npos);
  CHECK(t.J.kappa == doctest::Approx(t.X.kappa).epsilon(1e-10));
  REQUIRE(t.free_bound.applicable);
  CHECK(t.free_bound.bound == doctest::Approx(t.J.kappa).epsilon(1e-8));  // attained at P = I
  CHECK(t.free_bound_holds);
  // Without the correction the same tokens do not collapse.
  const Theorem34Report u = theorem34(X, Mat<double>(WQ - 10 * E), Mat<double>(WK - 10 * E),
                                      Mat<double>(WV - 10 * E), o, bo);
  CHECK(!u.diagnostics.collapsed);
  CHECK(u.diagnostics.pattern.saturated == 0);
  CHECK(u.free_bound_holds);
  CHECK(u.J.kappa <= u.free_bound.bound * (1 + 1e-10));
}

TEST_CASE("the bound without hypothesis is attained when 1 is in the range of V (N = d_v)") {
  std::mt19937_64 rng(21);
  for (MaskKind mask : {MaskKind::None, MaskKind::Causal}) {
    const Index N = 4, D = 7, dk = 3, dv = 4;  // V = X W_V is square and invertible
    const Mat<double> X = randn<double>(N, D, rng), WQ = randn<double>(D, dk, rng, 0.7);
    const Mat<double> WK = randn<double>(D, dk, rng, 0.7), WV = randn<double>(D, dv, rng, 0.7);
    AttentionOptions<double> o;
    o.mask = mask;
    const Mat<double> P = attention_forward(X, WQ, WK, WV, o).P;
    const Eigen::VectorXd s = dense_sv(attention_jacobian(X, WQ, WK, WV, o));
    const Eigen::VectorXd sp = dense_sv(P * X);
    INFO("mask " << to_string(mask));
    CHECK(s(s.size() - 1) == doctest::Approx(sp(N - 1)).epsilon(1e-10));
  }
}
