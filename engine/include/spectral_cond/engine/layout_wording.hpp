// spectral-cond: the tool's wording of the library's layout errors (io::LayoutError). The library
// names no flag; the tool says which of its flags to use: --layout, --map, --heads and
// --kv-heads. run.hpp's exit_status prints these (exit 2, bad input).
#pragma once

#include <spectral_cond/io/error.hpp>
#include <spectral_cond/io/layouts/types.hpp>

#include <cstddef>
#include <string>

namespace spectral_cond::engine {

/// The tool's one-line message for `e`: the library's error in terms of the tool's flags.
inline std::string layout_message(const io::LayoutError& e) {
  const std::string at = e.file.empty() ? std::string() : e.file + ": ";
  auto name = [&](std::size_t i) { return i < e.names.size() ? e.names[i] : std::string(); };
  switch (e.problem) {
    case io::LayoutProblem::UnknownLayout:
      return "--layout: unknown layout " + io::quote(e.value) + " (expected auto, " +
             io::kLayoutNames + "; or --map for any other)";
    case io::LayoutProblem::MapSyntax:
      return at + "--map: " + e.reason;
    case io::LayoutProblem::MapWithLayout:
      return at + "--map replaces the built-in layouts; drop --layout " + e.value;
    case io::LayoutProblem::MapDuplicate:
      if (e.value == "qkv")
        return at + "--map qkv: two tensors for layer " + io::quote(name(0)) +
               " (use a capture group for the layer number)";
      return at + "--map " + e.value + " matches two tensors for layer " + io::quote(name(0)) +
             " (" + name(1) + ", " + name(2) + "); use a capture group for the layer number";
    case io::LayoutProblem::MapIncomplete:
      return at + "--map: " + e.reason;
    case io::LayoutProblem::MapMatchedNothing:
      return at + "--map matched no tensor (the expressions must match whole names)";
    case io::LayoutProblem::SeveralLayouts:
      return at + "tensor names match several layouts (" + name(0) + ", " + name(1) +
             "); choose one with --layout";
    case io::LayoutProblem::NoLayers:
      return at + e.reason +
             (e.names.empty() ? ""
                              : "; name them with --map q=REGEX,k=REGEX,v=REGEX (or qkv=REGEX)");
    case io::LayoutProblem::HeadsUnknown:
      return at +
             "the number of heads is unknown; pass --heads (and --kv-heads for grouped-query "
             "models) or put a config.json beside the checkpoint";
  }
  return e.what();
}

}  // namespace spectral_cond::engine
