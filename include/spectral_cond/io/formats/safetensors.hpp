// spectral_cond::io: a defensive safetensors reader (header parsing, memory-mapped tensors,
// conversion to Mat<S>), sharded checkpoints, and an atomic writer. MATH.md §8 says which
// tensors of a checkpoint are attention weights and how they are laid out.
//
// File layout: u64 little-endian N, N bytes of UTF-8 JSON
//   {"__metadata__": {str: str}, "name": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}}
// then the data buffer; offsets are relative to its start. Everything is checked before any
// tensor is touched; every failure is an IoError whose one-line message names the file (and the
// tensor).
#pragma once

#include <spectral_cond/core/common.hpp>
#include <spectral_cond/io/atomic_file.hpp>
#include <spectral_cond/io/error.hpp>
#include <spectral_cond/io/float16.hpp>
#include <spectral_cond/io/json.hpp>
#include <spectral_cond/io/mapped_file.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace spectral_cond {
namespace io {

/// Element types of the safetensors format. F64, F32, F16 and BF16 convert to floating point;
/// the others can be listed and copied byte for byte, but not read as numbers.
enum class Dtype {
  F64,
  F32,
  F16,
  BF16,
  I64,
  I32,
  I16,
  I8,
  U64,
  U32,
  U16,
  U8,
  BOOL,
  F8_E4M3,
  F8_E5M2
};

inline const char* to_string(Dtype d) {
  switch (d) {
    case Dtype::F64:
      return "F64";
    case Dtype::F32:
      return "F32";
    case Dtype::F16:
      return "F16";
    case Dtype::BF16:
      return "BF16";
    case Dtype::I64:
      return "I64";
    case Dtype::I32:
      return "I32";
    case Dtype::I16:
      return "I16";
    case Dtype::I8:
      return "I8";
    case Dtype::U64:
      return "U64";
    case Dtype::U32:
      return "U32";
    case Dtype::U16:
      return "U16";
    case Dtype::U8:
      return "U8";
    case Dtype::BOOL:
      return "BOOL";
    case Dtype::F8_E4M3:
      return "F8_E4M3";
    case Dtype::F8_E5M2:
      return "F8_E5M2";
  }
  return "unknown";
}

/// Bytes per element.
inline std::size_t dtype_size(Dtype d) {
  switch (d) {
    case Dtype::F64:
    case Dtype::I64:
    case Dtype::U64:
      return 8;
    case Dtype::F32:
    case Dtype::I32:
    case Dtype::U32:
      return 4;
    case Dtype::F16:
    case Dtype::BF16:
    case Dtype::I16:
    case Dtype::U16:
      return 2;
    case Dtype::I8:
    case Dtype::U8:
    case Dtype::BOOL:
    case Dtype::F8_E4M3:
    case Dtype::F8_E5M2:
      return 1;
  }
  return 0;
}

/// True for the dtypes matrix() and encode_values() convert: F64, F32, F16, BF16.
inline bool is_convertible(Dtype d) {
  return d == Dtype::F64 || d == Dtype::F32 || d == Dtype::F16 || d == Dtype::BF16;
}

/// Parses "F32" etc.; false for names this reader does not know.
inline bool dtype_from_string(const std::string& s, Dtype& out) {
  static const Dtype all[] = {Dtype::F64, Dtype::F32, Dtype::F16,  Dtype::BF16,    Dtype::I64,
                              Dtype::I32, Dtype::I16, Dtype::I8,   Dtype::U64,     Dtype::U32,
                              Dtype::U16, Dtype::U8,  Dtype::BOOL, Dtype::F8_E4M3, Dtype::F8_E5M2};
  for (Dtype d : all) {
    if (s == to_string(d)) {
      out = d;
      return true;
    }
  }
  return false;
}

/// One tensor of a header. Offsets are relative to the data buffer; dims are <= INT64_MAX and
/// numel() * dtype_size(dtype) == end - begin is guaranteed by the parser.
struct TensorInfo {
  std::string name;
  Dtype dtype = Dtype::F32;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
  std::uint64_t numel() const {
    std::uint64_t n = 1;
    for (std::int64_t s : shape) n *= static_cast<std::uint64_t>(s);
    return n;
  }
  std::uint64_t nbytes() const { return end - begin; }
};

/// A parsed and fully checked header.
struct SafetensorsHeader {
  std::uint64_t header_size = 0;                ///< N, the JSON length
  std::uint64_t data_start = 0;                 ///< 8 + N, where the data buffer starts in the file
  std::uint64_t data_size = 0;                  ///< file size - 8 - N
  std::vector<TensorInfo> tensors;              ///< sorted by name, names unique
  std::map<std::string, std::string> metadata;  ///< "__metadata__", empty when absent

