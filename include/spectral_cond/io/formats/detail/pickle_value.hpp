// spectral_cond::io::detail: the values the restricted unpickler (detail/pickle.hpp) builds:
// containers, strings, numbers, storages and tensors, and opaque globals it never calls; they
// live in the reader's arena, and the limits bound how many there are.
#pragma once

#include <spectral_cond/io/error.hpp>
#include <spectral_cond/io/formats/safetensors.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace spectral_cond {
namespace io {
namespace detail {

/// Bounds of the unpickler: values created, and cells held by the stack, the memo and the
/// containers. A state dict needs about 15 values per tensor.
constexpr std::size_t kPickleMaxValues = std::size_t{1} << 19;
constexpr std::size_t kPickleMaxCells = std::size_t{1} << 22;
constexpr int kPickleMaxDepth = 64;  ///< nesting of the dicts walked for tensors

struct PickleValue;
/// Values live in their PickleReader's arena (pickles can hold cycles: a dict that holds itself)
/// and are valid as long as the reader.
using PickleRef = PickleValue*;

/// A storage or a tensor, as the unpickler rebuilds them.
struct PickleTensorParts {
  Dtype dtype = Dtype::U8;
  bool typed = false;      ///< a typed storage (FloatStorage, ...), not UntypedStorage
  std::int64_t numel = 0;  ///< storage: elements
  std::string key;         ///< storage: its key
  PickleRef storage;       ///< tensor: its storage
  std::vector<std::int64_t> shape, stride;
  std::int64_t offset = 0;
};

struct PickleValue {
  enum class Kind {
    None,
    Bool,
    Int,
    BigInt,
    Float,
    Str,
    Bytes,
    Tuple,
    List,
    Dict,
    Global,
    Storage,
    Tensor,
    Opaque,
    Mark
  };
  Kind kind = Kind::None;
  std::int64_t i = 0;  ///< Int, Bool
  double f = 0;        ///< Float
  std::string s;       ///< Str, Bytes, BigInt (little-endian bytes), Global and Opaque names
  std::vector<PickleRef> items;              ///< Tuple, List; Dict as key, value, key, value, ...
  std::unique_ptr<PickleTensorParts> parts;  ///< Storage, Tensor
};

inline const char* kind_name(PickleValue::Kind k) {
  using K = PickleValue::Kind;
  switch (k) {
    case K::None:
      return "None";
    case K::Bool:
      return "bool";
    case K::Int:
      return "int";
    case K::BigInt:
      return "int";
    case K::Float:
      return "float";
    case K::Str:
      return "str";
    case K::Bytes:
      return "bytes";
    case K::Tuple:
      return "tuple";
    case K::List:
      return "list";
    case K::Dict:
      return "dict";
    case K::Global:
      return "global";
    case K::Storage:
      return "storage";
    case K::Tensor:
      return "tensor";
    case K::Opaque:
      return "object";
    case K::Mark:
      return "mark";
  }
  return "value";
}

/// The dtype of a typed storage class; false for others.
inline bool storage_dtype(const std::string& global, Dtype& d) {
  static const std::pair<const char*, Dtype> table[] = {
      {"torch.FloatStorage", Dtype::F32}, {"torch.DoubleStorage", Dtype::F64},
      {"torch.HalfStorage", Dtype::F16},  {"torch.BFloat16Storage", Dtype::BF16},
      {"torch.LongStorage", Dtype::I64},  {"torch.IntStorage", Dtype::I32},
      {"torch.ShortStorage", Dtype::I16}, {"torch.CharStorage", Dtype::I8},
      {"torch.ByteStorage", Dtype::U8},   {"torch.BoolStorage", Dtype::BOOL}};
  for (const auto& e : table)
    if (global == e.first) {
      d = e.second;
      return true;
    }
  return false;
}

}  // namespace detail
}  // namespace io
}  // namespace spectral_cond
