// spectral-cond verify: the randomized verifier of verify_sweep.hpp, printed.
//
//   spectral-cond verify [--seed S] [--instances-per-regime K] [--format table|json]
//                        [--out FILE] [--dump DIR] [--max-listed M] [--quiet]
//
// Exit code 3 only when a proven statement fails (Theorem 3.5, the Weyl bound of Theorem 3.8,
// the Kronecker identity, the concatenation bound): that is a bug. A violation of Theorem 3.4
// is a finding: reported, exit 0. Every would-be violation and every verdict resting on an
// uncertain rank decision is recomputed in extended precision (extended_rechecks.cpp) and
// classified real, artefact (float64 rounding) or unresolved; a proven statement's float64
// failure overturned there is an artefact, not a bug. The JSON keys are documented in
// docs/cli.md.
#include <spectral_cond/engine/extended_rechecks.hpp>
#include <spectral_cond/engine/inputs.hpp>
#include <spectral_cond/engine/number_text.hpp>
#include <spectral_cond/engine/report_json.hpp>
#include "commands.hpp"
#include "progress.hpp"

#include <spectral_cond/engine/verify_sweep.hpp>
#include <spectral_cond/io/atomic_file.hpp>
#include <spectral_cond/io/formats/npy.hpp>

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <functional>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>

namespace spectral_cond::cli {
namespace {

/// 144 regimes of this many instances take about an hour on two cores.
constexpr long long kMaxInstancesPerRegime = 1 << 16;

struct VerifyArgs {
  std::uint64_t seed = VerifyOptions{}.seed;
  Index instances = VerifyOptions{}.instances_per_regime;
  std::string format = "table";
  std::string out, dump;
  Index max_listed = 20;
  bool quiet = false;
};

/// Significant digits of the table's ratios and κ; λ and c are echoed with std::ostream's 6.
constexpr int kVerifyDigits = 4, kOptionDigits = 6;

/// A number in the tables and summaries: kVerifyDigits significant digits, and "-" for NaN (nothing
/// to report, such as the worst ratio of a group without a real ratio).
std::string verify_number(double x) {
  return std::isnan(x) ? "-" : number_text(x, kVerifyDigits);
}

void make_dir(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0777) != 0 && errno != EEXIST)
    throw BadInput(dir + ": cannot create the directory: " + std::strerror(errno));
}

std::string instance_dir(const std::string& dump, const VerifyViolation& v) {
  return dump + "/instance-" + std::to_string(v.seed);
}

/// Writes the inputs of every violating instance under --dump DIR (once per instance):
/// X, W_Q, W_K, W_V as Theorem 3.4 sees them (W + λ I_k), and the raw weights.
void dump_instances(const std::string& dump, const VerifyReport& rep) {
  make_dir(dump);
  std::set<std::uint64_t> done;
  for (const VerifyViolation& v : rep.violations) {
    if (!done.insert(v.seed).second) continue;
    const VerifyInstance in = make_verify_instance(v.regime, v.shape, v.seed);
    const std::string d = instance_dir(dump, v);
    make_dir(d);
    io::write_npy(d + "/X.npy", in.X);
    io::write_npy(d + "/WQ.npy", in.corrected(in.W_Q));
    io::write_npy(d + "/WK.npy", in.corrected(in.W_K));
    io::write_npy(d + "/WV.npy", in.corrected(in.W_V));
    io::write_npy(d + "/WQ_raw.npy", in.W_Q);
    io::write_npy(d + "/WK_raw.npy", in.W_K);
    io::write_npy(d + "/WV_raw.npy", in.W_V);
  }
}

/// How to reproduce a violation: a `kappa --bound` command when its inputs were dumped.
std::string hint(const VerifyArgs& a, const VerifyViolation& v) {
  std::ostringstream s;
  if (a.dump.empty()) {
    s << "rebuild with make_verify_instance(regime, {" << v.shape.N << ", " << v.shape.D << ", "
      << v.shape.d_k << ", " << v.shape.d_v << "}, " << v.seed
      << "), or rerun with --dump DIR for a spectral-cond kappa command";
    return s.str();
  }
  const std::string d = instance_dir(a.dump, v);
  s << "spectral-cond kappa --x " << d << "/X.npy --wq " << d << "/WQ.npy --wk " << d
    << "/WK.npy --wv " << d << "/WV.npy --scale " << number_text(v.c, 17) << " --mask "
    << to_string(v.regime.mask) << " --method dense --bound";
  return s.str();
}

/// A regime's dimensions, as the first columns of the tables.
void regime_columns(std::ostream& o, const VerifyRegime& r) {
  o << std::left << std::setw(6) << to_string(r.shape) << std::setw(13) << to_string(r.c)
    << std::setw(11) << to_string(r.weights) << std::setw(8) << to_string(r.mask) << std::setw(7)
    << number_text(r.lambda, kOptionDigits) << std::right;
}

