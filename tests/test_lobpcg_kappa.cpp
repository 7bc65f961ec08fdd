// The lobpcg method for kappa(J) (jacobian_kappa.hpp; MATH.md §3 "Squaring is not affordable",
// §4): against a dense SVD of the assembled J on PyTorch-style instances where gram loses digits,
// with masks, c = 1, N > D and float inputs; where it declines (tall or singular J, no
// convergence) and what kappa_jacobian does then (qr); auto's choice; option checks.
#include <spectral_cond/conditioning/methods/kappa_jacobian.hpp>

#include <string>

#include "support/dense_reference.hpp"
#include "support/kappa_methods.hpp"
#include "support/test_helpers.hpp"

using namespace spectral_cond;
using sc_test::dense_reference;
using sc_test::make_problem;
using sc_test::Problem;
using sc_test::rel;
using sc_test::with_method;

namespace {

// N = D = d_k = d_v of the mid-sized cases (smaller under the sanitizers, which run at -O0).
constexpr Index kMid = SC_TEST_SANITIZED ? 12 : 24;

/// lobpcg answered, and agrees with the dense SVD to `tol` or to what the two accuracies allow:
/// its stated accuracy plus the SVD's ε κ, with a factor 20 for the polynomial in the sizes.
void check_agrees(const ConditionResult<double>& l, const ConditionResult<double>& d, double tol,
                  const std::string& method = "lobpcg") {
  INFO("lobpcg: sigma_min " << l.sigma_min << " kappa " << l.kappa << " accuracy " << l.accuracy
                            << " residual " << l.residual << " note: " << l.note);
  INFO("svd: sigma_min " << d.sigma_min << " kappa " << d.kappa);
  REQUIRE(l.info == Info::Success);
  REQUIRE(d.info == Info::Success);
  CHECK(l.method == method);
  const double allowed = std::max(tol, 20 * (l.accuracy + sc_test::eps<double>() * d.kappa));
  CHECK(rel(l.sigma_max, d.sigma_max) < 1e-12);
  CHECK(rel(l.sigma_min, d.sigma_min) < allowed);
  CHECK(rel(l.kappa, d.kappa) < allowed);
  CHECK(rel(l.kappa_plus, d.kappa_plus) < allowed);
  CHECK(l.rank == d.rank);
}

}  // namespace

TEST_CASE("lobpcg agrees with the dense SVD of J where gram loses digits") {
  struct Case {
    Index N, D, d;
    std::uint64_t seed;
  };
  std::vector<Case> cases{Case{32, 32, 32, 11}, Case{40, 40, 40, 12}};
  if (SC_TEST_SANITIZED) cases = {Case{12, 12, 12, 11}};
  for (const Case c : cases) {
    INFO("seed=" << c.seed << " N=D=d_k=d_v=" << c.N);
    const auto p = make_problem<double>(c.N, c.D, c.d, c.d, c.seed);
    const auto l = kappa_jacobian_lobpcg<double>(p.X, p.WQ, p.WK, p.WV, p.opts);
    const auto d = dense_reference(p);
    const auto g =
        kappa_jacobian(p.X, p.WQ, p.WK, p.WV, p.opts, with_method(JacobianKappaMethod::Gram));
    MESSAGE("N=D=d=" << c.N << ": kappa(J) = " << d.kappa << "; sigma_min rel. error: lobpcg "
                     << rel(l.sigma_min, d.sigma_min) << " (stated " << l.accuracy << ", "
                     << l.iterations << " iterations incl. Lanczos), gram "
                     << rel(g.sigma_min, d.sigma_min) << " (stated " << g.accuracy << ")");
    if (!SC_TEST_SANITIZED) CHECK(d.kappa > 1e3);  // where squaring loses digits (MATH.md §3)
    CHECK(rel(l.sigma_min, d.sigma_min) < 1e-9);   // the goal, whatever eps kappa is
    CHECK(rel(l.kappa, d.kappa) < 1e-9);
    check_agrees(l, d, 1e-9);
    CHECK(l.rank == c.N * c.d);
    CHECK(l.residual <= 1e-10);
    // The stated accuracy is honest, and lobpcg is the more accurate of the two here.
    CHECK(rel(l.sigma_min, d.sigma_min) <= 20 * (l.accuracy + sc_test::eps<double>() * d.kappa));
    if (!SC_TEST_SANITIZED) CHECK(rel(l.sigma_min, d.sigma_min) < rel(g.sigma_min, d.sigma_min));
  }
}

