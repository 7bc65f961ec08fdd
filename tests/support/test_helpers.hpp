// Shared helpers for the test suite: seeded random matrices and relative errors.
#pragma once

#include <spectral_cond/core/attention.hpp>
#include <spectral_cond/core/common.hpp>

#include <doctest/doctest.h>

#include <cstdint>
#include <iostream>
#include <random>

// Under the sanitizers everything runs several times slower: tests shrink their largest cases.
#if defined(__SANITIZE_ADDRESS__)
#define SC_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SC_TEST_SANITIZED 1
#endif
#endif
#ifndef SC_TEST_SANITIZED
#define SC_TEST_SANITIZED 0
#endif

namespace sc_test {

using spectral_cond::Index;
using spectral_cond::Mat;

/// Standard normal entries from a seeded generator (the seed is printed by the test on failure
/// through INFO).
template <typename Scalar>
Mat<Scalar> randn(Index rows, Index cols, std::mt19937_64& rng, double stddev = 1.0) {
  std::normal_distribution<double> dist(0.0, stddev);
  Mat<Scalar> m(rows, cols);
  for (Index k = 0; k < m.size(); ++k) m.data()[k] = static_cast<Scalar>(dist(rng));
  return m;
}

/// max|a - b| / max(max|b|, tiny): a relative error that is meaningful for whole matrices.
template <typename DA, typename DB>
double rel_err(const Eigen::MatrixBase<DA>& a, const Eigen::MatrixBase<DB>& b) {
  const double num = static_cast<double>((a - b).cwiseAbs().maxCoeff());
  const double den = static_cast<double>(b.cwiseAbs().maxCoeff());
  return num / (den > 1e-300 ? den : 1e-300);
}

/// An attention block's inputs.
template <typename Scalar>
struct Problem {
  Mat<Scalar> X, WQ, WK, WV;
  spectral_cond::AttentionOptions<Scalar> opts;
};

/// PyTorch-style instance: X ~ N(0, 1), W ~ N(0, 1/D), c = 1/sqrt(d_k) (the default scale).
/// `xrank` > 0 makes X a product of N x xrank and xrank x D Gaussians (rank xrank).
template <typename Scalar>
Problem<Scalar> make_problem(Index N, Index D, Index dk, Index dv, std::uint64_t seed,
                             spectral_cond::MaskKind mask = spectral_cond::MaskKind::None,
                             Index xrank = 0) {
  std::mt19937_64 rng(seed);
  Problem<Scalar> p;
  p.X = xrank > 0 ? Mat<Scalar>(randn<Scalar>(N, xrank, rng) * randn<Scalar>(xrank, D, rng))
                  : randn<Scalar>(N, D, rng);
  const double ws = 1.0 / std::sqrt(static_cast<double>(D));
  p.WQ = randn<Scalar>(D, dk, rng, ws);
  p.WK = randn<Scalar>(D, dk, rng, ws);
  p.WV = randn<Scalar>(D, dv, rng, ws);
  p.opts.mask = mask;
  return p;
}

template <typename Scalar>
constexpr double eps() {
  return static_cast<double>(std::numeric_limits<Scalar>::epsilon());
}

}  // namespace sc_test
