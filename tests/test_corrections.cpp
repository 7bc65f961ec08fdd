// The paper's corrections (MATH.md §6–7): Theorem 3.5's exact correction reaches its predicted
// kappa and keeps singular vectors; λ I_k obeys the Weyl bound where it applies, and fails
// without a hypothesis (the diag(-9.9, 5) counterexample); multi-head placements.
#include <spectral_cond/conditioning/corrections.hpp>

#include "support/test_helpers.hpp"

#include <Eigen/QR>
#include <Eigen/SVD>

using namespace spectral_cond;
using sc_test::randn;

namespace {

Eigen::VectorXd ref_sv(const Mat<double>& M) {
  return Eigen::JacobiSVD<Eigen::MatrixXd>(M).singularValues();
}
double ref_kappa(const Mat<double>& M) {
  const Eigen::VectorXd s = ref_sv(M);
  return s(0) / s(s.size() - 1);
}

/// m x n matrix with given singular values and seeded random singular vectors.
Mat<double> with_singular_values(Index m, Index n, const Eigen::VectorXd& s, std::mt19937_64& rng) {
  const Index r = std::min(m, n);
  const Mat<double> U = Eigen::HouseholderQR<Mat<double>>(randn<double>(m, m, rng)).householderQ();
  const Mat<double> V = Eigen::HouseholderQR<Mat<double>>(randn<double>(n, n, rng)).householderQ();
  return U.leftCols(r) * s.asDiagonal() * V.leftCols(r).transpose();
}

constexpr double kEps = std::numeric_limits<double>::epsilon();

}  // namespace

TEST_CASE("Theorem 3.5: kappa(W + sigma_1 U V^T) = 2 sigma_1/(sigma_1 + sigma_r), vectors kept") {
  struct Shape {
    Index m, n;
  };
  std::uint64_t seed = 5100;
  for (const Shape& sh : {Shape{6, 6}, Shape{9, 5}, Shape{4, 7}, Shape{1, 1}, Shape{1, 5}}) {
    ++seed;
    INFO("seed=" << seed << " shape=" << sh.m << "x" << sh.n);
    std::mt19937_64 rng(seed);
    const Index r = std::min(sh.m, sh.n);
    Eigen::VectorXd s = Eigen::VectorXd::LinSpaced(r, 0.0, -4.0);  // 1 … 1e-4, distinct
    s = s.unaryExpr([](double e) { return std::pow(10.0, e); });
    const Mat<double> W = 3.0 * with_singular_values(sh.m, sh.n, s, rng);
    const Eigen::VectorXd sw = ref_sv(W);
    const double predicted = 2 * sw(0) / (sw(0) + sw(r - 1));

    const ExactCorrection<double> ec = exact_correction(W);
    CHECK(ec.corrected);
    CHECK(ec.alpha == doctest::Approx(sw(0)).epsilon(50 * kEps));
    CHECK(std::abs(ec.kappa_after - predicted) <= 50 * kEps * predicted);
    CHECK(std::abs(ec.kappa_predicted - predicted) <= 50 * kEps * predicted);
    CHECK(std::abs(ref_kappa(ec.W_corrected) - predicted) <= 50 * kEps * predicted);
    CHECK(std::abs(ec.kappa_before - ref_kappa(W)) <= 1e3 * kEps * ref_kappa(W));
    CHECK(sc_test::rel_err(ec.W_corrected, Mat<double>(W + ec.C)) == 0.0);
    CHECK(ec.info == Info::Success);

    // Singular vectors unchanged: W + C = U (Σ + σ_1 I) V^T, so |U^T U'| = |V^T V'| = I.
    Eigen::JacobiSVD<Eigen::MatrixXd> a(W, Eigen::ComputeThinU | Eigen::ComputeThinV);
    Eigen::JacobiSVD<Eigen::MatrixXd> b(ec.W_corrected, Eigen::ComputeThinU | Eigen::ComputeThinV);
    const Mat<double> Iu = (a.matrixU().transpose() * b.matrixU()).cwiseAbs();
    const Mat<double> Iv = (a.matrixV().transpose() * b.matrixV()).cwiseAbs();
    CHECK(sc_test::rel_err(Iu, Mat<double>(Mat<double>::Identity(r, r))) < 1e4 * kEps);
    CHECK(sc_test::rel_err(Iv, Mat<double>(Mat<double>::Identity(r, r))) < 1e4 * kEps);
    const Eigen::VectorXd shifted = sw.array() + sw(0);
    CHECK(sc_test::rel_err(b.singularValues(), shifted) < 50 * kEps);
  }
}

