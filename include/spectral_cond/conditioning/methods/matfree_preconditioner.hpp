// spectral_cond: the preconditioner of the matfree method (MATH.md §12): block-Jacobi over the
// d_v output channels of J J^T in a mixed channel basis (ChannelBlockPreconditioner), and the
// coarse level on the smallest eigenvectors of (P X)(P X)^T times every channel
// (CoarseCorrection), both built from the structured form of J J^T with no product by J.
#pragma once

#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "spectral_cond/jacobian/jacobian.hpp"
#include "spectral_cond/linalg/cholesky.hpp"
#include "spectral_cond/linalg/eigen.hpp"

namespace spectral_cond {

namespace detail {
/// The block-Jacobi preconditioner of J J^T over the d_v output channels in a transformed channel
/// basis (MATH.md §12). Mixing the output channels by an invertible R (d_v x d_v) maps J to
/// (R^T ⊗ I_N) J, the Jacobian's rows for W_V R, so J J^T = (R^{-T} ⊗ I) G~ (R^{-1} ⊗ I) with
/// G~ the Gram matrix of the mixed channels, and M = (R^{-T} ⊗ I) blockdiag(G~_jj) (R^{-1} ⊗ I),
/// M^{-1} = (R ⊗ I) blockdiag(G~_jj)^{-1} (R^T ⊗ I). R simultaneously diagonalises the channel
/// couplings of the query and the key terms, C_Q = Σ_n |x_n|^2 𝔅_(n) 𝔅_(n)^T and
/// C_K = Σ_n |q_n|^2 𝔈_(n) 𝔈_(n)^T (𝔅_(n) the d_v rows of 𝔅 for token n: each is the trace over
/// tokens of one term's d_v x d_v blocks), by the generalised eigenvectors of (C_Q, C_Q + C_K),
/// columns scaled to unit length (block-Jacobi does not depend on the columns' scale). Each block
/// G~_jj = (X X^T) ∘ (𝔅~_j 𝔅~_j^T) + (Q Q^T) ∘ (𝔈~_j 𝔈~_j^T) + S ((R^T R)_jj = 1), 𝔅~ and 𝔈~ the
/// channel mixtures of 𝔅 and 𝔈 and S = (P X)(P X)^T, is factored once (Cholesky, after a shift
/// of 64 N ε ||G~_jj|| that keeps it definite) and its inverse kept: applied to the few columns of
/// a LOBPCG block, one pass over G~_jj^{-1} costs less than two triangular solves.
struct ChannelBlockPreconditioner {
  std::vector<Mat<double>> Ginv;  ///< the blocks' inverses, one per mixed channel
  Mat<double> R;                  ///< the channel mixing, d_v x d_v, unit columns
  Index N = 0;
  bool mixed = false;  ///< R from the couplings' eigenvectors; false: R = I

  /// Mixes the output channels of the stacked factor F ((N d_v) x n, column b the vec of an
  /// N x d_v matrix) in place: every N x d_v column becomes itself times R.
  static void mix_channels(Mat<double>& F, Index N, const Mat<double>& R) {
    Mat<double> t(N, R.cols());
    for (Index b = 0; b < F.cols(); ++b) {
      Eigen::Map<Mat<double>> col(F.col(b).data(), N, R.rows());
      t.noalias() = col * R;
      col = t;
    }
  }

  /// Σ_b F_b^T diag(w)^2 F_b, F_b the N x dv matrix of column b of F.
  static Mat<double> coupling(const Mat<double>& F, Index N, Index dv, const Vec<double>& w) {
    Mat<double> C = Mat<double>::Zero(dv, dv), t(N, dv);
    for (Index b = 0; b < F.cols(); ++b) {
      t.noalias() = w.asDiagonal() * Eigen::Map<const Mat<double>>(F.col(b).data(), N, dv);
      C.noalias() += t.transpose() * t;
    }
    return C;
  }

