// Condition numbers (MATH.md §4): every kappa against an independent Eigen::JacobiSVD, the
// exact semantics for singular, rank-deficient, zero and invalid matrices, every SVD backend.
#include <spectral_cond/conditioning/kappa.hpp>

#include "support/test_helpers.hpp"

#include <Eigen/SVD>

using namespace spectral_cond;
using sc_test::randn;

namespace {

/// Reference singular values in double, from a JacobiSVD computed here.
template <typename Scalar>
Eigen::VectorXd ref_sv(const Mat<Scalar>& M) {
  return Eigen::JacobiSVD<Eigen::MatrixXd>(M.template cast<double>()).singularValues();
}

/// Relative error bound for σ_min and kappa: both SVDs are backward stable, so σ_min carries an
/// absolute error of a few ε σ_1 per dimension.
template <typename Scalar>
double kappa_tol(double kappa_ref, Index m, Index n) {
  return 20.0 * static_cast<double>(std::max(m, n)) * sc_test::eps<Scalar>() * kappa_ref;
}

}  // namespace

TEST_CASE_TEMPLATE("kappa matches an independent JacobiSVD for every backend and shape", Scalar,
                   double, float) {
  struct Shape {
    Index m, n;
  };
  const Shape shapes[] = {{1, 1}, {5, 5}, {9, 4}, {4, 9}, {1, 6}, {6, 1}, {80, 70}, {66, 90}};
  const SvdMethod methods[] = {SvdMethod::Auto, SvdMethod::Jacobi, SvdMethod::BDC,
                               SvdMethod::Lapack};
  std::uint64_t seed = 4100;
  for (const Shape& s : shapes) {
    ++seed;
    std::mt19937_64 rng(seed);
    const Mat<Scalar> M = randn<Scalar>(s.m, s.n, rng);
    const Eigen::VectorXd ref = ref_sv(M);
    const double k_ref = ref(0) / ref(ref.size() - 1);
    for (SvdMethod method : methods) {
      INFO("seed=" << seed << " shape=" << s.m << "x" << s.n << " method=" << to_string(method));
      KappaOptions<Scalar> o;
      o.svd = method;
      const ConditionResult<Scalar> r = kappa(M, o);
      INFO("note: " << r.note << " method used: " << r.method);
      REQUIRE(r.info == Info::Success);
      CHECK(r.rank == std::min(s.m, s.n));
      const double tol = kappa_tol<Scalar>(k_ref, s.m, s.n);
      CHECK(std::abs(static_cast<double>(r.kappa) - k_ref) <= tol * k_ref);
      CHECK(std::abs(static_cast<double>(r.sigma_max) - ref(0)) <=
            20.0 * static_cast<double>(std::max(s.m, s.n)) * sc_test::eps<Scalar>() * ref(0));
      CHECK(r.kappa_plus == r.kappa);
      CHECK(r.sigma_min_plus == r.sigma_min);
      CHECK(r.accuracy == doctest::Approx(static_cast<double>(ScalarTraits<Scalar>::eps()) *
                                          static_cast<double>(r.kappa)));
      CHECK(r.iterations == 0);
      // The transpose has the same singular values.
      const ConditionResult<Scalar> rt = kappa(M.transpose(), o);
      CHECK(std::abs(static_cast<double>(rt.kappa) - k_ref) <= tol * k_ref);
      // singular_values(): sorted and equal to the reference.
      const Vec<Scalar> sv = singular_values(M, method);
      REQUIRE(sv.size() == ref.size());
      for (Index i = 0; i < sv.size(); ++i)
        CHECK(std::abs(static_cast<double>(sv(i)) - ref(i)) <= tol * ref(ref.size() - 1) + 1e-300);
    }
  }
}

TEST_CASE("the method string names the backend actually used") {
  std::mt19937_64 rng(7);
  const Mat<double> small = randn<double>(10, 8, rng), big = randn<double>(70, 70, rng);
  KappaOptions<double> o;
  CHECK(kappa(small, o).method == "jacobi_svd");
  CHECK(kappa(big, o).method == (have_lapacke() ? "lapack_dgesdd" : "bdc_svd"));
  o.svd = SvdMethod::BDC;
  CHECK(kappa(small, o).method == "bdc_svd");
  o.svd = SvdMethod::Jacobi;
  CHECK(kappa(big, o).method == "jacobi_svd");
  o.svd = SvdMethod::Lapack;
  const ConditionResult<double> r = kappa(small, o);
  if (have_lapacke()) {
    CHECK(r.method == "lapack_dgesdd");
    CHECK(r.note.empty());
    CHECK(kappa(small.cast<float>().eval(), KappaOptions<float>{-1, SvdMethod::Lapack}).method ==
          "lapack_sgesdd");
  } else {
    CHECK(r.method == "bdc_svd");
    CHECK(r.note.find("SPECTRAL_COND_HAVE_LAPACKE") != std::string::npos);
  }
}

