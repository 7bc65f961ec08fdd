// Shared by the CUDA test programs: doctest's main, which skips (prints "no CUDA device:
// skipped" and exits 0) when cudaGetDeviceCount reports no device, and the comparison helpers.
#pragma once

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "spectral_cond/cuda/api.hpp"

#include <cstdio>
#include <random>

namespace sc = spectral_cond;
namespace scc = spectral_cond::cuda;

/// One context for the whole program (handles and workspace are reused across tests).
inline scc::Context& gpu() {
  static scc::Context ctx(0);
  return ctx;
}

/// The tolerance of the issue: relative 1e-10 in double, 1e-4 in float.
template <typename Scalar>
double tol() {
  return sizeof(Scalar) == sizeof(double) ? 1e-10 : 1e-4;
}

/// ||a - b|| / max(||b||, tiny), in double.
template <typename A, typename B>
double rel(const A& a, const B& b) {
  const double nb = b.template cast<double>().norm();
  return (a.template cast<double>() - b.template cast<double>()).norm() / std::max(nb, 1e-300);
}
inline double rel(double a, double b) {
  return std::abs(a - b) / std::max(std::abs(b), 1e-300);
}

template <typename Scalar>
sc::Mat<Scalar> randn(sc::Index r, sc::Index c, std::mt19937_64& g, double s = 1.0) {
  std::normal_distribution<double> d(0.0, s);
  sc::Mat<Scalar> m(r, c);
  for (sc::Index j = 0; j < c; ++j)
    for (sc::Index i = 0; i < r; ++i) m(i, j) = static_cast<Scalar>(d(g));
  return m;
}

/// A batch of `heads` items of one shape; X shared unless `per_item_x`.
template <typename Scalar>
scc::AttentionBatch<Scalar> make_batch(sc::Index N, sc::Index D, sc::Index dk, sc::Index dv,
                                       sc::Index heads, bool per_item_x, std::uint64_t seed) {
  std::mt19937_64 g(seed);
  MESSAGE("seed " << seed);
  scc::AttentionBatch<Scalar> b;
  const double ws = 1.0 / std::sqrt(static_cast<double>(D));
  for (sc::Index h = 0; h < heads; ++h) {
    if (per_item_x || h == 0) b.X.push_back(randn<Scalar>(N, D, g));
    b.WQ.push_back(randn<Scalar>(D, dk, g, ws));
    b.WK.push_back(randn<Scalar>(D, dk, g, ws));
    b.WV.push_back(randn<Scalar>(D, dv, g, ws));
  }
  return b;
}

int main(int argc, char** argv) {
  const int n = scc::device_count();
  if (n == 0) {
    std::printf("no CUDA device: skipped\n");
    return 0;
  }
  std::printf("CUDA device 0 of %d: %s\n", n, scc::device_name(0).c_str());
  doctest::Context context(argc, argv);
  return context.run();
}