TEST_CASE("Theorem 3.5 with a target t gives kappa = t; no correction when already below") {
  const std::uint64_t seed = 5200;
  INFO("seed=" << seed);
  std::mt19937_64 rng(seed);
  Eigen::VectorXd s(5);
  s << 50, 20, 3, 0.7, 0.05;  // kappa(W) = 1000
  const Mat<double> W = with_singular_values(7, 5, s, rng);
  for (double t : {1.01, 1.5, 3.0, 10.0, 999.0}) {
    INFO("t=" << t);
    const ExactCorrection<double> ec = exact_correction(W, t);
    CHECK(ec.corrected);
    CHECK(ec.alpha == doctest::Approx((50 - t * 0.05) / (t - 1)).epsilon(1e3 * kEps));
    CHECK(std::abs(ec.kappa_after - t) <= 1e3 * kEps * t);
    CHECK(std::abs(ref_kappa(ec.W_corrected) - t) <= 1e3 * kEps * t);
    CHECK(ec.kappa_predicted == t);
    REQUIRE(ec.target.has_value());
    CHECK(*ec.target == t);
  }
  const ExactCorrection<double> none = exact_correction(W, 2000.0);
  CHECK_FALSE(none.corrected);
  CHECK(none.alpha == 0.0);
  CHECK(none.C.cwiseAbs().maxCoeff() == 0.0);
  CHECK(sc_test::rel_err(none.W_corrected, W) == 0.0);
  CHECK(none.note.find("no correction needed") != std::string::npos);
  CHECK(none.kappa_after == doctest::Approx(1000.0).epsilon(1e-9));

  // The SVD-taking form (for refreshes) gives the same correction.
  const ThinSvd<double> svd = thin_svd(W);
  const ExactCorrection<double> a = exact_correction_from_svd<double>(W, svd, 3.0);
  CHECK(sc_test::rel_err(a.C, exact_correction(W, 3.0).C) < 10 * kEps);
  CHECK_THROWS_AS(exact_correction_from_svd<double>(W.leftCols(4), svd), std::invalid_argument);
  for (double bad : {1.0, 0.5, -2.0, std::numeric_limits<double>::quiet_NaN()})
    CHECK_THROWS_WITH_AS(exact_correction(W, bad), doctest::Contains("target must be"),
                         std::invalid_argument);
}

TEST_CASE("Theorem 3.5 on rank-deficient W gives kappa exactly 2 (or t)") {
  const std::uint64_t seed = 5300;
  INFO("seed=" << seed);
  std::mt19937_64 rng(seed);
  Mat<double> W = randn<double>(6, 4, rng);
  W.col(2) = W.col(0);  // exactly rank 3
  for (const Mat<double>& A : {W, Mat<double>(W.transpose())}) {
    const ExactCorrection<double> ec = exact_correction(A);
    CHECK(std::isinf(ec.kappa_before));
    CHECK(std::abs(ec.kappa_after - 2.0) <= 20 * kEps);
    CHECK(std::abs(ref_kappa(ec.W_corrected) - 2.0) <= 20 * kEps);
    CHECK(std::abs(ec.kappa_predicted - 2.0) <= 20 * kEps);
    const ExactCorrection<double> et = exact_correction(A, 5.0);
    CHECK(std::abs(et.kappa_after - 5.0) <= 100 * kEps);
  }
  // W = 0: nothing to condition; the result says so.
  const ExactCorrection<double> z = exact_correction(Mat<double>(Mat<double>::Zero(3, 2)));
  CHECK(z.info == Info::Singular);
  CHECK(std::isinf(z.kappa_after));
  CHECK(z.note.find("W = 0") != std::string::npos);
  // NaN: an answer, all NaN.
  Mat<double> bad = W;
  bad(0, 0) = std::numeric_limits<double>::quiet_NaN();
  const ExactCorrection<double> n = exact_correction(bad);
  CHECK(n.info == Info::InvalidInput);
  CHECK(std::isnan(n.kappa_after));
  CHECK(n.C.array().isNaN().all());
}

