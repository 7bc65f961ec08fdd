// spectral_cond: the vocabulary of the κ(J) methods (MATH.md §12): the method as a typed enum,
// and one options struct per concern, with the same field names everywhere (tol,
// max_iterations, seed) and a check() that throws std::invalid_argument naming the function.
#pragma once

#include "spectral_cond/core/random.hpp"
#include "spectral_cond/linalg/lanczos.hpp"
#include "spectral_cond/linalg/lobpcg.hpp"

#include <cmath>
#include <cstdint>
#include <functional>
#include <sstream>
#include <string>
#include <thread>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

namespace spectral_cond {

/// The machine's physical memory in bytes (sysconf on POSIX systems; 8 GiB where it is unknown).
inline std::uint64_t physical_memory_bytes() {
#if defined(_SC_PHYS_PAGES) && defined(_SC_PAGE_SIZE)
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  if (pages > 0 && page > 0)
    return static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page);
#endif
  return std::uint64_t(8) << 30;
}

/// How κ(J) is computed (MATH.md §12).
enum class JacobianKappaMethod { Auto, Dense, Gram, Iterative, Qr, Lobpcg, Matfree };

inline const char* to_string(JacobianKappaMethod m) {
  switch (m) {
    case JacobianKappaMethod::Auto:
      return "auto";
    case JacobianKappaMethod::Dense:
      return "dense";
    case JacobianKappaMethod::Gram:
      return "gram";
    case JacobianKappaMethod::Iterative:
      return "iterative";
    case JacobianKappaMethod::Qr:
      return "qr";
    case JacobianKappaMethod::Lobpcg:
      return "lobpcg";
    case JacobianKappaMethod::Matfree:
      return "matfree";
  }
  return "unknown";
}

/// Parses "auto", "dense", "gram", "iterative", "qr", "lobpcg" or "matfree"; throws
/// std::invalid_argument otherwise.
inline JacobianKappaMethod parse_jacobian_kappa_method(const std::string& s) {
  for (auto m : {JacobianKappaMethod::Auto, JacobianKappaMethod::Dense, JacobianKappaMethod::Gram,
                 JacobianKappaMethod::Iterative, JacobianKappaMethod::Qr,
                 JacobianKappaMethod::Lobpcg, JacobianKappaMethod::Matfree})
    if (s == to_string(m)) return m;
  throw std::invalid_argument("method: unknown '" + s +
                              "' (expected auto, dense, gram, iterative, qr, lobpcg or matfree)");
}

/// Options of kappa_jacobian_qr and kappa_input_jacobian_qr (MATH.md §3, §12).
struct QrKappaOptions {
  /// Columns of J~ per streamed block (rows of J~^T per update of R). 0 (default): about
  /// 128 MiB of doubles per block, clamped to [256, 4096].
  Index block_cols = 0;
  /// Householder panel width nb of the blocked update (default 64); the panel is BLAS-2, the
  /// trailing update two GEMMs of inner size nb and block_cols.
  Index panel = 64;
  /// Rank tolerance relative to σ_1: σ_i counts towards the rank when σ_i > rtol · σ_1.
  /// Negative (default): max(m, n) · ε with m x n the shape of the uncompressed J (MATH.md §4).
  double rtol = -1;
  /// The Lanczos iterations for σ_max and σ_min of the triangular factor R (default tolerance
  /// 1e-13, 1000 restarts).
  LanczosOptions lanczos{1e-13, 1000, 20, default_seed};
  /// R of order <= this gets a dense SVD (all singular values, hence the exact numerical rank)
  /// when J~ is tall or when the Lanczos σ_min is below the rank tolerance (default 2048).
  /// Below 64 the dense SVD is always used.
  Index dense_svd_max = 2048;
  /// Threads for the trailing updates; 0 (default): std::thread::hardware_concurrency().
  unsigned threads = 0;
  /// Called with the fraction of the work done, in [0, 1], after each streamed block and at the
  /// end (for progress reports; may be empty). It may throw to cancel the computation.
  std::function<void(double)> progress;

