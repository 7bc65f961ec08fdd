// The assembled Jacobian (MATH.md §3) and the multi-head layer Jacobian (§8): every column
// against central finite differences of the forward pass, J against the JVP on basis vectors,
// J^T against the VJP, and the known structure (rank of J_Q, gauge null space of §4).
#include <spectral_cond/jacobian/jacobian.hpp>
#include <spectral_cond/jacobian/multihead_jacobian.hpp>
#include <spectral_cond/testing/finite_diff.hpp>

#include <Eigen/SVD>

#include "support/test_helpers.hpp"

using namespace spectral_cond;
using sc_test::randn;
using sc_test::rel_err;

namespace {

template <typename Scalar>
struct Problem {
  Mat<Scalar> X, WQ, WK, WV;
  AttentionOptions<Scalar> opts;
};

template <typename Scalar>
Problem<Scalar> make_problem(Index N, Index D, Index dk, Index dv, std::uint64_t seed,
                             MaskKind mask = MaskKind::None, bool unit_scale = false) {
  std::mt19937_64 rng(seed);
  Problem<Scalar> p;
  p.X = randn<Scalar>(N, D, rng);
  const double ws = 1.0 / std::sqrt(static_cast<double>(D));
  p.WQ = randn<Scalar>(D, dk, rng, 2 * ws);
  p.WK = randn<Scalar>(D, dk, rng, 2 * ws);
  p.WV = randn<Scalar>(D, dv, rng, ws);
  p.opts.mask = mask;
  if (unit_scale) p.opts.scale = Scalar(1);
  if (mask == MaskKind::Additive) {  // a random pattern of -inf with the diagonal kept
    p.opts.additive_mask = randn<Scalar>(N, N, rng);
    for (Index i = 0; i < N; ++i)
      for (Index j = 0; j < N; ++j)
        if (i != j && p.opts.additive_mask(i, j) > Scalar(0.8))
          p.opts.additive_mask(i, j) = -std::numeric_limits<Scalar>::infinity();
  }
  return p;
}

/// Central-difference Jacobian of A with respect to one input (0: W_Q, 1: W_K, 2: W_V, 3: X).
template <typename Scalar>
Mat<Scalar> fd_jacobian(const Problem<Scalar>& p, int which) {
  auto fwd = [&](const Mat<Scalar>& x, const Mat<Scalar>& q, const Mat<Scalar>& k,
                 const Mat<Scalar>& v) { return attention(x, q, k, v, p.opts); };
  switch (which) {
    case 0:
      return numerical_jacobian<Scalar>(
          [&](const Mat<Scalar>& w) { return fwd(p.X, w, p.WK, p.WV); }, p.WQ);
    case 1:
      return numerical_jacobian<Scalar>(
          [&](const Mat<Scalar>& w) { return fwd(p.X, p.WQ, w, p.WV); }, p.WK);
    case 2:
      return numerical_jacobian<Scalar>(
          [&](const Mat<Scalar>& w) { return fwd(p.X, p.WQ, p.WK, w); }, p.WV);
    default:
      return numerical_jacobian<Scalar>(
          [&](const Mat<Scalar>& x) { return fwd(x, p.WQ, p.WK, p.WV); }, p.X);
  }
}

/// Worst relative error over columns, each column measured against max(|column|, floor · max|J|)
/// so that a wrong small column is not hidden by a large one.
template <typename Scalar>
double worst_column_error(const Mat<Scalar>& J, const Mat<Scalar>& ref, double floor) {
  const double big = static_cast<double>(ref.cwiseAbs().maxCoeff());
  double worst = 0;
  for (Index j = 0; j < J.cols(); ++j) {
    const double den = std::max(static_cast<double>(ref.col(j).cwiseAbs().maxCoeff()), floor * big);
    const double num = static_cast<double>((J.col(j) - ref.col(j)).cwiseAbs().maxCoeff());
    worst = std::max(worst, num / std::max(den, 1e-300));
  }
  return worst;
}

struct Case {
  Index N, D, dk, dv;
  MaskKind mask;
  bool unit_scale;
};

const Case kCases[] = {
    {5, 3, 2, 3, MaskKind::None, false},      // N > D
    {3, 6, 4, 2, MaskKind::None, true},       // N < D, c = 1
    {4, 4, 3, 3, MaskKind::Causal, false},    // causal, c = 1/sqrt(d_k)
    {6, 3, 2, 2, MaskKind::Causal, true},     // causal, c = 1
    {5, 4, 2, 3, MaskKind::Additive, false},  // additive mask
    {1, 3, 2, 2, MaskKind::None, false},      // N = 1: J_Q = J_K = 0
};

}  // namespace

