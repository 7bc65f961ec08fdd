// Shared helpers for the benchmarks: a reporter that keeps every run's time so that a program
// can print the ratios it is judged by, measured in the same run (timings on a shared machine
// are noisy; ratios within one run are what we compare).
#pragma once

#include <benchmark/benchmark.h>

#include <chrono>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace sc_bench {

class CollectingReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs)
      if (r.run_type == Run::RT_Iteration && !r.error_occurred)
        seconds_[r.benchmark_name()] =
            r.GetAdjustedRealTime() / benchmark::GetTimeUnitMultiplier(r.time_unit);
    ConsoleReporter::ReportRuns(runs);
  }
  /// Seconds per iteration of the benchmark with this exact name, or -1 if it did not run.
  double seconds(const std::string& name) const {
    auto it = seconds_.find(name);
    return it == seconds_.end() ? -1.0 : it->second;
  }

 private:
  std::map<std::string, double> seconds_;
};

using Clock = std::chrono::steady_clock;
/// Seconds since t.
inline double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

template <typename M>
M randn(Eigen::Index r, Eigen::Index c, std::mt19937_64& rng, double s = 1.0) {
  std::normal_distribution<double> d(0.0, s);
  M m(r, c);
  for (Eigen::Index k = 0; k < m.size(); ++k) m.data()[k] = static_cast<typename M::Scalar>(d(rng));
  return m;
}

}  // namespace sc_bench
