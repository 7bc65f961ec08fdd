// spectral-cond: how the CSV reports (analyze's, advise's) write a number and a text field.
#pragma once

#include "number_text.hpp"

#include <cmath>
#include <string>

namespace spectral_cond::engine {

/// A CSV number: round-trip digits, and an empty field for NaN (docs/checkpoints.md).
inline std::string csv_number(double x) {
  return std::isnan(x) ? "" : number_text(x, 17);
}

/// A CSV text field, quoted (with quotes doubled) when it holds a comma, a quote or a newline.
inline std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

}  // namespace spectral_cond::engine
