// Builds against the installed CUDA path (a package built with SPECTRAL_COND_ENABLE_CUDA): host
// code compiled by the C++ compiler, linked to spectral_cond::cuda (docs/cuda.md).
#include <spectral_cond/cuda/api.hpp>

#include <iostream>

int main() {
  const int n = spectral_cond::cuda::device_count();  // 0 without a GPU: never throws
  std::cout << "consumer_cuda: " << n << " CUDA device(s)\n";
  return n >= 0 ? 0 : 1;
}
