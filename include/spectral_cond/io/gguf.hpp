// spectral_cond::io: a defensive reader for GGUF, llama.cpp's checkpoint format (versions 2 and
// 3): header, metadata and tensor infos are checked before any tensor is touched; tensor data is
// memory-mapped and dequantized to double on request (F32, F16, BF16, F64, the 32-element blocks
// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the 256-element K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K).
//
// File layout, all little-endian: "GGUF", u32 version, u64 tensor count, u64 metadata count;
// the metadata entries {string key, u32 value type, value}; the tensor infos {string name,
// u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset}; padding up to general.alignment
// (default 32); the data section, which the offsets are relative to. A string is a u64 length
// and that many bytes (no terminator); an array is a u32 element type, a u64 count and the
// elements. ne[0] is the fastest-varying dimension: the shape in PyTorch's row-major order is
// ne reversed, so a 2-D tensor with ne = [cols, rows] has shape {rows, cols}.
//
// Checks, all before any allocation or loop they bound: every count, length and dimension
// against the bytes left and against fixed limits; arrays nested at most kGgufMaxArrayDepth
// deep; unique metadata keys and tensor names; n_dims <= 4; shape products without overflow;
// known ggml types; rows (ne[0]) a whole number of blocks; offsets multiples of the alignment
// (a power of two <= kGgufMaxAlignment), inside the data section, tensors not overlapping.
// Every failure is an IoError whose one-line message names the file (and the metadata key or
// the tensor): "<file>: gguf: tensor 'blk.0.attn_q.weight': ...".
//
// Dequantized values are those of the quantized model: κ of a matrix read here is κ of the
// weight llama.cpp computes with, not of the original floating-point checkpoint it was
// quantized from.
#pragma once

#include <spectral_cond/core/common.hpp>
#include <spectral_cond/io/error.hpp>
#include <spectral_cond/io/float16.hpp>
#include <spectral_cond/io/mapped_file.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace spectral_cond {
namespace io {

/// Most dimensions of a tensor (ggml's GGML_MAX_DIMS).
inline constexpr std::uint32_t kGgufMaxDims = 4;
/// Most levels of arrays inside arrays in a metadata value (an array of scalars is one level).
inline constexpr int kGgufMaxArrayDepth = 8;
/// Largest general.alignment accepted (files use 32; this allows up to 64 KiB pages).
inline constexpr std::uint64_t kGgufMaxAlignment = std::uint64_t{1} << 16;
/// Most metadata entries, and most tensors, a file may declare (real models: tens of entries,
/// a few thousand tensors). Both counts are also bounded by the bytes left in the file.
inline constexpr std::uint64_t kGgufMaxMetadata = std::uint64_t{1} << 20;
inline constexpr std::uint64_t kGgufMaxTensors = std::uint64_t{1} << 20;
/// general.alignment when a file does not set it.
inline constexpr std::uint64_t kGgufDefaultAlignment = 32;

/// Types of metadata values (gguf_type), numbered as in the file.
enum class GgufType : std::uint32_t {
  UINT8 = 0,
  INT8 = 1,
  UINT16 = 2,
  INT16 = 3,
  UINT32 = 4,
  INT32 = 5,
  FLOAT32 = 6,
  BOOL = 7,
  STRING = 8,
  ARRAY = 9,
  UINT64 = 10,
  INT64 = 11,
  FLOAT64 = 12
};

inline const char* to_string(GgufType t) {
  switch (t) {
    case GgufType::UINT8:
      return "UINT8";
    case GgufType::INT8:
      return "INT8";
    case GgufType::UINT16:
      return "UINT16";
    case GgufType::INT16:
      return "INT16";
    case GgufType::UINT32:
      return "UINT32";
    case GgufType::INT32:
      return "INT32";
    case GgufType::FLOAT32:
      return "FLOAT32";
    case GgufType::BOOL:
      return "BOOL";
    case GgufType::STRING:
      return "STRING";
    case GgufType::ARRAY:
      return "ARRAY";
    case GgufType::UINT64:
      return "UINT64";
    case GgufType::INT64:
      return "INT64";
    case GgufType::FLOAT64:
      return "FLOAT64";
  }
  return "unknown";
}

/// Tensor element types (ggml_type), numbered as in the file. Numbers missing here (4, 5,
/// 31-33, 36-38: removed from ggml) and numbers above the last are unknown and refused.
enum class GgmlType : std::uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q8_1 = 9,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  Q8_K = 15,
  IQ2_XXS = 16,
  IQ2_XS = 17,
  IQ3_XXS = 18,
  IQ1_S = 19,
  IQ4_NL = 20,
  IQ3_S = 21,
  IQ2_S = 22,
  IQ4_XS = 23,
  I8 = 24,
  I16 = 25,
  I32 = 26,
  I64 = 27,
  F64 = 28,
  IQ1_M = 29,
  BF16 = 30,
  TQ1_0 = 34,
  TQ2_0 = 35,
  MXFP4 = 39,
  NVFP4 = 40,
  Q1_0 = 41
};

