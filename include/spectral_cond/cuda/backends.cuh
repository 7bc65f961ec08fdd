// spectral_cond CUDA path: the device backends of the CPU's κ(J) drivers (MATH.md §12), so that
// the GPU runs the CPU's own code with only the heavy products on the device:
//   DeviceOp          a Spectra operator on a device matrix (for the one Lanczos helper)
//   DeviceGram        the Gram backend of detail::gram_condition_of (conditioning/methods/gram.hpp)
//   DeviceTriangular  the triangular backend of detail::condition_of_triangular (methods/qr.hpp)
//   DeviceProducts    the products backend of detail::matfree_condition (methods/matfree.hpp,
//                     interface in methods/common.hpp): J x and J^T x by the device's JVP and VJP
// Each product copies x to the device, runs cuBLAS (and the softmax kernel), and copies y back.
#pragma once

#include "spectral_cond/conditioning/methods/gram.hpp"
#include "spectral_cond/conditioning/methods/qr.hpp"
#include "spectral_cond/cuda/attention.cuh"
#include "spectral_cond/cuda/context.cuh"
#include "spectral_cond/cuda/kernels.cuh"

#include <Spectra/SymEigsSolver.h>

#include <string>

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

/// The Gram backend (gram.hpp) of G (n x n, lower triangle, on the device, overwritten):
/// cuSOLVER syevd for every eigenvalue, potrf for the factor, cuBLAS symv and trsv for Lanczos.
class DeviceGram {
 public:
  DeviceGram(DeviceContext& ctx, double* G, int n) : ctx_(&ctx), G_(G), n_(n) {}
  Index order() const { return n_; }
  bool all_finite() {
    int* flag = ctx_->buffer<int>("flag", 1);
    SC_CUDA_CHECK(cudaMemsetAsync(flag, 0, sizeof(int), ctx_->stream()));
    kernels::launch("flag_nonfinite_lower", static_cast<size_t>(n_) * static_cast<size_t>(n_),
                    ctx_->stream(), kernels::flag_nonfinite_lower<double>,
                    static_cast<const double*>(G_), n_, flag);
    return read_int(flag) == 0;
  }
  std::string eigenvalues(Vec<double>& ascending, std::string& why) {
    double* w = ctx_->buffer<double>("eig", static_cast<size_t>(n_));
    const int lw = blas::syevd_lwork(ctx_->solver(), n_, G_, n_, w);
    double* work = ctx_->buffer<double>("solver_work", static_cast<size_t>(std::max(lw, 1)));
    int* info = ctx_->buffer<int>("info", 1);
    blas::syevd(ctx_->solver(), n_, G_, n_, w, work, lw, info);
    ascending.resize(n_);
    SC_CUDA_CHECK(cudaMemcpyAsync(ascending.data(), w, sizeof(double) * static_cast<size_t>(n_),
                                  cudaMemcpyDeviceToHost, ctx_->stream()));
    const int i = read_int(info);
    if (i == 0) return "cuSOLVER syevd";
    why = "cuSOLVER syevd returned info = " + std::to_string(i);
    return "";
  }
  DeviceOp product() const { return DeviceOp(*ctx_, G_, n_, OpKind::SymLower); }
  const char* cholesky_name() const { return "cuSOLVER Cholesky"; }
  bool factor() {
    const int lw = blas::potrf_lwork(ctx_->solver(), n_, G_, n_);
    double* work = ctx_->buffer<double>("solver_work", static_cast<size_t>(std::max(lw, 1)));
    int* info = ctx_->buffer<int>("info", 1);
    blas::potrf(ctx_->solver(), n_, G_, n_, work, lw, info);
    return read_int(info) == 0;
  }
  DeviceOp inverse() const { return DeviceOp(*ctx_, G_, n_, OpKind::CholInverse); }

 private:
  int read_int(const int* device_value) {
    int v = 0;
    SC_CUDA_CHECK(
        cudaMemcpyAsync(&v, device_value, sizeof(int), cudaMemcpyDeviceToHost, ctx_->stream()));
    SC_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream()));
    return v;
  }
  DeviceContext* ctx_;
  double* G_;
  int n_;
};

