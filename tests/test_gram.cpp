// The Gram matrices without J (MATH.md §3): the structured J J^T and J^T J of every block
// against products of the assembled Jacobian, which itself is checked against finite
// differences in test_jacobian.
#include <spectral_cond/jacobian/gram.hpp>

#include <Eigen/Eigenvalues>
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
                             MaskKind mask, bool unit_scale) {
  std::mt19937_64 rng(seed);
  Problem<Scalar> p;
  p.X = randn<Scalar>(N, D, rng);
  const double ws = 1.0 / std::sqrt(static_cast<double>(D));
  p.WQ = randn<Scalar>(D, dk, rng, ws);
  p.WK = randn<Scalar>(D, dk, rng, ws);
  p.WV = randn<Scalar>(D, dv, rng, ws);
  p.opts.mask = mask;
  if (unit_scale) p.opts.scale = Scalar(1);
  return p;
}

struct Case {
  Index N, D, dk, dv;
  MaskKind mask;
  bool unit_scale;
};

const Case kCases[] = {
    {4, 7, 3, 2, MaskKind::None, false},    // N < D, wide J
    {9, 3, 2, 3, MaskKind::None, true},     // N > D, tall J (27 > 21), c = 1
    {5, 5, 4, 3, MaskKind::Causal, false},  // causal
    {6, 4, 2, 4, MaskKind::Causal, true},   // causal, c = 1
    {1, 3, 2, 2, MaskKind::None, false},    // N = 1
};

const JacobianBlock kBlocks[] = {JacobianBlock::All, JacobianBlock::Q, JacobianBlock::K,
                                 JacobianBlock::V, JacobianBlock::X};

}  // namespace

TEST_CASE_TEMPLATE("structured J J^T and J^T J equal the products of the assembled J", Scalar,
                   double, float) {
  const double tol = 100 * sc_test::eps<Scalar>();  // 2e-14 in double
  std::uint64_t case_no = 0;
  for (const Case& c : kCases) {
    const std::uint64_t seed = 500 + case_no++;
    const auto p = make_problem<Scalar>(c.N, c.D, c.dk, c.dv, seed, c.mask, c.unit_scale);
    for (const JacobianBlock b : kBlocks) {
      INFO("seed=" << seed << " N=" << c.N << " D=" << c.D << " dk=" << c.dk << " dv=" << c.dv
                   << " mask=" << std::string(to_string(c.mask)) << " c=1:" << c.unit_scale
                   << " block=" << std::string(to_string(b)));
      const Mat<Scalar> J = attention_jacobian(p.X, p.WQ, p.WK, p.WV, p.opts, b);
      const Mat<Scalar> JJt = J * J.transpose(), JtJ = J.transpose() * J;
      const Mat<Scalar> G = attention_gram(p.X, p.WQ, p.WK, p.WV, p.opts, b);
      const Mat<Scalar> H = attention_normal(p.X, p.WQ, p.WK, p.WV, p.opts, b);
      REQUIRE(G.rows() == J.rows());
      REQUIRE(H.rows() == J.cols());
      if (JJt.cwiseAbs().maxCoeff() == Scalar(0)) {  // N = 1: J_Q = J_K = 0
        CHECK(G.cwiseAbs().maxCoeff() <= Scalar(10) * ScalarTraits<Scalar>::eps());
        CHECK(H.cwiseAbs().maxCoeff() <= Scalar(10) * ScalarTraits<Scalar>::eps());
        continue;
      }
      CHECK(rel_err(G, JJt) < tol);
      CHECK(rel_err(H, JtJ) < tol);
      CHECK(rel_err(G, G.transpose().eval()) == 0.0);  // symmetric by construction
    }
  }
}

TEST_CASE("the eigenvalues of G are the squared singular values of J") {
  const auto p = make_problem<double>(5, 6, 3, 2, 42, MaskKind::None, false);
  const Mat<double> J = attention_jacobian(p.X, p.WQ, p.WK, p.WV, p.opts);
  const Mat<double> G = attention_gram(p.X, p.WQ, p.WK, p.WV, p.opts);
  const Eigen::SelfAdjointEigenSolver<Mat<double>> eig(G);
  const Eigen::JacobiSVD<Mat<double>> svd(J);
  const Vec<double> s2 = svd.singularValues().array().square();
  const Vec<double> ev = eig.eigenvalues().reverse();  // descending
  CHECK(rel_err(ev, s2) < 1e-13);
}

TEST_CASE("the out-parameter forms write into caller storage and check shapes") {
  const auto p = make_problem<double>(3, 4, 2, 2, 8, MaskKind::Causal, false);
  const Mat<double> G = attention_gram(p.X, p.WQ, p.WK, p.WV, p.opts);
  Mat<double> big = Mat<double>::Constant(10, 9, -1.0);
  attention_gram<double>(p.X, p.WQ, p.WK, p.WV, p.opts, JacobianBlock::All, big.block(2, 1, 6, 6));
  CHECK(big.block(2, 1, 6, 6) == G);
  CHECK((big.col(0).array() == -1.0).all());
  Mat<double> bad(6, 5);
  CHECK_THROWS_WITH_AS(
      attention_gram<double>(p.X, p.WQ, p.WK, p.WV, p.opts, JacobianBlock::All, bad),
      "attention_gram: out must be N d_v x N d_v = 6 x 6 (got 6 x 5)", std::invalid_argument);
  Mat<double> badH(5, 5);
  CHECK_THROWS_WITH_AS(
      attention_normal<double>(p.X, p.WQ, p.WK, p.WV, p.opts, JacobianBlock::V, badH),
      "attention_normal: out must be cols x cols = 8 x 8 (got 5 x 5)", std::invalid_argument);
}
