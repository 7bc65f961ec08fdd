// The matfree method for kappa(J) (conditioning/methods/matfree.hpp; MATH.md §12): against a
// dense SVD of the assembled J over the shape classes (N < D, N = D, N > D), no mask and causal,
// Gaussian and LayerNorm'd tokens, lambda in {0, 10}; where it answers it agrees within its
// stated accuracy, where it cannot it declines (never a silent wrong answer); against qr and
// lobpcg at N = 256; auto's choice under a memory budget; tall J; float inputs.
#include <spectral_cond/conditioning/corrections.hpp>
#include <spectral_cond/conditioning/methods/kappa_jacobian.hpp>

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

/// Rows of X with mean 0 and variance 1, as a LayerNorm without affine parameters makes them.
template <typename Scalar>
void layer_norm_rows(Problem<Scalar>& p) {
  for (Index i = 0; i < p.X.rows(); ++i) {
    p.X.row(i).array() -= p.X.row(i).mean();
    p.X.row(i) /= std::sqrt(p.X.row(i).squaredNorm() / static_cast<Scalar>(p.X.cols()));
  }
}

/// The outcome of one comparison: answered and agreeing, declined as singular, or declined for
/// another reason. A wrong answer fails.
struct Tally {
  int answered = 0, singular = 0, declined = 0;
};

/// If matfree answered, it agrees with the reference `d` within its stated accuracy plus the
/// reference's own ε κ, times 20 for the polynomial in the sizes; if it found J singular, kappa
/// is +inf; if it declined otherwise, kappa is NaN; the note says why.
void check_honest(const ConditionResult<double>& m, const ConditionResult<double>& d, Tally& t) {
  INFO("matfree: info " << to_string(m.info) << " sigma_min " << m.sigma_min << " kappa " << m.kappa
                        << " accuracy " << m.accuracy << " iterations " << m.iterations
                        << " note: " << m.note);
  INFO("reference: info " << to_string(d.info) << " sigma_min " << d.sigma_min << " kappa "
                          << d.kappa);
  if (m.info != Info::Success) {
    ++(m.info == Info::Singular ? t.singular : t.declined);
    if (m.info == Info::Singular)
      CHECK(m.kappa == std::numeric_limits<double>::infinity());
    else
      CHECK(std::isnan(m.kappa));
    CHECK(!m.note.empty());
    return;
  }
  ++t.answered;
  CHECK(m.method == "matfree");
  REQUIRE(d.info == Info::Success);
  const double allowed = 20 * (m.accuracy + sc_test::eps<double>() * d.kappa);
  CHECK(rel(m.sigma_max, d.sigma_max) < 1e-12);
  CHECK(rel(m.sigma_min, d.sigma_min) <= allowed);
  CHECK(rel(m.kappa, d.kappa) <= allowed + 1e-12);
  CHECK(m.accuracy < 1e-6);
}

}  // namespace

