// spectral_cond: the one seeded generator of the library (MATH.md §16). Every seeded path (start
// vectors of the iterative solvers, random test instances, synthetic tokens) draws from it, so a
// seed rebuilds the same numbers with any standard library: std::mt19937_64 is specified bit for
// bit by the C++ standard, and the conversions to uniforms, normals and integers below are fixed
// here instead of being left to std::*_distribution, whose algorithms are implementation-defined.
// (log and cos come from the platform's libm, which may differ in the last bit.)
#pragma once

#include "spectral_cond/core/common.hpp"

#include <cmath>
#include <cstdint>
#include <random>

namespace spectral_cond {

/// The default seed of every seeded option in the library (MATH.md §16).
inline constexpr std::uint64_t default_seed = 0;

/// SplitMix64's output function (Steele, Lea and Flood, 2014) applied to x: a bijection of the
/// 64-bit words that mixes every input bit into every output bit. It derives independent seeds
/// from one (MATH.md §16): the verifier's instance k of regime r gets
/// splitmix64(splitmix64(seed ^ splitmix64(r)) + k). Fixed here, so derived seeds are the same
/// with any compiler.
constexpr std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/// Portable seeded random numbers (MATH.md §16):
///   word()          the next 64-bit word of std::mt19937_64(seed);
///   uniform()       ((w >> 11) + 1) 2^-53, in (0, 1];
///   uniform0()      (w >> 11) 2^-53, in [0, 1);
///   normal()        Box–Muller, cosine branch: sqrt(-2 ln u1) cos(2 π u2), u1 = uniform(),
///                   u2 = uniform0() (two words per value);
///   integer(lo, hi) uniform in [lo, hi] by rejection from the top bits of one word at a time.
class Rng {
 public:
  explicit Rng(std::uint64_t seed = default_seed) : gen_(seed) {}

  std::uint64_t word() { return gen_(); }
  double uniform() { return static_cast<double>((gen_() >> 11) + 1) * kTwoPowMinus53; }
  double uniform0() { return static_cast<double>(gen_() >> 11) * kTwoPowMinus53; }
  double normal() {
    constexpr double two_pi = 6.283185307179586476925286766559;
    const double u1 = uniform(), u2 = uniform0();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(two_pi * u2);
  }
  /// Uniform integer in [lo, hi] (lo <= hi): with n = hi - lo + 1 >= 2, the top b = ceil(log2 n)
  /// bits of one word at a time, rejecting values >= n; n = 1 returns lo without drawing.
  Index integer(Index lo, Index hi) {
    const auto n = static_cast<std::uint64_t>(hi - lo) + 1;
    if (n == 1) return lo;
    int b = 0;
    while (b < 64 && (std::uint64_t(1) << b) < n) ++b;
    std::uint64_t v;
    do v = gen_() >> (64 - b);
    while (v >= n);
    return lo + static_cast<Index>(v);
  }

  /// A rows x cols matrix of normals times `stddev`, filled in storage (column-major) order.
  Mat<double> normal_matrix(Index rows, Index cols, double stddev = 1.0) {
    Mat<double> m(rows, cols);
    for (Index k = 0; k < m.size(); ++k) m.data()[k] = stddev * normal();
    return m;
  }

 private:
  static constexpr double kTwoPowMinus53 = 1.0 / 9007199254740992.0;
  std::mt19937_64 gen_;
};

}  // namespace spectral_cond
