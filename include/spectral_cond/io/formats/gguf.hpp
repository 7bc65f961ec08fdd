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
#include <spectral_cond/io/formats/detail/gguf_dequant.hpp>
#include <spectral_cond/io/formats/detail/gguf_parse.hpp>
#include <spectral_cond/io/formats/gguf_types.hpp>
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

namespace detail {

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

/// A tensor of `g` (its weight as a matrix, or its bias as one column) with its rows in Hugging
/// Face order: for architecture "llama", the attn_q / attn_k weights and biases had their rows
/// permuted by the converter (undo_llama_rope_permutation, with attention.head_count for attn_q
/// and attention.head_count_kv, else head_count, for attn_k); every other tensor and
/// architecture is returned unchanged. IoError naming the tensor when the head count is missing
/// or does not fit its rows.
inline Mat<double> in_hf_row_order(const GgufFile& g, const std::string& tensor, Mat<double> m) {
  auto is = [&](const std::string& suffix) {
    return tensor.size() >= suffix.size() &&
           tensor.compare(tensor.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  const bool q = is("attn_q.weight") || is("attn_q.bias");
  const bool k = is("attn_k.weight") || is("attn_k.bias");
  if ((!q && !k) || g.get_string("general.architecture").value_or("") != "llama") return m;
  const std::optional<std::int64_t> heads = g.get_int("llama.attention.head_count");
  std::optional<std::int64_t> kv = g.get_int("llama.attention.head_count_kv");
  if (!kv) kv = heads;
  const std::optional<std::int64_t> n = q ? heads : kv;
  if (!n || *n < 1)
    throw IoError(g.path() + ": gguf: tensor " + detail::quote(tensor) +
                  ": llama.attention.head_count is missing, so its rows cannot be put back in "
                  "Hugging Face order");
  if (m.rows() % (2 * *n) != 0)
    throw IoError(g.path() + ": gguf: tensor " + detail::quote(tensor) + " has " +
                  std::to_string(m.rows()) + " rows, not a multiple of 2 x " + std::to_string(*n) +
                  " heads");
  return undo_llama_rope_permutation(m, static_cast<Index>(*n));
}

}  // namespace io
}  // namespace spectral_cond
