// spectral-cond: the command-line options `analyze`, `demo` and `advise` share.
#pragma once

#include <spectral_cond/engine/analysis_types.hpp>
#include <spectral_cond/engine/inputs.hpp>
#include "commands.hpp"

#include <CLI/CLI.hpp>

#include <spectral_cond/io/atomic_file.hpp>
#include <spectral_cond/io/paths.hpp>

#include <iostream>
#include <string>
#include <vector>

namespace spectral_cond::cli {

/// After a report of analyze or merge is written: exit 3 (NumericalFailure) naming the first
/// declined κ(J) answer when there is any (engine::declined_kappa_j), so that no NaN κ(J)
/// leaves with exit 0 (docs/cli.md).
inline void fail_if_declined(const std::vector<std::string>& declined) {
  if (declined.empty()) return;
  throw NumericalFailure(std::to_string(declined.size()) +
                         " kappa(J) answer(s) declined and reported as nan, the first " +
                         declined.front() + " (the report is written; its notes say why)");
}

/// The options of every command that reads a checkpoint's attention layers and their inputs
/// (`analyze`, `demo`, `advise`): where the weights are, the heads, the layers, X, RoPE, biases.
inline void add_model_options(CLI::App* cmd, AnalysisOptions& o) {
  cmd->add_option("--layout", o.layout, layout_help())->check(CLI::IsMember(layout_choices()));
  cmd->add_option("--map", o.map,
                  "where W_Q, W_K, W_V are in any other model: q=REGEX,k=REGEX,v=REGEX or "
                  "qkv=REGEX[,storage=conv1d], each matching whole tensor names; capture groups "
                  "name the layer");
  cmd->add_option("--heads", o.heads, "number of attention heads (default: config.json)")
      ->check(head_count());
  cmd->add_option("--kv-heads", o.kv_heads,
                  "key/value heads of grouped-query models (default: "
                  "config.json, else --heads)")
      ->check(head_count());
  cmd->add_option("--layers", o.layers, "layers to analyse, e.g. 0,3,5-7 (default all)");
  cmd->add_option("--inputs", o.inputs,
                  "X for --jacobian: an N x D .npy for every layer, or an .npz / folder of "
                  ".npy with one X per layer (keys 3, layer_3 or the prefix); default --tokens");
  cmd->add_option("--tokens", o.tokens, "N synthetic LayerNorm-like tokens (default 64)")
      ->check(CLI::Range(1LL, kMaxTokens));
  cmd->add_option("--seed", o.seed, "seed of the synthetic tokens (default 0)")
      ->check(unsigned_integer());
  cmd->add_option("--tol", o.tol, "requested relative accuracy of sigma_min(J) (default 1e-6)");
  cmd->add_flag_callback(
      "--no-biases", [&o] { o.biases = false; },
      "with --jacobian, leave out the checkpoint's Q/K/V biases (the block of Theorem 3.4)");
  cmd->add_option("--rope", o.rope,
                  "with --jacobian, RoPE: auto (default: config.json or GGUF metadata), none, "
                  "rotate_half or interleaved")
      ->check(CLI::IsMember({"auto", "none", "rotate_half", "interleaved"}));
  cmd->add_option_function<double>(
      "--rope-theta", [&o](const double& t) { o.rope_theta = t; },
      "with --jacobian, the RoPE base (default: the model's rope_theta, else 10000)");
  cmd->add_option("--rope-dims", o.rope_dims,
                  "with --jacobian, rotated columns per head (default: the model's, else d_k)")
      ->check(CLI::Range(std::int64_t{2}, std::int64_t{1} << 30));
  cmd->add_flag("--verbose", o.verbose, "log every tensor read (and its file) on stderr");
}

/// Before anything is computed: --out may replace only a regular file that is no input (the
/// checkpoints, their config.json, --inputs; shards are checked as they are found).
inline void check_report_out(const std::string& out, const std::vector<std::string>& checkpoints,
                             const std::string& inputs_file) {
  if (out.empty()) return;
  std::vector<std::string> inputs = checkpoints;
  for (const std::string& c : checkpoints)
    inputs.push_back(
        io::join_path(io::is_directory(c) ? c : io::parent_directory(c), "config.json"));
  if (!inputs_file.empty()) inputs.push_back(inputs_file);
  io::check_output_target(out, inputs);
}

/// The comma-separated items of an option's value ("" items included, to be refused).
inline std::vector<std::string> comma_items(const std::string& s) {
  std::vector<std::string> out;
  std::string::size_type start = 0;
  while (true) {
    const auto comma = s.find(',', start);
    out.push_back(s.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) return out;
    start = comma + 1;
  }
}

/// --placements: names of MATH.md §7 (fused, per_head, packed; fused:qk, per_head:v, ...).
inline std::vector<CorrectionPlacement> parse_placements(const std::string& s) {
  if (s.empty()) throw BadInput("--placements: the list of placements is empty");
  std::vector<CorrectionPlacement> out;
  for (const std::string& item : comma_items(s)) {
    try {
      out.push_back(parse_placement(item, "--placements"));
    } catch (const std::invalid_argument& e) {
      throw BadInput(e.what());
    }
  }
  return out;
}

/// The options `analyze` and `demo` share: the model's, and those of their report.
inline void add_analysis_options(CLI::App* cmd, AnalysisOptions& o) {
  add_model_options(cmd, o);
  cmd->add_option("--lambda", o.lambda, "lambda of W + lambda I_k (default 10)");
  cmd->add_flag("--per-head", o.per_head, "also report every head's D x d_k block");
  cmd->add_flag("--jacobian", o.jacobian, "also kappa(J) and Theorem 3.4 for every head");
  cmd->add_flag("--blocks", o.blocks, "with --jacobian, also kappa(J_Q), kappa(J_K), kappa(J_V)");
  cmd->add_flag_callback(
      "--no-jacobian-corrections", [&o] { o.jacobian_corrections = false; },
      "with --jacobian, skip kappa(J) of the corrected weights (lambda fused, per-head, exact)");
}

}  // namespace spectral_cond::cli
