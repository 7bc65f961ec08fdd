// The λ advisor (conditioning/advisor.hpp, MATH.md §17): every grid point against independent
// references (κ(J) by JacobiSVD of the assembled J, κ(W + λ E) by JacobiSVD of a corrected slice
// built here by hand, the saturated fraction from P entry by entry), the placements' identities,
// the closed-form onset, and the recommendation on heads whose answer is known.
#include <spectral_cond/conditioning/advisor.hpp>
#include <spectral_cond/jacobian/jacobian.hpp>

#include "support/test_helpers.hpp"

#include <Eigen/SVD>

#include <cmath>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>

using namespace spectral_cond;
using sc_test::randn;

namespace {

double eps() {
  return std::numeric_limits<double>::epsilon();
}

/// κ of a matrix by JacobiSVD (+inf when the smallest singular value is 0).
double jacobi_kappa(const Mat<double>& M) {
  const Eigen::VectorXd s = Eigen::JacobiSVD<Mat<double>>(M).singularValues();
  return s(s.size() - 1) == 0 ? std::numeric_limits<double>::infinity() : s(0) / s(s.size() - 1);
}

/// LayerNorm'd tokens: each row of a Gaussian matrix centred and scaled to unit variance.
Mat<double> layer_normed(Index N, Index D, std::mt19937_64& rng) {
  Mat<double> X = randn<double>(N, D, rng);
  for (Index i = 0; i < N; ++i) {
    X.row(i).array() -= X.row(i).mean();
    X.row(i) /= std::sqrt(X.row(i).squaredNorm() / static_cast<double>(D));
  }
  return X;
}

/// Saturated rows of P (max_j P_ij > 1 - 1e-6) over its rows, entry by entry.
double saturated_fraction(const Mat<double>& P) {
  Index s = 0;
  for (Index i = 0; i < P.rows(); ++i) s += P.row(i).maxCoeff() > 1 - 1e-6 ? 1 : 0;
  return static_cast<double>(s) / static_cast<double>(P.rows());
}

}  // namespace

TEST_CASE("placements: names round-trip, and bad names are refused naming the argument") {
  for (const char* name : {"fused", "per_head", "packed", "fused:qk", "per_head:v", "fused:q"}) {
    CHECK(parse_placement(name).name() == name);
  }
  CHECK(parse_placement("per-head").name() == "per_head");
  CHECK(parse_placement("fused:kq").name() == "fused:qk");
  for (const char* bad : {"diagonal", "fused:", "fused:qq", "fused:x", "packed:q", ""}) {
    INFO(bad);
    try {
      parse_placement(bad, "--placements");
      FAIL("accepted");
    } catch (const std::invalid_argument& e) {
      CHECK(std::string(e.what()).find("--placements") != std::string::npos);
    }
  }
}

TEST_CASE("placements: the identity each projection of a head receives") {
  // heads = 4, d_k = d_v = 2, D = 8 (= heads d_k): head 2's fused slice has ones at rows 4, 5;
  // per-head at rows 0, 1; packed reaches the Q block alone (K and V start at column 8 = D).
  const HeadPosition pos{2, 4, 0};
  const CorrectionPlacement fused{Placement::Fused}, per_head{Placement::PerHead},
      packed{Placement::Packed};
  for (int w = 0; w < 3; ++w) {
    CHECK(detail::identity_offset(fused, w, pos, 2, 2) == 4);
    CHECK(detail::identity_offset(per_head, w, pos, 2, 2) == 0);
  }
  CHECK(detail::identity_offset(packed, 0, pos, 2, 2) == 4);
  CHECK(detail::identity_offset(packed, 1, pos, 2, 2) == 8 + 4);
  CHECK(detail::identity_offset(packed, 2, pos, 2, 2) == 16 + 4);
  const CorrectionPlacement v_only = parse_placement("fused:v");
  CHECK(detail::identity_offset(v_only, 0, pos, 2, 2) == -1);
  CHECK(detail::identity_offset(v_only, 1, pos, 2, 2) == -1);
  CHECK(detail::identity_offset(v_only, 2, pos, 2, 2) == 4);
  // Grouped-query: 4 query heads over 2 key/value heads; head 3 reads K and V of group 1.
  const HeadPosition gqa{3, 4, 2};
  CHECK(detail::identity_offset(fused, 0, gqa, 2, 3) == 6);
  CHECK(detail::identity_offset(fused, 1, gqa, 2, 3) == 2);
  CHECK(detail::identity_offset(fused, 2, gqa, 2, 3) == 3);
  CHECK(detail::identity_offset(packed, 2, gqa, 2, 3) == (4 + 2) * 2 + 3);
  // The corrected slice: ones only where the shifted diagonal stays inside D rows.
  const Mat<double> W = Mat<double>::Zero(5, 3);
  const Mat<double> C = detail::shifted_identity_add(W, 3, 2.0);
  CHECK(C(3, 0) == 2.0);
  CHECK(C(4, 1) == 2.0);
  CHECK(C.sum() == 4.0);
  CHECK(detail::shifted_identity_add(W, -1, 2.0) == W);
}

