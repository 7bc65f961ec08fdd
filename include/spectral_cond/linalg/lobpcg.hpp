// spectral_cond: LOBPCG for the smallest singular value of a wide matrix J given by its products
// (MATH.md §12), with a preconditioner for J J^T supplied by the caller.
#pragma once

#include "spectral_cond/core/random.hpp"

#include <Eigen/QR>
#include <Eigen/SVD>

#include <functional>
#include <memory>

namespace spectral_cond {

/// Options of the LOBPCG iteration of the lobpcg method (MATH.md §12).
struct LobpcgOptions {
  /// Block size (default 4).
  Index block = 4;
  /// Iterations allowed (default 100).
  Index max_iterations = 100;
  /// Stopping tolerance on the relative residual bound ρ = ||M^{-1} (J J^T x - σ^2 x)|| of the
  /// smallest Ritz pair (its σ is then within about ρ / 2, relatively, of a singular value of
  /// J); the iteration also stops once ρ reaches rounding level, 16 ε κ. Default 1e-10.
  double tol = 1e-10;
  /// Seed of the start block (MATH.md §16).
  std::uint64_t seed = default_seed;
  /// Warm start (the advisor's λ grid, MATH.md §17): when set and its block has J's row count,
  /// the first half of the start block (at least one column) is taken from it and the rest is
  /// random as always; on return it holds the final block. Null (default): a random start.
  std::shared_ptr<Mat<double>> warm;

