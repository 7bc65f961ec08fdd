// The compressed Jacobians (MATH.md §3, "The compressed Jacobian"): J~ and the compressed input
// Jacobian M against J and J_X assembled column by column from attention_jvp on basis tangents
// (an oracle independent of the closed forms): equal singular values, J J^T = J~ J~^T, block
// extraction, N < D, N = D, N > D, rank-deficient X, causal mask, float.
#include <spectral_cond/core/attention.hpp>
#include <spectral_cond/jacobian/compressed.hpp>

#include <Eigen/SVD>

#include "support/test_helpers.hpp"

using namespace spectral_cond;
using sc_test::make_problem;
using sc_test::Problem;
using sc_test::randn;
using sc_test::rel_err;

namespace {

/// d vec A / d [vec W_Q; vec W_K; vec W_V] (wrt = 0) or d vec A / d vec X (wrt = 1), one JVP
/// per basis tangent: exact to rounding and independent of the closed forms of MATH.md §3.
template <typename Scalar>
Mat<Scalar> jvp_jacobian(const Problem<Scalar>& p, int wrt) {
  const Index N = p.X.rows(), D = p.X.cols(), dk = p.WQ.cols(), dv = p.WV.cols();
  AttentionCache<Scalar> cache;
  attention_forward<Scalar>(p.X, p.WQ, p.WK, p.WV, p.opts, cache);
  AttentionWorkspace<Scalar> ws;
  const Index cols = wrt == 0 ? D * (2 * dk + dv) : N * D;
  Mat<Scalar> J(N * dv, cols);
  Mat<Scalar> dA(N, dv);
  const Mat<Scalar> none;
  for (Index j = 0; j < cols; ++j) {
    Mat<Scalar> dWQ, dWK, dWV, dX;
    if (wrt == 1) {
      dX = Mat<Scalar>::Zero(N, D);
      dX.data()[j] = Scalar(1);
    } else if (j < D * dk) {
      dWQ = Mat<Scalar>::Zero(D, dk);
      dWQ.data()[j] = Scalar(1);
    } else if (j < 2 * D * dk) {
      dWK = Mat<Scalar>::Zero(D, dk);
      dWK.data()[j - D * dk] = Scalar(1);
    } else {
      dWV = Mat<Scalar>::Zero(D, dv);
      dWV.data()[j - 2 * D * dk] = Scalar(1);
    }
    attention_jvp<Scalar>(p.X, p.WQ, p.WK, p.WV, cache, dWQ, dWK, dWV, dX, ws, dA);
    J.col(j) = Eigen::Map<const Vec<Scalar>>(dA.data(), dA.size());
  }
  return J;
}

/// Singular values of M padded with zeros to length n.
template <typename Scalar>
Vec<double> padded_sv(const Mat<Scalar>& M, Index n) {
  Vec<double> s = Vec<double>::Zero(n);
  if (M.size() > 0) {
    const Vec<double> sv =
        Eigen::JacobiSVD<Mat<double>>(M.template cast<double>()).singularValues();
    s.head(std::min(n, sv.size())) = sv.head(std::min(n, sv.size()));
  }
  return s;
}

/// J and its compressed form C: J J^T = C C^T and equal singular values (to tol · σ_1).
template <typename Scalar>
void check_same_spectrum(const Mat<Scalar>& J, const Mat<Scalar>& C, double tol) {
  const Mat<double> Jd = J.template cast<double>(), Cd = C.template cast<double>();
  CHECK(rel_err(Cd * Cd.transpose(), Jd * Jd.transpose()) < tol);
  const Index n = std::min(J.rows(), J.cols());
  const Vec<double> sJ = padded_sv(J, n), sC = padded_sv(C, n);
  INFO("sigma_1 = " << sJ(0) << ", sigma_min(J) = " << sJ(n - 1)
                    << ", sigma_min(J~) = " << sC(n - 1));
  CHECK((sJ - sC).cwiseAbs().maxCoeff() <= tol * sJ(0));
}

struct Case {
  Index N, D, dk, dv;
  MaskKind mask;
  Index xrank;  ///< 0: full rank
  const char* what;
};

}  // namespace