TEST_CASE(
    "advise_head: every grid point against JacobiSVD of the assembled J and of W + lambda E") {
  std::mt19937_64 rng(41);
  const Index N = 5, D = 8, d = 2, heads = 4;
  const Mat<double> X = layer_normed(N, D, rng);
  const Mat<double> WQf = randn<double>(D, heads * d, rng, 0.3),
                    WKf = randn<double>(D, heads * d, rng, 0.3),
                    WVf = randn<double>(D, heads * d, rng, 0.3);
  const HeadPosition pos{1, heads, 0};
  const Mat<double> WQ = WQf.middleCols(2, d), WK = WKf.middleCols(2, d), WV = WVf.middleCols(2, d);
  AdviceOptions o;
  o.lambdas = {0, 0.5, 2};
  o.placements = {parse_placement("fused"), parse_placement("per_head"), parse_placement("packed"),
                  parse_placement("fused:v")};
  const AttentionOptions<double> opts;
  const HeadAdvice a = advise_head(X, WQ, WK, WV, opts, pos, o);
  REQUIRE(a.points.size() == 12);
  CHECK(a.baseline == 0);
  for (std::size_t i = 0; i < a.points.size(); ++i) {
    const AdvicePoint& p = a.points[i];
    INFO("point " << i << ": lambda " << p.lambda << " " << p.placement);
    const CorrectionPlacement pl = parse_placement(p.placement);
    // The corrected slices built here from the fused matrices: fused adds λ I(D, heads d) to the
    // whole projection, per-head λ I(D, d) to the head's block, packed λ I(D, 3 heads d) to
    // [W_Q | W_K | W_V].
    Mat<double> fq = WQf, fk = WKf, fv = WVf;
    if (pl.layout == Placement::Fused) {
      if (pl.q) fq += p.lambda * Mat<double>::Identity(D, heads * d);
      if (pl.k) fk += p.lambda * Mat<double>::Identity(D, heads * d);
      if (pl.v) fv += p.lambda * Mat<double>::Identity(D, heads * d);
    } else if (pl.layout == Placement::Packed) {
      Mat<double> packed(D, 3 * heads * d);
      packed << WQf, WKf, WVf;
      packed += p.lambda * Mat<double>::Identity(D, 3 * heads * d);
      fq = packed.leftCols(heads * d);
      fk = packed.middleCols(heads * d, heads * d);
      fv = packed.rightCols(heads * d);
    }
    Mat<double> q = fq.middleCols(2, d), k = fk.middleCols(2, d), v = fv.middleCols(2, d);
    if (pl.layout == Placement::PerHead) {
      q += p.lambda * Mat<double>::Identity(D, d);
      k += p.lambda * Mat<double>::Identity(D, d);
      v += p.lambda * Mat<double>::Identity(D, d);
    }
    const Mat<double>* ws[3] = {&q, &k, &v};
    for (std::size_t w = 0; w < 3; ++w) {
      const double ref = jacobi_kappa(*ws[w]);
      CHECK(std::abs(p.kappa_W[w].kappa - ref) <= 64 * eps() * ref * ref);
    }
    const Mat<double> J = attention_jacobian(X, q, k, v, opts);
    const double ref = jacobi_kappa(J);
    REQUIRE(p.J.info == Info::Success);
    CHECK(std::isfinite(p.J.accuracy));
    CHECK(std::abs(p.J.kappa - ref) <= std::max(p.J.accuracy, 1e3 * eps() * ref) * ref);
    const Mat<double> P = attention_forward(X, q, k, v, opts).P;
    CHECK(p.diagnostics.pattern.saturated_fraction == saturated_fraction(P));
    CHECK(p.diagnostics.pattern.row_max_mean ==
          doctest::Approx(P.rowwise().maxCoeff().mean()).epsilon(1e-14));
    // The bound that needs no hypothesis holds (N <= D).
    REQUIRE(p.free_bound.applicable);
    CHECK(ref <= p.free_bound.bound * (1 + 1e-10));
  }
  // λ = 0 is one point under every placement: computed once.
  for (std::size_t i = 3; i < a.points.size(); i += 3) {
    CHECK(a.points[i].lambda == 0);
    CHECK(a.points[i].same_as == 0);
    CHECK(a.points[i].J.kappa == a.points[0].J.kappa);
  }
  // Packed with D = heads d_k corrects Q alone: fused:q's weights, not fused's.
  CHECK(a.points[7].kappa_W[0].kappa == a.points[1].kappa_W[0].kappa);
  CHECK(a.points[7].kappa_W[1].kappa == a.points[0].kappa_W[1].kappa);
  CHECK(a.points[7].kappa_W[2].kappa == a.points[0].kappa_W[2].kappa);
}

