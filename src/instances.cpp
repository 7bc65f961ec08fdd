// The precompiled instances behind spectral_cond_instances (CMakeLists.txt): every group of the one
// list in include/spectral_cond/detail/instances.hpp, for S = INSTANCE_SCALAR (this file is
// compiled twice, for float and for double, so that the two halves build in parallel). Targets
// linked to spectral_cond_instances get SPECTRAL_COND_EXTERN_INSTANCES, and with it the matching
// `extern template` declarations at the end of each header. The library stays header-only for
// its users; this only shortens the project's own build.
#include <spectral_cond/spectral_cond.hpp>

SPECTRAL_COND_ALL_INSTANCES(SPECTRAL_COND_INSTANCE_DEFINE, INSTANCE_SCALAR)
