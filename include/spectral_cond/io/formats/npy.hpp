// spectral_cond::io: a small, defensive reader and writer for NumPy's .npy format.
//
// Format (numpy/lib/format.py, "NPY format version 1.0/2.0/3.0"):
//   "\x93NUMPY" major minor  header_len (uint16 LE for 1.0, uint32 LE for 2.0/3.0)
//   header: a Python dict literal {'descr': ..., 'fortran_order': ..., 'shape': (...), }
//           padded with spaces and ended by '\n'
//   data:   prod(shape) items of descr, C (row-major) or Fortran (column-major) order.
//
// The reader is meant for untrusted files: it checks the magic, the version, that the header
// length is bounded (<= 1 MiB) and lies inside the file, parses the header dict strictly (the
// keys 'descr', 'fortran_order' and 'shape', each exactly once), checks every shape entry and
// the element count for overflow, and requires the data to be exactly prod(shape) x itemsize
// bytes, all before it allocates anything sized by the file. Only little-endian floats are read
// ('<f2', '<f4', '<f8'), converted to double. Every failure throws IoError with one line that
// starts with the file's (or member's) name.
//
// The writer writes float64 ('<f8') or float32 ('<f4') 2-D arrays in C order with a version
// 1.0 header padded to a multiple of 64 bytes, atomically (atomic_file.hpp).
#pragma once

#include "spectral_cond/core/common.hpp"
#include "spectral_cond/io/atomic_file.hpp"
#include "spectral_cond/io/error.hpp"
#include "spectral_cond/io/files.hpp"
#include "spectral_cond/io/float16.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace spectral_cond::io {

/// Largest header the reader accepts; numpy's own headers are a few hundred bytes.
inline constexpr std::size_t kNpyMaxHeaderBytes = std::size_t(1) << 20;

/// An array read from a .npy file or an .npz member, its elements converted to double.
struct NpyArray {
  std::vector<std::int64_t> shape;  ///< the header's shape; empty for a 0-d (scalar) array
  std::string dtype;                ///< the header's descr: "<f2", "<f4" or "<f8"
  bool fortran_order = false;       ///< storage order of `data` (as in the file)
  std::vector<double> data;         ///< prod(shape) elements, in the file's storage order
  std::string name;                 ///< file or member name, for error messages

  std::size_t ndim() const { return shape.size(); }
  /// prod(shape) (1 for a scalar); equal to data.size().
  std::size_t numel() const { return data.size(); }

  /// The array as a matrix, entry (i, j) = array[i, j]; throws IoError unless it is 2-D.
  Mat<double> to_matrix() const { return as<double>(); }

  /// to_matrix() converted to Scalar (float or double).
  template <typename Scalar>
  Mat<Scalar> as() const {
    if (ndim() != 2) throw IoError(name + ": expected a 2-D array, got shape " + shape_string());
    const auto rows = static_cast<Index>(shape[0]), cols = static_cast<Index>(shape[1]);
    Mat<Scalar> m(rows, cols);
    if (data.empty()) return m;  // a zero dimension: no loop over the other one
    for (Index i = 0; i < rows; ++i)
      for (Index j = 0; j < cols; ++j) {
        const auto k = static_cast<std::size_t>(fortran_order ? i + rows * j : i * cols + j);
        m(i, j) = static_cast<Scalar>(data[k]);
      }
    return m;
  }

  /// The shape the way Python prints it: "(3, 4)", "(5,)", "()".
  std::string shape_string() const {
    std::string s = "(";
    for (std::size_t k = 0; k < shape.size(); ++k) s += (k ? ", " : "") + std::to_string(shape[k]);
    return s + (shape.size() == 1 ? ",)" : ")");
  }
};