/// The triangular backend (qr.hpp) of R (k x k, upper, on the device): cuBLAS trmv and trsv for
/// Lanczos; R is copied to the host only for a dense SVD.
class DeviceTriangular {
 public:
  DeviceTriangular(DeviceContext& ctx, const double* R, int k) : ctx_(&ctx), R_(R), k_(k) {}
  Index order() const { return k_; }
  Vec<double> diagonal() const {
    Vec<double> diag(k_);
    SC_CUDA_CHECK(cudaMemcpy2DAsync(
        diag.data(), sizeof(double), R_, (static_cast<size_t>(k_) + 1) * sizeof(double),
        sizeof(double), static_cast<size_t>(k_), cudaMemcpyDeviceToHost, ctx_->stream()));
    SC_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream()));
    return diag;
  }
  Mat<double> matrix() const { return download(R_, k_, k_, ctx_->stream()); }
  DeviceOp gram() const { return DeviceOp(*ctx_, R_, k_, OpKind::TriGram); }
  DeviceOp inverse_gram() const { return DeviceOp(*ctx_, R_, k_, OpKind::TriGramInverse); }
  const char* library() const { return "cuBLAS "; }

 private:
  DeviceContext* ctx_;
  const double* R_;
  int k_;
};

/// The products backend (methods/common.hpp) of one head on the device, in double: J x by the
/// JVP and J^T x by the VJP of MATH.md §2 (attention.cuh's jvp and vjp, a few cuBLAS GEMMs and
/// the softmax kernel each), the forward pass run once in the constructor. The inputs are copied
/// into the context's workspace (buffers X, W_Q, ..., shared with the batched routines), so one
/// DeviceProducts at a time per context.
class DeviceProducts {
 public:
  DeviceProducts(DeviceContext& ctx, const Mat<double>& X, const Mat<double>& WQ,
                 const Mat<double>& WK, const Mat<double>& WV, const AttentionOptions<double>& opts)
      : ctx_(&ctx) {
    d_ = upload_batch(ctx,
                      AttentionBatch<double>::single(X, WQ, WK, WV, opts, "cuda::DeviceProducts"));
    forward(ctx, d_);
    rows_ = jacobian_rows(d_.N, d_.dv);
    cols_ = jacobian_cols(JacobianBlock::All, d_.N, d_.D, d_.dk, d_.dv);
    in_ = ctx.buffer<double>("products_in", static_cast<size_t>(std::max(rows_, cols_)));
    out_ = ctx.buffer<double>("products_out", static_cast<size_t>(std::max(rows_, cols_)));
  }
  Index rows() const { return rows_; }
  Index cols() const { return cols_; }

  /// y (rows) = J x (cols), x = [vec dW_Q; vec dW_K; vec dW_V]: one JVP.
  void apply(const double* x, double* y) const {
    copy_in(x, cols_);
    const size_t Dk = static_cast<size_t>(d_.sW(d_.dk));
    jvp<double>(*ctx_, d_, in_, in_ + Dk, in_ + 2 * Dk, nullptr, out_);
    copy_out(y, rows_);
  }

  /// y (cols) = J^T x (rows), x = vec G: one VJP without its X part.
  void apply_transpose(const double* x, double* y) const {
    copy_in(x, rows_);
    const size_t Dk = static_cast<size_t>(d_.sW(d_.dk));
    vjp<double>(*ctx_, d_, in_, out_, out_ + Dk, out_ + 2 * Dk, nullptr);
    copy_out(y, cols_);
  }

 private:
  void copy_in(const double* x, Index n) const {
    SC_CUDA_CHECK(cudaMemcpyAsync(in_, x, static_cast<size_t>(n) * sizeof(double),
                                  cudaMemcpyHostToDevice, ctx_->stream()));
  }
  void copy_out(double* y, Index n) const {
    SC_CUDA_CHECK(cudaMemcpyAsync(y, out_, static_cast<size_t>(n) * sizeof(double),
                                  cudaMemcpyDeviceToHost, ctx_->stream()));
    SC_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream()));
  }
  DeviceContext* ctx_;
  DeviceBatch<double> d_;
  Index rows_ = 0, cols_ = 0;
  double* in_ = nullptr;
  double* out_ = nullptr;
};

/// What matfree_condition calls to get its products backend: DeviceProducts on `ctx`.
struct DeviceProductsMaker {
  DeviceContext* ctx;
  DeviceProducts operator()(const Mat<double>& X, const Mat<double>& WQ, const Mat<double>& WK,
                            const Mat<double>& WV, const AttentionOptions<double>& opts) const {
    return DeviceProducts(*ctx, X, WQ, WK, WV, opts);
  }
};

}  // namespace detail
}  // namespace cuda
}  // namespace spectral_cond