  /// The mixing R from the two couplings (the key coupling is absent with RoPE: then the
  /// orthonormal eigenvectors of C_Q). Any invertible R gives a valid preconditioner, so where
  /// the eigensolver fails or returns a column that is not finite (couplings at the level of
  /// underflow, as when the softmax is saturated and the query and key terms vanish) R = I, the
  /// plain block-Jacobi over the output channels; mixed says which.
  template <typename = void>  // compiled only where called (eigensolvers)
  void choose_mixing(const Mat<double>& CQ, const Mat<double>* CK) {
    const Index dv = CQ.rows();
    bool ok = false;
    if (CK) {
      Mat<double> T = CQ + *CK;
      // A floor of d_v ε tr keeps C_Q + C_K definite where a channel of V vanishes.
      T.diagonal().array() += static_cast<double>(dv) * ScalarTraits<double>::eps() *
                              std::max(T.trace(), std::numeric_limits<double>::min());
      const Eigen::GeneralizedSelfAdjointEigenSolver<Mat<double>> ge(CQ, T);
      if (ge.info() == Eigen::Success && ge.eigenvectors().allFinite()) {
        R = ge.eigenvectors();
        ok = true;
      }
    } else {
      const Eigen::SelfAdjointEigenSolver<Mat<double>> e(CQ);
      if (e.info() == Eigen::Success && e.eigenvectors().allFinite()) {
        R = e.eigenvectors();
        ok = true;
      }
    }
    for (Index j = 0; ok && j < dv; ++j) {
      const double n = R.col(j).norm();
      ok = n > 0 && std::isfinite(n);
      if (ok) R.col(j) /= n;
    }
    mixed = ok;
    if (!ok) R = Mat<double>::Identity(dv, dv);
  }

  /// Builds the blocks from jp, whose 𝔅 and 𝔈 it mixes in place. False when a block stays
  /// indefinite after the shift (NaN or Inf in the inputs' products); why says which.
  template <typename = void>
  bool build(JacobianParts<double>& jp, const Mat<double>& X, const Mat<double>& S, bool with_keys,
             std::string& why) {
    N = X.rows();
    const Index dv = jp.fwd.V.cols();
    const Mat<double> CQ = coupling(jp.B, N, dv, X.rowwise().norm());
    const Mat<double> CK =
        with_keys ? coupling(jp.E, N, dv, jp.fwd.Q.rowwise().norm()) : Mat<double>();
    choose_mixing(CQ, with_keys ? &CK : nullptr);
    mix_channels(jp.B, N, R);
    if (with_keys) mix_channels(jp.E, N, R);
    const Mat<double> XX = X * X.transpose();
    const Mat<double> QQ = jp.fwd.Q * jp.fwd.Q.transpose();
    Ginv.assign(static_cast<std::size_t>(dv), Mat<double>());
    Mat<double> T(N, N);
    for (Index j = 0; j < dv; ++j) {
      Mat<double>& G = Ginv[static_cast<std::size_t>(j)];
      G = S;  // (R^T R)_jj S, and R's columns are unit
      T.noalias() = jp.B.middleRows(j * N, N) * jp.B.middleRows(j * N, N).transpose();
      G += XX.cwiseProduct(T);
      if (with_keys) {
        T.noalias() = jp.E.middleRows(j * N, N) * jp.E.middleRows(j * N, N).transpose();
        G += QQ.cwiseProduct(T);
      }
      const double shift = 64.0 * static_cast<double>(N) * ScalarTraits<double>::eps() *
                           std::max(G.diagonal().maxCoeff(), std::numeric_limits<double>::min());
      G.diagonal().array() += shift;
      if (!cholesky_in_place(G) || !inverse_from_cholesky(G)) {
        why = "the block of mixed channel " + std::to_string(j) +
              " is not positive definite at working precision";
        return false;
      }
    }
    return true;
  }

