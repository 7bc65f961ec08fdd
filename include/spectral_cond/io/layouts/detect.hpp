// clang-format off
// spectral_cond::io: where W_Q, W_K and W_V live in the checkpoints of common model families
// (MATH.md §8), detected from tensor names, and how many heads split them.
//
// | layout     | tensor names (layer i)                                 | storage                    |
// |------------|--------------------------------------------------------|----------------------------|
// | timm       | blocks.i.attn.qkv.weight                               | 3D x D, rows Q, K, V       |
// | gpt2       | h.i.attn.c_attn.weight                                 | Conv1D D x 3D, columns     |
// | hf-bert    | …i.attention.{self,attention}.{query,key,value}.weight | Linear each (BERT, RoBERTa, ViT, DeiT) |
// | llama      | …layers.i.self_attn.{q,k,v}_proj.weight                | Linear; K, V may be narrower (GQA) |
// | gguf       | blk.i.attn_{q,k,v}.weight (llama.cpp's names)          | Linear; K, V may be narrower |
// | albert     | …albert_layer_groups.g.albert_layers.j.attention.{query,key,value}.weight | Linear; shared by layers |
// | distilbert | …layer.i.attention.{q,k,v}_lin.weight                  | Linear each                |
// | t5         | …block.i.layer.j.{SelfAttention,EncDecAttention}.{q,k,v}.weight | Linear; no 1/sqrt(d_k) |
// | gpt-neox   | …layers.i.attention.query_key_value.weight             | 3D x D, rows per head (q, k, v) |
// | falcon     | …h.i.self_attention.query_key_value.weight (BLOOM too) | (h + 2 h_kv) d x D, per group |
// | whisper    | …{encoder,decoder}.layers.i.{self_attn,encoder_attn}.{q,k,v}_proj.weight | Linear; cross-attention too |
// | torch-mha  | …in_proj_weight                                        | 3D x D, rows Q, K, V       |
// | map        | a layer map q=REGEX,k=REGEX,v=REGEX or qkv=REGEX       | Linear, or storage=conv1d  |
//
// A Linear weight is out x in, so W = weight^T; GPT-2's Conv1D is already in x out.
// clang-format on
#pragma once

#include "spectral_cond/io/error.hpp"
#include "spectral_cond/io/layouts/detail/rules.hpp"
#include "spectral_cond/io/layouts/heads.hpp"
#include "spectral_cond/io/layouts/layer_map.hpp"
#include "spectral_cond/io/layouts/types.hpp"

