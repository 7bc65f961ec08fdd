// spectral_cond::io: a reader for PyTorch checkpoints as torch.save writes them
// (docs/checkpoints.md):
//
//   zip     the default since PyTorch 1.6: an uncompressed zip holding <prefix>/data.pkl (the
//           pickled object), one member <prefix>/data/<key> per storage and <prefix>/byteorder.
//   legacy  torch.save(..., _use_new_zipfile_serialization=False): five pickles in a row (magic
//           number, protocol version, system info, the object, the storage keys), then each
//           storage as an 8-byte element count followed by its bytes.
//
// The pickles are read by a restricted unpickler (PickleReader, io/formats/detail/pickle.hpp) that
// only builds values: it knows the containers (tuples, lists, dicts, OrderedDict), the tensor
// rebuild functions (torch._utils._rebuild_tensor_v2, _rebuild_tensor, _rebuild_parameter,
// _rebuild_parameter_with_state, torch._tensor._rebuild_from_type_v2) and the typed storages
// (torch.FloatStorage, ...). Any other global becomes an opaque value that is never called; an
// unknown torch rebuild function (quantized, sparse, ...) is an error naming it. No code of the
// file is ever run. Every length is checked against the bytes left before anything is copied, the
// number of values, memo entries and stack cells is bounded, and a tensor's extent (offset,
// shape, strides) must lie inside its storage. The tensors of the object are found by walking its
// dicts: nested keys join with "." (a checkpoint {"model": state_dict} gives "model.<key>").
#pragma once

#include <spectral_cond/core/common.hpp>
#include <spectral_cond/io/error.hpp>
#include <spectral_cond/io/float16.hpp>
#include <spectral_cond/io/formats/detail/pickle.hpp>
#include <spectral_cond/io/formats/npz.hpp>
#include <spectral_cond/io/formats/safetensors.hpp>
#include <spectral_cond/io/layouts/detect.hpp>
#include <spectral_cond/io/mapped_file.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace spectral_cond {
namespace io {

/// One tensor of a PyTorch checkpoint.
struct PytorchTensor {
  std::string name;                  ///< the key in the pickled dicts (nested keys joined by ".")
  Dtype dtype = Dtype::F32;          ///< from the storage type (torch.FloatStorage: F32, ...)
  std::vector<std::int64_t> shape;   ///< torch's size
  std::vector<std::int64_t> stride;  ///< in elements
  std::int64_t offset = 0;           ///< storage offset, in elements
  std::string storage;               ///< the storage key

  std::int64_t numel() const {
    std::int64_t n = 1;
    for (std::int64_t d : shape) n *= d;
    return n;
  }
  /// Row-major without gaps: the bytes can be used as they are.
  bool contiguous() const {
    std::int64_t s = 1;
    for (std::size_t k = shape.size(); k-- > 0;) {
      if (shape[k] != 1 && stride[k] != s) return false;
      s *= shape[k];
    }
    return true;
  }
};

namespace detail {

/// Where a storage's bytes are.
struct PytorchStorage {
  Dtype dtype = Dtype::U8;
  std::int64_t numel = 0;
  std::uint64_t offset = 0;           ///< of its bytes in the file (zip: of the member's data)
  const NpzMember* member = nullptr;  ///< zip: the member (STORED or DEFLATE)
};

/// Collects the tensors of an unpickled object (see the top of this file).
class TensorCollector {
 public:
  TensorCollector(std::string file, std::map<std::string, PytorchTensor>& out,
                  std::map<std::string, PytorchStorage>& storages)
      : file_(std::move(file)), out_(out), storages_(storages) {}

