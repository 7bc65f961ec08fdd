// Precompiled instances behind spectral_cond_instances (CMakeLists.txt), for double: the heaviest
// templates of the library, compiled once. A target linked to spectral_cond_instances gets
// SPECTRAL_COND_EXTERN_INSTANCES, which turns on the matching `extern template` declarations at
// the ends of detail/svd.hpp, compressed.hpp, jacobian_kappa.hpp, bound.hpp and verify.hpp: its
// translation units then use these instead of instantiating them again. The library stays
// header-only for its users; this only shortens the project's own build (tests, tool, benchmarks).
#ifndef SPECTRAL_COND_EXTERN_INSTANCES
#define SPECTRAL_COND_EXTERN_INSTANCES
#endif
#include <spectral_cond/spectral_cond.hpp>
#include <spectral_cond/verify.hpp>

SPECTRAL_COND_SVD_CLASSES(, double)

namespace spectral_cond {
SPECTRAL_COND_COMPRESSED_CLASSES(, double)
SPECTRAL_COND_KAPPA_JACOBIAN(, double)
SPECTRAL_COND_THEOREM34(, double)
template VerifyReport verify_sweep<>(const VerifyOptions&);
}  // namespace spectral_cond
