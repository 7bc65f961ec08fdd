// spectral_cond CUDA path, everything (docs/cuda.md): include this from a .cu file compiled by
// nvcc to use the device templates directly. Host code compiled by another compiler includes
// spectral_cond/cuda/api.hpp and links spectral_cond::cuda instead.
// Eigen must not add __device__ annotations here: compile with -DEIGEN_NO_CUDA (the
// spectral_cond::cuda target does), as the device code never touches Eigen types.
//
// The non-template parts of the API (device_count, device_name, Context) are defined in exactly
// one translation unit: the one that defines SPECTRAL_COND_CUDA_IMPLEMENTATION before including
// this header (the spectral_cond::cuda library does; a program that includes this header
// without linking that library must do it in one of its .cu files).
#pragma once

#include "spectral_cond/cuda/api.hpp"
#include "spectral_cond/cuda/attention.cuh"
#include "spectral_cond/cuda/context.cuh"
#include "spectral_cond/cuda/error.cuh"
#include "spectral_cond/cuda/gram.cuh"
#include "spectral_cond/cuda/kappa_jacobian.cuh"
#include "spectral_cond/cuda/weights.cuh"

#ifdef SPECTRAL_COND_CUDA_IMPLEMENTATION
namespace spectral_cond {
namespace cuda {

int device_count() noexcept {
  return device_count_noexcept();
}

std::string device_name(int device) {
  cudaDeviceProp prop{};
  SC_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return prop.name;
}

Context::Context(int device, int lanes) : impl_(std::make_unique<DeviceContext>(device, lanes)) {}
Context::~Context() = default;
Context::Context(Context&&) noexcept = default;
Context& Context::operator=(Context&&) noexcept = default;
const std::string& Context::device_name() const {
  return impl_->name();
}
std::size_t Context::workspace_bytes() const {
  return impl_->workspace_bytes();
}
void Context::release_workspace() {
  impl_->release_buffers();
}
DeviceContext& Context::device() {
  return *impl_;
}

}  // namespace cuda
}  // namespace spectral_cond
#endif  // SPECTRAL_COND_CUDA_IMPLEMENTATION