  void check(const char* fn) const {
    if (block < 1 || max_iterations < 1 || !(tol > 0 && tol < 1))
      detail::fail(fn,
                   "lobpcg.block and lobpcg.max_iterations must be >= 1 and lobpcg.tol in (0, 1)");
  }
};

namespace detail {

/// What the iteration's stopping test measures (see lobpcg_sigma_min).
enum class LobpcgStop {
  /// ρ = ||M^{-1} r||: a relative bound when M is close to J J^T (the Gram preconditioner).
  Preconditioned,
  /// η = ||r|| / σ^2, r = J J^T x - σ^2 x unpreconditioned: a relative bound for any M.
  Residual,
};

/// How the Rayleigh-Ritz step gets J^T S for the orthonormal basis S of [X, W, P].
enum class LobpcgProducts {
  /// 3 b fresh products J^T S every iteration.
  Fresh,
  /// J^T X and J^T P carried along from the previous step and b fresh products J^T W, then
  /// J^T S = (J^T [X, W, P]) T^{-1} for the triangular factor T of [X, W, P] = S T: a third of
  /// the products. Rounding in J^T S grows with κ(T), so a step whose T has κ(T) > 1000, and
  /// every 8th step, takes fresh products. For callers that check the answer by fresh products
  /// (the matfree method), since the carried products may drift by a few ε κ(T) ||J||.
  Tracked,
};

/// Temple's bound on the relative error of σ = sqrt(ρ) as an approximation of σ_min (MATH.md
/// §12): for a unit x with Rayleigh quotient ρ = ||J^T x||^2 and residual norm r1 =
/// ||J J^T x - ρ x||, if J J^T has exactly one eigenvalue below a > ρ, that eigenvalue λ_1
/// satisfies ρ - r1^2 / (a - ρ) <= λ_1 <= ρ. Here a = θ_2 - r2, with θ_2 the second Ritz value and
/// r2 its residual norm (an eigenvalue lies within r2 of θ_2), so the hypothesis is that no
/// eigenvalue lies between λ_1 and that one: the iteration found the bottom of the spectrum.
/// `round` (about ε σ_1^2, the rounding of a computed J J^T x) is added to both residuals. With
/// t = r1^2 / (ρ (a - ρ)), sqrt(λ_1) >= σ sqrt(1 - t), a relative error of at most
/// t / (1 + sqrt(1 - t)). +inf where a <= ρ (no gap seen) or t >= 1.
inline double temple_bound(double rho, double r1, double theta2, double r2, double round) {
  const double a = theta2 - r2 - round, e = r1 + round;
  if (!(rho > 0 && a > rho && std::isfinite(a) && std::isfinite(e)))
    return std::numeric_limits<double>::infinity();
  const double t = e * e / (rho * (a - rho));
  return t < 1 ? t / (1 + std::sqrt(1 - t)) : std::numeric_limits<double>::infinity();
}

struct LobpcgOutcome {
  double sigma = std::numeric_limits<double>::quiet_NaN();  ///< smallest Ritz value of J^T
  double rho = std::numeric_limits<double>::infinity();     ///< ||M^{-1} r|| (see below)
  double eta = std::numeric_limits<double>::infinity();     ///< ||r|| / σ^2 (see below)
  /// Temple's bound (temple_bound) from the two smallest Ritz pairs, with stop Residual
  double temple = std::numeric_limits<double>::infinity();
  Vec<double> x;   ///< its unit Ritz vector
  Vec<double> x2;  ///< the second Ritz vector (empty for a block of 1)
  Index iterations = 0;
  Index fresh_steps = 0;  ///< Rayleigh-Ritz steps that took 3 b fresh products
  bool converged = false;
  bool at_eta_floor = false;  ///< stopped where η stopped falling, above tol (see below)
};

/// σ_min of the wide J (products J.apply(x, y) = J x and J.apply_transpose(x, y) = J^T x, one JVP
/// or VJP per column) by LOBPCG on J J^T with the preconditioner `precondition(B)`,
/// B <- M^{-1} B for an approximation M of J J^T (MATH.md §12). With M = G~ = L L^T, the
/// computed Gram matrix
/// (the lobpcg method):
///   - the Rayleigh-Ritz step takes the SVD of J^T S for an orthonormal basis S of [X, W, P]
///     (the singular values of J^T on span S), never the eigenvalues of S^T J J^T S, so nothing
///     in it squares J;
///   - the residual R = J (J^T X) - X Σ^2 is formed from products with J as well. G~ differs
///     from J J^T by about ε σ_1^2, which only makes the preconditioner inexact (||I - G~^{-1}
///     J J^T|| ~ ε κ^2 in the smallest directions): the iteration's fixed point is set by the
///     products with J, so σ_min comes out to about ε κ relatively, like a backward-stable
///     method, as long as the iteration converges;
///   - ρ = ||W_1|| = ||(L L^T)^{-1} r_1|| for the unit Ritz vector x_1 is the inverse-iteration
///     residual: with G~ = J J^T exactly, some eigenvalue λ of J J^T has |λ - σ^2| <= ρ λ, so σ
///     is within about ρ / 2 of a singular value, relatively. G~ differs from J J^T, so
///     ||(J J^T)^{-1} r_1|| <= (1 + ||G~ - J J^T|| / σ_min^2) ρ ≈ (1 + ε κ^2) ρ: the caller
///     states that. Rounding in the products can put a
///     floor under ρ: the iteration stops at ρ <= tol, or once ρ <= 16 ε κ and σ moved by at most
///     4 ε κ relatively in the last step (nothing left to gain above rounding).
/// With any other M (stop = LobpcgStop::Residual) ρ bounds nothing, and the test is on
/// η = ||r|| / σ^2 for the unpreconditioned residual r = J J^T x - σ^2 x of the unit Ritz vector
/// x: some eigenvalue λ of J J^T has |λ - σ^2| <= ||r||, so some singular value σ_i of J has
/// |σ_i - σ| <= ||r|| / (σ_i + σ) <= η σ (MATH.md §12). The same floor applies to η. The test
/// there is on min(η, Temple's bound from the two smallest Ritz pairs, temple_bound), which is
/// quadratic in ||r|| and so reaches tol long before η does, and below η's rounding floor.
/// A Ritz value bounds σ_min from above (Courant-Fischer), so once it is at or below
/// `stop_below` (a rank tolerance) the iteration stops unconverged: σ_min is that small too.
template <typename Products, typename Precondition>
LobpcgOutcome lobpcg_sigma_min(const Products& J, Precondition&& precondition, double sigma_max,
                               const LobpcgOptions& lo, const std::function<void(double)>& progress,
                               LobpcgStop stop = LobpcgStop::Preconditioned, double stop_below = 0,
                               LobpcgProducts products = LobpcgProducts::Fresh) {
  const Index m = J.rows(), n = J.cols(), b = std::min(lo.block, m);
  const double eps = ScalarTraits<double>::eps();
  auto apply_t = [&](const Mat<double>& S, Mat<double>& Y) {  // Y = J^T S
    Y.resize(n, S.cols());
    for (Index j = 0; j < S.cols(); ++j) J.apply_transpose(S.col(j).data(), Y.col(j).data());
  };
  Mat<double> X(m, b), Y, S, YS, R, P, Xn, YA, YP, T, Vr;
  Vec<double> sig;
  LobpcgOutcome out;
  // X, Y = J^T X and sig <- the b smallest Ritz triplets of span(S), ascending; YS = J^T S is
  // given (have_ys) or taken fresh.
  auto rayleigh_ritz = [&](bool have_ys) {
    if (!have_ys) {
      apply_t(S, YS);
      ++out.fresh_steps;
    }
    // The singular values and right vectors of the tall YS are those of its triangular factor:
    // a blocked Householder QR (BLAS-3) and then a small Jacobi SVD, never YS^T YS.
    Eigen::HouseholderQR<Mat<double>> tall(YS);
    const Index kr = std::min(YS.rows(), YS.cols());
    const Mat<double> Rf = tall.matrixQR().topRows(kr).template triangularView<Eigen::Upper>();
    Eigen::JacobiSVD<Mat<double>> svd(Rf, Eigen::ComputeThinV);
    const Index k = svd.singularValues().size(), kb = std::min(b, k);
    sig = svd.singularValues().tail(kb).reverse();
    Vr = svd.matrixV().rightCols(kb).rowwise().reverse();
    Xn.noalias() = S * Vr;
    Y.noalias() = YS * Vr;
  };
  // S <- an orthonormal basis of span(A) (at most m columns: all of R^m), T <- its triangular
  // factor, A = S T, where A has no more columns than rows.
  auto orthonormal_basis = [&](const Mat<double>& A) {
    Eigen::HouseholderQR<Mat<double>> qr(A);
    S = qr.householderQ() * Mat<double>::Identity(A.rows(), std::min(A.cols(), A.rows()));
    if (A.cols() <= A.rows())
      T = qr.matrixQR().topRows(A.cols()).template triangularView<Eigen::Upper>();
    else
      T.resize(0, 0);
  };
  Rng rng(lo.seed);
  for (Index k = 0; k < X.size(); ++k) X.data()[k] = rng.normal();
  if (lo.warm && lo.warm->rows() == m && lo.warm->cols() > 0) {
    const Index w = std::min(lo.warm->cols(), std::max<Index>(1, b / 2));
    X.leftCols(w) = lo.warm->leftCols(w);
  }
  // The final block, for the next solve's warm start.
  auto keep_block = [&] {
    if (lo.warm) *lo.warm = X;
  };
  precondition(X);  // the start: one preconditioned step
  orthonormal_basis(X);
  rayleigh_ritz(false);
  X = Xn;
  double best = std::numeric_limits<double>::infinity();  // the last η that halved the one before
  Index best_it = 0;
  double done = 0;  // progress: the fraction of the way from ρ = 1 to ρ = tol, never decreasing
  for (Index it = 0;; ++it) {
    R.resize(m, sig.size());
    for (Index j = 0; j < sig.size(); ++j) J.apply(Y.col(j).data(), R.col(j).data());
    for (Index j = 0; j < sig.size(); ++j) R.col(j) -= (sig(j) * sig(j)) * X.col(j);
    out.eta = R.col(0).norm() / (sig(0) * sig(0));
    if (stop == LobpcgStop::Residual && sig.size() > 1)
      out.temple = temple_bound(sig(0) * sig(0), R.col(0).norm(), sig(1) * sig(1), R.col(1).norm(),
                                eps * sigma_max * sigma_max);
    precondition(R);  // W
    const double previous = out.sigma;
    out.sigma = sig(0);
    out.rho = R.col(0).norm();
    out.iterations = it;
    const double measure = stop == LobpcgStop::Residual ? std::min(out.eta, out.temple) : out.rho;
    const double floor = 16 * eps * sigma_max / sig(0);
    // η's own floor (the rounding of the stored x through J J^T, up to ε κ^2): reached once η is
    // below 64 ε κ^2 and has not halved in the last 64 iterations.
    if (measure < 0.5 * best) {
      best = measure;
      best_it = it;
    }
    const double kappa = sigma_max / sig(0);
    const bool eta_floor =
        stop == LobpcgStop::Residual && measure <= 64 * eps * kappa * kappa && it - best_it >= 64;
    if (measure <= lo.tol || eta_floor ||
        (measure <= floor && std::abs(previous - out.sigma) <= 0.25 * floor * out.sigma)) {
      out.converged = true;
      out.at_eta_floor = eta_floor && measure > lo.tol;
      out.x = X.col(0);
      if (X.cols() > 1) out.x2 = X.col(1);
      keep_block();
      return out;
    }
    if (it >= lo.max_iterations || !std::isfinite(measure) || out.sigma <= stop_below) {
      out.x = X.col(0);
      if (X.cols() > 1) out.x2 = X.col(1);
      return out;
    }
    if (progress) {
      done = std::max(done, std::clamp(std::log(measure) / std::log(lo.tol), 0.0, 1.0));
      progress(done);
    }
    // Basis [X, W, P], W and P scaled to unit columns (zero ones dropped) so that the QR keeps
    // their directions to working precision however small the correction has become.
    const bool track = products == LobpcgProducts::Tracked && it % 8 != 7;
    Mat<double> YW;
    if (track) apply_t(R, YW);  // J^T W, before W is scaled
    Index cols = X.cols();
    Mat<double> A(m, X.cols() + R.cols() + P.cols());
    if (track) YA.resize(n, A.cols());
    A.leftCols(X.cols()) = X;
    if (track) YA.leftCols(X.cols()) = Y;
    for (int part = 0; part < 2; ++part) {
      const Mat<double>& M = part == 0 ? R : P;
      for (Index j = 0; j < M.cols(); ++j) {
        const double nrm = M.col(j).norm();
        if (!(nrm > 0 && std::isfinite(nrm))) continue;
        A.col(cols) = M.col(j) / nrm;
        if (track) YA.col(cols) = (part == 0 ? YW.col(j) : YP.col(j)) / nrm;
        ++cols;
      }
    }
    orthonormal_basis(A.leftCols(cols));
    bool have_ys = false;
    if (track && T.rows() == cols) {
      const Eigen::JacobiSVD<Mat<double>> ts(T);
      const Vec<double>& tv = ts.singularValues();
      if (tv.size() > 0 && tv(tv.size() - 1) * 1e3 >= tv(0)) {
        YS = T.template triangularView<Eigen::Upper>().template solve<Eigen::OnTheRight>(
            YA.leftCols(cols));
        have_ys = YS.allFinite();
      }
    }
    rayleigh_ritz(have_ys);
    if (products == LobpcgProducts::Tracked && S.cols() > X.cols()) {
      // The step's part outside span(X): S's first columns span X, so it is the new Ritz
      // vectors' coordinates on the other columns of S, and J^T P the same combination of
      // J^T S, with no cancellation to amplify the rounding of the carried products.
      const Index k = S.cols() - X.cols();
      P.noalias() = S.rightCols(k) * Vr.bottomRows(k);
      YP.noalias() = YS.rightCols(k) * Vr.bottomRows(k);
    } else {
      P.noalias() = Xn - X * (X.transpose() * Xn);  // the step's part outside span(X)
      YP.resize(n, 0);
      if (products == LobpcgProducts::Tracked) P.resize(m, 0);
    }
    X = Xn;
  }
}

}  // namespace detail
}  // namespace spectral_cond