/// What the reader knows of a ggml type: a row of ne[0] elements is ne[0] / block_size blocks
/// of type_size bytes each.
struct GgmlTypeInfo {
  GgmlType type;
  const char* name;
  std::uint32_t block_size;
  std::uint32_t type_size;
  bool dequantizable;  ///< values() and matrix() can read it
};

/// The entry of ggml type number `id`, or nullptr for a number this reader does not know.
inline const GgmlTypeInfo* ggml_type_info(std::uint32_t id) {
  // Block sizes and bytes per block as in ggml's type traits (ggml-common.h's block structs).
  static const GgmlTypeInfo table[] = {{GgmlType::F32, "F32", 1, 4, true},
                                       {GgmlType::F16, "F16", 1, 2, true},
                                       {GgmlType::Q4_0, "Q4_0", 32, 18, true},
                                       {GgmlType::Q4_1, "Q4_1", 32, 20, true},
                                       {GgmlType::Q5_0, "Q5_0", 32, 22, true},
                                       {GgmlType::Q5_1, "Q5_1", 32, 24, true},
                                       {GgmlType::Q8_0, "Q8_0", 32, 34, true},
                                       {GgmlType::Q8_1, "Q8_1", 32, 36, false},
                                       {GgmlType::Q2_K, "Q2_K", 256, 84, true},
                                       {GgmlType::Q3_K, "Q3_K", 256, 110, true},
                                       {GgmlType::Q4_K, "Q4_K", 256, 144, true},
                                       {GgmlType::Q5_K, "Q5_K", 256, 176, true},
                                       {GgmlType::Q6_K, "Q6_K", 256, 210, true},
                                       {GgmlType::Q8_K, "Q8_K", 256, 292, true},
                                       {GgmlType::IQ2_XXS, "IQ2_XXS", 256, 66, false},
                                       {GgmlType::IQ2_XS, "IQ2_XS", 256, 74, false},
                                       {GgmlType::IQ3_XXS, "IQ3_XXS", 256, 98, false},
                                       {GgmlType::IQ1_S, "IQ1_S", 256, 50, false},
                                       {GgmlType::IQ4_NL, "IQ4_NL", 32, 18, false},
                                       {GgmlType::IQ3_S, "IQ3_S", 256, 110, false},
                                       {GgmlType::IQ2_S, "IQ2_S", 256, 82, false},
                                       {GgmlType::IQ4_XS, "IQ4_XS", 256, 136, false},
                                       {GgmlType::I8, "I8", 1, 1, false},
                                       {GgmlType::I16, "I16", 1, 2, false},
                                       {GgmlType::I32, "I32", 1, 4, false},
                                       {GgmlType::I64, "I64", 1, 8, false},
                                       {GgmlType::F64, "F64", 1, 8, true},
                                       {GgmlType::IQ1_M, "IQ1_M", 256, 56, false},
                                       {GgmlType::BF16, "BF16", 1, 2, true},
                                       {GgmlType::TQ1_0, "TQ1_0", 256, 54, false},
                                       {GgmlType::TQ2_0, "TQ2_0", 256, 66, false},
                                       {GgmlType::MXFP4, "MXFP4", 32, 17, false},
                                       {GgmlType::NVFP4, "NVFP4", 64, 36, false},
                                       {GgmlType::Q1_0, "Q1_0", 128, 18, false}};
  for (const auto& t : table)
    if (static_cast<std::uint32_t>(t.type) == id) return &t;
  return nullptr;
}

inline const char* to_string(GgmlType t) {
  const GgmlTypeInfo* i = ggml_type_info(static_cast<std::uint32_t>(t));
  return i != nullptr ? i->name : "unknown";
}

class GgufValue;

namespace detail {
class GgufCursor;
inline GgufValue gguf_read_value(GgufCursor& c, std::uint32_t type, int depth,
                                 const std::string& ctx, bool keep);
}  // namespace detail

/// A metadata value: an integer, a float, a bool, a string, or an array of any of these
/// (arrays may nest). Accessors return std::nullopt when the value is of another kind. An array
/// keeps a copy of its elements' bytes (never more than the file holds) and decodes them only
/// when elements() is called, so a tokenizer's 150 000 strings cost one copy until asked for.
class GgufValue {
 public:
  GgufValue() = default;

  GgufType type() const { return type_; }
  /// UINT8 ... INT64 (not BOOL).
  bool is_integer() const {
    return is_unsigned() || type_ == GgufType::INT8 || type_ == GgufType::INT16 ||
           type_ == GgufType::INT32 || type_ == GgufType::INT64;
  }
  bool is_float() const { return type_ == GgufType::FLOAT32 || type_ == GgufType::FLOAT64; }
  bool is_bool() const { return type_ == GgufType::BOOL; }
  bool is_string() const { return type_ == GgufType::STRING; }
  bool is_array() const { return type_ == GgufType::ARRAY; }

