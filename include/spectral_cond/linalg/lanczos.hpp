// spectral_cond: the one Lanczos helper of the library (MATH.md §12): the largest eigenvalue of a
// symmetric operator by Spectra's implicitly restarted Lanczos, with a seeded start vector, the
// solver's convergence status, and the relative residual of the returned pair. Every κ(J) method
// that needs an extreme eigenvalue (of J J^T, J^T J, their inverses through a Cholesky factor, or
// R^T R of the qr method, on the CPU and the GPU) calls it.
#pragma once

#include "spectral_cond/core/random.hpp"

#include <Spectra/SymEigsSolver.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>

namespace spectral_cond {

/// Options of a Lanczos iteration.
struct LanczosOptions {
  /// Spectra's relative convergence tolerance on the Ritz value (default 1e-10).
  double tol = 1e-10;
  /// Restarts allowed (default 2000).
  Index max_iterations = 2000;
  /// Krylov dimension (default 20; capped at the operator's order).
  Index ncv = 20;
  /// Seed of the start vector (MATH.md §16).
  std::uint64_t seed = default_seed;

  void check(const char* fn) const {
    std::ostringstream s;
    if (!(tol > 0 && tol < 1))
      s << "lanczos.tol must be in (0, 1) (got " << tol << ")";
    else if (max_iterations < 1)
      s << "lanczos.max_iterations must be >= 1 (got " << max_iterations << ")";
    else if (ncv < 3)
      s << "lanczos.ncv must be >= 3 (got " << ncv << ")";
    if (!s.str().empty()) detail::fail(fn, s.str());
  }
};

/// What one Lanczos run found. `lambda` is NaN unless `converged`.
struct LanczosOutcome {
  double lambda = std::numeric_limits<double>::quiet_NaN();
  double residual = std::numeric_limits<double>::quiet_NaN();  ///< ||op v - λ v|| / |λ|
  Index iterations = 0;                                        ///< restarts
  Index operations = 0;                                        ///< products with the operator
  bool converged = false;
  std::string failure;  ///< the eigensolver's own failure message, when it failed outright
};

namespace detail {

/// y = shift x - Op x: its largest eigenvalue gives the smallest of Op.
template <typename Op>
struct ShiftedNegOp {
  using Scalar = double;
  Op* base;
  double shift;
  Index rows() const { return base->rows(); }
  Index cols() const { return base->cols(); }
  void perform_op(const double* x, double* y) const {
    base->perform_op(x, y);
    for (Index i = 0; i < rows(); ++i) y[i] = shift * x[i] - y[i];
  }
};

/// The largest eigenvalue of the symmetric operator `op` (Spectra's interface: rows(),
/// perform_op(x, y)) by Lanczos from a seeded start vector. Order 1 is one product. The outcome
/// says whether the solver converged; its residual is recomputed from one more product.
template <typename Op>
LanczosOutcome lanczos_largest(Op& op, const LanczosOptions& o) {
  const Index n = op.rows();
  LanczosOutcome out;
  if (n == 1) {
    Vec<double> one = Vec<double>::Ones(1), y(1);
    op.perform_op(one.data(), y.data());
    out.lambda = y(0);
    out.residual = 0;
    out.iterations = out.operations = 1;
    out.converged = std::isfinite(y(0));
    return out;
  }
  Spectra::SymEigsSolver<Op> eigs(op, 1, std::min<Index>(n, std::max<Index>(o.ncv, 3)));
  Rng rng(o.seed);
  Vec<double> v0(n);
  for (Index i = 0; i < n; ++i) v0(i) = rng.normal();
  eigs.init(v0.data());
  // Spectra throws where its tridiagonal eigensolver fails, which happens when the operator's
  // products overflow or are not finite (the inverse of a numerically singular factor): that
  // is a Lanczos run that did not converge, which every caller already handles, never an error.
  try {
    eigs.compute(Spectra::SortRule::LargestAlge, o.max_iterations, o.tol);
  } catch (const std::runtime_error& e) {
    out.failure = e.what();
    return out;
  }
  out.iterations = eigs.num_iterations();
  out.operations = eigs.num_operations();
  if (eigs.info() != Spectra::CompInfo::Successful) return out;
  const double lam = eigs.eigenvalues()(0);
  const Vec<double> v = eigs.eigenvectors().col(0);
  Vec<double> Av(n);
  op.perform_op(v.data(), Av.data());
  out.lambda = lam;
  out.residual = (Av - lam * v).norm() / (std::max(std::abs(lam), 1e-300) * v.norm());
  out.converged = std::isfinite(lam) && std::isfinite(out.residual);
  return out;
}

}  // namespace detail
}  // namespace spectral_cond