TEST_CASE("matfree agrees with the dense SVD of J across shapes, masks, tokens and lambda") {
  struct Shape {
    Index N, D, d;
  };
  std::vector<Shape> shapes{{16, 24, 8}, {24, 24, 6}, {32, 16, 4}};
  if (SC_TEST_SANITIZED) shapes = {{8, 12, 4}, {12, 8, 3}};
  Tally t;
  std::uint64_t seed = 300;
  for (const Shape s : shapes)
    for (const MaskKind mask : {MaskKind::None, MaskKind::Causal})
      for (const bool ln : {false, true})
        for (const double lambda : {0.0, 10.0}) {
          ++seed;
          // std::string: doctest's INFO prints a const char* as a pointer.
          INFO("seed=" << seed << " N=" << s.N << " D=" << s.D << " d=" << s.d << " mask "
                       << std::string(to_string(mask))
                       << std::string(ln ? " LayerNorm'd" : " Gaussian") << " lambda " << lambda);
          auto p = make_problem<double>(s.N, s.D, s.d, s.d, seed, mask);
          if (ln) layer_norm_rows(p);
          if (lambda != 0) {
            const Mat<double> E = rectangular_identity<double>(s.D, s.d);
            p.WQ += lambda * E;
            p.WK += lambda * E;
          }
          JacobianKappaOptions jo;
          jo.matfree.max_iterations = 1600;  // where too weak, decline soon
          const auto m = kappa_jacobian_matfree<double>(p.X, p.WQ, p.WK, p.WV, p.opts, jo);
          const auto d = dense_reference(p);
          check_honest(m, d, t);
          // A Ritz value bounds sigma_min from above: singular means sigma_min <= rank_tol.
          if (m.info == Info::Singular) CHECK(d.sigma_min <= m.rank_tol * (1 + 1e-8));
        }
  const int total = t.answered + t.singular + t.declined;
  MESSAGE("matfree answered " << t.answered << " of " << total << " instances, declined "
                              << t.singular << " as singular and " << t.declined
                              << " as not converging");
  // Declining is allowed, but a method that always declined would pass the loop above.
  // The counts of the Release grid (14 answered, 4 singular of 24 when measured); the
  // sanitizer build's smaller grid checks honesty only.
  if (!SC_TEST_SANITIZED) {
    CHECK(t.answered >= total / 4);
    CHECK(t.answered + t.singular >= total / 2);
  }
}

// A saturated softmax (causal, lambda = 10): the query and key couplings are exactly 0, the
// mixing cannot be computed, and matfree falls back to the unmixed channel blocks (MATH.md §12).
// It had declined this instance as singular, where sigma_min(J) = 1.04.
TEST_CASE("matfree with a saturated softmax: the unmixed blocks, never a wrong singular") {
  auto p = make_problem<double>(8, 12, 4, 4, 306, MaskKind::Causal);
  const Mat<double> E = rectangular_identity<double>(12, 4);
  p.WQ += 10 * E;
  p.WK += 10 * E;
  const auto m = kappa_jacobian_matfree<double>(p.X, p.WQ, p.WK, p.WV, p.opts);
  const auto d = dense_reference(p);
  REQUIRE(d.info == Info::Success);
  CHECK(d.sigma_min > 1e3 * m.rank_tol);  // far from singular
  Tally t;
  check_honest(m, d, t);
  CHECK(t.answered == 1);
  CHECK(m.note.find("(unmixed) channel blocks") != std::string::npos);
  CHECK(m.note.find("compressed inputs") != std::string::npos);
}

TEST_CASE("matfree against qr and lobpcg at N = 256 (causal, LayerNorm'd, N > D)") {
  if (SC_TEST_SANITIZED) return;  // thousands of JVPs at -O0: the Release suite has it
  auto p = make_problem<double>(256, 128, 4, 4, 41, MaskKind::Causal);
  layer_norm_rows(p);
  p.WQ *= 0.5;  // logits of order 1: a softmax neither uniform nor saturated
  p.WK *= 0.5;
  JacobianKappaOptions jo = with_method(JacobianKappaMethod::Matfree);
  const auto m = kappa_jacobian<double>(p.X, p.WQ, p.WK, p.WV, p.opts, jo);
  const auto q =
      kappa_jacobian<double>(p.X, p.WQ, p.WK, p.WV, p.opts, with_method(JacobianKappaMethod::Qr));
  const auto l = kappa_jacobian<double>(p.X, p.WQ, p.WK, p.WV, p.opts,
                                        with_method(JacobianKappaMethod::Lobpcg));
  MESSAGE("N = 256: kappa(J) = " << q.kappa << "; matfree " << m.iterations
                                 << " iterations, stated accuracy " << m.accuracy
                                 << ", rel. difference to qr " << rel(m.sigma_min, q.sigma_min)
                                 << ", to lobpcg " << rel(m.sigma_min, l.sigma_min));
  REQUIRE(q.info == Info::Success);
  REQUIRE(l.info == Info::Success);
  Tally t;
  check_honest(m, q, t);
  CHECK(t.answered + t.declined == 1);
  if (t.answered == 1) CHECK(rel(m.sigma_min, l.sigma_min) <= 20 * (m.accuracy + l.accuracy));
}

