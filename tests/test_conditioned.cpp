// Spectrally conditioned attention (paper §3, MATH.md §6–7): forward equals attention at W + C,
// the VJP and JVP match central differences with respect to W (C fixed), fold-in, refresh.
#include <spectral_cond/conditioning/conditioned.hpp>
#include <spectral_cond/testing/finite_diff.hpp>

#include "support/test_helpers.hpp"

#include <array>

using namespace spectral_cond;
using sc_test::randn;
using sc_test::rel_err;

namespace {

struct Layer {
  Index N, D, heads, kv_heads, dk, dv;
};

template <typename Scalar>
struct Weights {
  Mat<Scalar> X, WQ, WK, WV;
};

template <typename Scalar>
Weights<Scalar> make_weights(const Layer& L, std::mt19937_64& rng) {
  const double ws = 1.0 / std::sqrt(static_cast<double>(L.D));
  return {randn<Scalar>(L.N, L.D, rng), randn<Scalar>(L.D, L.heads * L.dk, rng, ws),
          randn<Scalar>(L.D, L.kv_heads * L.dk, rng, ws),
          randn<Scalar>(L.D, L.kv_heads * L.dv, rng, ws)};
}

template <typename Scalar>
MultiHeadOptions<Scalar> options(const Layer& L) {
  MultiHeadOptions<Scalar> o;
  o.heads = L.heads;
  o.kv_heads = L.kv_heads;
  return o;
}

/// The correction built independently of the layer, from the public building blocks.
template <typename Scalar>
Mat<Scalar> expected_correction(const Correction<Scalar>& c, const Mat<Scalar>& W, Index blocks) {
  const Index d = W.cols() / blocks;
  switch (c.kind) {
    case CorrectionKind::None:
      return Mat<Scalar>::Zero(W.rows(), W.cols());
    case CorrectionKind::Lambda:
      return c.lambda * lambda_identity<Scalar>(W.rows(), blocks, d, c.placement);
    case CorrectionKind::Exact:
      break;
  }
  Mat<Scalar> C(W.rows(), W.cols());
  for (Index j = 0; j < blocks; ++j)
    C.middleCols(j * d, d) = exact_correction(Mat<Scalar>(W.middleCols(j * d, d)), c.target).C;
  return C;
}

std::vector<ConditioningSpec<double>> specs() {
  using C = Correction<double>;
  return {ConditioningSpec<double>::shared(C::with_lambda(10.0)),
          ConditioningSpec<double>::shared(C::with_lambda(2.0, Placement::PerHead)),
          ConditioningSpec<double>::shared(C::with_exact()),
          {C::none(), C::with_exact(3.0), C::with_lambda(1.0, Placement::PerHead)}};
}

const Layer kLayers[] = {
    {5, 4, 1, 1, 3, 3},  // single head
    {4, 6, 2, 2, 3, 2},  // two heads, h d_k = D
    {3, 4, 3, 1, 2, 2},  // grouped-query, h d_k = 6 > D: the fused identity runs out
};

}  // namespace

TEST_CASE("forward equals attention at W + C; fold-in gives the same output") {
  std::uint64_t seed = 6100;
  for (const Layer& L : kLayers) {
    for (const auto& spec : specs()) {
      ++seed;
      INFO("seed=" << seed << " heads=" << L.heads << " kv=" << L.kv_heads
                   << " q=" << to_string(spec.q.kind) << " k=" << to_string(spec.k.kind));
      std::mt19937_64 rng(seed);
      const auto w = make_weights<double>(L, rng);
      const auto opts = options<double>(L);
      ConditionedAttention<double> layer(w.WQ, w.WK, w.WV, spec, opts);
      CHECK(layer.info() == Info::Success);
      const Mat<double> CQ = expected_correction(spec.q, w.WQ, L.heads);
      const Mat<double> CK = expected_correction(spec.k, w.WK, L.kv_heads);
      const Mat<double> CV = expected_correction(spec.v, w.WV, L.kv_heads);
      CHECK(rel_err(layer.C_Q(), CQ) <= 10 * sc_test::eps<double>());
      CHECK(rel_err(layer.C_K(), CK) <= 10 * sc_test::eps<double>());
      CHECK(rel_err(layer.C_V(), CV) <= 10 * sc_test::eps<double>());

      MultiHeadCache<double> cache;
      layer.forward(w.X, w.WQ, w.WK, w.WV, cache);
      const Mat<double> WQc = w.WQ + layer.C_Q(), WKc = w.WK + layer.C_K(),
                        WVc = w.WV + layer.C_V();
      const Mat<double> ref = multihead_forward(w.X, WQc, WKc, WVc, opts).A;
      CHECK(rel_err(cache.A, ref) == 0.0);
      if (L.heads == 1) CHECK(rel_err(cache.A, attention(w.X, WQc, WKc, WVc, opts)) == 0.0);
      // The correction changes the output (so equality above is not vacuous) unless C = 0.
      const Mat<double> plain = multihead_forward(w.X, w.WQ, w.WK, w.WV, opts).A;
      CHECK(rel_err(cache.A, plain) > 1e-6);

      const FoldedWeights<double> f = layer.fold(w.WQ, w.WK, w.WV);
      CHECK(rel_err(multihead_forward(w.X, f.WQ, f.WK, f.WV, opts).A, cache.A) == 0.0);
      // Repeated forwards reuse the buffers and give identical results.
      CHECK(rel_err(layer.attention(w.X, w.WQ, w.WK, w.WV), cache.A) == 0.0);
    }
  }
}

