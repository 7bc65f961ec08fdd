// spectral_cond: κ(J) of an attention block by five methods, each saying what it computed and
// how accurate it is (MATH.md §3–4).
//
//   dense      SVD of the assembled J. The reference; accuracy about ε κ(J); small sizes only.
//   gram       eigenvalues of the structured Gram J J^T (or J^T J when J is tall), never forming
//              J. Squares J: σ_min has relative error about ε κ(J)^2 (MATH.md §3, "Squaring is
//              not affordable"), and singular values below about sqrt(n ε) σ_1 cannot be told
//              from zero.
//   iterative  matrix-free Lanczos (Spectra) on J J^T or J^T J through the JVP/VJP operators;
//              squares J too, and σ_min may not converge: then Info::NotConverging.
//   lobpcg     wide J: LOBPCG for the smallest eigenvalue of J J^T, preconditioned by the
//              Cholesky factor of gram's J J^T, with every product by J and J^T matrix-free and
//              the Rayleigh-Ritz step an SVD of J^T S. Gram's rounding only slows the iteration;
//              its fixed point is set by products with J: accuracy about ε κ(J), like qr, at
//              about gram's cost. Answers only when the preconditioned iteration converges and
//              σ_min is above the rank tolerance; otherwise (and for tall J, and when its stated
//              accuracy exceeds max(tol, 100 ε κ)) kappa_jacobian takes qr.
//   qr         QR of the compressed Jacobian (MATH.md §3, "The compressed Jacobian"), then the
//              triangular factor: backward stable, accuracy about ε κ(J).
//   auto       dense when J is small; else gram when its own error estimate ε κ^2 is below the
//              requested tolerance, otherwise an accurate method: lobpcg where it answers, qr
//              where it does not. The note says which and why.
//
// All methods compute in double, whatever the scalar of the inputs.
#pragma once

#include "spectral_cond/gram.hpp"
#include "spectral_cond/jacobian.hpp"
#include "spectral_cond/kappa.hpp"
#include "spectral_cond/operators.hpp"
#include "spectral_cond/qr_kappa.hpp"

#include <Spectra/MatOp/DenseSymMatProd.h>
#include <Spectra/SymEigsSolver.h>
#include <Eigen/Cholesky>
#include <Eigen/Eigenvalues>
#include <Eigen/QR>
#include <Eigen/SVD>

#include <functional>
#include <optional>
#include <random>

// Functions on double alone are written `template <typename = void>`: they are then compiled
// only in the translation units that call them, not in every one that includes this header.
namespace spectral_cond {

enum class JacobianKappaMethod { Auto, Dense, Gram, Iterative, Qr, Lobpcg };

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
  }
  return "unknown";
}

/// Parses "auto", "dense", "gram", "iterative", "qr" or "lobpcg"; throws std::invalid_argument
/// otherwise.
inline JacobianKappaMethod parse_jacobian_kappa_method(const std::string& s) {
  for (auto m :
       {JacobianKappaMethod::Auto, JacobianKappaMethod::Dense, JacobianKappaMethod::Gram,
        JacobianKappaMethod::Iterative, JacobianKappaMethod::Qr, JacobianKappaMethod::Lobpcg})
    if (s == to_string(m)) return m;
  throw std::invalid_argument("method: unknown '" + s +
                              "' (expected auto, dense, gram, iterative, qr or lobpcg)");
}

/// Options of kappa_jacobian.
struct JacobianKappaOptions {
  JacobianKappaMethod method = JacobianKappaMethod::Auto;
  /// Requested relative accuracy of σ_min; auto takes gram only when ε κ^2 is below it, and
  /// gram and iterative say in their note when their estimate exceeds it. Default 1e-6.
  double tol = 1e-6;
  /// Rank tolerance relative to σ_1 for kappa_plus; < 0 means max(m, n) ε (MATH.md §4).
  double rtol = -1;
  /// auto uses dense while J has at most this many entries (default 2^22, 32 MB).
  Index dense_max_entries = Index(1) << 22;
  /// gram: a full symmetric eigensolve up to this order, Lanczos and Cholesky above.
  Index gram_eig_max = 4000;
  /// iterative: Lanczos restarts and convergence tolerance (Spectra's relative tolerance).
  Index max_iterations = 2000;
  double iter_tol = 1e-10;
  /// lobpcg: block size, iterations allowed, and the stopping tolerance on the relative
  /// residual bound ρ = ||(L L^T)^{-1} (J J^T x - σ^2 x)|| of the smallest Ritz pair (its σ is
  /// then within about ρ / 2, relatively, of a singular value of J); the iteration also stops
  /// once ρ reaches rounding level, 16 ε κ. Defaults 4, 100, 1e-10.
  Index lobpcg_block = 4;
  Index lobpcg_max_iterations = 100;
  double lobpcg_tol = 1e-10;
  /// Seed of the random start vectors (deterministic by default).
  std::uint64_t seed = 42;
  /// Called with the fraction done, for progress bars; may be empty.
  std::function<void(double)> progress;