TEST_CASE("float: Theorem 3.5 in single precision") {
  std::mt19937_64 rng(5400);
  const Mat<float> W = randn<float>(8, 6, rng);
  const ExactCorrection<float> ec = exact_correction(W);
  const double pred = static_cast<double>(ec.kappa_predicted);
  CHECK(std::abs(static_cast<double>(ec.kappa_after) - pred) <= 100 * sc_test::eps<float>() * pred);
  CHECK(std::abs(static_cast<double>(exact_correction(W, 1.5f).kappa_after) - 1.5) <=
        100 * sc_test::eps<float>() * 1.5);
}

TEST_CASE("Theorem 3.8: lambda I_k obeys the Weyl bound on many random W") {
  const std::uint64_t seed = 5500;
  INFO("seed=" << seed);
  std::mt19937_64 rng(seed);
  struct Shape {
    Index m, n;
  };
  int applied = 0, guaranteed = 0, total = 0;
  for (int trial = 0; trial < 40; ++trial) {
    for (const Shape& sh : {Shape{5, 5}, Shape{8, 3}, Shape{3, 8}, Shape{1, 1}, Shape{1, 4}}) {
      const double scale = std::pow(10.0, -1.5 + 0.1 * trial);  // s from ~0.03 to ~300
      const Mat<double> W = randn<double>(sh.m, sh.n, rng, scale);
      for (double lambda : {0.0, 1.0, 2.0, 10.0}) {
        INFO("trial=" << trial << " shape=" << sh.m << "x" << sh.n << " lambda=" << lambda);
        const LambdaCorrection<double> lc = lambda_correction(W, lambda);
        const Mat<double> ref = W + lambda * Mat<double>::Identity(sh.m, sh.n);
        CHECK(sc_test::rel_err(lc.W_corrected, ref) == 0.0);
        const Eigen::VectorXd sw = ref_sv(W), sc = ref_sv(ref);
        const double kr = sc(0) / sc(sc.size() - 1);
        CHECK(std::abs(lc.kappa_after - kr) <= 1e3 * kEps * kr);
        CHECK(lc.s == doctest::Approx(sw(0)).epsilon(100 * kEps));
        CHECK(lc.isometric_addend);
        CHECK(lc.weyl_applies == (lambda > lc.s));
        // Weyl's inequality itself: |σ_i(W + λ I_k) - λ| <= σ_1(W).
        for (Index i = 0; i < sc.size(); ++i)
          CHECK(std::abs(sc(i) - lambda) <= sw(0) * (1 + 100 * kEps) + 100 * kEps * lambda);
        ++total;
        if (!lc.weyl_applies) {
          CHECK(std::isinf(lc.weyl_bound));
          CHECK_FALSE(lc.improvement_guaranteed);
          continue;
        }
        ++applied;
        CHECK(lc.weyl_bound == doctest::Approx((lambda + sw(0)) / (lambda - sw(0))));
        CHECK(lc.kappa_after <= lc.weyl_bound * (1 + 1e3 * kEps));
        if (lc.improvement_guaranteed) {
          ++guaranteed;
          CHECK(lc.kappa_after < lc.kappa_before);
          CHECK(lambda > lc.lambda_min);
        }
      }
    }
  }
  // The sweep exercises every branch (the checks above cannot pass vacuously).
  CHECK(applied > total / 4);
  CHECK(guaranteed > 10);
  CHECK(applied < total);
}