namespace detail {

/// What the header says, after every check.
struct NpyHeader {
  std::vector<std::int64_t> shape;
  std::string descr;
  bool fortran_order = false;
  std::size_t itemsize = 0;
  std::size_t numel = 0;       ///< prod(shape), overflow-checked
  std::size_t data_bytes = 0;  ///< numel * itemsize, overflow-checked
};

inline const char* npy_type_name(std::size_t itemsize) {
  return itemsize == 2 ? "float16" : itemsize == 4 ? "float32" : "float64";
}

/// "3 x 4 float64 = 96 bytes" for messages.
inline std::string npy_describe(const NpyHeader& h) {
  std::string s;
  if (h.shape.empty()) s = "scalar";
  for (std::size_t k = 0; k < h.shape.size(); ++k)
    s += (k ? " x " : "") + std::to_string(h.shape[k]);
  return s + " " + npy_type_name(h.itemsize) + " = " + std::to_string(h.data_bytes) + " bytes";
}

/// Strict parser of the header dict (a Python literal), positions reported in messages.
class NpyHeaderParser {
 public:
  NpyHeaderParser(const char* text, std::size_t len, const std::string& name)
      : s_(text), n_(len), name_(name) {}

  NpyHeader parse() {
    for (std::size_t k = 0; k < n_; ++k) {
      const auto c = static_cast<unsigned char>(s_[k]);
      if (c >= 0x80 || (c < 0x20 && c != '\n' && c != '\r' && c != '\t'))
        fail("header contains a non-ASCII or control byte at offset " + std::to_string(k));
    }
    NpyHeader h;
    bool seen_descr = false, seen_order = false, seen_shape = false;
    skip_ws();
    expect('{');
    skip_ws();
    while (peek() != '}') {
      const std::string key = parse_string("a key");
      skip_ws();
      expect(':');
      skip_ws();
      if (key == "descr") {
        once(seen_descr, key);
        if (peek() == '[') fail("unsupported dtype: structured arrays are not supported");
        h.descr = parse_string("the 'descr' string");
      } else if (key == "fortran_order") {
        once(seen_order, key);
        h.fortran_order = parse_bool();
      } else if (key == "shape") {
        once(seen_shape, key);
        h.shape = parse_shape();
      } else {
        fail("bad header: unexpected key '" + key + "'");
      }
      skip_ws();
      if (peek() == ',') {
        ++pos_;
        skip_ws();
      } else if (peek() != '}') {
        fail("bad header: expected ',' or '}' at offset " + std::to_string(pos_));
      }
    }
    ++pos_;  // '}'
    for (; pos_ < n_; ++pos_)
      if (!is_ws(s_[pos_]))
        fail("bad header: unexpected text after the dict at offset " + std::to_string(pos_));
    if (!seen_descr || !seen_order || !seen_shape)
      fail(std::string("bad header: missing key '") +
           (!seen_descr   ? "descr"
            : !seen_order ? "fortran_order"
                          : "shape") +
           "'");
    h.itemsize = itemsize_of(h.descr);
    // The extent (zero dimensions counted as one) bounds every loop over the dimensions, also
    // for an empty array: (2^63 - 1, 0) holds no element but must not drive a loop of 2^63 rows.
    std::size_t extent = 1;
    for (const std::int64_t d : h.shape) {
      const auto ud = std::max<std::uint64_t>(static_cast<std::uint64_t>(d), 1);
      if (extent > std::numeric_limits<std::size_t>::max() / 8 / ud)
        fail("shape " + shape_text(h.shape) + " is too large (dimensions overflow)");
      extent *= static_cast<std::size_t>(ud);
    }
    h.numel = 1;
    for (const std::int64_t d : h.shape) {
      const auto ud = static_cast<std::uint64_t>(d);
      if (ud != 0 && h.numel > std::numeric_limits<std::size_t>::max() / ud)
        fail("shape " + shape_text(h.shape) + " has too many elements (overflow)");
      h.numel *= static_cast<std::size_t>(ud);
    }
    if (h.numel > std::numeric_limits<std::size_t>::max() / 8)
      fail("shape " + shape_text(h.shape) + " has too many elements (overflow)");
    h.data_bytes = h.numel * h.itemsize;
    return h;
  }

