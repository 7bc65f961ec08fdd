// The qr method for kappa(J) (MATH.md §3 "Squaring is not affordable", §4): against a dense SVD
// of the assembled J on PyTorch-style instances, the tall gauge-singular case, masks, float
// inputs, the input Jacobian, and the streaming parameters (block, panel, threads).
#include <spectral_cond/conditioning/methods/qr.hpp>

#include <chrono>

#include "support/dense_reference.hpp"
#include "support/kappa_methods.hpp"
#include "support/test_helpers.hpp"

using namespace spectral_cond;
using sc_test::dense_reference;
using sc_test::make_problem;
using sc_test::Problem;
using sc_test::randn;
using sc_test::rel;

namespace {

/// qr and the dense SVD agree to `tol`, or to 20 ε κ when that is larger: both methods are
/// backward stable, so each σ_min carries a relative error of about ε κ (MATH.md §3); for a
/// numerically singular J the smallest σ above the rank tolerance carries ε κ_plus.
void check_agrees(const ConditionResult<double>& q, const ConditionResult<double>& d, double tol) {
  tol = std::max(tol,
                 20 * sc_test::eps<double>() * (d.info == Info::Success ? d.kappa : d.kappa_plus));
  INFO("qr: sigma_max " << q.sigma_max << " sigma_min " << q.sigma_min << " kappa " << q.kappa
                        << " note: " << q.note);
  INFO("svd: sigma_max " << d.sigma_max << " sigma_min " << d.sigma_min << " kappa " << d.kappa);
  CHECK(q.method == "qr");
  CHECK(q.info == d.info);
  CHECK(q.rank == d.rank);
  CHECK(rel(q.sigma_max, d.sigma_max) < 1e-12);
  CHECK(rel(q.sigma_min_plus, d.sigma_min_plus) < tol);
  CHECK(rel(q.kappa_plus, d.kappa_plus) < tol);
  if (d.info == Info::Success) {
    CHECK(rel(q.sigma_min, d.sigma_min) < tol);
    CHECK(rel(q.kappa, d.kappa) < tol);
    CHECK(q.accuracy >= 1e-16 * q.kappa);
    CHECK(q.accuracy < 1e-15 * q.kappa + 1e-12);
  } else {
    CHECK(q.kappa == std::numeric_limits<double>::infinity());
  }
}

}  // namespace

TEST_CASE("qr agrees with the dense SVD of J on PyTorch-style instances (wide J)") {
  struct Case {
    Index N, D, d;
    std::uint64_t seed;
  };
  // (64, 64, 64, 64) is in bench/bench_qr_kappa (its dense SVD takes minutes); 40 keeps the
  // suite fast. The sanitizer build (-O0) runs a small case for the memory checks only.
  std::vector<Case> cases{Case{32, 32, 32, 11}, Case{40, 40, 40, 12}};
  if (SC_TEST_SANITIZED) cases = {Case{12, 12, 12, 11}};
  for (const Case c : cases) {
    INFO("seed=" << c.seed << " N=D=d_k=d_v=" << c.N);
    const auto p = make_problem<double>(c.N, c.D, c.d, c.d, c.seed);
    const auto t0 = std::chrono::steady_clock::now();
    const auto q = kappa_jacobian_qr<double>(p.X, p.WQ, p.WK, p.WV, p.opts);
    const auto t1 = std::chrono::steady_clock::now();
    const auto d = dense_reference(p, JacobianBlock::All);
    const auto t2 = std::chrono::steady_clock::now();
    MESSAGE("N=D=d=" << c.N << ": kappa(J) = " << q.kappa << " (dense " << d.kappa << "), qr "
                     << std::chrono::duration<double>(t1 - t0).count() << " s, dense SVD "
                     << std::chrono::duration<double>(t2 - t1).count() << " s");
    if (!SC_TEST_SANITIZED) CHECK(q.kappa > 1e3);  // where squaring loses digits (MATH.md §3)
    CHECK(q.rank == c.N * c.d);
    CHECK(q.iterations > 0);
    CHECK(q.residual < 1e-10);
    MESSAGE("sigma_min rel. diff " << rel(q.sigma_min, d.sigma_min) << ", kappa rel. diff "
                                   << rel(q.kappa, d.kappa));
    CHECK(rel(q.sigma_min, d.sigma_min) < 1e-9);  // the goal, whatever eps kappa is
    CHECK(rel(q.kappa, d.kappa) < 1e-9);
    check_agrees(q, d, 1e-9);
  }
}

TEST_CASE("qr on the tall, gauge-singular J: kappa = +inf, rank and kappa_plus as the SVD's") {
  struct Case {
    Index N, D, dk, dv, xrank;
    MaskKind mask;
    const char* what;
  };
  const Case cases[] = {
      {24, 4, 2, 2, 0, MaskKind::None, "J tall: N d_v = 48 > 24 columns"},
      {30, 5, 2, 3, 0, MaskKind::Causal, "J tall, causal"},
      {12, 10, 2, 2, 2, MaskKind::None, "J wide but J~ tall: rank-2 X"},
  };
  std::uint64_t seed = 300;
  for (const Case& c : cases) {
    INFO("seed=" << seed << " " << c.what);
    const auto p = make_problem<double>(c.N, c.D, c.dk, c.dv, seed++, c.mask, c.xrank);
    const auto q = kappa_jacobian_qr<double>(p.X, p.WQ, p.WK, p.WV, p.opts);
    const auto d = dense_reference(p, JacobianBlock::All, SvdMethod::Jacobi);
    CHECK(q.kappa == std::numeric_limits<double>::infinity());
    CHECK(q.info == Info::Singular);
    CHECK(q.rank > 0);
    CHECK(q.rank <= std::min(c.N * c.dv, c.D * (2 * c.dk + c.dv)) - c.dk * c.dk);  // gauge
    CHECK(std::isfinite(q.kappa_plus));
    check_agrees(q, d, 1e-9);
  }
}