TEST_CASE_TEMPLATE("every column of J_Q, J_K, J_V, J_X matches central differences", Scalar, double,
                   float) {
  // Central differences carry error ~ eps^(2/3) times the third derivative, which logits of
  // size ~3 (c = 1) make large in float: tolerances in units of sqrt(eps) there (as in
  // test_attention); double is the tight check.
  const bool dbl = std::is_same<Scalar, double>::value;
  const double tol = dbl ? 1e-7 : 100 * std::sqrt(sc_test::eps<float>());
  std::uint64_t case_no = 0;
  for (const Case& c : kCases) {
    const std::uint64_t seed = 2024 + case_no++;
    INFO("seed=" << seed << " N=" << c.N << " D=" << c.D << " dk=" << c.dk << " dv=" << c.dv
                 << " mask=" << std::string(to_string(c.mask)) << " c=1:" << c.unit_scale);
    const auto p = make_problem<Scalar>(c.N, c.D, c.dk, c.dv, seed, c.mask, c.unit_scale);
    const JacobianBlock blocks[] = {JacobianBlock::Q, JacobianBlock::K, JacobianBlock::V,
                                    JacobianBlock::X};
    Mat<Scalar> parts[3];
    for (int w = 0; w < 4; ++w) {
      INFO("block " << std::string(to_string(blocks[w])));
      const Mat<Scalar> J = attention_jacobian(p.X, p.WQ, p.WK, p.WV, p.opts, blocks[w]);
      CHECK(J.rows() == jacobian_rows(c.N, c.dv));
      CHECK(J.cols() == jacobian_cols(blocks[w], c.N, c.D, c.dk, c.dv));
      const Mat<Scalar> fd = fd_jacobian(p, w);
      if (fd.cwiseAbs().maxCoeff() == Scalar(0)) {
        CHECK(J.cwiseAbs().maxCoeff() <= Scalar(10) * ScalarTraits<Scalar>::eps());
      } else {
        CHECK(worst_column_error(J, fd, 1e-2) < tol);
      }
      if (w < 3) parts[w] = J;
    }
    // All = [J_Q | J_K | J_V], bit for bit.
    const Mat<Scalar> J = attention_jacobian(p.X, p.WQ, p.WK, p.WV, p.opts);
    const Index qk = c.D * c.dk;
    CHECK(J.leftCols(qk) == parts[0]);
    CHECK(J.middleCols(qk, qk) == parts[1]);
    CHECK(J.rightCols(c.D * c.dv) == parts[2]);
  }
}