  /// An integer that fits in int64 (a UINT64 above 2^63 - 1 does not).
  std::optional<std::int64_t> as_int() const {
    if (is_unsigned()) {
      if (bits_ > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        return std::nullopt;
      return static_cast<std::int64_t>(bits_);
    }
    if (is_integer()) return signed_value();
    return std::nullopt;
  }
  /// A non-negative integer.
  std::optional<std::uint64_t> as_uint() const {
    if (is_unsigned()) return bits_;
    if (is_integer() && signed_value() >= 0) return static_cast<std::uint64_t>(signed_value());
    return std::nullopt;
  }
  /// A float, or an integer converted to double (rounded above 2^53).
  std::optional<double> as_double() const {
    if (is_float()) return float_;
    if (is_unsigned()) return static_cast<double>(bits_);
    if (is_integer()) return static_cast<double>(signed_value());
    return std::nullopt;
  }
  std::optional<bool> as_bool() const {
    if (!is_bool()) return std::nullopt;
    return bits_ != 0;
  }
  /// The bytes of a STRING as stored (GGUF says UTF-8; not checked).
  std::optional<std::string> as_string() const {
    if (!is_string()) return std::nullopt;
    return str_;
  }

  /// An array's element type (UINT8 for a value that is not an array).
  GgufType element_type() const { return elem_; }
  /// An array's element count (0 for a value that is not an array).
  std::uint64_t size() const { return count_; }
  /// An array's elements, decoded (empty for a value that is not an array). Costs one GgufValue
  /// (about 100 bytes) per element: a large array of numbers takes far more memory decoded than
  /// in the file.
  std::vector<GgufValue> elements() const;

  /// A short description for messages: "UINT32 32", "STRING 'llama'", "ARRAY of 3 INT32".
  std::string describe() const {
    if (is_array())
      return std::string("ARRAY of ") + std::to_string(count_) + " " + to_string(elem_);
    if (is_string()) return std::string("STRING ") + detail::quote(str_, 60);
    if (is_bool()) return bits_ != 0 ? "BOOL true" : "BOOL false";
    if (is_float()) {
      // The shortest of 15, 16, 17 significant digits that reads back as the same double.
      char buf[40];
      for (int digits = 15; digits <= 17; ++digits) {
        std::snprintf(buf, sizeof buf, "%.*g", digits, float_);
        if (std::strtod(buf, nullptr) == float_ || std::isnan(float_)) break;
      }
      return std::string(to_string(type_)) + " " + buf;
    }
    if (is_unsigned()) return std::string(to_string(type_)) + " " + std::to_string(bits_);
    return std::string(to_string(type_)) + " " + std::to_string(signed_value());
  }

 private:
  friend GgufValue detail::gguf_read_value(detail::GgufCursor& c, std::uint32_t type, int depth,
                                           const std::string& ctx, bool keep);

  bool is_unsigned() const {
    return type_ == GgufType::UINT8 || type_ == GgufType::UINT16 || type_ == GgufType::UINT32 ||
           type_ == GgufType::UINT64;
  }
  std::int64_t signed_value() const {
    std::int64_t v = 0;
    std::memcpy(&v, &bits_, sizeof v);
    return v;
  }

  GgufType type_ = GgufType::UINT8;
  std::uint64_t bits_ = 0;  ///< integers (signed ones sign-extended) and BOOL
  double float_ = 0;        ///< FLOAT32 (exactly) and FLOAT64
  std::string str_;         ///< STRING
  GgufType elem_ = GgufType::UINT8;
  std::uint64_t count_ = 0;
  std::vector<std::uint8_t> raw_;  ///< ARRAY: the elements as stored in the file
};

/// One tensor info. The parser guarantees: shape.size() <= 4, every dimension <= 2^63 - 1 and
/// their product too, shape.back() (ne[0]) a multiple of the type's block size, nbytes =
/// numel / block_size * type_size, offset a multiple of the alignment and [offset, offset +
/// nbytes) inside the data section.
struct GgufTensorInfo {
  std::string name;
  std::vector<std::int64_t> shape;  ///< PyTorch order (row-major): ne reversed
  GgmlType type = GgmlType::F32;
  std::uint64_t offset = 0;  ///< relative to the data section
  std::uint64_t nbytes = 0;
  std::uint64_t numel() const {
    std::uint64_t n = 1;
    for (std::int64_t s : shape) n *= static_cast<std::uint64_t>(s);
    return n;
  }
  /// ggml's ne: the shape reversed, fastest-varying dimension first.
  std::vector<std::int64_t> ne() const { return {shape.rbegin(), shape.rend()}; }
};

/// A parsed and fully checked GGUF header.
struct GgufHeader {
  std::uint32_t version = 0;                        ///< 2 or 3
  std::uint64_t alignment = kGgufDefaultAlignment;  ///< general.alignment
  std::uint64_t data_start = 0;  ///< file offset of the data section (after the padding)
  std::uint64_t data_size = 0;   ///< bytes from data_start to the end of the file
  std::map<std::string, GgufValue> metadata;
  std::vector<GgufTensorInfo> tensors;       ///< in file order, names unique
  std::map<std::string, std::size_t> index;  ///< name -> position in `tensors`

