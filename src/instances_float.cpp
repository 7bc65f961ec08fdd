// Precompiled instances behind spectral_cond_instances (CMakeLists.txt), for float: the heaviest
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

SPECTRAL_COND_SVD_CLASSES(, float)

namespace spectral_cond {
SPECTRAL_COND_COMPRESSED_CLASSES(, float)
SPECTRAL_COND_KAPPA_JACOBIAN(, float)
SPECTRAL_COND_THEOREM34(, float)
}  // namespace spectral_cond
