// The attention core (MATH.md §1–2): forward, JVP and VJP against central finite differences,
// the adjoint identity, masks, extreme logits and degenerate shapes.
#include <spectral_cond/spectral_cond.hpp>

#include "support/test_helpers.hpp"

using namespace spectral_cond;
using sc_test::make_problem;
using sc_test::Problem;
using sc_test::randn;
using sc_test::rel_err;

namespace {

/// The reference forward pass, written independently of the library: explicit loops.
template <typename Scalar>
Mat<Scalar> reference_attention(const Problem<Scalar>& p) {
  const Mat<Scalar> Q = p.X * p.WQ, K = p.X * p.WK, V = p.X * p.WV;
  const Index N = Q.rows();
  const Scalar c = p.opts.resolved_scale(Q.cols());
  Mat<Scalar> P(N, N);
  for (Index i = 0; i < N; ++i) {
    long double mx = -1e300L;
    for (Index j = 0; j < N; ++j) {
      if (p.opts.mask == MaskKind::Causal && j > i) continue;
      mx = std::max(mx, static_cast<long double>(c * Q.row(i).dot(K.row(j))));
    }
    long double s = 0;
    for (Index j = 0; j < N; ++j) {
      const bool masked = p.opts.mask == MaskKind::Causal && j > i;
      const long double e =
          masked ? 0.0L : std::exp(static_cast<long double>(c * Q.row(i).dot(K.row(j))) - mx);
      P(i, j) = static_cast<Scalar>(e);
      s += e;
    }
    P.row(i) /= static_cast<Scalar>(s);
  }
  return P * V;
}

template <typename Scalar>
void check_derivatives(Index N, Index D, Index dk, Index dv, std::uint64_t seed, MaskKind mask,
                       double fd_tol, double adj_tol) {
  INFO("seed=" << seed << " N=" << N << " D=" << D << " dk=" << dk << " dv=" << dv
               << " mask=" << to_string(mask));
  auto p = make_problem<Scalar>(N, D, dk, dv, seed, mask);
  const auto cache = attention_forward(p.X, p.WQ, p.WK, p.WV, p.opts);
  CHECK(rel_err(cache.A, reference_attention(p)) <
        50 * sc_test::eps<Scalar>() * static_cast<double>(N));

  std::mt19937_64 rng(seed + 1);
  const Mat<Scalar> dWQ = randn<Scalar>(D, dk, rng), dWK = randn<Scalar>(D, dk, rng);
  const Mat<Scalar> dWV = randn<Scalar>(D, dv, rng), dX = randn<Scalar>(N, D, rng);
  const Mat<Scalar> G = randn<Scalar>(N, dv, rng);

  // JVP of each input alone against a central difference of the forward pass.
  auto fd_along = [&](int which, const Mat<Scalar>& v) {
    switch (which) {
      case 0:
        return central_difference<Scalar>(
            [&](const Mat<Scalar>& w) { return attention(p.X, w, p.WK, p.WV, p.opts); }, p.WQ, v);
      case 1:
        return central_difference<Scalar>(
            [&](const Mat<Scalar>& w) { return attention(p.X, p.WQ, w, p.WV, p.opts); }, p.WK, v);
      case 2:
        return central_difference<Scalar>(
            [&](const Mat<Scalar>& w) { return attention(p.X, p.WQ, p.WK, w, p.opts); }, p.WV, v);
      default:
        return central_difference<Scalar>(
            [&](const Mat<Scalar>& x) { return attention(x, p.WQ, p.WK, p.WV, p.opts); }, p.X, v);
    }
  };
  const Mat<Scalar>* tangents[4] = {&dWQ, &dWK, &dWV, &dX};
  const char* names[4] = {"W_Q", "W_K", "W_V", "X"};
  Mat<Scalar> sum_fd = Mat<Scalar>::Zero(N, dv);
  for (int w = 0; w < 4; ++w) {
    AttentionTangents<Scalar> t;
    (w == 0 ? t.dWQ : w == 1 ? t.dWK : w == 2 ? t.dWV : t.dX) = *tangents[w];
    const Mat<Scalar> jvp = attention_jvp(p.X, p.WQ, p.WK, p.WV, cache, t);
    const Mat<Scalar> fd = fd_along(w, *tangents[w]);
    sum_fd += fd;
    INFO("input " << names[w]);
    CHECK(rel_err(jvp, fd) < fd_tol);
  }
  // All four tangents at once: linearity of the JVP.
  const AttentionTangents<Scalar> all{dWQ, dWK, dWV, dX};
  const Mat<Scalar> jvp_all = attention_jvp(p.X, p.WQ, p.WK, p.WV, cache, all);
  CHECK(rel_err(jvp_all, sum_fd) < fd_tol);

  // VJP against finite differences of <G, A> (a scalar function) for each input.
  const auto g = attention_vjp(p.X, p.WQ, p.WK, p.WV, cache, CRef<Scalar>(G));
  const Mat<Scalar>* grads[4] = {&g.dWQ, &g.dWK, &g.dWV, &g.dX};
  for (int w = 0; w < 4; ++w) {
    INFO("cotangent of " << names[w]);
    const Mat<Scalar> fd = fd_along(w, *tangents[w]);
    const double lhs = static_cast<double>((fd.array() * G.array()).sum());
    const double rhs = static_cast<double>((grads[w]->array() * tangents[w]->array()).sum());
    CHECK(std::abs(lhs - rhs) <= fd_tol * (std::abs(lhs) + std::abs(rhs) + 1e-3));
  }
  // Adjoint identity <JVP(v), w> = <v, VJP(w)>, which involves no finite differences.
  const double lhs = static_cast<double>((jvp_all.array() * G.array()).sum());
  double rhs = 0;
  for (int w = 0; w < 4; ++w)
    rhs += static_cast<double>((grads[w]->array() * tangents[w]->array()).sum());
  CHECK(std::abs(lhs - rhs) <= adj_tol * (std::abs(lhs) + std::abs(rhs)));
}

}  // namespace

