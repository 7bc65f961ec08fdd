// spectral_cond::io::detail: the safetensors header as a SAX pass (nlohmann::json::sax_parse)
// that builds no JSON document, and the checks of each tensor entry. Included by
// io/formats/safetensors.hpp, which defines TensorInfo, Dtype and st_fail first; do not include
// directly.
#pragma once

#include <spectral_cond/io/json.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace spectral_cond {
namespace io {
namespace detail {

/// One tensor entry as the header states it, before any check (SafetensorsSax fills it).
struct RawEntry {
  std::string name;
  bool is_object = true;
  std::string unexpected;  ///< the first field that is not dtype, shape or data_offsets
  bool has_dtype = false, dtype_is_string = false;
  std::string dtype;
  bool has_shape = false, shape_is_array = false, shape_bad = false;
  std::size_t shape_len = 0;  ///< entries in the array (only the first 65 are kept)
  std::vector<std::uint64_t> shape;
  bool has_offsets = false, offsets_is_array = false, offsets_bad = false;
  std::size_t offsets_len = 0;
  std::uint64_t offsets[2] = {0, 0};
};

/// The checks of parse_safetensors_header on one entry; throws IoError naming the tensor.
inline TensorInfo check_entry(const std::string& file, const RawEntry& e, std::uint64_t data_size) {
  const std::string& name = e.name;
  if (!e.is_object) st_fail(file, name, "entry is not an object");
  if (!e.unexpected.empty()) st_fail(file, name, "unexpected field " + quote(e.unexpected));
  if (!e.has_dtype) st_fail(file, name, "missing field 'dtype'");
  if (!e.has_shape) st_fail(file, name, "missing field 'shape'");
  if (!e.has_offsets) st_fail(file, name, "missing field 'data_offsets'");
  TensorInfo t;
  t.name = name;
  if (!e.dtype_is_string) st_fail(file, name, "dtype is not a string");
  if (!dtype_from_string(e.dtype, t.dtype)) st_fail(file, name, "unknown dtype " + quote(e.dtype));
  if (!e.shape_is_array) st_fail(file, name, "shape is not an array");
  if (e.shape_len > 64) st_fail(file, name, "shape has more than 64 dimensions");
  if (e.shape_bad) st_fail(file, name, "shape entries must be non-negative integers");
  // The extent (zero dimensions counted as one) must fit too: it bounds every loop over the
  // dimensions, also of an empty tensor such as [2^62, 0].
  std::uint64_t extent = 1;
  bool overflow = false, zero = false;
  const std::uint64_t es = dtype_size(t.dtype);
  for (std::uint64_t v : e.shape) {
    t.shape.push_back(static_cast<std::int64_t>(v));
    if (v == 0) zero = true;
    const std::uint64_t v1 = std::max<std::uint64_t>(v, 1);
    if (extent > UINT64_MAX / es / v1) overflow = true;
    if (!overflow) extent *= v1;
  }
  if (overflow) st_fail(file, name, "shape product overflows");
  const std::uint64_t numel = zero ? 0 : extent;
  if (!e.offsets_is_array || e.offsets_bad || e.offsets_len != 2)
    st_fail(file, name, "data_offsets must be two non-negative integers");
  t.begin = e.offsets[0];
  t.end = e.offsets[1];
  if (t.end < t.begin) st_fail(file, name, "data_offsets end < begin");
  if (t.end > data_size)
    st_fail(file, name,
            "data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                ") beyond the data buffer of " + std::to_string(data_size) + " bytes");
  if (numel * es != t.end - t.begin)
    st_fail(file, name,
            "byte length " + std::to_string(t.end - t.begin) + " != " + std::to_string(numel) +
                " elements x " + std::to_string(es) + " bytes (" + to_string(t.dtype) + ")");
  return t;
}

/// A SAX handler for a safetensors header that builds no JSON document: each entry goes
/// straight into a RawEntry (one linear pass, no per-entry allocations beyond the name and the
/// shape), so that a header of 60,000 tensors parses in tens of milliseconds. Duplicate keys in
/// an entry or in __metadata__ stop the parse; duplicate tensor names are found afterwards (the
/// entries are sorted by name). Values nested where the format has none are recorded as the
/// entry's error, and skipped with only a depth count.
class SafetensorsSax {
 public:
  using json = nlohmann::json;

  std::vector<RawEntry> entries;
  std::map<std::string, std::string> metadata;
  std::string duplicate, where, error, metadata_error;
  std::string deep_in;  ///< the top-level key under which the nesting limit was reached
  bool not_object = false, too_deep = false, metadata_not_object = false, has_metadata = false;

  bool null() { return scalar(Kind::Other, 0, nullptr); }
  bool boolean(bool) { return scalar(Kind::Other, 0, nullptr); }
  bool number_integer(json::number_integer_t v) {
    return v >= 0 ? scalar(Kind::Unsigned, static_cast<std::uint64_t>(v), nullptr)
                  : scalar(Kind::Other, 0, nullptr);
  }
  bool number_unsigned(json::number_unsigned_t v) { return scalar(Kind::Unsigned, v, nullptr); }
  bool number_float(json::number_float_t, const json::string_t&) {
    return scalar(Kind::Other, 0, nullptr);
  }
  bool string(json::string_t& s) { return scalar(Kind::String, 0, &s); }
  bool binary(json::binary_t&) { return scalar(Kind::Other, 0, nullptr); }

