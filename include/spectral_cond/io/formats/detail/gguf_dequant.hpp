// spectral_cond::io::detail: ggml's block formats decoded to double (F16, BF16 and the Q4_0 ...
// Q8_K quantizations), each block's layout written out where it is decoded. Included by
// io/formats/gguf.hpp; do not include directly.
#pragma once

#include <spectral_cond/io/float16.hpp>
#include <spectral_cond/io/formats/detail/gguf_parse.hpp>

#include <cstdint>
#include <cstring>

namespace spectral_cond {
namespace io {
namespace detail {

inline double gguf_half(const std::uint8_t* p) {
  return half_to_double(static_cast<std::uint16_t>(p[0] | p[1] << 8));
}
inline double gguf_f32(const std::uint8_t* p) {
  const auto u = static_cast<std::uint32_t>(gguf_le(p, 4));
  float f = 0;
  std::memcpy(&f, &u, sizeof f);
  return static_cast<double>(f);
}
inline double dbl(int v) {
  return static_cast<double>(v);
}

// One block each: `b` its bytes, `y` its block_size outputs. Every value is the exact real
// number the block encodes (scale x integer [- min x integer]): with half-precision scales (a
// float one for Q8_K) and integers of at most 8 bits every product and difference is exact in
// double. ggml computes in float and rounds the last operation where that is inexact (an
// addition of a min, mostly): its values are these rounded to float.

/// Q4_0: half d, 16 bytes of 4-bit q (low nibbles: elements 0-15, high: 16-31); y = d (q - 8).
inline void gguf_dq_q4_0(const std::uint8_t* b, double* y) {
  const double d = gguf_half(b);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * dbl((b[2 + j] & 0x0F) - 8);
    y[j + 16] = d * dbl((b[2 + j] >> 4) - 8);
  }
}
/// Q4_1: half d, half m, 16 bytes of 4-bit q; y = d q + m.
inline void gguf_dq_q4_1(const std::uint8_t* b, double* y) {
  const double d = gguf_half(b), m = gguf_half(b + 2);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * dbl(b[4 + j] & 0x0F) + m;
    y[j + 16] = d * dbl(b[4 + j] >> 4) + m;
  }
}
/// Q5_0: half d, u32 of fifth bits (bit j for element j), 16 bytes of low nibbles;
/// y = d (q - 16).
inline void gguf_dq_q5_0(const std::uint8_t* b, double* y) {
  const double d = gguf_half(b);
  const auto qh = static_cast<std::uint32_t>(gguf_le(b + 2, 4));
  for (int j = 0; j < 16; ++j) {
    const int h0 = static_cast<int>((qh >> j) & 1U) << 4;
    const int h1 = static_cast<int>((qh >> (j + 16)) & 1U) << 4;
    y[j] = d * dbl(((b[6 + j] & 0x0F) | h0) - 16);
    y[j + 16] = d * dbl(((b[6 + j] >> 4) | h1) - 16);
  }
}
/// Q5_1: half d, half m, u32 of fifth bits, 16 bytes of low nibbles; y = d q + m.
inline void gguf_dq_q5_1(const std::uint8_t* b, double* y) {
  const double d = gguf_half(b), m = gguf_half(b + 2);
  const auto qh = static_cast<std::uint32_t>(gguf_le(b + 4, 4));
  for (int j = 0; j < 16; ++j) {
    const int h0 = static_cast<int>((qh >> j) & 1U) << 4;
    const int h1 = static_cast<int>((qh >> (j + 16)) & 1U) << 4;
    y[j] = d * dbl((b[8 + j] & 0x0F) | h0) + m;
    y[j + 16] = d * dbl((b[8 + j] >> 4) | h1) + m;
  }
}
/// Q8_0: half d, 32 int8 q; y = d q.
inline void gguf_dq_q8_0(const std::uint8_t* b, double* y) {
  const double d = gguf_half(b);
  for (int j = 0; j < 32; ++j) y[j] = d * dbl(static_cast<std::int8_t>(b[2 + j]));
}
/// Q2_K: 16 bytes of (4-bit min << 4 | 4-bit scale), one per 16 elements; 64 bytes of 2-bit q;
/// half d, half dmin. Element i = 128 h + 32 s + l takes bits 2s of byte 32 h + l;
/// y = d scale q - dmin min.
inline void gguf_dq_q2_k(const std::uint8_t* b, double* y) {
  const std::uint8_t* sc = b;
  const std::uint8_t* qs = b + 16;
  const double d = gguf_half(b + 80), dmin = gguf_half(b + 82);
  for (int i = 0; i < 256; ++i) {
    const int h = i / 128, s = (i % 128) / 32, l = i % 32;
    const int q = (qs[32 * h + l] >> (2 * s)) & 3;
    const int g = i / 16;
    y[i] = d * dbl(sc[g] & 0x0F) * dbl(q) - dmin * dbl(sc[g] >> 4);
  }
}
/// Q3_K: 32 bytes of high bits (bit i / 32 of byte i % 32; a clear bit subtracts 4), 64 bytes of
/// 2-bit low parts (as Q2_K), 12 bytes of sixteen 6-bit scales (offset by 32), half d;
/// y = d (scale - 32) q.
inline void gguf_dq_q3_k(const std::uint8_t* b, double* y) {
  const std::uint8_t* hm = b;
  const std::uint8_t* qs = b + 32;
  const std::uint8_t* sc = b + 96;
  const double d = gguf_half(b + 108);
  int scale[16];
  for (int k = 0; k < 16; ++k) {
    const int lo = k < 8 ? (sc[k] & 0x0F) : (sc[k - 8] >> 4);
    const int hi = (sc[8 + k % 4] >> (2 * (k / 4))) & 3;
    scale[k] = (lo | hi << 4) - 32;
  }
  for (int i = 0; i < 256; ++i) {
    const int h = i / 128, s = (i % 128) / 32, l = i % 32;
    const int lo = (qs[32 * h + l] >> (2 * s)) & 3;
    const int high = (hm[l] >> (i / 32)) & 1;
    y[i] = d * dbl(scale[i / 16]) * dbl(lo - (high != 0 ? 0 : 4));
  }
}
/// The eight 6-bit scales and mins of Q4_K and Q5_K, packed in 12 bytes.
inline void gguf_k_scale_min(const std::uint8_t* s, int* sc, int* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 0x3F;
    mn[j] = s[4 + j] & 0x3F;
    sc[j + 4] = (s[8 + j] & 0x0F) | ((s[j] >> 2) & 0x30);
    mn[j + 4] = (s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30);
  }
}
/// Q4_K: half d, half dmin, 12 bytes of scales and mins (one each per 32 elements), 128 bytes
/// of 4-bit q (sub-block 2c + n is nibble n of bytes 32c ... 32c + 31); y = d scale q - dmin min.
inline void gguf_dq_q4_k(const std::uint8_t* b, double* y) {
  const double d = gguf_half(b), dmin = gguf_half(b + 2);
  int sc[8], mn[8];
  gguf_k_scale_min(b + 4, sc, mn);
  const std::uint8_t* qs = b + 16;
  for (int i = 0; i < 256; ++i) {
    const int g = i / 32, l = i % 32;
    const int q = (qs[32 * (g / 2) + l] >> (4 * (g % 2))) & 0x0F;
    y[i] = d * dbl(sc[g]) * dbl(q) - dmin * dbl(mn[g]);
  }
}
/// Q5_K: Q4_K's fields with 32 bytes of fifth bits (bit g of byte l for element 32 g + l)
/// before the nibbles.
inline void gguf_dq_q5_k(const std::uint8_t* b, double* y) {
  const double d = gguf_half(b), dmin = gguf_half(b + 2);
  int sc[8], mn[8];
  gguf_k_scale_min(b + 4, sc, mn);
  const std::uint8_t* qh = b + 16;
  const std::uint8_t* qs = b + 48;
  for (int i = 0; i < 256; ++i) {
    const int g = i / 32, l = i % 32;
    const int q = ((qs[32 * (g / 2) + l] >> (4 * (g % 2))) & 0x0F) | (((qh[l] >> g) & 1) << 4);
    y[i] = d * dbl(sc[g]) * dbl(q) - dmin * dbl(mn[g]);
  }
}
/// Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8 scales (one per 16
/// elements), half d. Element i = 128 h + r: low nibble r / 64 of byte 64 h + r % 64, high bits
/// 2 (r / 32) of byte 32 h + r % 32; y = d scale (q - 32).
inline void gguf_dq_q6_k(const std::uint8_t* b, double* y) {
  const std::uint8_t* ql = b;
  const std::uint8_t* qh = b + 128;
  const std::uint8_t* sc = b + 192;
  const double d = gguf_half(b + 208);
  for (int i = 0; i < 256; ++i) {
    const int h = i / 128, r = i % 128;
    const int lo = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0F;
    const int hi = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
    y[i] = d * dbl(static_cast<std::int8_t>(sc[i / 16])) * dbl((lo | hi << 4) - 32);
  }
}
/// Q8_K: float d, 256 int8 q, 16 int16 block sums (not needed); y = d q.
inline void gguf_dq_q8_k(const std::uint8_t* b, double* y) {
  const double d = gguf_f32(b);
  for (int i = 0; i < 256; ++i) y[i] = d * dbl(static_cast<std::int8_t>(b[4 + i]));
}