TEST_CASE("lobpcg at kappa(J) = 1.2e6: error near eps kappa, far below gram's eps kappa^2") {
  if (SC_TEST_SANITIZED) return;  // a 1024 x 3072 dense SVD at -O0: the Release suite has it
  const auto p = make_problem<double>(32, 32, 32, 32, 10);
  const auto d = dense_reference(p);
  const auto l = kappa_jacobian_lobpcg<double>(p.X, p.WQ, p.WK, p.WV, p.opts);
  const auto g =
      kappa_jacobian(p.X, p.WQ, p.WK, p.WV, p.opts, with_method(JacobianKappaMethod::Gram));
  const double eps_kappa = sc_test::eps<double>() * d.kappa;
  MESSAGE("kappa(J) = " << d.kappa << ": sigma_min rel. error lobpcg "
                        << rel(l.sigma_min, d.sigma_min) << " (stated " << l.accuracy << "), gram "
                        << rel(g.sigma_min, d.sigma_min) << " (stated " << g.accuracy
                        << "); eps kappa = " << eps_kappa);
  REQUIRE(d.kappa > 1e6);
  check_agrees(l, d, 1e-9);
  CHECK(rel(l.sigma_min, d.sigma_min) < 100 * eps_kappa);
  CHECK(rel(l.sigma_min, d.sigma_min) < 1e-3 * eps_kappa * d.kappa);
  CHECK(l.accuracy < 10 * eps_kappa);
}

TEST_CASE("lobpcg: causal mask, c = 1, N > D with rank(X) < N, tiny J, and float inputs") {
  const std::uint64_t seed = 91;
  INFO("seed=" << seed);
  auto causal = make_problem<double>(16, 24, 8, 8, seed, MaskKind::Causal);
  check_agrees(
      kappa_jacobian_lobpcg<double>(causal.X, causal.WQ, causal.WK, causal.WV, causal.opts),
      dense_reference(causal), 1e-9);
  auto unit = make_problem<double>(12, 16, 6, 5, seed + 1);
  unit.opts.scale = 1.0;
  check_agrees(kappa_jacobian_lobpcg<double>(unit.X, unit.WQ, unit.WK, unit.WV, unit.opts),
               dense_reference(unit), 1e-9);
  // N = 20 > D = 16: rank(X) = 16, J is 80 x 320, still of full row rank.
  const auto tallx = make_problem<double>(20, 16, 8, 4, seed + 2);
  check_agrees(kappa_jacobian_lobpcg<double>(tallx.X, tallx.WQ, tallx.WK, tallx.WV, tallx.opts),
               dense_reference(tallx), 1e-9);
  // Fewer rows than the basis [X, W, P] has columns (N d_v = 10 < 3 x 4); then fewer than the
  // block (N d_v = 3 < 4).
  const auto small = make_problem<double>(5, 6, 3, 2, seed + 4);
  check_agrees(kappa_jacobian_lobpcg<double>(small.X, small.WQ, small.WK, small.WV, small.opts),
               dense_reference(small), 1e-9);
  const auto tiny = make_problem<double>(3, 4, 2, 1, seed + 5);
  check_agrees(kappa_jacobian_lobpcg<double>(tiny.X, tiny.WQ, tiny.WK, tiny.WV, tiny.opts),
               dense_reference(tiny), 1e-9);
  // float data: computed in double, so the answer is κ of the float data to double accuracy
  // (c as given: the default 1/sqrt(d_k) would be rounded in float, the reference's in double).
  auto f = make_problem<float>(16, 16, 8, 8, seed + 3);
  f.opts.scale = 0.35f;
  check_agrees(kappa_jacobian_lobpcg<float>(f.X, f.WQ, f.WK, f.WV, f.opts), dense_reference(f),
               1e-9);
}

