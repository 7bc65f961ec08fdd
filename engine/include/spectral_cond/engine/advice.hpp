// spectral-cond advise: what the λ advisor (MATH.md §17) needs beyond `analyze`'s machinery: the
// heads sampled per layer, where a head's slices sit in a packed tensor, whether a layout can
// take each placement, and the recommendation over every advised head of a run.
#pragma once

#include <spectral_cond/conditioning/advisor.hpp>
#include <spectral_cond/core/random.hpp>
#include <spectral_cond/io/layouts/types.hpp>
#include "analysis_types.hpp"
#include "inputs.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace spectral_cond::engine {

/// The output feature of column j of a slot: its row in a Linear's out x in storage, its column
/// in a Conv1D's in x out storage (io::detail::for_each_range's order).
inline std::int64_t slot_feature(const io::ProjectionSlot& s, std::int64_t j) {
  if (s.stride <= 0 || s.block <= 0) return s.offset + j;
  return s.offset + (j / s.block) * s.stride + j % s.block;
}

/// W_Q, W_K and W_V of the layer live in one tensor (timm's qkv, in_proj_weight, GPT-2's
/// c_attn, GPT-NeoX's query_key_value).
inline bool packed_layer(const io::AttentionLayerSpec& L) {
  return L.q.tensor == L.k.tensor && L.k.tensor == L.v.tensor;
}

/// Refuses a placement the layer cannot take: packed on separate Q/K/V tensors.
inline void check_placements(const io::AttentionLayerSpec& L,
                             const std::vector<CorrectionPlacement>& placements,
                             const std::string& where, const std::string& flag = "--placements") {
  for (const CorrectionPlacement& p : placements)
    if (p.layout == Placement::Packed && !packed_layer(L))
      throw BadInput(flag + " packed: " + where +
                     " keeps W_Q, W_K and W_V in separate "
                     "tensors (" +
                     io::quote(L.q.tensor) + ", " + io::quote(L.k.tensor) + ", " +
                     io::quote(L.v.tensor) + "): the packed identity needs one packed tensor");
}

/// Where head h's W_Q, W_K, W_V slices start among the packed tensor's output features (the
/// packed identity puts λ at row f of feature f). Each slice must be contiguous there.
inline std::array<Index, 3> packed_columns(const io::AttentionLayerSpec& L, const io::LayerHeads& H,
                                           Index h, const std::string& where) {
  const Index g = h / (H.heads / H.kv_heads);
  const std::array<std::pair<const io::ProjectionSlot*, std::int64_t>, 3> slices{
      {{&L.q, h * H.d_k}, {&L.k, g * H.d_k}, {&L.v, g * H.d_v}}};
  const std::array<Index, 3> widths{H.d_k, H.d_k, H.d_v};
  std::array<Index, 3> out{};
  for (std::size_t i = 0; i < 3; ++i) {
    const auto& [slot, first] = slices[i];
    const std::int64_t f0 = slot_feature(*slot, first);
    for (Index j = 1; j < widths[i]; ++j)
      if (slot_feature(*slot, first + j) != f0 + j)
        throw BadInput("--placements packed: " + where + ": head " + std::to_string(h) +
                       "'s features in " + io::quote(slot->tensor) +
                       " are not contiguous, so its packed identity is not a shifted identity");
    out[i] = static_cast<Index>(f0);
  }
  return out;
}

/// The heads to advise of a layer among `allowed` (the selection): all of them when count <= 0
/// or count >= their number, else `count` drawn without replacement (a partial Fisher-Yates
/// shuffle with Rng, MATH.md §16, seeded with (seed, layer)), sorted.
inline std::vector<Index> sample_heads(const std::vector<Index>& allowed, std::int64_t count,
                                       std::uint64_t seed, std::int64_t layer) {
  if (count <= 0 || static_cast<std::size_t>(count) >= allowed.size()) return allowed;
  Rng rng(splitmix64(seed ^ splitmix64(static_cast<std::uint64_t>(layer))));
  std::vector<Index> pool = allowed;
  const Index n = static_cast<Index>(pool.size());
  for (Index i = 0; i < count; ++i)
    std::swap(pool[static_cast<std::size_t>(i)],
              pool[static_cast<std::size_t>(rng.integer(i, n - 1))]);
  pool.resize(static_cast<std::size_t>(count));
  std::sort(pool.begin(), pool.end());
  return pool;
}

/// The recommendation over every advised head of the reports (MATH.md §17).
inline AdviceChoice recommend_reports(const std::vector<CheckpointReport>& reps) {
  std::vector<const HeadAdvice*> heads;
  for (const CheckpointReport& r : reps)
    for (const LayerStats& L : r.layers)
      for (const HeadAdvice& a : L.advice) heads.push_back(&a);
  return recommend(heads);
}

}  // namespace spectral_cond::engine