  void walk(const PickleRef& v, const std::string& name, int depth) {
    using K = PickleValue::Kind;
    if (v->kind == K::Tensor) return add(*v->parts, name.empty() ? "tensor" : name);
    if (v->kind != K::Dict && v->kind != K::List && v->kind != K::Tuple) return;
    if (depth > kPickleMaxDepth)
      throw IoError(file_ + ": pytorch: containers nested deeper than " +
                    std::to_string(kPickleMaxDepth) + " at " + quote(name));
    if (!on_path_.insert(v).second) return;  // a cycle
    const std::string prefix = name.empty() ? "" : name + ".";
    if (v->kind == K::Dict) {
      for (std::size_t k = 0; k + 1 < v->items.size(); k += 2) {
        const PickleRef& key = v->items[k];
        std::string ks;
        if (key->kind == K::Str)
          ks = key->s;
        else if (key->kind == K::Int)
          ks = std::to_string(key->i);
        else
          continue;
        walk(v->items[k + 1], prefix + ks, depth + 1);
      }
    } else {
      for (std::size_t k = 0; k < v->items.size(); ++k)
        walk(v->items[k], prefix + std::to_string(k), depth + 1);
    }
    on_path_.erase(v);
  }

 private:
  [[noreturn]] void fail(const std::string& name, const std::string& msg) const {
    throw IoError(file_ + ": pytorch: tensor " + quote(name) + ": " + msg);
  }

  void add(const PickleTensorParts& t, const std::string& name) {
    const PickleTensorParts& s = *t.storage->parts;
    if (!s.typed)
      fail(name, "its storage " + quote(s.key) + " has type " + quote(t.storage->s) +
                     " (typed float, int or bool storages only)");
    storages_.emplace(s.key, PytorchStorage{s.dtype, s.numel, 0, nullptr});
    if (t.shape.size() != t.stride.size())
      fail(name, std::to_string(t.shape.size()) + " sizes but " + std::to_string(t.stride.size()) +
                     " strides");
    if (t.shape.size() > 8) fail(name, std::to_string(t.shape.size()) + " dimensions (at most 8)");
    if (t.offset < 0) fail(name, "negative storage offset");
    // numel and the last element's index, with overflow checks (all < 2^62).
    constexpr std::int64_t lim = std::int64_t{1} << 62;
    std::int64_t numel = 1, last = t.offset;
    for (std::size_t k = 0; k < t.shape.size(); ++k) {
      if (t.shape[k] < 0 || t.stride[k] < 0) fail(name, "negative size or stride");
      if (t.shape[k] != 0 && numel > lim / t.shape[k]) fail(name, "element count overflows");
      numel *= t.shape[k];
    }
    if (numel > 0)
      for (std::size_t k = 0; k < t.shape.size(); ++k) {
        if (t.stride[k] != 0 && t.shape[k] - 1 > (lim - last) / t.stride[k])
          fail(name, "extent overflows");
        last += (t.shape[k] - 1) * t.stride[k];
      }
    if (numel > 0 && last >= s.numel)
      fail(name, "reaches element " + std::to_string(last) + " of storage " + quote(s.key) +
                     ", which holds " + std::to_string(s.numel));
    PytorchTensor out;
    out.name = name;
    out.dtype = s.dtype;
    out.shape = t.shape;
    out.stride = t.stride;
    out.offset = t.offset;
    out.storage = s.key;
    if (!out_.emplace(name, std::move(out)).second) fail(name, "two tensors have this name");
  }

