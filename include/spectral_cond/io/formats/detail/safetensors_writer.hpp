// spectral_cond::io: write_safetensors and the double -> F64/F32/F16/BF16 encoders. Included by
// safetensors.hpp; do not include directly.
#pragma once

#include <spectral_cond/io/formats/safetensors.hpp>

#include <spectral_cond/io/atomic_file.hpp>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <set>
#include <sstream>

namespace spectral_cond {
namespace io {

/// One tensor to write: its bytes are little-endian, row-major, exactly numel(shape) x
/// dtype_size(dtype) long. The bytes are not owned: they may point into a SafetensorsFile (copy
/// byte for byte) or into a buffer from encode_values / encode_matrix, which must outlive the call.
struct TensorToWrite {
  std::string name;
  Dtype dtype = Dtype::F32;
  std::vector<std::int64_t> shape;
  ByteView bytes;
};

namespace detail {

/// Whether `s` is well-formed UTF-8 (no overlong forms, surrogates or code points past U+10FFFF).
inline bool valid_utf8(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  for (std::size_t i = 0; i < n;) {
    const unsigned c = p[i];
    std::size_t len = c < 0x80         ? 1
                      : (c >> 5) == 6  ? 2
                      : (c >> 4) == 14 ? 3
                      : (c >> 3) == 30 ? 4
                                       : 0;
    if (len == 0 || i + len > n) return false;
    std::uint32_t cp = len == 1 ? c : c & (0x7Fu >> len);
    for (std::size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    static const std::uint32_t least[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < least[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += len;
  }
  return true;
}

/// `s` with every byte outside printable ASCII written as \xHH, for messages.
inline std::string escaped_bytes(const std::string& s) {
  static const char hex[] = "0123456789abcdef";
  std::string out;
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c >= 0x20 && c < 0x7F && c != '\\') {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}

}  // namespace detail

/// n doubles encoded as dtype (F64, F32, F16 or BF16), rounding to nearest even; values beyond
/// the format's range become +-inf. Other dtypes: std::invalid_argument.
inline std::vector<std::uint8_t> encode_values(const double* x, std::size_t n, Dtype dtype) {
  if (!is_convertible(dtype))
    throw std::invalid_argument(std::string("encode_values: dtype ") + to_string(dtype) +
                                " is not a floating-point type");
  const std::size_t es = dtype_size(dtype);
  std::vector<std::uint8_t> out(n * es);
  std::uint8_t* p = out.data();
  for (std::size_t i = 0; i < n; ++i, p += es) {
    std::uint64_t u = 0;
    switch (dtype) {
      case Dtype::F64:
        std::memcpy(&u, &x[i], 8);
        break;
      case Dtype::F32: {
        const float f = static_cast<float>(x[i]);  // IEEE round to nearest even
        std::uint32_t v = 0;
        std::memcpy(&v, &f, 4);
        u = v;
        break;
      }
      case Dtype::F16:
        u = double_to_half(x[i]);
        break;
      case Dtype::BF16:
        u = double_to_bf16(x[i]);
        break;
      default:
        break;
    }
    for (std::size_t b = 0; b < es; ++b) p[b] = static_cast<std::uint8_t>(u >> (8 * b));
  }
  return out;
}

/// Index of the first of n values that is not a finite number of `dtype` after rounding (NaN,
/// Inf, or so large that it rounds to Inf: |x| >= 65520 for F16), or n when all fit.
inline std::size_t first_unrepresentable(const double* x, std::size_t n, Dtype dtype) {
  for (std::size_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) return i;
    switch (dtype) {
      case Dtype::F32:
        if (!std::isfinite(static_cast<float>(x[i]))) return i;
        break;
      case Dtype::F16:
        if ((double_to_half(x[i]) & 0x7C00U) == 0x7C00U) return i;
        break;
      case Dtype::BF16:
        if ((double_to_bf16(x[i]) & 0x7F80U) == 0x7F80U) return i;
        break;
      default:
        break;
    }
  }
  return n;
}

/// Throws IoError("<label>: value v at [i, j] does not fit <dtype> ...") unless every entry of
/// m is finite in `dtype` after rounding (first_unrepresentable): a value is refused rather
/// than written as Inf.
template <typename Derived>
void require_representable(const Eigen::MatrixBase<Derived>& m, Dtype dtype,
                           const std::string& label) {
  for (Index i = 0; i < m.rows(); ++i)
    for (Index j = 0; j < m.cols(); ++j) {
      const double v = static_cast<double>(m(i, j));
      if (first_unrepresentable(&v, 1, dtype) == 0) {
        std::ostringstream s;
        s << label << ": value " << v << " at [" << i << ", " << j << "] does not fit "
          << to_string(dtype) << " (it would be written as " << (std::isnan(v) ? "NaN" : "Inf")
          << ")";
        throw IoError(s.str());
      }
    }
}

/// A matrix encoded row-major (the safetensors layout of a rows x cols tensor) as dtype.
template <typename Derived>
std::vector<std::uint8_t> encode_matrix(const Eigen::MatrixBase<Derived>& m, Dtype dtype) {
  std::vector<double> v(static_cast<std::size_t>(m.size()));
  std::size_t k = 0;
  for (Index i = 0; i < m.rows(); ++i)
    for (Index j = 0; j < m.cols(); ++j) v[k++] = static_cast<double>(m(i, j));
  return encode_values(v.data(), v.size(), dtype);
}

/// Writes a safetensors file atomically. Tensors are laid out by decreasing element size, then
/// by name, contiguously from offset 0; the header is padded with spaces to a multiple of 8
/// bytes. Checks (IoError naming the file and tensor): names unique, non-empty and not
/// "__metadata__"; dims non-negative; bytes.size == numel x dtype size.
inline void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata = {}) {
  std::vector<const TensorToWrite*> order;
  std::set<std::string> seen;
  for (const auto& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__")
      detail::st_fail(path, t.name, "invalid tensor name");
    if (!seen.insert(t.name).second) detail::st_fail(path, t.name, "duplicate tensor name");
    std::uint64_t n = 1;
    for (std::int64_t s : t.shape) {
      if (s < 0) detail::st_fail(path, t.name, "negative dimension");
      n *= static_cast<std::uint64_t>(s);
    }
    if (n * dtype_size(t.dtype) != t.bytes.size)
      detail::st_fail(path, t.name,
                      "has " + std::to_string(t.bytes.size) + " bytes, shape x " +
                          to_string(t.dtype) + " needs " + std::to_string(n * dtype_size(t.dtype)));
    order.push_back(&t);
  }
  std::sort(order.begin(), order.end(), [](const TensorToWrite* a, const TensorToWrite* b) {
    const std::size_t sa = dtype_size(a->dtype), sb = dtype_size(b->dtype);
    return sa != sb ? sa > sb : a->name < b->name;
  });
  // JSON needs UTF-8: a name that is not (an .npz member named in another encoding) is refused
  // by name, with its bytes escaped, before anything is written.
  for (const auto* t : order)
    if (!detail::valid_utf8(t->name))
      detail::st_fail(path, "tensor name \"" + detail::escaped_bytes(t->name) +
                                "\" is not valid UTF-8, which a safetensors header (JSON) needs; "
                                "rename it in the input");
  nlohmann::json h = nlohmann::json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  std::uint64_t off = 0;
  for (const auto* t : order) {
    h[t->name] = {{"dtype", to_string(t->dtype)},
                  {"shape", t->shape},
                  {"data_offsets", {off, off + t->bytes.size}}};
    off += t->bytes.size;
  }
  std::string js;
  try {
    js = h.dump();
  } catch (const nlohmann::json::exception& ex) {
    detail::st_fail(path, "cannot encode the header: " + detail::one_line(ex.what()));
  }
  js.append((8 - js.size() % 8) % 8, ' ');
  std::uint8_t len[8];
  for (int b = 0; b < 8; ++b)
    len[b] = static_cast<std::uint8_t>(std::uint64_t{js.size()} >> (8 * b));
  atomic_write(path, [&](std::FILE* f) {
    auto put = [&](const void* p, std::size_t n) {
      if (n > 0 && std::fwrite(p, 1, n, f) != n)
        throw IoError(path + ": write failed: " + std::strerror(errno));
    };
    put(len, 8);
    put(js.data(), js.size());
    for (const auto* t : order) put(t->bytes.data, t->bytes.size);
  });
}

}  // namespace io
}  // namespace spectral_cond
