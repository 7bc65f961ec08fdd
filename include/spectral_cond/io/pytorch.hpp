// spectral_cond::io: a reader for PyTorch checkpoints as torch.save writes them
// (docs/checkpoints.md):
//
//   zip     the default since PyTorch 1.6: an uncompressed zip holding <prefix>/data.pkl (the
//           pickled object), one member <prefix>/data/<key> per storage and <prefix>/byteorder.
//   legacy  torch.save(..., _use_new_zipfile_serialization=False): five pickles in a row (magic
//           number, protocol version, system info, the object, the storage keys), then each
//           storage as an 8-byte element count followed by its bytes.
//
// The pickles are read by a restricted unpickler (PickleReader) that only builds values: it knows
// the containers (tuples, lists, dicts, OrderedDict), the tensor rebuild functions
// (torch._utils._rebuild_tensor_v2, _rebuild_tensor, _rebuild_parameter,
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
#include <spectral_cond/io/layouts.hpp>
#include <spectral_cond/io/mapped_file.hpp>
#include <spectral_cond/io/npz.hpp>
#include <spectral_cond/io/safetensors.hpp>

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

/// A restricted unpickler (see the top of this file). One object per call of load(); the
/// persistent ids it meets are torch's storage tuples, rebuilt as Storage values.
class PickleReader {
 public:
  /// `label` starts every message ("<file>: pytorch: data.pkl"); `legacy` selects the legacy
  /// format's persistent ids (with a sixth field, the view metadata).
  PickleReader(const std::uint8_t* p, std::size_t n, std::string label, bool legacy)
      : p_(p), n_(n), label_(std::move(label)), legacy_(legacy) {}

  /// Unpickles one object starting at byte `pos`; on return pos is just past its STOP.
  PickleRef load(std::size_t& pos) {
    pos_ = pos;
    stack_.clear();
    marks_.clear();
    memo_.clear();
    while (true) {
      const std::size_t at = pos_;
      const std::uint8_t op = byte();
      if (op == '.') break;  // STOP
      step(op, at);
    }
    if (stack_.size() != 1 || !marks_.empty())
      fail("pickle ends with " + std::to_string(stack_.size()) + " values on its stack");
    pos = pos_;
    return stack_.back();
  }

  /// Globals that were seen but are not a container, storage or rebuild function.
  const std::set<std::string>& opaque_globals() const { return opaque_; }
  /// Every storage a persistent id named, by key (typed or not).
  const std::map<std::string, PickleRef>& storages() const { return storages_; }

 private:
  using K = PickleValue::Kind;

  [[noreturn]] void fail(const std::string& msg) const { throw IoError(label_ + ": " + msg); }
  [[noreturn]] void fail_at(std::size_t at, const std::string& msg) const {
    fail("byte " + std::to_string(at) + ": " + msg);
  }

  void need(std::uint64_t k) const {
    if (k > n_ - pos_)
      fail_at(pos_, "truncated (" + std::to_string(k) + " bytes wanted, " +
                        std::to_string(n_ - pos_) + " left)");
  }
  std::uint8_t byte() {
    need(1);
    return p_[pos_++];
  }
  std::uint64_t le(int k) {
    need(static_cast<std::uint64_t>(k));
    std::uint64_t v = 0;
    for (int b = k; b-- > 0;) v = (v << 8) | p_[pos_ + static_cast<std::size_t>(b)];
    pos_ += static_cast<std::size_t>(k);
    return v;
  }
  std::string take(std::uint64_t k) {
    need(k);
    std::string s(reinterpret_cast<const char*>(p_ + pos_), static_cast<std::size_t>(k));
    pos_ += static_cast<std::size_t>(k);
    return s;
  }