void regime_header(std::ostream& o) {
  o << std::left << std::setw(6) << "shape" << std::setw(13) << "c" << std::setw(11) << "W scale"
    << std::setw(8) << "mask" << std::setw(7) << "lambda" << std::right << std::setw(4) << "n";
}

/// Theorem 3.4 per regime: the float64 counts, then after the extended-precision re-checks.
std::string regimes_table(const VerifyReport& rep) {
  std::ostringstream o;
  o << "Theorem 3.4 (MATH.md §5) on W + lambda I_k. k: plain kappa (the bound is +inf since "
       "kappa(Lambda) = +inf: vacuous).\nk+: kappa_plus throughout, in float64; held / violated "
       "/ '?' = inconclusive (the two sides agree within the\nrounding error of the kappa_plus "
       "values they are built from). ratio = bound_plus / kappa_plus(J) over conclusive\n"
       "instances (worst = smallest; below 1 is a violation). Every float64 violation and every "
       "instance with an\nuncertain rank decision is recomputed in extended precision: real = "
       "violated there too, art = float64\nartefact (held there), unres = unresolved there; "
       "worst real = smallest exact ratio. k(J)=inf: J singular.\nbugs: failed proven checks.\n\n";
  regime_header(o);
  o << std::setw(9) << "k: held" << std::setw(10) << "k+: held" << std::setw(9) << "k+: NO"
    << std::setw(8) << "k+: ?" << std::setw(12) << "worst k+" << std::setw(12) << "max k+"
    << std::setw(6) << "real" << std::setw(5) << "art" << std::setw(7) << "unres" << std::setw(12)
    << "worst real" << std::setw(10) << "k(J)=inf" << std::setw(6) << "bugs" << '\n';
  for (const RegimeStats& s : rep.regimes) {
    regime_columns(o, s.regime);
    o << std::setw(4) << s.instances << std::setw(9) << s.held << std::setw(10) << s.held_plus
      << std::setw(9) << s.violated_plus << std::setw(8) << s.inconclusive_plus << std::setw(12)
      << verify_number(s.worst_ratio_plus) << std::setw(12) << verify_number(s.max_ratio_plus)
      << std::setw(6) << s.final_violated + s.final_unchecked << std::setw(5) << s.artefacts
      << std::setw(7) << s.final_unresolved << std::setw(12) << verify_number(s.worst_real_ratio)
      << std::setw(10) << s.kappa_J_infinite << std::setw(6) << s.proven_failures << '\n';
  }
  return o.str();
}

/// Theorem 3.4 with kappa_plus after the re-checks over the whole sweep, then by each value of
/// each regime dimension (held/violated/inconclusive/unresolved, artefacts, worst real ratio).
std::string totals(const VerifyReport& rep) {
  std::ostringstream o;
  const RegimeStats t = combined(rep.regimes);
  o << "\nTheorem 3.4 with kappa_plus after the extended-precision re-checks: " << t.final_held
    << " held, " << t.final_violated << " violated (real), " << t.final_inconclusive
    << " inconclusive, " << t.final_unresolved << " unresolved";
  if (t.final_unchecked > 0) o << ", " << t.final_unchecked << " float64 violations unchecked";
  o << "; " << t.artefacts << " float64 violations were artefacts; " << t.rechecked
    << " instances re-checked (" << t.rank_uncertain << " with an uncertain rank decision, "
    << t.missed << " violations float64 missed); worst real ratio "
    << verify_number(t.worst_real_ratio) << "\n";
  o << "\nThe same, held/violated/inconclusive/unresolved (artefacts, worst real ratio), by:\n";
  using Key = std::function<std::string(const VerifyRegime&)>;
  const std::pair<const char*, Key> dimensions[] = {
      {"shape class", [](const VerifyRegime& r) { return to_string(r.shape); }},
      {"c", [](const VerifyRegime& r) { return to_string(r.c); }},
      {"weight scale", [](const VerifyRegime& r) { return to_string(r.weights); }},
      {"mask", [](const VerifyRegime& r) { return to_string(r.mask); }},
      {"lambda", [](const VerifyRegime& r) { return number_text(r.lambda, kOptionDigits); }}};
  for (const auto& dimension : dimensions) {
    const Key& key = dimension.second;  // a named reference: lambdas cannot capture a binding
    o << "  " << std::left << std::setw(14) << dimension.first;
    std::vector<std::string> values;  // in the order of the regimes
    for (const RegimeStats& s : rep.regimes)
      if (std::find(values.begin(), values.end(), key(s.regime)) == values.end())
        values.push_back(key(s.regime));
    for (const std::string& v : values) {
      const RegimeStats g =
          combined(rep.regimes, [&](const VerifyRegime& r) { return key(r) == v; });
      o << "  " << v << ": " << g.final_held << "/" << g.final_violated + g.final_unchecked << "/"
        << g.final_inconclusive << "/" << g.final_unresolved << " (artefacts " << g.artefacts
        << ", worst " << verify_number(g.worst_real_ratio) << ")";
    }
    o << '\n';
  }
  return o.str();
}