TEST_CASE("advise_head: head 0's fused and per-head identities coincide and are computed once") {
  std::mt19937_64 rng(7);
  const Index N = 4, D = 6, d = 3;
  const Mat<double> X = layer_normed(N, D, rng);
  const Mat<double> WQ = randn<double>(D, d, rng, 0.2), WK = randn<double>(D, d, rng, 0.2),
                    WV = randn<double>(D, d, rng, 0.2);
  AdviceOptions o;
  o.lambdas = {0, 1};
  o.placements = {parse_placement("fused"), parse_placement("per_head")};
  const HeadAdvice a = advise_head(X, WQ, WK, WV, {}, HeadPosition{0, 2, 0}, o);
  REQUIRE(a.points.size() == 4);
  CHECK(a.points[3].same_as == 1);
  CHECK(a.points[3].J.kappa == a.points[1].J.kappa);
}

TEST_CASE("advise_head: the predicted onset is the closed form, and the measured one brackets it") {
  std::mt19937_64 rng(3);
  const Index N = 24, D = 16, d = 16;
  const Mat<double> X = layer_normed(N, D, rng);
  const Mat<double> WQ = randn<double>(D, d, rng, 0.02), WK = randn<double>(D, d, rng, 0.02),
                    WV = randn<double>(D, d, rng, 0.02);
  AdviceOptions o;
  o.lambdas = {0, 0.25, 0.5, 1, 2, 4};
  o.placements = {parse_placement("per_head"), parse_placement("per_head:v")};
  // Unoptimised, the dense SVD of these 384 x 768 Jacobians takes minutes; the onsets do not
  // depend on the method.
  if (SC_TEST_SANITIZED) o.jacobian.method = JacobianKappaMethod::Gram;
  const HeadAdvice a = advise_head(X, WQ, WK, WV, {}, HeadPosition{0, 1, 0}, o);
  const double c = 1 / std::sqrt(16.0), v = X.squaredNorm() / static_cast<double>(N * D);
  const double lstar = std::sqrt(std::log(23 / 1e-6) / (c * 16 * v));
  CHECK(a.predicted_onset[0] == doctest::Approx(lstar).epsilon(1e-12));
  CHECK(a.token_variance[0] == doctest::Approx(1.0).epsilon(1e-12));  // LayerNorm'd
  CHECK(std::isnan(a.predicted_onset[1]));  // V alone: the λ² law does not apply
  // λ* is about 2.1: saturation is measured somewhere between a half and twice it.
  REQUIRE(std::isfinite(a.measured_onset[0]));
  CHECK(a.measured_onset[0] >= lstar / 2);
  CHECK(a.measured_onset[0] <= 2 * lstar);
  CHECK(std::isnan(a.measured_onset[1]));  // V alone never changes P
  // Only small λ is safe: the recommendation is below the onset, with the reason in words.
  CHECK(a.best.found);
  CHECK(a.best.lambda < a.measured_onset[0]);
  CHECK(a.best.reason.find("kappa(J)") != std::string::npos);
  for (const AdvicePoint& p : a.points)
    if (p.diagnostics.pattern.saturated_fraction > 0.01) {
      CHECK_FALSE(p.admissible);
      CHECK(p.reason.find("saturated") == 0);
    }
}

