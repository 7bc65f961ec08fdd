// Numbers a referee can trust (MATH.md §12): every κ(J) method either answers within its stated
// accuracy or declines — on the two reported cases (tests/data/cases/), on a sweep of LayerNorm'd
// instances with c = 1/sqrt(d_k), W ~ N(0, 1/D) and N(0, 0.02^2), λ in {0, 1, 3, 10}, against a
// dense SVD of J — never κ < 1, never a success on a failed decomposition (an injected
// non-converging eigensolver), and every result validated before it leaves the library. The two
// cases (J of 2048 x 36864 and 1024 x 12288) and iterative-wrong-end by every method (measured:
// over 10 minutes of the 14 this file took) are slow under the sanitizers' -O0 build, which runs
// the other cases, iterative-wrong-end by iterative (the method it was reported against, in a
// build without LAPACK, as the sanitizer build is), the sweep (every method on 96 instances) and
// the validation tests; the Release suite runs all.
#include <spectral_cond/conditioning/methods/kappa_jacobian.hpp>
#include <spectral_cond/io/formats/npy.hpp>

#include "support/dense_reference.hpp"
#include "support/kappa_methods.hpp"
#include "support/test_helpers.hpp"

#include <filesystem>

using namespace spectral_cond;
using sc_test::rel;
namespace fs = std::filesystem;

namespace {

const fs::path kCases = fs::path(__FILE__).parent_path() / "data" / "cases";

struct Case {
  Mat<double> X, WQ, WK, WV;
  AttentionOptions<double> opts;
};

Case load_case(const std::string& name, double scale) {
  Case c;
  c.X = io::read_npy((kCases / name / "X.npy").string()).to_matrix();
  c.WQ = io::read_npy((kCases / name / "WQ.npy").string()).to_matrix();
  c.WK = io::read_npy((kCases / name / "WK.npy").string()).to_matrix();
  c.WV = io::read_npy((kCases / name / "WV.npy").string()).to_matrix();
  c.opts.scale = scale;
  return c;
}

/// σ of J from the compressed J~ (same singular values as J, MATH.md §3; J~ is tested against J
/// in test_compressed), by LAPACK's gesdd (or BDCSVD): the reference where J itself is too large
/// for a dense SVD in a unit test.
ConditionResult<double> compressed_reference(const Case& c) {
  const Mat<double> Jt = compressed_jacobian(c.X, c.WQ, c.WK, c.WV, c.opts);
  KappaOptions<double> ko;
  ko.svd = have_lapacke() ? SvdMethod::Lapack : SvdMethod::BDC;
  return kappa(Jt, ko);
}

/// A success is within its stated accuracy of the reference (σ_min, and κ to the same order);
/// anything else must be a declined answer.
void check_answer_or_decline(const ConditionResult<double>& r, const ConditionResult<double>& ref,
                             const char* what) {
  INFO(what << ": info " << to_string(r.info) << ", method " << r.method << ", note " << r.note);
  if (r.info != Info::Success) {
    CHECK(r.info != Info::InvalidInput);
    return;
  }
  REQUIRE(ref.info == Info::Success);
  CHECK(r.kappa >= 1);
  CHECK(r.sigma_max >= r.sigma_min);
  // σ_max: every method's own figure is far below its σ_min accuracy; 1e3 ε covers rounding.
  CHECK(rel(r.sigma_max, ref.sigma_max) <= std::max(r.accuracy, 1e3 * sc_test::eps<double>()));
  // The reference carries ε κ of its own.
  const double slack = 10 * ref.accuracy;
  CHECK(rel(r.sigma_min, ref.sigma_min) <= r.accuracy + slack);
  CHECK(rel(r.kappa, ref.kappa) <= 2 * (r.accuracy + slack) + 1e3 * sc_test::eps<double>());
}

const JacobianKappaMethod kAll[] = {JacobianKappaMethod::Auto,   JacobianKappaMethod::Dense,
                                    JacobianKappaMethod::Gram,   JacobianKappaMethod::Iterative,
                                    JacobianKappaMethod::Lobpcg, JacobianKappaMethod::Qr};

}  // namespace