TEST_CASE("compressed J~ has J's singular values and J J^T = J~ J~^T") {
  const Case cases[] = {
      {5, 8, 3, 2, MaskKind::None, 0, "N < D"},
      {6, 6, 3, 4, MaskKind::None, 0, "N = D"},
      {9, 4, 3, 2, MaskKind::None, 0, "N > D (J~ tall)"},
      {7, 6, 2, 3, MaskKind::None, 2, "rank-2 X"},
      {6, 8, 3, 3, MaskKind::Causal, 0, "causal mask"},
      {1, 4, 2, 2, MaskKind::None, 0, "N = 1"},
  };
  std::uint64_t seed = 2024;
  for (const Case& c : cases) {
    INFO("seed=" << seed << " " << c.what << " N=" << c.N << " D=" << c.D << " dk=" << c.dk
                 << " dv=" << c.dv);
    const auto p = make_problem<double>(c.N, c.D, c.dk, c.dv, seed++, c.mask, c.xrank);
    const CompressedJacobian<double> cj(p.X, p.WQ, p.WK, p.WV, p.opts);
    const Index r = c.xrank > 0 ? c.xrank : std::min(c.N, c.D);
    CHECK(cj.rank() == r);
    CHECK(cj.rows() == c.N * c.dv);
    CHECK(cj.cols() == r * (2 * c.dk + c.dv));
    CHECK(cj.full_cols() == c.D * (2 * c.dk + c.dv));
    const Mat<double> J = jvp_jacobian(p, 0);
    const Mat<double> Jc = compressed_jacobian(p.X, p.WQ, p.WK, p.WV, p.opts);
    CHECK(rel_err(Jc, cj.matrix()) == 0.0);
    check_same_spectrum<double>(J, Jc, 1e-13);
    // The factorisation itself: J = J~ T, T = blockdiag(I ⊗ V_X^T) (MATH.md §3).
    const Index dk = c.dk, dv = c.dv;
    Mat<double> T = Mat<double>::Zero(Jc.cols(), J.cols());
    for (Index b = 0; b < 2 * dk + dv; ++b) T.block(b * r, b * c.D, r, c.D) = cj.VX().transpose();
    CHECK(rel_err(Jc * T, J) < 1e-13);
  }
}

TEST_CASE("X with duplicated columns and c = 1: rank(X) columns, same spectrum") {
  const std::uint64_t seed = 99;
  INFO("seed=" << seed);
  auto p = make_problem<double>(6, 5, 2, 2, seed);
  p.X.col(3) = p.X.col(0);
  p.X.col(4) = p.X.col(1);
  p.opts.scale = 1.0;
  const CompressedJacobian<double> cj(p.X, p.WQ, p.WK, p.WV, p.opts);
  CHECK(cj.rank() == 3);
  check_same_spectrum<double>(jvp_jacobian(p, 0), cj.matrix(), 1e-13);
}

