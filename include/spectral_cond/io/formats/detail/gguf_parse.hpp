// spectral_cond::io: the GGUF header parser (parse_gguf): a bounded little-endian cursor, the
// metadata values, the tensor infos and the checks of their layout. Included by
// io/formats/gguf.hpp.
#pragma once

#include <spectral_cond/io/formats/gguf_types.hpp>

namespace spectral_cond {
namespace io {

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

}  // namespace io
}  // namespace spectral_cond