TEST_CASE("gram-no-convergence: every method answers within its accuracy or declines" *
          doctest::skip(SC_TEST_SANITIZED != 0)) {
  // N = 32, D = 192, d_k = d_v = 64, LayerNorm'd tokens, W ~ N(0, 0.02^2), c = 0.125. Eigen's
  // SelfAdjointEigenSolver does not converge on this J J^T: its unsorted values were once read
  // as κ = 0.000352.
  const Case c = load_case("gram-no-convergence", 0.125);
  const ConditionResult<double> ref = compressed_reference(c);
  REQUIRE(ref.info == Info::Success);
  for (JacobianKappaMethod m : kAll) {
    if (m == JacobianKappaMethod::Dense) continue;  // J has 75 M entries: the reference covers it
    JacobianKappaOptions jo;
    jo.method = m;
    check_answer_or_decline(kappa_jacobian(c.X, c.WQ, c.WK, c.WV, c.opts, jo), ref, to_string(m));
  }
}

TEST_CASE("minilm-after-lambda: a singular J is +inf or a decline by every method, never a throw") {
  // tests/data/cases/minilm-after-lambda: float32 values of a trained head after W + 10 I; J has
  // rank 288 of 352. qr's Lanczos on (R^T R)^{-1} met non-finite products, and Spectra threw.
  Case c = load_case("minilm-after-lambda", 1 / std::sqrt(32.0));
  c.opts.scale.reset();
  auto vec = [](const std::string& n) {
    return Vec<double>(
        io::read_npy((kCases / "minilm-after-lambda" / n).string()).to_matrix().col(0));
  };
  for (bool biases : {false, true}) {
    AttentionOptions<double> o = c.opts;
    if (biases) {
      o.bias_q = vec("bq.npy");
      o.bias_k = vec("bk.npy");
      o.bias_v = vec("bv.npy");
    }
    for (JacobianKappaMethod m :
         {JacobianKappaMethod::Auto, JacobianKappaMethod::Gram, JacobianKappaMethod::Iterative,
          JacobianKappaMethod::Lobpcg, JacobianKappaMethod::Qr, JacobianKappaMethod::Matfree}) {
      INFO("method " << to_string(m) << ", biases " << biases);
      JacobianKappaOptions jo;
      jo.method = m;
      ConditionResult<double> r;
      REQUIRE_NOTHROW(r = kappa_jacobian(c.X, c.WQ, c.WK, c.WV, o, jo));
      INFO("info " << to_string(r.info) << ", kappa " << r.kappa << ", note " << r.note);
      CHECK(r.info != Info::Success);
      // +inf, or a decline that says why (gram: its rank certificate is uncertain here, and an
      // uncertain rank is never a singular verdict).
      if (r.info == Info::Singular)
        CHECK(std::isinf(r.kappa));
      else
        CHECK(!r.note.empty());
    }
  }
}

TEST_CASE("iterative-wrong-end: no method reports a singular value that is not the smallest") {
  // tests/data/cases/iterative-wrong-end: LayerNorm'd tokens, N = 32, D = 64, d = 16, per-head
  // λ = 3 added to W ~ N(0, 1/D), c = 1/4. Without LAPACK, iterative's Lanczos converged to
  // σ = 2.48913 (a residual-based accuracy of 1.5e-11) where the smallest is 2.48493.
  const Case c = load_case("iterative-wrong-end", 0.25);
  // σ_min(J) by the QR of the compressed Jacobian, recomputed (and checked to be this) in the
  // Release suite; the sanitizers' -O0 build takes it as stated (the QR takes minutes there) and
  // runs the method the case was reported against, in a build without LAPACK as it is.
  constexpr double kSigmaMin = 2.4849258;
  if (SC_TEST_SANITIZED != 0) {
    JacobianKappaOptions jo;
    jo.method = JacobianKappaMethod::Iterative;
    const ConditionResult<double> r = kappa_jacobian(c.X, c.WQ, c.WK, c.WV, c.opts, jo);
    INFO("info " << to_string(r.info) << ", note " << r.note);
    CHECK(r.info != Info::InvalidInput);
    if (r.info == Info::Success) {
      CHECK(rel(r.sigma_min, kSigmaMin) <= r.accuracy + 1e-6);
      CHECK(r.note.find("certified the smallest") != std::string::npos);
    }
    return;
  }
  const ConditionResult<double> ref = compressed_reference(c);
  REQUIRE(ref.info == Info::Success);
  CHECK(std::abs(ref.sigma_min - kSigmaMin) < 1e-6);
  for (JacobianKappaMethod m :
       {JacobianKappaMethod::Auto, JacobianKappaMethod::Gram, JacobianKappaMethod::Iterative,
        JacobianKappaMethod::Lobpcg, JacobianKappaMethod::Qr, JacobianKappaMethod::Matfree}) {
    JacobianKappaOptions jo;
    jo.method = m;
    const ConditionResult<double> r = kappa_jacobian(c.X, c.WQ, c.WK, c.WV, c.opts, jo);
    check_answer_or_decline(r, ref, to_string(m));
    // An iterative answer says what certifies it (order 512 here: a Cholesky of G - θ I).
    if (r.info == Info::Success && r.iterations > 0)
      CHECK(r.note.find("certified the smallest") != std::string::npos);
  }
}

