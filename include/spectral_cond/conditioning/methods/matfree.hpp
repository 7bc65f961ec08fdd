// spectral_cond: κ(J) of a wide J without ever forming or factoring an (N d_v)^2 matrix (MATH.md
// §12, "The matrix-free method"): σ_max by Lanczos on J J^T, σ_min by LOBPCG on J J^T
// preconditioned by the d_v blocks of J J^T over mixed output channels (N x N each, from the
// structured form) plus a coarse level on the smallest eigenvectors of (P X)(P X)^T (its null
// modes, where N > rank(X), and 16 more) times every channel, every product by J and J^T
// matrix-free (one JVP or VJP), on inputs compressed to N
// columns where N < D. Memory O(d_v N^2 + N d_v D + (k d_v)^2 + k d_v min(N, D)) instead of
// (N d_v)^2. Accuracy ε κ plus the residual bound η or Temple's bound, earned from products with
// J, whatever the preconditioner's quality.
#pragma once

#include <functional>

#include "spectral_cond/conditioning/methods/common.hpp"
#include "spectral_cond/jacobian/compressed.hpp"
#include "spectral_cond/jacobian/jacobian.hpp"
#include "spectral_cond/jacobian/operators.hpp"
#include "spectral_cond/linalg/cholesky.hpp"
#include "spectral_cond/linalg/eigen.hpp"
#include "spectral_cond/linalg/lanczos.hpp"
#include "spectral_cond/linalg/lobpcg.hpp"

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

/// The compressed inputs of MATH.md §3 for N < D: X = L V^T from X's truncated SVD
/// (detail::truncated_svd, L = U Σ, N x r, V D x r with orthonormal columns), so the Jacobian of
/// attention at (L, V^T W_Q, V^T W_K, V^T W_V) is J~ = J T^T with T's rows orthonormal:
/// J J^T = J~ J~^T, the same singular values, and every product costs N r in place of N D; the
/// truncation at max(N, D) ε σ_1(X) is a perturbation at the level of rounding. For N >= D, and
/// where the SVD fails, the inputs are used as they are (always valid).
struct MatfreeInputs {
  Mat<double> X, WQ, WK, WV;
  bool compressed = false;

  explicit MatfreeInputs(const KJInputs& in) {
    Mat<double> V;
    if (in.X.rows() >= in.X.cols() || !truncated_svd<double>(in.X, X, V)) return;
    WQ.noalias() = V.transpose() * in.WQ;
    WK.noalias() = V.transpose() * in.WK;
    WV.noalias() = V.transpose() * in.WV;
    compressed = true;
  }
  const Mat<double>& x(const KJInputs& in) const { return compressed ? X : in.X; }
  const Mat<double>& wq(const KJInputs& in) const { return compressed ? WQ : in.WQ; }
  const Mat<double>& wk(const KJInputs& in) const { return compressed ? WK : in.WK; }
  const Mat<double>& wv(const KJInputs& in) const { return compressed ? WV : in.WV; }
};

/// The host's products backend for matfree_condition: J x and J^T x by one JVP or VJP on the
/// CPU (JacobianProducts, MATH.md §2).
struct HostProducts {
  JacobianProducts<double> operator()(const Mat<double>& X, const Mat<double>& WQ,
                                      const Mat<double>& WK, const Mat<double>& WV,
                                      const AttentionOptions<double>& opts) const {
    return JacobianProducts<double>(X, WQ, WK, WV, opts, JacobianBlock::All,
                                    "kappa_jacobian_matfree");
  }
};

