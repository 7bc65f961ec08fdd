// spectral_cond: κ(J) of a wide J without ever forming or factoring an (N d_v)^2 matrix (MATH.md
// §12, "The matrix-free method"): σ_max by Lanczos on J J^T, σ_min by LOBPCG on J J^T
// preconditioned by the d_v channel blocks of J J^T (N x N each, from the structured form), every
// product by J and J^T matrix-free (one JVP or VJP). Memory O(d_v N^2 + N d_v D) instead of
// (N d_v)^2. Accuracy ε κ plus the residual bound η, both earned from products with J, whatever
// the preconditioner's quality.
#pragma once

#include "spectral_cond/conditioning/methods/common.hpp"
#include "spectral_cond/jacobian/jacobian.hpp"
#include "spectral_cond/jacobian/operators.hpp"
#include "spectral_cond/linalg/cholesky.hpp"
#include "spectral_cond/linalg/eigen.hpp"
#include "spectral_cond/linalg/lanczos.hpp"
#include "spectral_cond/linalg/lobpcg.hpp"

namespace spectral_cond {

namespace detail {

/// The block-Jacobi preconditioner of J J^T over the d_v output channels: M = blockdiag(G_jj),
/// G_jj = J_j J_j^T (N x N) for the rows J_j of J that belong to channel j, from the structured
/// form (MATH.md §3): G_jj = (X X^T) ∘ (𝔅_j 𝔅_j^T) + (Q Q^T) ∘ (𝔈_j 𝔈_j^T) + S, 𝔅_j and 𝔈_j
/// the rows of 𝔅 and 𝔈 for channel j and S = (P X)(P X)^T. Each block is factored once
/// (Cholesky, after a shift of 64 N ε ||G_jj|| that keeps it definite); M^{-1} is d_v pairs of
/// triangular solves per column.
struct ChannelBlockPreconditioner {
  std::vector<Mat<double>> L;  ///< Cholesky factors, one per channel
  Index N = 0;

  /// False when a block stays indefinite after the shift (NaN or Inf in the inputs' products).
  bool build(const JacobianParts<double>& jp, const Mat<double>& X, const Mat<double>& S,
             bool with_keys) {
    N = X.rows();
    const Index dv = jp.fwd.V.cols();
    const Mat<double> XX = X * X.transpose();
    const Mat<double> QQ = jp.fwd.Q * jp.fwd.Q.transpose();
    L.assign(static_cast<std::size_t>(dv), Mat<double>());
    Mat<double> T(N, N);
    for (Index j = 0; j < dv; ++j) {
      Mat<double>& G = L[static_cast<std::size_t>(j)];
      G = S;
      T.noalias() = jp.B.middleRows(j * N, N) * jp.B.middleRows(j * N, N).transpose();
      G += XX.cwiseProduct(T);
      if (with_keys) {
        T.noalias() = jp.E.middleRows(j * N, N) * jp.E.middleRows(j * N, N).transpose();
        G += QQ.cwiseProduct(T);
      }
      const double shift = 64.0 * static_cast<double>(N) * ScalarTraits<double>::eps() *
                           std::max(G.diagonal().maxCoeff(), std::numeric_limits<double>::min());
      G.diagonal().array() += shift;
      if (!cholesky_in_place(G)) return false;
    }
    return true;
  }

