// spectral-cond: the --layers / --jacobian-heads selections. The checkpoint reader itself is the
// library's (spectral_cond/io/checkpoint.hpp).
#pragma once

#include "inputs.hpp"

#include <spectral_cond/io/checkpoint.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace spectral_cond::engine {

using io::CheckpointFormat;
using io::CheckpointReader;

/// The numbers of a --layers or --jacobian-heads value ("0,3,5-7"), kept as ranges: a range
/// is never expanded, so "0-50000000" costs two numbers, and it is checked against what exists
/// before any loop over it (require_within).
class IndexSelection {
 public:
  IndexSelection() = default;

  /// Parses `spec` (empty: everything); `flag` names the option in messages. Throws BadInput.
  static IndexSelection parse(const std::string& spec, const std::string& flag) {
    IndexSelection out;
    out.flag_ = flag;
    if (spec.empty()) return out;
    auto number = [&](const std::string& s) -> std::int64_t {
      if (s.empty() || s.size() > 9 || s.find_first_not_of("0123456789") != std::string::npos)
        throw BadInput(flag + ": '" + spec + "' is not a list like 0,3,5-7");
      return std::stoll(s);
    };
    std::size_t start = 0;
    while (start <= spec.size()) {
      const std::size_t comma = std::min(spec.find(',', start), spec.size());
      const std::string part = spec.substr(start, comma - start);
      const std::size_t dash = part.find('-');
      if (dash == std::string::npos) {
        const std::int64_t a = number(part);
        out.ranges_.push_back({a, a});
      } else {
        const std::int64_t a = number(part.substr(0, dash)), b = number(part.substr(dash + 1));
        if (b < a) throw BadInput(flag + ": range '" + part + "' is decreasing");
        out.ranges_.push_back({a, b});
      }
      start = comma + 1;
    }
    return out;
  }

  bool empty() const { return ranges_.empty(); }
  /// True when `i` is selected (always, for an empty selection).
  bool contains(std::int64_t i) const {
    if (ranges_.empty()) return true;
    for (const auto& r : ranges_)
      if (r.first <= i && i <= r.second) return true;
    return false;
  }
  /// Throws BadInput("<flag>: there is no <what> i ...") unless every selected number is one of
  /// `available` (sorted). Costs O(|available| x ranges), whatever the ranges span.
  void require_within(const std::vector<std::int64_t>& available, const std::string& what,
                      const std::string& where) const {
    std::vector<std::int64_t> avail = available;
    avail.erase(std::unique(avail.begin(), avail.end()), avail.end());
    for (const auto& r : ranges_) {
      const auto lo = std::lower_bound(avail.begin(), avail.end(), r.first);
      const auto hi = std::upper_bound(avail.begin(), avail.end(), r.second);
      const auto have = static_cast<std::uint64_t>(hi - lo);
      if (have == static_cast<std::uint64_t>(r.second - r.first) + 1) continue;
      std::int64_t missing = r.first;  // the first selected number that does not exist
      for (auto it = lo; it != hi && *it == missing; ++it) ++missing;
      throw BadInput(where + ": " + flag_ + ": there is no " + what + " " +
                     std::to_string(missing) + " (there are " + std::to_string(available.size()) +
                     ")");
    }
  }

 private:
  std::string flag_ = "--layers";
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges_;
};

}  // namespace spectral_cond::engine