  /// The tensor called `name`, or nullptr.
  const GgufTensorInfo* find(const std::string& name) const {
    auto it = index.find(name);
    return it != index.end() ? &tensors[it->second] : nullptr;
  }
  /// The metadata value under `key`, or nullptr.
  const GgufValue* find_metadata(const std::string& key) const {
    auto it = metadata.find(key);
    return it != metadata.end() ? &it->second : nullptr;
  }
};

namespace detail {

[[noreturn]] inline void gguf_fail(const std::string& file, const std::string& msg) {
  throw IoError(file + ": gguf: " + msg);
}
[[noreturn]] inline void gguf_fail(const std::string& file, const std::string& tensor,
                                   const std::string& msg) {
  throw IoError(file + ": gguf: tensor " + quote(tensor) + ": " + msg);
}

inline std::uint64_t gguf_le(const std::uint8_t* p, unsigned n) {
  std::uint64_t v = 0;
  for (unsigned i = n; i-- > 0;) v = (v << 8) | p[i];
  return v;
}

inline bool gguf_known_value_type(std::uint64_t t) {
  return t <= static_cast<std::uint32_t>(GgufType::FLOAT64);
}

/// Bytes of a value of fixed size, 0 for STRING and ARRAY.
inline std::uint64_t gguf_fixed_size(GgufType t) {
  switch (t) {
    case GgufType::UINT8:
    case GgufType::INT8:
    case GgufType::BOOL:
      return 1;
    case GgufType::UINT16:
    case GgufType::INT16:
      return 2;
    case GgufType::UINT32:
    case GgufType::INT32:
    case GgufType::FLOAT32:
      return 4;
    case GgufType::UINT64:
    case GgufType::INT64:
    case GgufType::FLOAT64:
      return 8;
    case GgufType::STRING:
    case GgufType::ARRAY:
      return 0;
  }
  return 0;
}

/// Reads little-endian fields from [0, size) and never past it; every failure names the file
/// and what was being read.
class GgufCursor {
 public:
  GgufCursor(const std::uint8_t* data, std::size_t size, std::size_t pos, const std::string& file)
      : p_(data), n_(size), pos_(pos), file_(file) {}

  std::size_t pos() const { return pos_; }
  std::uint64_t left() const { return n_ - pos_; }
  const std::uint8_t* data() const { return p_; }
  const std::string& file() const { return file_; }

  [[noreturn]] void fail(const std::string& ctx, const std::string& msg) const {
    gguf_fail(file_, ctx + ": " + msg);
  }

  /// Throws unless `k` more bytes are there.
  void need(std::uint64_t k, const std::string& ctx, const char* what) const {
    if (k > left())
      fail(ctx, std::string(what) + " (" + std::to_string(k) + " bytes at offset " +
                    std::to_string(pos_) + ") runs past the end of the file (" +
                    std::to_string(left()) + " bytes left)");
  }
  std::uint64_t le(unsigned k, const std::string& ctx, const char* what) {
    need(k, ctx, what);
    const std::uint64_t v = gguf_le(p_ + pos_, k);
    pos_ += k;
    return v;
  }
  void skip(std::uint64_t k, const std::string& ctx, const char* what) {
    need(k, ctx, what);
    pos_ += static_cast<std::size_t>(k);
  }
  /// A u64 length and that many bytes; the length is checked before anything is copied.
  std::string str(const std::string& ctx, const char* what) {
    const std::uint64_t len = le(8, ctx, what);
    if (len > left())
      fail(ctx, std::string(what) + " length " + std::to_string(len) + " exceeds the " +
                    std::to_string(left()) + " bytes left");
    std::string s(reinterpret_cast<const char*>(p_ + pos_), static_cast<std::size_t>(len));
    pos_ += static_cast<std::size_t>(len);
    return s;
  }