  /// The tensor called `name`, or nullptr.
  const TensorInfo* find(const std::string& name) const {
    auto it =
        std::lower_bound(tensors.begin(), tensors.end(), name,
                         [](const TensorInfo& t, const std::string& n) { return t.name < n; });
    return it != tensors.end() && it->name == name ? &*it : nullptr;
  }
};

/// Largest header accepted (the reference implementation uses the same bound).
constexpr std::uint64_t kMaxSafetensorsHeader = std::uint64_t{100} << 20;

namespace detail {

inline std::string one_line(const std::string& s) {
  std::string out = quote(s, 300);
  return out.substr(1, out.size() - 2);
}

[[noreturn]] inline void st_fail(const std::string& file, const std::string& msg) {
  throw IoError(file + ": safetensors: " + msg);
}
[[noreturn]] inline void st_fail(const std::string& file, const std::string& tensor,
                                 const std::string& msg) {
  throw IoError(file + ": safetensors: tensor " + quote(tensor) + ": " + msg);
}

inline std::uint64_t load_u64_le(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace detail
}  // namespace io
}  // namespace spectral_cond

#include <spectral_cond/io/formats/detail/safetensors_header.hpp>

namespace spectral_cond {
namespace io {
namespace detail {

/// Checkpoint formats that are not safetensors, by name: PyTorch checkpoints and GGUF.
inline const char* unsupported_format_of_name(const std::string& path) {
  auto ends = [&](const char* suffix) {
    const std::size_t n = std::strlen(suffix);
    return path.size() >= n && path.compare(path.size() - n, n, suffix) == 0;
  };
  for (const char* s : {".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle"})
    if (ends(s)) return "a PyTorch pickle checkpoint";
  if (ends(".gguf")) return "a GGUF file";
  return nullptr;
}

/// The message for a file given to the safetensors reader that is in another format.
inline std::string unsupported_message(const std::string& path, const char* what) {
  return path + ": " + what + ", not a safetensors file (io::open_checkpoint finds the format)";
}

/// Throws IoError when the bytes are those of another format (GGUF, a zip or pickle as PyTorch
/// writes them), so that the message says what the file is rather than how its first 8 bytes
/// fail as a header length.
inline void refuse_other_formats(const std::uint8_t* p, std::size_t n, const std::string& name) {
  if (n >= 9 && p[8] == '{') return;  // a safetensors header starts there, whatever its length
  if (n >= 4 && std::memcmp(p, "GGUF", 4) == 0)
    throw IoError(unsupported_message(name, "a GGUF file"));
  if ((n >= 4 && std::memcmp(p, "PK\x03\x04", 4) == 0) ||
      (n >= 2 && p[0] == 0x80 && p[1] >= 2 && p[1] <= 5))
    throw IoError(unsupported_message(name, "a PyTorch pickle checkpoint"));
}

}  // namespace detail

/// Parses and checks the header of a whole safetensors file held in memory (`size` bytes at
/// `data`); `name` labels messages. Checks: header length <= kMaxSafetensorsHeader and
/// <= size - 8; valid JSON object with unique keys in every object; "__metadata__" a str -> str
/// map; each tensor entry exactly {dtype, shape, data_offsets} with known dtype, non-negative
/// integer dims whose product does not overflow, begin <= end <= data size, end - begin = numel x
/// dtype size; no two non-empty tensors overlap. Throws IoError on the first violation.
inline SafetensorsHeader parse_safetensors_header(const std::uint8_t* data, std::size_t size,
                                                  const std::string& name) {
  using detail::st_fail;
  detail::refuse_other_formats(data, size, name);
  if (size < 8) st_fail(name, "file of " + std::to_string(size) + " bytes is too short");
  SafetensorsHeader h;
  h.header_size = detail::load_u64_le(data);
  if (h.header_size > kMaxSafetensorsHeader)
    st_fail(name, "header length " + std::to_string(h.header_size) + " exceeds the limit of " +
                      std::to_string(kMaxSafetensorsHeader));
  if (h.header_size > size - 8)
    st_fail(name, "header length " + std::to_string(h.header_size) +
                      " exceeds the file size minus 8 (" + std::to_string(size - 8) + ")");
  h.data_start = 8 + h.header_size;
  h.data_size = size - h.data_start;
  const char* js = reinterpret_cast<const char*>(data + 8);
  const std::string label = name + ": safetensors: header";
  detail::SafetensorsSax sax;
  bool ok = false;
  try {
    ok = nlohmann::json::sax_parse(js, js + h.header_size, &sax);
  } catch (const nlohmann::json::exception& ex) {
    throw IoError(label + ": not valid JSON: " + detail::json_error_text(ex));
  }
  if (sax.too_deep)
    throw IoError(label + ": JSON nested deeper than " + std::to_string(kMaxJsonDepth) + " levels" +
                  (sax.deep_in.empty() ? std::string() : " under " + detail::quote(sax.deep_in)));
  if (!sax.duplicate.empty())
    throw IoError(label + ": duplicate key " + detail::quote(sax.duplicate) + sax.where);
  if (sax.not_object) st_fail(name, "header JSON is not an object");
  if (!ok || !sax.error.empty())
    throw IoError(label + ": not valid JSON: " +
                  (sax.error.empty() ? std::string("parse failed") : sax.error));
  if (sax.metadata_not_object) st_fail(name, "__metadata__ is not an object");
  if (!sax.metadata_error.empty())
    st_fail(name,
            "__metadata__ value of " + detail::quote(sax.metadata_error) + " is not a string");
  h.metadata = std::move(sax.metadata);
  // Entries are checked in name order, so that of two bad entries the same one is named
  // whatever order the file lists them in; equal neighbours are duplicate keys.
  auto& es = sax.entries;
  auto by_name = [](const detail::RawEntry& x, const detail::RawEntry& y) {
    return x.name < y.name;
  };
  if (!std::is_sorted(es.begin(), es.end(), by_name)) std::sort(es.begin(), es.end(), by_name);
  for (std::size_t i = 1; i < es.size(); ++i)
    if (es[i].name == es[i - 1].name)
      throw IoError(label + ": duplicate key " + detail::quote(es[i].name));
  h.tensors.reserve(es.size());
  for (const auto& e : es) h.tensors.push_back(detail::check_entry(name, e, h.data_size));
  // h.tensors is sorted by name; check overlaps in offset order (empty tensors occupy no bytes).
  std::vector<const TensorInfo*> by_off;
  for (const auto& t : h.tensors)
    if (t.end > t.begin) by_off.push_back(&t);
  std::sort(by_off.begin(), by_off.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->name < b->name;
  });
  for (std::size_t i = 1; i < by_off.size(); ++i) {
    if (by_off[i]->begin < by_off[i - 1]->end)
      st_fail(name, by_off[i]->name, "data overlaps tensor " + detail::quote(by_off[i - 1]->name));
  }
  return h;
}

namespace detail {

template <typename S, typename Load>
void convert_loop(const std::uint8_t* p, std::size_t es, Index rows, Index cols, S* out,
                  Load load) {
  // Source is row-major rows x cols; out is column-major. No loop at all when one is empty.
  if (rows == 0 || cols == 0) return;
  for (Index i = 0; i < rows; ++i)
    for (Index k = 0; k < cols; ++k, p += es) out[i + k * rows] = static_cast<S>(load(p));
}

template <typename S>
void convert(const TensorInfo& t, const std::uint8_t* p, Index rows, Index cols, S* out) {
  switch (t.dtype) {
    case Dtype::F64:
      convert_loop(p, 8, rows, cols, out, [](const std::uint8_t* q) {
        const std::uint64_t u = load_u64_le(q);
        double v = 0;
        std::memcpy(&v, &u, 8);
        return v;
      });
      return;
    case Dtype::F32:
      convert_loop(p, 4, rows, cols, out, [](const std::uint8_t* q) {
        const std::uint32_t u = std::uint32_t{q[0]} | std::uint32_t{q[1]} << 8 |
                                std::uint32_t{q[2]} << 16 | std::uint32_t{q[3]} << 24;
        float v = 0;
        std::memcpy(&v, &u, 4);
        return v;
      });
      return;
    case Dtype::F16:
      convert_loop(p, 2, rows, cols, out, [](const std::uint8_t* q) {
        return io::half_to_double(static_cast<std::uint16_t>(q[0] | q[1] << 8));
      });
      return;
    case Dtype::BF16:
      convert_loop(p, 2, rows, cols, out, [](const std::uint8_t* q) {
        return io::bf16_to_double(static_cast<std::uint16_t>(q[0] | q[1] << 8));
      });
      return;
    default:
      break;
  }
}

}  // namespace detail

/// A memory-mapped safetensors file. The header is parsed and checked on open; tensor data is
/// touched only when a tensor is asked for, so opening a large shard reads one page.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path)
      : map_(open_checked(path)),
        header_(parse_safetensors_header(map_.data(), map_.size(), path)) {}

