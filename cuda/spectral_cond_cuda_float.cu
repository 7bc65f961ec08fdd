// The spectral_cond::cuda library, part 2 of 2: the float instantiation of
// spectral_cond/cuda/api.hpp (docs/cuda.md).
#include "instantiate.cuh"

namespace spectral_cond {
namespace cuda {
SC_INSTANTIATE(float)
}  // namespace cuda
}  // namespace spectral_cond
