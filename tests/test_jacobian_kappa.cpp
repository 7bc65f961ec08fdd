// κ(J) by dense, gram, iterative, qr, lobpcg and auto (MATH.md §3–4): the methods agree within
// their stated accuracy, and each one's stated accuracy is honest (compared with dense SVD of J).
#include <spectral_cond/conditioning/methods/kappa_jacobian.hpp>

#include "support/kappa_methods.hpp"
#include "support/test_helpers.hpp"

using namespace spectral_cond;
using sc_test::randn;
using sc_test::rel;

namespace {
struct Inst {
  Mat<double> X, WQ, WK, WV;
  AttentionOptions<double> opts;
};
Inst make(Index N, Index D, Index dk, Index dv, std::uint64_t seed, double wscale,
          MaskKind mask = MaskKind::None) {
  std::mt19937_64 rng(seed);
  Inst in;
  in.X = randn<double>(N, D, rng);
  in.WQ = randn<double>(D, dk, rng, wscale);
  in.WK = randn<double>(D, dk, rng, wscale);
  in.WV = randn<double>(D, dv, rng, wscale);
  in.opts.mask = mask;
  return in;
}
}  // namespace

TEST_CASE("all methods agree with dense within their stated accuracy (wide J)") {
  for (std::uint64_t seed : {1u, 2u, 3u}) {
    INFO("seed=" << seed);
    // Well-conditioned instance: larger weights, c = 1 make kappa moderate.
    Inst in = make(6, 8, 4, 3, seed, 0.5, seed == 2 ? MaskKind::Causal : MaskKind::None);
    JacobianKappaOptions jo;
    jo.method = JacobianKappaMethod::Dense;
    const auto dense = kappa_jacobian(in.X, in.WQ, in.WK, in.WV, in.opts, jo);
    REQUIRE(dense.info == Info::Success);
    CHECK(dense.method.rfind("dense", 0) == 0);
    for (auto m :
         {JacobianKappaMethod::Gram, JacobianKappaMethod::Iterative, JacobianKappaMethod::Qr}) {
      jo.method = m;
      const auto r = kappa_jacobian(in.X, in.WQ, in.WK, in.WV, in.opts, jo);
      INFO("method " << to_string(m) << ": " << r.method << " / " << r.note);
      CHECK(r.info == Info::Success);
      CHECK(rel(r.sigma_max, dense.sigma_max) < 1e-10);
      // Stated accuracy is honest: the true error is within a small multiple of it.
      const double err = rel(r.sigma_min, dense.sigma_min);
      CHECK(err <= 10 * r.accuracy + 1e-12);
      CHECK(rel(r.kappa, dense.kappa) <= 10 * r.accuracy + 1e-10);
    }
  }
}

TEST_CASE("tall J is gauge-singular: kappa = +inf for every method, kappa_plus finite") {
  // N d_v = 20 * 6 = 120 > 2 D d_k + D d_v = 2*3*2 + 3*6 = 30: tall.
  Inst in = make(20, 3, 2, 6, 9, 0.7);
  for (auto m : {JacobianKappaMethod::Dense, JacobianKappaMethod::Gram, JacobianKappaMethod::Qr}) {
    JacobianKappaOptions jo;
    jo.method = m;
    const auto r = kappa_jacobian(in.X, in.WQ, in.WK, in.WV, in.opts, jo);
    INFO(to_string(m) << ": " << r.note);
    CHECK(std::isinf(r.kappa));
    CHECK(r.info == Info::Singular);
    if (m != JacobianKappaMethod::Gram) {
      CHECK(std::isfinite(r.kappa_plus));
      // The gauge null space has dimension d_k^2 = 4: rank <= 30 - 4.
      CHECK(r.rank <= 26);
    }
  }
}

