// spectral-cond jacobian: the Jacobian of single-head attention (MATH.md §1, §3), or one of its
// blocks, or its Gram matrix J J^T, written to a .npy file (float64, C order).
//
//   spectral-cond jacobian --x X.npy --wq WQ.npy --wk WK.npy --wv WV.npy
//                          [--scale S] [--mask none|causal] [--block all|q|k|v|x] [--gram]
//                          --out J.npy
//
// Entry [i, j] of the output is J[i, j] in MATH.md §1's convention: row i = r + N e for A(r, e),
// column a + D b for W(a, b) within each parameter block (J_X: column r + N a for X(r, a)).
#include <spectral_cond/engine/inputs.hpp>
#include "commands.hpp"
#include <spectral_cond/engine/number_text.hpp>

#include <spectral_cond/io/files.hpp>
#include <spectral_cond/jacobian/gram.hpp>
#include <spectral_cond/jacobian/jacobian.hpp>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <iostream>
#include <limits>
#include <memory>
#include <new>
#include <sstream>
#include <string>

namespace spectral_cond::cli {
namespace {

struct JacobianArgs {
  std::string x, wq, wk, wv, out;
  double scale = std::numeric_limits<double>::quiet_NaN();  // NaN: 1/sqrt(d_k)
  bool scale_set = false;
  std::string mask = "none";  // none | causal
  std::string block = "all";  // all | q | k | v | x
  bool gram = false;
  bool timing = false;
};

JacobianBlock parse_block(const std::string& b) {
  if (b == "q") return JacobianBlock::Q;
  if (b == "k") return JacobianBlock::K;
  if (b == "v") return JacobianBlock::V;
  if (b == "x") return JacobianBlock::X;
  return JacobianBlock::All;  // "all"; CLI11 has checked the value
}

std::string block_name(JacobianBlock b, bool gram) {
  const std::string j = b == JacobianBlock::All ? "J" : std::string("J_") + to_string(b);
  return gram ? j + " " + j + "^T" : j;
}

void run_jacobian(const JacobianArgs& a) {
  if (a.scale_set && !(std::isfinite(a.scale) && a.scale > 0)) {
    std::ostringstream s;
    s << "--scale must be finite and > 0 (got " << a.scale << ")";
    throw BadInput(s.str());
  }
  // Before anything is read or computed: --out may replace only a regular file that is no input.
  io::check_output_target(a.out, {a.x, a.wq, a.wk, a.wv});
  const AttentionFiles in = load_attention_files(a.x, a.wq, a.wk, a.wv);
  const Mat<double>& X = in.X;
  const Mat<double>& WQ = in.WQ;
  const Mat<double>& WK = in.WK;
  const Mat<double>& WV = in.WV;
  const Index N = X.rows(), D = X.cols(), dk = WQ.cols(), dv = WV.cols();

  AttentionOptions<double> opts;
  if (a.scale_set) opts.scale = a.scale;
  opts.mask = a.mask == "causal" ? MaskKind::Causal : MaskKind::None;
  require_finite_attention(X, WQ, WK, WV, opts, a.x + ", " + a.wq + ", " + a.wk + ", " + a.wv);
  const JacobianBlock block = parse_block(a.block);
  const Index rows = jacobian_rows(N, dv);
  const Index cols = a.gram ? rows : jacobian_cols(block, N, D, dk, dv);
  const std::string what = block_name(block, a.gram);
  // The size is checked before the allocation: more than the machine's memory is an input the
  // tool cannot serve (exit 2), not an internal error.
  const double bytes = static_cast<double>(rows) * static_cast<double>(cols) * 8.0;
  const double memory =
      static_cast<double>(::sysconf(_SC_PHYS_PAGES)) * static_cast<double>(::sysconf(_SC_PAGESIZE));
  if (memory > 0 && bytes > memory) {
    std::ostringstream s;
    s << a.x << ", " << a.wq << ", " << a.wv << ": " << what << " would be "
      << shape_str(rows, cols) << " (" << number_text(bytes * 1e-9, 6)
      << " GB in float64), more than this machine's " << number_text(memory * 1e-9, 6)
      << " GB of memory";
    throw BadInput(s.str());
  }
  Mat<double> out;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    out = a.gram ? attention_gram(X, WQ, WK, WV, opts, block)
                 : attention_jacobian(X, WQ, WK, WV, opts, block);
  } catch (const std::bad_alloc&) {
    std::ostringstream s;
    s << "out of memory: " << what << " is " << shape_str(rows, cols) << " ("
      << number_text(static_cast<double>(rows) * static_cast<double>(cols) * 8e-9, 6)
      << " GB in float64)";
    throw Error(kInternalError, s.str());
  }
  const auto t1 = std::chrono::steady_clock::now();
  require_finite(out, what);
  io::write_npy(a.out, out);
  if (a.timing) {
    const auto t2 = std::chrono::steady_clock::now();
    std::cerr << "timing: compute "
              << number_text(std::chrono::duration<double>(t1 - t0).count(), 6) << " s, write "
              << number_text(std::chrono::duration<double>(t2 - t1).count(), 6) << " s\n";
  }
  std::cout << what << ": " << shape_str(out.rows(), out.cols()) << " written to " << a.out
            << " (N = " << N << ", D = " << D << ", d_k = " << dk << ", d_v = " << dv
            << ", scale = " << number_text(opts.resolved_scale(dk), 6) << ", mask = " << a.mask
            << ")\n";
}

}  // namespace

void register_jacobian(CLI::App& app) {
  auto args = std::make_shared<JacobianArgs>();
  CLI::App* cmd = app.add_subcommand(
      "jacobian", "Write the attention Jacobian J (or a block, or J J^T) to a .npy file");
  cmd->add_option("--x", args->x, "X, N x D (.npy, float32/float64)")->required();
  cmd->add_option("--wq", args->wq, "W_Q, D x d_k (.npy)")->required();
  cmd->add_option("--wk", args->wk, "W_K, D x d_k (.npy)")->required();
  cmd->add_option("--wv", args->wv, "W_V, D x d_v (.npy)")->required();
  cmd->add_option("--scale", args->scale, "logit scale c > 0 (default 1/sqrt(d_k))");
  cmd->add_option("--mask", args->mask, "mask: none (default) or causal")
      ->check(CLI::IsMember({"none", "causal"}));
  cmd->add_option("--block", args->block,
                  "all = [J_Q | J_K | J_V] (default), q, k, v, or x (the input Jacobian J_X)")
      ->check(CLI::IsMember({"all", "q", "k", "v", "x"}));
  cmd->add_flag("--gram", args->gram, "write J J^T of the block instead of J");
  cmd->add_flag("--timing", args->timing,
                "print the time spent computing and writing the result on stderr");
  cmd->add_option("--out", args->out, "output .npy file (float64, C order; written atomically)")
      ->required();
  cmd->callback([args, cmd] {
    args->scale_set = cmd->count("--scale") > 0;
    run_jacobian(*args);
  });
}

}  // namespace spectral_cond::cli
