// spectral-cond kappa: condition numbers (MATH.md §4) of a matrix, or of the Jacobian J of an
// attention block (MATH.md §3), optionally with every term of the paper's Theorem 3.4 (§5).
//
//   spectral-cond kappa --matrix M.npy [--rtol R] [--format table|json] [--out FILE]
//   spectral-cond kappa --x X.npy --wq WQ.npy --wk WK.npy --wv WV.npy [--scale S]
//                       [--mask none|causal] [--method auto|dense|gram|iterative|qr|
//                       lobpcg] [--rtol R] [--tol T] [--bound] [--format table|json] [--out FILE]
//                       [--quiet] [--device cpu|cuda]
//
// The JSON keys are documented in docs/cli.md (a stable interface). Exit codes as in cli.hpp;
// a κ(J) that did not converge, or any declined answer (too large, inaccurate, out of range), is
// reported and then exits 3.
#include <spectral_cond/engine/inputs.hpp>
#include "commands.hpp"
#include <spectral_cond/engine/device.hpp>
#include <spectral_cond/engine/number_text.hpp>
#include "progress.hpp"
#include <spectral_cond/engine/report_json.hpp>

#include <spectral_cond/conditioning/bound.hpp>
#include <spectral_cond/conditioning/kappa.hpp>
#include <spectral_cond/conditioning/methods/kappa_jacobian.hpp>
#include <spectral_cond/io/atomic_file.hpp>

#include <cmath>
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <string>

