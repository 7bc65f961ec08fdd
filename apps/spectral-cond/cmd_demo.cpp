// spectral-cond demo: the whole analysis on a built-in model, with nothing to download.
//
//   spectral-cond demo [--seed 0] [--tokens 64] [--keep DIR] [--jacobian-layers 0,5,11]
//                      [--format table|json|csv] [--quiet]
//
// It writes a seeded ViT-Tiny-shaped checkpoint (timm layout: 12 blocks, D = 192, 3 heads,
// blocks.i.attn.qkv.weight 576 x 192 with its bias, attn.proj, mlp.fc1, norm1; float32) and a
// config.json to a temporary directory (or DIR), then runs exactly what
// `spectral-cond analyze DIR --per-head --jacobian --tokens 64 --no-biases` runs on it (Theorem
// 3.4 is stated without biases), restricted to a few layers for the Jacobian part so that it
// finishes in about a minute on two cores.
//
// The weights are not random matrices: W_Q, W_K, W_V of block i are U diag(s) V^T with random
// orthogonal U, V and singular values decaying geometrically from s_1 = 0.4 + 0.04 i to
// s_1 / kappa_i, kappa_i = 10^(1 + 2.5 i / 11): early blocks well conditioned, late blocks badly,
// the trend reported for trained vision transformers.
#include <spectral_cond/engine/analysis.hpp>
#include <spectral_cond/engine/analysis_format.hpp>
#include <spectral_cond/engine/inputs.hpp>
#include "commands.hpp"
#include "progress.hpp"

#include <spectral_cond/engine/synthetic.hpp>
#include <spectral_cond/io/formats/safetensors.hpp>
#include <spectral_cond/io/paths.hpp>

#include <Eigen/QR>

#include <sys/stat.h>

#include <cmath>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

