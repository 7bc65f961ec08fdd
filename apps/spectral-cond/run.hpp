// spectral-cond: the exit code and the one-line message of every exception a subcommand throws
// (cli.hpp lists the codes), shared by spectral-cond and spectral-cond-mpi.
#pragma once

#include <spectral_cond/engine/inputs.hpp>
#include <spectral_cond/engine/layout_wording.hpp>

#include <spectral_cond/io/error.hpp>

#include <CLI/CLI.hpp>

#include <exception>
#include <iostream>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

namespace spectral_cond::cli {
using namespace spectral_cond::engine;  // the analyses and reports the subcommands wrap
}  // namespace spectral_cond::cli

namespace spectral_cond::cli {

/// The exit code of `e` (a pending exception) and its message, cut to its first line.
inline std::pair<int, std::string> exit_status(const std::exception_ptr& e) {
  auto first_line = [](const std::string& msg) { return msg.substr(0, msg.find('\n')); };
  try {
    std::rethrow_exception(e);
  } catch (const Error& x) {
    return {x.code(), first_line(x.what())};
  } catch (const io::LayoutError& x) {  // worded with the tool's flags
    return {kBadInput, first_line(layout_message(x))};
  } catch (const io::IoError& x) {
    return {kBadInput, first_line(x.what())};
  } catch (const std::invalid_argument& x) {  // the library's argument checks
    return {kBadInput, first_line(x.what())};
  } catch (const std::bad_alloc&) {
    return {kInternalError, "out of memory"};
  } catch (const std::exception& x) {
    return {kInternalError, "internal error: " + first_line(x.what())};
  } catch (...) {
    return {kInternalError, "internal error: unknown exception"};
  }
}

/// Parses argv into `app` and runs its subcommand; returns the exit code. Errors are printed as
/// "<tool>: error: <message>" on stderr unless `print_errors` is false (the other ranks of
/// spectral-cond-mpi, which leave that to rank 0).
inline int run_app(CLI::App& app, int argc, char** argv, const std::string& tool,
                   bool print_errors = true) {
  auto report = [&](int code, const std::string& msg) {
    if (print_errors && !msg.empty())
      std::cerr << tool << ": error: " << msg.substr(0, msg.find('\n')) << '\n';
    return code;
  };
  // A first word that names no subcommand is named in the error (CLI11 would say only that a
  // subcommand is required, or that the word was not expected).
  const auto subs = app.get_subcommands([](CLI::App*) { return true; });
  if (argc > 1 && argv[1][0] != '-' && !subs.empty()) {
    const std::string first = argv[1];
    std::string names;
    bool known = false;
    for (const CLI::App* sub : subs) {
      known = known || sub->check_name(first);
      names += (names.empty() ? "" : ", ") + sub->get_name();
    }
    if (!known)
      return report(kBadInput, "unknown subcommand '" + first + "': expected one of " + names +
                                   " (see " + tool + " --help)");
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return print_errors ? app.exit(e) : 0;  // --help, --version
    return report(kBadInput, std::string(e.what()) + " (see " + tool + " --help)");
  } catch (...) {
    const auto [code, msg] = exit_status(std::current_exception());
    return report(code, msg);
  }
  return kSuccess;
}

}  // namespace spectral_cond::cli