/// The proven statements' counts.
std::string proven_table(const VerifyReport& rep) {
  std::ostringstream o;
  o << "\nProven statements (a violation is a bug: exit 3)\n";
  o << "  " << std::left << std::setw(44) << "statement" << std::right << std::setw(8) << "held"
    << std::setw(10) << "violated" << std::setw(16) << "not applicable" << std::setw(11)
    << "rechecked" << std::setw(11) << "artefacts" << '\n';
  const std::pair<const char*, const CheckCounts*> rows[] = {
      {"Theorem 3.5: kappa(W + C) = 2 s1/(s1 + sr)", &rep.theorem35},
      {"Theorem 3.5, target t: kappa(W + C) = t", &rep.theorem35_target},
      {"Theorem 3.8 (Weyl): <= (lambda+s)/(lambda-s)", &rep.weyl},
      {"kappa(A (x) B) = kappa(A) kappa(B)", &rep.kronecker},
      {"kappa([A_1|...|A_m]) <= sum kappa(A_i)", &rep.concatenation},
      {"the same on J = [J_Q | J_K | J_V]", &rep.concatenation_J},
      {"kappa(J) <= sigma_max(J)/sigma_N(P X), N<=D", &rep.bound_free}};
  for (const auto& [name, c] : rows)
    o << "  " << std::left << std::setw(44) << name << std::right << std::setw(8) << c->held
      << std::setw(10) << c->violated << std::setw(16) << c->not_applicable << std::setw(11)
      << c->rechecked << std::setw(11) << c->artefacts << '\n';
  return o.str();
}

/// κ(J) before and after W + λ I_k per regime with λ > 0: medians, how many instances it lowered
/// and how many collapsed to the identity (MATH.md §11).
std::string lambda_effect_table(const VerifyReport& rep) {
  std::ostringstream o;
  o << "\nkappa(J) before (W) and after (W + lambda I_k), by dense SVD: medians over the regime's "
       "instances; lowered: after < before;\ncollapsed: every row of P one-hot on the diagonal "
       "after the correction (then kappa(J) = kappa(X) for N <= D).\n";
  regime_header(o);
  o << std::setw(14) << "med k(J) W" << std::setw(14) << "med k(J) W+lI" << std::setw(9)
    << "lowered" << std::setw(11) << "collapsed" << '\n';
  for (const RegimeStats& s : rep.regimes) {
    if (s.regime.lambda == 0) continue;
    regime_columns(o, s.regime);
    o << std::setw(4) << s.instances << std::setw(14) << verify_number(s.median_kappa_J_before)
      << std::setw(14) << verify_number(s.median_kappa_J_after) << std::setw(9) << s.lowered
      << std::setw(11) << s.collapsed << '\n';
  }
  const RegimeStats t = combined(rep.regimes, [](const VerifyRegime& r) { return r.lambda != 0; });
  o << "  all lambda > 0: " << t.instances << " instances, kappa(J) lowered in " << t.lowered
    << ", collapsed in " << t.collapsed << '\n';
  return o.str();
}

/// The violations, at most --max-listed per statement, each with how to reproduce it.
std::string violations_list(const VerifyArgs& a, const VerifyReport& rep) {
  std::ostringstream o;
  o << "\nViolations: " << rep.violations.size();
  if (rep.violations.empty())
    o << '\n';
  else
    o << " (each reproducible from its seed and sizes)\n";
  std::map<std::string, Index> listed;
  for (const VerifyViolation& v : rep.violations) {
    if (++listed[v.statement] > a.max_listed) continue;
    o << "  [" << v.statement << (v.proven ? ", BUG" : ", finding") << ", " << v.classification
      << "] seed " << v.seed << ", N = " << v.shape.N << ", D = " << v.shape.D
      << ", d_k = " << v.shape.d_k << ", d_v = " << v.shape.d_v
      << ", c = " << number_text(v.c, kOptionDigits) << ", W scale " << to_string(v.regime.weights)
      << ", mask " << to_string(v.regime.mask) << ", lambda "
      << number_text(v.regime.lambda, kOptionDigits) << (v.matrix.empty() ? "" : ", " + v.matrix)
      << ": " << v.detail << '\n';
    if (!v.extended_detail.empty()) o << "      " << v.extended_detail << '\n';
    o << "      " << hint(a, v) << '\n';
  }
  for (const auto& [statement, count] : listed)
    if (count > a.max_listed)
      o << "  ... and " << count - a.max_listed << " more " << statement
        << " (--max-listed, or --format json for all)\n";
  return o.str();
}