TEST_CASE_TEMPLATE("an exactly repeated column gives kappa = +inf and kappa_plus with the rank",
                   Scalar, double, float) {
  const std::uint64_t seed = 4200;
  INFO("seed=" << seed);
  std::mt19937_64 rng(seed);
  for (SvdMethod method : {SvdMethod::Jacobi, SvdMethod::BDC, SvdMethod::Lapack}) {
    INFO("method=" << to_string(method));
    Mat<Scalar> M = randn<Scalar>(7, 4, rng);
    M.col(3) = M.col(1);  // exactly singular, rank 3
    const Eigen::VectorXd ref = ref_sv(M);
    for (const Mat<Scalar>& A : {M, Mat<Scalar>(M.transpose())}) {
      KappaOptions<Scalar> o;
      o.svd = method;
      const ConditionResult<Scalar> r = kappa(A, o);
      INFO("note: " << r.note);
      CHECK(r.info == Info::Singular);
      CHECK(std::isinf(r.kappa));
      CHECK(r.kappa > 0);
      CHECK(std::isinf(r.accuracy));
      CHECK(r.rank == 3);
      CHECK(r.sigma_min <= r.rank_tol);
      CHECK(r.rank_tol ==
            doctest::Approx(7.0 * sc_test::eps<Scalar>() * static_cast<double>(r.sigma_max)));
      const double kp_ref = ref(0) / ref(2);
      CHECK(std::abs(static_cast<double>(r.kappa_plus) - kp_ref) <=
            kappa_tol<Scalar>(kp_ref, 7, 4) * kp_ref);
      CHECK(static_cast<double>(r.sigma_min_plus) ==
            doctest::Approx(ref(2)).epsilon(100 * sc_test::eps<Scalar>() * kp_ref));
      CHECK(!r.note.empty());
    }
  }
}

TEST_CASE_TEMPLATE("rank-deficient products, 1 x 1 and the zero matrix", Scalar, double, float) {
  const std::uint64_t seed = 4300;
  INFO("seed=" << seed);
  std::mt19937_64 rng(seed);
  // Rank 2 as a product: computed singular values beyond 2 are rounding noise.
  const Mat<Scalar> M = randn<Scalar>(8, 2, rng) * randn<Scalar>(2, 5, rng);
  const ConditionResult<Scalar> r = kappa(M);
  const Eigen::VectorXd ref = ref_sv(M);
  CHECK(r.info == Info::Singular);
  CHECK(std::isinf(r.kappa));
  CHECK(r.rank == 2);
  const double kp_ref = ref(0) / ref(1);
  CHECK(std::abs(static_cast<double>(r.kappa_plus) - kp_ref) <=
        kappa_tol<Scalar>(kp_ref, 8, 5) * kp_ref);
  CHECK(kappa_plus(M).kappa_plus == r.kappa_plus);

  const Mat<Scalar> one = Mat<Scalar>::Constant(1, 1, Scalar(-3));
  const ConditionResult<Scalar> r1 = kappa(one);
  CHECK(r1.info == Info::Success);
  CHECK(r1.kappa == Scalar(1));
  CHECK(r1.sigma_max == Scalar(3));
  CHECK(r1.rank == 1);

  for (const Mat<Scalar>& Z :
       {Mat<Scalar>(Mat<Scalar>::Zero(1, 1)), Mat<Scalar>(Mat<Scalar>::Zero(3, 5))}) {
    const ConditionResult<Scalar> z = kappa(Z);
    CHECK(z.info == Info::Singular);
    CHECK(z.sigma_max == Scalar(0));
    CHECK(z.sigma_min == Scalar(0));
    CHECK(std::isinf(z.kappa));
    CHECK(z.rank == 0);
    CHECK(z.rank_tol == Scalar(0));
    CHECK(std::isnan(z.kappa_plus));
    CHECK(std::isnan(z.sigma_min_plus));
    CHECK(z.note.find("zero matrix") != std::string::npos);
  }
}