TEST_CASE("advise_head: a head saturated at every lambda gets no recommendation, with the reason") {
  std::mt19937_64 rng(5);
  const Index N = 8, D = 8, d = 8;
  const Mat<double> X = layer_normed(N, D, rng);
  // W_Q = W_K = 6 I: self-logits near 36 · 8 / sqrt(8), far above ln(7 / 1e-6) ≈ 16.
  const Mat<double> W = 6 * Mat<double>::Identity(D, d);
  const Mat<double> WV = randn<double>(D, d, rng, 0.3);
  AdviceOptions o;
  o.lambdas = {0, 1, 2};
  o.placements = {parse_placement("fused")};
  const HeadAdvice a = advise_head(X, W, W, WV, {}, HeadPosition{0, 1, 0}, o);
  CHECK_FALSE(a.best.found);
  CHECK(a.best.reason.find("none") == 0);
  CHECK(a.best.reason.find("saturated") != std::string::npos);
  for (const AdvicePoint& p : a.points) CHECK_FALSE(p.admissible);
}

TEST_CASE(
    "advise_head: a grid without lambda = 0 still computes the reference, not as a candidate") {
  std::mt19937_64 rng(9);
  const Index N = 4, D = 6, d = 3;
  const Mat<double> X = layer_normed(N, D, rng);
  const Mat<double> WQ = randn<double>(D, d, rng, 0.2), WK = randn<double>(D, d, rng, 0.2),
                    WV = randn<double>(D, d, rng, 0.2);
  AdviceOptions o;
  o.lambdas = {1, 0.5, 1};  // unsorted, repeated: sorted and made unique
  o.placements = {parse_placement("per_head")};
  const HeadAdvice a = advise_head(X, WQ, WK, WV, {}, HeadPosition{0, 1, 0}, o);
  REQUIRE(a.points.size() == 3);
  CHECK(a.points[0].placement == "none");
  CHECK_FALSE(a.points[0].admissible);
  CHECK(a.points[1].lambda == 0.5);
  CHECK(a.points[2].lambda == 1);
  CHECK((a.best.found && a.best.lambda > 0));
}

TEST_CASE("advise_head: bad grids and criteria are refused naming the argument") {
  std::mt19937_64 rng(1);
  const Mat<double> X = layer_normed(4, 4, rng), W = randn<double>(4, 2, rng);
  auto refused = [&](AdviceOptions o, const char* what) {
    INFO(what);
    try {
      (void)advise_head(X, W, W, W, {}, HeadPosition{}, o);
      FAIL("accepted");
    } catch (const std::invalid_argument& e) {
      CHECK(std::string(e.what()).find(what) != std::string::npos);
    }
  };
  AdviceOptions o;
  o.lambdas = {};
  refused(o, "lambdas");
  o.lambdas = {1, -1};
  refused(o, "lambdas");
  o.lambdas = {std::nan("")};
  refused(o, "lambdas");
  o.lambdas = {std::numeric_limits<double>::infinity()};
  refused(o, "lambdas");
  o = {};
  o.placements = {};
  refused(o, "placements");
  o = {};
  o.max_saturated_fraction = 2;
  refused(o, "max_saturated_fraction");
  o = {};
  try {
    (void)advise_head(X, W, W, W, {}, HeadPosition{3, 2, 0}, o);
    FAIL("accepted");
  } catch (const std::invalid_argument& e) {
    CHECK(std::string(e.what()).find("position") != std::string::npos);
  }
}