TEST_CASE_TEMPLATE("conditioned VJP and JVP match central differences w.r.t. W (C fixed)", Scalar,
                   double, float) {
  const double tol =
      std::is_same<Scalar, double>::value ? 1e-7 : 300 * std::sqrt(sc_test::eps<float>());
  using C = Correction<Scalar>;
  const ConditioningSpec<Scalar> spec{C::with_exact(), C::with_lambda(Scalar(2)),
                                      C::with_lambda(Scalar(1), Placement::PerHead)};
  std::uint64_t seed = 6200;
  for (const Layer& L : kLayers) {
    ++seed;
    INFO("seed=" << seed << " heads=" << L.heads << " kv=" << L.kv_heads);
    std::mt19937_64 rng(seed);
    auto w = make_weights<Scalar>(L, rng);
    const auto opts = options<Scalar>(L);
    ConditionedAttention<Scalar> layer(w.WQ, w.WK, w.WV, spec, opts);
    MultiHeadCache<Scalar> cache;
    layer.forward(w.X, w.WQ, w.WK, w.WV, cache);
    const Mat<Scalar> G = randn<Scalar>(L.N, L.heads * L.dv, rng);
    const AttentionGradients<Scalar> g = layer.vjp(w.X, w.WQ, w.WK, w.WV, cache, G);

    // The full Jacobian of A w.r.t. each weight by central differences; J^T vec(G) = vec(dL/dW).
    Mat<Scalar>* W[3] = {&w.WQ, &w.WK, &w.WV};
    const Mat<Scalar>* grads[3] = {&g.dWQ, &g.dWK, &g.dWV};
    for (int k = 0; k < 3; ++k) {
      INFO("weight "
           << "QKV"[k]);
      auto f = [&](const Mat<Scalar>& Wk) {
        Mat<Scalar> saved = *W[k];
        *W[k] = Wk;
        const Mat<Scalar> A = layer.attention(w.X, w.WQ, w.WK, w.WV);
        *W[k] = saved;
        return A;
      };
      const Mat<Scalar> J = numerical_jacobian<Scalar>(f, Mat<Scalar>(*W[k]));
      const Vec<Scalar> jtg = J.transpose() * Eigen::Map<const Vec<Scalar>>(G.data(), G.size());
      const Vec<Scalar> vjp = Eigen::Map<const Vec<Scalar>>(grads[k]->data(), grads[k]->size());
      CHECK(rel_err(vjp, jtg) < tol);
      // JVP along a random direction against the same Jacobian.
      const Mat<Scalar> dW = randn<Scalar>(W[k]->rows(), W[k]->cols(), rng);
      AttentionTangents<Scalar> t;
      (k == 0 ? t.dWQ : k == 1 ? t.dWK : t.dWV) = dW;
      const Mat<Scalar> jvp = layer.jvp(w.X, w.WQ, w.WK, w.WV, cache, t);
      const Vec<Scalar> jv = J * Eigen::Map<const Vec<Scalar>>(dW.data(), dW.size());
      CHECK(rel_err(Eigen::Map<const Vec<Scalar>>(jvp.data(), jvp.size()), jv) < tol);
      CHECK(rel_err(jvp, central_difference<Scalar>(f, *W[k], dW)) < tol);
    }
    // dL/dX against a central difference of <G, A>.
    const Mat<Scalar> dX = randn<Scalar>(L.N, L.D, rng);
    auto fx = [&](const Mat<Scalar>& X) { return layer.attention(X, w.WQ, w.WK, w.WV); };
    const Mat<Scalar> fd = central_difference<Scalar>(fx, w.X, dX);
    const double lhs = static_cast<double>((fd.array() * G.array()).sum());
    const double rhs = static_cast<double>((g.dX.array() * dX.array()).sum());
    CHECK(std::abs(lhs - rhs) <= tol * (std::abs(lhs) + std::abs(rhs) + 1e-3));

    // The weight gradient is exactly the core's gradient at W + C.
    const FoldedWeights<Scalar> fw = layer.fold(w.WQ, w.WK, w.WV);
    const auto core_cache = multihead_forward(w.X, fw.WQ, fw.WK, fw.WV, opts);
    const auto core = multihead_vjp<Scalar>(w.X, fw.WQ, fw.WK, fw.WV, opts, core_cache, G);
    CHECK(rel_err(g.dWQ, core.dWQ) == 0.0);
    CHECK(rel_err(g.dWK, core.dWK) == 0.0);
    CHECK(rel_err(g.dWV, core.dWV) == 0.0);
    CHECK(rel_err(g.dX, core.dX) == 0.0);
  }
}