  void check(const char* fn) const {
    if (!(tol > 0)) detail::fail(fn, "tol must be > 0");
    if (!(rtol < 1)) detail::fail(fn, "rtol must be < 1 (or < 0 for the default)");
    if (dense_max_entries < 0 || gram_eig_max < 1 || max_iterations < 1 || !(iter_tol > 0))
      detail::fail(fn, "dense_max_entries, gram_eig_max, max_iterations and iter_tol must be > 0");
    if (lobpcg_block < 1 || lobpcg_max_iterations < 1 || !(lobpcg_tol > 0 && lobpcg_tol < 1))
      detail::fail(fn,
                   "lobpcg_block and lobpcg_max_iterations must be >= 1 and lobpcg_tol in (0, 1)");
  }
};

namespace detail {

struct KJInputs {
  Mat<double> X, WQ, WK, WV;
  AttentionOptions<double> opts;
  Index rows = 0, cols = 0;
  bool wide() const { return rows <= cols; }
};

template <typename Scalar>
KJInputs kj_inputs(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                   const CRef<Scalar>& WV, const AttentionOptions<Scalar>& o) {
  KJInputs in;
  in.X = X.template cast<double>();
  in.WQ = WQ.template cast<double>();
  in.WK = WK.template cast<double>();
  in.WV = WV.template cast<double>();
  in.opts.scale = static_cast<double>(o.resolved_scale(WQ.cols()));
  in.opts.mask = o.mask;
  if (o.mask == MaskKind::Additive) in.opts.additive_mask = o.additive_mask.template cast<double>();
  in.rows = jacobian_rows(X.rows(), WV.cols());
  in.cols = jacobian_cols(JacobianBlock::All, X.rows(), X.cols(), WQ.cols(), WV.cols());
  return in;
}

inline KappaOptions<double> kappa_opts(const JacobianKappaOptions& jo) {
  KappaOptions<double> k;
  k.rtol = jo.rtol;
  return k;
}

/// Singular values from the eigenvalues of a Gram matrix (ascending, as Eigen returns them),
/// with the squared method's limits applied: values below sqrt(n ε) σ_1 are indistinguishable
/// from zero, so the rank tolerance is at least that.
template <typename = void>
inline ConditionResult<double> condition_from_gram_eigenvalues(const Vec<double>& lambda_asc,
                                                               Index m, Index n,
                                                               const JacobianKappaOptions& jo,
                                                               const std::string& method) {
  const Index r = std::min(m, n), g = lambda_asc.size();
  Vec<double> sv(r);
  for (Index i = 0; i < r; ++i) sv(i) = std::sqrt(std::max(0.0, lambda_asc(g - 1 - i)));
  KappaOptions<double> ko = kappa_opts(jo);
  const double floor = std::sqrt(static_cast<double>(g) * ScalarTraits<double>::eps());
  ko.rtol = std::max(ko.resolved_rtol(m, n), floor);
  ConditionResult<double> res = condition_from_singular_values<double>(sv, m, n, ko, method);
  return res;
}

/// Fills accuracy = ε κ^2 for the squared methods, and flags a meaningless answer.
inline void squared_accuracy(ConditionResult<double>& res, const JacobianKappaOptions& jo) {
  if (res.info == Info::InvalidInput) return;
  const double eps = ScalarTraits<double>::eps();
  const double k = std::isfinite(res.kappa) ? res.kappa : res.kappa_plus;
  res.accuracy = std::isfinite(k) ? eps * k * k : ScalarTraits<double>::inf();
  std::ostringstream s;
  s << "squares J: sigma_min has relative error about eps*kappa^2 = " << res.accuracy;
  if (res.accuracy >= 1) {
    if (res.info == Info::Success) res.info = Info::Inaccurate;
    s << " >= 1, so sigma_min and kappa are meaningless here; use method qr";
  } else if (res.accuracy > jo.tol) {
    s << ", above the requested tol " << jo.tol << "; method qr is accurate to eps*kappa";
  }
  res.note = res.note.empty() ? s.str() : s.str() + "; " + res.note;
}

/// G = L L^T in place (L in the lower triangle), by LAPACK's potrf when built with LAPACKE
/// (multithreaded OpenBLAS), else Eigen's blocked LLT. False when G is not positive definite.
template <typename = void>
inline bool cholesky_in_place(Mat<double>& G) {
#ifdef SPECTRAL_COND_HAVE_LAPACKE
  const lapack_int n = static_cast<lapack_int>(G.rows());
  return LAPACKE_dpotrf(LAPACK_COL_MAJOR, 'L', n, G.data(), n) == 0;
#else
  Eigen::LLT<Eigen::Ref<Mat<double>>> llt(G);
  return llt.info() == Eigen::Success;
#endif
}

/// y = G^{-1} x = L^{-T} L^{-1} x with the factor of cholesky_in_place, for Lanczos on the
/// inverse (its largest eigenvalue is 1 / λ_min(G)).
struct CholeskyInverseOp {
  using Scalar = double;
  const Mat<double>* L;
  Index rows() const { return L->rows(); }
  Index cols() const { return L->rows(); }
  void perform_op(const double* x, double* y) const {
    Eigen::Map<Vec<double>> out(y, L->rows());
    out = Eigen::Map<const Vec<double>>(x, L->rows());
    L->triangularView<Eigen::Lower>().solveInPlace(out);
    L->triangularView<Eigen::Lower>().transpose().solveInPlace(out);
  }
};

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

/// Largest eigenvalue of a symmetric operator by Lanczos; returns NaN when it does not converge.
template <typename Op>
double lanczos_largest(Op& op, Index n, const JacobianKappaOptions& jo, Index& iters,
                       double& residual) {
  if (n == 1) {
    Vec<double> one = Vec<double>::Ones(1), y(1);
    op.perform_op(one.data(), y.data());
    iters = 1;
    residual = 0;
    return y(0);
  }
  Spectra::SymEigsSolver<Op> eigs(op, 1, std::min<Index>(n, 20));
  std::mt19937_64 rng(jo.seed);
  std::normal_distribution<double> nd;
  Vec<double> v0(n);
  for (Index i = 0; i < n; ++i) v0(i) = nd(rng);
  eigs.init(v0.data());
  eigs.compute(Spectra::SortRule::LargestAlge, jo.max_iterations, jo.iter_tol);
  iters += eigs.num_iterations();
  if (eigs.info() != Spectra::CompInfo::Successful) return std::numeric_limits<double>::quiet_NaN();
  const double lam = eigs.eigenvalues()(0);
  const Vec<double> v = eigs.eigenvectors().col(0);
  Vec<double> Av(n);
  op.perform_op(v.data(), Av.data());
  residual = std::max(residual, (Av - lam * v).norm() / std::max(std::abs(lam), 1e-300));
  return lam;
}

/// B <- L^{-1} B, or L^{-T} B with `transpose`, for the lower triangular L of cholesky_in_place:
/// BLAS trsm when built with LAPACKE, else Eigen's blocked triangular solve.
template <typename = void>
inline void lower_solve(const Mat<double>& L, Mat<double>& B, bool transpose) {
#ifdef SPECTRAL_COND_HAVE_LAPACKE
  const int n = static_cast<int>(L.rows());
  cblas_dtrsm(CblasColMajor, CblasLeft, CblasLower, transpose ? CblasTrans : CblasNoTrans,
              CblasNonUnit, n, static_cast<int>(B.cols()), 1.0, L.data(), n, B.data(),
              static_cast<int>(B.rows()));
#else
  if (transpose)
    L.triangularView<Eigen::Lower>().transpose().solveInPlace(B);
  else
    L.triangularView<Eigen::Lower>().solveInPlace(B);
#endif
}

struct LobpcgOutcome {
  double sigma = std::numeric_limits<double>::quiet_NaN();  ///< smallest Ritz value of J^T
  double rho = std::numeric_limits<double>::infinity();     ///< its residual bound (see below)
  Index iterations = 0;
  bool converged = false;
};

/// σ_min of the wide J (products by `J`, one JVP or VJP per column) by LOBPCG on J J^T with the
/// preconditioner (L L^T)^{-1}, L the Cholesky factor of the computed Gram matrix G~ (MATH.md §3,
/// "Squaring is not affordable"):
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
template <typename = void>
inline LobpcgOutcome lobpcg_sigma_min(const JacobianProducts<double>& J, const Mat<double>& L,
                                      double sigma_max, const JacobianKappaOptions& jo,
                                      const std::function<void(double)>& progress) {
  const Index m = J.rows(), n = J.cols(), b = std::min(jo.lobpcg_block, m);
  const double eps = ScalarTraits<double>::eps();
  auto apply_t = [&](const Mat<double>& S, Mat<double>& Y) {  // Y = J^T S
    Y.resize(n, S.cols());
    for (Index j = 0; j < S.cols(); ++j) J.apply_transpose(S.col(j).data(), Y.col(j).data());
  };
  auto precondition = [&](Mat<double>& B) {
    lower_solve(L, B, false);
    lower_solve(L, B, true);
  };
  Mat<double> X(m, b), Y, S, YS, R, P, Xn;
  Vec<double> sig;
  // X, Y = J^T X and sig <- the b smallest Ritz triplets of span(S), ascending.
  auto rayleigh_ritz = [&]() {
    apply_t(S, YS);
    Eigen::JacobiSVD<Mat<double>> svd(YS, Eigen::ComputeThinV);
    const Index k = svd.singularValues().size(), kb = std::min(b, k);
    sig = svd.singularValues().tail(kb).reverse();
    const Mat<double> V = svd.matrixV().rightCols(kb).rowwise().reverse();
    Xn.noalias() = S * V;
    Y.noalias() = YS * V;
  };
  auto orthonormal_basis = [&](const Mat<double>& A) {  // at most m columns: all of R^m
    Eigen::HouseholderQR<Mat<double>> qr(A);
    S = qr.householderQ() * Mat<double>::Identity(A.rows(), std::min(A.cols(), A.rows()));
  };
  std::mt19937_64 rng(jo.seed);
  std::normal_distribution<double> nd;
  for (Index k = 0; k < X.size(); ++k) X.data()[k] = nd(rng);
  precondition(X);  // one step of inverse iteration with G~: the start
  orthonormal_basis(X);
  rayleigh_ritz();
  X = Xn;
  LobpcgOutcome out;
  double done = 0;  // progress: the fraction of the way from ρ = 1 to ρ = tol, never decreasing
  for (Index it = 0;; ++it) {
    R.resize(m, sig.size());
    for (Index j = 0; j < sig.size(); ++j) J.apply(Y.col(j).data(), R.col(j).data());
    for (Index j = 0; j < sig.size(); ++j) R.col(j) -= (sig(j) * sig(j)) * X.col(j);
    precondition(R);  // W
    const double previous = out.sigma;
    out.sigma = sig(0);
    out.rho = R.col(0).norm();
    out.iterations = it;
    const double floor = 16 * eps * sigma_max / sig(0);
    if (out.rho <= jo.lobpcg_tol ||
        (out.rho <= floor && std::abs(previous - out.sigma) <= 0.25 * floor * out.sigma)) {
      out.converged = true;
      return out;
    }
    if (it >= jo.lobpcg_max_iterations || !std::isfinite(out.rho)) return out;
    if (progress) {
      done = std::max(done, std::clamp(std::log(out.rho) / std::log(jo.lobpcg_tol), 0.0, 1.0));
      progress(done);
    }
    // Basis [X, W, P], W and P scaled to unit columns (zero ones dropped) so that the QR keeps
    // their directions to working precision however small the correction has become.
    Index cols = X.cols();
    Mat<double> A(m, X.cols() + R.cols() + P.cols());
    A.leftCols(X.cols()) = X;
    for (const Mat<double>* M : {&R, &P})
      for (Index j = 0; j < M->cols(); ++j) {
        const double nrm = M->col(j).norm();
        if (nrm > 0 && std::isfinite(nrm)) A.col(cols++) = M->col(j) / nrm;
      }
    orthonormal_basis(A.leftCols(cols));
    rayleigh_ritz();
    P.noalias() = Xn - X * (X.transpose() * Xn);  // the step's part outside span(X)
    X = Xn;
  }
}

}  // namespace detail

