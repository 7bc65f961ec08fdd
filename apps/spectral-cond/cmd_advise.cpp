// spectral-cond advise: which λ and placement of λ I lower κ(J) without saturating attention
// (MATH.md §17), from exact κ(J) on a grid, per sampled head of a checkpoint's self-attention
// layers, with the recommendation over them. Formats and keys: docs/cli.md ("advise").
//
//   spectral-cond advise CHECKPOINT... [--inputs X | --tokens 64 --seed 0]
//        [--lambdas 0,0.25,0.5,1,2,3,5,10] [--placements fused,per_head[,packed][,fused:qk...]]
//        [--sample-heads 2|all] [--layers 0,3] [--max-saturated 0.01] [--min-qk-ratio 0.1]
//        [--method auto] [--tol 1e-6] [--scale C] [--mask auto|none|causal] [--jobs N]
//        [--layout ...] [--heads H] [--kv-heads G] [--rope ...] [--no-biases]
//        [--format table|json|csv] [--out FILE] [--quiet] [--verbose]
#include <spectral_cond/engine/advice.hpp>
#include <spectral_cond/engine/advice_format.hpp>
#include <spectral_cond/engine/analysis.hpp>
#include <spectral_cond/engine/inputs.hpp>
#include <spectral_cond/engine/number_text.hpp>
#include <spectral_cond/io/atomic_file.hpp>
#include <spectral_cond/io/paths.hpp>
#include "analysis_cli.hpp"
#include "commands.hpp"
#include "progress.hpp"

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace spectral_cond::cli {
namespace {

struct AdviseArgs {
  std::vector<std::string> checkpoints;
  AnalysisOptions opts;
  std::string lambdas = "0,0.25,0.5,1,2,3,5,10", placements, sample_heads = "2";
  std::string method = "auto", mask = "auto", format = "table", out;
  double max_saturated = 0.01, min_qk_ratio = 0.1, scale = 0;
  bool quiet = false;
};

/// --lambdas: finite numbers >= 0, at least one.
std::vector<double> parse_lambdas(const std::string& s) {
  if (s.empty()) throw BadInput("--lambdas: the grid of lambda is empty");
  std::vector<double> out;
  for (const std::string& item : comma_items(s)) {
    char* end = nullptr;
    const double x = item.empty() ? std::nan("") : std::strtod(item.c_str(), &end);
    if (item.empty() || end != item.c_str() + item.size())
      throw BadInput("--lambdas: '" + item + "' is not a number (expected e.g. 0,0.5,1,2)");
    if (!(std::isfinite(x) && x >= 0))
      throw BadInput("--lambdas: every lambda must be finite and >= 0 (got " + item + ")");
    out.push_back(x);
  }
  return out;
}

void run_advise(AdviseArgs& a, bool scale_set, bool placements_set) {
  AnalysisOptions& o = a.opts;
  o.jacobian = true;  // X, the mask and RoPE are read as for analyze --jacobian
  o.jacobian_corrections = false;
  if (scale_set) {
    if (!(std::isfinite(a.scale) && a.scale > 0))
      throw BadInput("--scale must be finite and > 0 (got " + number_text(a.scale, 6) + ")");
    o.scale = a.scale;
  }
  if (!(o.tol > 0)) throw BadInput("--tol must be > 0");
  if (!(a.max_saturated >= 0 && a.max_saturated <= 1))
    throw BadInput("--max-saturated must be a fraction in [0, 1] (got " +
                   number_text(a.max_saturated, 6) + ")");
  if (!(std::isfinite(a.min_qk_ratio) && a.min_qk_ratio >= 0))
    throw BadInput("--min-qk-ratio must be finite and >= 0 (got " + number_text(a.min_qk_ratio, 6) +
                   ")");
  AdviceOptions ao;
  ao.lambdas = parse_lambdas(a.lambdas);
  // Default placements: fused and per-head, which every layout takes (packed only on request:
  // it needs Q, K and V in one tensor).
  ao.placements =
      placements_set ? parse_placements(a.placements) : parse_placements("fused,per_head");
  ao.max_saturated_fraction = a.max_saturated;
  ao.min_qk_ratio = a.min_qk_ratio;
  ao.jacobian.method = parse_jacobian_kappa_method(a.method);
  ao.jacobian.tol = o.tol;
  o.advice = ao;
  o.mask = a.mask;
  if (a.sample_heads == "all") {
    o.advice_heads = 0;
  } else {
    char* end = nullptr;
    const long long n = std::strtoll(a.sample_heads.c_str(), &end, 10);
    if (a.sample_heads.empty() || end != a.sample_heads.c_str() + a.sample_heads.size() || n < 1)
      throw BadInput("--sample-heads must be 'all' or a number of heads >= 1 per layer (got '" +
                     a.sample_heads + "')");
    o.advice_heads = n;
  }
  check_report_out(a.out, a.checkpoints, o.inputs);
  std::vector<CheckpointReport> reps;
  for (const std::string& path : a.checkpoints) {
    Progress bar("advise " + path, !a.quiet);
    reps.push_back(analyze_checkpoint(path, o, [&](double f) { bar.update(f); }));
    bar.done();
  }
  const AdviceChoice best = recommend_reports(reps);
  const std::string sampling =
      o.advice_heads == 0
          ? "every head of every selected layer"
          : std::to_string(o.advice_heads) + " heads per layer drawn at random (--seed " +
                std::to_string(o.seed) + "), every head where a layer has fewer";
  const std::string text = a.format == "json"  ? advice_json(reps, o, best, sampling)
                           : a.format == "csv" ? advice_csv(reps)
                                               : advice_table(reps, o, best, sampling);
  if (a.out.empty()) {
    std::cout << text << std::flush;
  } else {
    io::atomic_write_bytes(a.out, text.data(), text.size());
    if (!a.quiet) std::cerr << "spectral-cond: advice written to " << a.out << '\n';
  }
}

}  // namespace

void register_advise(CLI::App& app) {
  auto a = std::make_shared<AdviseArgs>();
  CLI::App* cmd =
      app.add_subcommand("advise",
                         "which lambda and placement of lambda I lower kappa(J) without saturating "
                         "attention (MATH.md section 17)");
  cmd->add_option(
         "checkpoint", a->checkpoints,
         "a .safetensors file, a sharded *.index.json, a PyTorch .bin/.pt, an .npz, or a directory")
      ->required();
  add_model_options(cmd, a->opts);
  cmd->add_option("--lambdas", a->lambdas,
                  "the grid of lambda, comma-separated (default 0,0.25,0.5,1,2,3,5,10)");
  cmd->add_option("--placements", a->placements,
                  "comma-separated: fused, per_head, packed (one packed Q/K/V tensor only), or "
                  "a subset such as fused:qk, per_head:v (default fused,per_head)");
  cmd->add_option("--sample-heads", a->sample_heads,
                  "heads advised per layer: a number drawn at random with --seed (default 2), "
                  "or all");
  cmd->add_option("--max-saturated", a->max_saturated,
                  "largest admissible fraction of saturated rows of P (default 0.01)");
  cmd->add_option("--min-qk-ratio", a->min_qk_ratio,
                  "smallest admissible ||J_QK||/||J_V|| as a multiple of its lambda = 0 value "
                  "(default 0.1)");
  cmd->add_option("--method", a->method,
                  "kappa(J) method: auto (default), dense, gram, iterative, qr, lobpcg, matfree")
      ->check(CLI::IsMember({"auto", "dense", "gram", "iterative", "qr", "lobpcg", "matfree"}));
  cmd->add_option("--scale", a->scale, "logit scale c (default 1/sqrt(d_k))");
  cmd->add_option("--mask", a->mask,
                  "auto (default: causal for decoder self-attention), none or causal")
      ->check(CLI::IsMember({"auto", "none", "causal"}));
  cmd->add_option("--format", a->format, "table (default), json or csv")
      ->check(CLI::IsMember({"table", "json", "csv"}));
  cmd->add_option("--out", a->out, "write the advice to FILE (atomically) instead of stdout");
  cmd->add_flag("--quiet", a->quiet, "no progress bar");
  cmd->add_option("--jobs", a->opts.jobs,
                  "threads, one head each (default 0: one per core); the advice is the same "
                  "for any number")
      ->check(CLI::Range(0u, 4096u));
  cmd->callback(
      [a, cmd] { run_advise(*a, cmd->count("--scale") > 0, cmd->count("--placements") > 0); });
}

}  // namespace spectral_cond::cli
