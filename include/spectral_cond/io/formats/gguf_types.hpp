// spectral_cond::io: the types of a GGUF file (io/formats/gguf.hpp): metadata value types and
// values, ggml tensor types and what the reader knows of each, tensor infos and the checked header.
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

}  // namespace io
}  // namespace spectral_cond