 private:
  const std::uint8_t* p_;
  std::size_t n_;
  std::size_t pos_;
  const std::string& file_;
};

/// Reads (keep) or only checks and skips (!keep) one value of type `type` at the cursor.
/// `depth` is the number of arrays around it. Arrays are checked element by element (every
/// loop consumes at least one byte per step, after its count was checked against the bytes
/// left) and kept as a copy of their bytes.
inline GgufValue gguf_read_value(GgufCursor& c, std::uint32_t type, int depth,
                                 const std::string& ctx, bool keep) {
  GgufValue v;
  if (!gguf_known_value_type(type)) c.fail(ctx, "unknown value type " + std::to_string(type));
  v.type_ = static_cast<GgufType>(type);
  switch (v.type_) {
    case GgufType::STRING:
      if (keep) {
        v.str_ = c.str(ctx, "string");
      } else {
        const std::uint64_t len = c.le(8, ctx, "string length");
        if (len > c.left())
          c.fail(ctx, "string length " + std::to_string(len) + " exceeds the " +
                          std::to_string(c.left()) + " bytes left");
        c.skip(len, ctx, "string");
      }
      return v;
    case GgufType::ARRAY: {
      const std::uint64_t et = c.le(4, ctx, "array element type");
      if (!gguf_known_value_type(et))
        c.fail(ctx, "array of unknown value type " + std::to_string(et));
      const auto elem = static_cast<GgufType>(et);
      const std::uint64_t count = c.le(8, ctx, "array length");
      if (elem == GgufType::ARRAY && depth + 1 >= kGgufMaxArrayDepth)
        c.fail(ctx, "arrays nested deeper than " + std::to_string(kGgufMaxArrayDepth) + " levels");
      // The least an element can take: its fixed size, a string's length, an array's header.
      const std::uint64_t fixed = gguf_fixed_size(elem);
      const std::uint64_t least = fixed != 0 ? fixed : elem == GgufType::STRING ? 8 : 12;
      if (count > c.left() / least)
        c.fail(ctx, "array of " + std::to_string(count) + " " + to_string(elem) +
                        " needs at least " + std::to_string(least) + " bytes each, only " +
                        std::to_string(c.left()) + " bytes left");
      const std::size_t start = c.pos();
      if (fixed != 0) {
        if (elem == GgufType::BOOL) {
          for (std::uint64_t k = 0; k < count; ++k)
            if (c.data()[start + k] > 1)
              c.fail(ctx, "array element " + std::to_string(k) + ": bool value " +
                              std::to_string(c.data()[start + k]) + " is neither 0 nor 1");
        }
        c.skip(count * fixed, ctx, "array");
      } else {
        for (std::uint64_t k = 0; k < count; ++k)
          (void)gguf_read_value(c, static_cast<std::uint32_t>(elem), depth + 1, ctx, false);
      }
      v.elem_ = elem;
      v.count_ = count;
      if (keep) v.raw_.assign(c.data() + start, c.data() + c.pos());
      return v;
    }
    case GgufType::FLOAT32: {
      const auto u = static_cast<std::uint32_t>(c.le(4, ctx, "value"));
      float f = 0;
      std::memcpy(&f, &u, sizeof f);
      v.float_ = static_cast<double>(f);
      return v;
    }
    case GgufType::FLOAT64: {
      const std::uint64_t u = c.le(8, ctx, "value");
      std::memcpy(&v.float_, &u, sizeof u);
      return v;
    }
    default:
      break;
  }
  const auto n = static_cast<unsigned>(gguf_fixed_size(v.type_));
  const std::uint64_t u = c.le(n, ctx, "value");
  v.bits_ = u;
  const bool is_signed = v.type_ == GgufType::INT8 || v.type_ == GgufType::INT16 ||
                         v.type_ == GgufType::INT32 || v.type_ == GgufType::INT64;
  if (is_signed && n < 8 && (u >> (8 * n - 1)) != 0) v.bits_ = u | (~std::uint64_t{0} << (8 * n));
  if (v.type_ == GgufType::BOOL && u > 1)
    c.fail(ctx, "bool value " + std::to_string(u) + " is neither 0 nor 1");
  return v;
}

}  // namespace detail

inline std::vector<GgufValue> GgufValue::elements() const {
  std::vector<GgufValue> out;
  if (!is_array()) return out;
  // The bytes were checked when the file was parsed; count_ elements are in raw_.
  const std::string label = "(metadata array)";
  detail::GgufCursor c(raw_.data(), raw_.size(), 0, label);
  out.reserve(static_cast<std::size_t>(count_));
  for (std::uint64_t k = 0; k < count_; ++k)
    out.push_back(
        detail::gguf_read_value(c, static_cast<std::uint32_t>(elem_), 0, "element", true));
  return out;
}

namespace detail {

inline void gguf_read_metadata(GgufCursor& c, std::uint64_t n_kv, GgufHeader& h) {
  for (std::uint64_t k = 0; k < n_kv; ++k) {
    const std::string entry = "metadata entry " + std::to_string(k);
    std::string key = c.str(entry, "key");
    if (key.empty()) c.fail(entry, "empty key");
    const std::string ctx = "metadata " + quote(key);
    const auto type = static_cast<std::uint32_t>(c.le(4, ctx, "value type"));
    GgufValue v = gguf_read_value(c, type, 0, ctx, true);
    if (!h.metadata.emplace(std::move(key), std::move(v)).second) c.fail(ctx, "duplicate key");
  }
  if (const GgufValue* a = h.find_metadata("general.alignment")) {
    const std::optional<std::uint64_t> u = a->as_uint();
    if (!u || *u == 0 || (*u & (*u - 1)) != 0 || *u > kGgufMaxAlignment)
      gguf_fail(c.file(), "metadata 'general.alignment': " + a->describe() +
                              " is not a power of two between 1 and " +
                              std::to_string(kGgufMaxAlignment));
    h.alignment = *u;
  }
}

inline GgufTensorInfo gguf_read_tensor_info(GgufCursor& c, std::uint64_t k) {
  GgufTensorInfo t;
  t.name = c.str("tensor info " + std::to_string(k), "name");
  if (t.name.empty()) c.fail("tensor info " + std::to_string(k), "empty name");
  const std::string ctx = "tensor " + quote(t.name);
  const std::uint64_t n_dims = c.le(4, ctx, "n_dims");
  if (n_dims > kGgufMaxDims)
    c.fail(ctx,
           std::to_string(n_dims) + " dimensions (at most " + std::to_string(kGgufMaxDims) + ")");
  std::int64_t ne[kGgufMaxDims] = {};
  for (std::uint64_t d = 0; d < n_dims; ++d) {
    const std::uint64_t v = c.le(8, ctx, "dimension");
    if (v > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      c.fail(ctx, "dimension ne[" + std::to_string(d) + "] = " + std::to_string(v) +
                      " exceeds 2^63 - 1");
    ne[d] = static_cast<std::int64_t>(v);
  }
  const std::uint64_t type = c.le(4, ctx, "ggml type");
  t.offset = c.le(8, ctx, "offset");
  const GgmlTypeInfo* ti = ggml_type_info(static_cast<std::uint32_t>(type));
  if (ti == nullptr) c.fail(ctx, "unknown ggml type " + std::to_string(type));
  t.type = ti->type;
  // Product of the dimensions, a zero one counted as one, so that an empty tensor's extent is
  // bounded too.
  constexpr auto kMax = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  std::uint64_t extent = 1;
  bool zero = false;
  for (std::uint64_t d = 0; d < n_dims; ++d) {
    const auto v = static_cast<std::uint64_t>(ne[d]);
    if (v == 0) zero = true;
    const std::uint64_t v1 = std::max<std::uint64_t>(v, 1);
    if (extent > kMax / v1) c.fail(ctx, "shape product overflows");
    extent *= v1;
  }
  const std::uint64_t numel = zero ? 0 : extent;
  const auto row = n_dims == 0 ? std::uint64_t{1} : static_cast<std::uint64_t>(ne[0]);
  if (row % ti->block_size != 0)
    c.fail(ctx, "row length " + std::to_string(row) + " (ne[0]) is not a multiple of the " +
                    ti->name + " block size " + std::to_string(ti->block_size));
  const std::uint64_t blocks = numel / ti->block_size;
  if (blocks > std::numeric_limits<std::uint64_t>::max() / ti->type_size)
    c.fail(ctx, "byte size overflows");
  t.nbytes = blocks * ti->type_size;
  for (std::uint64_t d = n_dims; d-- > 0;) t.shape.push_back(ne[d]);
  return t;
}

inline void gguf_check_layout(const std::string& file, GgufHeader& h) {
  for (const auto& t : h.tensors) {
    if (t.offset % h.alignment != 0)
      gguf_fail(file, t.name,
                "offset " + std::to_string(t.offset) + " is not a multiple of the alignment " +
                    std::to_string(h.alignment));
    if (t.offset > h.data_size || t.nbytes > h.data_size - t.offset)
      gguf_fail(file, t.name,
                "data [" + std::to_string(t.offset) + ", +" + std::to_string(t.nbytes) +
                    " bytes) lies outside the data section of " + std::to_string(h.data_size) +
                    " bytes (starting at file offset " + std::to_string(h.data_start) + ")");
  }
  std::vector<const GgufTensorInfo*> by_off;
  for (const auto& t : h.tensors)
    if (t.nbytes > 0) by_off.push_back(&t);
  std::sort(by_off.begin(), by_off.end(), [](const GgufTensorInfo* a, const GgufTensorInfo* b) {
    return a->offset != b->offset ? a->offset < b->offset : a->name < b->name;
  });
  for (std::size_t i = 1; i < by_off.size(); ++i) {
    const GgufTensorInfo* prev = by_off[i - 1];
    if (by_off[i]->offset < prev->offset + prev->nbytes)
      gguf_fail(file, by_off[i]->name, "data overlaps tensor " + quote(prev->name));
  }
}

}  // namespace detail

/// Parses and checks a whole GGUF file held in memory (`size` bytes at `data`); `name` labels
/// messages. Refuses other magics, big-endian files, versions other than 2 and 3, and
/// everything the top of this file lists. Throws IoError on the first violation.
inline GgufHeader parse_gguf(const std::uint8_t* data, std::size_t size, const std::string& name) {
  using detail::gguf_fail;
  if (data == nullptr && size != 0) gguf_fail(name, "no data");
  if (size < 4 || std::memcmp(data, "GGUF", 4) != 0)
    gguf_fail(name, "not a GGUF file (it does not start with the magic 'GGUF')");
  if (size < 8) gguf_fail(name, "file of " + std::to_string(size) + " bytes has no version");
  GgufHeader h;
  const auto version = static_cast<std::uint32_t>(detail::gguf_le(data + 4, 4));
  const std::uint32_t swapped = std::uint32_t{data[4]} << 24 | std::uint32_t{data[5]} << 16 |
                                std::uint32_t{data[6]} << 8 | std::uint32_t{data[7]};
  if (version > 0xFFFF && swapped >= 1 && swapped <= 3)
    gguf_fail(name, "big-endian GGUF file (version " + std::to_string(swapped) +
                        " byte-swapped) is not supported; only little-endian files are read");
  if (version == 1)
    gguf_fail(name,
              "GGUF version 1 is not supported (versions 2 and 3 are read); convert the "
              "file with a current llama.cpp");
  if (version != 2 && version != 3)
    gguf_fail(name, "unsupported GGUF version " + std::to_string(version) +
                        " (versions 2 and 3 are read)");
  h.version = version;
  if (size < 24)
    gguf_fail(name,
              "file of " + std::to_string(size) + " bytes is too short for the 24-byte header");
  const std::uint64_t n_tensors = detail::gguf_le(data + 8, 8);
  const std::uint64_t n_kv = detail::gguf_le(data + 16, 8);
  const std::uint64_t rest = size - 24;
  // A metadata entry takes at least 13 bytes (key length, type, a one-byte value), a tensor info
  // at least 24 (name length, n_dims, type, offset): both counts are checked before any loop.
  if (n_kv > kGgufMaxMetadata || n_kv > rest / 13)
    gguf_fail(name, "metadata count " + std::to_string(n_kv) + " exceeds what the " +
                        std::to_string(rest) + " bytes after the header can hold (limit " +
                        std::to_string(kGgufMaxMetadata) + ")");
  if (n_tensors > kGgufMaxTensors || n_tensors > rest / 24 || n_kv * 13 + n_tensors * 24 > rest)
    gguf_fail(name, "tensor count " + std::to_string(n_tensors) + " exceeds what the " +
                        std::to_string(rest) + " bytes after the header can hold (limit " +
                        std::to_string(kGgufMaxTensors) + ")");
  detail::GgufCursor c(data, size, 24, name);
  detail::gguf_read_metadata(c, n_kv, h);
  h.tensors.reserve(static_cast<std::size_t>(n_tensors));
  for (std::uint64_t k = 0; k < n_tensors; ++k) {
    GgufTensorInfo t = detail::gguf_read_tensor_info(c, k);
    if (!h.index.emplace(t.name, h.tensors.size()).second)
      gguf_fail(name, t.name, "duplicate tensor name");
    h.tensors.push_back(std::move(t));
  }
  const std::uint64_t end = c.pos();
  h.data_start = end + (h.alignment - end % h.alignment) % h.alignment;
  h.data_size = h.data_start <= size ? size - h.data_start : 0;
  detail::gguf_check_layout(name, h);
  return h;
}

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

/// "[i, j, k]": the multi-index of row-major position `k` in `shape`.
inline std::string gguf_index_string(std::uint64_t k, const std::vector<std::int64_t>& shape) {
  std::vector<std::uint64_t> idx(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    const auto n = static_cast<std::uint64_t>(shape[d]);
    idx[d] = k % n;
    k /= n;
  }
  std::string s = "[";
  for (std::size_t d = 0; d < idx.size(); ++d) s += (d ? ", " : "") + std::to_string(idx[d]);
  return s + "]";
}

}  // namespace detail

/// A parsed GGUF file over bytes someone else owns (a buffer, a map): the bytes must outlive
/// it. GgufFile owns its bytes.
class GgufView {
 public:
  /// Parses and checks the header (parse_gguf); throws IoError.
  GgufView(const std::uint8_t* data, std::size_t size, const std::string& name)
      : data_(data), size_(size), name_(name), header_(parse_gguf(data, size, name)) {}