  /// B := M^{-1} B: each column mixed (x R), the columns of one mixed channel multiplied together
  /// by the block's inverse (multiply_columns), and mixed back (x R^T).
  void apply(Mat<double>& B) const {
    const Index dv = R.rows(), nc = B.cols();
    Mat<double> t(N, dv), T(N, dv * nc);
    for (Index c = 0; c < nc; ++c) {
      t.noalias() = Eigen::Map<const Mat<double>>(B.col(c).data(), N, dv) * R;
      for (Index j = 0; j < dv; ++j) T.col(j * nc + c) = t.col(j);
    }
    Mat<double> Y(N, nc);
    for (Index j = 0; j < dv; ++j) {
      multiply_columns(Ginv[static_cast<std::size_t>(j)], T.middleCols(j * nc, nc), Y);
      T.middleCols(j * nc, nc) = Y;
    }
    for (Index c = 0; c < nc; ++c) {
      for (Index j = 0; j < dv; ++j) t.col(j) = T.col(j * nc + c);
      Eigen::Map<Mat<double>>(B.col(c).data(), N, dv).noalias() = t * R.transpose();
    }
  }
};

/// The coarse level of the matfree preconditioner (MATH.md §12): the space Z = R^{d_v} ⊗ U_k of
/// output matrices whose columns lie in span(U_k), U_k the eigenvectors of S = (P X)(P X)^T for
/// its k smallest eigenvalues, where J J^T ⪰ I ⊗ S is weakest and the channel blocks miss the
/// coupling of tokens and channels. Its Galerkin matrix E = Z^T J J^T Z (k d_v x k d_v) comes from
/// the structured form with no product by J: for z = e_i ⊗ u_a, J_Q^T z is the r x d_k matrix
/// X^T diag(u_a) 𝔅^(i) and J_K^T z is 𝔈^(i)T diag(u_a) Q (𝔅^(i), 𝔈^(i) the N rows of channel
/// i), and Z^T (I ⊗ S) Z = diag(μ_a). It is added to the channel blocks' inverse (an additive
/// two-level preconditioner): M^{-1} = M_1^{-1} + Z E^{-1} Z^T. E is formed one of two ways, the
/// cheaper by count: from those r x d_k matrices, 2 r d_k (k d_v)^2 flops, or channel pair by
/// channel pair, E_(i,j) = U_k^T [(X X^T) ∘ (𝔅^(i) 𝔅^(j)T) + (Q Q^T) ∘ (𝔈^(i) 𝔈^(j)T)] U_k,
/// about d_v^2 N^2 (d_k + r + k) flops, which wins once k is large (k = 273 at N = 1024 covering
/// the null modes of S: 6x fewer).
struct CoarseCorrection {
  Mat<double> U;     ///< U_k, N x k
  Mat<double> Einv;  ///< E^{-1} (E shifted, below), index a + k i
  Index k = 0;
  /// How E is formed: the cheaper of the two by flop count, or one of them (tests compare both).
  enum class Form { Cheaper, Columns, ChannelPairs } form = Form::Cheaper;
  bool used_pairs = false;  ///< which form the last build used
  /// Told the fraction of E formed, where set (forming E takes minutes at k d_v ~ 1e4).
  std::function<void(double)> progress;

  /// Builds E from the unmixed 𝔅 and 𝔈 of jp (𝔈 absent: with_keys false, no coarse level, as
  /// with RoPE). False, and k = 0, for `modes` = 0, where E and the work space of its forming
  /// would take more than `budget` bytes (E is not allocated then), and where S's eigenvectors
  /// or E's factor fail (`why` says which): the preconditioner then has one level, which is still
  /// valid.
  template <typename = void>  // compiled only where called (eigensolvers, factorisations)
  bool build(const JacobianParts<double>& jp, const Mat<double>& X, const Mat<double>& S,
             Index modes, bool with_keys, std::uint64_t budget, std::string& why) {
    k = 0;
    const Index N = X.rows(), r = X.cols(), dv = jp.fwd.V.cols(), dk = jp.fwd.Q.cols();
    const Index kk = std::min(modes, N);
    if (kk < 1) return false;
    if (!with_keys) {
      why = "none with RoPE, whose key term has no structured form";
      return false;
    }
    const Index n = kk * dv;
    const double by_columns = 2.0 * double(r) * double(dk) * double(n) * double(n);
    const double by_pairs = double(dv) * double(dv + 1) *
                            (double(N) * double(N) * double(dk + r + kk) + double(N * kk * kk));
    used_pairs = form == Form::ChannelPairs || (form == Form::Cheaper && by_pairs < by_columns);
    // E, in place of its factor and inverse, and the chosen form's work space: four N x N
    // matrices, or F (2 g r x n), W (N x n), W_Q (N x k g) and T (r x k g), g <= 8.
    const double g = double(std::min<Index>(8, dk));
    const double need =
        8.0 * (double(n) * double(n) + (used_pairs ? 4.0 * double(N) * double(N)
                                                   : (2 * g * double(r) + double(N)) * double(n) +
                                                         double(N + r) * double(kk) * g));
    if (need > double(budget)) {
      std::ostringstream o;
      o << "its Galerkin matrix of order " << n << " would need " << need / double(1 << 30)
        << " GiB, over the memory budget of " << double(budget) / double(1 << 30) << " GiB";
      why = o.str();
      return false;
    }
    Vec<double> mu;
    if (!smallest_eigenpairs(S, kk, mu, U)) {
      why = "the eigenvectors of (PX)(PX)^T were not computed";
      return false;
    }
    Mat<double>& L = Einv;  // E, then its factor, then its inverse
    L = Mat<double>::Zero(n, n);
    if (used_pairs)
      by_channel_pairs(jp, X, L);
    else
      by_columns_of_jt(jp, X, L);
    for (Index i = 0; i < dv; ++i) L.diagonal().segment(i * kk, kk) += mu;
    const double shift = 64.0 * static_cast<double>(n) * ScalarTraits<double>::eps() *
                         std::max(L.diagonal().maxCoeff(), std::numeric_limits<double>::min());
    L.diagonal().array() += shift;
    if (!cholesky_in_place(L) || !inverse_from_cholesky(L)) {
      why = "its Galerkin matrix is not positive definite at working precision";
      return false;
    }
    k = kk;
    return true;
  }