TEST_CASE("lobpcg's block size changes the iteration, not the answer") {
  const auto p = make_problem<double>(kMid, kMid, kMid, kMid, 17);
  const auto d = dense_reference(p);
  for (Index b : {1, 2, 4, 8}) {
    INFO("block=" << b);
    JacobianKappaOptions jo;
    jo.lobpcg.block = b;
    const auto l = kappa_jacobian_lobpcg<double>(p.X, p.WQ, p.WK, p.WV, p.opts, jo);
    check_agrees(l, d, 1e-9);
  }
}

TEST_CASE("lobpcg declines tall and singular J; kappa_jacobian then answers by qr") {
  SUBCASE("tall J: the gauge null space") {
    // N d_v = 48 rows > D (2 d_k + d_v) = 3 * 10 = 30 columns.
    const auto p = make_problem<double>(12, 3, 3, 4, 5);
    const auto l = kappa_jacobian_lobpcg<double>(p.X, p.WQ, p.WK, p.WV, p.opts);
    // A singular J is +inf, never NaN (MATH.md §4); σ_min = 0 exactly by the gauge directions.
    CHECK(l.info == Info::Singular);
    CHECK(l.kappa == std::numeric_limits<double>::infinity());
    CHECK(l.sigma_min == 0);
    CHECK(l.accuracy == 0);
    CHECK(std::isnan(l.kappa_plus));
    CHECK(l.rank == -1);
    CHECK(l.note.find("tall") != std::string::npos);
    const auto k =
        kappa_jacobian(p.X, p.WQ, p.WK, p.WV, p.opts, with_method(JacobianKappaMethod::Lobpcg));
    const auto q =
        kappa_jacobian(p.X, p.WQ, p.WK, p.WV, p.opts, with_method(JacobianKappaMethod::Qr));
    CHECK(k.method == "qr");
    CHECK(k.note.find("lobpcg did not answer") != std::string::npos);
    CHECK(k.kappa == std::numeric_limits<double>::infinity());
    CHECK(k.kappa_plus == q.kappa_plus);
    CHECK(k.rank == q.rank);
  }
  SUBCASE("wide J of rank below N d_v: X of rank 2") {
    // J~ has r (2 d_k + d_v) = 2 * 12 = 24 columns for N d_v = 32 rows: J J^T is singular.
    const auto p = make_problem<double>(8, 8, 4, 4, 6, MaskKind::None, 2);
    const auto l = kappa_jacobian_lobpcg<double>(p.X, p.WQ, p.WK, p.WV, p.opts);
    INFO("note: " << l.note);
    // J J^T is not positive definite: lobpcg cannot precondition. That is no singular verdict
    // (an ill-conditioned J looks the same), so it declines and kappa_jacobian takes qr.
    CHECK(l.info == Info::Inaccurate);
    CHECK(std::isnan(l.kappa));
    const auto k =
        kappa_jacobian(p.X, p.WQ, p.WK, p.WV, p.opts, with_method(JacobianKappaMethod::Lobpcg));
    const auto d = dense_reference(p);
    CHECK(k.method == "qr");
    CHECK(k.kappa == std::numeric_limits<double>::infinity());
    CHECK(k.rank == d.rank);
    CHECK(rel(k.kappa_plus, d.kappa_plus) < 1e-9);
  }
}

TEST_CASE("lobpcg: NotConverging when the iterations run out; kappa_jacobian falls back to qr") {
  const auto p = make_problem<double>(kMid, kMid, kMid, kMid, 17);
  JacobianKappaOptions jo;
  jo.lobpcg.max_iterations = 1;
  jo.lobpcg.tol = 1e-300;
  jo.lobpcg.block = 1;
  const auto l = kappa_jacobian_lobpcg<double>(p.X, p.WQ, p.WK, p.WV, p.opts, jo);
  INFO("note: " << l.note);
  CHECK(l.info == Info::NotConverging);
  CHECK(std::isnan(l.kappa));
  CHECK(l.note.find("did not converge") != std::string::npos);
  jo.method = JacobianKappaMethod::Lobpcg;
  const auto k = kappa_jacobian(p.X, p.WQ, p.WK, p.WV, p.opts, jo);
  CHECK(k.method == "qr");
  CHECK(k.info == Info::Success);
  CHECK(rel(k.kappa, dense_reference(p).kappa) < 1e-9);
}