TEST_CASE("column blocks equal the columns of the whole J~, across block boundaries") {
  const std::uint64_t seed = 7;
  INFO("seed=" << seed);
  const auto p = make_problem<double>(5, 7, 3, 2, seed, MaskKind::Causal);
  const CompressedJacobian<double> cj(p.X, p.WQ, p.WK, p.WV, p.opts);
  const Mat<double> J = cj.matrix();
  const Index n = cj.cols();  // 5 * 8 = 40: Q [0, 15), K [15, 30), V [30, 40)
  const Index starts[] = {0, 3, 14, 15, 29, 30, 39, n};
  for (Index j0 : starts) {
    for (Index m : {Index(0), Index(1), Index(4), n - j0}) {
      if (j0 + m > n) continue;
      INFO("j0=" << j0 << " m=" << m);
      Mat<double> big =
          Mat<double>::Constant(cj.rows() + 3, m + 2, 7.0);  // a block of caller storage
      cj.columns(j0, m, big.block(1, 1, cj.rows(), m));
      if (m > 0) CHECK(rel_err(big.block(1, 1, cj.rows(), m), J.middleCols(j0, m)) == 0.0);
      CHECK((big.row(0).array() == 7.0).all());
      CHECK((big.col(0).array() == 7.0).all());
    }
  }
  Mat<double> out(cj.rows(), 3);
  CHECK_THROWS_WITH_AS(cj.columns(38, 3, out),
                       "CompressedJacobian::columns: columns [j0, j0 + m) must lie in [0, 40) "
                       "(got j0 = 38, m = 3)",
                       std::invalid_argument);
  CHECK_THROWS_AS(cj.columns(0, 2, out), std::invalid_argument);
  CHECK_THROWS_AS(cj.columns(-1, 3, out), std::invalid_argument);
  Mat<double> wrong(3, 3);
  CHECK_THROWS_AS(compressed_jacobian<double>(p.X, p.WQ, p.WK, p.WV, p.opts, wrong),
                  std::invalid_argument);
  Mat<double> right(cj.rows(), cj.cols());
  compressed_jacobian<double>(p.X, p.WQ, p.WK, p.WV, p.opts, right);
  CHECK(rel_err(right, J) == 0.0);
  Mat<double> bad = p.X;
  bad(0, 0) = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_AS(compressed_jacobian(bad, p.WQ, p.WK, p.WV, p.opts), std::invalid_argument);
}

TEST_CASE("compressed input Jacobian M: J_X = M (U_W^T ⊗ I_N), same spectrum") {
  const Case cases[] = {
      {5, 12, 2, 3, MaskKind::None, 0, "D > 2 d_k + d_v: s = 7 < D"},
      {6, 4, 3, 2, MaskKind::None, 0, "D < 2 d_k + d_v: s = D"},
      {7, 9, 2, 2, MaskKind::Causal, 3, "causal, rank-3 X"},
      {1, 5, 2, 1, MaskKind::None, 0, "N = 1"},
  };
  std::uint64_t seed = 515;
  for (const Case& c : cases) {
    INFO("seed=" << seed << " " << c.what << " N=" << c.N << " D=" << c.D);
    const auto p = make_problem<double>(c.N, c.D, c.dk, c.dv, seed++, c.mask, c.xrank);
    const CompressedInputJacobian<double> cm(p.X, p.WQ, p.WK, p.WV, p.opts);
    const Index s = std::min(c.D, 2 * c.dk + c.dv);
    CHECK(cm.rank() == s);
    CHECK(cm.cols() == c.N * s);
    const Mat<double> JX = jvp_jacobian(p, 1);
    const Mat<double> M = compressed_input_jacobian(p.X, p.WQ, p.WK, p.WV, p.opts);
    // vec(dX U_W) = (U_W^T ⊗ I_N) vec(dX)
    Mat<double> T = Mat<double>::Zero(c.N * s, c.N * c.D);
    for (Index t = 0; t < s; ++t)
      for (Index a = 0; a < c.D; ++a)
        T.block(t * c.N, a * c.N, c.N, c.N) = cm.UW()(a, t) * Mat<double>::Identity(c.N, c.N);
    CHECK(rel_err(M * T, JX) < 1e-13);
    check_same_spectrum<double>(JX, M, 1e-13);
    Mat<double> blk(cm.rows(), 3);
    cm.columns(c.N * s - 3, 3, blk);
    CHECK(rel_err(blk, M.rightCols(3)) == 0.0);
  }
  // Rank-deficient W_cat: W_K = W_Q and W_V in their span leave s = d_k.
  const std::uint64_t seed2 = 616;
  INFO("seed=" << seed2);
  auto p = make_problem<double>(5, 10, 2, 2, seed2);
  p.WK = p.WQ;
  p.WV = p.WQ * Mat<double>::Ones(2, 2);
  const CompressedInputJacobian<double> cm(p.X, p.WQ, p.WK, p.WV, p.opts);
  CHECK(cm.rank() == 2);
  check_same_spectrum<double>(jvp_jacobian(p, 1), cm.matrix(), 1e-13);
}