  /// The name messages start with (the path, for a GgufFile).
  const std::string& name() const { return name_; }
  /// The whole file's bytes.
  ByteView buffer() const { return {data_, size_}; }
  const GgufHeader& header() const { return header_; }
  std::uint32_t version() const { return header_.version; }
  /// All tensors, in file order.
  const std::vector<GgufTensorInfo>& tensors() const { return header_.tensors; }
  std::vector<std::string> names() const {
    std::vector<std::string> n;
    for (const auto& t : header_.tensors) n.push_back(t.name);
    return n;
  }
  bool contains(const std::string& tensor) const { return header_.find(tensor) != nullptr; }
  /// The tensor's info; IoError naming the file and tensor when there is none.
  const GgufTensorInfo& info(const std::string& tensor) const {
    const GgufTensorInfo* t = header_.find(tensor);
    if (t == nullptr) detail::gguf_fail(name_, tensor, "no such tensor");
    return *t;
  }

  const std::map<std::string, GgufValue>& metadata() const { return header_.metadata; }
  /// The value under `key`, or nullptr.
  const GgufValue* find_metadata(const std::string& key) const {
    return header_.find_metadata(key);
  }
  /// general.architecture ("llama", "qwen2", ...); IoError when it is missing or not a string.
  std::string architecture() const {
    const std::optional<std::string> a = get_string("general.architecture");
    if (!a) detail::gguf_fail(name_, "metadata 'general.architecture' is missing");
    return *a;
  }
  /// The integer under `key`; nullopt when the key is absent. A value of another type (a float,
  /// a string, an array such as per-layer head counts) or a UINT64 above 2^63 - 1 is an IoError
  /// naming the key.
  std::optional<std::int64_t> get_int(const std::string& key) const {
    const GgufValue* v = find_metadata(key);
    if (v == nullptr) return std::nullopt;
    const std::optional<std::int64_t> i = v->as_int();
    if (!i)
      detail::gguf_fail(name_, "metadata " + detail::quote(key) + ": " + v->describe() +
                                   " is not an integer that fits in int64");
    return i;
  }
  /// The string under `key`; nullopt when the key is absent, IoError when it is not a string.
  std::optional<std::string> get_string(const std::string& key) const {
    const GgufValue* v = find_metadata(key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_string())
      detail::gguf_fail(
          name_, "metadata " + detail::quote(key) + ": " + v->describe() + " is not a string");
    return v->as_string();
  }