/// κ(J) by the dense SVD of the assembled J (MATH.md §3–4): the reference.
template <typename Scalar>
ConditionResult<double> kappa_jacobian_dense(const CRef<Scalar>& X, const CRef<Scalar>& WQ,
                                             const CRef<Scalar>& WK, const CRef<Scalar>& WV,
                                             const AttentionOptions<Scalar>& opts,
                                             const JacobianKappaOptions& jo = {}) {
  jo.check("kappa_jacobian_dense");
  const detail::KJInputs in = detail::kj_inputs<Scalar>(X, WQ, WK, WV, opts);
  const Mat<double> J = attention_jacobian(in.X, in.WQ, in.WK, in.WV, in.opts);
  KappaOptions<double> ko = detail::kappa_opts(jo);
  ko.svd = SvdMethod::Auto;
  ConditionResult<double> res = kappa(J, ko);
  res.method = "dense (" + res.method + " of J, " + detail::shape_str(in.rows, in.cols) + ")";
  return res;
}

namespace detail {

/// The checks every kappa_jacobian* entry point starts with: throws for bad options or shapes;
/// an InvalidInput result (with `method`) for NaN or Inf input, else empty.
/// X = 0 makes J = 0 exactly (every block of J is linear in X, MATH.md §3): the zero matrix's
/// result (rank 0, kappa = +inf), without running an iteration on a zero operator.
template <typename Scalar>
std::optional<ConditionResult<double>> zero_jacobian(const CRef<Scalar>& X, const CRef<Scalar>& WQ,
                                                     const CRef<Scalar>& WV,
                                                     const JacobianKappaOptions& jo,
                                                     const char* method) {
  if (X.size() == 0 || X.cwiseAbs().maxCoeff() != Scalar(0)) return std::nullopt;
  const Index rows = jacobian_rows(X.rows(), WV.cols());
  const Index cols = jacobian_cols(JacobianBlock::All, X.rows(), X.cols(), WQ.cols(), WV.cols());
  ConditionResult<double> res = condition_from_singular_values<double>(
      Vec<double>::Zero(std::min(rows, cols)), rows, cols, kappa_opts(jo), method);
  res.note = "X = 0, so J = 0: " + res.note;
  if (jo.progress) jo.progress(1.0);
  return res;
}

template <typename Scalar>
std::optional<ConditionResult<double>> check_kj_inputs(
    const char* fn, const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
    const CRef<Scalar>& WV, const AttentionOptions<Scalar>& opts, const JacobianKappaOptions& jo,
    const char* method) {
  jo.check(fn);
  check_attention_inputs<Scalar>(fn, X, WQ, WK, WV);
  opts.check(fn, X.rows());
  if (!(X.allFinite() && WQ.allFinite() && WK.allFinite() && WV.allFinite())) {
    auto bad = invalid_condition<double>("X or a weight contains NaN or Inf");
    bad.method = method;
    return bad;
  }
  return zero_jacobian<Scalar>(X, WQ, WV, jo, method);
}

/// kappa_jacobian_gram on inputs in double. When `factor` is given and the Cholesky route ran
/// and succeeded, the Cholesky factor of J J^T is moved there (for lobpcg, which then need not
/// form and factor J J^T again).
template <typename = void>
inline ConditionResult<double> gram_condition(const KJInputs& in, const JacobianKappaOptions& jo,
                                              Mat<double>* factor) {
  const char* which = in.wide() ? "J J^T" : "J^T J";
  Mat<double> G = in.wide() ? attention_gram(in.X, in.WQ, in.WK, in.WV, in.opts)
                            : attention_normal(in.X, in.WQ, in.WK, in.WV, in.opts);
  if (jo.progress) jo.progress(0.3);
  const Index n = G.rows();
  ConditionResult<double> res;
  // Finite inputs can still overflow (huge logits): NaN in G must not read as a zero matrix.
  if (!G.allFinite()) {
    const std::string why =
        std::string(which) + " has NaN or Inf entries (the inputs overflow double)";
    res = invalid_condition<double>(why.c_str());
    res.method = std::string("gram (") + which + ")";
    return res;
  }
  if (n <= jo.gram_eig_max) {
    Eigen::SelfAdjointEigenSolver<Mat<double>> es(G, Eigen::EigenvaluesOnly);
    res = condition_from_gram_eigenvalues(es.eigenvalues(), in.rows, in.cols, jo,
                                          std::string("gram (eigenvalues of ") + which + ")");
  } else {
    // Lanczos for λ_max(G); then G is factored in place (peak memory one G) and Lanczos on
    // G^{-1} gives λ_min(G).
    double lmax = 0;
    {
      Spectra::DenseSymMatProd<double> op(G);
      lmax = detail::lanczos_largest(op, n, jo, res.iterations, res.residual);
    }
    res.method = std::string("gram (Lanczos and Cholesky of ") + which + ")";
    res.sigma_max = std::sqrt(std::max(0.0, lmax));
    if (jo.progress) jo.progress(0.5);
    const bool pd = detail::cholesky_in_place(G);
    if (jo.progress) jo.progress(0.8);
    const double floor = std::sqrt(static_cast<double>(n) * ScalarTraits<double>::eps());
    if (!pd) {
      res.sigma_min = 0;
      res.kappa = ScalarTraits<double>::inf();
      res.sigma_min_plus = res.kappa_plus = std::numeric_limits<double>::quiet_NaN();
      res.info = Info::Singular;
      res.note = std::string("Cholesky of ") + which +
                 " failed: singular at working precision (kappa_plus needs method qr or dense)";
    } else {
      detail::CholeskyInverseOp inv{&G};
      const double linv = detail::lanczos_largest(inv, n, jo, res.iterations, res.residual);
      res.sigma_min = 1.0 / std::sqrt(linv);
      res.kappa = res.sigma_max / res.sigma_min;
      res.rank = std::min(in.rows, in.cols);
      res.sigma_min_plus = res.sigma_min;
      res.kappa_plus = res.kappa;
      if (res.sigma_min < floor * res.sigma_max) {
        res.kappa = ScalarTraits<double>::inf();
        res.info = Info::Singular;
        res.note = "sigma_min below sqrt(n eps) sigma_1: indistinguishable from zero by gram";
      }
      if (!std::isfinite(lmax) || !std::isfinite(linv)) res.info = Info::NotConverging;
      if (factor != nullptr && in.wide()) *factor = std::move(G);
    }
  }
  if (jo.progress) jo.progress(1.0);
  squared_accuracy(res, jo);
  return res;
}

}  // namespace detail

