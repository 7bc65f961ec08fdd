// Inputs at every scale of double (core/scaling.hpp; MATH.md §4 "Scaling into range"): κ of a
// matrix and κ(J) by every method on inputs multiplied by 2^k for k from -1070 to +1000, exact
// zeros, single tokens and the denormal case of the hostile audit. Each answer is the answer of
// the input as stored (scaled back exactly, a dense SVD of the assembled J in the normal range)
// within its stated accuracy, or a decline with a reason: never NaN with success, never an
// exception.
#include <spectral_cond/conditioning/kappa.hpp>
#include <spectral_cond/conditioning/methods/kappa_jacobian.hpp>
#include <spectral_cond/core/scaling.hpp>

#include "support/dense_reference.hpp"
#include "support/kappa_methods.hpp"
#include "support/test_helpers.hpp"

#include <cmath>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

using namespace spectral_cond;
using sc_test::rel;

namespace {

const std::vector<int> kScales = {-1070, -1060, -1040, -1023, -1000, -900, -600, -300, -64,
                                  -20,   0,     20,    64,    300,   600,  900,  1000};

const std::vector<JacobianKappaMethod> kMethods = {
    JacobianKappaMethod::Auto,   JacobianKappaMethod::Dense,  JacobianKappaMethod::Gram,
    JacobianKappaMethod::Qr,     JacobianKappaMethod::Lobpcg, JacobianKappaMethod::Iterative,
    JacobianKappaMethod::Matfree};

bool declined(Info i) {
  return i == Info::NotConverging || i == Info::Inaccurate || i == Info::InvalidInput ||
         i == Info::TooLarge;
}

/// The contract of one answer against the dense SVD of the input as stored: success is a finite
/// κ >= 1 within the stated accuracy (and the reference's ε κ, times 100 for the polynomial in
/// the sizes); singular is κ = +inf where the reference is singular or beyond the method's
/// resolution; anything else is a decline that says why.
/// `k`: the answer is of (X 2^k, W 2^-k), whose J is the reference's J times 2^k.
void check_answer(const ConditionResult<double>& r, const ConditionResult<double>& ref,
                  double resolution, int k = 0) {
  INFO("answer: info " << to_string(r.info) << " kappa " << r.kappa << " sigma_max " << r.sigma_max
                       << " sigma_min " << r.sigma_min << " accuracy " << r.accuracy << " method "
                       << r.method << " note " << r.note);
  INFO("reference: info " << to_string(ref.info) << " kappa " << ref.kappa << " sigma_max "
                          << ref.sigma_max);
  if (r.info == Info::Success) {
    REQUIRE(std::isfinite(r.kappa));
    CHECK(r.kappa >= 1);
    REQUIRE(ref.info == Info::Success);
    const double allowed = 100 * (r.accuracy + 1e-15 * ref.kappa) + 1e-12;
    CHECK(rel(r.kappa, ref.kappa) < allowed);
    CHECK(rel(std::ldexp(r.sigma_max, -k), ref.sigma_max) < 1e-6);
  } else if (r.info == Info::Singular) {
    CHECK(std::isinf(r.kappa));
    // Singular where the reference is, or where the reference's κ is beyond what the method
    // resolves (a squared method sees σ only down to about sqrt(n ε) σ_1).
    CHECK((ref.info == Info::Singular || ref.kappa > resolution));
  } else {
    CHECK(declined(r.info));
    CHECK(!r.note.empty());
  }
}

/// The same problem with X 2^k and W 2^-k as stored (entries may round when subnormal, and W
/// may overflow), and the problem those stored values stand for, scaled back exactly.
struct Scaled {
  sc_test::Problem<double> stored, back;
  bool finite = true;
};

Scaled scaled(const sc_test::Problem<double>& p, int k) {
  Scaled s;
  s.stored = p;
  s.stored.X = times_pow2<double>(p.X, k);
  s.stored.WQ = times_pow2<double>(p.WQ, -k);
  s.stored.WK = times_pow2<double>(p.WK, -k);
  s.stored.WV = times_pow2<double>(p.WV, -k);
  s.finite = s.stored.WQ.allFinite() && s.stored.WK.allFinite() && s.stored.WV.allFinite();
  s.back = s.stored;
  s.back.X = times_pow2<double>(s.stored.X, -k);
  s.back.WQ = times_pow2<double>(s.stored.WQ, k);
  s.back.WK = times_pow2<double>(s.stored.WK, k);
  s.back.WV = times_pow2<double>(s.stored.WV, k);
  return s;
}

}  // namespace

