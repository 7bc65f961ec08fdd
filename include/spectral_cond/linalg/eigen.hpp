// spectral_cond: eigenvalues of a symmetric matrix with every solver's status checked (MATH.md
// §12). Eigen's SelfAdjointEigenSolver can stop without converging (its QR iteration has a fixed
// budget) and then returns unsorted, meaningless values; those are never read as a result here.
#pragma once

#include "spectral_cond/core/common.hpp"

#include <Eigen/Eigenvalues>
#include <Eigen/SVD>

#include <algorithm>
#include <string>
#include <vector>

#ifdef SPECTRAL_COND_HAVE_LAPACKE
#include <lapacke.h>
#endif

namespace spectral_cond {
namespace detail {

/// Test hook: while positive, symmetric_eigenvalues skips its first `symmetric_eigen_failures`
/// solvers as if they had not converged (tests inject non-converging solvers through it).
inline thread_local int symmetric_eigen_failures = 0;

/// Below this order symmetric_eigenvalues tries Eigen's solver before LAPACK: on small matrices
/// a multithreaded BLAS spends more time synchronising its threads than computing (measured on
/// 16 x 16 blocks: LAPACK's ?syevd spun in OpenBLAS's thread barrier whenever the other core
/// was busy), and Eigen's QR iteration is fast there.
inline constexpr Index symmetric_eigen_lapack_min_size = 64;

/// The eigenvalues of the symmetric `G` (only its lower triangle is read by LAPACK; Eigen reads
/// the whole, which is symmetric here) in ascending order, into `ascending`. Tries, in turn:
/// LAPACK ?syevd (where the build has LAPACKE; for orders below
/// symmetric_eigen_lapack_min_size after Eigen's), Eigen's SelfAdjointEigenSolver, and for a
/// positive semidefinite `G` (`psd`) the singular values from Eigen's BDCSVD (which equal the
/// eigenvalues of a PSD matrix). Each solver's status is checked and the values are checked to
/// be finite and sorted. Returns the name of the solver that answered, or an empty string when
/// none did (then `ascending` is left empty). `note` collects why a solver was passed over.
/// The test hook symmetric_eigen_failures counts solvers in the order they are tried.
template <typename Scalar>
std::string symmetric_eigenvalues(const Mat<Scalar>& G, bool psd, Vec<Scalar>& ascending,
                                  std::string& note) {
  const Index n = G.rows();
  int tried = 0;  // solvers tried so far, for the test hook
  auto accept = [&](const Vec<Scalar>& v) {
    if (v.size() != n || !v.allFinite()) return false;
    for (Index i = 1; i < n; ++i)
      if (v(i) < v(i - 1)) return false;
    ascending = v;
    return true;
  };
  auto add = [&](const std::string& s) { note += (note.empty() ? "" : "; ") + s; };
  auto lapack = [&]() -> bool {
#ifdef SPECTRAL_COND_HAVE_LAPACKE
    if constexpr (std::is_same<Scalar, double>::value || std::is_same<Scalar, float>::value) {
      Mat<Scalar> A = G;
      Vec<Scalar> w(n);
      lapack_int rc;
      if constexpr (std::is_same<Scalar, double>::value)
        rc = LAPACKE_dsyevd(LAPACK_COL_MAJOR, 'N', 'L', static_cast<lapack_int>(n), A.data(),
                            static_cast<lapack_int>(n), w.data());
      else
        rc = LAPACKE_ssyevd(LAPACK_COL_MAJOR, 'N', 'L', static_cast<lapack_int>(n), A.data(),
                            static_cast<lapack_int>(n), w.data());
      if (symmetric_eigen_failures < ++tried && rc == 0 && accept(w)) return true;
      add("LAPACK syevd failed (info = " + std::to_string(rc) + ")");
    }
#endif
    return false;
  };
  auto eigen = [&]() -> bool {
    Eigen::SelfAdjointEigenSolver<Mat<Scalar>> es(G, Eigen::EigenvaluesOnly);
    if (symmetric_eigen_failures < ++tried && es.info() == Eigen::Success &&
        accept(es.eigenvalues()))
      return true;
    add(es.info() == Eigen::Success ? "Eigen's SelfAdjointEigenSolver returned unsorted values"
                                    : "Eigen's SelfAdjointEigenSolver did not converge");
    return false;
  };
  if (n < symmetric_eigen_lapack_min_size) {
    if (eigen()) return "eigen_selfadjoint";
    if (lapack()) return "lapack_syevd";
  } else {
    if (lapack()) return "lapack_syevd";
    if (eigen()) return "eigen_selfadjoint";
  }
  if (psd) {
    Eigen::BDCSVD<Mat<Scalar>> svd(G);
    if (symmetric_eigen_failures < ++tried && svd.info() == Eigen::Success) {
      Vec<Scalar> s = svd.singularValues().reverse();  // ascending
      if (accept(s)) return "bdc_svd (of the positive semidefinite matrix)";
    }
    add("Eigen's BDCSVD failed");
  }
  ascending.resize(0);
  return {};
}

/// The k smallest eigenvalues of the symmetric `G` (1 <= k <= n), ascending, into `values`, and
/// their eigenvectors into the n x k `vectors` (the coarse level of the matfree method, MATH.md
/// §12): LAPACK ?syevr for that range only (where the build has LAPACKE), else Eigen's
/// SelfAdjointEigenSolver. False where the solver reports a failure or a result is not finite
/// (then both are left empty).
/// A template only so that a translation unit that does not call it does not compile it.
template <typename = void>
bool smallest_eigenpairs(const Mat<double>& G, Index k, Vec<double>& values, Mat<double>& vectors) {
  const Index n = G.rows();
  values.resize(0);
  vectors.resize(0, 0);
  if (k < 1 || k > n) return false;
#ifdef SPECTRAL_COND_HAVE_LAPACKE
  {
    Mat<double> A = G, Z(n, k);
    Vec<double> w(n);
    std::vector<lapack_int> support(static_cast<std::size_t>(2 * k));
    lapack_int found = 0;
    const lapack_int rc =
        LAPACKE_dsyevr(LAPACK_COL_MAJOR, 'V', 'I', 'L', static_cast<lapack_int>(n), A.data(),
                       static_cast<lapack_int>(n), 0.0, 0.0, 1, static_cast<lapack_int>(k), 0.0,
                       &found, w.data(), Z.data(), static_cast<lapack_int>(n), support.data());
    if (rc == 0 && found == k && Z.allFinite() && w.head(k).allFinite()) {
      values = w.head(k);
      vectors = std::move(Z);
      return true;
    }
  }
#endif
  const Eigen::SelfAdjointEigenSolver<Mat<double>> es(G);
  if (es.info() != Eigen::Success || !es.eigenvectors().allFinite() ||
      !es.eigenvalues().allFinite())
    return false;
  values = es.eigenvalues().head(k);
  vectors = es.eigenvectors().leftCols(k);
  return true;
}

}  // namespace detail
}  // namespace spectral_cond