TEST_CASE("refresh recomputes exact corrections from the current weights, and only those") {
  const std::uint64_t seed = 6300;
  INFO("seed=" << seed);
  std::mt19937_64 rng(seed);
  const Layer L{4, 6, 2, 2, 3, 2};
  auto w = make_weights<double>(L, rng);
  using C = Correction<double>;
  const ConditioningSpec<double> spec{C::with_exact(), C::with_exact(1.5), C::with_lambda(10.0)};
  ConditionedAttention<double> layer(w.WQ, w.WK, w.WV, spec, options<double>(L));
  const Mat<double> CQ0 = layer.C_Q(), CK0 = layer.C_K(), CV0 = layer.C_V();
  CHECK(layer.refreshes() == 0);

  // A training step moves the weights; the corrections stay fixed until refresh().
  w.WQ += randn<double>(L.D, L.heads * L.dk, rng, 0.5);
  w.WK += randn<double>(L.D, L.heads * L.dk, rng, 0.5);
  w.WV += randn<double>(L.D, L.heads * L.dv, rng, 0.5);
  MultiHeadCache<double> cache;
  layer.forward(w.X, w.WQ, w.WK, w.WV, cache);
  CHECK(layer.C_Q() == CQ0);

  CHECK(layer.refresh(w.WQ, w.WK, w.WV) == Info::Success);
  CHECK(layer.refreshes() == 1);
  CHECK(rel_err(layer.C_Q(), expected_correction(spec.q, w.WQ, L.heads)) <=
        10 * sc_test::eps<double>());
  CHECK(rel_err(layer.C_K(), expected_correction(spec.k, w.WK, L.heads)) <=
        10 * sc_test::eps<double>());
  CHECK(rel_err(layer.C_Q(), CQ0) > 1e-3);
  CHECK(rel_err(layer.C_K(), CK0) > 1e-3);
  CHECK(layer.C_V() == CV0);  // Lambda: fixed
  // After the refresh every head block of W + C has the theorem's kappa (from an SVD).
  const FoldedWeights<double> f = layer.fold(w.WQ, w.WK, w.WV);
  for (Index j = 0; j < L.heads; ++j) {
    const Mat<double> q = f.WQ.middleCols(j * L.dk, L.dk), k = f.WK.middleCols(j * L.dk, L.dk);
    const ConditionResult<double> kq = kappa(q), kk = kappa(k);
    CHECK(kq.kappa <= 2.0 + 10 * sc_test::eps<double>());
    CHECK(kk.kappa == doctest::Approx(1.5).epsilon(1e-12));
  }
  // NaN weights: the outcome says so and the correction shows it.
  Mat<double> bad = w.WQ;
  bad(0, 0) = std::numeric_limits<double>::quiet_NaN();
  CHECK(layer.refresh(bad, w.WK, w.WV) == Info::InvalidInput);
  CHECK(layer.info() == Info::InvalidInput);
  CHECK(layer.C_Q().leftCols(L.dk).array().isNaN().all());
}