TEST_CASE("gram on a PyTorch-style instance: the stated eps*kappa^2 covers its true error") {
  // X ~ N(0,1), W ~ N(0, 1/D), c = 1/sqrt(d_k): badly conditioned already at (16,16,16,16).
  Inst in = make(16, 16, 16, 16, 2024, 0.25);
  JacobianKappaOptions jo;
  jo.method = JacobianKappaMethod::Dense;
  const auto dense = kappa_jacobian(in.X, in.WQ, in.WK, in.WV, in.opts, jo);
  jo.method = JacobianKappaMethod::Gram;
  const auto gram = kappa_jacobian(in.X, in.WQ, in.WK, in.WV, in.opts, jo);
  jo.method = JacobianKappaMethod::Qr;
  const auto qr = kappa_jacobian(in.X, in.WQ, in.WK, in.WV, in.opts, jo);
  MESSAGE("kappa(J) dense " << dense.kappa << ", gram " << gram.kappa << " (stated "
                            << gram.accuracy << ", true " << rel(gram.sigma_min, dense.sigma_min)
                            << "), qr " << qr.kappa << " (true "
                            << rel(qr.sigma_min, dense.sigma_min) << ")");
  CHECK(rel(gram.sigma_min, dense.sigma_min) <= 10 * gram.accuracy);
  CHECK(rel(qr.sigma_min, dense.sigma_min) < 1e-9);
  CHECK(gram.accuracy > qr.accuracy);
}

TEST_CASE("auto picks dense when small; otherwise an accurate method by estimated time") {
  Inst in = make(5, 6, 3, 2, 4, 0.5);
  JacobianKappaOptions jo;
  auto r = kappa_jacobian(in.X, in.WQ, in.WK, in.WV, in.opts, jo);
  CHECK(r.note.find("auto chose dense") != std::string::npos);
  jo.dense_max_entries = 0;
  r = kappa_jacobian(in.X, in.WQ, in.WK, in.WV, in.opts, jo);
  INFO("note: " << r.note);
  CHECK(r.note.find("by estimated time") != std::string::npos);
  CHECK(r.method != "gram");  // gram's eps kappa^2 is an estimate, never auto's answer
  const auto d = kappa_jacobian_dense(in.X, in.WQ, in.WK, in.WV, in.opts);
  CHECK(rel(r.kappa, d.kappa) <= 10 * (r.accuracy + d.accuracy));
  // A tall J (48 x 30): matfree and lobpcg do not apply; qr shows kappa = +inf and the rank.
  Inst tall = make(12, 3, 3, 4, 4, 0.5);
  r = kappa_jacobian(tall.X, tall.WQ, tall.WK, tall.WV, tall.opts, jo);
  CHECK(r.note.find("J is tall") != std::string::npos);
  CHECK(r.method.find("qr") != std::string::npos);
  CHECK(r.kappa == std::numeric_limits<double>::infinity());
}