/// κ(J) from the structured Gram matrix (MATH.md §3), without forming J. Accuracy ε κ^2.
template <typename Scalar>
ConditionResult<double> kappa_jacobian_gram(const CRef<Scalar>& X, const CRef<Scalar>& WQ,
                                            const CRef<Scalar>& WK, const CRef<Scalar>& WV,
                                            const AttentionOptions<Scalar>& opts,
                                            const JacobianKappaOptions& jo = {}) {
  jo.check("kappa_jacobian_gram");
  return detail::gram_condition(detail::kj_inputs<Scalar>(X, WQ, WK, WV, opts), jo, nullptr);
}

/// κ(J) matrix-free (MATH.md §3): Lanczos through the JVP/VJP operators (operators.hpp), on
/// J J^T when J is wide and J^T J when tall. σ_max converges fast; σ_min (the smallest
/// eigenvalue) may not: then Info::NotConverging, with iterations and residual reported.
template <typename Scalar>
ConditionResult<double> kappa_jacobian_iterative(const CRef<Scalar>& X, const CRef<Scalar>& WQ,
                                                 const CRef<Scalar>& WK, const CRef<Scalar>& WV,
                                                 const AttentionOptions<Scalar>& opts,
                                                 const JacobianKappaOptions& jo = {}) {
  jo.check("kappa_jacobian_iterative");
  if (auto zero = detail::zero_jacobian<Scalar>(X, WQ, WV, jo, "iterative")) return *zero;
  const detail::KJInputs in = detail::kj_inputs<Scalar>(X, WQ, WK, WV, opts);
  ConditionResult<double> res;
  auto run = [&](auto& op) {
    const Index n = op.rows();
    res.sigma_max =
        std::sqrt(std::max(0.0, detail::lanczos_largest(op, n, jo, res.iterations, res.residual)));
    if (jo.progress) jo.progress(0.2);
    // Smallest eigenvalue: Lanczos on the shifted operator σ_1^2 I - G (largest of it).
    detail::ShiftedNegOp<std::decay_t<decltype(op)>> shifted{&op, res.sigma_max * res.sigma_max};
    const double top = detail::lanczos_largest(shifted, n, jo, res.iterations, res.residual);
    const double lmin = shifted.shift - top;
    res.sigma_min = std::sqrt(std::max(0.0, lmin));
    return std::isfinite(top);
  };
  bool converged;
  if (in.wide()) {
    GramOp<double> op(in.X, in.WQ, in.WK, in.WV, in.opts);
    converged = run(op);
    res.method = "iterative (Lanczos on J J^T, matrix-free)";
  } else {
    NormalOp<double> op(in.X, in.WQ, in.WK, in.WV, in.opts);
    converged = run(op);
    res.method = "iterative (Lanczos on J^T J, matrix-free)";
  }
  if (jo.progress) jo.progress(1.0);
  const double floor =
      std::sqrt(static_cast<double>(std::min(in.rows, in.cols)) * ScalarTraits<double>::eps());
  res.rank_tol = floor * res.sigma_max;
  if (!converged || !std::isfinite(res.sigma_max)) {
    res.info = Info::NotConverging;
    res.kappa = res.kappa_plus = res.sigma_min_plus = std::numeric_limits<double>::quiet_NaN();
    res.note = "Lanczos did not converge in " + std::to_string(jo.max_iterations) +
               " restarts (smallest eigenvalues are clustered); use method qr or gram";
    res.accuracy = ScalarTraits<double>::inf();
    return res;
  }
  if (res.sigma_min <= res.rank_tol) {
    res.kappa = ScalarTraits<double>::inf();
    res.kappa_plus = res.sigma_min_plus = std::numeric_limits<double>::quiet_NaN();
    res.info = Info::Singular;
    res.note =
        "sigma_min below sqrt(n eps) sigma_1: singular as far as a squared method can "
        "tell; kappa_plus needs method qr or dense";
  } else {
    res.kappa = res.sigma_max / res.sigma_min;
    res.sigma_min_plus = res.sigma_min;
    res.kappa_plus = res.kappa;
    res.rank = std::min(in.rows, in.cols);
  }
  detail::squared_accuracy(res, jo);
  return res;
}

