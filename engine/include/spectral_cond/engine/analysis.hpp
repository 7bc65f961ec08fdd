// spectral-cond: the analysis behind `analyze` and `demo` (docs/checkpoints.md): for each
// attention layer of a checkpoint, the condition numbers of W_Q, W_K, W_V (MATH.md §4, §8), after
// the λ I_k correction in both placements with the Weyl bound (§7), after the exact correction
// (§6), and optionally per head κ(J) with every term of Theorem 3.4 (§5). Layers are read one at
// a time from an io::CheckpointReader, so only the current layer's tensors are in memory.
//
//   analysis_types.hpp   what is asked (AnalysisOptions) and what is reported (CheckpointReport)
//   analysis_inputs.hpp  what is read beside the weights: head counts, X, RoPE, biases
//   matrix_stats.hpp     the statistics of one projection or head block
//   analysis.cpp         analyze_checkpoint, step by step
//   analysis_format.hpp  the JSON, CSV and table of the reports
#pragma once

#include "analysis_types.hpp"

#include <cstdint>
#include <string>

namespace spectral_cond::engine {

/// Analyses one checkpoint (see the top of this file). Throws BadInput / io::IoError naming the
/// file and tensor for anything unusable, before any tensor is read where it can (layers, heads,
/// inputs, RoPE). `item` numbers the κ(J) work items across checkpoints for --shard (see
/// AnalysisOptions); it is advanced past this checkpoint's.
CheckpointReport analyze_checkpoint(const std::string& path, const AnalysisOptions& o,
                                    const ProgressFn& progress = {}, std::uint64_t* item = nullptr);

}  // namespace spectral_cond::engine
