// spectral-cond analyze: condition numbers of the attention projections of real checkpoints,
// before and after the paper's corrections, and optionally of each head's Jacobian with every
// term of Theorem 3.4 (MATH.md §4–8). Formats and fields: docs/checkpoints.md.
//
//   spectral-cond analyze CHECKPOINT... [--layout auto|torch-mha|timm|hf-bert|gpt2|llama]
//        [--heads H] [--kv-heads G] [--lambda 10] [--target T] [--per-head] [--layers 0,3,5-7]
//        [--jacobian [--inputs X.npy | --tokens 64 --seed 0] [--method auto|dense|gram|
//         iterative|qr|lobpcg] [--tol 1e-6] [--scale C] [--mask auto|none|causal] [--blocks]
//         [--jacobian-heads 0,1] [--no-biases] [--rope auto|none|rotate_half|interleaved]
//         [--rope-theta T] [--rope-dims R] [--placements packed,fused:qk,...]]
//        [--jobs N] [--shard I/N]
//        [--format table|json|csv] [--out FILE] [--quiet] [--verbose] [--device cpu|cuda]
//
// --jobs runs a layer's three projections, then its heads, on N threads; --shard I/N computes
// only every N-th κ(J) work item (one per head) from the I-th, for a JSON report that
// `spectral-cond merge` unites with the others into the unsharded one (merge.hpp);
// spectral-cond-mpi does both over MPI ranks.
#include <spectral_cond/engine/analysis.hpp>
#include <spectral_cond/engine/analysis_format.hpp>
#include <spectral_cond/engine/device.hpp>
#include <spectral_cond/engine/inputs.hpp>
#include <spectral_cond/engine/number_text.hpp>
#include <spectral_cond/engine/report_json.hpp>
#include "analysis_cli.hpp"
#include "commands.hpp"
#include "progress.hpp"
#include "run.hpp"

#include <spectral_cond/io/atomic_file.hpp>
#include <spectral_cond/io/paths.hpp>

#include <nlohmann/json.hpp>

#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace spectral_cond::cli {

namespace {

struct AnalyzeArgs {
  std::vector<std::string> checkpoints;
  AnalysisOptions opts;
  std::string method = "auto", mask = "auto", jacobian_heads;
  double target = 0;
  double scale = 0;
  std::string format = "table", out, device = "cpu", shard, placements;
  bool quiet = false;
};

/// Parses --shard I/N (0 <= I < N) into the options.
void parse_shard(const std::string& s, AnalysisOptions& o) {
  const auto slash = s.find('/');
  auto digits = [](const std::string& t) {
    return !t.empty() && t.size() <= 9 && t.find_first_not_of("0123456789") == std::string::npos;
  };
  const std::string i = slash == std::string::npos ? s : s.substr(0, slash);
  const std::string n = slash == std::string::npos ? std::string() : s.substr(slash + 1);
  if (!digits(i) || !digits(n) || std::stoull(n) < 1 || std::stoull(i) >= std::stoull(n))
    throw BadInput("--shard must be I/N with 0 <= I < N, e.g. 0/4 (got '" + s + "')");
  o.shard_index = std::stoull(i);
  o.shard_count = std::stoull(n);
}

void run_analyze(AnalyzeArgs& a, bool target_set, bool scale_set, bool placements_set,
                 const AnalyzeDistribution* dist) {
  AnalysisOptions& o = a.opts;
  if (!a.shard.empty()) {
    if (dist) throw BadInput("--shard: spectral-cond-mpi gives each rank its shard; leave it out");
    parse_shard(a.shard, o);
  }
  if (dist) {
    o.shard_index = dist->rank;
    o.shard_count = dist->size;
    if (dist->rank != 0) a.quiet = true;  // one progress bar, rank 0's
  }
  if (o.shard_count > 1 && a.format != "json")
    throw BadInput(dist ? "spectral-cond-mpi over several ranks writes --format json only"
                        : "--shard needs --format json (the shards' reports are united by "
                          "`spectral-cond merge`)");
  if (!(std::isfinite(o.lambda) && o.lambda >= 0))
    throw BadInput("--lambda must be finite and >= 0 (got " + number_text(o.lambda, 6) + ")");
  if (target_set) {
    if (!(std::isfinite(a.target) && a.target > 1))
      throw BadInput("--target must be finite and > 1 (got " + number_text(a.target, 6) + ")");
    o.target = a.target;
  }
  if (scale_set) {
    if (!(std::isfinite(a.scale) && a.scale > 0))
      throw BadInput("--scale must be finite and > 0 (got " + number_text(a.scale, 6) + ")");
    o.scale = a.scale;
  }
  if (!(a.opts.tol > 0)) throw BadInput("--tol must be > 0");
  o.method = parse_jacobian_kappa_method(a.method);
  require_device(a.device, o.method);
  o.device = a.device;
  o.mask = a.mask;
  o.jacobian_heads = IndexSelection::parse(a.jacobian_heads, "--jacobian-heads");
  if (placements_set) {
    if (!o.jacobian_corrections)
      throw BadInput(
          "--placements adds corrected variants: it cannot go with "
          "--no-jacobian-corrections");
    o.placements = parse_placements(a.placements);
  }

  check_report_out(a.out, a.checkpoints, o.inputs);
  std::vector<std::string> declined;
  auto compute = [&] {
    std::vector<CheckpointReport> reps;
    std::uint64_t item = 0;  // κ(J) work items, numbered across the checkpoints
    for (std::size_t i = 0; i < a.checkpoints.size(); ++i) {
      Progress bar("analyze " + a.checkpoints[i], !a.quiet);
      reps.push_back(analyze_checkpoint(
          a.checkpoints[i], o, [&](double f) { bar.update(f); }, &item));
      bar.done();
    }
    const nlohmann::json doc = reports_document(reps, o.shard_index, o.shard_count);
    declined = declined_kappa_j(doc);
    return a.format == "json"  ? json_text(doc)
           : a.format == "csv" ? reports_csv(reps)
                               : reports_table(reps);
  };
  std::string text;
  if (dist) {
    // Every rank reaches gather, with its report or with its error, so none waits forever.
    std::string mine;
    int code = kSuccess;
    try {
      mine = compute();
    } catch (...) {
      std::tie(code, mine) = exit_status(std::current_exception());
    }
    const std::optional<std::string> merged = dist->gather(mine, code);
    if (!merged) return;  // not the rank that writes
    text = *merged;
    declined = declined_kappa_j(nlohmann::json::parse(text));
  } else {
    text = compute();
  }
  if (a.out.empty()) {
    std::cout << text << std::flush;
  } else {
    io::atomic_write_bytes(a.out, text.data(), text.size());
    if (!a.quiet) std::cerr << "spectral-cond: report written to " << a.out << '\n';
  }
  fail_if_declined(declined);
}

}  // namespace