TEST_CASE("kappa_jacobian takes qr when lobpcg's stated accuracy is poor") {
  const auto p = make_problem<double>(kMid, kMid, kMid, kMid, 17);
  JacobianKappaOptions jo;
  jo.lobpcg.tol = 1e-2;  // stops early: ρ / 2 dominates the stated accuracy
  jo.tol = 1e-8;
  const auto l = kappa_jacobian_lobpcg<double>(p.X, p.WQ, p.WK, p.WV, p.opts, jo);
  INFO("lobpcg note: " << l.note);
  REQUIRE(l.info == Info::Success);
  CHECK(l.accuracy > 1e-8);
  CHECK(l.accuracy >= l.residual / 2);
  jo.method = JacobianKappaMethod::Lobpcg;
  const auto k = kappa_jacobian(p.X, p.WQ, p.WK, p.WV, p.opts, jo);
  INFO("note: " << k.note);
  CHECK(k.method == "qr");
  CHECK(k.note.find("exceeds max(tol, 100 eps kappa)") != std::string::npos);
  CHECK(rel(k.kappa, dense_reference(p).kappa) < 1e-9);
}

// Which method the plan ranks first depends on the size (lobpcg at 24, qr at the sanitizers' 12).
TEST_CASE("auto: the method the plan ranks first runs, with the reason in the note") {
  const auto p = make_problem<double>(kMid, kMid, kMid, kMid, 17);
  const auto d = dense_reference(p);
  JacobianKappaOptions jo;
  jo.dense_max_entries = 0;  // so that auto does not take dense
  KappaShape s{kMid, kMid, kMid, kMid};
  const KappaPlan plan = plan_kappa_jacobian(s, jo);
  REQUIRE(!plan.order.empty());
  const auto a = kappa_jacobian(p.X, p.WQ, p.WK, p.WV, p.opts, jo);
  INFO("note: " << a.note);
  const std::string first = to_string(plan.order[0].method);
  CHECK(a.note.find("auto chose " + first) == 0);
  check_agrees(a, d, 1e-9, first);
}

TEST_CASE("lobpcg: bad options throw, NaN input gives InvalidInput") {
  const auto p = make_problem<double>(6, 8, 4, 3, 3);
  JacobianKappaOptions jo;
  jo.lobpcg.block = 0;
  CHECK_THROWS_AS(kappa_jacobian_lobpcg<double>(p.X, p.WQ, p.WK, p.WV, p.opts, jo),
                  std::invalid_argument);
  jo = {};
  jo.lobpcg.tol = 1.5;
  CHECK_THROWS_AS(kappa_jacobian_lobpcg<double>(p.X, p.WQ, p.WK, p.WV, p.opts, jo),
                  std::invalid_argument);
  jo = {};
  jo.lobpcg.max_iterations = 0;
  CHECK_THROWS_AS(kappa_jacobian_lobpcg<double>(p.X, p.WQ, p.WK, p.WV, p.opts, jo),
                  std::invalid_argument);
  auto bad = p;
  bad.WK(1, 2) = std::numeric_limits<double>::quiet_NaN();
  const auto r = kappa_jacobian_lobpcg<double>(bad.X, bad.WQ, bad.WK, bad.WV, bad.opts);
  CHECK(r.info == Info::InvalidInput);
  CHECK(r.method == "lobpcg");
  CHECK(parse_jacobian_kappa_method("lobpcg") == JacobianKappaMethod::Lobpcg);
  CHECK(std::string(to_string(JacobianKappaMethod::Lobpcg)) == "lobpcg");
}
