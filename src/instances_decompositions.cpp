// Precompiled instances behind spectral_cond_instances (CMakeLists.txt), part "decompositions" of
// the one list in include/spectral_cond/detail/instances.hpp, for S = INSTANCE_SCALAR (each part is
// compiled for float and for double). Targets linked to spectral_cond_instances get
// SPECTRAL_COND_EXTERN_INSTANCES, and with it the matching `extern template` declarations at the
// end of each header. The library stays header-only for its users; this only shortens the
// project's own build.
#include <spectral_cond/spectral_cond.hpp>

SPECTRAL_COND_INSTANCES_DECOMPOSITIONS(SPECTRAL_COND_INSTANCE_DEFINE, INSTANCE_SCALAR)