TEST_CASE("the counterexample W = diag(-9.9, 5), lambda = 10: kappa 1.98 -> 150") {
  Mat<double> W(2, 2);
  W << -9.9, 0, 0, 5;
  const LambdaCorrection<double> lc = lambda_correction(W, 10.0);
  CHECK(std::abs(lc.kappa_before - 1.98) <= 4 * kEps * 1.98);
  CHECK(std::abs(lc.kappa_after - 150.0) <= 1e3 * kEps * 150.0);  // 10 - 9.9 is inexact
  CHECK(lc.s == 9.9);
  CHECK(lc.weyl_applies);  // λ = 10 > s = 9.9, and indeed 150 <= (10 + 9.9)/(10 - 9.9) = 199
  CHECK(lc.weyl_bound == doctest::Approx(199.0).epsilon(1e-12));
  CHECK(lc.kappa_after <= lc.weyl_bound);
  CHECK(lc.lambda_min == doctest::Approx(9.9 * 2.98 / 0.98).epsilon(1e-12));
  CHECK_FALSE(lc.improvement_guaranteed);
  CHECK(lc.note.find("not guaranteed") != std::string::npos);
  // A well-conditioned W (kappa = 1): no lambda can improve it.
  const LambdaCorrection<double> id =
      lambda_correction(Mat<double>(Mat<double>::Identity(3, 3)), 5.0);
  CHECK(std::isinf(id.lambda_min));
  CHECK_FALSE(id.improvement_guaranteed);
  CHECK(id.kappa_after == doctest::Approx(1.0));
  // A singular W: lambda_min = s, and any lambda > s gives a finite kappa.
  Mat<double> S(2, 2);
  S << 3, 0, 0, 0;
  const LambdaCorrection<double> sg = lambda_correction(S, 4.0);
  CHECK(sg.lambda_min == 3.0);
  CHECK(sg.improvement_guaranteed);
  CHECK(sg.kappa_after == doctest::Approx(7.0 / 4.0));
  CHECK_THROWS_AS(lambda_correction(S, -1.0), std::invalid_argument);
  CHECK_THROWS_AS(lambda_correction(S, std::numeric_limits<double>::infinity()),
                  std::invalid_argument);
}

TEST_CASE("rectangular identity shapes and lambda_identity placements") {
  for (auto [r, c] : {std::pair<Index, Index>{2, 5}, {5, 2}, {3, 3}, {1, 4}}) {
    const Mat<double> I = rectangular_identity(r, c);
    CHECK(I.rows() == r);
    CHECK(I.cols() == c);
    for (Index i = 0; i < r; ++i)
      for (Index j = 0; j < c; ++j) CHECK(I(i, j) == (i == j ? 1.0 : 0.0));
    CHECK(ref_sv(I).isApprox(Eigen::VectorXd::Ones(std::min(r, c))));
  }
  CHECK(rectangular_identity<float>(2, 3).sum() == 2.0f);
  CHECK_THROWS_AS(rectangular_identity(0, 3), std::invalid_argument);

  // D = 6, 3 heads of 2: Fused = I_6 (head j gets rows 2j, 2j+1); PerHead = [I(6,2)] x 3.
  const Mat<double> F = lambda_identity(6, 3, 2, Placement::Fused);
  CHECK(F == Mat<double>(Mat<double>::Identity(6, 6)));
  const Mat<double> P = lambda_identity(6, 3, 2, Placement::PerHead);
  REQUIRE(P.rows() == 6);
  REQUIRE(P.cols() == 6);
  for (Index i = 0; i < 6; ++i)
    for (Index j = 0; j < 6; ++j) CHECK(P(i, j) == (i == j % 2 ? 1.0 : 0.0));
  // D = 4 < 3 x 2: the fused identity runs out at column 4; head 2's slice is zero.
  const Mat<double> F2 = lambda_identity(4, 3, 2, Placement::Fused);
  CHECK(F2 == Mat<double>(Mat<double>::Identity(4, 6)));
  CHECK(F2.rightCols(2).cwiseAbs().maxCoeff() == 0.0);
  CHECK_THROWS_AS(lambda_identity(4, 0, 2, Placement::Fused), std::invalid_argument);
}