namespace detail {

/// kappa_jacobian_lobpcg on inputs in double; `L`, when not empty, is the Cholesky factor of
/// J J^T that gram_condition already computed.
template <typename = void>
inline ConditionResult<double> lobpcg_condition(const KJInputs& in, const JacobianKappaOptions& jo,
                                                Mat<double> L) {
  constexpr const char* fn = "kappa_jacobian_lobpcg";
  const double nan = std::numeric_limits<double>::quiet_NaN();
  ConditionResult<double> res;
  res.method = "lobpcg";
  auto no_answer = [&](Info info, const std::string& why) {
    res.info = info;
    res.sigma_min = res.kappa = res.sigma_min_plus = res.kappa_plus = res.accuracy = nan;
    res.rank = -1;
    res.note = why;
    if (jo.progress) jo.progress(1.0);
    return res;
  };
  if (!in.wide())
    return no_answer(Info::Singular,
                     "J is tall: the gauge directions (W_Q E, -W_K E^T, 0) lie in its null space "
                     "(MATH.md 4), so kappa = +inf; the rank and kappa_plus need method qr");
  const Index m = in.rows;
  {
    GramOp<double> op(in.X, in.WQ, in.WK, in.WV, in.opts);
    JacobianKappaOptions big = jo;
    big.iter_tol = std::min(jo.iter_tol, 1e-13);
    res.sigma_max =
        std::sqrt(std::max(0.0, lanczos_largest(op, m, big, res.iterations, res.residual)));
  }
  KappaOptions<double> ko = kappa_opts(jo);
  res.rank_tol = ko.resolved_rtol(in.rows, in.cols) * res.sigma_max;
  if (!(res.sigma_max > 0) || !std::isfinite(res.sigma_max))
    return no_answer(Info::NotConverging, "Lanczos for sigma_max did not converge");
  if (jo.progress) jo.progress(0.05);
  // The preconditioner: G~ = L L^T, the structured Gram matrix (gram.hpp). When rounding has made
  // G~ indefinite (ε κ^2 well above 1), G~ cannot tell the smallest singular directions apart
  // and the iteration could settle on the wrong one: no answer then (qr is the method for it).
  std::ostringstream note;
  note << "lobpcg: block " << std::min(jo.lobpcg_block, m)
       << ", preconditioned by the Cholesky factor of J J^T (" << m << " x " << m
       << (L.rows() == m ? ", gram's" : "") << ")";
  if (L.rows() != m) {
    L = attention_gram(in.X, in.WQ, in.WK, in.WV, in.opts);
    if (jo.progress) jo.progress(0.25);
    if (!cholesky_in_place(L))
      return no_answer(Info::Singular, note.str() +
                                           ": J J^T is not positive definite at working "
                                           "precision (eps kappa^2 >~ 1, or J singular)");
  }
  if (jo.progress) jo.progress(0.55);
  const JacobianProducts<double> J(in.X, in.WQ, in.WK, in.WV, in.opts, JacobianBlock::All, fn);
  std::function<void(double)> inner;
  if (jo.progress) inner = [&](double f) { jo.progress(0.55 + 0.45 * f); };
  const LobpcgOutcome lo = lobpcg_sigma_min(J, L, res.sigma_max, jo, inner);
  res.iterations += lo.iterations;
  res.residual = lo.rho;
  note << "; " << lo.iterations << " iterations, residual bound rho = " << lo.rho;
  // A Ritz value bounds σ_min from above, converged or not: at or below the rank tolerance, J is
  // numerically singular.
  if (!(lo.sigma > res.rank_tol))
    return no_answer(Info::Singular, note.str() + ": sigma_min <= " + std::to_string(lo.sigma) +
                                         " is not above the rank tolerance; the rank and "
                                         "kappa_plus need method qr or dense");
  if (!lo.converged)
    return no_answer(Info::NotConverging, note.str() + ": did not converge in " +
                                              std::to_string(jo.lobpcg_max_iterations) +
                                              " iterations (raise lobpcg_max_iterations or "
                                              "lobpcg_block, or use method qr)");
  res.sigma_min = lo.sigma;
  res.kappa = res.kappa_plus = res.sigma_max / res.sigma_min;
  res.sigma_min_plus = res.sigma_min;
  res.rank = std::min(in.rows, in.cols);
  // ε κ from the products with J; ρ / 2 from the iteration, times 1 + ε κ^2 for the distance of
  // the preconditioner from (J J^T)^{-1} (lobpcg_sigma_min).
  const double eps_kappa = ScalarTraits<double>::eps() * res.kappa;
  res.accuracy = eps_kappa + (1 + eps_kappa * res.kappa) * lo.rho / 2;
  res.info = Info::Success;
  res.note = note.str();
  if (jo.progress) jo.progress(1.0);
  return res;
}

}  // namespace detail

