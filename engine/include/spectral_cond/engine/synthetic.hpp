// spectral-cond: seeded synthetic tokens for `analyze --jacobian` and `demo`, reproducible across
// compilers and platforms (the portable generator of core/random.hpp, MATH.md §16).
//
//   standard_normals(seed, n): std::mt19937_64 seeded with `seed`; for each value two draws
//     a, b give u1 = ((a >> 11) + 1) 2^-53 in (0, 1] and u2 = (b >> 11) 2^-53 in [0, 1), and
//     z = sqrt(-2 ln u1) cos(2 pi u2) (Box-Muller, cosine branch only).
//   synthetic_tokens(N, D, seed): an N x D matrix filled row by row (row 0 first, columns left to
//     right) with standard_normals(seed, N D), then each row normalised like a LayerNorm output
//     without affine parameters and without epsilon: x_i <- (x_i - mean(x)) / sqrt(var(x)),
//     var the population variance (1/D). Each row then has mean 0 and variance 1 (D >= 2).
#pragma once

#include <spectral_cond/core/random.hpp>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace spectral_cond::engine {

/// n standard normal values from `seed`: Rng(seed).normal(), n times (MATH.md §16).
inline std::vector<double> standard_normals(std::uint64_t seed, std::size_t n) {
  Rng rng(seed);
  std::vector<double> out(n);
  for (double& z : out) z = rng.normal();
  return out;
}

/// N seeded synthetic tokens of width D, each row with mean 0 and variance 1 (LayerNorm-like;
/// see the top of this file). Throws std::invalid_argument unless N >= 1 and D >= 2.
inline Mat<double> synthetic_tokens(Index N, Index D, std::uint64_t seed) {
  if (N < 1 || D < 2)
    throw std::invalid_argument("synthetic_tokens: need N >= 1 and D >= 2 (got " +
                                std::to_string(N) + " x " + std::to_string(D) + ")");
  const std::vector<double> z =
      standard_normals(seed, static_cast<std::size_t>(N) * static_cast<std::size_t>(D));
  Mat<double> X(N, D);
  std::size_t k = 0;
  for (Index i = 0; i < N; ++i)
    for (Index j = 0; j < D; ++j) X(i, j) = z[k++];
  for (Index i = 0; i < N; ++i) {
    const double mean = X.row(i).mean();
    X.row(i).array() -= mean;
    const double var = X.row(i).squaredNorm() / static_cast<double>(D);
    X.row(i) /= std::sqrt(var);
  }
  return X;
}

}  // namespace spectral_cond::engine