  PickleRef make(K k) {
    if (++values_ > kPickleMaxValues)
      fail("more than " + std::to_string(kPickleMaxValues) +
           " values: too large for a checkpoint's pickle");
    arena_.push_back(std::make_unique<PickleValue>());
    PickleValue* v = arena_.back().get();
    v->kind = k;
    return v;
  }
  void cell() {
    if (++cells_ > kPickleMaxCells)
      fail("more than " + std::to_string(kPickleMaxCells) +
           " stack, memo and container cells: too large for a checkpoint's pickle");
  }
  void push(PickleRef v) {
    cell();
    stack_.push_back(std::move(v));
  }
  PickleRef pop(std::size_t at) {
    if (stack_.size() <= (marks_.empty() ? 0 : marks_.back())) fail_at(at, "pops an empty stack");
    PickleRef v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  PickleRef& top(std::size_t at) {
    if (stack_.size() <= (marks_.empty() ? 0 : marks_.back())) fail_at(at, "empty stack");
    return stack_.back();
  }
  /// The values above the topmost mark, removing them and the mark.
  std::vector<PickleRef> pop_mark(std::size_t at) {
    if (marks_.empty()) fail_at(at, "no mark on the stack");
    const std::size_t m = marks_.back();
    marks_.pop_back();
    std::vector<PickleRef> out(std::make_move_iterator(stack_.begin() + static_cast<long>(m)),
                               std::make_move_iterator(stack_.end()));
    stack_.resize(m);
    return out;
  }

  PickleRef str(K k, std::string s) {
    PickleRef v = make(k);
    v->s = std::move(s);
    return v;
  }
  PickleRef integer(std::int64_t i, K k = K::Int) {
    PickleRef v = make(k);
    v->i = i;
    return v;
  }
  PickleRef seq(K k, std::vector<PickleRef> items) {
    PickleRef v = make(k);
    v->items = std::move(items);
    return v;
  }

  void memo_put(std::uint64_t idx) {
    const std::size_t at = pos_;
    cell();
    memo_[idx] = top(at);
  }
  void memo_get(std::uint64_t idx, std::size_t at) {
    auto it = memo_.find(idx);
    if (it == memo_.end()) fail_at(at, "memo entry " + std::to_string(idx) + " was never stored");
    push(it->second);
  }

  void add_items(const PickleRef& target, std::vector<PickleRef> items, std::size_t at) {
    if (target->kind == K::Opaque) return;  // an object's contents are not needed
    if (target->kind != K::List)
      fail_at(at, std::string("appends to a ") + kind_name(target->kind));
    for (PickleRef& v : items) {
      cell();
      target->items.push_back(std::move(v));
    }
  }
  void set_items(const PickleRef& target, std::vector<PickleRef> kv, std::size_t at) {
    if (kv.size() % 2 != 0) fail_at(at, "sets a key without a value");
    if (target->kind == K::Opaque) return;
    if (target->kind != K::Dict)
      fail_at(at, std::string("sets items of a ") + kind_name(target->kind));
    for (PickleRef& v : kv) {
      cell();
      target->items.push_back(std::move(v));
    }
  }

  void step(std::uint8_t op, std::size_t at) {
    switch (op) {
      case 0x80: {  // PROTO
        const std::uint8_t v = byte();
        if (v < 2 || v > 5) fail_at(at, "pickle protocol " + std::to_string(v) + " (2 to 5 read)");
        return;
      }
      case 0x95:
        le(8);
        return;  // FRAME: a hint only
      case '(':
        marks_.push_back(stack_.size());
        cell();
        return;  // MARK
      case '}':
        push(make(K::Dict));
        return;
      case ']':
        push(make(K::List));
        return;
      case ')':
        push(make(K::Tuple));
        return;
      case 0x8f:
        push(make(K::List));
        return;  // EMPTY_SET: a set read as a list
      case 'N':
        push(make(K::None));
        return;
      case 0x88:
        push(integer(1, K::Bool));
        return;
      case 0x89:
        push(integer(0, K::Bool));
        return;
      case 'K':
        push(integer(static_cast<std::int64_t>(le(1))));
        return;  // BININT1
      case 'M':
        push(integer(static_cast<std::int64_t>(le(2))));
        return;  // BININT2
      case 'J':  // BININT
        push(integer(static_cast<std::int32_t>(static_cast<std::uint32_t>(le(4)))));
        return;
      case 0x8a:
        long_int(le(1));
        return;  // LONG1
      case 0x8b:
        long_int(le(4));
        return;    // LONG4
      case 'G': {  // BINFLOAT, big-endian
        need(8);
        std::uint64_t u = 0;
        for (int b = 0; b < 8; ++b) u = (u << 8) | p_[pos_ + static_cast<std::size_t>(b)];
        pos_ += 8;
        PickleRef v = make(K::Float);
        std::memcpy(&v->f, &u, 8);
        push(std::move(v));
        return;
      }
      case 0x8c:
        push(str(K::Str, take(le(1))));
        return;  // SHORT_BINUNICODE
      case 'X':
        push(str(K::Str, take(le(4))));
        return;  // BINUNICODE
      case 0x8d:
        push(str(K::Str, take(le(8))));
        return;  // BINUNICODE8
      case 'U':
        push(str(K::Str, take(le(1))));
        return;  // SHORT_BINSTRING
      case 'T':
        push(str(K::Str, take(le(4))));
        return;  // BINSTRING
      case 'C':
        push(str(K::Bytes, take(le(1))));
        return;  // SHORT_BINBYTES
      case 'B':
        push(str(K::Bytes, take(le(4))));
        return;  // BINBYTES
      case 0x8e:
        push(str(K::Bytes, take(le(8))));
        return;  // BINBYTES8
      case 'q':
        memo_put(le(1));
        return;  // BINPUT
      case 'r':
        memo_put(le(4));
        return;  // LONG_BINPUT
      case 0x94:
        memo_put(memo_.size());
        return;  // MEMOIZE
      case 'h':
        memo_get(le(1), at);
        return;  // BINGET
      case 'j':
        memo_get(le(4), at);
        return;  // LONG_BINGET
      case '0':
        pop(at);
        return;  // POP
      case '1':
        pop_mark(at);
        return;  // POP_MARK
      case '2':
        push(top(at));
        return;  // DUP
      case 't':
        push(seq(K::Tuple, pop_mark(at)));
        return;  // TUPLE
      case 0x85:
      case 0x86:
      case 0x87: {  // TUPLE1..3
        std::vector<PickleRef> items(static_cast<std::size_t>(op - 0x84));
        for (std::size_t k = items.size(); k-- > 0;) items[k] = pop(at);
        push(seq(K::Tuple, std::move(items)));
        return;
      }
      case 'l':
        push(seq(K::List, pop_mark(at)));
        return;    // LIST
      case 'd': {  // DICT
        PickleRef d = make(K::Dict);
        set_items(d, pop_mark(at), at);
        push(std::move(d));
        return;
      }
      case 'a': {  // APPEND
        PickleRef v = pop(at);
        std::vector<PickleRef> one{std::move(v)};
        add_items(top(at), std::move(one), at);
        return;
      }
      case 'e':
      case 0x90: {  // APPENDS, ADDITEMS
        std::vector<PickleRef> items = pop_mark(at);
        add_items(top(at), std::move(items), at);
        return;
      }
      case 's': {  // SETITEM
        PickleRef v = pop(at);
        PickleRef k = pop(at);
        std::vector<PickleRef> kv{std::move(k), std::move(v)};
        set_items(top(at), std::move(kv), at);
        return;
      }
      case 'u': {  // SETITEMS
        std::vector<PickleRef> kv = pop_mark(at);
        set_items(top(at), std::move(kv), at);
        return;
      }
      case 0x91:
        push(seq(K::List, pop_mark(at)));
        return;    // FROZENSET
      case 'c': {  // GLOBAL module\nname\n
        std::string module = line(at), name = line(at);
        push(global(module + "." + name));
        return;
      }
      case 0x93: {  // STACK_GLOBAL
        PickleRef name = pop(at), module = pop(at);
        if (name->kind != K::Str || module->kind != K::Str)
          fail_at(at, "STACK_GLOBAL needs two strings");
        push(global(module->s + "." + name->s));
        return;
      }
      case 'R': {  // REDUCE
        PickleRef args = pop(at), fn = pop(at);
        push(call(fn, args, at));
        return;
      }
      case 0x81: {  // NEWOBJ
        PickleRef args = pop(at), cls = pop(at);
        push(call(cls, args, at));
        return;
      }
      case 0x92: {  // NEWOBJ_EX
        pop(at);
        PickleRef args = pop(at), cls = pop(at);
        push(call(cls, args, at));
        return;
      }
      case 'b': {  // BUILD: an object's state, never needed here
        pop(at);
        top(at);
        return;
      }
      case 'Q': {  // BINPERSID
        PickleRef pid = pop(at);
        push(persistent(pid, at));
        return;
      }
      default: {
        static const char hex[] = "0123456789abcdef";
        fail_at(at, std::string("pickle opcode 0x") + hex[op >> 4] + hex[op & 15] +
                        " is not one torch.save writes: refused");
      }
    }
  }

  std::string line(std::size_t at) {
    const std::size_t limit = std::min<std::size_t>(n_ - pos_, 256);
    const void* nl = std::memchr(p_ + pos_, '\n', limit);
    if (nl == nullptr) fail_at(at, "GLOBAL name without a newline in 256 bytes");
    const auto len = static_cast<std::size_t>(static_cast<const std::uint8_t*>(nl) - (p_ + pos_));
    std::string s = take(len);
    ++pos_;
    return s;
  }

  void long_int(std::uint64_t len) {
    need(len);
    if (len <= 8) {
      std::uint64_t u = 0;
      for (std::uint64_t b = len; b-- > 0;) u = (u << 8) | p_[pos_ + b];
      if (len > 0 && len < 8 && (p_[pos_ + len - 1] & 0x80) != 0)
        u |= ~std::uint64_t{0} << (8 * len);
      pos_ += static_cast<std::size_t>(len);
      std::int64_t i = 0;
      std::memcpy(&i, &u, 8);
      push(integer(i));
      return;
    }
    push(str(K::BigInt, take(len)));
  }

  PickleRef global(const std::string& name) { return str(K::Global, name); }

  static bool is_int(const PickleRef& v) { return v->kind == K::Int; }
  std::vector<std::int64_t> int_tuple(const PickleRef& v, const char* what, std::size_t at) const {
    if (v->kind != K::Tuple && v->kind != K::List)
      fail_at(at, std::string("tensor ") + what + " is not a tuple");
    std::vector<std::int64_t> out;
    for (const PickleRef& e : v->items) {
      if (!is_int(e)) fail_at(at, std::string("tensor ") + what + " holds a non-integer");
      out.push_back(e->i);
    }
    return out;
  }

  PickleRef tensor(const std::vector<PickleRef>& a, std::size_t at) {
    if (a.size() < 4 || a[0]->kind != K::Storage || !is_int(a[1]))
      fail_at(at, "tensor rebuild without (storage, offset, size, stride)");
    PickleRef t = make(K::Tensor);
    t->parts = std::make_unique<PickleTensorParts>();
    t->parts->storage = a[0];
    t->parts->offset = a[1]->i;
    t->parts->shape = int_tuple(a[2], "size", at);
    t->parts->stride = int_tuple(a[3], "stride", at);
    return t;
  }

  PickleRef call(const PickleRef& fn, const PickleRef& args, std::size_t at) {
    if (fn->kind != K::Global) return str(K::Opaque, fn->kind == K::Opaque ? fn->s : "");
    const std::string& g = fn->s;
    const std::vector<PickleRef> no_args;
    const std::vector<PickleRef>& a = args->kind == K::Tuple ? args->items : no_args;
    if (g == "collections.OrderedDict") {
      if (!a.empty()) fail_at(at, "OrderedDict built from arguments");
      return make(K::Dict);
    }
    if (g == "torch._utils._rebuild_tensor_v2" || g == "torch._utils._rebuild_tensor")
      return tensor(a, at);
    if (g == "torch._utils._rebuild_parameter" ||
        g == "torch._utils._rebuild_parameter_with_state") {
      if (a.empty() || a[0]->kind != K::Tensor) fail_at(at, g + " of something not a tensor");
      return a[0];
    }
    if (g == "torch._tensor._rebuild_from_type_v2") {  // (func, type, args, state)
      if (a.size() < 3) fail_at(at, g + " with fewer than 3 arguments");
      return call(a[0], a[2], at);
    }
    if (g.rfind("torch._utils._rebuild", 0) == 0 || g.rfind("torch._tensor._rebuild", 0) == 0)
      fail_at(at, "tensors rebuilt by " + g +
                      " (quantized, sparse or device tensors) are not supported");
    opaque_.insert(g);
    return str(K::Opaque, g);
  }

  PickleRef persistent(const PickleRef& pid, std::size_t at) {
    const std::size_t want = legacy_ ? 6 : 5;
    if (pid->kind != K::Tuple || pid->items.size() != want || pid->items[0]->kind != K::Str ||
        pid->items[0]->s != "storage")
      fail_at(at, "persistent id is not torch's ('storage', type, key, location, size" +
                      std::string(legacy_ ? ", view)" : ")"));
    const auto& it = pid->items;
    if (it[1]->kind != K::Global) fail_at(at, "storage type is not a class");
    if (it[2]->kind != K::Str) fail_at(at, "storage key is not a string");
    if (!is_int(it[4]) || it[4]->i < 0) fail_at(at, "storage size is not a non-negative integer");
    if (legacy_ && it[5]->kind != K::None)
      fail_at(at, "storage views (the legacy format's view metadata) are not supported");
    PickleRef s = make(K::Storage);
    s->parts = std::make_unique<PickleTensorParts>();
    s->parts->key = it[2]->s;
    s->parts->numel = it[4]->i;
    s->parts->typed = storage_dtype(it[1]->s, s->parts->dtype);
    if (!s->parts->typed) s->s = it[1]->s;  // UntypedStorage or an unknown type: its name
    auto seen = storages_.find(s->parts->key);
    if (seen == storages_.end()) {
      storages_.emplace(s->parts->key, s);
    } else if (seen->second->parts->dtype != s->parts->dtype ||
               seen->second->parts->numel != s->parts->numel || seen->second->s != s->s) {
      fail_at(at, "storage " + quote(s->parts->key) +
                      " is declared twice with different types or sizes");
    }
    return s;
  }

  const std::uint8_t* p_;
  std::size_t n_;
  std::string label_;
  bool legacy_;
  std::size_t pos_ = 0;
  std::vector<PickleRef> stack_;
  std::vector<std::size_t> marks_;
  std::unordered_map<std::uint64_t, PickleRef> memo_;
  std::size_t values_ = 0, cells_ = 0;
  std::set<std::string> opaque_;
  std::map<std::string, PickleRef> storages_;
  std::vector<std::unique_ptr<PickleValue>> arena_;
};

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
