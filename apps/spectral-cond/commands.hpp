// spectral-cond: the subcommands. Each lives in its own cmd_<name>.cpp and adds itself to the
// app in register_<name>(); main.cpp calls every register function.
#pragma once

#include <CLI/CLI.hpp>

namespace spectral_cond::cli {

/// `spectral-cond jacobian`: J (or one block, or J J^T) of single-head attention to a .npy file.
void register_jacobian(CLI::App& app);
void register_kappa(CLI::App& app);    ///< `kappa`: kappa of a matrix or of J, with Theorem 3.4
void register_verify(CLI::App& app);   ///< `verify`: the paper's statements on random instances
void register_analyze(CLI::App& app);  ///< `analyze`: kappa of W_Q/W_K/W_V in checkpoints
void register_correct(CLI::App& app);  ///< `correct`: fold a spectral correction into a checkpoint
void register_demo(CLI::App& app);     ///< `demo`: analyse a built-in ViT-Tiny-shaped model

}  // namespace spectral_cond::cli