  const std::string& path() const { return map_.path(); }
  const SafetensorsHeader& header() const { return header_; }
  /// All tensors, sorted by name.
  const std::vector<TensorInfo>& tensors() const { return header_.tensors; }
  std::vector<std::string> names() const {
    std::vector<std::string> n;
    for (const auto& t : header_.tensors) n.push_back(t.name);
    return n;
  }
  bool contains(const std::string& name) const { return header_.find(name) != nullptr; }
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }

  /// The tensor's entry; IoError naming the file and tensor when there is none.
  const TensorInfo& info(const std::string& name) const {
    const TensorInfo* t = header_.find(name);
    if (t == nullptr) detail::st_fail(path(), name, "no such tensor");
    return *t;
  }

  /// The tensor's bytes exactly as stored (little-endian, row-major), for copying untouched.
  ByteView bytes(const std::string& name) const {
    const TensorInfo& t = info(name);
    return {map_.data() + header_.data_start + t.begin, static_cast<std::size_t>(t.nbytes())};
  }

  /// The tensor as a rows x cols matrix converted from F64/F32/F16/BF16 to S: 2-D tensors keep
  /// their shape, 1-D ones become a column, 0-D ones 1 x 1. Other ranks or dtypes: IoError.
  template <typename S>
  Mat<S> matrix(const std::string& name) const {
    const TensorInfo& t = info(name);
    if (t.shape.size() > 2)
      detail::st_fail(
          path(), name,
          "has " + std::to_string(t.shape.size()) + " dimensions; a matrix needs at most 2");
    const Index rows = t.shape.empty() ? 1 : static_cast<Index>(t.shape[0]);
    const Index cols = t.shape.size() == 2 ? static_cast<Index>(t.shape[1]) : 1;
    Mat<S> m(rows, cols);
    fill(t, rows, cols, m.data());
    return m;
  }

  /// All elements of a tensor of any rank, converted to S, in row-major (file) order.
  template <typename S>
  std::vector<S> values(const std::string& name) const {
    const TensorInfo& t = info(name);
    std::vector<S> v(static_cast<std::size_t>(t.numel()));
    fill(t, 1, static_cast<Index>(v.size()), v.data());
    return v;
  }

 private:
  static MappedFile open_checked(const std::string& path) { return MappedFile(path); }

  template <typename S>
  void fill(const TensorInfo& t, Index rows, Index cols, S* out) const {
    if (!is_convertible(t.dtype))
      detail::st_fail(path(), t.name,
                      std::string("dtype ") + to_string(t.dtype) + " cannot be read as floats");
    detail::convert(t, map_.data() + header_.data_start + t.begin, rows, cols, out);
  }

  MappedFile map_;
  SafetensorsHeader header_;
};

}  // namespace io
}  // namespace spectral_cond

#include <spectral_cond/io/formats/detail/safetensors_checkpoint.hpp>
#include <spectral_cond/io/formats/detail/safetensors_writer.hpp>