TEST_CASE("multihead_lambda_report: per-head kappa, and Weyl claimed only where it holds") {
  const std::uint64_t seed = 5600;
  INFO("seed=" << seed);
  std::mt19937_64 rng(seed);
  for (Index D : {6, 4}) {
    const Index heads = 3, d = 2;
    const Mat<double> W = randn<double>(D, heads * d, rng, 0.3);
    for (Placement pl : {Placement::Fused, Placement::PerHead}) {
      INFO("D=" << D << " placement=" << to_string(pl));
      const auto rep = multihead_lambda_report(W, heads, 10.0, pl);
      REQUIRE(rep.size() == 3);
      const Mat<double> E = lambda_identity(D, heads, d, pl);
      for (Index j = 0; j < heads; ++j) {
        INFO("head " << j);
        const auto& h = rep[static_cast<size_t>(j)];
        const Mat<double> Wj = W.middleCols(j * d, d);
        const Mat<double> ref = Wj + 10.0 * E.middleCols(j * d, d);
        CHECK(sc_test::rel_err(h.W_corrected, ref) == 0.0);
        CHECK(h.kappa_after == doctest::Approx(ref_kappa(ref)).epsilon(1e-12));
        CHECK(h.kappa_before == doctest::Approx(ref_kappa(Wj)).epsilon(1e-12));
        const bool iso = pl == Placement::PerHead || (j + 1) * d <= D;
        CHECK(h.isometric_addend == iso);
        CHECK(h.weyl_applies == iso);  // λ = 10 > s for these small weights
        if (h.weyl_applies)
          CHECK(h.kappa_after <= h.weyl_bound);
        else
          CHECK(std::isinf(h.weyl_bound));
      }
    }
  }
  CHECK_THROWS_AS(
      multihead_lambda_report(Mat<double>(Mat<double>::Zero(4, 6)), 4, 1.0, Placement::Fused),
      std::invalid_argument);
}

TEST_CASE_TEMPLATE("thin_svd above the Jacobi size (gesdd or BDCSVD) is a valid SVD", Scalar,
                   double, float) {
  const std::uint64_t seed = 5400;
  INFO("seed=" << seed);
  std::mt19937_64 rng(seed);
  for (const auto& [m, n] : {std::pair<Index, Index>{100, 80}, {72, 130}}) {
    const Mat<Scalar> W = randn<Scalar>(m, n, rng);
    const ThinSvd<Scalar> s = thin_svd(W);
    const Index r = std::min(m, n);
    REQUIRE(s.U.rows() == m);
    REQUIRE(s.U.cols() == r);
    REQUIRE(s.V.rows() == n);
    REQUIRE(s.V.cols() == r);
    const double tol = 200 * static_cast<double>(std::numeric_limits<Scalar>::epsilon());
    const Mat<Scalar> I = Mat<Scalar>::Identity(r, r);
    CHECK(static_cast<double>((s.U.transpose() * s.U - I).cwiseAbs().maxCoeff()) < tol);
    CHECK(static_cast<double>((s.V.transpose() * s.V - I).cwiseAbs().maxCoeff()) < tol);
    const Mat<Scalar> back = s.U * s.S.asDiagonal() * s.V.transpose();
    CHECK(sc_test::rel_err(back, W) < tol);
    const Eigen::JacobiSVD<Mat<Scalar>> ref(W);
    for (Index i = 0; i < r; ++i)
      CHECK(std::abs(static_cast<double>(s.S(i) - ref.singularValues()(i))) <
            tol * static_cast<double>(ref.singularValues()(0)));
  }
}