#include <algorithm>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace spectral_cond {
namespace io {

/// The built-in layouts (MATH.md §8), in the order detect_layers tries them (where two can match
/// the same names, the more specific first: whisper before llama), as kLayoutNames lists them.
/// Layout::Auto and Layout::Map are not among them.
inline std::vector<Layout> builtin_layouts() {
  std::vector<Layout> out;
  for (const auto& r : detail::layout_rules()) out.push_back(r.first.layout);
  return out;
}

/// True for the names a built-in layout can match (MATH.md §8): only these tensors' shapes are
/// needed to find the attention layers, so only their shards are opened.
inline bool attention_candidate(const std::string& name) {
  for (const auto& r : detail::layout_rules())
    if (r.second.matches(name)) return true;
  return false;
}

/// Finds the attention layers of a checkpoint from its tensor names (MATH.md §8). With
/// Layout::Auto every built-in layout is tried and exactly one must match (a layout whose
/// tensors another also claims, such as llama's within whisper's, gives way to it); otherwise the
/// requested one must; a non-empty layer `map` replaces them all. `file` names the checkpoint
/// in error messages. Throws LayoutError when the layers cannot be found: MapWithLayout,
/// MapMatchedNothing, MapDuplicate, MapIncomplete, SeveralLayouts, NoLayers; IoError when a
/// matched tensor has the wrong shape.
inline LayoutMatch detect_layers(const std::vector<NamedShape>& tensors, Layout requested,
                                 const std::string& file, const LayerMap* map = nullptr) {
  LayoutMatch result;
  if (map && !map->empty()) {
    if (requested != Layout::Auto)
      throw LayoutError(LayoutProblem::MapWithLayout, "", "", to_string(requested));
    result.layout = Layout::Map;
    result.layers = detail::number_layers(detail::match_map(tensors, *map, file));
    if (result.layers.empty()) throw LayoutError(LayoutProblem::MapMatchedNothing, file, "");
    return result;
  }
  // Name lookups through a hash map of views into `tensors` (linear, no copies).
  std::unordered_map<std::string_view, const NamedShape*> by_name;
  by_name.reserve(tensors.size());
  for (const NamedShape& t : tensors) by_name.emplace(t.name, &t);

  struct Candidate {
    Layout layout;
    std::vector<detail::Found> found;
    std::set<std::string> names;
  };
  std::vector<Candidate> cands;
  for (const auto& [rule, pat] : detail::layout_rules()) {
    if (requested != Layout::Auto && rule.layout != requested) continue;
    if (requested == Layout::Auto && rule.layout == Layout::Map) continue;
    std::vector<detail::Found> fs = detail::match_rule(tensors, rule, pat, by_name, file);
    if (fs.empty()) continue;
    cands.push_back(Candidate{rule.layout, std::move(fs), {}});
  }
  if (cands.size() > 1)  // the tensors of each, for the subsumption test below
    for (Candidate& c : cands)
      for (const auto& f : c.found)
        for (const ProjectionSlot* s : {&f.spec.q, &f.spec.k, &f.spec.v}) c.names.insert(s->tensor);
  // A layout whose tensors are all claimed by another gives way to it: to one that claims more,
  // or, claiming the same, to the more specific pattern listed before it (whisper before llama).
  std::vector<const Candidate*> kept;
  for (std::size_t i = 0; i < cands.size(); ++i) {
    const Candidate& a = cands[i];
    bool subsumed = false;
    for (std::size_t j = 0; j < cands.size(); ++j) {
      const Candidate& b = cands[j];
      if (i == j || b.names.size() < a.names.size() || (b.names.size() == a.names.size() && j > i))
        continue;
      if (std::includes(b.names.begin(), b.names.end(), a.names.begin(), a.names.end()))
        subsumed = true;
    }
    if (!subsumed) kept.push_back(&a);
  }
  if (kept.size() > 1) {
    std::vector<std::string> names;
    for (const Candidate* c : kept) names.push_back(to_string(c->layout));
    throw LayoutError(LayoutProblem::SeveralLayouts, file, "", "", std::move(names));
  }
  if (!kept.empty()) {
    result.layout = kept[0]->layout;
    result.layers = detail::number_layers(std::move(const_cast<Candidate*>(kept[0])->found));
    return result;
  }
  // Name the tensors that look like attention, so that the user sees what was not matched.
  std::vector<std::string> looks;
  std::size_t n_looks = 0;
  for (const NamedShape& t : tensors)
    for (const char* w : {"attn", "attention", "query", "key", "value", "q_proj", "qkv"})
      if (t.name.find(w) != std::string::npos) {
        if (looks.size() < 3) looks.push_back(t.name);
        ++n_looks;
        break;
      }
  std::string reason =
      "no attention layers found" +
      (requested == Layout::Auto ? std::string(" (looked for the ") + kLayoutNames + " layouts)"
                                 : std::string(" in layout ") + to_string(requested));
  if (!looks.empty()) {
    reason += "; tensors that look like attention: ";
    for (std::size_t i = 0; i < looks.size(); ++i) reason += (i ? ", " : "") + looks[i];
    if (n_looks > looks.size())
      reason += " and " + std::to_string(n_looks - looks.size()) + " more";
  }
  throw LayoutError(LayoutProblem::NoLayers, file, reason, to_string(requested), looks);
}

}  // namespace io
}  // namespace spectral_cond