/// κ(J) of a wide J (N d_v <= columns) by the lobpcg method (top of this header; MATH.md §3-4):
/// σ_max by Lanczos on J J^T (matrix-free; squaring does not hurt the largest), σ_min by
/// detail::lobpcg_sigma_min with the Cholesky factor of the structured Gram matrix as
/// preconditioner. Accuracy about ε κ(J) + (1 + ε κ(J)^2) ρ / 2 (field `accuracy`; ρ in
/// `residual`): ε κ where ε κ^2 is small, more where the preconditioner is poor. Cost: the
/// Gram matrix, one Cholesky factorisation ((N d_v)^3 / 3 flops, (N d_v)^2 doubles) and a few
/// LOBPCG iterations of O((N d_v)^2 block) each.
/// It answers (Info::Success) only when the iteration converges and σ_min is above the rank
/// tolerance. Otherwise it says why and leaves kappa NaN: Info::Singular when J is tall (the
/// gauge directions are in its null space, MATH.md §4), when the computed J J^T is not positive
/// definite (ε κ^2 well above 1, or J singular), or when σ_min is below the rank tolerance (rank
/// and kappa_plus then need qr or dense); Info::NotConverging when the iteration does not
/// converge. kappa_jacobian with method lobpcg or auto then calls qr.
template <typename Scalar>
ConditionResult<double> kappa_jacobian_lobpcg(const CRef<Scalar>& X, const CRef<Scalar>& WQ,
                                              const CRef<Scalar>& WK, const CRef<Scalar>& WV,
                                              const AttentionOptions<Scalar>& opts,
                                              const JacobianKappaOptions& jo = {}) {
  if (auto bad = detail::check_kj_inputs<Scalar>("kappa_jacobian_lobpcg", X, WQ, WK, WV, opts, jo,
                                                 "lobpcg"))
    return *bad;
  return detail::lobpcg_condition(detail::kj_inputs<Scalar>(X, WQ, WK, WV, opts), jo, {});
}

