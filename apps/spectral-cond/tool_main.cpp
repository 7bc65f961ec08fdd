// spectral-cond: dispatches to the subcommands (commands.hpp) and maps every exception to an exit
// code and one line on stderr (run.hpp).
#include "tool_main.hpp"

#include <spectral_cond/engine/blas_threads.hpp>
#include "commands.hpp"
#include "run.hpp"

#include <spectral_cond/io/files.hpp>

#include <CLI/CLI.hpp>

#include <string>

namespace spectral_cond::cli {

int tool_main(int argc, char** argv) {
  io::install_signal_cleanup();  // SIGINT / SIGTERM never leave a temporary file behind
  io::protect_inputs();          // no output replaces a file this run has read
  pin_blas_to_one_thread();      // the same report on any machine (blas_threads.hpp)
  CLI::App app{"Condition numbers of attention Jacobians (MATH.md).", "spectral-cond"};
  app.set_version_flag("--version", std::string("spectral-cond ") + SPECTRAL_COND_VERSION);
  app.require_subcommand(1);
  register_jacobian(app);
  register_kappa(app);
  register_verify(app);
  register_analyze(app);
  register_merge(app);
  register_correct(app);
  register_demo(app);
  register_advise(app);
  return run_app(app, argc, argv, "spectral-cond");
}

}  // namespace spectral_cond::cli