TEST_CASE("matfree where N <= D: the proven lower bound sigma_N(PX) is in the note and holds") {
  auto p = make_problem<double>(12, 32, 8, 4, 77, MaskKind::Causal);
  const auto m = kappa_jacobian_matfree<double>(p.X, p.WQ, p.WK, p.WV, p.opts);
  const auto d = dense_reference(p);
  Tally t;
  check_honest(m, d, t);
  REQUIRE(t.answered == 1);
  CHECK(m.note.find("sigma_min >= sigma_N(PX)") != std::string::npos);
  CHECK(m.note.find("at rounding level") == std::string::npos);  // P X has full row rank
  AttentionCache<double> c;
  attention_forward<double>(p.X, p.WQ, p.WK, p.WV, p.opts, c);
  const Eigen::JacobiSVD<Mat<double>> svd(c.P * p.X);
  CHECK(svd.singularValues()(p.X.rows() - 1) <= d.sigma_min * (1 + 1e-12));
}

TEST_CASE("matfree where N > rank(X): the coarse level covers the null modes of (PX)(PX)^T") {
  // LayerNorm'd rows have mean 0, so rank(X) = D - 1 = 11 and, P being invertible (causal),
  // (PX)(PX)^T has N - 11 = 13 null modes; the coarse level takes them and 4 more.
  auto p = make_problem<double>(24, 12, 4, 4, 19, MaskKind::Causal);
  layer_norm_rows(p);
  AttentionCache<double> c;
  attention_forward<double>(p.X, p.WQ, p.WK, p.WV, p.opts, c);
  const Eigen::JacobiSVD<Mat<double>> svd(c.P * p.X);
  const Vec<double> s = svd.singularValues();
  Index rank = 0;  // the same rule as the method's: σ_i^2 above N ε σ_1^2
  while (rank < s.size() && s(rank) * s(rank) > 24 * sc_test::eps<double>() * s(0) * s(0)) ++rank;
  REQUIRE(rank == 11);
  JacobianKappaOptions jo;
  jo.matfree_coarse = 4;
  const auto m = kappa_jacobian_matfree<double>(p.X, p.WQ, p.WK, p.WV, p.opts, jo);
  INFO(m.note);
  CHECK(m.note.find("a coarse level on the 17 smallest eigenvectors of (PX)(PX)^T (68 "
                    "directions)") != std::string::npos);
  CHECK(m.note.find("13 eigenvalues at rounding level (numerical rank 11 < N = 24): 52 "
                    "directions") != std::string::npos);
  CHECK(m.note.find("beyond the coarse level") == std::string::npos);
  Tally t;
  check_honest(m, dense_reference(p), t);
  CHECK(t.answered == 1);
  // A budget that holds the 4 modes' E (order 16) but not the 17 modes' (order 68): the null
  // modes are left out, the note says so, and with far too few iterations the decline says
  // that this is where the method is slow.
  jo.memory_budget = 50000;
  jo.matfree.max_iterations = 3;
  const auto few = kappa_jacobian_matfree<double>(p.X, p.WQ, p.WK, p.WV, p.opts, jo);
  INFO(few.note);
  CHECK(few.note.find("a coarse level on the 4 smallest") != std::string::npos);
  CHECK(few.note.find("9 modes beyond the coarse level (a coarse level covering them and 4 more "
                      "was left out: its Galerkin matrix of order 68 would need") !=
        std::string::npos);
  REQUIRE(few.info == Info::NotConverging);
  CHECK(std::isnan(few.kappa));
  CHECK(few.note.find("converge slowly or not at all (MATH.md §12)") != std::string::npos);
}

