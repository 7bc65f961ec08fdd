// spectral-cond: `--device cpu|cuda`. With cuda, the condition numbers that `kappa` and
// `analyze` compute (κ of weight matrices, κ(J) of attention heads) run on the GPU through
// spectral_cond::cuda (docs/cuda.md); everything else (reading, the other terms of Theorem 3.4,
// the corrections' reports) stays on the CPU. Without a CUDA build, or without a visible GPU,
// `--device cuda` is an input error (exit 2) that says which.
#pragma once

#include "inputs.hpp"

#include <spectral_cond/conditioning/kappa.hpp>
#include <spectral_cond/conditioning/methods/kappa_jacobian.hpp>

#ifdef SPECTRAL_COND_HAVE_CUDA
#include <spectral_cond/cuda/api.hpp>

#include <memory>
#endif

#include <string>
#include <vector>

namespace spectral_cond::engine {

/// True when this build has the CUDA path.
inline constexpr bool built_with_cuda() {
#ifdef SPECTRAL_COND_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

/// Checks `--device` before any work: cpu always works; cuda needs a CUDA build, a visible GPU
/// and a κ(J) method that has a GPU route (auto, gram, qr or matfree).
inline void require_device(const std::string& device, JacobianKappaMethod method) {
  if (device != "cuda") return;
  if (!built_with_cuda())
    throw BadInput(
        "--device cuda: spectral-cond was built without CUDA (configure with "
        "-DSPECTRAL_COND_ENABLE_CUDA=ON)");
  if (method == JacobianKappaMethod::Dense || method == JacobianKappaMethod::Iterative ||
      method == JacobianKappaMethod::Lobpcg)
    throw BadInput(std::string("--device cuda: --method ") + to_string(method) +
                   " has no GPU route (use auto, gram, qr or matfree)");
#ifdef SPECTRAL_COND_HAVE_CUDA
  if (!cuda::available())
    throw BadInput("--device cuda: no CUDA device is visible (cudaGetDeviceCount found none)");
#endif
}

#ifdef SPECTRAL_COND_HAVE_CUDA
/// One context (cuBLAS/cuSOLVER handles, streams, workspace) for the whole process.
inline cuda::Context& device_context() {
  static std::unique_ptr<cuda::Context> ctx;
  if (!ctx) ctx = std::make_unique<cuda::Context>(0);
  return *ctx;
}
#endif

/// κ of every matrix on the GPU (cuda::kappa_batched). Only after require_device("cuda").
inline std::vector<ConditionResult<double>> device_kappa(const std::vector<Mat<double>>& ms,
                                                         const KappaOptions<double>& ko) {
#ifdef SPECTRAL_COND_HAVE_CUDA
  return cuda::kappa_batched<double>(device_context(), ms, ko);
#else
  (void)ms;
  (void)ko;
  throw Error(kInternalError, "device_kappa called in a build without CUDA");
#endif
}

/// κ(J) of the heads (X, W_Q[i], W_K[i], W_V[i]) on the GPU, batched
/// (cuda::kappa_jacobian_batched). Only after require_device("cuda").
inline std::vector<ConditionResult<double>> device_kappa_jacobian(
    const Mat<double>& X, const std::vector<Mat<double>>& WQ, const std::vector<Mat<double>>& WK,
    const std::vector<Mat<double>>& WV, const AttentionOptions<double>& opts,
    const JacobianKappaOptions& jo) {
#ifdef SPECTRAL_COND_HAVE_CUDA
  cuda::AttentionBatch<double> b;
  b.X.push_back(X);
  b.WQ = WQ;
  b.WK = WK;
  b.WV = WV;
  b.opts = opts;
  cuda::CudaKappaOptions co;
  co.jacobian = jo;
  co.qr.rtol = jo.rtol;
  return cuda::kappa_jacobian_batched<double>(device_context(), b, co);
#else
  (void)X, (void)WQ, (void)WK, (void)WV, (void)opts, (void)jo;
  throw Error(kInternalError, "device_kappa_jacobian called in a build without CUDA");
#endif
}

}  // namespace spectral_cond::engine