 private:
  static bool is_ws(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }
  char peek() const {
    if (pos_ >= n_) fail("bad header: unexpected end of the header dict");
    return s_[pos_];
  }
  void skip_ws() {
    while (pos_ < n_ && is_ws(s_[pos_])) ++pos_;
  }
  void expect(char c) {
    if (peek() != c)
      fail(std::string("bad header: expected '") + c + "' at offset " + std::to_string(pos_));
    ++pos_;
  }
  void once(bool& seen, const std::string& key) const {
    if (seen) fail("bad header: key '" + key + "' appears twice");
    seen = true;
  }
  bool word(const char* w) {
    const std::size_t len = std::strlen(w);
    if (n_ - pos_ >= len && std::memcmp(s_ + pos_, w, len) == 0) {
      pos_ += len;
      return true;
    }
    return false;
  }

  std::string parse_string(const char* what) {
    const char q = peek();
    if (q != '\'' && q != '"')
      fail(std::string("bad header: expected ") + what + " at offset " + std::to_string(pos_));
    const std::size_t start = ++pos_;
    while (peek() != q)
      if (s_[pos_++] == '\\') fail("bad header: escapes in strings are not supported");
    return std::string(s_ + start, s_ + pos_++);
  }

  bool parse_bool() {
    if (word("True")) return true;
    if (word("False")) return false;
    fail("bad header: 'fortran_order' must be True or False (offset " + std::to_string(pos_) + ")");
  }

  std::int64_t parse_int() {
    if (peek() == '-') fail("negative dimension in 'shape' at offset " + std::to_string(pos_));
    if (peek() < '0' || peek() > '9')
      fail("bad header: expected a dimension in 'shape' at offset " + std::to_string(pos_));
    std::int64_t v = 0;
    while (pos_ < n_ && s_[pos_] >= '0' && s_[pos_] <= '9') {
      const int digit = s_[pos_++] - '0';
      if (v > (std::numeric_limits<std::int64_t>::max() - digit) / 10)
        fail("dimension in 'shape' is too large (overflow)");
      v = v * 10 + digit;
    }
    if (pos_ < n_ && s_[pos_] == 'L') ++pos_;  // Python 2 long literal, as numpy accepts
    return v;
  }

  std::vector<std::int64_t> parse_shape() {
    std::vector<std::int64_t> shape;
    expect('(');
    skip_ws();
    bool comma_after_last = false;
    while (peek() != ')') {
      if (shape.size() >= 64) fail("bad header: 'shape' has more than 64 dimensions");
      shape.push_back(parse_int());
      skip_ws();
      comma_after_last = false;
      if (peek() == ',') {
        ++pos_;
        skip_ws();
        comma_after_last = true;
      } else if (peek() != ')') {
        fail("bad header: expected ',' or ')' in 'shape' at offset " + std::to_string(pos_));
      }
    }
    ++pos_;
    if (shape.size() == 1 && !comma_after_last)
      fail("bad header: 'shape' (" + std::to_string(shape[0]) + ") is not a tuple");
    return shape;
  }

  std::size_t itemsize_of(const std::string& d) const {
    if (d == "<f8") return 8;
    if (d == "<f4") return 4;
    if (d == "<f2") return 2;
    const std::string supported = "only little-endian floats '<f2', '<f4', '<f8' are supported";
    if (d.size() >= 2 && d[0] == '>' && d[1] == 'f')
      fail("big-endian dtype '" + d + "' is not supported (" + supported +
           "; convert with arr.astype('<" + d.substr(1) + "'))");
    fail("unsupported dtype '" + d + "': " + supported);
  }

  static std::string shape_text(const std::vector<std::int64_t>& s) {
    NpyArray a;
    a.shape = s;
    return a.shape_string();
  }

  [[noreturn]] void fail(const std::string& what) const { throw IoError(name_ + ": " + what); }