TEST_CASE_TEMPLATE("NaN or Inf input is InvalidInput with every value NaN", Scalar, double, float) {
  Mat<Scalar> M = Mat<Scalar>::Identity(3, 4);
  for (Scalar bad : {std::numeric_limits<Scalar>::quiet_NaN(), ScalarTraits<Scalar>::inf(),
                     -ScalarTraits<Scalar>::inf()}) {
    M(1, 2) = bad;
    const ConditionResult<Scalar> r = kappa(M);
    CHECK(r.info == Info::InvalidInput);
    CHECK(std::isnan(r.kappa));
    CHECK(std::isnan(r.kappa_plus));
    CHECK(std::isnan(r.sigma_max));
    CHECK(std::isnan(r.sigma_min));
    CHECK(std::isnan(r.sigma_min_plus));
    CHECK(std::isnan(r.accuracy));
    CHECK(std::isnan(r.rank_tol));
    CHECK(r.rank == -1);
    const Vec<Scalar> sv = singular_values(M);
    CHECK(sv.size() == 3);
    CHECK(sv.array().isNaN().all());
  }
}

TEST_CASE("argument errors throw, naming the function") {
  const Mat<double> empty(0, 3);
  CHECK_THROWS_WITH_AS(kappa(empty), doctest::Contains("kappa: M must have"),
                       std::invalid_argument);
  CHECK_THROWS_AS(singular_values(Mat<double>(4, 0)), std::invalid_argument);
  KappaOptions<double> o;
  o.rtol = 1.5;
  CHECK_THROWS_WITH_AS(kappa(Mat<double>::Identity(2, 2), o), doctest::Contains("rtol"),
                       std::invalid_argument);
  o.rtol = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_AS(kappa(Mat<double>::Identity(2, 2), o), std::invalid_argument);
  CHECK_THROWS_AS(condition_from_singular_values<double>(Vec<double>::Ones(3), 2, 2),
                  std::invalid_argument);
}

TEST_CASE_TEMPLATE("rtol decides the rank, hence whether kappa is finite", Scalar, double, float) {
  // Orthogonal factors from a seeded QR, singular values 1, 1e-2, 1e-4 (representable in float).
  const std::uint64_t seed = 4400;
  INFO("seed=" << seed);
  std::mt19937_64 rng(seed);
  const Eigen::MatrixXd Ud =
      Eigen::HouseholderQR<Eigen::MatrixXd>(randn<double>(6, 3, rng)).householderQ() *
      Eigen::MatrixXd::Identity(6, 3);
  const Eigen::MatrixXd Vd =
      Eigen::HouseholderQR<Eigen::MatrixXd>(randn<double>(3, 3, rng)).householderQ();
  const Eigen::Vector3d s(1.0, 1e-2, 1e-4);
  const Mat<Scalar> M = (Ud * s.asDiagonal() * Vd.transpose()).cast<Scalar>();
  const double k_ref = ref_sv(M)(0) / ref_sv(M)(2);

  KappaOptions<Scalar> o;  // default rtol = 6 ε: full rank
  ConditionResult<Scalar> r = kappa(M, o);
  CHECK(r.info == Info::Success);
  CHECK(r.rank == 3);
  CHECK(std::abs(static_cast<double>(r.kappa) - k_ref) <= kappa_tol<Scalar>(k_ref, 6, 3) * k_ref);

  o.rtol = Scalar(1e-3);  // σ_3 = 1e-4 falls below
  r = kappa(M, o);
  CHECK(r.info == Info::Singular);
  CHECK(std::isinf(r.kappa));
  CHECK(r.rank == 2);
  CHECK(static_cast<double>(r.kappa_plus) ==
        doctest::Approx(100.0).epsilon(1e3 * sc_test::eps<Scalar>()));
  CHECK(r.rank_tol == doctest::Approx(1e-3 * static_cast<double>(r.sigma_max)));

  o.rtol = Scalar(0);  // only an exact zero is singular
  const Mat<Scalar> D2 = Eigen::Matrix<Scalar, 2, 1>(Scalar(1), Scalar(0)).asDiagonal();
  CHECK(std::isinf(kappa(D2, o).kappa));
  const Mat<Scalar> D3 = Eigen::Matrix<Scalar, 2, 1>(Scalar(1), Scalar(1e-30)).asDiagonal();
  CHECK(kappa(D3, o).info == Info::Success);
  CHECK(static_cast<double>(kappa(D3, o).kappa) == doctest::Approx(1e30).epsilon(1e-6));
  CHECK(kappa(D3).info == Info::Singular);  // default tolerance: numerically singular
}