TEST_CASE("denormal: X near 1e-310 gives the answer of the input as stored, or a decline") {
  // tests/data/cases/denormal: X (6 x 8) of order 1e-310 with W of order 1. Scaled into range
  // (X 2^k, W 2^-k, exact), J_V = P X (x) I is of order 1 and P is uniform (the logits underflow
  // to 0): P X has rank 1, so J (24 x 96) has rank 4 and is singular. qr once reported κ = 45.
  Case c;
  const fs::path d = kCases / "denormal";
  c.X = io::read_npy((d / "X_denormal.npy").string()).to_matrix();
  c.WQ = io::read_npy((d / "WQ.npy").string()).to_matrix();
  c.WK = io::read_npy((d / "WK.npy").string()).to_matrix();
  c.WV = io::read_npy((d / "WV.npy").string()).to_matrix();
  REQUIRE(c.X.cwiseAbs().maxCoeff() < 1e-300);
  for (JacobianKappaMethod m :
       {JacobianKappaMethod::Auto, JacobianKappaMethod::Dense, JacobianKappaMethod::Gram,
        JacobianKappaMethod::Iterative, JacobianKappaMethod::Lobpcg, JacobianKappaMethod::Qr,
        JacobianKappaMethod::Matfree}) {
    JacobianKappaOptions jo;
    jo.method = m;
    ConditionResult<double> r;
    REQUIRE_NOTHROW(r = kappa_jacobian(c.X, c.WQ, c.WK, c.WV, c.opts, jo));
    INFO("method " << to_string(m) << ": info " << to_string(r.info) << ", kappa " << r.kappa
                   << ", note " << r.note);
    CHECK(r.info != Info::Success);
    CHECK(r.info != Info::InvalidInput);
    if (r.info == Info::Singular) CHECK(std::isinf(r.kappa));
  }
}

TEST_CASE("a symmetric eigensolver that does not converge is never read as a result" *
          doctest::skip(SC_TEST_SANITIZED != 0)) {
  const Case c = load_case("gram-no-convergence", 0.125);
  const ConditionResult<double> ref = compressed_reference(c);
  for (int fail : {1, 2, 3}) {
    INFO("solvers failing: " << fail);
    detail::symmetric_eigen_failures = fail;
    JacobianKappaOptions jo;
    jo.method = JacobianKappaMethod::Gram;
    const ConditionResult<double> g = kappa_jacobian(c.X, c.WQ, c.WK, c.WV, c.opts, jo);
    jo.method = JacobianKappaMethod::Auto;
    const ConditionResult<double> a = kappa_jacobian(c.X, c.WQ, c.WK, c.WV, c.opts, jo);
    detail::symmetric_eigen_failures = 0;
    if (fail == 3) {  // no solver left: gram declines, auto answers by an accurate method
      CHECK(g.info == Info::NotConverging);
      CHECK(std::isnan(g.kappa));
      REQUIRE(a.info == Info::Success);
    }
    check_answer_or_decline(g, ref, "gram");
    check_answer_or_decline(a, ref, "auto");
  }
}

TEST_CASE("qr-blas-threads: qr answers within its accuracy (run with 1 and 2 BLAS threads)" *
          doctest::skip(SC_TEST_SANITIZED != 0)) {
  // Trained weights + 10 I_k and real hidden states; the 6 smallest singular values of J are
  // clustered within 3e-9, which once left the Lanczos on R unconverged with one BLAS thread.
  // ctest runs this test twice, with OPENBLAS_NUM_THREADS=1 and =2 (tests/CMakeLists.txt).
  const Case c = load_case("qr-blas-threads", 0.17677669529663687);
  const ConditionResult<double> ref = compressed_reference(c);
  REQUIRE(ref.info == Info::Success);
  JacobianKappaOptions jo;
  jo.method = JacobianKappaMethod::Qr;
  const ConditionResult<double> q = kappa_jacobian(c.X, c.WQ, c.WK, c.WV, c.opts, jo);
  CHECK(q.info == Info::Success);
  check_answer_or_decline(q, ref, "qr");
  for (JacobianKappaMethod m : {JacobianKappaMethod::Auto, JacobianKappaMethod::Lobpcg,
                                JacobianKappaMethod::Gram, JacobianKappaMethod::Iterative}) {
    jo.method = m;
    check_answer_or_decline(kappa_jacobian(c.X, c.WQ, c.WK, c.WV, c.opts, jo), ref, to_string(m));
  }
}

