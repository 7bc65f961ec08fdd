// spectral-cond: the one way the tool writes a number as text (tables, CSV, messages). JSON
// numbers are written by json_number (report_json.hpp).
#pragma once

#include <cmath>
#include <iomanip>
#include <sstream>
#include <string>

namespace spectral_cond::engine {

/// `x` with `digits` significant digits, as std::ostream writes it ("0.5", "1.234e+05"), and
/// "inf", "-inf" and "nan" for the values that have no digits (the spelling of the JSON
/// reports). Tables use 4 digits, `kappa`'s 10, CSV 17 (round trip); 6 is std::ostream's
/// default, for options such as λ echoed back.
inline std::string number_text(double x, int digits) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  std::ostringstream s;
  s << std::setprecision(digits) << x;
  return s.str();
}

}  // namespace spectral_cond::engine