  /// E's lower triangle, less diag(μ), from the r x d_k matrices J_Q^T z and J_K^T z: E =
  /// Σ_b F_b^T F_b over the query/key columns b, F_b (2 r x n) holding column b of them for every
  /// z = e_i ⊗ u_a (column a + k i): g columns b at a time, so nothing of order r d_k k d_v is
  /// held.
  void by_columns_of_jt(const JacobianParts<double>& jp, const Mat<double>& X,
                        Mat<double>& L) const {
    const Index N = X.rows(), r = X.cols(), dv = jp.fwd.V.cols(), dk = jp.fwd.Q.cols();
    const Index kk = U.cols(), n = kk * dv;
    const Index g = std::min<Index>(8, dk);
    Mat<double> F(2 * g * r, n), W(N, n), WQ(N, kk * g), T(r, kk * g);
    for (Index b0 = 0; b0 < dk; b0 += g) {
      const Index gb = std::min(g, dk - b0);
      for (Index b = 0; b < gb; ++b) {
        for (Index i = 0; i < dv; ++i)
          W.middleCols(kk * i, kk) =
              U.array().colwise() * jp.B.col(b0 + b).segment(i * N, N).array();
        F.middleRows(b * r, r).noalias() = X.transpose() * W;
        for (Index a = 0; a < kk; ++a)
          WQ.col(a + kk * b) = U.col(a).cwiseProduct(jp.fwd.Q.col(b0 + b));
      }
      for (Index i = 0; i < dv; ++i) {
        T.leftCols(kk * gb).noalias() =
            jp.E.middleRows(i * N, N).transpose() * WQ.leftCols(kk * gb);
        for (Index b = 0; b < gb; ++b)
          F.block(gb * r + b * r, kk * i, r, kk) = T.middleCols(kk * b, kk);
      }
      L.selfadjointView<Eigen::Lower>().rankUpdate(F.topRows(2 * gb * r).transpose());
    }
  }

  /// E's lower triangle, less diag(μ), channel pair by channel pair (i >= j): the N x N matrix
  /// (X X^T) ∘ (𝔅^(i) 𝔅^(j)T) + (Q Q^T) ∘ (𝔈^(i) 𝔈^(j)T), then U_k^T · U_k (MATH.md §12).
  void by_channel_pairs(const JacobianParts<double>& jp, const Mat<double>& X,
                        Mat<double>& L) const {
    const Index N = X.rows(), dv = jp.fwd.V.cols(), kk = U.cols();
    const Mat<double> XX = X * X.transpose(), QQ = jp.fwd.Q * jp.fwd.Q.transpose();
    Mat<double> H(N, N), T(N, N), HU(N, kk);
    for (Index j = 0; j < dv; ++j)
      for (Index i = j; i < dv; ++i) {
        H.noalias() = jp.B.middleRows(i * N, N) * jp.B.middleRows(j * N, N).transpose();
        T.noalias() = jp.E.middleRows(i * N, N) * jp.E.middleRows(j * N, N).transpose();
        H = H.cwiseProduct(XX) + T.cwiseProduct(QQ);
        HU.noalias() = H * U;
        L.block(i * kk, j * kk, kk, kk).noalias() = U.transpose() * HU;
        if (progress && i + 1 == dv)
          progress(double((j + 1) * (2 * dv - j)) / double(dv * (dv + 1)));
      }
  }

  /// Z E^{-1} Z^T B, for the columns of B as N x d_v matrices; into C.
  void apply(const Mat<double>& B, Mat<double>& C) const {
    const Index N = U.rows(), dv = B.rows() / N;
    Mat<double> Y(k * dv, B.cols()), Ye(k * dv, B.cols());
    for (Index c = 0; c < B.cols(); ++c)
      Eigen::Map<Mat<double>>(Y.col(c).data(), k, dv).noalias() =
          U.transpose() * Eigen::Map<const Mat<double>>(B.col(c).data(), N, dv);
    multiply_columns(Einv, Y, Ye);
    Y.swap(Ye);
    C.resize(B.rows(), B.cols());
    for (Index c = 0; c < B.cols(); ++c)
      Eigen::Map<Mat<double>>(C.col(c).data(), N, dv).noalias() =
          U * Eigen::Map<const Mat<double>>(Y.col(c).data(), k, dv);
  }
};

}  // namespace detail

}  // namespace spectral_cond
