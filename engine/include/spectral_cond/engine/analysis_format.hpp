// spectral-cond: the three output formats of `analyze` and `demo` (json, csv, table), documented
// field by field in docs/checkpoints.md: analysis_json.cpp, analysis_csv.cpp, analysis_table.cpp.
#pragma once

#include "analysis_types.hpp"

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace spectral_cond::engine {

/// The version of the JSON and CSV layouts; bumped on any incompatible change.
inline constexpr int kAnalyzeFormatVersion = 2;

/// The whole JSON document for several checkpoints. With shard_count > 1 (--shard i/n) it
/// carries "shard": {"index": i, "count": n}, and every layer whose κ(J) was asked has
/// "jacobian" and its model fields even where all its heads are in other shards, so that shards
/// merge field by field (merge.hpp).
std::string reports_json(const std::vector<CheckpointReport>& reps, std::uint64_t shard_index = 0,
                         std::uint64_t shard_count = 1);

/// The same document, before it is written as text (for declined_kappa_j).
nlohmann::json reports_document(const std::vector<CheckpointReport>& reps,
                                std::uint64_t shard_index = 0, std::uint64_t shard_count = 1);

/// The κ(J) answers of an `analyze` JSON document (reports_json, or shards merged) that were
/// declined: `info` not_converging, inaccurate, too_large or invalid_input, or κ NaN; one line
/// each, "<path> layer L head h[ (variant)]: <info>". analyze and merge write their report and
/// then exit 3 when there is any (docs/cli.md): no NaN κ(J) leaves with exit 0.
std::vector<std::string> declined_kappa_j(const nlohmann::json& doc);

/// One CSV row per (checkpoint, layer, head, matrix) and per Jacobian (matrix "J").
std::string reports_csv(const std::vector<CheckpointReport>& reps);

/// A human-readable table, with a legend.
std::string reports_table(const std::vector<CheckpointReport>& reps);

}  // namespace spectral_cond::engine