namespace spectral_cond::cli {
namespace {

struct KappaArgs {
  std::string matrix, x, wq, wk, wv, out;
  double scale = std::numeric_limits<double>::quiet_NaN();
  std::string mask = "none";
  std::string method = "auto";
  double rtol = -1;
  double tol = 1e-6;
  bool bound = false;
  std::string format = "table";
  bool quiet = false;
  std::string device = "cpu";
  std::int64_t max_iterations = 0;  ///< --max-iterations: matfree's LOBPCG limit (0: default)
  std::int64_t coarse = 16;         ///< --coarse: modes of matfree's coarse level
  // which options were given on the command line
  bool scale_set = false, mask_set = false, method_set = false, tol_set = false,
       max_iterations_set = false, coarse_set = false;
};

/// Significant digits of the table's numbers.
constexpr int kDigits = 10;

void check_args(const KappaArgs& a) {
  require_device(a.device, parse_jacobian_kappa_method(a.method));
  const bool attention = !a.x.empty() || !a.wq.empty() || !a.wk.empty() || !a.wv.empty();
  if (!a.matrix.empty() && attention)
    throw BadInput("give either --matrix or --x/--wq/--wk/--wv, not both");
  if (a.matrix.empty() && !attention)
    throw BadInput("nothing to do: give --matrix M.npy, or --x, --wq, --wk and --wv");
  if (attention) {
    std::string missing;
    for (const auto& [flag, path] : {std::pair<const char*, const std::string*>{"--x", &a.x},
                                     {"--wq", &a.wq},
                                     {"--wk", &a.wk},
                                     {"--wv", &a.wv}})
      if (path->empty()) missing += missing.empty() ? flag : std::string(", ") + flag;
    if (!missing.empty())
      throw BadInput("attention inputs need --x, --wq, --wk and --wv (missing " + missing + ")");
  } else {
    const char* extra = a.bound                ? "--bound"
                        : a.method_set         ? "--method"
                        : a.scale_set          ? "--scale"
                        : a.mask_set           ? "--mask"
                        : a.tol_set            ? "--tol"
                        : a.max_iterations_set ? "--max-iterations"
                        : a.coarse_set         ? "--coarse"
                                               : nullptr;
    if (extra != nullptr)
      throw BadInput(std::string(extra) + " applies to attention inputs (--x ...), not --matrix");
  }
  if (a.scale_set && !(std::isfinite(a.scale) && a.scale > 0)) {
    std::ostringstream s;
    s << "--scale must be finite and > 0 (got " << a.scale << ")";
    throw BadInput(s.str());
  }
  if (!(std::isfinite(a.rtol) && a.rtol < 1)) {
    std::ostringstream s;
    s << "--rtol must be finite and < 1 (negative for the default max(m, n) eps) (got " << a.rtol
      << ")";
    throw BadInput(s.str());
  }
  if (!(std::isfinite(a.tol) && a.tol > 0)) {
    std::ostringstream s;
    s << "--tol must be finite and > 0 (got " << a.tol << ")";
    throw BadInput(s.str());
  }
  // Before anything is read or computed: --out may replace only a regular file that is no input.
  if (!a.out.empty()) io::check_output_target(a.out, {a.matrix, a.x, a.wq, a.wk, a.wv});
}

void table_condition(std::ostream& o, const ConditionResult<double>& r) {
  auto row = [&o](const char* key, const std::string& value) {
    o << "  " << std::left << std::setw(16) << key << value << '\n';
  };
  row("method", r.method);
  row("sigma_max", number_text(r.sigma_max, kDigits));
  row("sigma_min", number_text(r.sigma_min, kDigits));
  row("kappa", number_text(r.kappa, kDigits));
  row("sigma_min_plus", number_text(r.sigma_min_plus, kDigits));
  row("kappa_plus", number_text(r.kappa_plus, kDigits));
  row("rank", std::to_string(r.rank) + " (rank_tol " + number_text(r.rank_tol, kDigits) + ")");
  row("accuracy", number_text(r.accuracy, kDigits) + " (estimated relative error of sigma_min)");
  if (r.iterations > 0)
    row("iterations",
        std::to_string(r.iterations) + " (residual " + number_text(r.residual, kDigits) + ")");
  row("info", to_string(r.info));
  if (!r.note.empty()) row("note", r.note);
}

void table_bound(std::ostream& o, const Theorem34Report& t, const VerifyShape& s) {
  o << "\nTheorem 3.4 (MATH.md §5): kappa(J) <= kappa(X)^3 kappa(Lambda) kappa(W_V) (kappa(W_Q) "
       "+ kappa(W_K)) + kappa(X) kappa(P)\n";
  auto row = [&o](const std::string& term, const std::string& k, const std::string& kp) {
    o << "  " << std::left << std::setw(10) << term << std::setw(20) << k << kp << '\n';
  };
  row("term", "kappa", "kappa_plus");
  const std::pair<const char*, const ConditionResult<double>*> terms[] = {
      {"X", &t.X},    {"Lambda", &t.Lambda}, {"W_Q", &t.WQ},
      {"W_K", &t.WK}, {"W_V", &t.WV},        {"P", &t.P}};
  for (const auto& [name, r] : terms)
    row(name, number_text(r->kappa, kDigits), number_text(r->kappa_plus, kDigits));
  if (t.have_blocks)
    for (const auto& [name, r] :
         {std::pair<const char*, const ConditionResult<double>*>{"J_Q", &t.JQ},
          {"J_K", &t.JK},
          {"J_V", &t.JV}})
      row(name, number_text(r->kappa, kDigits), number_text(r->kappa_plus, kDigits));
  row("bound", number_text(t.bound, kDigits), number_text(t.bound_plus, kDigits));
  row("J", number_text(t.J.kappa, kDigits), number_text(t.J.kappa_plus, kDigits));
  row("ratio", number_text(t.ratio, kDigits), number_text(t.ratio_plus, kDigits));
  row("holds", t.holds ? (t.vacuous ? "yes (vacuous)" : "yes") : "NO", t.holds_plus ? "yes" : "NO");
  o << "  verdict: " << t.verdict << '\n';
  const BoundClassification c = classify_theorem34_plus(t, s);
  o << "  with rounding (relative errors: kappa_plus(J) " << number_text(c.acc_J, kDigits)
    << ", bound_plus " << number_text(c.acc_bound, kDigits) << "): " << to_string(c.verdict)
    << '\n';
}

void table_diagnostics(std::ostream& o, const AttentionDiagnostics& d) {
  const AttentionPattern& p = d.pattern;
  const JacobianBlockNorms& n = d.norms;
  o << "\nAttention pattern (MATH.md §11)\n";
  auto row = [&o](const char* key, const std::string& value) {
    o << "  " << std::left << std::setw(20) << key << value << '\n';
  };
  row("row max", "min " + number_text(p.row_max_min, kDigits) + ", mean " +
                     number_text(p.row_max_mean, kDigits));
  row("row entropy", "mean " + number_text(p.entropy_mean, kDigits) + " (log N for uniform rows)");
  row("saturated rows", std::to_string(p.saturated) + " of " + std::to_string(p.rows) + " (" +
                            std::to_string(p.saturated_diagonal) +
                            " on the diagonal; max_j P_ij > 1 - 1e-6)");
  row("||J_Q||_2", number_text(n.sigma_max_JQ, kDigits));
  row("||J_K||_2", number_text(n.sigma_max_JK, kDigits));
  row("||J_V||_2", number_text(n.sigma_max_JV, kDigits) + " (= sigma_1(P X))");
  row("||J_QK||/||J_V||",
      number_text(n.ratio_QK_V, kDigits) + " (spectral norms, J_QK = [J_Q | J_K])");
  row("collapsed", d.collapsed ? "YES" : "no");
  if (!d.note.empty()) row("note", d.note);
}

void table_free_bound(std::ostream& o, const HypothesisFreeBound& b,
                      const ConditionResult<double>& J) {
  o << "\nBound without hypothesis (MATH.md §5): kappa(J) <= sigma_max(J) / sigma_N(P X), N <= D\n";
  auto row = [&o](const char* key, const std::string& value) {
    o << "  " << std::left << std::setw(20) << key << value << '\n';
  };
  row("sigma_max(J)", number_text(b.sigma_max_J, kDigits) + " (Lanczos on J J^T, residual " +
                          number_text(b.sigma_max_residual, kDigits) + ")");
  row("sigma_N(P X)",
      number_text(b.PX.sigma_min, kDigits) + " (rank " + std::to_string(b.PX.rank) + ")");
  row("bound", number_text(b.bound, kDigits) + (b.applicable ? "" : " (not applicable)"));
  row("ratio", number_text(b.bound / J.kappa, kDigits) + " (bound / kappa(J))");
  row("holds", free_bound_holds(b, J) ? "yes" : "NO (a bug: the bound is proven)");
  if (!b.note.empty()) row("note", b.note);
}

/// Writes `text` to --out atomically, or to stdout.
void emit(const KappaArgs& a, const std::string& text, const std::string& summary) {
  if (a.out.empty()) {
    std::cout << text;
    return;
  }
  io::atomic_write_bytes(a.out, text.data(), text.size());
  if (!a.quiet) std::cout << summary << " written to " << a.out << '\n';
}

void run_matrix(const KappaArgs& a) {
  const Mat<double> M = load_matrix(a.matrix, "M");
  if (M.rows() < 1 || M.cols() < 1)
    throw BadInput(a.matrix + ": M must have at least one row and one column (got " +
                   shape_str(M.rows(), M.cols()) + ")");
  KappaOptions<double> ko;
  ko.rtol = a.rtol;
  const ConditionResult<double> r = a.device == "cuda" ? device_kappa({M}, ko).at(0) : kappa(M, ko);
  if (r.info == Info::NotConverging || std::isnan(r.sigma_max))
    throw NumericalFailure("the SVD of " + a.matrix + " failed: " + r.note);
  std::string text;
  if (a.format == "json") {
    text = json_text(kappa_json("matrix", M.rows(), M.cols(), r));
  } else {
    std::ostringstream o;
    o << "kappa of " << a.matrix << ", " << shape_str(M.rows(), M.cols()) << '\n';
    table_condition(o, r);
    text = o.str();
  }
  emit(a, text,
       "kappa = " + number_text(r.kappa, kDigits) +
           ", kappa_plus = " + number_text(r.kappa_plus, kDigits));
}

void run_attention(const KappaArgs& a) {
  const AttentionFiles in = load_attention_files(a.x, a.wq, a.wk, a.wv);
  const Index N = in.X.rows(), D = in.X.cols(), dk = in.WQ.cols(), dv = in.WV.cols();
  AttentionOptions<double> opts;
  if (a.scale_set) opts.scale = a.scale;
  opts.mask = a.mask == "causal" ? MaskKind::Causal : MaskKind::None;
  require_finite_attention(in.X, in.WQ, in.WK, in.WV, opts,
                           a.x + ", " + a.wq + ", " + a.wk + ", " + a.wv);
  JacobianKappaOptions jo;
  jo.method = parse_jacobian_kappa_method(a.method);
  jo.tol = a.tol;
  jo.rtol = a.rtol;
  if (a.max_iterations_set) jo.matfree.max_iterations = a.max_iterations;
  jo.matfree_coarse = a.coarse;
  Progress bar("kappa(J)", !a.quiet);
  if (bar.enabled()) jo.progress = [&bar](double f) { bar.update(f); };

  std::optional<Theorem34Report> report;
  ConditionResult<double> r;
  std::optional<ConditionResult<double>> on_device;  // --device cuda: κ(J) from the GPU
  if (a.device == "cuda") {
    AttentionOptions<double> dopts = opts;
    dopts.scale = opts.resolved_scale(in.WQ.cols());
    on_device = device_kappa_jacobian(in.X, {in.WQ}, {in.WK}, {in.WV}, dopts, jo).at(0);
  }
  if (a.bound) {
    BoundOptions bo;
    bo.jacobian = jo;
    bo.rtol = a.rtol;
    report = on_device ? theorem34<double>(in.X, in.WQ, in.WK, in.WV, opts, bo, *on_device)
                       : theorem34<double>(in.X, in.WQ, in.WK, in.WV, opts, bo);
    r = report->J;
  } else {
    r = on_device ? *on_device : kappa_jacobian<double>(in.X, in.WQ, in.WK, in.WV, opts, jo);
  }
  if (r.info == Info::InvalidInput) {
    bar.done();
    throw NumericalFailure(a.x + ", " + a.wq + ", " + a.wk + ", " + a.wv + ": kappa(J) declined: " +
                           (r.note.empty() ? std::string("J has NaN or Inf entries (are the "
                                                         "inputs very large?)")
                                           : r.note));
  }
  // The attention diagnostics go with every kappa(J) (MATH.md §11); --bound has them already.
  const AttentionDiagnostics diag =
      report ? report->diagnostics
             : attention_diagnostics(in.X, in.WQ, in.WK, in.WV, opts,
                                     attention_forward(in.X, in.WQ, in.WK, in.WV, opts).P);
  bar.done();

  const Index rows = jacobian_rows(N, dv);
  const Index cols = jacobian_cols(JacobianBlock::All, N, D, dk, dv);
  const double c = opts.resolved_scale(dk);
  std::string text;
  if (a.format == "json") {
    nlohmann::json j = kappa_json("attention", rows, cols, r, report ? &*report : nullptr,
                                  VerifyShape{N, D, dk, dv});
    if (!report) j["attention"] = diagnostics_json(diag);
    j.update({{"N", N},
              {"D", D},
              {"d_k", dk},
              {"d_v", dv},
              {"scale", json_number(c)},
              {"mask", a.mask},
              {"method_requested", a.method},
              {"tol", json_number(a.tol)},
              {"device", a.device}});
    text = json_text(j);
  } else {
    std::ostringstream o;
    o << "kappa of J, " << shape_str(rows, cols) << " (attention: N = " << N << ", D = " << D
      << ", d_k = " << dk << ", d_v = " << dv << ", scale = " << number_text(c, kDigits)
      << ", mask = " << a.mask << ")\n";
    table_condition(o, r);
    table_diagnostics(o, diag);
    if (report) {
      table_bound(o, *report, VerifyShape{N, D, dk, dv});
      table_free_bound(o, report->free_bound, r);
    }
    text = o.str();
  }
  emit(a, text,
       "kappa(J) = " + number_text(r.kappa, kDigits) +
           ", kappa_plus(J) = " + number_text(r.kappa_plus, kDigits));
  if (r.info == Info::NotConverging)
    throw NumericalFailure("kappa(J) did not converge (method " + a.method + "): " + r.note);
  // A declined answer (too large, meaningless, or inputs out of range: κ NaN or without a
  // correct digit) is reported and then exits 3: no NaN and no meaningless κ leaves with exit 0.
  if (r.info == Info::TooLarge || r.info == Info::Inaccurate || r.info == Info::InvalidInput ||
      std::isnan(r.kappa))
    throw NumericalFailure("kappa(J) declined (method " + a.method + ", " + to_string(r.info) +
                           "): " + r.note);
}

}  // namespace

void register_kappa(CLI::App& app) {
  auto args = std::make_shared<KappaArgs>();
  CLI::App* cmd = app.add_subcommand(
      "kappa",
      "Condition numbers of a matrix, or of an attention block's Jacobian J (with the "
      "Theorem 3.4 bound)");
  cmd->add_option("--matrix", args->matrix, "any 2-D matrix M (.npy): kappa, kappa_plus, rank");
  cmd->add_option("--x", args->x, "X, N x D (.npy, float32/float64)");
  cmd->add_option("--wq", args->wq, "W_Q, D x d_k (.npy)");
  cmd->add_option("--wk", args->wk, "W_K, D x d_k (.npy)");
  cmd->add_option("--wv", args->wv, "W_V, D x d_v (.npy)");
  cmd->add_option("--scale", args->scale, "logit scale c > 0 (default 1/sqrt(d_k))");
  cmd->add_option("--mask", args->mask, "mask: none (default) or causal")
      ->check(CLI::IsMember({"none", "causal"}));
  cmd->add_option(
         "--method", args->method,
         "kappa(J) by auto (default), dense, gram, iterative, qr, lobpcg or matfree (docs/cli.md)")
      ->check(CLI::IsMember({"auto", "dense", "gram", "iterative", "qr", "lobpcg", "matfree"}));
  cmd->add_option("--rtol", args->rtol,
                  "rank tolerance relative to sigma_1 (default max(m, n) eps; 0: every nonzero "
                  "sigma counts)");
  cmd->add_option("--tol", args->tol, "requested relative accuracy of sigma_min(J) (default 1e-6)");
  cmd->add_option("--max-iterations", args->max_iterations,
                  "LOBPCG iterations allowed to the matfree method (default 2000; fewer make it "
                  "decline sooner, as when measuring the cost of an iteration)")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 40));
  cmd->add_option("--coarse", args->coarse,
                  "eigenvectors of (PX)(PX)^T in the matfree preconditioner's coarse level "
                  "beyond its null modes, which it also covers where memory allows (default 16; "
                  "0: the channel blocks alone)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{4096}));
  cmd->add_flag("--bound", args->bound, "add every term of Theorem 3.4 (MATH.md §5)");
  cmd->add_option("--format", args->format, "table (default) or json (docs/cli.md)")
      ->check(CLI::IsMember({"table", "json"}));
  cmd->add_option("--out", args->out, "write the report to FILE (atomically) instead of stdout");
  cmd->add_flag("--quiet", args->quiet, "no progress bar, no summary line with --out");
  cmd->add_option("--device", args->device, "cpu (default) or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->callback([args, cmd] {
    args->scale_set = cmd->count("--scale") > 0;
    args->mask_set = cmd->count("--mask") > 0;
    args->method_set = cmd->count("--method") > 0;
    args->tol_set = cmd->count("--tol") > 0;
    args->max_iterations_set = cmd->count("--max-iterations") > 0;
    args->coarse_set = cmd->count("--coarse") > 0;
    check_args(*args);
    if (args->matrix.empty())
      run_attention(*args);
    else
      run_matrix(*args);
  });
}

}  // namespace spectral_cond::cli