TEST_CASE("auto takes matfree when the Gram matrix would not fit the memory budget") {
  auto p = make_problem<double>(20, 24, 6, 6, 5, MaskKind::Causal);
  JacobianKappaOptions jo;
  jo.dense_max_entries = 0;   // not dense
  jo.memory_budget = 100000;  // no (N d_v)^2 matrix fits, the coarse level's 96^2 does
  jo.matfree.max_iterations = 400;
  const auto a = kappa_jacobian<double>(p.X, p.WQ, p.WK, p.WV, p.opts, jo);
  INFO(a.note);
  CHECK(a.note.rfind("auto chose matfree", 0) == 0);
  CHECK(a.note.find("lobpcg left out") != std::string::npos);
  Tally t;
  check_honest(a, dense_reference(p), t);
  CHECK(t.answered == 1);
  jo.memory_budget = std::uint64_t(1) << 40;  // everything fits: all three are candidates
  const auto b = kappa_jacobian<double>(p.X, p.WQ, p.WK, p.WV, p.opts, jo);
  CHECK(b.note.find("left out") == std::string::npos);
  CHECK(jo.resolved_memory_budget() == std::uint64_t(1) << 40);
  jo.memory_budget = 0;
  CHECK(jo.resolved_memory_budget() == physical_memory_bytes() / 4);
  CHECK(physical_memory_bytes() > 0);
}

TEST_CASE("matfree declines a tall J and reads float inputs") {
  const auto tall = make_problem<double>(24, 4, 2, 4, 8);  // 96 rows, 32 columns
  const auto r = kappa_jacobian_matfree<double>(tall.X, tall.WQ, tall.WK, tall.WV, tall.opts);
  CHECK(r.info == Info::Singular);
  CHECK(r.kappa == std::numeric_limits<double>::infinity());  // never NaN (MATH.md §4)
  CHECK(r.sigma_min == 0);
  CHECK(r.note.find("tall") != std::string::npos);
  const auto pf = make_problem<float>(10, 16, 4, 4, 9);
  const auto f = kappa_jacobian_matfree<float>(pf.X, pf.WQ, pf.WK, pf.WV, pf.opts);
  Tally t;
  check_honest(f, dense_reference(pf), t);
  CHECK(t.answered == 1);
}

TEST_CASE("matfree: the method's name parses, and kappa_jacobian routes it") {
  CHECK(parse_jacobian_kappa_method("matfree") == JacobianKappaMethod::Matfree);
  CHECK(std::string(to_string(JacobianKappaMethod::Matfree)) == "matfree");
  const auto p = make_problem<double>(10, 12, 4, 3, 12);
  const auto r = kappa_jacobian<double>(p.X, p.WQ, p.WK, p.WV, p.opts,
                                        with_method(JacobianKappaMethod::Matfree));
  CHECK(r.method == "matfree");
}

