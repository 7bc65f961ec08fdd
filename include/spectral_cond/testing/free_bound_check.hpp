// spectral_cond: the single check of the bound that needs no hypothesis (MATH.md §5, proven):
// κ(J) <= σ_max(J) / σ_N(P X) whenever N <= D and P X has full row rank. A violation beyond the
// rounding of both sides is a bug in the library (or in MATH.md).
#pragma once

#include "spectral_cond/conditioning/diagnostics.hpp"
#include "spectral_cond/testing/checks.hpp"

#include <string>

namespace spectral_cond {

/// Checks κ(J) (from `J`, computed independently of the bound, e.g. by a dense SVD) against
/// the bound `b` of the same inputs (hypothesis_free_bound); NotApplicable when N > D or P X is
/// rank-deficient, within the tolerance of free_bound_holds otherwise.
inline CheckResult check_hypothesis_free_bound(const HypothesisFreeBound& b,
                                               const ConditionResult<double>& J) {
  if (!b.applicable) return detail::not_applicable(b.note);
  return detail::check_result(free_bound_holds(b, J) ? CheckStatus::Held : CheckStatus::Violated,
                              J.kappa, b.bound, "kappa(J) against sigma_max(J) / sigma_N(P X)");
}

}  // namespace spectral_cond
