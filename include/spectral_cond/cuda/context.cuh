// spectral_cond CUDA path: the device context (docs/cuda.md). One DeviceContext holds the
// device's cuBLAS and cuSOLVER handles, a few streams ("lanes", each with its own handles, for
// independent work such as per-matrix SVDs), and named workspace buffers that are allocated once
// per shape and reused by every later call of the same or a smaller shape.
#pragma once

#include "spectral_cond/core/common.hpp"
#include "spectral_cond/cuda/blas.cuh"

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace spectral_cond {
namespace cuda {

/// One stream with its own cuBLAS handle, cuSOLVER handle and gesvdj parameters.
struct Lane {
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  cusolverDnHandle_t solver = nullptr;
  gesvdjInfo_t svdj = nullptr;
};

/// Handles, streams and reusable device workspace for one device. Not thread-safe: one
/// DeviceContext per host thread. Every member function may throw CudaError.
class DeviceContext {
 public:
  /// Selects `device` and creates `lanes` (>= 1) streams with their handles.
  explicit DeviceContext(int device = 0, int lanes = 4) : device_(device) {
    if (lanes < 1) throw std::invalid_argument("DeviceContext: lanes must be >= 1");
    SC_CUDA_CHECK(cudaSetDevice(device));
    cudaDeviceProp prop{};
    SC_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    name_ = prop.name;
    total_memory_ = prop.totalGlobalMem;
    for (int i = 0; i < lanes; ++i) {
      Lane l;
      SC_CUDA_CHECK(cudaStreamCreateWithFlags(&l.stream, cudaStreamNonBlocking));
      lanes_.push_back(l);  // pushed first so that the destructor frees what was made
      Lane& b = lanes_.back();
      SC_CUBLAS_CHECK(cublasCreate(&b.blas));
      SC_CUBLAS_CHECK(cublasSetStream(b.blas, b.stream));
      SC_CUSOLVER_CHECK(cusolverDnCreate(&b.solver));
      SC_CUSOLVER_CHECK(cusolverDnSetStream(b.solver, b.stream));
      SC_CUSOLVER_CHECK(cusolverDnCreateGesvdjInfo(&b.svdj));
    }
  }
  DeviceContext(const DeviceContext&) = delete;
  DeviceContext& operator=(const DeviceContext&) = delete;
  ~DeviceContext() {
    buffers_.clear();
    for (Lane& l : lanes_) {
      if (l.svdj) (void)cusolverDnDestroyGesvdjInfo(l.svdj);
      if (l.solver) (void)cusolverDnDestroy(l.solver);
      if (l.blas) (void)cublasDestroy(l.blas);
      if (l.stream) (void)cudaStreamDestroy(l.stream);
    }
  }

  int device() const { return device_; }
  const std::string& name() const { return name_; }
  std::size_t total_memory() const { return total_memory_; }
  int lanes() const { return static_cast<int>(lanes_.size()); }
  Lane& lane(int i = 0) { return lanes_[static_cast<size_t>(i % lanes())]; }
  cublasHandle_t blas() { return lanes_[0].blas; }
  cusolverDnHandle_t solver() { return lanes_[0].solver; }
  cudaStream_t stream() { return lanes_[0].stream; }

  /// The workspace buffer called `name`, with room for at least n elements of T (grown when
  /// needed, never shrunk: steady-state calls of one shape allocate nothing).
  template <typename T>
  T* buffer(const std::string& name, std::size_t n) {
    auto& b = buffers_[name];
    return reinterpret_cast<T*>(b.ensure(n * sizeof(T), name.c_str()));
  }
  /// Frees every workspace buffer (handles and streams stay).
  void release_buffers() { buffers_.clear(); }
  /// Bytes held by the workspace buffers.
  std::size_t workspace_bytes() const {
    std::size_t s = 0;
    for (const auto& kv : buffers_) s += kv.second.capacity();
    return s;
  }

  /// Waits for every lane.
  void synchronize() {
    for (Lane& l : lanes_) SC_CUDA_CHECK(cudaStreamSynchronize(l.stream));
  }

 private:
  int device_ = 0;
  std::string name_;
  std::size_t total_memory_ = 0;
  std::vector<Lane> lanes_;
  std::map<std::string, DeviceBuffer<unsigned char>> buffers_;
};

/// Host -> device copy of a column-major matrix (contiguous, as Mat is), on `stream`.
template <typename Scalar>
void upload(const Mat<Scalar>& m, Scalar* dst, cudaStream_t stream) {
  if (m.size() == 0) return;
  SC_CUDA_CHECK(cudaMemcpyAsync(dst, m.data(), static_cast<size_t>(m.size()) * sizeof(Scalar),
                                cudaMemcpyHostToDevice, stream));
}
/// Device -> host copy into `m` (already of the right shape); waits for `stream`.
template <typename Scalar>
void download(const Scalar* src, Mat<Scalar>& m, cudaStream_t stream) {
  if (m.size() == 0) return;
  SC_CUDA_CHECK(cudaMemcpyAsync(m.data(), src, static_cast<size_t>(m.size()) * sizeof(Scalar),
                                cudaMemcpyDeviceToHost, stream));
  SC_CUDA_CHECK(cudaStreamSynchronize(stream));
}
/// Device -> new host matrix of rows x cols.
template <typename Scalar>
Mat<Scalar> download(const Scalar* src, Index rows, Index cols, cudaStream_t stream) {
  Mat<Scalar> m(rows, cols);
  download(src, m, stream);
  return m;
}

/// int that cuBLAS and cuSOLVER take, checked: throws when a dimension exceeds 2^31 - 1.
inline int to_int(Index v, const char* what) {
  if (v < 0 || v > Index(2147483647))
    throw std::invalid_argument(std::string("spectral_cond::cuda: ") + what + " = " +
                                std::to_string(v) + " exceeds the 32-bit range of cuBLAS/cuSOLVER");
  return static_cast<int>(v);
}

}  // namespace cuda
}  // namespace spectral_cond
