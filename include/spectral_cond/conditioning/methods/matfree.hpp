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
#include "spectral_cond/conditioning/methods/matfree_preconditioner.hpp"
#include "spectral_cond/jacobian/compressed.hpp"
#include "spectral_cond/jacobian/jacobian.hpp"
#include "spectral_cond/jacobian/operators.hpp"
#include "spectral_cond/linalg/cholesky.hpp"
#include "spectral_cond/linalg/eigen.hpp"
#include "spectral_cond/linalg/lanczos.hpp"
#include "spectral_cond/linalg/lobpcg.hpp"

namespace spectral_cond {

namespace detail {

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
  template <typename = void>  // compiled only where called
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