TEST_CASE_TEMPLATE("J equals the JVP on basis vectors and J^T the VJP", Scalar, double, float) {
  const double tol = 200 * sc_test::eps<Scalar>();
  std::uint64_t case_no = 0;
  for (const Case& c : kCases) {
    const std::uint64_t seed = 77 + case_no++;
    INFO("seed=" << seed << " N=" << c.N << " D=" << c.D
                 << " mask=" << std::string(to_string(c.mask)));
    const auto p = make_problem<Scalar>(c.N, c.D, c.dk, c.dv, seed, c.mask, c.unit_scale);
    const auto cache = attention_forward(p.X, p.WQ, p.WK, p.WV, p.opts);
    for (const JacobianBlock b : {JacobianBlock::All, JacobianBlock::X}) {
      INFO("block " << std::string(to_string(b)));
      const Mat<Scalar> J = attention_jacobian(p.X, p.WQ, p.WK, p.WV, p.opts, b);
      Mat<Scalar> byJvp(J.rows(), J.cols()), byVjp(J.rows(), J.cols());
      const Index sizes[4] = {p.WQ.size(), p.WK.size(), p.WV.size(), p.X.size()};
      for (Index k = 0; k < J.cols(); ++k) {
        AttentionTangents<Scalar> t;
        Index kk = k;
        if (b == JacobianBlock::X) {
          t.dX = Mat<Scalar>::Zero(c.N, c.D);
          t.dX.data()[kk] = Scalar(1);
        } else if (kk < sizes[0]) {
          t.dWQ = Mat<Scalar>::Zero(c.D, c.dk);
          t.dWQ.data()[kk] = Scalar(1);
        } else if ((kk -= sizes[0]) < sizes[1]) {
          t.dWK = Mat<Scalar>::Zero(c.D, c.dk);
          t.dWK.data()[kk] = Scalar(1);
        } else {
          kk -= sizes[1];
          t.dWV = Mat<Scalar>::Zero(c.D, c.dv);
          t.dWV.data()[kk] = Scalar(1);
        }
        const Mat<Scalar> dA = attention_jvp<Scalar>(p.X, p.WQ, p.WK, p.WV, cache, t);
        byJvp.col(k) = Eigen::Map<const Vec<Scalar>>(dA.data(), dA.size());
      }
      for (Index r = 0; r < J.rows(); ++r) {
        Mat<Scalar> G = Mat<Scalar>::Zero(c.N, c.dv);
        G.data()[r] = Scalar(1);
        const auto g = attention_vjp<Scalar>(p.X, p.WQ, p.WK, p.WV, cache, G);
        if (b == JacobianBlock::X) {
          byVjp.row(r) = Eigen::Map<const Vec<Scalar>>(g.dX.data(), g.dX.size()).transpose();
        } else {
          Vec<Scalar> row(J.cols());
          row << Eigen::Map<const Vec<Scalar>>(g.dWQ.data(), g.dWQ.size()),
              Eigen::Map<const Vec<Scalar>>(g.dWK.data(), g.dWK.size()),
              Eigen::Map<const Vec<Scalar>>(g.dWV.data(), g.dWV.size());
          byVjp.row(r) = row.transpose();
        }
      }
      CHECK(rel_err(J, byJvp) < tol);
      CHECK(rel_err(J, byVjp) < tol);
    }
  }
}

TEST_CASE("rank(J_Q) = N min(N - 1, d_v): every softmax row Jacobian annihilates 1") {
  // Unsaturated softmax (small logits): with P near one-hot, B_b = P (k_b ∘ V) - (P k_b) ∘ A is a
  // difference of O(|k| |V|) terms whose true value is O(min P_ij), so its rounding error sits
  // far above eps σ_1(J_Q) and the standard rank rule would count noise.
  const struct { Index N, D, dk, dv; } cases[] = {{3, 6, 4, 4}, {4, 5, 5, 5}, {2, 4, 3, 5}};
  for (std::uint64_t k = 0; k < 3; ++k) {
    const auto& c = cases[k];
    const std::uint64_t seed = 11 + k;
    INFO("seed=" << seed << " N=" << c.N << " D=" << c.D << " dk=" << c.dk << " dv=" << c.dv);
    auto p = make_problem<double>(c.N, c.D, c.dk, c.dv, seed);
    p.WQ *= 0.5;
    p.WK *= 0.5;
    const Mat<double> JQ = attention_jacobian(p.X, p.WQ, p.WK, p.WV, p.opts, JacobianBlock::Q);
    const Eigen::JacobiSVD<Mat<double>> svd(JQ);
    const auto& s = svd.singularValues();
    const double tol =
        static_cast<double>(std::max(JQ.rows(), JQ.cols())) * sc_test::eps<double>() * s(0);
    Index rank = 0;
    while (rank < s.size() && s(rank) > tol) ++rank;
    const Index bound = c.N * std::min(c.N - 1, c.dv);
    INFO("rank=" << rank << " bound=" << bound << " min(m, n)=" << s.size());
    CHECK(bound < s.size());  // the bound is a real restriction at these sizes
    CHECK(rank <= bound);
    CHECK(rank == bound);  // and generic data attains it
  }
}