// Temple's bound (linalg/lobpcg.hpp, MATH.md §12) on a matrix of known spectrum: it holds for any
// unit x whose Rayleigh quotient lies below the second eigenvalue, and it is an equality for x in
// the span of the two smallest eigenvectors (then ρ - λ_1 = ||r||^2 / (λ_2 - ρ) exactly).
TEST_CASE("temple_bound: Temple's inequality against a matrix of known spectrum") {
  std::mt19937_64 rng(5);
  const Index n = 30;
  const Eigen::HouseholderQR<Mat<double>> qr(sc_test::randn<double>(n, n, rng));
  const Mat<double> Q = qr.householderQ();
  Vec<double> lam(n);
  for (Index i = 0; i < n; ++i) lam(i) = 1.0 + 0.5 * static_cast<double>(i);
  const Mat<double> A = Q * lam.asDiagonal() * Q.transpose();
  auto bound = [&](Vec<double> x, double& rel_error) {  // rel. error of sqrt(ρ) against sqrt(λ_1)
    x /= x.norm();
    const double rho = x.dot(A * x);
    rel_error = 1 - std::sqrt(lam(0) / rho);
    return detail::temple_bound(rho, (A * x - rho * x).norm(), lam(1), 0, 0);
  };
  double err = 0;
  for (const double s : {1e-2, 1e-4, 1e-6}) {  // x = u_1 + s u_2: the bound is exact
    const double b = bound(Q.col(0) + s * Q.col(1), err);
    INFO("s = " << s << ": bound " << b << ", error " << err);
    CHECK(std::abs(b - err) <= 1e-8 * err + 1e3 * sc_test::eps<double>());
  }
  for (const double s : {1e-2, 1e-3, 1e-5}) {  // any direction: an upper bound
    const Vec<double> x = Q.col(0) + s * sc_test::randn<double>(n, 1, rng);
    const double b = bound(x, err);
    INFO("s = " << s << ": bound " << b << ", error " << err);
    CHECK(err <= b * (1 + 1e-8) + 1e3 * sc_test::eps<double>());
    CHECK(b <= 1e3 * err);  // and quadratic in the residual, like the error itself
  }
  // No gap seen (the second value not above ρ) or a residual too large: no bound.
  CHECK(std::isinf(detail::temple_bound(1.0, 1e-3, 1.0, 0, 0)));
  CHECK(std::isinf(detail::temple_bound(1.0, 1e-3, 2.0, 1.5, 0)));
  CHECK(std::isinf(detail::temple_bound(1.0, 2.0, 2.0, 0, 0)));
  // The rounding allowance enters both residuals.
  CHECK(detail::temple_bound(1.0, 1e-4, 2.0, 0, 1e-4) > detail::temple_bound(1.0, 1e-4, 2.0, 0, 0));
}

// The coarse level's Galerkin matrix E = Z^T J J^T Z, from the structured form with no product
// by J (MATH.md §12), against the same product of the assembled J: Z = I_{d_v} ⊗ U_k, U_k the
// eigenvectors of S = (P X)(P X)^T for its k smallest eigenvalues. It keeps (E + a shift of at most
// 64 k d_v ε ||E||)^{-1}.
TEST_CASE("matfree's coarse level: its Galerkin matrix is Z^T J J^T Z of the assembled J") {
  auto p =
      make_problem<double>(10, 14, 10, 3, 91, MaskKind::Causal);  // d_k = 10: two chunks of columns
  detail::JacobianParts<double> jp;
  jp.compute(p.X, p.WQ, p.WK, p.WV, p.opts, JacobianBlock::All);
  const Mat<double> S = jp.PX * jp.PX.transpose();
  using Form = detail::CoarseCorrection::Form;
  for (const Form form : {Form::Columns, Form::ChannelPairs}) {  // both ways of forming E
    INFO("E formed " << (form == Form::Columns ? "from J's columns" : "by channel pairs"));
    detail::CoarseCorrection coarse;
    coarse.form = form;
    std::string why;
    REQUIRE(coarse.build(jp, p.X, S, 4, true, std::uint64_t(1) << 30, why));
    REQUIRE(coarse.k == 4);
    CHECK(coarse.used_pairs == (form == Form::ChannelPairs));
    const Mat<double> J = attention_jacobian(p.X, p.WQ, p.WK, p.WV, p.opts);
    const Index N = 10, dv = 3, n = coarse.k * dv;
    Mat<double> Z = Mat<double>::Zero(N * dv, n);  // column a + k i: u_a in channel i's rows
    for (Index i = 0; i < dv; ++i)
      for (Index a = 0; a < coarse.k; ++a)
        Z.col(a + coarse.k * i).segment(i * N, N) = coarse.U.col(a);
    const Mat<double> JtZ = J.transpose() * Z;
    const Mat<double> E = JtZ.transpose() * JtZ;
    // Its inverse, kept in place of E: E^{-1} E = I up to the shift and the inversion's rounding,
    // both relative to ||E||, so a few hundred n ε κ(E).
    REQUIRE(coarse.Einv.rows() == n);
    const Eigen::SelfAdjointEigenSolver<Mat<double>> ee(E);
    const double kappa_e = ee.eigenvalues()(n - 1) / ee.eigenvalues()(0);
    CHECK((coarse.Einv - coarse.Einv.transpose()).norm() == 0);
    const double err = (coarse.Einv * E - Mat<double>::Identity(n, n)).norm();
    INFO("||E^{-1} Z^T J J^T Z - I|| = " << err << ", kappa(E) = " << kappa_e);
    CHECK(err < 200 * static_cast<double>(n) * sc_test::eps<double>() * kappa_e);
    // The k columns of U_k are S's eigenvectors for its smallest eigenvalues.
    const Eigen::SelfAdjointEigenSolver<Mat<double>> es(S);
    for (Index a = 0; a < coarse.k; ++a)
      CHECK((S * coarse.U.col(a) - es.eigenvalues()(a) * coarse.U.col(a)).norm() <=
            1e3 * sc_test::eps<double>() * es.eigenvalues()(N - 1));
    // Applied to a block, it is Z E^{-1} Z^T.
    Mat<double> B = Mat<double>::Random(N * dv, 2), C;
    coarse.apply(B, C);
    const Mat<double> ref = Z * E.ldlt().solve(Z.transpose() * B);
    CHECK((C - ref).norm() <=
          1e3 * static_cast<double>(n) * sc_test::eps<double>() * kappa_e * ref.norm());
  }
  // Over the memory budget (E alone is 12^2 doubles here), no coarse level, and the note says why.
  detail::CoarseCorrection small;
  std::string why;
  CHECK(!small.build(jp, p.X, S, 4, true, 1000, why));
  CHECK(small.k == 0);
  CHECK(why.find("over the memory budget") != std::string::npos);
  JacobianKappaOptions jo;
  jo.memory_budget = 1000;
  const auto m = kappa_jacobian_matfree<double>(p.X, p.WQ, p.WK, p.WV, p.opts, jo);
  CHECK(m.note.find("(no coarse level: its Galerkin matrix of order 30 would need") !=
        std::string::npos);
}

