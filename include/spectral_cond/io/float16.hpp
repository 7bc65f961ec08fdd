// spectral_cond::io: IEEE binary16 (half) and bfloat16 conversions, exact decoding and
// round-to-nearest-even encoding straight from double (no double rounding through float).
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

namespace spectral_cond {
namespace io {
namespace detail {

/// m / 2^s rounded to nearest, ties to even; m < 2^63.
constexpr std::uint64_t round_shift_rne(std::uint64_t m, int s) {
  if (s <= 0) return m;
  if (s >= 64) return 0;  // m < 2^63 <= half of 2^64: rounds to zero
  const std::uint64_t q = m >> s;
  const std::uint64_t r = m & ((std::uint64_t{1} << s) - 1);
  const std::uint64_t half = std::uint64_t{1} << (s - 1);
  return (r > half || (r == half && (q & 1U) != 0)) ? q + 1 : q;
}

/// Bits of the binary format with E exponent and M mantissa bits nearest to x (ties to even).
/// Overflow gives +-inf, NaN a quiet NaN with x's sign; subnormals are produced where due.
template <int E, int M>
std::uint32_t encode_binary(double x) {
  static_assert(E >= 2 && E <= 8 && M >= 1 && M <= 23 && E + M < 32, "format too wide");
  constexpr int bias = (1 << (E - 1)) - 1;
  constexpr int emin = 1 - bias;
  constexpr std::uint32_t exp_all = (std::uint32_t{1} << E) - 1;
  std::uint64_t b = 0;
  std::memcpy(&b, &x, sizeof b);
  const std::uint32_t sign = static_cast<std::uint32_t>(b >> 63) << (E + M);
  const int de = static_cast<int>((b >> 52) & 0x7FF);
  const std::uint64_t dm = b & ((std::uint64_t{1} << 52) - 1);
  if (de == 0x7FF) {  // inf or NaN
    return sign | (exp_all << M) | (dm != 0 ? (std::uint32_t{1} << (M - 1)) : 0U);
  }
  if (de == 0 && dm == 0) return sign;  // +-0
  // x = m * 2^(e - 52) with m < 2^53.
  const std::uint64_t m = de == 0 ? dm : (dm | (std::uint64_t{1} << 52));
  int e = de == 0 ? -1022 : de - 1023;
  if (e >= emin) {
    std::uint64_t q = round_shift_rne(m, 52 - M);  // in [2^M, 2^(M+1)]
    if (q == (std::uint64_t{1} << (M + 1))) {
      q >>= 1;
      ++e;
    }
    if (e > bias) return sign | (exp_all << M);  // overflow: inf
    return sign | (static_cast<std::uint32_t>(e + bias) << M) |
           static_cast<std::uint32_t>(q & ((std::uint64_t{1} << M) - 1));
  }
  // Subnormal target: units of 2^(emin - M). A carry into 2^M is the smallest normal's bits.
  const std::uint64_t q = round_shift_rne(m, 52 + emin - M - e);
  return sign | static_cast<std::uint32_t>(q);
}

/// 2^k for |k| < 1000, as a constant expression.
constexpr double pow2(int k) {
  double v = 1.0;
  for (; k > 0; --k) v *= 2.0;
  for (; k < 0; ++k) v *= 0.5;
  return v;
}

/// Exact value of the binary format with E <= 8 exponent and M <= 23 mantissa bits, built as a
/// binary32 (which holds every such value exactly).
template <int E, int M>
double decode_binary(std::uint32_t bits) {
  static_assert(E >= 2 && E <= 8 && M >= 1 && M <= 23, "format wider than binary32");
  constexpr int bias = (1 << (E - 1)) - 1;
  constexpr std::uint32_t exp_all = (std::uint32_t{1} << E) - 1;
  constexpr double sub_unit = pow2(1 - bias - M);
  const std::uint32_t sign = ((bits >> (E + M)) & 1U) << 31;
  const std::uint32_t ex = (bits >> M) & exp_all;
  const std::uint32_t man = bits & ((std::uint32_t{1} << M) - 1);
  std::uint32_t f = 0;
  if (ex == exp_all) {
    f = sign | 0x7F800000U | (man != 0 ? 0x00400000U | (man << (23 - M)) : 0U);
  } else if (ex == 0) {
    const double v = static_cast<double>(man) * sub_unit;
    return sign != 0 ? -v : v;
  } else {
    f = sign | ((ex - static_cast<std::uint32_t>(bias) + 127U) << 23) | (man << (23 - M));
  }
  float out = 0;
  std::memcpy(&out, &f, sizeof out);
  return static_cast<double>(out);
}

}  // namespace detail

/// IEEE 754 binary16 bits -> double (exact; subnormals, inf and NaN kept).
inline double half_to_double(std::uint16_t h) {
  return detail::decode_binary<5, 10>(h);
}
/// double -> binary16 bits, round to nearest even; |x| >= 65520 gives inf.
inline std::uint16_t double_to_half(double x) {
  return static_cast<std::uint16_t>(detail::encode_binary<5, 10>(x));
}
/// bfloat16 bits (the top half of a binary32) -> double (exact).
inline double bf16_to_double(std::uint16_t h) {
  const std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float f = 0;
  std::memcpy(&f, &u, sizeof f);
  return static_cast<double>(f);
}
/// double -> bfloat16 bits, round to nearest even (straight from double, no double rounding).
inline std::uint16_t double_to_bf16(double x) {
  return static_cast<std::uint16_t>(detail::encode_binary<8, 7>(x));
}

}  // namespace io
}  // namespace spectral_cond