  /// The tensor's bytes exactly as stored.
  ByteView bytes(const std::string& tensor) const {
    const GgufTensorInfo& t = info(tensor);
    if (t.nbytes == 0) return {};  // its offset may point past the end of a file without data
    return {data_ + header_.data_start + t.offset, static_cast<std::size_t>(t.nbytes)};
  }

  /// All elements of a tensor of any rank, dequantized to double, in row-major order of
  /// `shape` (ggml's memory order). IoError for types that cannot be dequantized (the IQ and
  /// ternary types, integers) and for a NaN or infinite result, naming the entry.
  std::vector<double> values(const std::string& tensor) const {
    const GgufTensorInfo& t = info(tensor);
    const GgmlTypeInfo& ti = *ggml_type_info(static_cast<std::uint32_t>(t.type));
    if (!ti.dequantizable)
      detail::gguf_fail(name_, tensor,
                        std::string("type ") + ti.name + " (" +
                            std::to_string(static_cast<std::uint32_t>(t.type)) +
                            ") cannot be dequantized (read: F32, F16, BF16, F64, Q4_0, Q4_1, "
                            "Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K)");
    const std::uint64_t n = t.numel();
    if (n > std::vector<double>().max_size())
      detail::gguf_fail(name_, tensor, std::to_string(n) + " elements do not fit in memory");
    std::vector<double> out(static_cast<std::size_t>(n));
    if (n == 0) return out;
    detail::gguf_dequantize(ti, data_ + header_.data_start + t.offset, n / ti.block_size,
                            out.data());
    for (std::size_t k = 0; k < out.size(); ++k) {
      if (!std::isfinite(out[k]))
        detail::gguf_fail(name_, tensor,
                          "entry " + detail::gguf_index_string(k, t.shape) + " is " +
                              (std::isnan(out[k]) ? "NaN"
                               : out[k] > 0       ? "+inf"
                                                  : "-inf") +
                              " after dequantizing " + ti.name);
    }
    return out;
  }