  bool start_object(std::size_t) { return open(true); }
  bool start_array(std::size_t) { return open(false); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }

  bool key(json::string_t& k) {
    if (depth_ == 1) {
      in_metadata_ = k == "__metadata__";
      if (in_metadata_) {
        if (has_metadata) return dup(k, "");
        has_metadata = true;
      } else {
        entries.emplace_back();
        entries.back().name = std::move(k);
      }
      return true;
    }
    if (depth_ == 2 && in_metadata_) {
      if (metadata.count(k)) return dup(k, "__metadata__");
      meta_key_ = std::move(k);
      return true;
    }
    if (depth_ == 2) {  // a field of an entry
      RawEntry& e = entries.back();
      int f = k == "dtype" ? 1 : k == "shape" ? 2 : k == "data_offsets" ? 4 : 0;
      if (f == 0) {
        if (e.unexpected.empty()) e.unexpected = k;
        // Keys of unknown fields are not kept; two equal ones are the same unexpected field.
      } else if (fields_ & f) {
        return dup(k, e.name);
      }
      fields_ |= f;
      field_ = f;
      return true;
    }
    return true;  // inside a value the format does not nest: already the entry's error
  }

  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& ex) {
    error = json_error_text(ex);
    return false;
  }

 private:
  enum class Kind { Unsigned, String, Other };

  bool dup(const std::string& k, const std::string& in) {
    duplicate = k;
    if (!in.empty()) where = " in " + quote(in);
    return false;
  }

  /// A scalar at the current place.
  bool scalar(Kind kind, std::uint64_t u, json::string_t* s) {
    if (depth_ == 0) {
      not_object = true;
      return false;
    }
    if (depth_ == 1) {
      if (in_metadata_)
        metadata_not_object = true;
      else
        entries.back().is_object = false;
      return true;
    }
    if (depth_ == 2 && in_metadata_) {
      if (kind != Kind::String) {
        if (metadata_error.empty()) metadata_error = meta_key_;
      } else {
        metadata.emplace(std::move(meta_key_), std::move(*s));
      }
      return true;
    }
    if (depth_ == 2) {
      RawEntry& e = entries.back();
      if (field_ == 1) {
        e.has_dtype = true;
        e.dtype_is_string = kind == Kind::String;
        if (s) e.dtype = std::move(*s);
      } else if (field_ == 2) {
        e.has_shape = true;
      } else if (field_ == 4) {
        e.has_offsets = true;
      }
      return true;
    }
    if (depth_ == 3 && !in_metadata_ && array3_) {
      RawEntry& e = entries.back();
      if (field_ == 2) {
        if (kind != Kind::Unsigned || u > static_cast<std::uint64_t>(INT64_MAX))
          e.shape_bad = true;
        else if (e.shape.size() <= 64)
          e.shape.push_back(u);
        ++e.shape_len;
      } else if (field_ == 4) {
        if (kind != Kind::Unsigned)
          e.offsets_bad = true;
        else if (e.offsets_len < 2)
          e.offsets[e.offsets_len] = u;
        ++e.offsets_len;
      }
    }
    return true;
  }

  bool open(bool object) {
    if (depth_ >= kMaxJsonDepth) {
      too_deep = true;
      deep_in =
          in_metadata_ ? "__metadata__" : (entries.empty() ? std::string() : entries.back().name);
      return false;
    }
    if (depth_ == 0 && !object) {
      not_object = true;
      return false;
    }
    if (depth_ == 1) {
      if (in_metadata_)
        metadata_not_object = metadata_not_object || !object;
      else if (!object)
        entries.back().is_object = false;
      fields_ = 0;
      field_ = 0;
    } else if (depth_ == 2 && !in_metadata_) {
      RawEntry& e = entries.back();
      // A field's value: shape and data_offsets are arrays of integers, dtype a string.
      if (field_ == 1) {
        e.has_dtype = true;
      } else if (field_ == 2) {
        e.has_shape = true;
        e.shape_is_array = !object;
      } else if (field_ == 4) {
        e.has_offsets = true;
        e.offsets_is_array = !object;
      }
      array3_ = !object;
    } else if (depth_ == 2 && in_metadata_) {
      if (metadata_error.empty()) metadata_error = meta_key_;
    } else if (depth_ == 3 && !in_metadata_) {
      RawEntry& e = entries.back();  // an array or object inside shape / data_offsets
      if (field_ == 2) {
        e.shape_bad = true;
        ++e.shape_len;
      } else if (field_ == 4) {
        e.offsets_bad = true;
        ++e.offsets_len;
      }
    }
    ++depth_;
    return true;
  }

  bool close() {
    --depth_;
    if (depth_ == 2) array3_ = false;
    return true;
  }

  int depth_ = 0;
  bool in_metadata_ = false, array3_ = false;
  int fields_ = 0, field_ = 0;  // the fields seen in the current entry, the one being read
  std::string meta_key_;
};

}  // namespace detail
}  // namespace io
}  // namespace spectral_cond
