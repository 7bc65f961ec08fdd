// spectral_cond::io::detail: the built-in layouts as tensor-name patterns (NamePattern, no
// regular expression), and the matching that turns names and shapes into attention layers.
// Included by io/layouts/detect.hpp; do not include directly.
#pragma once

#include "spectral_cond/io/layouts/layer_map.hpp"
#include "spectral_cond/io/layouts/types.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <regex>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace spectral_cond {
namespace io {

namespace detail {

inline std::string shape_string(const std::vector<std::int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

inline bool name_ends_with(const std::string& s, const char* suffix) {
  const std::size_t n = std::char_traits<char>::length(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

inline bool word_char(char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}

/// A tensor-name pattern of a built-in layout, compiled from a compact text: "*" (at the start
/// only) any prefix that ends at a word boundary, "#" a run of digits (a layer number),
/// "{a|b}" one of the words, "<q|k|v>" the projection's word (W_Q, W_K, W_V in that order),
/// "~" where the layer's prefix ends; anything else is literal. Matching runs from the end of
/// the name, so a name costs a few comparisons unless its tail fits, and no regex is involved.
class NamePattern {
 public:
  struct Match {
    std::array<std::string, 3> numbers;  ///< the digits of each "#", in pattern order
    std::array<int, 3> choice{};         ///< the word chosen by each "{...}", in pattern order
    int projection = -1;                 ///< 0, 1, 2 for the "<...>" word; -1 if none
    std::size_t proj_begin = 0, proj_end = 0;  ///< where that word is in the name
    std::size_t prefix_end = 0;                ///< where "~" fell
  };

  explicit NamePattern(const char* text) {
    std::string s(text);
    std::size_t i = 0;
    if (!s.empty() && s[0] == '*') {
      star_ = true;
      ++i;
    }
    while (i < s.size()) {
      const char c = s[i];
      if (c == '#' || c == '~') {
        toks_.push_back({c == '#' ? Tok::Digits : Tok::Split, {}, 0});
        ++i;
      } else if (c == '{' || c == '<') {
        const std::size_t close = s.find(c == '{' ? '}' : '>', i);
        Tok t{c == '{' ? Tok::Alt : Tok::Projection, {}, 0};
        std::size_t a = i + 1;
        for (std::size_t b = a; b <= close; ++b)
          if (b == close || s[b] == '|') {
            t.words.push_back(s.substr(a, b - a));
            a = b + 1;
          }
        toks_.push_back(std::move(t));
        i = close + 1;
      } else {
        if (toks_.empty() || toks_.back().kind != Tok::Lit) toks_.push_back({Tok::Lit, {""}, 0});
        toks_.back().words[0] += c;
        ++i;
      }
    }
    int nd = 0, na = 0;
    for (Tok& t : toks_) {
      if (t.kind == Tok::Digits) t.slot = nd++;
      if (t.kind == Tok::Alt) t.slot = na++;
    }
    if (nd > 3 || na > 3) throw std::logic_error("NamePattern: more than 3 '#' or '{...}'");
    std::size_t f0 = 0;  // the first token that matches characters ("~" matches none)
    while (f0 + 1 < toks_.size() && toks_[f0].kind == Tok::Split) ++f0;
    const Tok& first = toks_[f0];
    first_is_word_ = first.kind == Tok::Digits ||
                     ((first.kind == Tok::Lit) && word_char(first.words[0][0])) ||
                     first.kind == Tok::Alt || first.kind == Tok::Projection;
  }

  /// Whether the whole name fits; fills m on success.
  bool match(const std::string& name, Match& m) const {
    if (name.size() > 4096) return false;
    m.numbers.fill(std::string());
    m.choice.fill(-1);
    m.projection = -1;
    return step(name, static_cast<int>(toks_.size()) - 1, name.size(), m);
  }
  bool matches(const std::string& name) const {
    Match m;
    return match(name, m);
  }

 private:
  struct Tok {
    enum Kind { Lit, Digits, Alt, Projection, Split } kind;
    std::vector<std::string> words;
    int slot;
  };

  static bool ends_at(const std::string& name, std::size_t pos, const std::string& w) {
    return w.size() <= pos && name.compare(pos - w.size(), w.size(), w) == 0;
  }

  bool step(const std::string& name, int ti, std::size_t pos, Match& m) const {
    if (ti < 0) {
      if (!star_) return pos == 0;
      return pos == 0 || !(word_char(name[pos - 1]) && first_is_word_);
    }
    const Tok& t = toks_[static_cast<std::size_t>(ti)];
    switch (t.kind) {
      case Tok::Lit:
        return ends_at(name, pos, t.words[0]) && step(name, ti - 1, pos - t.words[0].size(), m);
      case Tok::Split:
        m.prefix_end = pos;
        return step(name, ti - 1, pos, m);
      case Tok::Digits: {
        std::size_t n = 0;  // at most 20 digits: a longer run is no layer number
        while (n < pos && n <= 20 && name[pos - 1 - n] >= '0' && name[pos - 1 - n] <= '9') ++n;
        for (std::size_t k = std::min<std::size_t>(n, 20); k >= 1; --k) {
          m.numbers[static_cast<std::size_t>(t.slot)] = name.substr(pos - k, k);
          if (step(name, ti - 1, pos - k, m)) return true;
        }
        return false;
      }
      case Tok::Alt:
      case Tok::Projection:
        for (std::size_t w = 0; w < t.words.size(); ++w) {
          if (!ends_at(name, pos, t.words[w])) continue;
          const std::size_t at = pos - t.words[w].size();
          if (t.kind == Tok::Alt) {
            m.choice[static_cast<std::size_t>(t.slot)] = static_cast<int>(w);
          } else {
            m.projection = static_cast<int>(w);
            m.proj_begin = at;
            m.proj_end = pos;
          }
          if (step(name, ti - 1, at, m)) return true;
        }
        return false;
    }
    return false;
  }

  std::vector<Tok> toks_;
  bool star_ = false, first_is_word_ = false;

 public:
  /// Word `choice` of the "{...}" token number `slot`.
  const std::string& alt_word(int slot, int choice) const {
    for (const Tok& t : toks_)
      if (t.kind == Tok::Alt && t.slot == slot) return t.words[static_cast<std::size_t>(choice)];
    static const std::string none;
    return none;
  }
  /// The words of the "<...>" token (empty when there is none).
  std::vector<std::string> projection_words() const {
    for (const Tok& t : toks_)
      if (t.kind == Tok::Projection) return t.words;
    return {};
  }
};

/// How a built-in layout stores W_Q, W_K and W_V.
enum class Storage {
  FusedRows,    ///< one [3D, D] Linear tensor, rows Q, K, V
  FusedConv1d,  ///< one [D, 3D] Conv1D tensor, columns Q, K, V
  Packed,       ///< one [rows, D] Linear tensor interleaved by head group (resolve_heads)
  Separate      ///< three Linear tensors named by the "<q|k|v>" word
};

struct LayoutRule {
  Layout layout;
  const char* pattern;
  Storage storage;
  const char* cross_word = nullptr;  ///< a "{...}" word that marks cross-attention
  bool shared = false, unscaled = false;
  /// Every layer is decoder self-attention (causal); otherwise only the self-attention layers of
  /// a "decoder" stack in layouts that have cross-attention (Whisper, T5).
  bool decoder = false;
};

/// The built-in layouts (MATH.md §8; docs/checkpoints.md has the table with examples). Where
/// two can match the same names, the more specific comes first (whisper before llama).
inline const std::vector<std::pair<LayoutRule, NamePattern>>& layout_rules() {
  static const std::vector<std::pair<LayoutRule, NamePattern>> rules = [] {
    const LayoutRule defs[] = {
        {Layout::Timm, "*blocks.#.attn.~qkv.weight", Storage::FusedRows},
        {Layout::Gpt2, "*h.#.attn.~c_attn.weight", Storage::FusedConv1d, nullptr, false, false,
         true},
        {Layout::HfBert, "*.#.attention.{self|attention}.~<query|key|value>.weight",
         Storage::Separate},
        {Layout::Whisper,
         "*{encoder|decoder}.layers.#.{self_attn|encoder_attn}.~<q|k|v>_proj.weight",
         Storage::Separate, "encoder_attn"},
        {Layout::Llama, "*layers.#.self_attn.~<q|k|v>_proj.weight", Storage::Separate, nullptr,
         false, false, true},
        {Layout::Gguf, "blk.#.attn_~<q|k|v>.weight", Storage::Separate, nullptr, false, false,
         true},
        {Layout::Albert,
         "*albert_layer_groups.#.albert_layers.#.attention.~<query|key|value>.weight",
         Storage::Separate, nullptr, true},
        {Layout::DistilBert, "*layer.#.attention.~<q|k|v>_lin.weight", Storage::Separate},
        {Layout::T5, "*block.#.layer.#.{SelfAttention|EncDecAttention}.~<q|k|v>.weight",
         Storage::Separate, "EncDecAttention", false, true},
        {Layout::GptNeox, "*layers.#.attention.~query_key_value.weight", Storage::Packed, nullptr,
         false, false, true},
        {Layout::Falcon, "*h.#.self_attention.~query_key_value.weight", Storage::Packed, nullptr,
         false, false, true},
        {Layout::TorchMHA, "*~in_proj_weight", Storage::FusedRows},
    };
    std::vector<std::pair<LayoutRule, NamePattern>> out;
    for (const LayoutRule& d : defs) out.emplace_back(d, NamePattern(d.pattern));
    return out;
  }();
  return rules;
}

/// The layer's number: the first "#" of the pattern, else the last "<digits>." in the prefix
/// that starts it or follows a "." (torch-mha), else -1 (numbered by order later).
inline std::int64_t layer_number(const std::string& first_number, const std::string& prefix) {
  std::string d = first_number;
  if (d.empty()) {
    // The last "<digits>." of the prefix that starts it or follows a ".": "layers.3.", "3.".
    for (std::size_t i = 0; i + 1 < prefix.size(); ++i) {
      if (i > 0 && prefix[i - 1] != '.') continue;
      if (!(prefix[i] >= '0' && prefix[i] <= '9')) continue;
      std::size_t j = i;
      while (j < prefix.size() && prefix[j] >= '0' && prefix[j] <= '9') ++j;
      if (j < prefix.size() && prefix[j] == '.') d = prefix.substr(i, j - i);
    }
  }
  if (d.empty() || d.size() > 9) return -1;
  return std::stoll(d);
}

[[noreturn]] inline void bad_shape(const std::string& file, const NamedShape& t,
                                   const std::string& expected) {
  throw IoError(file + ": tensor " + t.name + " has shape " + shape_string(t.shape) +
                ", expected " + expected);
}

/// A layer found by a rule, before numbering.
struct Found {
  AttentionLayerSpec spec;
  std::int64_t number = -1;
  int stack = 0;  ///< 0 encoder or the only stack, 1 decoder
};

inline int stack_of(const std::string& prefix) {
  return prefix.find("decoder") != std::string::npos ? 1 : 0;
}

/// Fills a fused (one-tensor) layer from its tensor.
inline void fused_slots(AttentionLayerSpec& L, const NamedShape& t, Storage storage,
                        const std::string& file) {
  if (t.shape.size() != 2) bad_shape(file, t, "a 2-D fused Q/K/V projection");
  const bool conv1d = storage == Storage::FusedConv1d;
  const std::int64_t D = conv1d ? t.shape[0] : t.shape[1];
  const std::int64_t rows = conv1d ? t.shape[1] : t.shape[0];
  L.D = D;
  if (storage == Storage::Packed) {
    if (D < 1 || rows <= D) bad_shape(file, t, "[rows, D] with rows > D (Q, K and V fused)");
    L.packed_rows = rows;
    L.q.tensor = L.k.tensor = L.v.tensor = t.name;
    return;
  }
  if (D < 1 || D > INT64_MAX / 3 || rows != 3 * D)
    bad_shape(file, t, conv1d ? "[D, 3D]" : "[3D, D]");
  for (int p = 0; p < 3; ++p) {
    ProjectionSlot& s = p == 0 ? L.q : p == 1 ? L.k : L.v;
    s = {t.name, !conv1d, p * D, D};
  }
}

/// Fills a separate-tensor layer from its three tensors.
inline void separate_slots(AttentionLayerSpec& L, const NamedShape& q, const NamedShape& k,
                           const NamedShape& v, const std::string& file) {
  if (q.shape.size() != 2 || q.shape[0] < 1 || q.shape[1] < 1)
    bad_shape(file, q, "a 2-D Linear weight [out, in]");
  const std::int64_t D = q.shape[1];
  for (const NamedShape* t : {&k, &v})
    if (t->shape.size() != 2 || t->shape[1] != D || t->shape[0] < 1)
      bad_shape(file, *t, "[d, " + std::to_string(D) + "]");
  L.D = D;
  L.q = {q.name, true, 0, q.shape[0]};
  L.k = {k.name, true, 0, k.shape[0]};
  L.v = {v.name, true, 0, v.shape[0]};
}

/// The layers one built-in rule finds.
inline std::vector<Found> match_rule(
    const std::vector<NamedShape>& ts, const LayoutRule& rule, const NamePattern& pat,
    const std::unordered_map<std::string_view, const NamedShape*>& by_name,
    const std::string& file) {
  std::vector<Found> out;
  const std::vector<std::string> words = pat.projection_words();
  NamePattern::Match m;
  for (const NamedShape& t : ts) {
    if (!pat.match(t.name, m)) continue;
    if (rule.storage == Storage::Separate && m.projection != 0) continue;  // queries lead
    Found f;
    f.spec.prefix = t.name.substr(0, m.prefix_end);
    f.number = layer_number(m.numbers[0], f.spec.prefix);
    f.stack = stack_of(f.spec.prefix);
    f.spec.shared = rule.shared;
    if (rule.shared && !m.numbers[0].empty() && m.numbers[0].size() <= 9)
      f.spec.group = std::stoll(m.numbers[0]);
    f.spec.unscaled = rule.unscaled;
    if (rule.cross_word)
      for (std::size_t a = 0; a < m.choice.size(); ++a)
        if (m.choice[a] >= 0 && pat.alt_word(static_cast<int>(a), m.choice[a]) == rule.cross_word)
          f.spec.cross = true;
    f.spec.causal = rule.decoder || (rule.cross_word && !f.spec.cross && f.stack == 1);
    if (rule.storage != Storage::Separate) {
      fused_slots(f.spec, t, rule.storage, file);
    } else {
      auto other = [&](int p) -> const NamedShape* {
        const std::string n = t.name.substr(0, m.proj_begin) + words[static_cast<std::size_t>(p)] +
                              t.name.substr(m.proj_end);
        auto it = by_name.find(n);
        if (it == by_name.end())
          throw IoError(file + ": layer " + f.spec.prefix + " has " + t.name + " but not " + n);
        return it->second;
      };
      const NamedShape* k = other(1);
      const NamedShape* v = other(2);
      separate_slots(f.spec, t, *k, *v, file);
    }
    out.push_back(std::move(f));
  }
  return out;
}

/// The layers a layer map finds.
inline std::vector<Found> match_map(const std::vector<NamedShape>& ts, const LayerMap& map,
                                    const std::string& file) {
  auto id_of = [](const std::smatch& sm) {
    std::string id;
    for (std::size_t g = 1; g < sm.size(); ++g) id += (g > 1 ? "." : "") + sm[g].str();
    return id;
  };
  std::vector<Found> out;
  auto found = [&](const std::string& id) {
    Found f;
    f.spec.prefix = id;
    // A layer number only when the groups are one run of digits; otherwise numbered by order.
    const bool digits = !id.empty() && id.find_first_not_of("0123456789") == std::string::npos;
    f.number = digits ? layer_number(id, "") : -1;
    f.stack = stack_of(id);
    return f;
  };
  if (!map.qkv.empty()) {
    std::map<std::string, std::string> ids;  // the layer's id and its tensor
    for (const NamedShape& t : ts) {
      std::smatch sm;
      if (t.name.size() > kMaxMappedName || !std::regex_match(t.name, sm, map.qkv_re)) continue;
      const std::string id = id_of(sm);
      const auto [first, fresh] = ids.emplace(id, t.name);
      if (!fresh)
        throw LayoutError(LayoutProblem::MapDuplicate, file, "", "qkv",
                          {id, first->second, t.name});
      Found f = found(id.empty() ? t.name : id);
      fused_slots(f.spec, t, map.conv1d ? Storage::FusedConv1d : Storage::FusedRows, file);
      out.push_back(std::move(f));
    }
    return out;
  }
  std::map<std::string, const NamedShape*> role[3];
  const std::regex* res[3] = {&map.q_re, &map.k_re, &map.v_re};
  static const char* roles[3] = {"q", "k", "v"};
  for (const NamedShape& t : ts) {
    if (t.name.size() > kMaxMappedName) continue;
    for (int r = 0; r < 3; ++r) {
      std::smatch sm;
      if (!std::regex_match(t.name, sm, *res[r])) continue;
      const std::string id = id_of(sm);
      if (!role[r].emplace(id, &t).second)
        throw LayoutError(LayoutProblem::MapDuplicate, file, "", roles[r],
                          {id, role[r][id]->name, t.name});
    }
  }
  for (int r = 1; r < 3; ++r)
    for (const auto& kv : role[r])
      if (!role[0].count(kv.first))
        throw LayoutError(LayoutProblem::MapIncomplete, file,
                          "layer " + quote(kv.first) + " has " + kv.second->name + " (" + roles[r] +
                              ") but no q tensor matches",
                          "q", {kv.first, kv.second->name, roles[r]});
  for (const auto& [id, q] : role[0]) {
    for (int r = 1; r < 3; ++r)
      if (!role[r].count(id))
        throw LayoutError(LayoutProblem::MapIncomplete, file,
                          "layer " + quote(id) + " has W_Q " + q->name + " but no " + roles[r] +
                              " tensor matches",
                          roles[r], {id, q->name, "q"});
    Found f = found(id.empty() ? q->name : id);
    separate_slots(f.spec, *q, *role[1][id], *role[2][id], file);
    out.push_back(std::move(f));
  }
  return out;
}

/// Sorts the found layers (encoder before decoder, then by number, self before cross, then by
/// prefix with numbers compared as numbers) and
/// numbers them: by the numbers in their names when those are unique, else 0, 1, 2, ... in that
/// order (two stacks, or names without numbers).
/// a < b with runs of digits compared as numbers ("enc.2" before "enc.10").
inline bool natural_less(const std::string& a, const std::string& b) {
  std::size_t i = 0, j = 0;
  auto digit = [](char c) { return c >= '0' && c <= '9'; };
  while (i < a.size() && j < b.size()) {
    if (digit(a[i]) && digit(b[j])) {
      std::size_t i0 = i, j0 = j;
      while (i0 < a.size() && a[i0] == '0') ++i0;  // leading zeros do not count
      while (j0 < b.size() && b[j0] == '0') ++j0;
      std::size_t i1 = i0, j1 = j0;
      while (i1 < a.size() && digit(a[i1])) ++i1;
      while (j1 < b.size() && digit(b[j1])) ++j1;
      if (i1 - i0 != j1 - j0) return i1 - i0 < j1 - j0;
      const int c = a.compare(i0, i1 - i0, b, j0, j1 - j0);
      if (c != 0) return c < 0;
      i = i1;
      j = j1;
      continue;
    }
    if (a[i] != b[j]) return a[i] < b[j];
    ++i;
    ++j;
  }
  return a.size() - i < b.size() - j;
}

inline std::vector<AttentionLayerSpec> number_layers(std::vector<Found> fs) {
  std::stable_sort(fs.begin(), fs.end(), [](const Found& a, const Found& b) {
    if (a.stack != b.stack) return a.stack < b.stack;
    if (a.number != b.number) return a.number < b.number;
    if (a.spec.cross != b.spec.cross) return a.spec.cross < b.spec.cross;
    return natural_less(a.spec.prefix, b.spec.prefix);
  });
  std::set<std::int64_t> seen;
  bool unique = true;
  for (const Found& f : fs) unique = unique && f.number >= 0 && seen.insert(f.number).second;
  std::vector<AttentionLayerSpec> out;
  for (std::size_t i = 0; i < fs.size(); ++i) {
    out.push_back(std::move(fs[i].spec));
    out.back().index = unique ? fs[i].number : static_cast<std::int64_t>(i);
  }
  return out;
}

}  // namespace detail
}  // namespace io
}  // namespace spectral_cond
