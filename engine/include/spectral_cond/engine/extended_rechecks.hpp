// The engine's verify: the extended-precision re-checks (spectral_cond/testing/extended.hpp),
// compiled in their own library (src/extended_rechecks.cpp, spectral_cond_rechecks) so that only
// it needs Boost and MPFR and instantiates the library in MPFR arithmetic. Built without them
// (SPECTRAL_COND_EXTENDED=OFF), extended_rechecks() is empty and verify's report says that its
// violations were not re-checked.
#pragma once

#include "verify_types.hpp"

namespace spectral_cond::engine {

/// recheck_theorem34 and check_concatenation_extended, for VerifyOptions::rechecks.
#ifdef SPECTRAL_COND_HAVE_EXTENDED
VerifyRechecks extended_rechecks();
#else
inline VerifyRechecks extended_rechecks() {
  return {};
}
#endif

}  // namespace spectral_cond::engine
