// clang-format off
// spectral_cond::io: where W_Q, W_K and W_V live in the checkpoints of common model families
// (MATH.md §8), detected from tensor names, and how many heads split them.
//
// | layout     | tensor names (layer i)                          | storage                        |
// |------------|-------------------------------------------------|--------------------------------|
// | torch-mha  | …in_proj_weight                                 | 3D x D, rows Q, K, V (Linear)  |
// | timm       | blocks.i.attn.qkv.weight                        | 3D x D, rows Q, K, V (Linear)  |
// | hf-bert    | …layer.i.attention.{self,attention}.{query,key,value}.weight | Linear, D x D each |
// | gpt2       | h.i.attn.c_attn.weight                          | Conv1D D x 3D, columns Q, K, V |
// | llama      | …layers.i.self_attn.{q,k,v}_proj.weight         | Linear; K, V may have fewer heads |
// | gguf       | blk.i.attn_{q,k,v}.weight (llama.cpp's names)   | Linear; K, V may have fewer heads |
//
// A Linear weight is out x in, so W = weight^T; GPT-2's Conv1D is already in x out.
// clang-format on
#pragma once

#include "spectral_cond/core/common.hpp"
#include "spectral_cond/io/error.hpp"
#include "spectral_cond/io/json.hpp"
#include "spectral_cond/io/mapped_file.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <unordered_map>
#include <vector>