std::string table(const VerifyArgs& a, const VerifyReport& rep) {
  std::ostringstream o;
  o << "spectral-cond verify: seed " << rep.seed << ", " << rep.instances_per_regime
    << " instances per regime, " << rep.regimes.size() << " regimes, " << rep.instances
    << " instances; kappa(J) by dense SVD\n\n";
  return o.str() + regimes_table(rep) + totals(rep) + proven_table(rep) + lambda_effect_table(rep) +
         violations_list(a, rep);
}

void run_verify(const VerifyArgs& a) {
  if (a.instances < 1)
    throw BadInput("--instances-per-regime must be >= 1 (got " + std::to_string(a.instances) + ")");
  if (a.max_listed < 0) throw BadInput("--max-listed must be >= 0");
  if (!a.out.empty()) io::check_output_target(a.out);
  if (!a.dump.empty()) {
    struct stat st {};
    if (::lstat(a.dump.c_str(), &st) == 0 && !S_ISDIR(st.st_mode))
      throw BadInput(a.dump + ": --dump needs a directory, and this is " +
                     io::file_kind(st.st_mode) + " (nothing is written over it)");
    // Checked before the sweep, not after it: the directory (made now if absent, in a parent
    // that exists) must take new files.
    const std::string where =
        ::lstat(a.dump.c_str(), &st) == 0 ? a.dump : io::parent_directory(a.dump);
    if (::access(where.empty() ? "." : where.c_str(), W_OK | X_OK) != 0)
      throw BadInput(a.dump + ": --dump: cannot write in " + (where.empty() ? "." : where) + ": " +
                     std::strerror(errno) + " (checked before the sweep)");
  }
  VerifyOptions o;
  o.seed = a.seed;
  o.instances_per_regime = a.instances;
  o.rechecks = extended_rechecks();
  Progress bar("verify", !a.quiet);
  if (bar.enabled()) o.progress = [&bar](double f) { bar.update(f); };
  const VerifyReport rep = verify_sweep(o);
  bar.done();
  if (!a.dump.empty()) dump_instances(a.dump, rep);

  std::string text;
  if (a.format == "json") {
    nlohmann::json j = verify_json(rep);
    for (size_t i = 0; i < rep.violations.size(); ++i)
      j["violations"][i]["hint"] = hint(a, rep.violations[i]);
    text = json_text(j);
  } else {
    text = table(a, rep);
  }
  if (a.out.empty()) {
    std::cout << text << std::flush;
  } else {
    io::atomic_write_bytes(a.out, text.data(), text.size());
    if (!a.quiet)
      std::cout << "verify: " << rep.instances << " instances, " << rep.violations.size()
                << " violations, report written to " << a.out << '\n';
  }
  if (!rep.proven_ok()) {
    Index bugs = 0;
    for (const VerifyViolation& v : rep.violations) bugs += v.proven ? 1 : 0;
    throw NumericalFailure("verify: " + std::to_string(bugs) +
                           " check(s) of proven statements failed: a bug (see the violations)");
  }
}

}  // namespace

void register_verify(CLI::App& app) {
  auto args = std::make_shared<VerifyArgs>();
  CLI::App* cmd = app.add_subcommand(
      "verify",
      "Check the paper's statements on random instances (Theorem 3.4 is reported, "
      "proven statements must hold)");
  cmd->add_option("--seed", args->seed,
                  "the sweep's seed (default " + std::to_string(VerifyOptions{}.seed) + ")")
      ->check(unsigned_integer());
  cmd->add_option("--instances-per-regime", args->instances,
                  "random instances per regime (default " +
                      std::to_string(VerifyOptions{}.instances_per_regime) + ", at most " +
                      std::to_string(kMaxInstancesPerRegime) + ")")
      ->check(CLI::Range(1LL, kMaxInstancesPerRegime));
  cmd->add_option("--format", args->format, "table (default) or json (docs/cli.md)")
      ->check(CLI::IsMember({"table", "json"}));
  cmd->add_option("--out", args->out, "write the report to FILE (atomically) instead of stdout");
  cmd->add_option("--dump", args->dump,
                  "write each violating instance's X, W_Q, W_K, W_V (.npy) under DIR");
  cmd->add_option("--max-listed", args->max_listed,
                  "violations listed per statement in the table (default 20)");
  cmd->add_flag("--quiet", args->quiet, "no progress bar, no summary line with --out");
  cmd->callback([args] { run_verify(*args); });
}

}  // namespace spectral_cond::cli