TEST_CASE("sweep: every success of every method within its stated accuracy, no kappa < 1") {
  // LayerNorm'd tokens, c = 1/sqrt(d_k), W ~ N(0, 1/D) and N(0, 0.02^2), λ ∈ {0, 1, 3, 10}, J
  // small enough for a dense reference.
  struct Shape {
    Index N, D, d;
  };
  const Shape shapes[] = {{6, 12, 4}, {8, 8, 4}, {12, 6, 3}};
  Index successes = 0, declined = 0;
  std::uint64_t seed = 100;
  for (const Shape& s : shapes)
    for (double wscale : {0.0, 0.02})
      for (double lambda : {0.0, 1.0, 3.0, 10.0})
        for (MaskKind mask : {MaskKind::None, MaskKind::Causal}) {
          std::mt19937_64 rng(++seed);
          sc_test::Problem<double> p;
          p.X = sc_test::randn<double>(s.N, s.D, rng);
          for (Index i = 0; i < s.N; ++i) {  // LayerNorm without affine parameters
            p.X.row(i).array() -= p.X.row(i).mean();
            p.X.row(i) /= std::sqrt(p.X.row(i).squaredNorm() / static_cast<double>(s.D));
          }
          const double ws = wscale > 0 ? wscale : 1 / std::sqrt(static_cast<double>(s.D));
          const Mat<double> I = Mat<double>::Identity(s.D, s.d);
          p.WQ = sc_test::randn<double>(s.D, s.d, rng, ws) + lambda * I;
          p.WK = sc_test::randn<double>(s.D, s.d, rng, ws) + lambda * I;
          p.WV = sc_test::randn<double>(s.D, s.d, rng, ws) + lambda * I;
          p.opts.mask = mask;
          const ConditionResult<double> ref =
              sc_test::dense_reference(p, JacobianBlock::All, SvdMethod::Jacobi);
          if (ref.info != Info::Success) continue;  // singular J: nothing to compare with
          for (JacobianKappaMethod m : kAll) {
            JacobianKappaOptions jo;
            jo.method = m;
            jo.dense_max_entries = 0;  // auto must choose among the other methods
            const ConditionResult<double> r = kappa_jacobian(p.X, p.WQ, p.WK, p.WV, p.opts, jo);
            INFO("seed " << seed << " N " << s.N << " D " << s.D << " d " << s.d << " w " << ws
                         << " lambda " << lambda << " mask " << to_string(mask));
            check_answer_or_decline(r, ref, to_string(m));
            (r.info == Info::Success ? successes : declined)++;
          }
        }
  MESSAGE("sweep: " << successes << " answers, " << declined << " declined");
  CHECK(successes > 0);
}

TEST_CASE("validation declines a result that contradicts the power-method bound on sigma_max") {
  sc_test::Problem<double> p = sc_test::make_problem<double>(6, 8, 4, 4, 5);
  const detail::KJInputs in = detail::kj_inputs<double>(p.X, p.WQ, p.WK, p.WV, p.opts);
  JacobianKappaOptions jo;
  jo.method = JacobianKappaMethod::Dense;
  ConditionResult<double> good = kappa_jacobian(p.X, p.WQ, p.WK, p.WV, p.opts, jo);
  REQUIRE(good.info == Info::Success);
  CHECK(detail::validated(in, good, jo).info == Info::Success);
  ConditionResult<double> swapped = good;  // what an unsorted eigensolver output looked like
  std::swap(swapped.sigma_max, swapped.sigma_min);
  swapped.kappa = swapped.sigma_max / swapped.sigma_min;
  const ConditionResult<double> v = detail::validated(in, swapped, jo);
  CHECK(v.info == Info::Inaccurate);
  CHECK(std::isnan(v.kappa));
  ConditionResult<double> low = good;  // a σ_max well below the truth
  low.sigma_max *= 0.5;
  low.kappa = low.sigma_max / low.sigma_min;
  CHECK(detail::validated(in, low, jo).info == Info::Inaccurate);
}

TEST_CASE("condition_from_singular_values refuses values that are not singular values") {
  Vec<double> up(2), neg(2);
  up << 1, 2;
  neg << 1, -1;
  CHECK_THROWS_AS(condition_from_singular_values<double>(up, 2, 2), std::invalid_argument);
  CHECK_THROWS_AS(condition_from_singular_values<double>(neg, 2, 2), std::invalid_argument);
}