TEST_CASE("argument errors throw, naming the function") {
  std::mt19937_64 rng(6400);
  const Layer L{4, 6, 2, 2, 3, 2};
  const auto w = make_weights<double>(L, rng);
  using C = Correction<double>;
  const auto opts = options<double>(L);
  CHECK_THROWS_WITH_AS(
      ConditionedAttention<double>(w.WQ, w.WK, w.WV,
                                   ConditioningSpec<double>::shared(C::with_lambda(-1.0)), opts),
      doctest::Contains("lambda must be"), std::invalid_argument);
  CHECK_THROWS_AS(ConditionedAttention<double>(
                      w.WQ, w.WK, w.WV, ConditioningSpec<double>::shared(C::with_exact(1.0)), opts),
                  std::invalid_argument);
  ConditionedAttention<double> layer(w.WQ, w.WK, w.WV,
                                     ConditioningSpec<double>::shared(C::with_exact()), opts);
  MultiHeadCache<double> cache;
  CHECK_THROWS_WITH_AS(layer.forward(w.X, w.WQ.leftCols(4), w.WK, w.WV, cache),
                       doctest::Contains("ConditionedAttention::forward: W_Q"),
                       std::invalid_argument);
  CHECK_THROWS_AS(layer.refresh(w.WQ, w.WK, w.WV.leftCols(2)), std::invalid_argument);
  MultiHeadOptions<double> three = opts;
  three.heads = 4;
  CHECK_THROWS_AS(ConditionedAttention<double>(w.WQ, w.WK, w.WV,
                                               ConditioningSpec<double>::shared(C::none()), three),
                  std::invalid_argument);
}

TEST_CASE("packed and subset placements: the rectangular identity of [W_Q | W_K | W_V]") {
  // The packed weight is D x (h d_k + g d_k + g d_v); λ I of that whole matrix, sliced back into
  // the three projections, is the correction each must receive (MATH.md §7, "Placements").
  const Layer layers[] = {
      {4, 6, 2, 2, 3, 2},  // h d_k = D: the identity reaches W_Q alone
      {4, 8, 2, 1, 2, 2},  // grouped-query, widths 4 + 2 + 2 = D: each its own shifted block
      {3, 5, 1, 1, 3, 4},  // widths 3 + 3 + 4 > D: W_K's identity partly, W_V's not at all
  };
  std::mt19937_64 rng(31);
  for (const Layer& L : layers) {
    const Weights<double> w = make_weights<double>(L, rng);
    const Index wq = L.heads * L.dk, wk = L.kv_heads * L.dk, wv = L.kv_heads * L.dv;
    const Mat<double> E = Mat<double>::Identity(L.D, wq + wk + wv);
    const double lambda = 1.5;
    for (const char* name : {"packed", "fused:qk", "per_head:v", "fused:q"}) {
      INFO("layer D " << L.D << ", heads " << L.heads << ", placement " << name);
      const CorrectionPlacement p = parse_placement(name);
      const ConditionedAttention<double> layer(
          w.WQ, w.WK, w.WV, ConditioningSpec<double>::placed(lambda, p), options<double>(L));
      if (p.layout == Placement::Packed) {
        CHECK(layer.C_Q() == lambda * E.leftCols(wq));
        CHECK(layer.C_K() == lambda * E.middleCols(wq, wk));
        CHECK(layer.C_V() == lambda * E.rightCols(wv));
        continue;
      }
      const std::array<const Mat<double>*, 3> C{&layer.C_Q(), &layer.C_K(), &layer.C_V()};
      const std::array<Index, 3> blocks{L.heads, L.kv_heads, L.kv_heads};
      for (int i = 0; i < 3; ++i) {
        const Mat<double>& Ci = *C[static_cast<std::size_t>(i)];
        if (!p.receives(i)) {
          CHECK(Ci.isZero(0));
          continue;
        }
        // Independent of lambda_identity: the identity built entry by entry.
        const Index b = blocks[static_cast<std::size_t>(i)], d = Ci.cols() / b;
        Mat<double> ref = Mat<double>::Zero(L.D, Ci.cols());
        for (Index c = 0; c < Ci.cols(); ++c) {
          const Index r = p.layout == Placement::PerHead ? c % d : c;
          if (r < L.D) ref(r, c) = lambda;
        }
        CHECK(Ci == ref);
      }
    }
  }
}
