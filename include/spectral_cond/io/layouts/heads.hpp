// spectral_cond::io: how many heads split a layer's projections: from the caller, a
// config.json, or a GGUF file's metadata (HeadConfig); checked against the tensors and, for
// GPT-NeoX and Falcon, used to find Q, K and V in their fused tensor (resolve_heads).
#pragma once

#include "spectral_cond/io/error.hpp"
#include "spectral_cond/io/json.hpp"
#include "spectral_cond/io/layouts/types.hpp"
#include "spectral_cond/io/mapped_file.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>

namespace spectral_cond {
namespace io {

/// Head counts of a model: from the caller (the tool's --heads) or a config.json.
struct HeadConfig {
  std::int64_t heads = 0;          ///< 0: unknown
  std::int64_t kv_heads = 0;       ///< 0: equal to heads
  std::int64_t hidden = 0;         ///< D when the config states it, else 0
  std::int64_t hidden_layers = 0;  ///< num_hidden_layers (ALBERT's shared layers), else 0
  std::int64_t hidden_groups = 0;  ///< num_hidden_groups (ALBERT), else 0
  /// The config names a decoder-only language model ("is_decoder": true, or an architecture
  /// ending in ForCausalLM or LMHeadModel): its self-attention is causal.
  bool causal_lm = false;
  std::string source;  ///< where the numbers came from, for reports
};

/// The head counts of a parsed Hugging Face style config: num_attention_heads / n_head,
/// num_key_value_heads and hidden_size / n_embd. `path` names the file in errors.
inline HeadConfig head_config_from_json(const nlohmann::json& j, const std::string& path) {
  if (!j.is_object()) throw IoError(path + ": expected a JSON object");
  auto get = [&](std::initializer_list<const char*> keys) -> std::int64_t {
    for (const char* k : keys) {
      auto it = j.find(k);
      if (it == j.end() || it->is_null()) continue;
      if (!it->is_number_integer() || it->get<std::int64_t>() < 1)
        throw IoError(path + ": " + k + " must be a positive integer");
      return it->get<std::int64_t>();
    }
    return 0;
  };
  HeadConfig c;
  c.heads = get({"num_attention_heads", "n_head", "num_heads"});
  c.kv_heads = get({"num_key_value_heads", "n_head_kv"});
  c.hidden = get({"hidden_size", "n_embd", "embed_dim"});
  c.hidden_layers = get({"num_hidden_layers", "n_layer", "num_layers"});
  c.hidden_groups = get({"num_hidden_groups"});
  if (auto it = j.find("is_decoder"); it != j.end() && it->is_boolean() && it->get<bool>())
    c.causal_lm = true;
  if (auto it = j.find("architectures"); it != j.end() && it->is_array())
    for (const auto& a : *it)
      if (a.is_string()) {
        const std::string n = a.get<std::string>();
        for (const char* tail : {"ForCausalLM", "LMHeadModel"})
          if (n.size() >= std::strlen(tail) &&
              n.compare(n.size() - std::strlen(tail), std::strlen(tail), tail) == 0)
            c.causal_lm = true;
      }
  c.source = path;
  return c;
}

/// Reads the head counts of a Hugging Face style config.json (head_config_from_json).
inline HeadConfig read_head_config(const std::string& path) {
  const MappedFile f(path);  // a regular file, never a FIFO
  const char* b = reinterpret_cast<const char*>(f.data());
  return head_config_from_json(parse_json_strict(b, b + f.size(), path), path);
}

/// The heads of one layer, checked against its projections: h d_k = width(W_Q),
/// h_kv d_k = width(W_K), h_kv d_v = width(W_V). Throws IoError naming the tensor.
struct LayerHeads {
  std::int64_t heads = 1, kv_heads = 1, d_k = 0, d_v = 0;
};

namespace detail {

/// Fills the slots of a packed layer (GPT-NeoX, Falcon, BLOOM; MATH.md §8) from the head count: the
/// fused tensor holds h_kv groups of (h / h_kv) query heads, one key head and one value head, each
/// d = D / h rows; h_kv follows from the row count (h_kv = h: one group per head, GPT-NeoX).
inline void resolve_packing(AttentionLayerSpec& L, const HeadConfig& c,
                            const std::function<void(const std::string&)>& bad) {
  const std::int64_t h = c.heads, D = L.D, rows = L.packed_rows;
  if (D % h != 0)
    bad("heads = " + std::to_string(h) + " does not divide D = " + std::to_string(D) + " of " +
        L.q.tensor);
  const std::int64_t d = D / h;
  if (rows % d != 0 || rows / d <= h || (rows / d - h) % 2 != 0)
    bad("tensor " + L.q.tensor + " has " + std::to_string(rows) +
        " rows, which is not (heads + 2 kv_heads) x d_k with heads = " + std::to_string(h) +
        ", d_k = " + std::to_string(d));
  const std::int64_t kv = (rows / d - h) / 2;
  if (h % kv != 0)
    bad("the " + std::to_string(kv) + " key/value heads of " + L.q.tensor +
        " do not divide heads = " + std::to_string(h));
  if (c.kv_heads > 0 && c.kv_heads != kv)
    bad("kv_heads = " + std::to_string(c.kv_heads) + " but tensor " + L.q.tensor + " holds " +
        std::to_string(kv) + " key/value heads");
  const std::int64_t r = h / kv, group = (r + 2) * d;
  L.q = {L.q.tensor, true, 0, h * d, r * d, group};
  L.k = {L.q.tensor, true, r * d, kv * d, d, group};
  L.v = {L.q.tensor, true, (r + 1) * d, kv * d, d, group};
  L.packed_rows = 0;
}

}  // namespace detail

/// The heads of one layer, checked against its projections: h d_k = width(W_Q),
/// h_kv d_k = width(W_K), h_kv d_v = width(W_V); h_kv is the config's, else W_K's width / d_k.
/// A packed layer's slots are filled here (they depend on h). Throws LayoutError (HeadsUnknown)
/// when c.heads < 1, else IoError naming the tensor and c.source ("the caller" when empty).
/// Heads split W's columns as MATH.md §8 says.
inline LayerHeads resolve_heads(AttentionLayerSpec& L, const HeadConfig& c,
                                const std::string& file) {
  if (c.heads < 1) throw LayoutError(LayoutProblem::HeadsUnknown, file, "");
  if (c.hidden > 0 && c.hidden != L.D)
    throw IoError(file + ": " + c.source + " says hidden size " + std::to_string(c.hidden) +
                  " but tensor " + L.q.tensor + " has D = " + std::to_string(L.D));
  auto bad = [&](const std::string& what) {
    throw IoError(file + ": " + what + " (layer " + L.prefix + ", heads from " +
                  (c.source.empty() ? std::string("the caller") : c.source) + ")");
  };
  if (L.packed_rows > 0) detail::resolve_packing(L, c, bad);
  LayerHeads h;
  h.heads = c.heads;
  if (L.q.width % h.heads != 0)
    bad("heads = " + std::to_string(h.heads) + " does not divide the width " +
        std::to_string(L.q.width) + " of W_Q in " + L.q.tensor);
  h.d_k = L.q.width / h.heads;
  if (c.kv_heads > 0) {
    h.kv_heads = c.kv_heads;
  } else if (L.k.width % h.d_k == 0 && L.k.width >= h.d_k) {
    h.kv_heads = L.k.width / h.d_k;  // grouped-query K and V, read from W_K's width
  } else {
    h.kv_heads = h.heads;
  }
  if (h.heads % h.kv_heads != 0)
    bad("kv_heads = " + std::to_string(h.kv_heads) +
        " does not divide heads = " + std::to_string(h.heads));
  if (L.k.width != h.kv_heads * h.d_k)
    bad("W_K in " + L.k.tensor + " has width " + std::to_string(L.k.width) +
        ", expected kv_heads x d_k = " + std::to_string(h.kv_heads * h.d_k));
  if (L.v.width % h.kv_heads != 0)
    bad("kv_heads = " + std::to_string(h.kv_heads) + " does not divide the width " +
        std::to_string(L.v.width) + " of W_V in " + L.v.tensor);
  h.d_v = L.v.width / h.kv_heads;
  return h;
}

/// Which layers a shared (ALBERT) layer stands for, from num_hidden_layers L and
/// num_hidden_groups G: layer l runs group floor(l G / L) (Hugging Face's l / (L / G), in exact
/// arithmetic), so group g is used by layers ceil(g L / G) .. ceil((g + 1) L / G) - 1: "layers
/// 0-11", or "every layer" when the config does not say.
inline std::string shared_by(const AttentionLayerSpec& L, const HeadConfig& c) {
  if (!L.shared) return {};
  if (c.hidden_layers < 1) return "every layer (num_hidden_layers unknown)";
  const std::int64_t layers = c.hidden_layers, groups = c.hidden_groups > 0 ? c.hidden_groups : 1;
  const std::int64_t g = L.group >= 0 ? L.group : 0;
  constexpr std::int64_t kMax = std::int64_t{1} << 31;  // products below stay under 2^63
  if (layers > kMax || groups > kMax)
    return "layers unknown (num_hidden_layers or num_hidden_groups beyond 2^31)";
  if (g >= groups)
    return "no layer (group " + std::to_string(g) + " of " + std::to_string(groups) + ")";
  auto ceil_div = [](std::int64_t a, std::int64_t b) { return (a + b - 1) / b; };
  const std::int64_t first = ceil_div(g * layers, groups);
  const std::int64_t last = ceil_div((g + 1) * layers, groups) - 1;
  if (first > last) return "no layer (group " + std::to_string(L.group) + " is unused)";
  return first == last ? "layer " + std::to_string(first)
                       : "layers " + std::to_string(first) + "-" + std::to_string(last);
}

}  // namespace io
}  // namespace spectral_cond