TEST_CASE_TEMPLATE("attention JVP and VJP match finite differences", Scalar, double, float) {
  // float: central differences carry error ~ eps^(2/3); tolerances in units of sqrt(eps).
  const double fd_tol =
      std::is_same<Scalar, double>::value ? 1e-6 : 300 * std::sqrt(sc_test::eps<float>());
  const double adj_tol = std::is_same<Scalar, double>::value ? 1e-12 : 1e3 * sc_test::eps<float>();
  struct Case {
    Index N, D, dk, dv;
    MaskKind mask;
  };
  const Case cases[] = {
      {6, 5, 4, 3, MaskKind::None},    // N > D
      {3, 8, 4, 5, MaskKind::None},    // N < D
      {5, 5, 5, 5, MaskKind::Causal},  // causal mask
      {1, 4, 3, 2, MaskKind::None},    // N = 1
      {4, 1, 1, 1, MaskKind::None},    // D = d = 1
      {7, 6, 1, 2, MaskKind::Causal},  // d_k = 1
  };
  std::uint64_t seed = 1234;
  for (const Case& c : cases)
    check_derivatives<Scalar>(c.N, c.D, c.dk, c.dv, seed++, c.mask, fd_tol, adj_tol);
}

TEST_CASE("scale c = 1 (the paper's theory) and an explicit scale") {
  auto p = make_problem<double>(5, 4, 3, 2, 77);
  p.opts.scale = 1.0;
  CHECK(rel_err(attention(p.X, p.WQ, p.WK, p.WV, p.opts), reference_attention(p)) < 1e-13);
  const auto cache = attention_forward(p.X, p.WQ, p.WK, p.WV, p.opts);
  CHECK(cache.scale == 1.0);
  AttentionOptions<double> dflt;
  CHECK(dflt.resolved_scale(16) == doctest::Approx(0.25));
}

TEST_CASE("additive mask equals causal mask when it encodes the same pattern") {
  auto p = make_problem<double>(6, 4, 3, 2, 5);
  p.opts.mask = MaskKind::Causal;
  const Mat<double> causal = attention(p.X, p.WQ, p.WK, p.WV, p.opts);
  p.opts.mask = MaskKind::Additive;
  p.opts.additive_mask = Mat<double>::Zero(6, 6);
  for (Index i = 0; i < 6; ++i)
    for (Index j = i + 1; j < 6; ++j)
      p.opts.additive_mask(i, j) = -std::numeric_limits<double>::infinity();
  CHECK(rel_err(attention(p.X, p.WQ, p.WK, p.WV, p.opts), causal) < 1e-15);
  // Causal attention: the first output row is V's first row.
  CHECK(rel_err(causal.row(0), (p.X * p.WV).row(0)) < 1e-14);
}

