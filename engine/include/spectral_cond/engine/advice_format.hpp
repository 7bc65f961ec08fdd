// spectral-cond advise: the three output formats of the λ advisor (json, csv, table), documented
// key by key in docs/cli.md ("advise"); advice_report.cpp writes them.
#pragma once

#include "analysis_types.hpp"

#include <string>
#include <vector>

namespace spectral_cond::engine {

/// The version of advise's JSON and CSV layouts; bumped on any incompatible change.
inline constexpr int kAdviseFormatVersion = 1;

/// The whole JSON document: the grid and criteria, the recommendation over every advised head
/// (`best`), how the heads were sampled, and per checkpoint, layer and head every grid point.
std::string advice_json(const std::vector<CheckpointReport>& reps, const AnalysisOptions& o,
                        const AdviceChoice& best, const std::string& sampling);

/// One CSV row per (checkpoint, layer, head, grid point).
std::string advice_csv(const std::vector<CheckpointReport>& reps);

/// A human-readable table per head, the onsets, and the recommendation with its criteria.
std::string advice_table(const std::vector<CheckpointReport>& reps, const AnalysisOptions& o,
                         const AdviceChoice& best, const std::string& sampling);

}  // namespace spectral_cond::engine