  /// A 2-D tensor as a matrix, entry (i, j) = T[i, j] for shape {rows, cols} (ggml's ne =
  /// [cols, rows]); for an attention projection that is PyTorch's weight (out x in). IoError for
  /// other ranks, and as values().
  Mat<double> matrix(const std::string& tensor) const {
    const GgufTensorInfo& t = info(tensor);
    if (t.shape.size() != 2)
      detail::gguf_fail(
          name_, tensor,
          "has " + std::to_string(t.shape.size()) + " dimensions; a matrix needs exactly 2");
    const std::vector<double> v = values(tensor);
    const auto rows = static_cast<Index>(t.shape[0]), cols = static_cast<Index>(t.shape[1]);
    Mat<double> m(rows, cols);
    if (v.empty()) return m;
    for (Index i = 0; i < rows; ++i)
      for (Index j = 0; j < cols; ++j) m(i, j) = v[static_cast<std::size_t>(i * cols + j)];
    return m;
  }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::string name_;
  GgufHeader header_;
};

namespace detail {
/// Holds the map so that it is built before the GgufView base that parses it.
struct GgufMapHolder {
  explicit GgufMapHolder(const std::string& path) : map(path) {}
  MappedFile map;
};
}  // namespace detail

/// A memory-mapped GGUF file. The header is parsed and checked on open; tensor data is touched
/// only when a tensor is asked for. Move-only; moving keeps the mapping (and every pointer into
/// it) where it is.
class GgufFile : private detail::GgufMapHolder, public GgufView {
 public:
  explicit GgufFile(const std::string& path)
      : detail::GgufMapHolder(path), GgufView(map.data(), map.size(), path) {}

  const std::string& path() const { return map.path(); }
};

/// Undoes the row permutation llama.cpp's converter (convert_hf_to_gguf.py) applies to the Q
/// and K projections of "llama" models, so that heads and RoPE pairs are in Hugging Face order
/// again. The converter writes, for each head h of d = rows / n_head rows and i < d / 2,
/// t in {0, 1}: permuted row h d + 2 i + t = original row h d + t d / 2 + i (numpy:
/// w.reshape(n_head, 2, d / 2, cols).swapaxes(1, 2).reshape(rows, cols)). This inverts it
/// exactly. Pass attention.head_count for attn_q and attention.head_count_kv for attn_k (the
/// converter does). A row permutation leaves singular values and κ unchanged; it matters for
/// per-head slices. Throws std::invalid_argument unless n_head > 0 divides rows / 2.
inline Mat<double> undo_llama_rope_permutation(const Mat<double>& w, Index n_head) {
  const char* fn = "undo_llama_rope_permutation";
  if (n_head <= 0)
    spectral_cond::detail::fail(fn, "n_head must be positive (got " + std::to_string(n_head) + ")");
  if (w.rows() % (2 * n_head) != 0)
    spectral_cond::detail::fail(
        fn, "rows (" + std::to_string(w.rows()) +
                ") must be a multiple of 2 x n_head = " + std::to_string(2 * n_head));
  const Index d = w.rows() / n_head, half = d / 2;
  Mat<double> out(w.rows(), w.cols());
  for (Index h = 0; h < n_head; ++h)
    for (Index i = 0; i < half; ++i)
      for (Index t = 0; t < 2; ++t) out.row(h * d + t * half + i) = w.row(h * d + 2 * i + t);
  return out;
}

}  // namespace io
}  // namespace spectral_cond
