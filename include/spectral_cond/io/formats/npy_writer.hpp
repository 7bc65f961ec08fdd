// spectral_cond::io: the .npy writer (float64 '<f8' or float32 '<f4' 2-D arrays in C order, a
// version 1.0 header padded to a multiple of 64 bytes, written atomically: atomic_file.hpp).
// Included by npy.hpp.
#pragma once

#include "spectral_cond/core/common.hpp"
#include "spectral_cond/io/atomic_file.hpp"
#include "spectral_cond/io/error.hpp"

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace spectral_cond::io {

namespace detail {

/// Version 1.0 header for a 2-D array, padded with spaces so that the data starts at a
/// multiple of 64 bytes, ended by '\n'.
inline std::string npy_header_bytes(const char* descr, Index rows, Index cols) {
  std::string dict = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (" +
                     std::to_string(rows) + ", " + std::to_string(cols) + "), }";
  const std::size_t unpadded = 10 + dict.size() + 1;
  dict.append((64 - unpadded % 64) % 64, ' ');
  dict += '\n';
  const std::size_t len = dict.size();
  std::string out = "\x93NUMPY";
  out += '\x01';
  out += '\x00';
  out += static_cast<char>(len & 0xff);
  out += static_cast<char>((len >> 8) & 0xff);
  return out + dict;
}

/// Streams the .npy bytes of `m` (C order, little-endian) to sink(const uint8_t*, size_t).
template <typename Scalar, typename Sink>
void serialize_npy(const Eigen::Ref<const Mat<Scalar>>& m, Sink&& sink) {
  static_assert(std::is_same<Scalar, double>::value || std::is_same<Scalar, float>::value,
                "serialize_npy: float or double only");
  using Bits = std::conditional_t<sizeof(Scalar) == 8, std::uint64_t, std::uint32_t>;
  const std::string header =
      npy_header_bytes(sizeof(Scalar) == 8 ? "<f8" : "<f4", m.rows(), m.cols());
  sink(reinterpret_cast<const std::uint8_t*>(header.data()), header.size());
  constexpr std::size_t kChunk = 1 << 16;
  std::vector<std::uint8_t> buf;
  buf.reserve(kChunk + sizeof(Scalar));
  for (Index i = 0; i < m.rows(); ++i)
    for (Index j = 0; j < m.cols(); ++j) {
      Bits bits;
      const Scalar v = m(i, j);
      std::memcpy(&bits, &v, sizeof(Scalar));
      for (std::size_t b = 0; b < sizeof(Scalar); ++b)
        buf.push_back(static_cast<std::uint8_t>(bits >> (8 * b)));
      if (buf.size() >= kChunk) {
        sink(buf.data(), buf.size());
        buf.clear();
      }
    }
  if (!buf.empty()) sink(buf.data(), buf.size());
}

template <typename Scalar>
void write_npy_impl(const std::string& path, const Eigen::Ref<const Mat<Scalar>>& m) {
  atomic_write(path, [&](std::FILE* f) {
    serialize_npy<Scalar>(m, [&](const std::uint8_t* p, std::size_t n) {
      if (std::fwrite(p, 1, n, f) != n) throw IoError(path + ": write failed: " + errno_str(errno));
    });
  });
}

}  // namespace detail

/// The .npy bytes of `m`: float64 '<f8', C order, shape (rows, cols), entry [i, j] = m(i, j),
/// version 1.0 header padded to 64 bytes.
inline std::vector<std::uint8_t> encode_npy(const Eigen::Ref<const Mat<double>>& m) {
  std::vector<std::uint8_t> out;
  detail::serialize_npy<double>(
      m, [&](const std::uint8_t* p, std::size_t n) { out.insert(out.end(), p, p + n); });
  return out;
}
/// As encode_npy for double, as float32 '<f4'.
inline std::vector<std::uint8_t> encode_npy(const Eigen::Ref<const Mat<float>>& m) {
  std::vector<std::uint8_t> out;
  detail::serialize_npy<float>(
      m, [&](const std::uint8_t* p, std::size_t n) { out.insert(out.end(), p, p + n); });
  return out;
}

/// Writes `m` to `path` as float64 '<f8', C order, shape (rows, cols), entry [i, j] = m(i, j),
/// atomically (temporary file, fsync, rename). Throws IoError; on failure `path` is untouched.
inline void write_npy(const std::string& path, const Eigen::Ref<const Mat<double>>& m) {
  detail::write_npy_impl<double>(path, m);
}
/// As write_npy for double, as float32 '<f4'.
inline void write_npy(const std::string& path, const Eigen::Ref<const Mat<float>>& m) {
  detail::write_npy_impl<float>(path, m);
}

}  // namespace spectral_cond::io
