// spectral_cond: exact scaling by powers of two (MATH.md §4, "Scaling into range").
//
// κ of a matrix does not change when the matrix is multiplied by a number, and κ(J) does not
// change under (X, W) -> (X / s, W s). With s a power of two the multiplication is exact as long
// as the results stay normal numbers, so an input whose entries lie near the underflow or
// overflow threshold of its type can be brought to entries of order 1 and the singular values
// scaled back afterwards. The factor 2^k is never formed as a number (2^-1074 and 2^1074 are
// both out of range): every entry is multiplied by std::ldexp.
#pragma once

#include "spectral_cond/core/common.hpp"

#include <cmath>
#include <limits>

namespace spectral_cond {

/// The k that brings a magnitude `top` into [1, 2) by top 2^k; 0 for zero, NaN or Inf.
inline int balancing_exponent_of(double top) {
  top = std::abs(top);
  if (top == 0 || !std::isfinite(top)) return 0;
  int e = 0;
  (void)std::frexp(top, &e);  // top = f 2^e with f in [1/2, 1)
  return 1 - e;
}

/// The k that brings max |M_ij| into [1, 2) by M 2^k; 0 for an empty or zero M, or one that
/// holds NaN or Inf (those are refused elsewhere, with their own message).
template <typename Scalar>
int balancing_exponent(const CRef<Scalar>& M) {
  if (M.size() == 0 || !M.allFinite()) return 0;
  return balancing_exponent_of(static_cast<double>(M.cwiseAbs().maxCoeff()));
}

/// M 2^k entry by entry (std::ldexp): exact wherever the result is a normal number.
template <typename Scalar>
Mat<Scalar> times_pow2(const CRef<Scalar>& M, int k) {
  return M.unaryExpr([k](Scalar x) { return static_cast<Scalar>(std::ldexp(x, k)); });
}

/// Whether a nonzero magnitude lies in the range where products of a few such numbers stay
/// normal: [2^-(max_exp - 53), 2^(max_exp - 53)] for doubles, about [1e-292, 1e292].
inline bool comfortably_normal(double magnitude) {
  constexpr int room = std::numeric_limits<double>::max_exponent - 53;
  return magnitude == 0 || (std::isfinite(magnitude) && magnitude >= std::ldexp(1.0, -room) &&
                            magnitude <= std::ldexp(1.0, room));
}

}  // namespace spectral_cond
