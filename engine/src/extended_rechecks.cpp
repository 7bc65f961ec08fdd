// spectral-cond verify: the extended-precision re-checks (see extended_rechecks.hpp).
#include <spectral_cond/engine/extended_rechecks.hpp>

#include <spectral_cond/testing/extended.hpp>

namespace spectral_cond::engine {

VerifyRechecks extended_rechecks() {
  VerifyRechecks r;
  r.theorem34 = [](const Mat<double>& X, const Mat<double>& WQ, const Mat<double>& WK,
                   const Mat<double>& WV, const AttentionOptions<double>& opts) {
    return recheck_theorem34(X, WQ, WK, WV, opts);
  };
  r.concatenation = [](const std::vector<Mat<double>>& blocks) {
    return check_concatenation_extended(blocks);
  };
  return r;
}

}  // namespace spectral_cond::engine
