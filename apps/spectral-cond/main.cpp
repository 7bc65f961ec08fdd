// spectral-cond: condition numbers of attention Jacobians from the command line.
//
// Dispatches to the subcommands (commands.hpp) and maps every exception to an exit code and one
// line on stderr (cli.hpp).
#include "cli.hpp"
#include "commands.hpp"

#include <spectral_cond/io/files.hpp>

#include <CLI/CLI.hpp>

#include <exception>
#include <iostream>
#include <new>
#include <stdexcept>
#include <string>

namespace {

/// The first line of `msg`, so that every error stays on one line.
std::string one_line(const std::string& msg) {
  const auto nl = msg.find('\n');
  return nl == std::string::npos ? msg : msg.substr(0, nl);
}

int report(int code, const std::string& msg) {
  std::cerr << "spectral-cond: error: " << one_line(msg) << '\n';
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace spectral_cond;
  io::install_signal_cleanup();  // SIGINT / SIGTERM never leave a temporary file behind
  io::protect_inputs();          // no output replaces a file this run has read
  CLI::App app{"Condition numbers of attention Jacobians (MATH.md).", "spectral-cond"};
  app.set_version_flag("--version", std::string("spectral-cond ") + SPECTRAL_COND_VERSION);
  app.require_subcommand(1);
  cli::register_jacobian(app);
  cli::register_kappa(app);
  cli::register_verify(app);
  cli::register_analyze(app);
  cli::register_correct(app);
  cli::register_demo(app);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    return report(cli::kBadInput, std::string(e.what()) + " (see spectral-cond --help)");
  } catch (const cli::Error& e) {
    return report(e.code(), e.what());
  } catch (const io::IoError& e) {
    return report(cli::kBadInput, e.what());
  } catch (const std::invalid_argument& e) {  // the library's argument checks
    return report(cli::kBadInput, e.what());
  } catch (const std::bad_alloc&) {
    return report(cli::kInternalError, "out of memory");
  } catch (const std::exception& e) {
    return report(cli::kInternalError, std::string("internal error: ") + e.what());
  }
  return cli::kSuccess;
}