/// kappa_jacobian_matfree on inputs in double (MATH.md §12, matfree). Every product with J and
/// J^T goes through the backend `make_products(X, W_Q, W_K, W_V, opts)` returns for the inputs
/// the method runs on (compressed where N < D; a products backend, common.hpp): HostProducts on
/// the CPU, cuda::detail::DeviceProducts on a GPU. The preconditioner is built on the host.
template <typename MakeProducts = HostProducts>
ConditionResult<double> matfree_condition(const KJInputs& in, const JacobianKappaOptions& jo,
                                          const MakeProducts& make_products = MakeProducts{}) {
  const double eps = ScalarTraits<double>::eps();
  LobpcgRun run("matfree", jo);
  if (!in.wide()) return run.decline_tall();
  const MatfreeInputs c(in);
  const auto J = make_products(c.x(in), c.wq(in), c.wk(in), c.wv(in), in.opts);
  if (!run.find_sigma_max(J, in.rows, in.cols))
    return run.decline(Info::NotConverging, "Lanczos for sigma_max did not converge");
  if (jo.progress) jo.progress(0.05);
  // S = (P X)(P X)^T: J J^T >= J_V J_V^T = I ⊗ S (MATH.md §5, the bound without hypothesis).
  const Index N = in.X.rows();
  ChannelBlockPreconditioner M;
  CoarseCorrection coarse;
  std::string coarse_why;  // why there is no coarse level, where one was asked for
  double lower = 0;        // the proven lower bound σ_N(P X) on σ_min(J), where it is informative
  Index s_null = 0;        // S's eigenvalues at rounding level: N - rank(P X)
  std::string null_left_out;  // why the coarse level does not cover them, where it does not
  {
    JacobianParts<double> jp;
    jp.compute(c.x(in), c.wq(in), c.wk(in), c.wv(in), in.opts, JacobianBlock::All);
    const Mat<double> S = jp.PX * jp.PX.transpose();
    Vec<double> mu;
    std::string why;
    if (symmetric_eigenvalues(S, true, mu, why).empty())
      return run.decline(Info::NotConverging,
                         "the eigenvalues of S = (P X)(P X)^T were not computed: " + why);
    // Clear of S's rounding, about N ε λ_max(S), σ_N(P X) bounds σ_min(J) from below.
    const double s_floor = static_cast<double>(N) * eps * mu(N - 1);
    if (mu(0) > 4 * s_floor) lower = std::sqrt(mu(0) - s_floor);
    while (s_null < N && mu(s_null) <= s_floor) ++s_null;
    // The coarse level covers S's null modes and matfree_coarse more: where P X is rank
    // deficient (N > rank(X)), J J^T's smallest eigenvalues fill the null modes' directions in
    // every channel, which only a coarse level on all of them resolves (MATH.md §12). Where that
    // level does not fit the memory budget (or fails), it has matfree_coarse modes, as where S
    // has none.
    if (jo.progress) coarse.progress = [&jo](double f) { jo.progress(0.05 + 0.05 * f); };
    bool built = false;
    if (jo.matfree_coarse > 0 && s_null > 0) {
      built = coarse.build(jp, c.x(in), S, jo.matfree_coarse + s_null, !jp.fwd.rope.active,
                           jo.resolved_memory_budget(), coarse_why);
      if (!built) null_left_out.swap(coarse_why);
    }
    if (!built)
      coarse.build(jp, c.x(in), S, jo.matfree_coarse, !jp.fwd.rope.active,
                   jo.resolved_memory_budget(), coarse_why);
    why.clear();
    if (!M.build(jp, c.x(in), S, !jp.fwd.rope.active, why))
      // The preconditioner only speeds the iteration: its failure says nothing of σ_min(J).
      return run.decline(Info::NotConverging, "the matfree preconditioner: " + why);
  }
  if (jo.progress) jo.progress(0.1);
  Mat<double> C;
  auto precondition = [&M, &coarse, &C](Mat<double>& B) {
    if (coarse.k > 0) coarse.apply(B, C);
    M.apply(B);
    if (coarse.k > 0) B += C;
  };
  std::function<void(double)> inner;
  if (jo.progress) inner = [&](double f) { jo.progress(0.1 + 0.9 * f); };
  const LobpcgOutcome lo =
      lobpcg_sigma_min(J, precondition, run.res.sigma_max, jo.matfree, inner, LobpcgStop::Residual,
                       run.res.rank_tol, LobpcgProducts::Tracked);
  run.res.iterations += lo.iterations;
  std::ostringstream note;
  note << "matfree: block " << std::min(jo.matfree.block, in.rows) << ", preconditioned by the "
       << in.WV.cols() << (M.mixed ? " mixed" : " (unmixed)") << " channel blocks of J J^T (" << N
       << " x " << N << " each)";
  if (coarse.k > 0)
    note << " and a coarse level on the " << coarse.k << " smallest eigenvectors of (PX)(PX)^T ("
         << coarse.k * in.WV.cols() << " directions)";
  else if (!coarse_why.empty())
    note << " (no coarse level: " << coarse_why << ")";
  if (s_null > 0) {
    // Where P X is numerically rank deficient (N > rank(X), or attention averaging tokens to
    // rounding level), J_V misses s_null d_v directions, and J J^T's smallest eigenvalues fill
    // them densely; a coarse level of fewer modes leaves most of them to the channel blocks,
    // which do not resolve them (MATH.md §12, where matfree breaks).
    note << "; (PX)(PX)^T has " << s_null << (s_null == 1 ? " eigenvalue" : " eigenvalues")
         << " at rounding level (numerical rank " << N - s_null << " < N = " << N
         << "): " << s_null * in.WV.cols() << " directions that J_V does not reach";
    if (s_null > coarse.k) note << ", " << s_null - coarse.k << " modes beyond the coarse level";
    if (!null_left_out.empty())
      note << " (a coarse level covering them and " << jo.matfree_coarse
           << " more was left out: " << null_left_out << ")";
  }
  note << "; " << lo.iterations << " iterations";
  if (c.compressed)
    note << " on the compressed inputs X = L V^T (L " << N << " x " << c.X.cols() << ")";
  if (auto d = run.decline_if_rank_level(lo.sigma, note.str())) return *d;
  if (!lo.converged) {
    note << ": did not converge in " << jo.matfree.max_iterations << " iterations (residual bound "
         << lo.eta << "; raise matfree.max_iterations or matfree.block, or use method qr)";
    if (s_null > coarse.k)
      note << "; where PX is numerically rank deficient beyond the coarse level the method is "
              "known to converge slowly or not at all (MATH.md §12)";
    return run.decline(Info::NotConverging, note.str());
  }
  if (lo.at_eta_floor)
    note << "; stopped where eta stopped falling (" << lo.eta
         << ", above matfree.tol = " << jo.matfree.tol
         << "): the rounding of the stored vector through J J^T";
  // The residual of the returned pair, recomputed from two fresh products: r = J J^T x - σ^2 x
  // with σ = ||J^T x||; some singular value is within η σ = ||r|| / σ of σ (lobpcg_sigma_min).
  // The same for the second Ritz vector gives Temple's bound (temple_bound), quadratic in ||r||.
  const double round = eps * run.res.sigma_max * run.res.sigma_max;
  auto fresh = [&J, &in](Vec<double> x, double& sigma) {  // ||J J^T x - σ^2 x||, x unit
    x /= x.norm();
    Vec<double> y(J.cols()), r(in.rows);
    J.apply_transpose(x.data(), y.data());
    sigma = y.norm();
    J.apply(y.data(), r.data());
    r -= (sigma * sigma) * x;
    return r.norm();
  };
  double sigma = 0, sigma2 = 0;
  const double r1 = fresh(lo.x, sigma);
  const double eta = r1 / (sigma * sigma);
  double temple = std::numeric_limits<double>::infinity();
  if (lo.x2.size() == lo.x.size()) {
    const double r2 = fresh(lo.x2, sigma2);
    temple = temple_bound(sigma * sigma, r1, sigma2 * sigma2, r2, round);
  }
  run.res.residual = eta;
  note << ", residual bound eta = ||J J^T x - sigma^2 x|| / sigma^2 = " << eta;
  if (std::isfinite(temple))
    note << "; Temple's bound " << temple << " from the gap to the second Ritz value ("
         << sigma2 / sigma << " sigma_min; the bound assumes no singular value of J between the "
         << "two, i.e. that the iteration found the bottom of the spectrum)";
  // Ratios: the method may run on rescaled inputs (kappa_jacobian), whose σ's are scaled alike.
  if (lower > 0)
    note << "; sigma_min >= sigma_N(PX) = " << lower / sigma << " sigma_min (proven, MATH.md 5)";
  if (lower > sigma * (1 + eta + 64 * eps))
    return run.decline(Info::Inaccurate,
                       note.str() +
                           ": the Ritz value is below the proven lower bound sigma_N(PX), "
                           "so the iteration went wrong; use method qr");
  if (!(eta < 0.5))
    return run.decline(Info::NotConverging,
                       note.str() + ": the recomputed residual bound leaves no correct digit");
  return run.answer(sigma, eps * (run.res.sigma_max / sigma) + std::min(eta, temple), in.rows,
                    in.cols, note.str());
}

}  // namespace detail

