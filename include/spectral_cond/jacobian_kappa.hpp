// spectral_cond: κ(J) of an attention block by four methods, each saying what it computed and
// how accurate it is (MATH.md §3–4).
//
//   dense      SVD of the assembled J. The reference; accuracy about ε κ(J); small sizes only.
//   gram       eigenvalues of the structured Gram J J^T (or J^T J when J is tall), never forming
//              J. Squares J: σ_min has relative error about ε κ(J)^2 (MATH.md §3, "Squaring is
//              not affordable"), and singular values below about sqrt(n ε) σ_1 cannot be told
//              from zero.
//   iterative  matrix-free Lanczos (Spectra) on J J^T or J^T J through the JVP/VJP operators;
//              squares J too, and σ_min may not converge: then Info::NotConverging.
//   qr         QR of the compressed Jacobian (MATH.md §3, "The compressed Jacobian"), then the
//              triangular factor: backward stable, accuracy about ε κ(J).
//   auto       dense when J is small; else gram when its own error estimate ε κ^2 is below the
//              requested tolerance, otherwise qr. The note says which and why.
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

#include <functional>
#include <random>

// Functions on double alone are written `template <typename = void>`: they are then compiled
// only in the translation units that call them, not in every one that includes this header.
namespace spectral_cond {

enum class JacobianKappaMethod { Auto, Dense, Gram, Iterative, Qr };

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
  }
  return "unknown";
}

/// Parses "auto", "dense", "gram", "iterative" or "qr"; throws std::invalid_argument otherwise.
inline JacobianKappaMethod parse_jacobian_kappa_method(const std::string& s) {
  for (auto m : {JacobianKappaMethod::Auto, JacobianKappaMethod::Dense, JacobianKappaMethod::Gram,
                 JacobianKappaMethod::Iterative, JacobianKappaMethod::Qr})
    if (s == to_string(m)) return m;
  throw std::invalid_argument("method: unknown '" + s +
                              "' (expected auto, dense, gram, iterative or qr)");
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
  /// Seed of the random start vectors (deterministic by default).
  std::uint64_t seed = 42;
  /// Called with the fraction done, for progress bars; may be empty.
  std::function<void(double)> progress;

  void check(const char* fn) const {
    if (!(tol > 0)) detail::fail(fn, "tol must be > 0");
    if (!(rtol < 1)) detail::fail(fn, "rtol must be < 1 (or < 0 for the default)");
    if (dense_max_entries < 0 || gram_eig_max < 1 || max_iterations < 1 || !(iter_tol > 0))
      detail::fail(fn, "dense_max_entries, gram_eig_max, max_iterations and iter_tol must be > 0");
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

/// κ(J) from the structured Gram matrix (MATH.md §3), without forming J. Accuracy ε κ^2.
template <typename Scalar>
ConditionResult<double> kappa_jacobian_gram(const CRef<Scalar>& X, const CRef<Scalar>& WQ,
                                            const CRef<Scalar>& WK, const CRef<Scalar>& WV,
                                            const AttentionOptions<Scalar>& opts,
                                            const JacobianKappaOptions& jo = {}) {
  jo.check("kappa_jacobian_gram");
  const detail::KJInputs in = detail::kj_inputs<Scalar>(X, WQ, WK, WV, opts);
  const char* which = in.wide() ? "J J^T" : "J^T J";
  Mat<double> G = in.wide() ? attention_gram(in.X, in.WQ, in.WK, in.WV, in.opts)
                            : attention_normal(in.X, in.WQ, in.WK, in.WV, in.opts);
  if (jo.progress) jo.progress(0.3);
  const Index n = G.rows();
  ConditionResult<double> res;
  if (n <= jo.gram_eig_max) {
    Eigen::SelfAdjointEigenSolver<Mat<double>> es(G, Eigen::EigenvaluesOnly);
    res = detail::condition_from_gram_eigenvalues(
        es.eigenvalues(), in.rows, in.cols, jo, std::string("gram (eigenvalues of ") + which + ")");
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
    }
  }
  if (jo.progress) jo.progress(1.0);
  detail::squared_accuracy(res, jo);
  return res;
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

/// κ(J) by the method in `jo` (MATH.md §3–4); see the top of this header for what each does.
template <typename Scalar>
ConditionResult<double> kappa_jacobian(const CRef<Scalar>& X, const CRef<Scalar>& WQ,
                                       const CRef<Scalar>& WK, const CRef<Scalar>& WV,
                                       const AttentionOptions<Scalar>& opts,
                                       const JacobianKappaOptions& jo = {}) {
  constexpr const char* fn = "kappa_jacobian";
  jo.check(fn);
  detail::check_attention_inputs<Scalar>(fn, X, WQ, WK, WV);
  opts.check(fn, X.rows());
  if (!X.allFinite() || !WQ.allFinite() || !WK.allFinite() || !WV.allFinite()) {
    auto bad = detail::invalid_condition<double>("X or a weight contains NaN or Inf");
    bad.method = to_string(jo.method);
    return bad;
  }
  auto qr = [&] {
    const detail::KJInputs in = detail::kj_inputs<Scalar>(X, WQ, WK, WV, opts);
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
      return kappa_jacobian_gram<Scalar>(X, WQ, WK, WV, opts, jo);
    case JacobianKappaMethod::Iterative:
      return kappa_jacobian_iterative<Scalar>(X, WQ, WK, WV, opts, jo);
    case JacobianKappaMethod::Qr:
      return qr();
    case JacobianKappaMethod::Auto:
      break;
  }
  const Index rows = jacobian_rows(X.rows(), WV.cols());
  const Index cols = jacobian_cols(JacobianBlock::All, X.rows(), X.cols(), WQ.cols(), WV.cols());
  std::ostringstream why;
  ConditionResult<double> res;
  if (rows * cols <= jo.dense_max_entries) {
    res = kappa_jacobian_dense<Scalar>(X, WQ, WK, WV, opts, jo);
    why << "auto chose dense: J has " << rows * cols << " <= " << jo.dense_max_entries
        << " entries";
  } else {
    res = kappa_jacobian_gram<Scalar>(X, WQ, WK, WV, opts, jo);
    if (res.info != Info::InvalidInput && res.accuracy <= jo.tol) {
      why << "auto chose gram: its error estimate eps*kappa^2 = " << res.accuracy
          << " is below tol = " << jo.tol;
    } else {
      why << "auto chose qr: gram's error estimate eps*kappa^2 = " << res.accuracy
          << " exceeds tol = " << jo.tol;
      res = qr();
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