TEST_CASE_TEMPLATE("logits of magnitude 1e4 stay finite, and so do derivatives", Scalar, double,
                   float) {
  auto p = make_problem<Scalar>(6, 4, 3, 3, 9);
  p.opts.scale = Scalar(1);
  p.WQ *= Scalar(100);
  p.WK *= Scalar(100);  // logits ~ 1e4
  const auto cache = attention_forward(p.X, p.WQ, p.WK, p.WV, p.opts);
  CHECK(std::abs(static_cast<double>((cache.Q * cache.K.transpose()).cwiseAbs().maxCoeff())) > 1e3);
  CHECK(cache.A.allFinite());
  CHECK(cache.P.allFinite());
  CHECK(rel_err(cache.P.rowwise().sum().eval(), Mat<Scalar>::Ones(6, 1)) <
        10 * sc_test::eps<Scalar>());
  std::mt19937_64 rng(3);
  const Mat<Scalar> G = randn<Scalar>(6, 3, rng);
  const auto g = attention_vjp(p.X, p.WQ, p.WK, p.WV, cache, CRef<Scalar>(G));
  CHECK(g.dWQ.allFinite());
  CHECK(g.dX.allFinite());
}

TEST_CASE("misuse throws std::invalid_argument naming the function and the shapes") {
  auto p = make_problem<double>(4, 3, 2, 2, 1);
  const Mat<double> badWK = Mat<double>::Zero(3, 5);
  CHECK_THROWS_WITH_AS(attention(p.X, p.WQ, badWK, p.WV),
                       "attention_forward: W_K must be D x d_k = 3 x 2 (got 3 x 5)",
                       std::invalid_argument);
  p.opts.scale = -1.0;
  CHECK_THROWS_AS(attention(p.X, p.WQ, p.WK, p.WV, p.opts), std::invalid_argument);
  p.opts.scale = 0.0;
  CHECK_THROWS_AS(attention(p.X, p.WQ, p.WK, p.WV, p.opts), std::invalid_argument);
  p.opts.scale.reset();
  p.opts.mask = MaskKind::Additive;
  p.opts.additive_mask = Mat<double>::Zero(4, 4);
  p.opts.additive_mask.row(2).setConstant(-std::numeric_limits<double>::infinity());
  CHECK_THROWS_WITH_AS(attention(p.X, p.WQ, p.WK, p.WV, p.opts),
                       "attention_forward: additive_mask row 2 is fully masked (every entry -inf)",
                       std::invalid_argument);
  p.opts.additive_mask = Mat<double>::Zero(3, 3);
  CHECK_THROWS_AS(attention(p.X, p.WQ, p.WK, p.WV, p.opts), std::invalid_argument);
  p.opts.mask = MaskKind::None;
  const auto cache = attention_forward(p.X, p.WQ, p.WK, p.WV, p.opts);
  const Mat<double> badG = Mat<double>::Zero(4, 3);
  CHECK_THROWS_WITH_AS(attention_vjp(p.X, p.WQ, p.WK, p.WV, cache, CRef<double>(badG)),
                       "attention_vjp: G must be N x d_v = 4 x 2 (got 4 x 3)",
                       std::invalid_argument);
}

TEST_CASE("VJP skips outputs passed as 0 x 0 and the out-parameter form reuses buffers") {
  auto p = make_problem<double>(5, 4, 3, 2, 21);
  AttentionCache<double> cache;
  attention_forward<double>(p.X, p.WQ, p.WK, p.WV, p.opts, cache);
  std::mt19937_64 rng(4);
  const Mat<double> G = randn<double>(5, 2, rng);
  AttentionWorkspace<double> ws;
  Mat<double> gWQ(4, 3), gWK(4, 3), gWV(4, 2);
  attention_vjp<double>(p.X, p.WQ, p.WK, p.WV, cache, G, ws, gWQ, gWK, gWV,
                        Eigen::Map<Mat<double>>(nullptr, 0, 0));
  const auto full = attention_vjp(p.X, p.WQ, p.WK, p.WV, cache, CRef<double>(G));
  CHECK(rel_err(gWQ, full.dWQ) == 0.0);
  CHECK(rel_err(gWV, full.dWV) == 0.0);
  // Writing into a column block of a larger matrix (caller storage).
  Mat<double> big = Mat<double>::Zero(4, 10);
  attention_vjp<double>(p.X, p.WQ, p.WK, p.WV, cache, G, ws, big.middleCols(0, 3),
                        big.middleCols(3, 3), big.middleCols(6, 2),
                        Eigen::Map<Mat<double>>(nullptr, 0, 0));
  CHECK(rel_err(big.middleCols(3, 3), full.dWK) == 0.0);
  CHECK(big.col(8).isZero());
}
