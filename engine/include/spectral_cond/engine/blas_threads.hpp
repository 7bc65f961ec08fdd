// spectral-cond: one BLAS thread, so that every report is the same on any machine and under any
// way of spreading the work (--jobs, --shard, MPI ranks); the Python package pins it too, on
// import, so that its reports are the tool's.
//
// Measured (2026-12-03): OpenBLAS's LAPACK SVD rounds differently with 1 and 2 threads (analyze's
// κ of W after the exact correction moved in its 15th digit), and mpirun, which binds each rank
// to a core, changes the thread count OpenBLAS picks. The tool's parallelism is its own (--jobs,
// ranks); the BLAS runs on one thread. Found at run time, so builds without OpenBLAS are unchanged.
// With EIGEN_USE_BLAS (SPECTRAL_COND_EIGEN_BLAS) every dense product goes through OpenBLAS, and
// its GEMMs and triangular solves round differently with 1 and 2 threads as well (measured
// 2026-12-06: `verify --seed 3` differed between the tool and the Python package on 2 threads).
#pragma once

#include <dlfcn.h>

#include <cstdlib>

namespace spectral_cond::engine {

/// Sets OpenBLAS (when it is the loaded BLAS) to one thread, or to SPECTRAL_COND_BLAS_THREADS
/// (an integer from 1 to 1024) when that is set: faster dense SVDs on many cores, at the price of
/// reports that may differ in their last digits from one machine to another. Returns whether
/// OpenBLAS was found.
inline bool pin_blas_to_one_thread() {
  int threads = 1;
  if (const char* env = std::getenv("SPECTRAL_COND_BLAS_THREADS")) {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && n >= 1 && n <= 1024) threads = static_cast<int>(n);
  }
  using SetThreads = void (*)(int);
  void* f = ::dlsym(RTLD_DEFAULT, "openblas_set_num_threads");
  if (f == nullptr) {
    // A Python extension is loaded with RTLD_LOCAL: its OpenBLAS is not in the global scope, but
    // it is loaded, so a handle to it can be had without loading anything.
    if (void* h = ::dlopen("libopenblas.so.0", RTLD_LAZY | RTLD_NOLOAD)) {
      f = ::dlsym(h, "openblas_set_num_threads");
      ::dlclose(h);  // the extension's own reference keeps it loaded
    }
  }
  if (f == nullptr) return false;
  SetThreads set = nullptr;
  static_assert(sizeof(set) == sizeof(f), "function and object pointers differ in size");
  __builtin_memcpy(&set, &f, sizeof(f));
  set(threads);
  return true;
}

}  // namespace spectral_cond::engine