void register_analyze(CLI::App& app, const AnalyzeDistribution* dist) {
  auto a = std::make_shared<AnalyzeArgs>();
  CLI::App* cmd = app.add_subcommand(
      "analyze", "kappa of W_Q, W_K, W_V in checkpoints, before and after the corrections");
  cmd->add_option(
         "checkpoint", a->checkpoints,
         "a .safetensors file, a sharded *.index.json, a PyTorch .bin/.pt, an .npz, or a directory")
      ->required();
  add_analysis_options(cmd, a->opts);
  cmd->add_option("--target", a->target,
                  "target kappa of the exact correction (default: none, "
                  "kappa = 2 sigma_1/(sigma_1 + sigma_r))");
  cmd->add_option("--method", a->method,
                  "kappa(J) method: auto (default), dense, gram, "
                  "iterative, qr, lobpcg, matfree")
      ->check(CLI::IsMember({"auto", "dense", "gram", "iterative", "qr", "lobpcg", "matfree"}));
  cmd->add_option("--scale", a->scale, "logit scale c (default 1/sqrt(d_k))");
  cmd->add_option("--mask", a->mask,
                  "mask for --jacobian: auto (default: causal for decoder self-attention, by "
                  "the layout or config.json), none or causal")
      ->check(CLI::IsMember({"auto", "none", "causal"}));
  cmd->add_option("--jacobian-heads", a->jacobian_heads, "heads for --jacobian (default all)");
  cmd->add_option("--placements", a->placements,
                  "with --jacobian, kappa(J) after lambda I under further placements too, "
                  "comma-separated: packed (one packed Q/K/V tensor), fused:qk, per_head:v, ... "
                  "(MATH.md §7)");
  cmd->add_option("--format", a->format, "table (default), json or csv")
      ->check(CLI::IsMember({"table", "json", "csv"}));
  cmd->add_option("--out", a->out, "write the report to FILE (atomically) instead of stdout");
  cmd->add_flag("--quiet", a->quiet, "no progress bar");
  cmd->add_option("--jobs", a->opts.jobs,
                  "threads, one projection or head each (default 0: one per core); the "
                  "report is the same for any number")
      ->check(CLI::Range(0u, 4096u));
  cmd->add_option("--shard", a->shard,
                  "I/N: only every N-th kappa(J) work item from the I-th, as a JSON report "
                  "for `spectral-cond merge`");
  cmd->add_option("--device", a->device, "cpu (default) or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->callback([a, cmd, dist] {
    // Options that act only on the Jacobian analysis are refused without it, not ignored.
    if (!a->opts.jacobian)
      for (const char* opt :
           {"--inputs", "--tokens", "--seed", "--jacobian-heads", "--mask", "--scale", "--method",
            "--shard", "--tol", "--blocks", "--device", "--no-jacobian-corrections", "--no-biases",
            "--rope", "--rope-theta", "--rope-dims", "--placements"})
        if (cmd->count(opt) > 0) throw BadInput(std::string(opt) + " needs --jacobian");
    run_analyze(*a, cmd->count("--target") > 0, cmd->count("--scale") > 0,
                cmd->count("--placements") > 0, dist);
  });
}

}  // namespace spectral_cond::cli