TEST_CASE("scaling helpers: exact, and out-of-range factors applied entry by entry") {
  Mat<double> M(2, 2);
  M << 3e-310, -1e-320, 0.0, 2.5e-312;
  const int k = balancing_exponent<double>(M);
  const Mat<double> S = times_pow2<double>(M, k);
  CHECK(S.cwiseAbs().maxCoeff() >= 1);
  CHECK(S.cwiseAbs().maxCoeff() < 2);
  CHECK(times_pow2<double>(S, -k) == M);  // exact both ways: subnormals included
  CHECK(balancing_exponent<double>(Mat<double>::Zero(2, 2)) == 0);
  CHECK(balancing_exponent_of(std::numeric_limits<double>::infinity()) == 0);
  CHECK(balancing_exponent_of(1.5) == 0);
  CHECK(balancing_exponent_of(std::ldexp(1.0, -1074)) == 1074);
}

TEST_CASE("kappa of a matrix at every scale: the same kappa, sigma scaled back") {
  std::mt19937_64 rng(5);
  const Mat<double> W = sc_test::randn<double>(9, 6, rng);
  const ConditionResult<double> ref = kappa(W);
  REQUIRE(ref.info == Info::Success);
  for (int k : kScales) {
    const Mat<double> Wk = times_pow2<double>(W, k);
    INFO("W 2^" << k);
    const ConditionResult<double> r = kappa(Wk);
    if (!Wk.allFinite()) {
      CHECK(r.info == Info::InvalidInput);
      continue;
    }
    // What is stored (subnormal entries round) is what the answer is about.
    const ConditionResult<double> back = kappa(Mat<double>(times_pow2<double>(Wk, -k)));
    REQUIRE((r.info == Info::Success || r.info == Info::Singular));
    CHECK(r.rank == back.rank);
    if (r.info == Info::Success) {
      CHECK(rel(r.kappa, back.kappa) < 1e-12);
      // (σ of W 2^k is itself subnormal below 2^-1022: rounded to fewer digits there.)
      if (std::ldexp(back.sigma_max, k) >= std::numeric_limits<double>::min())
        CHECK(rel(std::ldexp(r.sigma_max, -k), back.sigma_max) < 1e-12);
      if (k > -1000) CHECK(rel(r.kappa, ref.kappa) < 1e-12);  // nothing rounded at this scale
    }
  }
}

