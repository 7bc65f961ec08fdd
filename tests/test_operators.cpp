// Matrix-free operators (J, J^T, J J^T, J^T J) against the assembled matrices (MATH.md §3),
// the adjoint identity, and GramOp inside Spectra's SymEigsSolver.
#include <spectral_cond/jacobian/jacobian.hpp>
#include <spectral_cond/jacobian/operators.hpp>

#include <Spectra/SymEigsSolver.h>
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

/// The dense matrix of an operator, one perform_op per basis vector.
template <typename Op>
Mat<typename Op::Scalar> dense(const Op& op) {
  using Scalar = typename Op::Scalar;
  Mat<Scalar> M(op.rows(), op.cols());
  Vec<Scalar> e = Vec<Scalar>::Zero(op.cols());
  for (Index k = 0; k < op.cols(); ++k) {
    e(k) = Scalar(1);
    op.perform_op(e.data(), M.col(k).data());
    e(k) = Scalar(0);
  }
  return M;
}

}  // namespace

TEST_CASE_TEMPLATE("operators equal the dense J, J^T, J J^T, J^T J for every block", Scalar, double,
                   float) {
  const double tol = 200 * sc_test::eps<Scalar>();
  struct Case {
    Index N, D, dk, dv;
    MaskKind mask;
    bool unit_scale;
  };
  const Case cases[] = {{3, 6, 4, 2, MaskKind::None, false},
                        {7, 3, 2, 3, MaskKind::Causal, true},
                        {5, 5, 3, 3, MaskKind::Causal, false}};
  std::uint64_t case_no = 0;
  for (const Case& c : cases) {
    const std::uint64_t seed = 900 + case_no++;
    const auto p = make_problem<Scalar>(c.N, c.D, c.dk, c.dv, seed, c.mask, c.unit_scale);
    for (const JacobianBlock b : {JacobianBlock::All, JacobianBlock::Q, JacobianBlock::K,
                                  JacobianBlock::V, JacobianBlock::X}) {
      INFO("seed=" << seed << " N=" << c.N << " D=" << c.D << " block=" << std::string(to_string(b))
                   << " mask=" << std::string(to_string(c.mask)));
      const Mat<Scalar> J = attention_jacobian(p.X, p.WQ, p.WK, p.WV, p.opts, b);
      const JacobianOp<Scalar> Jop(p.X, p.WQ, p.WK, p.WV, p.opts, b);
      const JacobianTransposeOp<Scalar> JTop(p.X, p.WQ, p.WK, p.WV, p.opts, b);
      const GramOp<Scalar> Gop(p.X, p.WQ, p.WK, p.WV, p.opts, b);
      const NormalOp<Scalar> Nop(p.X, p.WQ, p.WK, p.WV, p.opts, b);
      CHECK(Jop.rows() == J.rows());
      CHECK(Jop.cols() == J.cols());
      CHECK(JTop.rows() == J.cols());
      CHECK(Gop.rows() == J.rows());
      CHECK(Nop.cols() == J.cols());
      CHECK(rel_err(dense(Jop), J) < tol);
      const Mat<Scalar> Jt = J.transpose();
      CHECK(rel_err(dense(JTop), Jt) < tol);
      const Mat<Scalar> JJt = J * Jt, JtJ = Jt * J;
      CHECK(rel_err(dense(Gop), JJt) < tol);
      CHECK(rel_err(dense(Nop), JtJ) < tol);

      // Adjoint identity <J v, w> = <v, J^T w>, through the operators alone.
      std::mt19937_64 rng(seed + 7);
      const Vec<Scalar> v = randn<Scalar>(J.cols(), 1, rng), w = randn<Scalar>(J.rows(), 1, rng);
      Vec<Scalar> Jv(J.rows()), JTw(J.cols());
      Jop.perform_op(v.data(), Jv.data());
      JTop.perform_op(w.data(), JTw.data());
      const double lhs = static_cast<double>(Jv.dot(w)), rhs = static_cast<double>(v.dot(JTw));
      CHECK(std::abs(lhs - rhs) <= tol * (std::abs(lhs) + std::abs(rhs)));
    }
  }
}

TEST_CASE("the operators keep copies: the inputs may change or die after construction") {
  auto p = make_problem<double>(4, 5, 3, 2, 3, MaskKind::None, false);
  const Mat<double> J = attention_jacobian(p.X, p.WQ, p.WK, p.WV, p.opts);
  const JacobianOp<double> op(p.X, p.WQ, p.WK, p.WV, p.opts);
  p.X.setZero();
  p.WQ.setZero();
  CHECK(rel_err(dense(op), J) < 1e-14);
  const Mat<double> bad(4, 5);
  CHECK_THROWS_WITH_AS(GramOp<double>(p.X, bad, p.WK, p.WV),
                       "GramOp: W_Q must be D x d_k = 5 x 5 (got 4 x 5)", std::invalid_argument);
}

TEST_CASE("GramOp in Spectra::SymEigsSolver: the largest eigenvalue is sigma_1(J)^2") {
  const auto p = make_problem<double>(16, 12, 4, 4, 2718, MaskKind::Causal, false);
  INFO("seed=2718");
  const Mat<double> J = attention_jacobian(p.X, p.WQ, p.WK, p.WV, p.opts);
  const Eigen::JacobiSVD<Mat<double>> svd(J);
  const Vec<double> s = svd.singularValues();

  GramOp<double> op(p.X, p.WQ, p.WK, p.WV, p.opts);
  Spectra::SymEigsSolver<GramOp<double>> eigs(op, 3, 12);
  eigs.init();
  const Index nconv = eigs.compute(Spectra::SortRule::LargestAlge, 1000, 1e-12);
  REQUIRE(eigs.info() == Spectra::CompInfo::Successful);
  CHECK(nconv == 3);
  const Vec<double> ev = eigs.eigenvalues();
  for (Index i = 0; i < 3; ++i) CHECK(std::abs(ev(i) - s(i) * s(i)) <= 1e-10 * s(0) * s(0));

  NormalOp<double> nop(p.X, p.WQ, p.WK, p.WV, p.opts);
  Spectra::SymEigsSolver<NormalOp<double>> neigs(nop, 1, 8);
  neigs.init();
  neigs.compute(Spectra::SortRule::LargestAlge, 1000, 1e-12);
  REQUIRE(neigs.info() == Spectra::CompInfo::Successful);
  CHECK(std::abs(neigs.eigenvalues()(0) - s(0) * s(0)) <= 1e-10 * s(0) * s(0));
}
