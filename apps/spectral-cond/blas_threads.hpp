// spectral-cond: one BLAS thread, so that every report is the same on any machine and under any
// way of spreading the work (--jobs, --shard, MPI ranks).
//
// Measured (2026-12-03): OpenBLAS's LAPACK SVD rounds differently with 1 and 2 threads (analyze's
// κ of W after the exact correction moved in its 15th digit), and mpirun, which binds each rank
// to a core, changes the thread count OpenBLAS picks. The tool's parallelism is its own (--jobs,
// ranks); the BLAS runs on one thread. Found at run time, so builds without OpenBLAS are unchanged.
#pragma once

#include <dlfcn.h>

namespace spectral_cond::cli {

/// Sets OpenBLAS (when it is the loaded BLAS) to one thread. Returns whether it was found.
inline bool pin_blas_to_one_thread() {
  using SetThreads = void (*)(int);
  void* f = ::dlsym(RTLD_DEFAULT, "openblas_set_num_threads");
  if (f == nullptr) return false;
  SetThreads set = nullptr;
  static_assert(sizeof(set) == sizeof(f), "function and object pointers differ in size");
  __builtin_memcpy(&set, &f, sizeof(f));
  set(1);
  return true;
}

}  // namespace spectral_cond::cli
