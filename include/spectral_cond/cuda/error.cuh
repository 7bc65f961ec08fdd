// spectral_cond CUDA path: error checking and device memory (docs/cuda.md).
//
// Every CUDA runtime, cuBLAS and cuSOLVER call goes through one of the SC_CUDA_CHECK,
// SC_CUBLAS_CHECK or SC_CUSOLVER_CHECK macros, which throw spectral_cond::cuda::CudaError naming
// the call, its status and the source line. Device allocations go through DeviceBuffer, which
// reports the requested size when the device is out of memory (CudaOutOfMemory).
// Never included by the umbrella header spectral_cond.hpp (STYLE.md habit 12).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>

#include <cstddef>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace spectral_cond {
namespace cuda {

/// A failed CUDA, cuBLAS or cuSOLVER call: what() names the call, the status and the place.
class CudaError : public std::runtime_error {
 public:
  CudaError(const std::string& call, const std::string& status, const char* file, int line)
      : std::runtime_error(make(call, status, file, line)), call_(call), status_(status) {}
  const std::string& call() const { return call_; }
  const std::string& status() const { return status_; }

 private:
  static std::string make(const std::string& call, const std::string& status, const char* file,
                          int line) {
    std::ostringstream s;
    s << "CUDA error: " << call << " returned " << status << " (" << file << ":" << line << ")";
    return s.str();
  }
  std::string call_, status_;
};

/// cudaMalloc failed for lack of device memory; bytes() is the size that was asked for.
class CudaOutOfMemory : public CudaError {
 public:
  CudaOutOfMemory(std::size_t bytes, const std::string& what, const char* file, int line)
      : CudaError("cudaMalloc(" + what + ", " + std::to_string(bytes) + " bytes = " +
                      std::to_string(static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0)) +
                      " GiB)",
                  "cudaErrorMemoryAllocation (out of device memory)", file, line),
        bytes_(bytes) {}
  std::size_t bytes() const { return bytes_; }

 private:
  std::size_t bytes_;
};

inline const char* cublas_status_name(cublasStatus_t s) {
  return cublasGetStatusName(s);  // cuBLAS's own names (CUDA 11.4 and later)
}

inline const char* cusolver_status_name(cusolverStatus_t s) {
  switch (s) {
    case CUSOLVER_STATUS_SUCCESS:
      return "CUSOLVER_STATUS_SUCCESS";
    case CUSOLVER_STATUS_NOT_INITIALIZED:
      return "CUSOLVER_STATUS_NOT_INITIALIZED";
    case CUSOLVER_STATUS_ALLOC_FAILED:
      return "CUSOLVER_STATUS_ALLOC_FAILED";
    case CUSOLVER_STATUS_INVALID_VALUE:
      return "CUSOLVER_STATUS_INVALID_VALUE";
    case CUSOLVER_STATUS_ARCH_MISMATCH:
      return "CUSOLVER_STATUS_ARCH_MISMATCH";
    case CUSOLVER_STATUS_EXECUTION_FAILED:
      return "CUSOLVER_STATUS_EXECUTION_FAILED";
    case CUSOLVER_STATUS_INTERNAL_ERROR:
      return "CUSOLVER_STATUS_INTERNAL_ERROR";
    case CUSOLVER_STATUS_MATRIX_TYPE_NOT_SUPPORTED:
      return "CUSOLVER_STATUS_MATRIX_TYPE_NOT_SUPPORTED";
    case CUSOLVER_STATUS_NOT_SUPPORTED:
      return "CUSOLVER_STATUS_NOT_SUPPORTED";
    default:
      return "CUSOLVER_STATUS_<unknown>";
  }
}

namespace detail {
inline void check_cuda(cudaError_t e, const char* call, const char* file, int line) {
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // clear a sticky-free error so later calls are not blamed
    throw CudaError(call, std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")",
                    file, line);
  }
}
inline void check_cublas(cublasStatus_t s, const char* call, const char* file, int line) {
  if (s != CUBLAS_STATUS_SUCCESS) throw CudaError(call, cublas_status_name(s), file, line);
}
inline void check_cusolver(cusolverStatus_t s, const char* call, const char* file, int line) {
  if (s != CUSOLVER_STATUS_SUCCESS) throw CudaError(call, cusolver_status_name(s), file, line);
}
}  // namespace detail

}  // namespace cuda
}  // namespace spectral_cond

/// Throws spectral_cond::cuda::CudaError naming `call` unless it returns cudaSuccess.
#define SC_CUDA_CHECK(call) \
  ::spectral_cond::cuda::detail::check_cuda((call), #call, __FILE__, __LINE__)
/// Throws unless the cuBLAS call returns CUBLAS_STATUS_SUCCESS.
#define SC_CUBLAS_CHECK(call) \
  ::spectral_cond::cuda::detail::check_cublas((call), #call, __FILE__, __LINE__)
/// Throws unless the cuSOLVER call returns CUSOLVER_STATUS_SUCCESS.
#define SC_CUSOLVER_CHECK(call) \
  ::spectral_cond::cuda::detail::check_cusolver((call), #call, __FILE__, __LINE__)
/// Checks the launch of the kernel just issued (configuration errors surface here).
#define SC_CUDA_CHECK_LAUNCH(name)                                                           \
  ::spectral_cond::cuda::detail::check_cuda(cudaGetLastError(), "launch of " name, __FILE__, \
                                            __LINE__)

namespace spectral_cond {
namespace cuda {

/// Number of CUDA devices, 0 when there is none or no usable driver (never throws).
inline int device_count_noexcept() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

/// Owning device array of T, grown (never shrunk) by ensure(); moves, does not copy.
/// ensure() keeps the allocation when it is already large enough, so buffers are allocated once
/// per shape and reused across calls.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t n, const char* what = "buffer") { ensure(n, what); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)), cap_(std::exchange(o.cap_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      release();
      p_ = std::exchange(o.p_, nullptr);
      cap_ = std::exchange(o.cap_, 0);
    }
    return *this;
  }
  ~DeviceBuffer() { release(); }

  /// Makes room for n elements (contents are not kept when it grows). Throws CudaOutOfMemory
  /// with the requested size when the device has no room.
  T* ensure(std::size_t n, const char* what = "buffer") {
    if (n <= cap_) return p_;
    release();
    if (n == 0) return p_;
    void* q = nullptr;
    const cudaError_t e = cudaMalloc(&q, n * sizeof(T));
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      throw CudaOutOfMemory(n * sizeof(T), what, __FILE__, __LINE__);
    }
    detail::check_cuda(e, "cudaMalloc", __FILE__, __LINE__);
    p_ = static_cast<T*>(q);
    cap_ = n;
    return p_;
  }
  void release() noexcept {
    if (p_ != nullptr) (void)cudaFree(p_);
    p_ = nullptr;
    cap_ = 0;
  }
  T* data() const { return p_; }
  std::size_t capacity() const { return cap_; }

 private:
  T* p_ = nullptr;
  std::size_t cap_ = 0;
};

}  // namespace cuda
}  // namespace spectral_cond