/// κ(J) by the method in `jo` (MATH.md §3–4); see the top of this header for what each does.
template <typename Scalar>
ConditionResult<double> kappa_jacobian(const CRef<Scalar>& X, const CRef<Scalar>& WQ,
                                       const CRef<Scalar>& WK, const CRef<Scalar>& WV,
                                       const AttentionOptions<Scalar>& opts,
                                       const JacobianKappaOptions& jo = {}) {
  if (auto bad = detail::check_kj_inputs<Scalar>("kappa_jacobian", X, WQ, WK, WV, opts, jo,
                                                 to_string(jo.method)))
    return *bad;
  // κ(J) is the same for (X / s, W s) (Q, K, V and P do not change; J scales by 1 / s,
  // MATH.md §3). With s the power of two at the top of max |X| the rescaling is exact, and every
  // method then works on X of order 1: no overflow or underflow in J or J J^T from the scale of
  // X alone, and one answer for every scale. The singular values are scaled back.
  {
    int e = 0;
    (void)std::frexp(static_cast<double>(X.cwiseAbs().maxCoeff()), &e);
    if (e != 1) {
      const Mat<Scalar> Xs = X * static_cast<Scalar>(std::ldexp(1.0, 1 - e));
      const Scalar up = static_cast<Scalar>(std::ldexp(1.0, e - 1));
      const Mat<Scalar> Qs = WQ * up, Ks = WK * up, Vs = WV * up;
      if (Xs.allFinite() && Qs.allFinite() && Ks.allFinite() && Vs.allFinite()) {
        ConditionResult<double> r = kappa_jacobian<Scalar>(Xs, Qs, Ks, Vs, opts, jo);
        const double s = std::ldexp(1.0, e - 1);
        r.sigma_max *= s;
        r.sigma_min *= s;
        r.sigma_min_plus *= s;
        r.rank_tol *= s;
        return r;
      }
    }
  }
  const detail::KJInputs in = detail::kj_inputs<Scalar>(X, WQ, WK, WV, opts);
  auto qr = [&] {
    QrKappaOptions qo;
    qo.rtol = jo.rtol;
    qo.progress = jo.progress;
    qo.seed = jo.seed;
    return kappa_jacobian_qr<double>(in.X, in.WQ, in.WK, in.WV, in.opts, qo);
  };
  switch (jo.method) {
    case JacobianKappaMethod::Dense:
      return kappa_jacobian_dense<Scalar>(X, WQ, WK, WV, opts, jo);
    case JacobianKappaMethod::Gram:
      return detail::gram_condition(in, jo, nullptr);
    case JacobianKappaMethod::Iterative:
      return kappa_jacobian_iterative<Scalar>(X, WQ, WK, WV, opts, jo);
    case JacobianKappaMethod::Qr:
      return qr();
    case JacobianKappaMethod::Lobpcg:
    case JacobianKappaMethod::Auto:
      break;
  }
  // lobpcg where it answers, else qr (kappa_jacobian_lobpcg's comment says when it does not).
  Mat<double> factor;  // J J^T's Cholesky factor when gram computed it, for lobpcg
  std::ostringstream why;
  auto accurate = [&] {
    ConditionResult<double> r = detail::lobpcg_condition(in, jo, std::move(factor));
    // qr's accuracy is about ε κ: lobpcg's answer stands when it is within 100 ε κ or tol.
    const double good_enough = std::max(jo.tol, 100 * ScalarTraits<double>::eps() * r.kappa);
    if (r.info == Info::Success && r.accuracy <= good_enough) {
      why << "lobpcg answered";
      return r;
    }
    if (r.info == Info::Success)
      why << "lobpcg's stated accuracy " << r.accuracy
          << " exceeds max(tol, 100 eps kappa) = " << good_enough << ", so qr";
    else
      why << "lobpcg did not answer (" << r.note << "), so qr";
    return qr();
  };
  if (jo.method == JacobianKappaMethod::Lobpcg) {
    ConditionResult<double> res = accurate();
    if (res.method != "lobpcg") res.note = why.str() + "; " + res.note;
    return res;
  }
  const Index rows = jacobian_rows(X.rows(), WV.cols());
  const Index cols = jacobian_cols(JacobianBlock::All, X.rows(), X.cols(), WQ.cols(), WV.cols());
  ConditionResult<double> res;
  if (rows * cols <= jo.dense_max_entries) {
    res = kappa_jacobian_dense<Scalar>(X, WQ, WK, WV, opts, jo);
    why << "auto chose dense: J has " << rows * cols << " <= " << jo.dense_max_entries
        << " entries";
  } else {
    res = detail::gram_condition(in, jo, &factor);
    if (res.info != Info::InvalidInput && res.accuracy <= jo.tol) {
      why << "auto chose gram: its error estimate eps*kappa^2 = " << res.accuracy
          << " is below tol = " << jo.tol;
    } else {
      why << "auto chose an accurate method: gram's error estimate eps*kappa^2 = " << res.accuracy
          << " exceeds tol = " << jo.tol << "; ";
      if (rows <= cols) {
        res = accurate();
      } else {
        why << "J is tall, so qr";
        res = qr();
      }
    }
  }
  res.note = res.note.empty() ? why.str() : why.str() + "; " + res.note;
  return res;
}

/// By-value convenience form.
template <typename DX, typename DQ, typename DK, typename DV>
ConditionResult<double> kappa_jacobian(const Eigen::MatrixBase<DX>& X,
                                       const Eigen::MatrixBase<DQ>& WQ,
                                       const Eigen::MatrixBase<DK>& WK,
                                       const Eigen::MatrixBase<DV>& WV,
                                       const AttentionOptions<typename DX::Scalar>& opts = {},
                                       const JacobianKappaOptions& jo = {}) {
  return kappa_jacobian<typename DX::Scalar>(X, WQ, WK, WV, opts, jo);
}

#ifdef SPECTRAL_COND_EXTERN_INSTANCES  // see the end of bound.hpp
#define SPECTRAL_COND_KAPPA_JACOBIAN(EXTERN, S)                                                   \
  EXTERN template ConditionResult<double> kappa_jacobian<S>(                                      \
      const CRef<S>&, const CRef<S>&, const CRef<S>&, const CRef<S>&, const AttentionOptions<S>&, \
      const JacobianKappaOptions&);
SPECTRAL_COND_KAPPA_JACOBIAN(extern, float)
SPECTRAL_COND_KAPPA_JACOBIAN(extern, double)
#endif

}  // namespace spectral_cond