TEST_CASE("plan: estimated costs rank matfree, lobpcg and qr; the budget leaves methods out") {
  JacobianKappaOptions jo;
  jo.memory_budget = std::uint64_t(6) << 30;
  // A ViT-B head (N = 197, D = 768, d = 64): matfree's ~500 small iterations beat forming and
  // factoring a 12608^2 Gram matrix (measured 3.8 s against 29 s, bench/python/bench_auto.py).
  KappaShape vit{197, 768, 64, 64};
  KappaPlan p = plan_kappa_jacobian(vit, jo);
  REQUIRE(p.order.size() == 3);
  CHECK(p.order[0].method == JacobianKappaMethod::Matfree);
  CHECK(p.order[1].method == JacobianKappaMethod::Lobpcg);
  CHECK(p.order[2].method == JacobianKappaMethod::Qr);
  CHECK(p.why.find("auto chose matfree by estimated time") == 0);
  // Small J: dense, whatever the rest.
  p = plan_kappa_jacobian(KappaShape{8, 16, 4, 4}, jo);
  REQUIRE(p.order.size() == 1);
  CHECK(p.order[0].method == JacobianKappaMethod::Dense);
  // Lobpcg's two (N d_v)^2 matrices over budget: left out, and said.
  const double gram = 8.0 * 2 * 12608.0 * 12608.0;
  jo.memory_budget = static_cast<std::uint64_t>(gram / 2);
  p = plan_kappa_jacobian(vit, jo);
  CHECK(p.order.size() == 1);
  CHECK(p.order[0].method == JacobianKappaMethod::Matfree);
  CHECK(p.left_out.size() == 2);
  CHECK(p.why.find("lobpcg left out") != std::string::npos);
  // The memory estimates grow as the shapes say: lobpcg with (N d_v)^2, matfree with d_v N^2.
  const MethodCost l1 = estimate_cost(JacobianKappaMethod::Lobpcg, {100, 768, 64, 64}, jo);
  const MethodCost l2 = estimate_cost(JacobianKappaMethod::Lobpcg, {200, 768, 64, 64}, jo);
  CHECK(l2.bytes == doctest::Approx(4 * l1.bytes));
  // Nothing fits: an empty plan, and kappa_jacobian declines before allocating, with sizes.
  jo.memory_budget = 1000;
  p = plan_kappa_jacobian(vit, jo);
  CHECK(p.order.empty());
  std::mt19937_64 rng(3);
  const Mat<double> X = randn<double>(40, 12, rng), W = randn<double>(12, 8, rng);
  JacobianKappaOptions tiny;
  tiny.dense_max_entries = 0;
  tiny.memory_budget = 1000;
  const auto r = kappa_jacobian(X, W, W, W, AttentionOptions<double>{}, tiny);
  CHECK(r.info == Info::TooLarge);
  CHECK(std::isnan(r.kappa));
  CHECK(r.note.find("N = 40, D = 12, d_k = 8, d_v = 8") != std::string::npos);
}

TEST_CASE("NaN input is InvalidInput, float inputs work, bad options throw") {
  Inst in = make(4, 5, 2, 2, 8, 0.5);
  Mat<double> bad = in.X;
  bad(1, 1) = std::numeric_limits<double>::quiet_NaN();
  CHECK(kappa_jacobian(bad, in.WQ, in.WK, in.WV, in.opts).info == Info::InvalidInput);
  const Mat<float> Xf = in.X.cast<float>(), Qf = in.WQ.cast<float>(), Kf = in.WK.cast<float>(),
                   Vf = in.WV.cast<float>();
  const auto rf = kappa_jacobian(Xf, Qf, Kf, Vf);
  const auto rd = kappa_jacobian(Xf.cast<double>().eval(), Qf.cast<double>().eval(),
                                 Kf.cast<double>().eval(), Vf.cast<double>().eval());
  CHECK(rf.kappa == doctest::Approx(rd.kappa).epsilon(1e-6));  // c = 1/sqrt(d_k) rounded in float
  JacobianKappaOptions jo;
  jo.tol = -1;
  CHECK_THROWS_AS(kappa_jacobian(in.X, in.WQ, in.WK, in.WV, in.opts, jo), std::invalid_argument);
  CHECK_THROWS_AS(parse_jacobian_kappa_method("svd"), std::invalid_argument);
  CHECK(parse_jacobian_kappa_method("qr") == JacobianKappaMethod::Qr);
}

TEST_CASE("finite inputs that overflow: gram says InvalidInput, never a zero matrix") {
  Inst in = make(4, 5, 2, 2, 8, 0.5);
  const Mat<double> X = in.X * 1e200;  // logits ~1e400: P, and so J, are NaN
  for (const auto m : {JacobianKappaMethod::Gram, JacobianKappaMethod::Dense}) {
    JacobianKappaOptions jo;
    jo.method = m;
    const auto r = kappa_jacobian(X, in.WQ, in.WK, in.WV, in.opts, jo);
    CHECK(r.info != Info::Success);
    CHECK(r.note.find("zero matrix") == std::string::npos);
  }
}