  void apply(Mat<double>& B) const {
    for (std::size_t j = 0; j < L.size(); ++j) {
      auto seg = B.middleRows(static_cast<Index>(j) * N, N);
      L[j].triangularView<Eigen::Lower>().solveInPlace(seg);
      L[j].triangularView<Eigen::Lower>().transpose().solveInPlace(seg);
    }
  }
};

/// kappa_jacobian_matfree on inputs in double.
template <typename = void>
inline ConditionResult<double> matfree_condition(const KJInputs& in,
                                                 const JacobianKappaOptions& jo) {
  constexpr const char* fn = "kappa_jacobian_matfree";
  const double eps = ScalarTraits<double>::eps();
  LobpcgRun run("matfree", jo);
  if (!in.wide()) return run.decline_tall();
  const JacobianProducts<double> J(in.X, in.WQ, in.WK, in.WV, in.opts, JacobianBlock::All, fn);
  if (!run.find_sigma_max(J, in.rows, in.cols))
    return run.decline(Info::NotConverging, "Lanczos for sigma_max did not converge");
  if (jo.progress) jo.progress(0.05);
  // S = (P X)(P X)^T: J J^T >= J_V J_V^T = I ⊗ S (MATH.md §5, the bound without hypothesis).
  const Index N = in.X.rows();
  ChannelBlockPreconditioner M;
  double lower = 0;  // the proven lower bound σ_N(P X) on σ_min(J), where it is informative
  {
    JacobianParts<double> jp;
    jp.compute(in.X, in.WQ, in.WK, in.WV, in.opts, JacobianBlock::All);
    const Mat<double> S = jp.PX * jp.PX.transpose();
    Vec<double> mu;
    std::string why;
    if (symmetric_eigenvalues(S, true, mu, why).empty())
      return run.decline(Info::NotConverging,
                         "the eigenvalues of S = (P X)(P X)^T were not computed: " + why);
    // Clear of S's rounding, about N ε λ_max(S), σ_N(P X) bounds σ_min(J) from below.
    const double s_floor = static_cast<double>(N) * eps * mu(N - 1);
    if (mu(0) > 4 * s_floor) lower = std::sqrt(mu(0) - s_floor);
    if (!M.build(jp, in.X, S, !jp.fwd.rope.active))
      return run.decline(Info::Singular,
                         "a channel block of J J^T is not positive definite at working precision");
  }
  if (jo.progress) jo.progress(0.1);
  auto precondition = [&M](Mat<double>& B) { M.apply(B); };
  std::function<void(double)> inner;
  if (jo.progress) inner = [&](double f) { jo.progress(0.1 + 0.9 * f); };
  const LobpcgOutcome lo = lobpcg_sigma_min(J, precondition, run.res.sigma_max, jo.matfree, inner,
                                            LobpcgStop::Residual, run.res.rank_tol);
  run.res.iterations += lo.iterations;
  std::ostringstream note;
  note << "matfree: block " << std::min(jo.matfree.block, in.rows) << ", preconditioned by the "
       << in.WV.cols() << " channel blocks of J J^T (" << N << " x " << N << " each); "
       << lo.iterations << " iterations";
  if (auto d = run.decline_if_rank_level(lo.sigma, note.str())) return *d;
  if (!lo.converged)
    return run.decline(Info::NotConverging,
                       note.str() + ": did not converge in " +
                           std::to_string(jo.matfree.max_iterations) +
                           " iterations (residual bound " + std::to_string(lo.eta) +
                           "; raise matfree.max_iterations or matfree.block, or use method qr)");
  // The residual of the returned pair, recomputed from two fresh products: r = J J^T x - σ^2 x
  // with σ = ||J^T x||; some singular value is within η σ = ||r|| / σ of σ (lobpcg_sigma_min).
  Vec<double> y(in.cols), r(in.rows);
  J.apply_transpose(lo.x.data(), y.data());
  const double sigma = y.norm();
  J.apply(y.data(), r.data());
  r -= (sigma * sigma) * lo.x;
  const double eta = r.norm() / (sigma * sigma);
  run.res.residual = eta;
  note << ", residual bound eta = ||J J^T x - sigma^2 x|| / sigma^2 = " << eta;
  if (lower > 0) note << "; sigma_min >= sigma_N(PX) = " << lower << " (proven, MATH.md 5)";
  if (lower > sigma * (1 + eta + 64 * eps))
    return run.decline(Info::Inaccurate,
                       note.str() +
                           ": the Ritz value is below the proven lower bound sigma_N(PX), "
                           "so the iteration went wrong; use method qr");
  if (!(eta < 0.5))
    return run.decline(Info::NotConverging,
                       note.str() + ": the recomputed residual bound leaves no correct digit");
  return run.answer(sigma, eps * (run.res.sigma_max / sigma) + eta, in.rows, in.cols, note.str());
}

}  // namespace detail

/// κ(J) of a wide J by the matrix-free method (top of this header; MATH.md §12): nothing of order
/// (N d_v)^2 is formed, so it runs where gram, lobpcg and qr do not fit (a GPT-2 head at
/// N = 1024 has a 34 GB Gram matrix). σ_max by Lanczos on J J^T; σ_min by LOBPCG on J J^T with
/// the d_v channel blocks of J J^T as preconditioner (ChannelBlockPreconditioner), stopped on the
/// unpreconditioned residual. At the
/// end the residual of the Ritz pair is recomputed from two products: some singular value of J
/// lies within η σ of the answer, η = ||J J^T x - σ^2 x|| / σ^2. Stated accuracy ε κ + η.
/// Cost: the blocks (O(N^2 d_v (D + d_k)) flops, once), then per iteration `block` products with
/// J and J^T and d_v N^2 block solves per column.
/// Like lobpcg, it finds the smallest singular value from a random block, not by a certificate:
/// where N <= D and P X has full rank, the proven σ_min >= σ_N(P X) (MATH.md §5) is checked and
/// given in the note. It answers (Info::Success) only when the iteration converges, σ_min is
/// above the rank tolerance and the recomputed η is below 1/2; otherwise it says why and leaves
/// kappa NaN (Info::Singular for a tall J or a σ_min at rank level, Info::NotConverging,
/// Info::Inaccurate when the answer contradicts the proven bound).
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