template <typename Block>
void gguf_blocks(const std::uint8_t* p, std::uint64_t blocks, std::uint32_t type_size,
                 std::uint32_t block_size, double* out, Block f) {
  for (std::uint64_t k = 0; k < blocks; ++k, p += type_size, out += block_size) f(p, out);
}

/// Dequantizes `blocks` blocks of type `t` at `p` into `out`.
inline void gguf_dequantize(const GgmlTypeInfo& t, const std::uint8_t* p, std::uint64_t blocks,
                            double* out) {
  auto run = [&](auto f) { gguf_blocks(p, blocks, t.type_size, t.block_size, out, f); };
  switch (t.type) {
    case GgmlType::F32:
      return run([](const std::uint8_t* b, double* y) { *y = gguf_f32(b); });
    case GgmlType::F16:
      return run([](const std::uint8_t* b, double* y) { *y = gguf_half(b); });
    case GgmlType::BF16:
      return run([](const std::uint8_t* b, double* y) {
        *y = bf16_to_double(static_cast<std::uint16_t>(b[0] | b[1] << 8));
      });
    case GgmlType::F64:
      return run([](const std::uint8_t* b, double* y) {
        const std::uint64_t u = gguf_le(b, 8);
        std::memcpy(y, &u, sizeof u);
      });
    case GgmlType::Q4_0:
      return run(gguf_dq_q4_0);
    case GgmlType::Q4_1:
      return run(gguf_dq_q4_1);
    case GgmlType::Q5_0:
      return run(gguf_dq_q5_0);
    case GgmlType::Q5_1:
      return run(gguf_dq_q5_1);
    case GgmlType::Q8_0:
      return run(gguf_dq_q8_0);
    case GgmlType::Q2_K:
      return run(gguf_dq_q2_k);
    case GgmlType::Q3_K:
      return run(gguf_dq_q3_k);
    case GgmlType::Q4_K:
      return run(gguf_dq_q4_k);
    case GgmlType::Q5_K:
      return run(gguf_dq_q5_k);
    case GgmlType::Q6_K:
      return run(gguf_dq_q6_k);
    case GgmlType::Q8_K:
      return run(gguf_dq_q8_k);
    default:
      return;
  }
}

}  // namespace detail
}  // namespace io
}  // namespace spectral_cond
