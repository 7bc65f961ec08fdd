// spectral-cond: condition numbers of attention Jacobians from the command line.
//
// Dispatches to the subcommands (commands.hpp) and maps every exception to an exit code and one
// line on stderr (run.hpp).
#include "blas_threads.hpp"
#include "commands.hpp"
#include "run.hpp"

#include <spectral_cond/io/files.hpp>

#include <CLI/CLI.hpp>

#include <string>

int main(int argc, char** argv) {
  using namespace spectral_cond;
  io::install_signal_cleanup();   // SIGINT / SIGTERM never leave a temporary file behind
  io::protect_inputs();           // no output replaces a file this run has read
  cli::pin_blas_to_one_thread();  // the same report on any machine (blas_threads.hpp)
  CLI::App app{"Condition numbers of attention Jacobians (MATH.md).", "spectral-cond"};
  app.set_version_flag("--version", std::string("spectral-cond ") + SPECTRAL_COND_VERSION);
  app.require_subcommand(1);
  cli::register_jacobian(app);
  cli::register_kappa(app);
  cli::register_verify(app);
  cli::register_analyze(app);
  cli::register_merge(app);
  cli::register_correct(app);
  cli::register_demo(app);
  return cli::run_app(app, argc, argv, "spectral-cond");
}