// The preconditioners keep inverses (inverse_from_cholesky) and apply them to a few columns in one
// pass over the matrix (multiply_columns): against Eigen's LDL^T solve and its ordinary product.
TEST_CASE("inverse_from_cholesky and multiply_columns against Eigen's solve and product") {
  std::mt19937_64 rng(23);
  const Index n = 37;
  const Mat<double> A = sc_test::randn<double>(n, n, rng);
  Mat<double> G = A * A.transpose() + 1e-3 * Mat<double>::Identity(n, n);
  const Mat<double> G0 = G;
  const Eigen::SelfAdjointEigenSolver<Mat<double>> es(G0);
  const double kappa = es.eigenvalues()(n - 1) / es.eigenvalues()(0);
  REQUIRE(detail::cholesky_in_place(G));
  REQUIRE(detail::inverse_from_cholesky(G));
  CHECK((G - G.transpose()).norm() == 0);
  const Mat<double> ref = G0.ldlt().solve(Mat<double>::Identity(n, n));
  INFO("kappa(G) = " << kappa);
  CHECK((G - ref).norm() <=
        100 * static_cast<double>(n) * sc_test::eps<double>() * kappa * ref.norm());
  for (Index c : {1, 2, 4, 8, 9}) {
    const Mat<double> B = sc_test::randn<double>(n, c, rng);
    Mat<double> Y(n, c);
    detail::multiply_columns(G0, B, Y);
    const Mat<double> prod = G0 * B;
    CHECK((Y - prod).norm() <=
          10 * static_cast<double>(n) * sc_test::eps<double>() * G0.norm() * B.norm());
  }
  // A matrix that is not positive definite is refused at the factorisation.
  Mat<double> bad = G0;
  bad(0, 0) = -1;
  CHECK_FALSE(detail::cholesky_in_place(bad));
}