TEST_CASE("recommend: the median over heads, admissible in every head") {
  std::mt19937_64 rng(11);
  const Index N = 6, D = 8, d = 4, heads = 2;
  const Mat<double> X = layer_normed(N, D, rng);
  AdviceOptions o;
  o.lambdas = {0, 0.5, 1};
  o.placements = {parse_placement("fused")};
  std::vector<HeadAdvice> advice;
  for (Index h = 0; h < heads; ++h) {
    const Mat<double> WQ = randn<double>(D, d, rng, 0.1), WK = randn<double>(D, d, rng, 0.1),
                      WV = randn<double>(D, d, rng, 0.1);
    advice.push_back(advise_head(X, WQ, WK, WV, {}, HeadPosition{h, heads, 0}, o));
  }
  const AdviceChoice c = recommend({&advice[0], &advice[1]});
  REQUIRE(c.found);
  // The chosen point's median is the least among the points admissible in both heads.
  for (std::size_t i = 0; i < advice[0].points.size(); ++i) {
    if (!(advice[0].points[i].admissible && advice[1].points[i].admissible)) continue;
    const double med = 0.5 * (advice[0].points[i].J.kappa + advice[1].points[i].J.kappa);
    CHECK(c.kappa_J <= med * (1 + 1e-15));
  }
  CHECK(c.reason.find("median") != std::string::npos);
  // Different grids are refused.
  AdviceOptions o2 = o;
  o2.lambdas = {0, 2};
  const Mat<double> W = randn<double>(D, d, rng, 0.1);
  const HeadAdvice other = advise_head(X, W, W, W, {}, HeadPosition{0, 2, 0}, o2);
  CHECK_THROWS_AS(recommend({&advice[0], &other}), std::invalid_argument);
}

TEST_CASE("advise_head: a decoder head (causal mask, grouped-query position) against JacobiSVD") {
  std::mt19937_64 rng(13);
  const Index N = 6, D = 8, d = 2;
  const Mat<double> X = layer_normed(N, D, rng);
  const Mat<double> WQ = randn<double>(D, d, rng, 0.3), WK = randn<double>(D, d, rng, 0.3),
                    WV = randn<double>(D, d, rng, 0.3);
  AttentionOptions<double> opts;
  opts.mask = MaskKind::Causal;
  const HeadPosition pos{3, 4, 2};  // query head 3 reads key/value group 1
  AdviceOptions o;
  o.lambdas = {0, 0.5, 2};
  o.placements = {parse_placement("fused"), parse_placement("per_head:qk")};
  const HeadAdvice a = advise_head(X, WQ, WK, WV, opts, pos, o);
  for (const AdvicePoint& p : a.points) {
    INFO(p.placement << " " << p.lambda);
    const CorrectionPlacement pl = parse_placement(p.placement);
    const auto w = corrected_head_weights(WQ, WK, WV, pl, pos, p.lambda);
    // Fused: Q's slice at rows 3 d, K's and V's (group 1) at rows d.
    if (pl.layout == Placement::Fused && p.lambda > 0) {
      CHECK(w[0](3 * d, 0) == WQ(3 * d, 0) + p.lambda);
      CHECK(w[1](d, 0) == WK(d, 0) + p.lambda);
    }
    const double ref = jacobi_kappa(attention_jacobian(X, w[0], w[1], w[2], opts));
    REQUIRE((p.J.info == Info::Success || p.J.info == Info::Singular));
    CHECK(std::abs(p.J.kappa - ref) <= std::max(p.J.accuracy, 1e3 * eps() * ref) * ref);
    CHECK_FALSE(std::isnan(p.J.kappa));
    CHECK(p.diagnostics.pattern.forced == 1);  // row 0 has one key under the mask
  }
}
