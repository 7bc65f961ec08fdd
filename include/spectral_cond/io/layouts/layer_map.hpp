// spectral_cond::io: a layer map, a user's own layout (the tool's --map): regular expressions
// naming W_Q, W_K and W_V (or one fused tensor) in a checkpoint no built-in layout knows
// (MATH.md §8 for the storage, docs/checkpoints.md for the syntax).
#pragma once

#include "spectral_cond/io/error.hpp"

#include <cstddef>
#include <map>
#include <regex>
#include <string>

namespace spectral_cond {
namespace io {

/// A user's own layout (a layer map): regular expressions that match the whole tensor name of W_Q,
/// W_K and W_V (or of one fused Q/K/V tensor). Their capture groups, joined by ".", identify the
/// layer, so q, k and v tensors with equal groups form one layer.
struct LayerMap {
  std::string q, k, v, qkv;  ///< the expressions as given (qkv, or all of q, k, v)
  bool conv1d = false;       ///< storage=conv1d: D x out (GPT-2) instead of Linear out x D
  std::regex q_re, k_re, v_re, qkv_re;
  bool empty() const { return q.empty() && qkv.empty(); }
};

/// Names longer than this are never matched against a layer map's expression (std::regex recurses
/// per character); no checkpoint's tensor names come near it.
inline constexpr std::size_t kMaxMappedName = 1024;

/// Parses a layer map "q=REGEX,k=REGEX,v=REGEX" or "qkv=REGEX", optionally with
/// ",storage=conv1d". A comma starts a new item only when followed by one of those keys and "=",
/// so that commas inside an expression ({1,3}) stay. An empty text is an empty map. Throws
/// LayoutError (MapSyntax) saying what is wrong.
inline LayerMap parse_layer_map(const std::string& text) {
  LayerMap m;
  if (text.empty()) return m;
  auto bad = [&](const std::string& reason) {
    throw LayoutError(LayoutProblem::MapSyntax, "", reason, text);
  };
  static const char* keys[] = {"q", "k", "v", "qkv", "storage"};
  auto key_at = [&](std::size_t pos) -> std::string {
    for (const char* k : keys) {
      const std::size_t n = std::char_traits<char>::length(k);
      if (text.compare(pos, n, k) == 0 && pos + n < text.size() && text[pos + n] == '=') return k;
    }
    return {};
  };
  std::size_t pos = 0;
  std::map<std::string, std::string> items;
  while (pos < text.size()) {
    const std::string key = key_at(pos);
    if (key.empty())
      bad("expected q=REGEX,k=REGEX,v=REGEX or qkv=REGEX (optionally storage=linear|conv1d), "
          "got " +
          detail::quote(text.substr(pos), 80));
    std::size_t start = pos + key.size() + 1, end = start;
    while (end < text.size() && !(text[end] == ',' && !key_at(end + 1).empty())) ++end;
    if (!items.emplace(key, text.substr(start, end - start)).second) bad(key + " given twice");
    pos = end < text.size() ? end + 1 : end;
  }
  auto get = [&](const char* k) { return items.count(k) ? items[k] : std::string(); };
  m.q = get("q");
  m.k = get("k");
  m.v = get("v");
  m.qkv = get("qkv");
  const std::string storage = get("storage");
  if (!storage.empty() && storage != "linear" && storage != "conv1d")
    bad("storage must be linear or conv1d, got " + detail::quote(storage));
  m.conv1d = storage == "conv1d";
  const bool separate = !m.q.empty() || !m.k.empty() || !m.v.empty();
  if (separate && !m.qkv.empty()) bad("give either q, k and v or qkv, not both");
  if (separate && (m.q.empty() || m.k.empty() || m.v.empty()))
    bad(std::string(m.q.empty()   ? "q"
                    : m.k.empty() ? "k"
                                  : "v") +
        " is missing (q, k and v go together)");
  if (!separate && m.qkv.empty()) bad("no q, k, v or qkv expression");
  if (separate && m.conv1d) bad("storage=conv1d applies to a fused qkv tensor only");
  auto compile = [&](const char* what, const std::string& re, std::regex& out) {
    if (re.empty()) return;
    try {
      out = std::regex(re, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      bad(std::string(what) + ": not a valid regular expression " + detail::quote(re, 80) + " (" +
          e.what() + ")");
    }
  };
  compile("q", m.q, m.q_re);
  compile("k", m.k, m.k_re);
  compile("v", m.v, m.v_re);
  compile("qkv", m.qkv, m.qkv_re);
  return m;
}

/// True for the names a layer map's expressions match (whole name).
inline bool map_candidate(const LayerMap& map, const std::string& name) {
  if (name.size() > kMaxMappedName) return false;
  if (!map.qkv.empty()) return std::regex_match(name, map.qkv_re);
  return std::regex_match(name, map.q_re) || std::regex_match(name, map.k_re) ||
         std::regex_match(name, map.v_re);
}

}  // namespace io
}  // namespace spectral_cond