  std::string file_;
  std::map<std::string, PytorchTensor>& out_;
  std::map<std::string, PytorchStorage>& storages_;
  std::set<const PickleValue*> on_path_;
};

/// Loads one element of dtype d at p as a double.
inline double load_element(Dtype d, const std::uint8_t* p) {
  switch (d) {
    case Dtype::F64: {
      const std::uint64_t u = zip_le(p, 8);
      double v = 0;
      std::memcpy(&v, &u, 8);
      return v;
    }
    case Dtype::F32: {
      const auto u = static_cast<std::uint32_t>(zip_le(p, 4));
      float v = 0;
      std::memcpy(&v, &u, 4);
      return v;
    }
    case Dtype::F16:
      return half_to_double(static_cast<std::uint16_t>(zip_le(p, 2)));
    case Dtype::BF16:
      return bf16_to_double(static_cast<std::uint16_t>(zip_le(p, 2)));
    default:
      return 0;
  }
}

}  // namespace detail

/// A PyTorch checkpoint (zip or legacy format), memory-mapped; the pickle is read on open,
/// storages only when a tensor is asked for.
class PytorchFile {
 public:
  explicit PytorchFile(const std::string& path)
      : map_(path), data_(map_.data()), size_(map_.size()), name_(path) {
    open();
  }
  /// A checkpoint held in memory, which must outlive this object; `name` labels messages.
  PytorchFile(const std::uint8_t* data, std::size_t size, const std::string& name)
      : data_(data), size_(size), name_(name) {
    open();
  }
  PytorchFile(const PytorchFile&) = delete;
  PytorchFile& operator=(const PytorchFile&) = delete;

  const std::string& path() const { return name_; }
  /// "zip" or "legacy".
  const char* format() const { return zip_ ? "zip" : "legacy"; }
  /// Every tensor, by name.
  const std::map<std::string, PytorchTensor>& tensors() const { return tensors_; }
  std::vector<std::string> names() const {
    std::vector<std::string> v;
    for (const auto& kv : tensors_) v.push_back(kv.first);
    return v;
  }
  const PytorchTensor& info(const std::string& name) const {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) fail("no tensor " + detail::quote(name));
    return it->second;
  }

  /// A 2-D (or 1-D: a column) float tensor as a double matrix, entry (i, j) = T[i, j].
  Mat<double> matrix(const std::string& name) const {
    const PytorchTensor& t = info(name);
    if (t.shape.size() > 2 || t.shape.empty())
      fail_tensor(name, "has shape " + detail::shape_string(t.shape) + ", expected a matrix");
    if (!is_convertible(t.dtype))
      fail_tensor(name, std::string("has dtype ") + to_string(t.dtype) +
                            ", which cannot be read as floats");
    const Index rows = static_cast<Index>(t.shape[0]);
    const Index cols = t.shape.size() == 2 ? static_cast<Index>(t.shape[1]) : 1;
    const std::int64_t s1 = t.shape.size() == 2 ? t.stride[1] : 0;
    std::vector<std::uint8_t> buf;
    const std::uint8_t* base = storage_bytes(t, buf);
    const std::size_t es = dtype_size(t.dtype);
    Mat<double> m(rows, cols);
    for (Index j = 0; j < cols; ++j)
      for (Index i = 0; i < rows; ++i) {
        const std::int64_t e = t.offset + i * t.stride[0] + j * s1;
        m(i, j) = detail::load_element(t.dtype, base + static_cast<std::size_t>(e) * es);
      }
    return m;
  }

  /// The tensor's bytes in row-major order without gaps, little-endian in its dtype: in place
  /// when it is contiguous, else gathered into `buf`.
  ByteView bytes(const std::string& name, std::vector<std::uint8_t>& buf) const {
    const PytorchTensor& t = info(name);
    const std::size_t es = dtype_size(t.dtype);
    const auto count = static_cast<std::size_t>(t.numel());
    std::vector<std::uint8_t> raw;
    const std::uint8_t* base = storage_bytes(t, raw);
    if (t.contiguous()) {
      const std::uint8_t* first = base + static_cast<std::size_t>(t.offset) * es;
      if (raw.empty()) return {first, count * es};
      buf.assign(first, first + count * es);
      return {buf.data(), buf.size()};
    }
    buf.resize(count * es);
    std::vector<std::int64_t> idx(t.shape.size(), 0);
    for (std::size_t k = 0; k < count; ++k) {
      std::int64_t e = t.offset;
      for (std::size_t d = 0; d < idx.size(); ++d) e += idx[d] * t.stride[d];
      std::memcpy(buf.data() + k * es, base + static_cast<std::size_t>(e) * es, es);
      for (std::size_t d = idx.size(); d-- > 0;) {
        if (++idx[d] < t.shape[d]) break;
        idx[d] = 0;
      }
    }
    return {buf.data(), buf.size()};
  }

