// spectral_cond::io: what a checkpoint says about attention beyond W_Q, W_K, W_V (MATH.md §10):
// where each projection's bias is (bias_name_for, extract_bias), and whether its logits are
// rotated by RoPE, with which pairing, base and rotated width (RopeConfig, from a Hugging Face
// config.json or a GGUF file's metadata). What cannot be modelled (rope_scaling, ALiBi, a
// pairing the metadata does not determine) is said in RopeConfig::refusal, never guessed.
#pragma once

#include "spectral_cond/core/rope.hpp"
#include "spectral_cond/io/error.hpp"
#include "spectral_cond/io/formats/gguf.hpp"
#include "spectral_cond/io/json.hpp"
#include "spectral_cond/io/layouts/types.hpp"
#include "spectral_cond/io/mapped_file.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

namespace spectral_cond {
namespace io {

/// The name of the bias beside a weight tensor: "…weight" → "…bias" ("q_proj.weight" →
/// "q_proj.bias", "in_proj_weight" → "in_proj_bias"); empty when the name does not end in
/// "weight".
inline std::string bias_name_for(const std::string& weight) {
  const std::string w = "weight";
  if (weight.size() < w.size() || weight.compare(weight.size() - w.size(), w.size(), w) != 0)
    return {};
  return weight.substr(0, weight.size() - w.size()) + "bias";
}

/// The projection's bias from its tensor's bias b: the entries of the output features the slot
/// takes, in the order extract_projection takes W's columns (MATH.md §8). `len` is the tensor's
/// output width (rows of a transposed weight, columns of a Conv1D one); IoError naming `what`
/// when b's length differs.
inline Vec<double> extract_bias(const ProjectionSlot& s, const Vec<double>& b, std::int64_t len,
                                const std::string& what) {
  if (b.size() != len)
    throw IoError(what + " has " + std::to_string(b.size()) + " entries, expected " +
                  std::to_string(len) + " (one per output feature of " + s.tensor + ")");
  Vec<double> out(s.width);
  Index c = 0;
  detail::for_each_range(s, [&](std::int64_t first, std::int64_t n) {
    out.segment(c, n) = b.segment(first, n);
    c += n;
  });
  return out;
}

/// Whether and how a model rotates its queries and keys (RoPE, MATH.md §10).
struct RopeConfig {
  /// The metadata decides: `present` says whether there is RoPE. False: it does not (no config,
  /// or a model type whose position encoding it does not name); the caller decides by layout.
  bool decided = false;
  bool present = false;
  RopePairing pairing = RopePairing::RotateHalf;
  double theta = 10000;
  double fraction = 1;    ///< partial_rotary_factor / rotary_pct: rotated share of d_k
  std::int64_t dims = 0;  ///< rotated columns per head when stated absolutely; 0: fraction d_k
  std::string source;     ///< where it came from, for reports
  /// Non-empty: the model's positions cannot be modelled here, and why (the caller refuses
  /// unless told otherwise).
  std::string refusal;