/// κ(J) of a wide J by the matrix-free method (top of this header; MATH.md §12): nothing of order
/// (N d_v)^2 is formed, so it runs where gram, lobpcg and qr do not fit (a GPT-2 head at
/// N = 1024 has a 34 GB Gram matrix). σ_max by Lanczos on J J^T; σ_min by LOBPCG on J J^T with
/// the d_v blocks of J J^T over mixed channels (ChannelBlockPreconditioner) plus the coarse level
/// on S's null modes and JacobianKappaOptions::matfree_coarse more (CoarseCorrection) as
/// preconditioner, stopped on the unpreconditioned residual; for N < D on the compressed inputs
/// (MatfreeInputs), whose J J^T is the same. At the end the residual of the Ritz pair is recomputed
/// from two products: some singular value of J lies within η σ of the answer, η = ||J J^T x - σ^2
/// x|| / σ^2; and from the second Ritz pair, Temple's bound (temple_bound), quadratic in the
/// residual, which assumes no singular value lies between the two smallest found (the note says
/// so). Stated accuracy ε κ + min(η, Temple's bound). Cost: the blocks (O(N^2 d_v (D + d_k)) flops,
/// once), then per iteration about `block` products with J^T (the rest carried,
/// LobpcgProducts::Tracked), `block` with J, and one pass over the blocks' d_v N^2 inverse entries
/// and over E^{-1}'s (k d_v)^2. The iteration stops at matfree.tol, or where η stops falling above
/// it (below 64 ε κ^2: the rounding of the stored vector; the note says so). Like lobpcg, it finds
/// the smallest singular value from a random block, not by a certificate: where N <= D and P X has
/// full rank, the proven σ_min >= σ_N(P X) (MATH.md §5) is checked and given in the note. It
/// answers (Info::Success) only when the iteration converges, σ_min is above the rank tolerance and
/// the recomputed η is below 1/2; otherwise it says why and leaves kappa NaN (Info::Singular for a
/// tall J or a σ_min at rank level, Info::NotConverging, Info::Inaccurate when the answer
/// contradicts the proven bound).
template <typename Scalar>
ConditionResult<double> kappa_jacobian_matfree(const CRef<Scalar>& X, const CRef<Scalar>& WQ,
                                               const CRef<Scalar>& WK, const CRef<Scalar>& WV,
                                               const AttentionOptions<Scalar>& opts,
                                               const JacobianKappaOptions& jo = {}) {
  if (auto bad = detail::check_kj_inputs<Scalar>("kappa_jacobian_matfree", X, WQ, WK, WV, opts, jo,
                                                 "matfree"))
    return *bad;
  const detail::KJInputs in = detail::kj_inputs<Scalar>(X, WQ, WK, WV, opts);
  return detail::validated(in, detail::matfree_condition(in, jo), jo);
}

}  // namespace spectral_cond