 private:
  void open() {
    if (size_ >= 4 && std::memcmp(data_, "PK\x03\x04", 4) == 0)
      open_zip();
    else if (size_ >= 2 && data_[0] == 0x80)
      open_legacy();
    else
      fail("not a PyTorch checkpoint (neither a zip archive nor a pickle)");
  }

  [[noreturn]] void fail(const std::string& msg) const {
    throw IoError(path() + ": pytorch: " + msg);
  }
  [[noreturn]] void fail_tensor(const std::string& name, const std::string& msg) const {
    fail("tensor " + detail::quote(name) + " " + msg);
  }

  /// The first byte of the tensor's storage (zip members that are deflated are inflated into buf).
  const std::uint8_t* storage_bytes(const PytorchTensor& t, std::vector<std::uint8_t>& buf) const {
    const detail::PytorchStorage& s = storages_.at(t.storage);
    if (s.member != nullptr) {
      const ByteView b =
          detail::ZipReader(data_, size_, path(), "pytorch", false).member_bytes(*s.member, buf);
      return b.data;
    }
    return data_ + s.offset;
  }

  void finish(detail::PickleReader& r, const detail::PickleRef& obj) {
    detail::TensorCollector(path(), tensors_, storages_).walk(obj, "", 0);
    if (tensors_.empty()) {
      std::string msg = "holds no tensors";
      if (!r.opaque_globals().empty()) {
        msg += " (it pickles";
        for (const std::string& g : r.opaque_globals()) msg += " " + g;
        msg += "; only tensors in dicts, lists and tuples are read)";
      }
      fail(msg);
    }
  }

  void open_zip() {
    zip_ = true;
    detail::ZipReader z(data_, size_, path(), "pytorch", false);
    members_ = z.members();
    std::string prefix;
    const NpzMember* pkl = nullptr;
    for (const NpzMember& m : members_) {
      const std::size_t slash = m.name.find('/');
      if (slash != std::string::npos &&
          m.name.compare(slash, std::string::npos, "/data.pkl") == 0) {
        if (pkl != nullptr) fail("two data.pkl members");
        pkl = &m;
        prefix = m.name.substr(0, slash + 1);
      }
    }
    if (pkl == nullptr)
      fail("zip archive without a <name>/data.pkl member: not a PyTorch checkpoint");
    std::map<std::string, const NpzMember*> by_name;
    for (const NpzMember& m : members_) by_name.emplace(m.name, &m);
    auto bo = by_name.find(prefix + "byteorder");
    if (bo != by_name.end()) {
      std::vector<std::uint8_t> buf;
      const ByteView b = z.member_bytes(*bo->second, buf);
      if (std::string(reinterpret_cast<const char*>(b.data), b.size) != "little")
        fail("byte order is not little-endian");
    }
    std::vector<std::uint8_t> pbuf;
    const ByteView pk = z.member_bytes(*pkl, pbuf);
    pickle_.assign(pk.data, pk.data + pk.size);
    detail::PickleReader r(pickle_.data(), pickle_.size(), path() + ": pytorch: " + pkl->name,
                           false);
    std::size_t pos = 0;
    const detail::PickleRef obj = r.load(pos);
    finish(r, obj);
    for (auto& kv : storages_) {
      const std::string& key = kv.first;
      if (key.empty() || key.find('/') != std::string::npos || key.find('\0') != std::string::npos)
        fail("storage key " + detail::quote(key) + " is not a plain name");
      auto it = by_name.find(prefix + "data/" + key);
      if (it == by_name.end())
        fail("storage " + detail::quote(key) + " has no member " +
             detail::quote(prefix + "data/" + key));
      const std::uint64_t want =
          static_cast<std::uint64_t>(kv.second.numel) * dtype_size(kv.second.dtype);
      if (it->second->uncompressed != want)
        fail("member " + detail::quote(it->second->name) + " holds " +
             std::to_string(it->second->uncompressed) + " bytes, its storage needs " +
             std::to_string(want));
      kv.second.member = it->second;
    }
  }

