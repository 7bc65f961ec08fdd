// spectral_cond::io::detail: PickleReader, the restricted unpickler of io/formats/pytorch.hpp (see
// its top): it builds values only, never calls a global, and bounds every count and length.
// Included by io/formats/pytorch.hpp; do not include directly.
#pragma once

#include <spectral_cond/io/error.hpp>
#include <spectral_cond/io/formats/detail/pickle_value.hpp>
#include <spectral_cond/io/formats/safetensors.hpp>

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
namespace detail {

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

}  // namespace detail
}  // namespace io
}  // namespace spectral_cond