TEST_CASE("qr: causal mask, rank-deficient X and c = 1 on wide J; dense and Lanczos paths") {
  const std::uint64_t seed = 77;
  INFO("seed=" << seed);
  auto p = make_problem<double>(16, 24, 8, 8, seed, MaskKind::Causal);
  p.opts.scale = 1.0;
  const auto d = dense_reference(p, JacobianBlock::All);
  const auto lanczos = kappa_jacobian_qr<double>(p.X, p.WQ, p.WK, p.WV, p.opts);
  check_agrees(lanczos, d, 1e-9);
  CHECK(lanczos.iterations > 0);
  auto q = make_problem<double>(20, 16, 8, 4, seed + 1, MaskKind::None, 12);  // r = 12 < N
  const auto dq = dense_reference(q, JacobianBlock::All);
  check_agrees(kappa_jacobian_qr<double>(q.X, q.WQ, q.WK, q.WV, q.opts), dq, 1e-9);
}

TEST_CASE("block size, panel width and thread count change rounding only") {
  const std::uint64_t seed = 5;
  INFO("seed=" << seed);
  const auto p = make_problem<double>(12, 20, 6, 6, seed);
  const auto ref = kappa_jacobian_qr<double>(p.X, p.WQ, p.WK, p.WV, p.opts);
  struct Setting {
    Index block, panel;
    unsigned threads;
  };
  for (const Setting s :
       {Setting{1, 1, 1}, Setting{7, 5, 3}, Setting{1000, 64, 2}, Setting{33, 200, 4}}) {
    INFO("block=" << s.block << " panel=" << s.panel << " threads=" << s.threads);
    QrKappaOptions qo;
    qo.block_cols = s.block;
    qo.panel = s.panel;
    qo.threads = s.threads;
    std::vector<double> fractions;
    qo.progress = [&](double f) { fractions.push_back(f); };
    const auto r = kappa_jacobian_qr<double>(p.X, p.WQ, p.WK, p.WV, p.opts, qo);
    CHECK(rel(r.sigma_min, ref.sigma_min) < 1e-11);
    CHECK(rel(r.kappa, ref.kappa) < 1e-11);
    REQUIRE(!fractions.empty());
    CHECK(std::is_sorted(fractions.begin(), fractions.end()));
    CHECK(fractions.back() == 1.0);
  }
}

TEST_CASE("qr with float inputs: computed in double, equals the double result on the same data") {
  const std::uint64_t seed = 41;
  INFO("seed=" << seed);
  const auto p = make_problem<float>(16, 16, 8, 8, seed);
  const auto q = kappa_jacobian_qr<float>(p.X, p.WQ, p.WK, p.WV, p.opts);
  const auto d = dense_reference(p, JacobianBlock::All);
  INFO("qr: " << to_string(q.info) << ", accuracy " << q.accuracy << ", note " << q.note);
  CHECK(q.method == "qr");
  CHECK(q.info == Info::Success);
  CHECK(rel(static_cast<double>(q.kappa), d.kappa) < 1e-6);
  CHECK(rel(static_cast<double>(q.sigma_min), d.sigma_min) < 1e-6);
}

TEST_CASE("qr for the input Jacobian J_X agrees with the dense SVD of J_X") {
  std::uint64_t seed = 900;
  for (const Index D : {Index(24), Index(6)}) {  // s = 2 d_k + d_v = 12 < D, and s = D
    INFO("seed=" << seed << " D=" << D);
    const auto p = make_problem<double>(10, D, 4, 4, seed++);
    const auto q = kappa_input_jacobian_qr<double>(p.X, p.WQ, p.WK, p.WV, p.opts);
    check_agrees(q, dense_reference(p, JacobianBlock::X), 1e-9);
  }
}

TEST_CASE("qr: zero X, NaN input and misuse") {
  auto p = make_problem<double>(4, 5, 2, 2, 1);
  const Mat<double> zero = Mat<double>::Zero(4, 5);
  const auto z = kappa_jacobian_qr<double>(zero, p.WQ, p.WK, p.WV, p.opts);
  CHECK(z.rank == 0);
  CHECK(z.info == Info::Singular);
  CHECK(z.kappa == std::numeric_limits<double>::infinity());
  Mat<double> bad = p.X;
  bad(1, 1) = std::numeric_limits<double>::infinity();
  const auto b = kappa_jacobian_qr<double>(bad, p.WQ, p.WK, p.WV, p.opts);
  CHECK(b.info == Info::InvalidInput);
  CHECK(std::isnan(b.kappa));
  const Mat<double> wrong = Mat<double>::Zero(3, 2);
  CHECK_THROWS_WITH_AS(kappa_jacobian_qr<double>(p.X, wrong, p.WK, p.WV, p.opts),
                       "kappa_jacobian_qr: W_Q must be D x d_k = 5 x 2 (got 3 x 2)",
                       std::invalid_argument);
  QrKappaOptions qo;
  qo.panel = 0;
  CHECK_THROWS_WITH_AS(kappa_jacobian_qr<double>(p.X, p.WQ, p.WK, p.WV, p.opts, qo),
                       "kappa_jacobian_qr: panel must be >= 1 (got 0)", std::invalid_argument);
  qo = {};
  qo.lanczos.tol = 0;
  CHECK_THROWS_AS(kappa_input_jacobian_qr<double>(p.X, p.WQ, p.WK, p.WV, p.opts, qo),
                  std::invalid_argument);
}
