// spectral_cond::io: the exception type of the checkpoint readers and writers, IoError, and the
// structured LayoutError of layout detection, whose fields let a front end word the error in its
// own terms (its flags, its parameters) while the library's message names none.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace spectral_cond {
namespace io {

/// A file could not be read or written, or its contents are malformed. The message is one line
/// and starts with the file's name (and names the tensor or member, where one is concerned).
struct IoError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// `s` in single quotes, for messages: control and non-ASCII bytes, the quote and the backslash
/// become \xNN, and a text longer than `max_len` bytes is cut there and ends in "...", so that a
/// message stays one printable line whatever a file contains ("'a\x0ab'" for "a\nb").
inline std::string quote(const std::string& s, std::size_t max_len = 200) {
  std::string out = "'";
  static const char* hex = "0123456789abcdef";
  for (std::size_t i = 0; i < s.size() && i < max_len; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c >= 0x7F || c == '\'' || c == '\\') {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  if (s.size() > max_len) out += "...";
  return out + "'";
}

namespace detail {
using io::quote;  // the readers' name for it
}  // namespace detail

/// What a LayoutError is about, and which of its fields say more (MATH.md §8).
enum class LayoutProblem {
  UnknownLayout,      ///< parse_layout: `value` names no layout; `names` lists the accepted ones
  MapSyntax,          ///< parse_layer_map: the map text `value` is malformed, `reason` says how
  MapWithLayout,      ///< detect_layers: a layer map together with the built-in layout `value`
  MapDuplicate,       ///< the map's expression `value` (q, k, v or qkv) matches two tensors of one
                      ///< layer; `names`: the layer's id, then the two tensors
  MapIncomplete,      ///< a layer the map found lacks the projection `value` (q, k or v);
                      ///< `names`: the layer's id, the tensor it has, that tensor's key;
                      ///< `reason`: "layer 'id' has ... but no v tensor matches"
  MapMatchedNothing,  ///< the layer map matched no tensor of `file`
  SeveralLayouts,     ///< the tensor names match several built-in layouts, `names` (two or more)
  NoLayers,           ///< no attention layers in `file` for the layout `value` ("auto": any);
                      ///< `reason`: what was looked for and what looks like attention; `names`:
                      ///< up to three tensors that look like attention
  HeadsUnknown,       ///< resolve_heads: no head count was given and `file` has no config
};

inline const char* to_string(LayoutProblem p) {
  switch (p) {
    case LayoutProblem::UnknownLayout:
      return "unknown_layout";
    case LayoutProblem::MapSyntax:
      return "map_syntax";
    case LayoutProblem::MapWithLayout:
      return "map_with_layout";
    case LayoutProblem::MapDuplicate:
      return "map_duplicate";
    case LayoutProblem::MapIncomplete:
      return "map_incomplete";
    case LayoutProblem::MapMatchedNothing:
      return "map_matched_nothing";
    case LayoutProblem::SeveralLayouts:
      return "several_layouts";
    case LayoutProblem::NoLayers:
      return "no_layers";
    case LayoutProblem::HeadsUnknown:
      return "heads_unknown";
  }
  return "unknown";
}

/// Where W_Q, W_K and W_V are could not be decided (io/layouts/detect.hpp, layer_map.hpp,
/// heads.hpp). A structured IoError: `problem` says what went wrong, the other fields what it
/// concerns (see LayoutProblem for which are set), so that a front end can word it in its own
/// terms. what() is the library's own one-line message, which names no command-line flag or
/// parameter: "layer map" for a user's own layout, "layout <name>" for a built-in one.
struct LayoutError : IoError {
  LayoutProblem problem;
  std::string file;                ///< the checkpoint concerned; empty when none is
  std::string reason;              ///< what is wrong, where the problem needs saying
  std::string value;               ///< the value concerned: a layout's name, a map or its key
  std::vector<std::string> names;  ///< layouts, layers or tensors concerned

  LayoutError(LayoutProblem p, std::string file_, std::string reason_, std::string value_ = {},
              std::vector<std::string> names_ = {})
      : IoError(message(p, file_, reason_, value_, names_)),
        problem(p),
        file(std::move(file_)),
        reason(std::move(reason_)),
        value(std::move(value_)),
        names(std::move(names_)) {}

  /// The library's message for these fields (what()).
  static std::string message(LayoutProblem p, const std::string& file, const std::string& reason,
                             const std::string& value, const std::vector<std::string>& names) {
    const std::string at = file.empty() ? std::string() : file + ": ";
    auto name = [&](std::size_t i) { return i < names.size() ? names[i] : std::string(); };
    switch (p) {
      case LayoutProblem::UnknownLayout: {
        std::string list;
        for (std::size_t i = 0; i < names.size(); ++i)
          list += (i == 0 ? "" : i + 1 == names.size() ? " and " : ", ") + names[i];
        return "unknown layout " + quote(value) + " (expected " + list +
               "; or a layer map for any other)";
      }
      case LayoutProblem::MapSyntax:
        return at + "layer map: " + reason;
      case LayoutProblem::MapWithLayout:
        return at +
               "a layer map replaces the built-in layouts; it cannot be combined with layout " +
               value;
      case LayoutProblem::MapDuplicate:
        return at + "layer map: " + value + " matches two tensors for layer " + quote(name(0)) +
               " (" + name(1) + ", " + name(2) + "); use a capture group for the layer number";
      case LayoutProblem::MapIncomplete:
        return at + "layer map: " + reason;
      case LayoutProblem::MapMatchedNothing:
        return at + "the layer map matched no tensor (the expressions must match whole names)";
      case LayoutProblem::SeveralLayouts:
        return at + "tensor names match several layouts (" + name(0) + ", " + name(1) +
               "); choose one";
      case LayoutProblem::NoLayers:
        return at + reason +
               (names.empty() ? ""
                              : "; name them with a layer map q=REGEX,k=REGEX,v=REGEX (or "
                                "qkv=REGEX)");
      case LayoutProblem::HeadsUnknown:
        return at +
               "the number of heads is unknown; give it (and the key/value heads of "
               "grouped-query models) or put a config.json beside the checkpoint";
    }
    return at + reason;
  }
};
}  // namespace io
}  // namespace spectral_cond