TEST_CASE("X = 0: J = 0 for every method, kappa = +inf, no exception") {
  Inst in = make(4, 5, 2, 2, 8, 0.5);
  const Mat<double> X = Mat<double>::Zero(in.X.rows(), in.X.cols());
  for (const auto m :
       {JacobianKappaMethod::Dense, JacobianKappaMethod::Gram, JacobianKappaMethod::Iterative,
        JacobianKappaMethod::Qr, JacobianKappaMethod::Lobpcg, JacobianKappaMethod::Auto}) {
    JacobianKappaOptions jo;
    jo.method = m;
    const auto r = kappa_jacobian(X, in.WQ, in.WK, in.WV, in.opts, jo);
    CHECK(r.rank == 0);
    CHECK(r.kappa == std::numeric_limits<double>::infinity());
    CHECK(r.info == Info::Singular);
  }
}

TEST_CASE("kappa(J) is the same for (X t, W / t) at extreme t, for every method") {
  Inst in = make(4, 5, 2, 2, 8, 0.5);
  for (const auto m :
       {JacobianKappaMethod::Dense, JacobianKappaMethod::Gram, JacobianKappaMethod::Iterative,
        JacobianKappaMethod::Qr, JacobianKappaMethod::Lobpcg}) {
    JacobianKappaOptions jo;
    jo.method = m;
    const auto ref = kappa_jacobian(in.X, in.WQ, in.WK, in.WV, in.opts, jo);
    for (const double t : {std::ldexp(1.0, -700), std::ldexp(1.0, 700)}) {
      const Mat<double> Xt = in.X * t, Qt = in.WQ / t, Kt = in.WK / t, Vt = in.WV / t;
      const auto r = kappa_jacobian(Xt, Qt, Kt, Vt, in.opts, jo);
      CHECK(r.kappa == doctest::Approx(ref.kappa).epsilon(1e-12));
      CHECK(r.sigma_max == doctest::Approx(ref.sigma_max * t).epsilon(1e-12));
    }
  }
}

TEST_CASE("gram by Lanczos and Cholesky agrees with gram by a full eigensolve") {
  Inst in = make(7, 9, 4, 3, 12, 0.5);
  JacobianKappaOptions jo;
  jo.method = JacobianKappaMethod::Gram;
  const auto full = kappa_jacobian(in.X, in.WQ, in.WK, in.WV, in.opts, jo);
  jo.gram_eig_max = 1;  // force the large-G route
  const auto lan = kappa_jacobian(in.X, in.WQ, in.WK, in.WV, in.opts, jo);
  INFO(lan.method << " / " << lan.note);
  CHECK(lan.method.find("Cholesky") != std::string::npos);
  CHECK(lan.info == Info::Success);
  CHECK(rel(lan.sigma_max, full.sigma_max) < 1e-10);
  CHECK(rel(lan.sigma_min, full.sigma_min) <= 10 * full.accuracy + 1e-10);
  CHECK(lan.iterations > 0);
  // Tall J: J^T J is singular (gauge directions), so its Cholesky fails: Singular, kappa = +inf.
  Inst tall = make(20, 3, 2, 6, 9, 0.7);
  const auto s = kappa_jacobian(tall.X, tall.WQ, tall.WK, tall.WV, tall.opts, jo);
  CHECK(std::isinf(s.kappa));
  CHECK(s.info == Info::Singular);
  // A singular answer's sigma_min is rounding noise: no finite accuracy is claimed for it
  // (ConditionResult::accuracy), by either gram route.
  CHECK(std::isinf(s.accuracy));
  jo.gram_eig_max = JacobianKappaOptions{}.gram_eig_max;
  const auto se = kappa_jacobian(tall.X, tall.WQ, tall.WK, tall.WV, tall.opts, jo);
  INFO(se.method << " / " << se.note);
  CHECK(se.info == Info::Singular);
  CHECK(std::isinf(se.accuracy));
  CHECK(se.note.find("only known to lie below the rank tolerance") != std::string::npos);
}
