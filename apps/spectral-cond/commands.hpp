// spectral-cond: the subcommands. Each lives in its own cmd_<name>.cpp and adds itself to the
// app in register_<name>(); main.cpp calls every register function.
#pragma once

#include <CLI/CLI.hpp>

#include <spectral_cond/io/layouts/detect.hpp>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace spectral_cond::engine {}
namespace spectral_cond::cli {
using namespace spectral_cond::engine;  // the analyses and reports the subcommands wrap
}  // namespace spectral_cond::cli

namespace spectral_cond::cli {

/// The --layout values: auto and every built-in layout of io::detect_layers.
inline std::vector<std::string> layout_choices() {
  std::vector<std::string> out = {"auto"};
  for (io::Layout l : io::builtin_layouts()) out.push_back(io::to_string(l));
  return out;
}

inline std::string layout_help() {
  return std::string("tensor layout: auto (default), ") + io::kLayoutNames +
         " (docs/checkpoints.md); --map for any other";
}

/// Accepts only decimal digits that fit in an unsigned 64-bit integer: "-1" would otherwise
/// wrap to 2^64 - 1 and "1e3" be cut to 1.
inline CLI::Validator unsigned_integer() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        static const std::string max = "18446744073709551615";
        if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos)
          return "must be a non-negative integer (got '" + s + "')";
        const std::string t = s.substr(std::min(s.find_first_not_of('0'), s.size() - 1));
        if (t.size() > max.size() || (t.size() == max.size() && t > max))
          return "must be at most " + max + " (got " + s + ")";
        return std::string();
      },
      "UINT64");
}

/// The command-line names of an enum's values, in the order the help lists them.
template <typename E>
using EnumNames = std::vector<std::pair<std::string, E>>;

/// Parses an option's value into the enum value `names` gives it, for an option whose variable
/// is that enum: add_option("--method", method)->transform(enum_names(kMethods)). Only the names
/// are accepted (unlike CLI::CheckedTransformer, which also takes the enum's numbers); the help
/// and the error list them as CLI::IsMember does ("--method: x not in {lambda,exact}").
template <typename E>
CLI::Validator enum_names(const EnumNames<E>& names) {
  std::string list;
  for (const auto& kv : names) list += (list.empty() ? "" : ",") + kv.first;
  return CLI::Validator(
      [names, list](std::string& s) -> std::string {
        for (const auto& [name, value] : names)
          if (name == s) {
            s = std::to_string(static_cast<std::underlying_type_t<E>>(value));
            return std::string();
          }
        return s + " not in {" + list + "}";
      },
      "{" + list + "}");
}

/// The command-line name of `value` in `names`.
template <typename E>
std::string enum_name(const EnumNames<E>& names, E value) {
  for (const auto& [name, v] : names)
    if (v == value) return name;
  return std::string();
}

/// A head count: an integer from 1 to 2^20 (the CLI11 PositiveNumber check names a 309-digit
/// range when it fails).
inline CLI::Validator head_count() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        if (s.empty() || s.size() > 7 || s.find_first_not_of("0123456789") != std::string::npos)
          return "must be a positive integer (got '" + s + "')";
        const long v = std::stol(s);
        if (v < 1 || v > (1L << 20)) return "must be between 1 and 1048576 (got " + s + ")";
        return std::string();
      },
      "HEADS");
}

/// Most synthetic tokens (N) the Jacobian analysis accepts: J has N d_v rows and J J^T
/// (N d_v)^2 entries, so far fewer are practical.
inline constexpr long long kMaxTokens = 1 << 16;

/// `spectral-cond jacobian`: J (or one block, or J J^T) of single-head attention to a .npy file.
void register_jacobian(CLI::App& app);
void register_kappa(CLI::App& app);   ///< `kappa`: kappa of a matrix or of J, with Theorem 3.4
void register_verify(CLI::App& app);  ///< `verify`: the paper's statements on random instances
/// How a multi-process driver (apps/spectral-cond-mpi) runs `analyze`: this process's rank among
/// `size`, each computing shard rank/size, and `gather`, which every process calls exactly once
/// with its shard's JSON report (code 0) or its error's message and exit code. It returns the
/// merged report's text on the process that writes it and nothing on the others, and throws
/// Error on every process when any of them failed.
struct AnalyzeDistribution {
  std::uint64_t rank = 0, size = 1;
  std::function<std::optional<std::string>(const std::string& text, int code)> gather;
};

/// `analyze`: kappa of W_Q/W_K/W_V in checkpoints; `dist` when run by spectral-cond-mpi.
void register_analyze(CLI::App& app, const AnalyzeDistribution* dist = nullptr);
/// `merge`: one analyze report from the JSON reports of its shards (merge.hpp).
void register_merge(CLI::App& app);
void register_correct(CLI::App& app);  ///< `correct`: fold a spectral correction into a checkpoint
void register_demo(CLI::App& app);     ///< `demo`: analyse a built-in ViT-Tiny-shaped model
void register_advise(CLI::App& app);   ///< `advise`: which lambda and placement (MATH.md §17)

}  // namespace spectral_cond::cli