TEST_CASE_TEMPLATE("gauge directions (W_Q E, -W_K E^T, 0) are in the null space of J", Scalar,
                   double, float) {
  // Tall: N d_v = 36 > 2 D d_k + D d_v = 14, and a wide case (the identity holds for every J).
  const struct { Index N, D, dk, dv; } cases[] = {{12, 2, 2, 3}, {4, 5, 3, 2}};
  std::uint64_t case_no = 0;
  for (const auto& c : cases) {
    const std::uint64_t seed = 5 + case_no++;
    INFO("seed=" << seed << " N=" << c.N << " D=" << c.D << " dk=" << c.dk << " dv=" << c.dv);
    const auto p = make_problem<Scalar>(c.N, c.D, c.dk, c.dv, seed, MaskKind::Causal);
    std::mt19937_64 rng(seed + 100);
    const Mat<Scalar> J = attention_jacobian(p.X, p.WQ, p.WK, p.WV, p.opts);
    const Eigen::JacobiSVD<Mat<Scalar>> svd(J);
    const double s1 = static_cast<double>(svd.singularValues()(0));
    for (int trial = 0; trial < 3; ++trial) {
      const Mat<Scalar> E = randn<Scalar>(c.dk, c.dk, rng);
      Vec<Scalar> t = Vec<Scalar>::Zero(J.cols());
      const Mat<Scalar> tq = p.WQ * E, tk = -(p.WK * E.transpose());
      t.head(tq.size()) = Eigen::Map<const Vec<Scalar>>(tq.data(), tq.size());
      t.segment(tq.size(), tk.size()) = Eigen::Map<const Vec<Scalar>>(tk.data(), tk.size());
      const double ratio = static_cast<double>((J * t).norm() / t.norm()) / s1;
      INFO("||J t|| / (||t|| sigma_1) = " << ratio);
      CHECK(ratio < 100 * sc_test::eps<Scalar>());
      // A random direction is not in the null space.
      const Vec<Scalar> u = randn<Scalar>(J.cols(), 1, rng);
      CHECK(static_cast<double>((J * u).norm() / u.norm()) / s1 > 1e-3);
    }
    if (J.rows() > J.cols()) {  // tall: kappa(J) = +inf, the gauge gives sigma_min = 0
      const auto& s = svd.singularValues();
      CHECK(static_cast<double>(s(s.size() - 1)) / s1 < 100 * sc_test::eps<Scalar>());
    }
  }
}

TEST_CASE("the out-parameter form writes into a block of caller storage and checks shapes") {
  const auto p = make_problem<double>(4, 3, 2, 3, 31);
  const Mat<double> J = attention_jacobian(p.X, p.WQ, p.WK, p.WV, p.opts);
  Mat<double> big = Mat<double>::Constant(J.rows() + 3, J.cols() + 5, 7.0);
  attention_jacobian<double>(p.X, p.WQ, p.WK, p.WV, p.opts, JacobianBlock::All,
                             big.block(1, 2, J.rows(), J.cols()));
  CHECK(big.block(1, 2, J.rows(), J.cols()) == J);
  CHECK((big.row(0).array() == 7.0).all());
  CHECK((big.col(1).array() == 7.0).all());
  std::vector<double> buf(static_cast<size_t>(J.size()));  // a Map, as over a mapped file
  attention_jacobian<double>(p.X, p.WQ, p.WK, p.WV, p.opts, JacobianBlock::All,
                             Eigen::Map<Mat<double>>(buf.data(), J.rows(), J.cols()));
  CHECK(Eigen::Map<Mat<double>>(buf.data(), J.rows(), J.cols()) == J);
  Mat<double> bad(J.rows(), J.cols() - 1);
  CHECK_THROWS_WITH_AS(
      attention_jacobian<double>(p.X, p.WQ, p.WK, p.WV, p.opts, JacobianBlock::All, bad),
      "attention_jacobian: out must be jacobian_rows x jacobian_cols = 12 x 21 "
      "(got 12 x 20)",
      std::invalid_argument);
  CHECK(std::string(to_string(JacobianBlock::X)) == "X");
  CHECK(jacobian_cols(JacobianBlock::All, 4, 3, 2, 3) == 21);
  CHECK(jacobian_cols(JacobianBlock::X, 4, 3, 2, 3) == 12);
}

// ---- multi-head layer (MATH.md §8) ----

