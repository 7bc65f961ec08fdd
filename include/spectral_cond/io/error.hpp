// spectral_cond::io: the one exception type of the checkpoint readers and writers.
#pragma once

#include <stdexcept>
#include <string>

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
}  // namespace io
}  // namespace spectral_cond
