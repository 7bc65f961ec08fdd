// spectral-cond verify: the extended-precision re-checks (spectral_cond/testing/extended.hpp),
// compiled in their own translation unit (extended_rechecks.cpp) so that only it needs Boost
// and MPFR and instantiates the library in MPFR arithmetic.
#pragma once

#include "verify_types.hpp"

namespace spectral_cond::cli {

/// recheck_theorem34 and check_concatenation_extended, for VerifyOptions::rechecks.
VerifyRechecks extended_rechecks();

}  // namespace spectral_cond::cli