  void check(const char* fn) const {
    std::ostringstream s;
    if (block_cols < 0)
      s << "block_cols must be >= 0 (got " << block_cols << ")";
    else if (panel < 1)
      s << "panel must be >= 1 (got " << panel << ")";
    else if (!(std::isfinite(rtol) && rtol < 1))
      s << "rtol must be finite and < 1 (got " << rtol << ")";
    else if (dense_svd_max < 0)
      s << "dense_svd_max must be >= 0 (got " << dense_svd_max << ")";
    if (!s.str().empty()) detail::fail(fn, s.str());
    lanczos.check(fn);
  }
  unsigned resolved_threads() const {
    const unsigned hw = std::thread::hardware_concurrency();
    return threads > 0 ? threads : (hw > 0 ? hw : 1u);
  }
};

/// Options of kappa_jacobian and of every kappa_jacobian_* method (MATH.md §12).
struct JacobianKappaOptions {
  JacobianKappaMethod method = JacobianKappaMethod::Auto;
  /// κ of J with respect to the weights and the biases together, [J_W | J_b] (MATH.md §10),
  /// rather than the weights alone. kappa_jacobian applies with_bias_parameters (jacobian.hpp)
  /// and runs the method on its result; the single-method entry points refuse the flag (pass
  /// them with_bias_parameters' inputs instead).
  bool include_biases = false;
  /// Requested relative accuracy of σ_min; auto takes gram only when ε κ^2 is below it, and
  /// gram and iterative say in their note when their estimate exceeds it. Default 1e-6.
  double tol = 1e-6;
  /// Rank tolerance relative to σ_1 for kappa_plus; < 0 means max(m, n) ε (MATH.md §4, §15).
  double rtol = -1;
  /// auto uses dense while J has at most this many entries (default 2^22, 32 MB).
  Index dense_max_entries = Index(1) << 22;
  /// gram: a full symmetric eigensolve up to this order, Lanczos and Cholesky above.
  Index gram_eig_max = 4000;
  /// Bytes the (N d_v)^2 matrices of gram, lobpcg and qr may take; auto takes matfree when two
  /// of them (a Gram matrix and its factor) would not fit. matfree's coarse level is left out
  /// where its Galerkin matrix would not fit it. 0 (default): a quarter of the physical memory
  /// (physical_memory_bytes).
  std::uint64_t memory_budget = 0;
  /// The Lanczos iterations of the gram, iterative and lobpcg methods.
  LanczosOptions lanczos;
  /// The LOBPCG iteration of the lobpcg method.
  LobpcgOptions lobpcg;
  /// The LOBPCG iteration of the matfree method, whose preconditioner is coarser than lobpcg's:
  /// more iterations by default (block 2, 2000 iterations). A larger block takes fewer
  /// iterations but more products in all (MATH.md §12; GPT-2-small head at N = 256: block 2, 387
  /// iterations, 7.4 s; block 4, 352 iterations, 11.0 s). Temple's bound needs a block of 2 or
  /// more (the second Ritz pair).
  LobpcgOptions matfree{2, 2000, 1e-10, default_seed, nullptr};
  /// The matfree preconditioner's coarse level: the eigenvectors of S = (P X)(P X)^T for its
  /// null modes (eigenvalues at rounding level, N - rank(P X)) and this many smallest eigenvalues
  /// more, times every output channel (MATH.md §12); without the null modes where that would
  /// not fit memory_budget; 0: none.
  Index matfree_coarse = 16;
  /// The qr method (its rtol and progress are taken from this struct when kappa_jacobian calls
  /// it).
  QrKappaOptions qr;
  /// Called with the fraction done, for progress bars; may be empty. It may throw to cancel
  /// the computation: the exception propagates and nothing is left half-done.
  std::function<void(double)> progress;

  std::uint64_t resolved_memory_budget() const {
    return memory_budget > 0 ? memory_budget : physical_memory_bytes() / 4;
  }

  void check(const char* fn) const {
    if (!(tol > 0)) detail::fail(fn, "tol must be > 0");
    if (!(rtol < 1)) detail::fail(fn, "rtol must be < 1 (or < 0 for the default)");
    if (dense_max_entries < 0 || gram_eig_max < 1)
      detail::fail(fn, "dense_max_entries must be >= 0 and gram_eig_max >= 1");
    lanczos.check(fn);
    lobpcg.check(fn);
    matfree.check(fn);
    if (matfree_coarse < 0) detail::fail(fn, "matfree_coarse must be >= 0");
    qr.check(fn);
  }
};

}  // namespace spectral_cond