TEST_CASE_TEMPLATE("layer Jacobian: per-head blocks at the right place, and finite differences",
                   Scalar, double, float) {
  const Index N = 4, D = 5, h = 4, hkv = 2, dk = 2, dv = 3;  // grouped-query: 2 heads per group
  const std::uint64_t seed = 99;
  INFO("seed=" << seed);
  std::mt19937_64 rng(seed);
  const Mat<Scalar> X = randn<Scalar>(N, D, rng);
  const Mat<Scalar> WQ = randn<Scalar>(D, h * dk, rng, 0.8),
                    WK = randn<Scalar>(D, hkv * dk, rng, 0.8);
  const Mat<Scalar> WV = randn<Scalar>(D, hkv * dv, rng, 0.5);
  MultiHeadOptions<Scalar> mo;
  mo.heads = h;
  mo.kv_heads = hkv;
  mo.mask = MaskKind::Causal;
  const Mat<Scalar> J = multihead_jacobian<Scalar>(X, WQ, WK, WV, mo);
  const Index R = N * dv, cq = D * h * dk, ck = D * hkv * dk;
  REQUIRE(J.rows() == N * h * dv);
  REQUIRE(J.cols() == cq + ck + D * hkv * dv);

  // Block placement: head j's J at its row band, zeros elsewhere.
  Mat<Scalar> expect = Mat<Scalar>::Zero(J.rows(), J.cols());
  for (Index j = 0; j < h; ++j) {
    const Index g = j / (h / hkv);
    const Mat<Scalar> Jh = multihead_jacobian_head<Scalar>(X, WQ, WK, WV, mo, j);
    const Mat<Scalar> ref = attention_jacobian(
        X, WQ.middleCols(j * dk, dk).eval(), WK.middleCols(g * dk, dk).eval(),
        WV.middleCols(g * dv, dv).eval(), static_cast<const AttentionOptions<Scalar>&>(mo));
    CHECK(Jh == ref);
    expect.block(j * R, j * D * dk, R, D * dk) = Jh.leftCols(D * dk);
    expect.block(j * R, cq + g * D * dk, R, D * dk) = Jh.middleCols(D * dk, D * dk);
    expect.block(j * R, cq + ck + g * D * dv, R, D * dv) = Jh.rightCols(D * dv);
  }
  CHECK(J == expect);

  // Finite differences of multihead_forward with respect to the fused weights and X.
  auto fwd = [&](const Mat<Scalar>& x, const Mat<Scalar>& q, const Mat<Scalar>& k,
                 const Mat<Scalar>& v) { return multihead_forward(x, q, k, v, mo).A; };
  Mat<Scalar> fd(J.rows(), J.cols());
  fd << numerical_jacobian<Scalar>([&](const Mat<Scalar>& w) { return fwd(X, w, WK, WV); }, WQ),
      numerical_jacobian<Scalar>([&](const Mat<Scalar>& w) { return fwd(X, WQ, w, WV); }, WK),
      numerical_jacobian<Scalar>([&](const Mat<Scalar>& w) { return fwd(X, WQ, WK, w); }, WV);
  const bool dbl = std::is_same<Scalar, double>::value;
  const double tol = dbl ? 1e-7 : 100 * std::sqrt(sc_test::eps<float>());
  CHECK(worst_column_error(J, fd, 1e-2) < tol);
  const Mat<Scalar> JX = multihead_jacobian<Scalar>(X, WQ, WK, WV, mo, JacobianBlock::X);
  const Mat<Scalar> fdX =
      numerical_jacobian<Scalar>([&](const Mat<Scalar>& x) { return fwd(x, WQ, WK, WV); }, X);
  CHECK(worst_column_error(JX, fdX, 1e-2) < tol);
  // Single blocks are the corresponding column ranges of All.
  CHECK(multihead_jacobian<Scalar>(X, WQ, WK, WV, mo, JacobianBlock::K) == J.middleCols(cq, ck));
  CHECK(multihead_jacobian<Scalar>(X, WQ, WK, WV, mo, JacobianBlock::V) ==
        J.rightCols(D * hkv * dv));
  CHECK_THROWS_AS(multihead_jacobian_head<Scalar>(X, WQ, WK, WV, mo, h), std::invalid_argument);
}