TEST_CASE("float inputs: J~ J~^T = J J^T to float accuracy") {
  const std::uint64_t seed = 31;
  INFO("seed=" << seed);
  const auto p = make_problem<float>(6, 9, 3, 2, seed);
  const Mat<float> J = jvp_jacobian(p, 0);
  const Mat<float> Jc = compressed_jacobian(p.X, p.WQ, p.WK, p.WV, p.opts);
  CHECK(Jc.rows() == 12);
  CHECK(Jc.cols() == 6 * 8);
  check_same_spectrum<float>(J, Jc, 2e-5);
  const Mat<float> M = compressed_input_jacobian(p.X, p.WQ, p.WK, p.WV, p.opts);
  check_same_spectrum<float>(jvp_jacobian(p, 1), M, 2e-5);
}

TEST_CASE("reduced J~: r^2 - (r - d_k)_+^2 query-key columns, same Gram and spectrum as J") {
  const Case cases[] = {
      {5, 8, 3, 2, MaskKind::None, 0, "N < D, r > d_k"},
      {6, 6, 3, 4, MaskKind::None, 0, "N = D"},
      {4, 6, 5, 3, MaskKind::None, 0, "r < d_k"},
      {9, 4, 3, 2, MaskKind::None, 0, "N > D (tall)"},
      {7, 6, 2, 3, MaskKind::None, 2, "rank-2 X"},
      {6, 8, 3, 3, MaskKind::Causal, 0, "causal mask"},
      {8, 8, 8, 8, MaskKind::None, 0, "d = N = D (halves the query-key part)"},
      {1, 4, 2, 2, MaskKind::None, 0, "N = 1"},
  };
  std::uint64_t seed = 3030;
  for (const Case& c : cases) {
    INFO("seed=" << seed << " " << c.what << " N=" << c.N << " D=" << c.D << " dk=" << c.dk
                 << " dv=" << c.dv);
    const auto p = make_problem<double>(c.N, c.D, c.dk, c.dv, seed++, c.mask, c.xrank);
    const ReducedCompressedJacobian<double> rj(p.X, p.WQ, p.WK, p.WV, p.opts);
    const Index r = c.xrank > 0 ? c.xrank : std::min(c.N, c.D);
    const Index excess = std::max<Index>(0, r - c.dk);
    CHECK(rj.rank() == r);
    CHECK(rj.rows() == c.N * c.dv);
    CHECK(rj.reduced_cols() == r * r - excess * excess);
    CHECK(rj.cols() == rj.reduced_cols() + r * c.dv);
    CHECK(rj.reduced_cols() < 2 * r * c.dk);
    const Mat<double> R = rj.matrix();
    check_same_spectrum<double>(jvp_jacobian(p, 0), R, 1e-13);
    // Column blocks across the boundary between the pairs and J~_V agree with the whole.
    const Index j0 = std::max<Index>(0, rj.reduced_cols() - 2),
                m = std::min<Index>(5, R.cols() - j0);
    Mat<double> blk(rj.rows(), m);
    rj.columns(j0, m, blk);
    CHECK(rel_err(blk, R.middleCols(j0, m)) == 0.0);
  }
}

TEST_CASE("reduced J~ in float: same Gram as J to float accuracy") {
  const auto p = make_problem<float>(6, 7, 3, 2, 77);
  const ReducedCompressedJacobian<float> rj(p.X, p.WQ, p.WK, p.WV, p.opts);
  const Mat<double> R = rj.matrix().cast<double>(), J = jvp_jacobian(p, 0).cast<double>();
  CHECK(rel_err(R * R.transpose(), J * J.transpose()) < 200 * sc_test::eps<float>());
}