  const char* s_;
  std::size_t n_;
  const std::string& name_;
  std::size_t pos_ = 0;
};

/// Where the header lies: checks the magic, the version and that the header fits in the file.
struct NpyPreamble {
  std::size_t header_offset = 0;  ///< 10 (version 1.0) or 12 (2.0, 3.0)
  std::size_t header_len = 0;
};

/// `p` holds the first min(total, 12) bytes of a file of `total` bytes.
inline NpyPreamble parse_npy_preamble(const std::uint8_t* p, std::uint64_t total,
                                      const std::string& name) {
  static const std::uint8_t magic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
  if (total < 6 || std::memcmp(p, magic, 6) != 0)
    throw IoError(name + ": not a .npy file (bad magic; expected \\x93NUMPY)");
  if (total < 8) throw IoError(name + ": truncated: the file ends inside the version bytes");
  const unsigned major = p[6], minor = p[7];
  if ((major != 1 && major != 2 && major != 3) || minor != 0)
    throw IoError(name + ": unsupported .npy format version " + std::to_string(major) + "." +
                  std::to_string(minor) + " (supported: 1.0, 2.0, 3.0)");
  NpyPreamble pre;
  pre.header_offset = major == 1 ? 10 : 12;
  if (total < pre.header_offset)
    throw IoError(name + ": truncated: the file ends inside the header length");
  pre.header_len = major == 1 ? std::size_t(p[8]) | std::size_t(p[9]) << 8
                              : std::size_t(p[8]) | std::size_t(p[9]) << 8 |
                                    std::size_t(p[10]) << 16 | std::size_t(p[11]) << 24;
  if (pre.header_len > kNpyMaxHeaderBytes)
    throw IoError(name + ": header length " + std::to_string(pre.header_len) +
                  " exceeds the limit of " + std::to_string(kNpyMaxHeaderBytes) + " bytes");
  if (pre.header_len > total - pre.header_offset)
    throw IoError(name + ": header length " + std::to_string(pre.header_len) +
                  " runs past the end of the file (" + std::to_string(total) + " bytes)");
  return pre;
}

/// Throws unless the data after the header is exactly h.data_bytes long.
inline void check_npy_data_size(const NpyHeader& h, std::uint64_t available,
                                const std::string& name) {
  if (available < h.data_bytes)
    throw IoError(name + ": truncated: header says " + npy_describe(h) + " of data, file has " +
                  std::to_string(available));
  if (available > h.data_bytes)
    throw IoError(name + ": " + std::to_string(available - h.data_bytes) +
                  " trailing bytes after the data: header says " + npy_describe(h) + ", file has " +
                  std::to_string(available));
}

/// The offset of the data of a .npy file held in memory (`total` bytes at `p`), with its header
/// in `h`, every check of parse_npy made (the data size included).
inline std::size_t npy_data_offset(const std::uint8_t* p, std::uint64_t total,
                                   const std::string& name, NpyHeader& h) {
  const NpyPreamble pre = parse_npy_preamble(p, total, name);
  h = NpyHeaderParser(reinterpret_cast<const char*>(p) + pre.header_offset, pre.header_len, name)
          .parse();
  const std::size_t off = pre.header_offset + pre.header_len;
  check_npy_data_size(h, total - off, name);
  return off;
}

/// Decodes `count` little-endian floats of `itemsize` bytes at `src` into `dst`.
inline void decode_le_floats(const std::uint8_t* src, std::size_t count, std::size_t itemsize,
                             double* dst) {
  for (std::size_t k = 0; k < count; ++k, src += itemsize) {
    std::uint64_t bits = 0;
    for (std::size_t b = 0; b < itemsize; ++b) bits |= std::uint64_t(src[b]) << (8 * b);
    if (itemsize == 8) {
      std::memcpy(&dst[k], &bits, 8);
    } else if (itemsize == 4) {
      const auto b32 = static_cast<std::uint32_t>(bits);
      float f;
      std::memcpy(&f, &b32, 4);
      dst[k] = static_cast<double>(f);
    } else {
      dst[k] = io::half_to_double(static_cast<std::uint16_t>(bits));
    }
  }
}

inline NpyArray make_npy_array(NpyHeader&& h, const std::string& name) {
  NpyArray a;
  a.shape = std::move(h.shape);
  a.dtype = std::move(h.descr);
  a.fortran_order = h.fortran_order;
  a.name = name;
  a.data.resize(h.numel);
  return a;
}

/// Closes a std::FILE* on scope exit.
struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};

}  // namespace detail