namespace {

/// A number as the library prints it in notes (ostream's default format).
std::string printed(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

/// A singular answer at scale 2^j of one at scale 1 (r1): every absolute field 2^j times r1's
/// exactly (both are computed on the same rescaled matrix), and the note's sigma_min and
/// tolerance are the fields' own values (a factor 2^k apart before, k the rescaling exponent).
void check_singular_scaled(const ConditionResult<double>& r, const ConditionResult<double>& r1,
                           int j) {
  INFO("note: " << r.note);
  REQUIRE(r.info == Info::Singular);
  CHECK(r.rank == r1.rank);
  CHECK(r.sigma_max == std::ldexp(r1.sigma_max, j));
  CHECK(r.sigma_min == std::ldexp(r1.sigma_min, j));
  CHECK(r.rank_tol == std::ldexp(r1.rank_tol, j));
  CHECK(r.sigma_dropped == std::ldexp(r1.sigma_dropped, j));
  CHECK(r.sigma_dropped <= r.rank_tol);
  CHECK(r.sigma_dropped >= r.sigma_min);
  CHECK(r.note.find("(sigma_min = " + printed(r.sigma_min) + ")") != std::string::npos);
  CHECK(r.note.find("at tolerance " + printed(r.rank_tol) + " ") != std::string::npos);
}

}  // namespace

TEST_CASE("a singular verdict at any scale: sigma_dropped and the note agree with sigma_min") {
  // Rank 3 of 6 with rounding-level dropped singular values, at max |M| 0.3 (the SVD runs on
  // M 2^2), so that the rescaling is not the identity at j = 0 either.
  std::mt19937_64 rng(11);
  const Mat<double> A = sc_test::randn<double>(7, 3, rng), B = sc_test::randn<double>(3, 6, rng);
  Mat<double> M = A * B;
  M *= 0.3 / M.cwiseAbs().maxCoeff();
  const ConditionResult<double> r1 = kappa(M);
  REQUIRE(r1.info == Info::Singular);
  REQUIRE(r1.rank == 3);
  REQUIRE(r1.sigma_dropped > 0);
  for (int j : {0, -1, 3, -40, 200}) {
    INFO("M 2^" << j);
    check_singular_scaled(kappa(Mat<double>(times_pow2<double>(M, j))), r1, j);
  }
  // κ(J) of a tall J (N d_v rows > D (2 d_k + d_v) columns): singular by its gauge directions,
  // dense SVD; X of max |X| 3 is rescaled by 2^-1.
  sc_test::Problem<double> p;
  p.X = sc_test::randn<double>(12, 2, rng);
  p.X *= 3 / p.X.cwiseAbs().maxCoeff();
  p.WQ = sc_test::randn<double>(2, 2, rng);
  p.WK = sc_test::randn<double>(2, 2, rng);
  p.WV = sc_test::randn<double>(2, 2, rng);
  JacobianKappaOptions jo;
  jo.method = JacobianKappaMethod::Dense;
  const ConditionResult<double> J1 =
      kappa_jacobian<double>(p.X, p.WQ, p.WK, p.WV, AttentionOptions<double>{}, jo);
  REQUIRE(J1.info == Info::Singular);
  REQUIRE(J1.sigma_dropped > 0);
  for (int j : {0, 5, -30}) {
    INFO("(X 2^" << j << ", W 2^-" << j << ")");
    const Scaled s = scaled(p, j);
    check_singular_scaled(kappa_jacobian<double>(s.stored.X, s.stored.WQ, s.stored.WK, s.stored.WV,
                                                 AttentionOptions<double>{}, jo),
                          J1, j);
  }
}

TEST_CASE("kappa(J) at every scale of (X 2^k, W 2^-k), every method") {
  const auto p = sc_test::make_problem<double>(6, 8, 4, 4, 21);
  const ConditionResult<double> unscaled = sc_test::dense_reference(p);
  REQUIRE(unscaled.info == Info::Success);
  for (int k : kScales) {
    const Scaled s = scaled(p, k);
    const ConditionResult<double> ref =
        s.finite ? sc_test::dense_reference(s.back) : ConditionResult<double>{};
    for (JacobianKappaMethod m : kMethods) {
      INFO("X 2^" << k << ", W 2^" << -k << ", method " << to_string(m));
      ConditionResult<double> r;
      REQUIRE_NOTHROW(r = kappa_jacobian(s.stored.X, s.stored.WQ, s.stored.WK, s.stored.WV,
                                         s.stored.opts, sc_test::with_method(m)));
      if (!s.finite) {
        CHECK(r.info == Info::InvalidInput);
        continue;
      }
      check_answer(r, ref, 1e6, k);
      // Where nothing rounded, the answer of the unscaled problem.
      if (r.info == Info::Success && k > -1000 && k < 1000)
        CHECK(rel(r.kappa, unscaled.kappa) < 100 * (r.accuracy + 1e-15 * unscaled.kappa) + 1e-12);
    }
  }
}

TEST_CASE("kappa(J) with X or one W alone at the edge of the range: an answer or a decline") {
  const auto p = sc_test::make_problem<double>(6, 8, 4, 4, 22);
  for (int which = 0; which < 4; ++which) {
    for (int k : {-1074, -1060, -1030, -700, -200, 200, 500, 1000}) {
      auto q = p;
      Mat<double>& M = which == 0 ? q.X : which == 1 ? q.WQ : which == 2 ? q.WK : q.WV;
      M = times_pow2<double>(M, k);
      if (!M.allFinite()) continue;
      // The reference: the dense SVD of the assembled J, where J is finite.
      const ConditionResult<double> ref = sc_test::dense_reference(q);
      for (JacobianKappaMethod m : kMethods) {
        INFO("input " << which << " times 2^" << k << ", method " << to_string(m));
        ConditionResult<double> r;
        REQUIRE_NOTHROW(r = kappa_jacobian(q.X, q.WQ, q.WK, q.WV, q.opts, sc_test::with_method(m)));
        if (r.info == Info::Success) {
          REQUIRE(std::isfinite(r.kappa));
          CHECK(r.kappa >= 1);
        }
        if (ref.info == Info::Success && ref.kappa < 1e8) check_answer(r, ref, 1e6);
        // A certainly singular J is never a well-conditioned success.
        if (ref.info == Info::Singular && ref.rank_certain && r.info == Info::Success)
          CHECK(r.kappa > 1e8);
        if (r.info == Info::Singular) CHECK(std::isinf(r.kappa));
        if (std::isnan(r.kappa)) CHECK(r.info != Info::Success);
      }
    }
  }
}

TEST_CASE("kappa(J): exact zeros and single tokens") {
  const auto p = sc_test::make_problem<double>(1, 8, 4, 4, 23);  // N = 1: P = 1, J = [0 0 I (x) x]
  const ConditionResult<double> ref = sc_test::dense_reference(p);
  for (JacobianKappaMethod m : kMethods) {
    INFO("N = 1, method " << to_string(m));
    const auto r = kappa_jacobian(p.X, p.WQ, p.WK, p.WV, p.opts, sc_test::with_method(m));
    check_answer(r, ref, 1e6);
    if (ref.info == Info::Success && r.info == Info::Success) CHECK(rel(r.kappa, 1.0) < 1e-12);
  }
  auto z = sc_test::make_problem<double>(5, 8, 4, 4, 24);
  z.X.setZero();
  for (JacobianKappaMethod m : kMethods) {
    INFO("X = 0, method " << to_string(m));
    const auto r = kappa_jacobian(z.X, z.WQ, z.WK, z.WV, z.opts, sc_test::with_method(m));
    CHECK(r.info == Info::Singular);
    CHECK(std::isinf(r.kappa));
  }
}