  /// The options for heads of width d_k: dims, else ⌊fraction d_k⌋ (Hugging Face's
  /// int(head_dim * partial_rotary_factor)); IoError when that is odd or exceeds d_k.
  RopeOptions for_head(Index d_k) const {
    RopeOptions r;
    r.pairing = pairing;
    r.theta = theta;
    const auto n = dims > 0
                       ? dims
                       : static_cast<std::int64_t>(std::floor(fraction * static_cast<double>(d_k)));
    if (n < 2 || n > d_k || n % 2 != 0)
      throw IoError(source + ": the rotated width " + std::to_string(n) +
                    " is not even and within d_k = " + std::to_string(d_k));
    r.dims = n == d_k ? 0 : n;
    return r;
  }
};

namespace detail {

inline bool one_of(const std::string& s, std::initializer_list<const char*> names) {
  for (const char* n : names)
    if (s == n) return true;
  return false;
}

/// Model types whose attention rotates queries and keys by rotate_half RoPE (Hugging Face's
/// apply_rotary_pos_emb with rotate_half), and those with GPT-J's interleaved pairs.
inline bool rotate_half_model(const std::string& t) {
  return one_of(t,
                {"llama", "mistral", "mixtral",    "qwen2",   "qwen2_moe", "qwen3",    "qwen3_moe",
                 "gemma", "gemma2",  "phi",        "phi3",    "stablelm",  "gpt_neox", "falcon",
                 "olmo",  "olmo2",   "starcoder2", "granite", "persimmon", "internlm2"});
}
inline bool interleaved_model(const std::string& t) {
  return one_of(t, {"gptj"});
}

}  // namespace detail

/// RoPE from a parsed Hugging Face config.json (see RopeConfig); `path` names it in errors.
/// model_type decides the pairing; rope_theta (rotary_emb_base) the base, 10000 by default;
/// partial_rotary_factor (rotary_pct; GPT-NeoX's default 0.25, Phi's 0.5) or rotary_dim the
/// width. transformers 5 keeps rope_theta, partial_rotary_factor and rope_type in
/// "rope_parameters" (one object, or one per layer type): read there first. A rope_type other
/// than "default" (in rope_parameters or rope_scaling), rope_parameters that differ between
/// layer types, or Falcon's alibi, is a refusal.
inline RopeConfig rope_config_from_json(const nlohmann::json& j, const std::string& path) {
  RopeConfig c;
  if (!j.is_object()) throw IoError(path + ": expected a JSON object");
  // rope_parameters: {"rope_theta": …, "rope_type": …} or {"<layer type>": {…}, …}.
  const nlohmann::json* params = nullptr;
  std::string params_refusal;
  if (auto it = j.find("rope_parameters"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) throw IoError(path + ": \"rope_parameters\" must be an object");
    params = &*it;
    if (!it->contains("rope_theta") && !it->contains("rope_type") && !it->empty()) {
      const nlohmann::json* first = nullptr;
      for (const auto& [k, v] : it->items()) {
        if (!v.is_object())
          throw IoError(path + ": \"rope_parameters\"." + k + " must be an object");
        if (first == nullptr)
          first = &v;
        else if (v != *first)
          params_refusal = path + ": rope_parameters differ between layer types (" +
                           it->begin().key() + ", " + k + "); per-layer RoPE is not modelled";
      }
      params = first;
    }
  }
  auto number = [&](const char* key) -> std::optional<double> {
    for (const nlohmann::json* o : {params, &j}) {
      if (o == nullptr) continue;
      auto it = o->find(key);
      if (it == o->end() || it->is_null()) continue;
      if (!it->is_number() || !std::isfinite(it->get<double>()))
        throw IoError(path + ": \"" + key + "\" must be a finite number");
      return it->get<double>();
    }
    return std::nullopt;
  };
  std::string type;
  if (auto it = j.find("model_type"); it != j.end() && it->is_string())
    type = it->get<std::string>();
  const std::optional<double> theta = number("rope_theta"), base = number("rotary_emb_base");
  const std::optional<double> factor = number("partial_rotary_factor"), pct = number("rotary_pct"),
                              rdim = number("rotary_dim");
  const bool half = detail::rotate_half_model(type), inter = detail::interleaved_model(type);
  c.source = path + (type.empty() ? std::string() : " (model_type " + type + ")");
  if (detail::one_of(type, {"bloom", "mpt"})) {
    c.decided = true;
    c.refusal = c.source + ": ALiBi position biases are not modelled";
    return c;
  }
  if (!half && !inter) {
    if (auto it = j.find("position_embedding_type");
        it != j.end() && it->is_string() && it->get<std::string>() == "rotary") {
      c.decided = true;
      c.refusal = c.source + ": rotary position embeddings whose pairing is not known here";
      return c;
    }
  }
  if (!half && !inter) {
    // A model type this reader does not list: RoPE only when the config names its base.
    if (type.empty() && !theta && !base) return c;
    c.decided = true;
    if (!theta && !base) return c;
    c.present = true;
  } else {
    c.decided = c.present = true;
  }
  if (auto it = j.find("alibi"); it != j.end() && it->is_boolean() && it->get<bool>()) {
    c.present = false;
    c.refusal = path + ": alibi is true: ALiBi position biases are not modelled";
    return c;
  }
  c.pairing = inter ? RopePairing::Interleaved : RopePairing::RotateHalf;
  c.theta = theta ? *theta : base ? *base : 10000.0;
  c.fraction = factor ? *factor : pct ? *pct : type == "gpt_neox" ? 0.25 : type == "phi" ? 0.5 : 1;
  if (rdim) {
    if (!(*rdim >= 2 && *rdim == std::floor(*rdim) && *rdim <= 1e9))
      throw IoError(path + ": \"rotary_dim\" must be an even integer >= 2");
    c.dims = static_cast<std::int64_t>(*rdim);
  }
  if (!(c.fraction > 0 && c.fraction <= 1))
    throw IoError(path + ": the partial rotary factor must be in (0, 1] (got " +
                  std::to_string(c.fraction) + ")");
  if (auto it = j.find("rope_scaling"); it != j.end() && !it->is_null()) {
    std::string kind = "of unknown type";
    if (it->is_object())
      for (const char* k : {"rope_type", "type"})
        if (auto t = it->find(k); t != it->end() && t->is_string()) kind = t->get<std::string>();
    if (kind != "default")
      c.refusal = path + ": rope_scaling " + kind + " is not modelled (plain RoPE is)";
  }
  if (params != nullptr) {
    if (auto t = params->find("rope_type"); t != params->end() && !t->is_null()) {
      const std::string kind = t->is_string() ? t->get<std::string>() : "of unknown type";
      if (kind != "default")
        c.refusal = path + ": rope_parameters rope_type " + kind +
                    " is not modelled (plain RoPE is; the Python package models every rope_type "
                    "from a live model's own angles)";
    }
  }
  if (!params_refusal.empty()) c.refusal = params_refusal;
  return c;
}

/// RoPE from a config.json file (rope_config_from_json).
inline RopeConfig read_rope_config(const std::string& path) {
  const MappedFile f(path);
  const char* b = reinterpret_cast<const char*>(f.data());
  return rope_config_from_json(parse_json_strict(b, b + f.size(), path), path);
}

/// RoPE from a GGUF file's metadata: <arch>.rope.freq_base (10000 by default) and
/// <arch>.rope.dimension_count; architectures whose Hugging Face form uses rotate_half (llama
/// once its Q/K rows are put back in Hugging Face order, qwen2, phi3, …) decide it, others with
/// rope metadata are refused (their pairing is not known here), others have none.
inline RopeConfig rope_config_from_gguf(const GgufFile& g) {
  RopeConfig c;
  const std::string arch = g.get_string("general.architecture").value_or("");
  c.source = g.path() + " (GGUF metadata, architecture " + arch + ")";
  const GgufValue* base = g.find_metadata(arch + ".rope.freq_base");
  const std::optional<std::int64_t> dims = g.get_int(arch + ".rope.dimension_count");
  const bool known = detail::one_of(
      arch, {"llama", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "phi2", "phi3", "gptneox", "falcon",
             "stablelm", "gemma", "gemma2", "olmo", "starcoder2", "granite"});
  c.decided = true;
  if (!known) {
    if (base != nullptr || dims)
      c.refusal = c.source + ": the RoPE pairing of this architecture is not known here";
    return c;
  }
  c.present = true;
  if (base != nullptr) {
    const std::optional<double> t = base->as_double();
    if (!t || !std::isfinite(*t))
      throw IoError(g.path() + ": gguf: metadata '" + arch + ".rope.freq_base' is not a number");
    c.theta = *t;
  }
  if (dims) c.dims = *dims;
  const std::optional<std::string> scaling = g.get_string(arch + ".rope.scaling.type");
  if (scaling && *scaling != "none")
    c.refusal = c.source + ": rope scaling " + *scaling + " is not modelled (plain RoPE is)";
  return c;
}

}  // namespace io
}  // namespace spectral_cond