  void open_legacy() {
    const std::uint8_t* p = data_;
    const std::size_t n = size_;
    std::size_t pos = 0;
    detail::PickleReader r(p, n, path() + ": pytorch (legacy)", true);
    const detail::PickleRef magic = r.load(pos);
    static const std::uint8_t kMagic[] = {0x6c, 0xfc, 0x9c, 0x46, 0xf9,
                                          0x20, 0x6a, 0xa8, 0x50, 0x19};
    if (magic->kind != detail::PickleValue::Kind::BigInt ||
        magic->s != std::string(reinterpret_cast<const char*>(kMagic), sizeof kMagic))
      fail("a pickle, but not a torch.save checkpoint (no magic number): refused");
    const detail::PickleRef version = r.load(pos);
    if (version->kind != detail::PickleValue::Kind::Int || version->i != 1001)
      fail("legacy protocol version is not 1001");
    const detail::PickleRef sys = r.load(pos);
    for (std::size_t k = 0; k + 1 < sys->items.size(); k += 2)
      if (sys->items[k]->s == "little_endian" && sys->items[k + 1]->i == 0)
        fail("written on a big-endian machine: not supported");
    const detail::PickleRef obj = r.load(pos);
    finish(r, obj);
    const detail::PickleRef keys = r.load(pos);
    if (keys->kind != detail::PickleValue::Kind::List) fail("the storage key list is not a list");
    std::set<std::string> seen;
    for (const detail::PickleRef& k : keys->items) {
      if (k->kind != detail::PickleValue::Kind::Str) fail("a storage key is not a string");
      if (!seen.insert(k->s).second) fail("storage " + detail::quote(k->s) + " listed twice");
      if (n - pos < 8) fail("storage " + detail::quote(k->s) + ": truncated before its size");
      const std::uint64_t count = detail::zip_le(p + pos, 8);
      pos += 8;
      // Every listed storage was named by a persistent id of the object; its type gives the
      // element size, which is needed to skip it even when no tensor uses it.
      auto known = r.storages().find(k->s);
      if (known == r.storages().end())
        fail("storage " + detail::quote(k->s) + " is listed but never referenced");
      const detail::PickleTensorParts& sp = *known->second->parts;
      if (!sp.typed)
        fail("storage " + detail::quote(k->s) + " has type " + detail::quote(known->second->s) +
             ", whose element size this reader does not know");
      if (count != static_cast<std::uint64_t>(sp.numel))
        fail("storage " + detail::quote(k->s) + " holds " + std::to_string(count) +
             " elements, its persistent id declares " + std::to_string(sp.numel));
      const std::uint64_t bytes = count * dtype_size(sp.dtype);
      if (bytes > n - pos)
        fail("storage " + detail::quote(k->s) + " runs past the end of the file");
      auto st = storages_.find(k->s);
      if (st != storages_.end()) st->second.offset = pos;
      pos += static_cast<std::size_t>(bytes);
    }
    for (const auto& kv : r.storages())
      if (!seen.count(kv.first)) fail("storage " + detail::quote(kv.first) + " is not in the file");
    if (pos != n) fail(std::to_string(n - pos) + " bytes after the last storage");
  }

  MappedFile map_;  // empty for a checkpoint in memory
  const std::uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
  std::string name_;
  bool zip_ = false;
  std::vector<NpzMember> members_;
  std::vector<std::uint8_t> pickle_;
  std::map<std::string, PytorchTensor> tensors_;
  std::map<std::string, detail::PytorchStorage> storages_;
};

}  // namespace io
}  // namespace spectral_cond