namespace spectral_cond {
namespace io {

enum class Layout { Auto, TorchMHA, Timm, HfBert, Gpt2, Llama, Gguf };

inline const char* to_string(Layout l) {
  switch (l) {
    case Layout::Auto:
      return "auto";
    case Layout::TorchMHA:
      return "torch-mha";
    case Layout::Timm:
      return "timm";
    case Layout::HfBert:
      return "hf-bert";
    case Layout::Gpt2:
      return "gpt2";
    case Layout::Llama:
      return "llama";
    case Layout::Gguf:
      return "gguf";
  }
  return "unknown";
}

/// Parses a --layout value; throws IoError listing the accepted names.
inline Layout parse_layout(const std::string& s) {
  for (Layout l : {Layout::Auto, Layout::TorchMHA, Layout::Timm, Layout::HfBert, Layout::Gpt2,
                   Layout::Llama, Layout::Gguf})
    if (s == to_string(l)) return l;
  throw IoError("--layout: unknown layout '" + s +
                "' (expected auto, torch-mha, timm, hf-bert, gpt2, llama or gguf)");
}

/// A tensor's name and shape, all that layout detection looks at.
struct NamedShape {
  std::string name;
  std::vector<std::int64_t> shape;
};

/// Where one projection W (D x width) sits inside a checkpoint tensor T (2-D, row-major as
/// stored): transposed (Linear): W = T[offset : offset + width, :]^T; otherwise (Conv1D):
/// W = T[:, offset : offset + width].
struct ProjectionSlot {
  std::string tensor;
  bool transposed = true;
  std::int64_t offset = 0;
  std::int64_t width = 0;
};

/// One attention layer of a checkpoint: its number, the slots of W_Q, W_K, W_V, and D.
struct AttentionLayerSpec {
  std::int64_t index = 0;
  std::string prefix;  ///< the name prefix shared by its tensors, e.g. "blocks.3.attn."
  ProjectionSlot q, k, v;
  std::int64_t D = 0;
};

struct LayoutMatch {
  Layout layout = Layout::Auto;
  std::vector<AttentionLayerSpec> layers;  ///< sorted by index
};

/// W from the tensor's matrix (entry (i, j) = T[i, j]).
inline Mat<double> extract_projection(const ProjectionSlot& s, const Mat<double>& T) {
  if (s.transposed) return T.middleRows(s.offset, s.width).transpose();
  return T.middleCols(s.offset, s.width);
}

/// Writes W back into the tensor's matrix at its slot (the inverse of extract_projection).
inline void insert_projection(const ProjectionSlot& s, const Mat<double>& W, Mat<double>& T) {
  if (s.transposed)
    T.middleRows(s.offset, s.width) = W.transpose();
  else
    T.middleCols(s.offset, s.width) = W;
}

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

/// The layer's number: the given digits, else the last ".<digits>." in the prefix, else the
/// order of appearance.
inline std::int64_t layer_number(const std::string& digits, const std::string& prefix,
                                 std::int64_t fallback) {
  std::string d = digits;
  if (d.empty()) {
    static const std::regex num(R"(\.(\d+)\.)");
    for (auto it = std::sregex_iterator(prefix.begin(), prefix.end(), num);
         it != std::sregex_iterator(); ++it)
      d = (*it)[1].str();
  }
  if (d.empty() || d.size() > 9) return fallback;
  return std::stoll(d);
}

/// Fused 3D x D (rows Q, K, V) or D x 3D (columns Q, K, V) tensors: torch-mha, timm, gpt2.
inline std::vector<AttentionLayerSpec> match_fused(const std::vector<NamedShape>& ts,
                                                   const std::regex& re, const char* suffix,
                                                   bool conv1d, const std::string& file) {
  std::vector<AttentionLayerSpec> out;
  std::int64_t order = 0;
  for (const NamedShape& t : ts) {
    std::smatch m;
    // The suffix test keeps the (slow) regex off the names that cannot match.
    if (!name_ends_with(t.name, suffix) || !std::regex_match(t.name, m, re)) continue;
    if (t.shape.size() != 2)
      throw IoError(file + ": tensor " + t.name + " has shape " + shape_string(t.shape) +
                    ", expected a 2-D fused Q/K/V projection");
    const std::int64_t D = conv1d ? t.shape[0] : t.shape[1];
    const std::int64_t three = conv1d ? t.shape[1] : t.shape[0];
    if (D < 1 || D > INT64_MAX / 3 || three != 3 * D)
      throw IoError(file + ": tensor " + t.name + " has shape " + shape_string(t.shape) +
                    (conv1d ? ", expected [D, 3D]" : ", expected [3D, D]"));
    AttentionLayerSpec L;
    L.prefix = m[1].str();
    L.index = layer_number(m.size() > 2 ? m[2].str() : std::string(), L.prefix, order);
    ++order;
    L.D = D;
    for (int p = 0; p < 3; ++p) {
      ProjectionSlot& s = p == 0 ? L.q : p == 1 ? L.k : L.v;
      s.tensor = t.name;
      s.transposed = !conv1d;
      s.offset = p * D;
      s.width = D;
    }
    out.push_back(L);
  }
  return out;
}

/// Separate Linear q/k/v tensors: hf-bert (D x D each) and llama (K, V may be narrower).
inline std::vector<AttentionLayerSpec> match_separate(const std::vector<NamedShape>& ts,
                                                      const std::regex& re,
                                                      const std::string names[3],
                                                      const std::string& suffix,
                                                      const std::string& file) {
  std::map<std::string, std::pair<std::string, const NamedShape*>> queries;  // prefix -> (num, q)
  const std::string q_suffix = names[0] + suffix;
  for (const NamedShape& t : ts) {
    std::smatch m;
    if (name_ends_with(t.name, q_suffix.c_str()) && std::regex_match(t.name, m, re) &&
        m[3].str() == names[0])
      queries[m[1].str()] = {m[2].str(), &t};
  }
  // Name lookups through a hash map (linear, not quadratic), built only when there is a query.
  std::unordered_map<std::string, const NamedShape*> by_name;
  if (!queries.empty()) {
    by_name.reserve(ts.size());
    for (const NamedShape& t : ts) by_name.emplace(t.name, &t);
  }
  auto find_tensor = [&](const std::string& n) -> const NamedShape* {
    auto it = by_name.find(n);
    return it == by_name.end() ? nullptr : it->second;
  };
  std::vector<AttentionLayerSpec> out;
  std::int64_t order = 0;
  for (const auto& kv : queries) {
    const std::string& prefix = kv.first;
    const NamedShape& q = *kv.second.second;
    const std::string rest = q.name.substr(prefix.size() + names[0].size());
    const NamedShape* k = find_tensor(prefix + names[1] + rest);
    const NamedShape* v = find_tensor(prefix + names[2] + rest);
    if (!k || !v)
      throw IoError(file + ": layer " + prefix + " has " + q.name + " but not " +
                    (!k ? prefix + names[1] + rest : prefix + names[2] + rest));
    if (q.shape.size() != 2 || q.shape[0] < 1 || q.shape[1] < 1)
      throw IoError(file + ": tensor " + q.name + " has shape " + shape_string(q.shape) +
                    ", expected a 2-D Linear weight [out, in]");
    const std::int64_t D = q.shape[1];
    if (k->shape.size() != 2 || k->shape[1] != D || k->shape[0] < 1)
      throw IoError(file + ": tensor " + k->name + " has shape " + shape_string(k->shape) +
                    ", expected [d, " + std::to_string(D) + "]");
    if (v->shape.size() != 2 || v->shape[1] != D || v->shape[0] < 1)
      throw IoError(file + ": tensor " + v->name + " has shape " + shape_string(v->shape) +
                    ", expected [d, " + std::to_string(D) + "]");
    AttentionLayerSpec L;
    L.prefix = prefix;
    L.index = layer_number(kv.second.first, prefix, order);
    ++order;
    L.D = D;
    L.q = {q.name, true, 0, q.shape[0]};
    L.k = {k->name, true, 0, k->shape[0]};
    L.v = {v->name, true, 0, v->shape[0]};
    out.push_back(L);
  }
  return out;
}

}  // namespace detail

/// Finds the attention layers of a checkpoint from its tensor names (MATH.md §8). With
/// Layout::Auto every layout is tried and exactly one must match; otherwise the requested one
/// must. `file` names the checkpoint in error messages.
inline LayoutMatch detect_layers(const std::vector<NamedShape>& tensors, Layout requested,
                                 const std::string& file) {
  static const std::regex timm(R"(^(.*\bblocks\.(\d+)\.attn\.)qkv\.weight$)");
  static const std::regex mha(R"(^((?:.*\.)?)in_proj_weight$)");
  static const std::regex gpt2(R"(^(.*\bh\.(\d+)\.attn\.)c_attn\.weight$)");
  static const std::regex bert(
      R"(^(.*\.(\d+)\.attention\.(?:self|attention)\.)(query|key|value)(\.weight)$)");
  static const std::regex llama(R"(^(.*\blayers\.(\d+)\.self_attn\.)(q|k|v)(_proj\.weight)$)");
  static const std::string bert_names[3] = {"query", "key", "value"};
  static const std::string llama_names[3] = {"q", "k", "v"};
  static const std::regex gguf(R"(^(blk\.(\d+)\.attn_)(q|k|v)(\.weight)$)");

  auto run = [&](Layout l) -> std::vector<AttentionLayerSpec> {
    switch (l) {
      case Layout::Timm:
        return detail::match_fused(tensors, timm, "qkv.weight", false, file);
      case Layout::TorchMHA:
        return detail::match_fused(tensors, mha, "in_proj_weight", false, file);
      case Layout::Gpt2:
        return detail::match_fused(tensors, gpt2, "c_attn.weight", true, file);
      case Layout::HfBert:
        return detail::match_separate(tensors, bert, bert_names, ".weight", file);
      case Layout::Llama:
        return detail::match_separate(tensors, llama, llama_names, "_proj.weight", file);
      case Layout::Gguf:
        return detail::match_separate(tensors, gguf, llama_names, ".weight", file);
      case Layout::Auto:
        break;
    }
    return {};
  };
  LayoutMatch result;
  if (requested != Layout::Auto) {
    result.layout = requested;
    result.layers = run(requested);
  } else {
    std::vector<std::string> found;
    for (Layout l : {Layout::Timm, Layout::Gpt2, Layout::HfBert, Layout::Llama, Layout::Gguf,
                     Layout::TorchMHA}) {
      auto layers = run(l);
      if (layers.empty()) continue;
      found.push_back(to_string(l));
      if (result.layers.empty()) {
        result.layout = l;
        result.layers = std::move(layers);
      }
    }
    if (found.size() > 1)
      throw IoError(file + ": tensor names match several layouts (" + found[0] + ", " + found[1] +
                    "); choose one with --layout");
  }
  if (result.layers.empty()) {
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
    std::string msg = file + ": no attention layers found" +
                      (requested == Layout::Auto
                           ? std::string(" (looked for the torch-mha, timm, hf-bert, gpt2, llama "
                                         "and gguf layouts)")
                           : std::string(" in layout ") + to_string(requested));
    if (!looks.empty()) {
      msg += "; tensors that look like attention: ";
      for (std::size_t i = 0; i < looks.size(); ++i) msg += (i ? ", " : "") + looks[i];
      if (n_looks > looks.size()) msg += " and " + std::to_string(n_looks - looks.size()) + " more";
    }
    throw IoError(msg);
  }
  std::stable_sort(
      result.layers.begin(), result.layers.end(),
      [](const AttentionLayerSpec& a, const AttentionLayerSpec& b) { return a.index < b.index; });
  return result;
}

/// Head counts of a model: from the command line or a config.json.
struct HeadConfig {
  std::int64_t heads = 0;     ///< 0: unknown
  std::int64_t kv_heads = 0;  ///< 0: equal to heads
  std::int64_t hidden = 0;    ///< D when the config states it, else 0
  std::string source;         ///< where the numbers came from, for reports
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

inline LayerHeads resolve_heads(const AttentionLayerSpec& L, const HeadConfig& c,
                                const std::string& file) {
  if (c.heads < 1)
    throw IoError(file +
                  ": the number of heads is unknown; pass --heads (and --kv-heads for "
                  "grouped-query models) or put a config.json beside the checkpoint");
  if (c.hidden > 0 && c.hidden != L.D)
    throw IoError(file + ": " + c.source + " says hidden size " + std::to_string(c.hidden) +
                  " but tensor " + L.q.tensor + " has D = " + std::to_string(L.D));
  LayerHeads h;
  h.heads = c.heads;
  h.kv_heads = c.kv_heads > 0 ? c.kv_heads : c.heads;
  auto bad = [&](const std::string& what) {
    throw IoError(file + ": " + what + " (layer " + L.prefix + ", heads from " +
                  (c.source.empty() ? std::string("--heads") : c.source) + ")");
  };
  if (L.q.width % h.heads != 0)
    bad("heads = " + std::to_string(h.heads) + " does not divide the width " +
        std::to_string(L.q.width) + " of W_Q in " + L.q.tensor);
  if (h.heads % h.kv_heads != 0)
    bad("kv_heads = " + std::to_string(h.kv_heads) +
        " does not divide heads = " + std::to_string(h.heads));
  h.d_k = L.q.width / h.heads;
  if (L.k.width != h.kv_heads * h.d_k)
    bad("W_K in " + L.k.tensor + " has width " + std::to_string(L.k.width) +
        ", expected kv_heads x d_k = " + std::to_string(h.kv_heads * h.d_k));
  if (L.v.width % h.kv_heads != 0)
    bad("kv_heads = " + std::to_string(h.kv_heads) + " does not divide the width " +
        std::to_string(L.v.width) + " of W_V in " + L.v.tensor);
  h.d_v = L.v.width / h.kv_heads;
  return h;
}

}  // namespace io
}  // namespace spectral_cond
