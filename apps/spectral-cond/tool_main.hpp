// spectral-cond: the whole command-line tool as one function of the app library, so that the
// executable's main.cpp includes nothing heavy (CLI11 is compiled once, with the subcommands).
#pragma once

namespace spectral_cond::cli {

/// Registers every subcommand, parses argv and runs the one named; returns the exit code
/// (cli.hpp lists them).
int tool_main(int argc, char** argv);

}  // namespace spectral_cond::cli
