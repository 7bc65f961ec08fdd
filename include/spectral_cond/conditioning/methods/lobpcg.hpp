// spectral_cond: κ(J) of a wide J by LOBPCG on J J^T, preconditioned by the Cholesky factor of the
// structured Gram matrix, every product by J and J^T matrix-free (MATH.md §12). Gram's rounding
// only slows the iteration; its fixed point is set by products with J: accuracy about ε κ(J).
#pragma once

#include "spectral_cond/conditioning/methods/common.hpp"
#include "spectral_cond/jacobian/gram.hpp"
#include "spectral_cond/jacobian/operators.hpp"
#include "spectral_cond/linalg/cholesky.hpp"
#include "spectral_cond/linalg/lanczos.hpp"
#include "spectral_cond/linalg/lobpcg.hpp"

namespace spectral_cond {

namespace detail {

/// kappa_jacobian_lobpcg on inputs in double; `L`, when not empty, is the Cholesky factor of
/// J J^T that gram_condition already computed.
template <typename = void>
inline ConditionResult<double> lobpcg_condition(const KJInputs& in, const JacobianKappaOptions& jo,
                                                Mat<double> L) {
  constexpr const char* fn = "kappa_jacobian_lobpcg";
  LobpcgRun run("lobpcg", jo);
  if (!in.wide()) return run.decline_tall();
  const Index m = in.rows;
  const JacobianProducts<double> J(in.X, in.WQ, in.WK, in.WV, in.opts, JacobianBlock::All, fn);
  if (!run.find_sigma_max(J, in.rows, in.cols))
    return run.decline(Info::NotConverging, "Lanczos for sigma_max did not converge");
  if (jo.progress) jo.progress(0.05);
  // The preconditioner: G~ = L L^T, the structured Gram matrix (gram.hpp). When rounding has made
  // G~ indefinite (ε κ^2 well above 1), G~ cannot tell the smallest singular directions apart
  // and the iteration could settle on the wrong one: no answer then (qr is the method for it).
  std::ostringstream note;
  note << "lobpcg: block " << std::min(jo.lobpcg.block, m)
       << ", preconditioned by the Cholesky factor of J J^T (" << m << " x " << m
       << (L.rows() == m ? ", gram's" : "") << ")";
  if (L.rows() != m) {
    L = attention_gram(in.X, in.WQ, in.WK, in.WV, in.opts);
    if (jo.progress) jo.progress(0.25);
    if (!cholesky_in_place(L))
      // Not a singular verdict: an ill-conditioned J (eps kappa^2 >~ 1) looks the same here.
      return run.decline(Info::Inaccurate, note.str() +
                                               ": J J^T is not positive definite at working "
                                               "precision (eps kappa^2 >~ 1, or J singular)");
  }
  if (jo.progress) jo.progress(0.55);
  std::function<void(double)> inner;
  if (jo.progress) inner = [&](double f) { jo.progress(0.55 + 0.45 * f); };
  auto precondition = [&L](Mat<double>& B) {
    lower_solve(L, B, false);
    lower_solve(L, B, true);
  };
  const LobpcgOutcome lo = lobpcg_sigma_min(J, precondition, run.res.sigma_max, jo.lobpcg, inner);
  run.res.iterations += lo.iterations;
  run.res.residual = lo.rho;
  note << "; " << lo.iterations << " iterations, residual bound rho = " << lo.rho;
  if (auto d = run.decline_if_rank_level(lo.sigma, note.str())) return *d;
  if (!lo.converged)
    return run.decline(Info::NotConverging, note.str() + ": did not converge in " +
                                                std::to_string(jo.lobpcg.max_iterations) +
                                                " iterations (raise lobpcg.max_iterations or "
                                                "lobpcg.block, or use method qr)");
  // ε κ from the products with J; ρ / 2 from the iteration, times 1 + ε κ^2 for the distance of
  // the preconditioner from (J J^T)^{-1} (lobpcg_sigma_min).
  const double kappa = run.res.sigma_max / lo.sigma;
  const double eps_kappa = ScalarTraits<double>::eps() * kappa;
  return run.answer(lo.sigma, eps_kappa + (1 + eps_kappa * kappa) * lo.rho / 2, in.rows, in.cols,
                    note.str());
}

}  // namespace detail

/// κ(J) of a wide J (N d_v <= columns) by the lobpcg method (top of this header; MATH.md §3-4):
/// σ_max by Lanczos on J J^T (matrix-free; squaring does not hurt the largest), σ_min by
/// detail::lobpcg_sigma_min with the Cholesky factor of the structured Gram matrix as
/// preconditioner. Accuracy about ε κ(J) + (1 + ε κ(J)^2) ρ / 2 (field `accuracy`; ρ in
/// `residual`): ε κ where ε κ^2 is small, more where the preconditioner is poor. Cost: the
/// Gram matrix, one Cholesky factorisation ((N d_v)^3 / 3 flops, (N d_v)^2 doubles) and a few
/// LOBPCG iterations of O((N d_v)^2 block) each.
/// It answers (Info::Success) only when the iteration converges and σ_min is above the rank
/// tolerance. Otherwise it says why and leaves kappa NaN: Info::Singular when J is tall (the
/// gauge directions are in its null space, MATH.md §4), when the computed J J^T is not positive
/// definite (ε κ^2 well above 1, or J singular), or when σ_min is below the rank tolerance (rank
/// and kappa_plus then need qr or dense); Info::NotConverging when the iteration does not
/// converge. kappa_jacobian with method lobpcg or auto then calls qr.
template <typename Scalar>
ConditionResult<double> kappa_jacobian_lobpcg(const CRef<Scalar>& X, const CRef<Scalar>& WQ,
                                              const CRef<Scalar>& WK, const CRef<Scalar>& WV,
                                              const AttentionOptions<Scalar>& opts,
                                              const JacobianKappaOptions& jo = {}) {
  if (auto bad = detail::check_kj_inputs<Scalar>("kappa_jacobian_lobpcg", X, WQ, WK, WV, opts, jo,
                                                 "lobpcg"))
    return *bad;
  const detail::KJInputs in = detail::kj_inputs<Scalar>(X, WQ, WK, WV, opts);
  return detail::validated(in, detail::lobpcg_condition(in, jo, {}), jo);
}

}  // namespace spectral_cond
