// The spectral_cond::cuda library, part 1 of 2: the non-template host API (device_count,
// device_name, Context) and the double instantiation of spectral_cond/cuda/api.hpp, so that host
// code built by g++/clang++ can call the GPU path (docs/cuda.md).
#define SPECTRAL_COND_CUDA_IMPLEMENTATION
#include "instantiate.cuh"

namespace spectral_cond {
namespace cuda {
SC_INSTANTIATE(double)
}  // namespace cuda
}  // namespace spectral_cond