namespace spectral_cond::cli {
namespace {

constexpr Index kLayers = 12, kD = 192, kHeads = 3, kMlp = 768;

struct DemoArgs {
  std::uint64_t seed = 0;
  Index tokens = 64;
  std::string keep, jacobian_layers = "0,5,11", format = "table";
  bool quiet = false;
};

/// rows x cols standard normals times `scale`, from a seed derived from (seed, tag).
Mat<double> gaussian(Index rows, Index cols, double scale, std::uint64_t seed, std::uint64_t tag) {
  const std::vector<double> z = standard_normals(
      seed * 1000003ULL + tag, static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols));
  Mat<double> m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = scale * z[static_cast<std::size_t>(i)];
  return m;
}

/// A D x D matrix with singular values geometric from s1 to s1 / kappa (see the top).
Mat<double> conditioned(double s1, double kappa, std::uint64_t seed, std::uint64_t tag) {
  const Mat<double> U =
      Eigen::HouseholderQR<Mat<double>>(gaussian(kD, kD, 1, seed, tag)).householderQ() *
      Mat<double>::Identity(kD, kD);
  const Mat<double> V =
      Eigen::HouseholderQR<Mat<double>>(gaussian(kD, kD, 1, seed, tag + 1)).householderQ() *
      Mat<double>::Identity(kD, kD);
  Vec<double> s(kD);
  for (Index i = 0; i < kD; ++i)
    s(i) = s1 * std::pow(kappa, -static_cast<double>(i) / static_cast<double>(kD - 1));
  return U * s.asDiagonal() * V.transpose();
}

/// Writes the model and its config.json into `dir`; returns the checkpoint's path.
std::string write_model(const std::string& dir, std::uint64_t seed) {
  std::deque<std::vector<std::uint8_t>> bufs;
  std::vector<io::TensorToWrite> ts;
  auto add = [&](const std::string& name, const Mat<double>& m, bool vector) {
    bufs.push_back(io::encode_matrix(m, io::Dtype::F32));
    io::TensorToWrite t;
    t.name = name;
    t.dtype = io::Dtype::F32;
    t.shape = vector ? std::vector<std::int64_t>{m.size()}
                     : std::vector<std::int64_t>{m.rows(), m.cols()};
    t.bytes = {bufs.back().data(), bufs.back().size()};
    ts.push_back(std::move(t));
  };
  for (Index i = 0; i < kLayers; ++i) {
    const std::string p = "blocks." + std::to_string(i) + ".";
    const auto tag = static_cast<std::uint64_t>(100 * i);
    const double s1 = 0.4 + 0.04 * static_cast<double>(i);
    const double kappa = std::pow(10.0, 1.0 + 2.5 * static_cast<double>(i) / 11.0);
    Mat<double> qkv(3 * kD, kD);  // Linear weight: rows Q, K, V, each W^T
    for (Index j = 0; j < 3; ++j)
      qkv.middleRows(j * kD, kD) = conditioned(s1 * (1 - 0.1 * static_cast<double>(j)), kappa, seed,
                                               tag + 10 * static_cast<std::uint64_t>(j))
                                       .transpose();
    add(p + "attn.qkv.weight", qkv, false);
    add(p + "attn.qkv.bias", gaussian(3 * kD, 1, 0.02, seed, tag + 50), true);
    add(p + "attn.proj.weight", gaussian(kD, kD, 0.02, seed, tag + 51), false);
    add(p + "mlp.fc1.weight", gaussian(kMlp, kD, 0.02, seed, tag + 52), false);
    add(p + "norm1.weight", Mat<double>::Ones(kD, 1), true);
  }
  const std::string path = io::join_path(dir, "model.safetensors");
  io::write_safetensors(path, ts, {{"format", "pt"}, {"source", "spectral-cond demo"}});
  const std::string cfg = "{\"model_type\": \"vit\", \"hidden_size\": " + std::to_string(kD) +
                          ", \"num_attention_heads\": " + std::to_string(kHeads) +
                          ", \"num_hidden_layers\": " + std::to_string(kLayers) + "}\n";
  io::atomic_write_bytes(io::join_path(dir, "config.json"), cfg.data(), cfg.size());
  return path;
}

/// A temporary directory removed on scope exit (unless kept).
struct TempDir {
  std::string path;
  bool keep = false;
  TempDir() {
    const char* t = std::getenv("TMPDIR");
    std::string tmpl = std::string(t && *t ? t : "/tmp") + "/spectral-cond-demo.XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr)
      throw Error(kInternalError, tmpl + ": cannot create a temporary directory");
    path = tmpl;
  }
  ~TempDir() {
    if (keep) return;
    for (const char* f : {"model.safetensors", "config.json"})
      ::unlink(io::join_path(path, f).c_str());
    ::rmdir(path.c_str());
  }
};

const char* const kExplanation =
    "What the numbers mean (MATH.md; docs/checkpoints.md):\n"
    "- kappa = sigma_max / sigma_min of each projection W (D x d). The paper argues that badly\n"
    "  conditioned W_Q, W_K, W_V make the attention Jacobian J badly conditioned, which slows "
    "training.\n"
    "- \"+lambda I fused\" is kappa(W + lambda I_k) with I_k added to the whole projection; "
    "\"per-head\"\n"
    "  adds one rectangular identity to every head's block. \"(<=b)\" is the Weyl bound\n"
    "  (lambda + s)/(lambda - s), s = sigma_max(W), a theorem whenever lambda > s (Theorem 3.8).\n"
    "- \"exact\" is kappa(W + C), C = sigma_1 U V^T (Theorem 3.5): at most 2, whatever kappa(W) "
    "was.\n"
    "- kappa(J) is the condition number of the Jacobian of one head's attention output with "
    "respect\n"
    "  to (W_Q, W_K, W_V) on the synthetic tokens; J is wide, its rank is at most N d_v. kappa+ "
    "uses\n"
    "  the singular values above the rank tolerance. \"bound+\" is the right-hand side of Theorem "
    "3.4\n"
    "  with kappa_plus of every factor (with plain kappa it is +inf: the softmax Jacobian is "
    "singular),\n"
    "  and \"holds\" compares it with kappa+(J). \"method\" is what --method auto chose, and "
    "why.\n";

void run_demo(const DemoArgs& a) {
  TempDir dir;
  if (!a.keep.empty()) {
    // --keep never replaces anything: DIR is created, or an existing directory without the
    // two files the demo writes.
    struct stat st {};
    if (::lstat(a.keep.c_str(), &st) == 0 && !S_ISDIR(st.st_mode))
      throw BadInput(a.keep + ": --keep needs a directory, and this is " +
                     io::file_kind(st.st_mode));
    for (const char* f : {"model.safetensors", "config.json"}) {
      const std::string p = io::join_path(a.keep, f);
      if (::lstat(p.c_str(), &st) == 0)
        throw BadInput(p + ": --keep would overwrite it; choose an empty or new directory");
    }
    dir.keep = true;
    ::rmdir(dir.path.c_str());
    dir.path = a.keep;
    if (!io::is_directory(dir.path) && ::mkdir(dir.path.c_str(), 0777) != 0)
      throw BadInput(a.keep + ": cannot create the directory");
  }
  Progress bar("demo: writing the model", !a.quiet);
  const std::string path = write_model(dir.path, a.seed);
  bar.done();

  AnalysisOptions o;
  o.per_head = true;
  CheckpointReport weights;
  {
    Progress b2("demo: weights and corrections", !a.quiet);
    weights = analyze_checkpoint(dir.path, o, [&](double f) { b2.update(f); });
  }
  o.per_head = false;
  o.jacobian = true;
  o.tokens = a.tokens;
  o.seed = a.seed;
  o.layers = a.jacobian_layers;
  o.jacobian_heads = IndexSelection::parse("0", "--jacobian-heads");
  // Theorem 3.4 is stated for the block without biases (MATH.md §10): the demo checks it there.
  o.biases = false;
  CheckpointReport jac;
  {
    Progress b3("demo: kappa(J) and Theorem 3.4", !a.quiet);
    jac = analyze_checkpoint(dir.path, o, [&](double f) { b3.update(f); });
  }
  // One report: the weight rows of every layer, the Jacobian rows of the chosen ones.
  for (LayerStats& L : weights.layers)
    for (LayerStats& J : jac.layers)
      if (J.spec.index == L.spec.index) L.jacobian = std::move(J.jacobian);
  weights.tokens = jac.tokens;
  weights.inputs = jac.inputs;
  weights.path =
      a.keep.empty() ? "demo model (ViT-Tiny shape, seed " + std::to_string(a.seed) + ")" : path;
  const std::vector<CheckpointReport> reps{weights};
  if (a.format == "json") {
    std::cout << reports_json(reps);
    return;
  }
  if (a.format == "csv") {
    std::cout << reports_csv(reps);
    return;
  }
  std::cout << "spectral-cond demo: a seeded ViT-Tiny-shaped model (12 blocks, D = 192, 3 heads, "
               "timm layout, float32),\nanalysed like `spectral-cond analyze MODEL --per-head "
               "--jacobian --tokens "
            << a.tokens << " --layers " << a.jacobian_layers
            << " --jacobian-heads 0 --no-biases`\n(Theorem 3.4 is stated for the block without "
               "its biases).\n\n"
            << reports_table(reps) << kExplanation;
  if (!a.keep.empty())
    std::cout << "\nThe model is in " << a.keep << "; try `spectral-cond analyze " << a.keep
              << "` and `spectral-cond correct " << path
              << " --method lambda --out NEW.safetensors`.\n";
}

}  // namespace

void register_demo(CLI::App& app) {
  auto a = std::make_shared<DemoArgs>();
  CLI::App* cmd = app.add_subcommand(
      "demo", "Analyse a built-in ViT-Tiny-shaped model end to end (no files needed)");
  cmd->add_option("--seed", a->seed, "seed of the model and the tokens (default 0)")
      ->check(unsigned_integer());
  cmd->add_option("--tokens", a->tokens, "N synthetic tokens for kappa(J) (default 64)")
      ->check(CLI::Range(1LL, kMaxTokens));
  cmd->add_option("--jacobian-layers", a->jacobian_layers,
                  "layers whose head 0 gets kappa(J) (default 0,5,11)");
  cmd->add_option("--keep", a->keep, "write the model to this directory and keep it");
  cmd->add_option("--format", a->format, "table (default, with an explanation), json or csv")
      ->check(CLI::IsMember({"table", "json", "csv"}));
  cmd->add_flag("--quiet", a->quiet, "no progress bar");
  cmd->callback([a] { run_demo(*a); });
}

}  // namespace spectral_cond::cli
