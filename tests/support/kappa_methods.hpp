// Shared helpers of the κ(J) method tests: a scalar relative difference and options naming one
// method.
#pragma once

#include <spectral_cond/conditioning/methods/options.hpp>

#include <cmath>

namespace sc_test {

/// |a - b| / |b|: how far a result is from its reference, relative to the reference.
inline double rel(double a, double b) {
  return std::abs(a - b) / std::abs(b);
}

/// Default options with `method` chosen.
inline spectral_cond::JacobianKappaOptions with_method(spectral_cond::JacobianKappaMethod m) {
  spectral_cond::JacobianKappaOptions jo;
  jo.method = m;
  return jo;
}

}  // namespace sc_test