/// Parses a whole .npy file held in memory (a file's bytes, or an .npz member); `name` starts
/// every error message. Throws IoError on anything malformed or unsupported (see the top of
/// this file).
inline NpyArray parse_npy(const std::uint8_t* data, std::size_t size, const std::string& name) {
  if (data == nullptr && size != 0) throw IoError(name + ": no data");
  const detail::NpyPreamble pre = detail::parse_npy_preamble(data, size, name);
  detail::NpyHeader h =
      detail::NpyHeaderParser(reinterpret_cast<const char*>(data) + pre.header_offset,
                              pre.header_len, name)
          .parse();
  const std::size_t data_offset = pre.header_offset + pre.header_len;
  detail::check_npy_data_size(h, size - data_offset, name);
  const std::size_t itemsize = h.itemsize;
  NpyArray a = detail::make_npy_array(std::move(h), name);
  detail::decode_le_floats(data + data_offset, a.data.size(), itemsize, a.data.data());
  return a;
}

/// Reads a .npy file (see parse_npy). The data size is checked against the file size before
/// the data is read; the file is read in chunks, never held twice.
inline NpyArray read_npy(const std::string& path) {
  struct stat st {};
  const int fd = open_input(path, st);  // regular files only; a FIFO never blocks
  std::unique_ptr<std::FILE, detail::FileCloser> f(::fdopen(fd, "rb"));
  if (!f) {
    const int e = errno;
    ::close(fd);
    throw IoError(path + ": cannot open: " + detail::errno_str(e));
  }
  const auto total = static_cast<std::uint64_t>(st.st_size);
  auto read_exact = [&](void* dst, std::size_t n) {
    if (n > 0 && std::fread(dst, 1, n, f.get()) != n)
      throw IoError(path + (std::ferror(f.get()) ? ": read error: " + detail::errno_str(errno)
                                                 : std::string(": truncated while reading")));
  };
  std::uint8_t pre_bytes[12] = {};
  read_exact(pre_bytes, static_cast<std::size_t>(std::min<std::uint64_t>(total, 12)));
  const detail::NpyPreamble pre = detail::parse_npy_preamble(pre_bytes, total, path);
  // The header starts inside pre_bytes for version 1.0 (offset 10): re-read from the offset.
  std::string header(pre.header_len, '\0');
  if (std::fseek(f.get(), static_cast<long>(pre.header_offset), SEEK_SET) != 0)
    throw IoError(path + ": seek failed: " + detail::errno_str(errno));
  read_exact(header.data(), header.size());
  detail::NpyHeader h = detail::NpyHeaderParser(header.data(), header.size(), path).parse();
  detail::check_npy_data_size(h, total - pre.header_offset - pre.header_len, path);
  const std::size_t itemsize = h.itemsize;
  NpyArray a = detail::make_npy_array(std::move(h), path);
  constexpr std::size_t kChunkItems = std::size_t(1) << 15;
  std::vector<std::uint8_t> buf(std::min(a.data.size(), kChunkItems) * itemsize);
  for (std::size_t done = 0; done < a.data.size();) {
    const std::size_t n = std::min(kChunkItems, a.data.size() - done);
    read_exact(buf.data(), n * itemsize);
    detail::decode_le_floats(buf.data(), n, itemsize, a.data.data() + done);
    done += n;
  }
  if (std::fgetc(f.get()) != EOF) throw IoError(path + ": trailing bytes (the file grew)");
  return a;
}

}  // namespace spectral_cond::io

// The writer (encode_npy, write_npy).
#include "spectral_cond/io/formats/npy_writer.hpp"
