// spectral-cond: condition numbers of attention Jacobians from the command line. The tool lives
// in the app library (tool_main.cpp and the cmd_*.cpp subcommands).
#include "tool_main.hpp"

int main(int argc, char** argv) {
  return spectral_cond::cli::tool_main(argc, argv);
}