// The coarse level's eigensolver (LAPACK ?syevr for the k smallest where built with LAPACKE)
// against Eigen's full solver, on a PSD matrix with a cluster of small eigenvalues.
TEST_CASE("smallest_eigenpairs: the k smallest eigenpairs, as the full eigensolver gives them") {
  std::mt19937_64 rng(17);
  const Mat<double> A = sc_test::randn<double>(40, 12, rng);
  const Mat<double> G = A * A.transpose();  // rank 12: 28 eigenvalues at rounding level
  Vec<double> values;
  Mat<double> vectors;
  REQUIRE(detail::smallest_eigenpairs(G, 31, values, vectors));
  REQUIRE(values.size() == 31);
  REQUIRE(vectors.cols() == 31);
  const Eigen::SelfAdjointEigenSolver<Mat<double>> es(G);
  const double tol = 1e3 * sc_test::eps<double>() * es.eigenvalues()(39);
  CHECK((values - es.eigenvalues().head(31)).cwiseAbs().maxCoeff() <= tol);
  CHECK((G * vectors - vectors * values.asDiagonal()).cwiseAbs().maxCoeff() <= tol);
  CHECK((vectors.transpose() * vectors - Mat<double>::Identity(31, 31)).cwiseAbs().maxCoeff() <=
        1e3 * sc_test::eps<double>());
  CHECK(!detail::smallest_eigenpairs(G, 0, values, vectors));
  CHECK(!detail::smallest_eigenpairs(G, 41, values, vectors));
  CHECK(values.size() == 0);
}

// The regime of a GPT-2-sized head with LayerNorm'd tokens and small weights (MATH.md §12): the
// smallest singular vectors lie on the near-null modes of the causal average P X, which the
// channel blocks alone miss. With the coarse level matfree answers within its stated accuracy
// (against lobpcg) in a fraction of the iterations it takes without (measured: 302 against
// 1460 on the NumPy-seeded instance of the same shape).
TEST_CASE("matfree's coarse level where the channel blocks miss the small directions") {
  if (SC_TEST_SANITIZED) return;  // thousands of JVPs at -O0: the Release suite has it
  auto p = make_problem<double>(128, 768, 32, 32, 2025, MaskKind::Causal);
  layer_norm_rows(p);
  const double to_002 = 0.02 * std::sqrt(768.0);  // W ~ N(0, 1/D) -> N(0, 0.02^2)
  p.WQ *= to_002;
  p.WK *= to_002;
  p.WV *= to_002;
  JacobianKappaOptions with = with_method(JacobianKappaMethod::Matfree), without = with;
  without.matfree_coarse = 0;
  const auto m = kappa_jacobian<double>(p.X, p.WQ, p.WK, p.WV, p.opts, with);
  const auto m0 = kappa_jacobian<double>(p.X, p.WQ, p.WK, p.WV, p.opts, without);
  const auto l = kappa_jacobian<double>(p.X, p.WQ, p.WK, p.WV, p.opts,
                                        with_method(JacobianKappaMethod::Lobpcg));
  MESSAGE("N = 128, D = 768, d = 32, causal, LayerNorm'd, W ~ N(0, 0.02^2): kappa(J) = "
          << l.kappa << "; matfree " << m.iterations << " iterations with the coarse level ("
          << std::string(to_string(m.info)) << ", stated accuracy " << m.accuracy << "), "
          << m0.iterations << " without (" << std::string(to_string(m0.info)) << ")");
  REQUIRE(l.info == Info::Success);
  Tally t;
  check_honest(m, l, t);
  check_honest(m0, l, t);
  REQUIRE(m.info == Info::Success);
  // S's smallest eigenvalue is at rounding level here (σ_N(P X)^2 below N ε σ_1(P X)^2: the
  // attention averages the tokens), so the coarse level takes it and 16 more.
  CHECK(m.note.find("1 eigenvalue at rounding level (numerical rank 127 < N = 128)") !=
        std::string::npos);
  CHECK(m.note.find("coarse level on the 17 smallest eigenvectors") != std::string::npos);
  CHECK(m.accuracy <= 1e-8);
  CHECK(2 * m.iterations <= m0.iterations);
}