TEST_CASE("condition_from_singular_values refuses values out of order or negative") {
  // [1, 2] would otherwise give kappa = sv(0) / sv(1) = 0.5, below the lower bound 1.
  Vec<double> up(2);
  up << 1, 2;
  CHECK_THROWS_AS(condition_from_singular_values<double>(up, 2, 2), std::invalid_argument);
  Vec<double> neg(2);
  neg << 2, -1;
  CHECK_THROWS_AS(condition_from_singular_values<double>(neg, 2, 2), std::invalid_argument);
  Vec<double> ok(2);
  ok << 2, 2;  // equal values are in order
  CHECK(condition_from_singular_values<double>(ok, 2, 2).kappa == 1.0);
}

TEST_CASE("condition_from_singular_values applies the same rules to given values") {
  Vec<double> sv(3);
  sv << 4.0, 2.0, 0.5;
  ConditionResult<double> r = condition_from_singular_values<double>(sv, 3, 5, {}, "mine");
  CHECK(r.kappa == 8.0);
  CHECK(r.method == "mine");
  CHECK(r.rank == 3);
  sv(2) = 0.0;
  r = condition_from_singular_values<double>(sv, 3, 5);
  CHECK(std::isinf(r.kappa));
  CHECK(r.kappa_plus == 2.0);
  CHECK(r.rank == 2);
}

TEST_CASE("kappa_via_gram: well conditioned matrices to eps*kappa^2, the rest declined") {
  constexpr double eps = sc_test::eps<double>();
  std::mt19937_64 rng(4711);
  struct Shape {
    Index m, n;
  };
  for (const Shape s : {Shape{60, 60}, Shape{90, 40}, Shape{40, 90}, Shape{1, 7}, Shape{7, 1}}) {
    CAPTURE(s.m);
    CAPTURE(s.n);
    // W + 10 I_k with W of norm about 1: kappa about 1.2, as after a lambda correction.
    const Mat<double> M =
        randn<double>(s.m, s.n, rng, 0.05) + 10.0 * Mat<double>::Identity(s.m, s.n);
    const auto g = kappa_via_gram(M);
    REQUIRE(g.has_value());
    const Eigen::VectorXd ref = ref_sv(M);
    const double k_ref = ref(0) / ref(ref.size() - 1);
    const double tol = 20.0 * static_cast<double>(std::max(s.m, s.n)) * eps * k_ref * k_ref;
    CHECK(g->method == "gram_eigen");
    CHECK(g->info == Info::Success);
    CHECK(g->rank == std::min(s.m, s.n));
    CHECK(std::abs(g->sigma_max - ref(0)) <= tol * ref(0));
    CHECK(std::abs(g->sigma_min - ref(ref.size() - 1)) <= tol * ref(ref.size() - 1));
    CHECK(std::abs(g->kappa - k_ref) <= tol * k_ref);
    CHECK(g->kappa_plus == g->kappa);
    CHECK(g->accuracy == doctest::Approx(eps * g->kappa * g->kappa).epsilon(1e-6));
  }
  // kappa = 1e4: eps kappa^2 = 2e-8 > 1e-12, so the squared route declines; a looser
  // max_error accepts it, and then σ_min is off by about that much and no more.
  Eigen::VectorXd sv(30);
  for (Index i = 0; i < 30; ++i) sv(i) = std::pow(1e-4, static_cast<double>(i) / 29.0);
  const Mat<double> Qa =
      Eigen::HouseholderQR<Mat<double>>(randn<double>(50, 30, rng)).householderQ() *
      Mat<double>::Identity(50, 30);
  const Mat<double> Qb =
      Eigen::HouseholderQR<Mat<double>>(randn<double>(30, 30, rng)).householderQ();
  const Mat<double> ill = Qa * sv.asDiagonal() * Qb.transpose();
  CHECK_FALSE(kappa_via_gram(ill).has_value());
  const auto loose = kappa_via_gram(ill, 1e-6);
  REQUIRE(loose.has_value());
  CHECK(loose->accuracy > 1e-12);
  CHECK(std::abs(loose->sigma_min - 1e-4) <= 100.0 * loose->accuracy * 1e-4);
  // Singular, NaN: declined (the caller's SVD reports them); bad arguments throw.
  Mat<double> sing = randn<double>(8, 8, rng);
  sing.col(3) = sing.col(5);
  CHECK_FALSE(kappa_via_gram(sing).has_value());
  Mat<double> nan = Mat<double>::Identity(4, 4);
  nan(1, 2) = std::numeric_limits<double>::quiet_NaN();
  CHECK_FALSE(kappa_via_gram(nan).has_value());
  CHECK_THROWS_WITH_AS(kappa_via_gram(Mat<double>(0, 3)), doctest::Contains("kappa_via_gram"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(kappa_via_gram(Mat<double>::Identity(3, 3), 0.0),
                       doctest::Contains("max_error"), std::invalid_argument);
}
