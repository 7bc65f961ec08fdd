// spectral_cond CUDA path: device operators for Spectra's Lanczos (the CPU path's solver), so
// that σ_max and σ_min of large Gram and triangular matrices never leave the device. Each
// perform_op copies x to the device, applies cuBLAS level-2 products or solves, and copies back.
#pragma once

#include "spectral_cond/conditioning/methods/qr.hpp"
#include "spectral_cond/cuda/context.cuh"

#include <Spectra/SymEigsSolver.h>

#include <random>

namespace spectral_cond {
namespace cuda {
namespace detail {

/// Which product a DeviceOp applies.
enum class OpKind {
  SymLower,       ///< y = G x, G symmetric with its lower triangle stored
  CholInverse,    ///< y = G^{-1} x = L^{-T} L^{-1} x, L lower (potrf)
  TriGram,        ///< y = R^T R x, R upper
  TriGramInverse  ///< y = R^{-1} R^{-T} x, R upper
};

/// Spectra operator on a device matrix (double). The matrix must outlive the operator.
class DeviceOp {
 public:
  using Scalar = double;
  DeviceOp(DeviceContext& ctx, const double* M, int n, OpKind kind)
      : ctx_(&ctx), M_(M), n_(n), kind_(kind) {
    x_ = ctx.buffer<double>("lanczos_x", static_cast<size_t>(n));
    y_ = ctx.buffer<double>("lanczos_y", static_cast<size_t>(n));
  }
  Index rows() const { return n_; }
  Index cols() const { return n_; }
  void perform_op(const double* x, double* y) const {
    cudaStream_t s = ctx_->stream();
    cublasHandle_t h = ctx_->blas();
    const size_t bytes = static_cast<size_t>(n_) * sizeof(double);
    SC_CUDA_CHECK(cudaMemcpyAsync(x_, x, bytes, cudaMemcpyHostToDevice, s));
    double* out = x_;
    switch (kind_) {
      case OpKind::SymLower:
        blas::symv_lower(h, n_, M_, n_, x_, y_);
        out = y_;
        break;
      case OpKind::CholInverse:
        blas::trsv(h, false, false, n_, M_, n_, x_);  // L z = x
        blas::trsv(h, false, true, n_, M_, n_, x_);   // L^T y = z
        break;
      case OpKind::TriGram:
        blas::trmv(h, true, false, n_, M_, n_, x_);  // R x
        blas::trmv(h, true, true, n_, M_, n_, x_);   // R^T (R x)
        break;
      case OpKind::TriGramInverse:
        blas::trsv(h, true, true, n_, M_, n_, x_);   // R^T z = x
        blas::trsv(h, true, false, n_, M_, n_, x_);  // R y = z
        break;
    }
    SC_CUDA_CHECK(cudaMemcpyAsync(y, out, bytes, cudaMemcpyDeviceToHost, s));
    SC_CUDA_CHECK(cudaStreamSynchronize(s));
  }

 private:
  DeviceContext* ctx_;
  const double* M_;
  int n_;
  OpKind kind_;
  double* x_ = nullptr;
  double* y_ = nullptr;
};

/// The device twin of the CPU's detail::condition_of_r (qr_kappa.hpp) for an R (k x k, upper,
/// on the device) of order >= 64 with k = min(m_J, n_J): σ_max by Lanczos on R^T R, σ_min by
/// Lanczos on (R^T R)^{-1}; the dense fallbacks of the CPU code copy R to the host.
inline ConditionResult<double> device_condition_of_r(DeviceContext& ctx, const double* R, int k,
                                                     Index mJ, Index nJ, bool tall,
                                                     const QrKappaOptions& q,
                                                     std::ostringstream& note) {
  auto host_r = [&] { return download(R, k, k, ctx.stream()); };
  Vec<double> diag(k);
  SC_CUDA_CHECK(cudaMemcpy2DAsync(diag.data(), sizeof(double), R,
                                  (static_cast<size_t>(k) + 1) * sizeof(double), sizeof(double),
                                  static_cast<size_t>(k), cudaMemcpyDeviceToHost, ctx.stream()));
  SC_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));
  const bool singular_diag = (diag.array() == 0.0).any();
  DeviceOp gram(ctx, R, k, OpKind::TriGram), inverse_gram(ctx, R, k, OpKind::TriGramInverse);
  // The CPU's one Lanczos helper (linalg/lanczos.hpp) on the device operators.
  const LanczosOutcome big = spectral_cond::detail::lanczos_largest(gram, q.lanczos);
  LanczosOutcome small;
  LanczosOptions lo = q.lanczos;
  lo.seed = q.lanczos.seed + 1;
  if (!singular_diag) small = spectral_cond::detail::lanczos_largest(inverse_gram, lo);
  note << "; sigma_max by Lanczos on R^T R (" << big.operations << " products, cuBLAS trmv), "
       << "sigma_min by Lanczos on (R^T R)^{-1} (" << small.operations
       << " pairs of cuBLAS triangular solves, relative residual " << small.residual << ")";
  std::optional<ConditionResult<double>> res =
      spectral_cond::detail::condition_from_lanczos(big, small, singular_diag, k, mJ, nJ, q, note);
  if (res) return *res;
  // the CPU's dense fallback, on the host
  std::ostringstream host_note;
  ConditionResult<double> d =
      spectral_cond::detail::condition_of_r(host_r(), mJ, nJ, tall, q, host_note);
  note << host_note.str();
  return d;
}

}  // namespace detail
}  // namespace cuda
}  // namespace spectral_cond
