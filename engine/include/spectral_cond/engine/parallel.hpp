// spectral-cond: independent work items on several threads, with the serial run's results and
// errors. `analyze --jobs N` runs a layer's projections and its heads this way.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <exception>
#include <thread>
#include <vector>

namespace spectral_cond::engine {

/// Threads for `jobs`: 0 means one per hardware thread; never more than `items`, never below 1.
inline unsigned resolved_jobs(unsigned jobs, std::size_t items) {
  unsigned n = jobs;
  if (n == 0) n = std::max(1u, std::thread::hardware_concurrency());
  return static_cast<unsigned>(std::max<std::size_t>(1, std::min<std::size_t>(n, items)));
}

/// Calls fn(i) for every i in [0, items) on `threads` threads (the calling thread is one of
/// them); each item writes only its own results, so the outcome is the serial one whatever the
/// order. Items are started in increasing order; once one throws, no new item starts, and the
/// exception of the lowest-numbered item that threw is rethrown here. Every item below it has
/// run, so that is the error the serial loop would have stopped at.
template <typename Fn>
void parallel_for(std::size_t items, unsigned threads, Fn&& fn) {
  if (threads <= 1 || items <= 1) {
    for (std::size_t i = 0; i < items; ++i) fn(i);
    return;
  }
  std::atomic<std::size_t> next{0};
  std::atomic<bool> failed{false};
  std::vector<std::exception_ptr> errors(items);
  auto worker = [&] {
    for (std::size_t i = next++; i < items && !failed; i = next++) {
      try {
        fn(i);
      } catch (...) {
        errors[i] = std::current_exception();
        failed = true;
      }
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (unsigned t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace spectral_cond::engine
