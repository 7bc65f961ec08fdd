// spectral-cond: a one-line progress bar on stderr for long computations.
//
//   Progress bar("kappa(J)", !quiet);   // draws only when enabled and stderr is a terminal
//   bar.update(0.42);                     // fraction done, in [0, 1]; redraws at most every 1%
//   bar.done();                           // erases the line (also done by the destructor)
//
// The bar never writes to stdout and never writes when stderr is redirected, so reports and
// JSON stay clean.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>

namespace spectral_cond::cli {

class Progress {
 public:
  /// `label` precedes the bar; nothing is drawn unless `enabled` and isatty(2).
  Progress(std::string label, bool enabled)
      : label_(std::move(label)), enabled_(enabled && ::isatty(2) == 1) {}
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  ~Progress() { done(); }

  bool enabled() const { return enabled_; }

  /// Redraws the bar for `fraction` done (clamped to [0, 1]) when it moved by 1% or more.
  void update(double fraction) {
    if (!enabled_) return;
    const double f = std::clamp(fraction, 0.0, 1.0);
    const int percent = static_cast<int>(f * 100.0);
    if (percent == last_percent_) return;
    last_percent_ = percent;
    constexpr int width = 30;
    const int filled = percent * width / 100;
    std::string bar(static_cast<size_t>(filled), '#');
    bar.append(static_cast<size_t>(width - filled), ' ');
    std::fprintf(stderr, "\r%s [%s] %3d%%", label_.c_str(), bar.c_str(), percent);
    std::fflush(stderr);
    drawn_ = true;
  }

  /// Clears the bar's line; later updates draw it again.
  void done() {
    if (!drawn_) return;
    std::fprintf(stderr, "\r%*s\r", static_cast<int>(label_.size()) + 38, "");
    std::fflush(stderr);
    drawn_ = false;
    last_percent_ = -1;
  }

 private:
  std::string label_;
  bool enabled_;
  bool drawn_ = false;
  int last_percent_ = -1;
};

}  // namespace spectral_cond::cli
