// spectral_cond: what every κ(J) method shares (MATH.md §12): the inputs converted to double once,
// the input checks, the rank tolerance, and the reading of Gram eigenvalues with the limits of a
// method that squares J.
#pragma once

#include "spectral_cond/conditioning/kappa.hpp"
#include "spectral_cond/conditioning/methods/options.hpp"
#include "spectral_cond/jacobian/gram.hpp"
#include "spectral_cond/jacobian/jacobian.hpp"
#include "spectral_cond/jacobian/operators.hpp"
#include "spectral_cond/linalg/lanczos.hpp"

#include <Eigen/Cholesky>

#include <algorithm>
#include <cmath>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>

namespace spectral_cond {

namespace detail {

struct KJInputs {
  Mat<double> X, WQ, WK, WV;
  AttentionOptions<double> opts;
  Index rows = 0, cols = 0;
  bool wide() const { return rows <= cols; }
};

inline AttentionOptions<double> to_double(const AttentionOptions<double>& o) {
  return o;
}

/// Every option in double: scale, mask, biases and RoPE.
template <typename Scalar>
AttentionOptions<double> to_double(const AttentionOptions<Scalar>& o) {
  AttentionOptions<double> d;
  if (o.scale) d.scale = static_cast<double>(*o.scale);
  d.mask = o.mask;
  d.additive_mask = o.additive_mask.template cast<double>();
  d.bias_q = o.bias_q.template cast<double>();
  d.bias_k = o.bias_k.template cast<double>();
  d.bias_v = o.bias_v.template cast<double>();
  d.rope = o.rope;
  return d;
}

template <typename Scalar>
KJInputs kj_inputs(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                   const CRef<Scalar>& WV, const AttentionOptions<Scalar>& o) {
  KJInputs in;
  in.X = X.template cast<double>();
  in.WQ = WQ.template cast<double>();
  in.WK = WK.template cast<double>();
  in.WV = WV.template cast<double>();
  in.opts = to_double(o);
  // The default scale 1/sqrt(d_k) in double, as qr and dense take it: resolved in float it
  // differs by 1e-8, and the answers of the methods with it (the certificate caught it).
  in.opts.scale = in.opts.resolved_scale(WQ.cols());
  in.rows = jacobian_rows(X.rows(), WV.cols());
  in.cols = jacobian_cols(JacobianBlock::All, X.rows(), X.cols(), WQ.cols(), WV.cols());
  return in;
}

inline KappaOptions<double> kappa_opts(const JacobianKappaOptions& jo) {
  KappaOptions<double> k;
  k.rtol = jo.rtol;
  return k;
}

/// A squared method's singular verdict that it cannot make: at its resolution sqrt(n ε) σ_1 a
/// small σ of a nonsingular J and rounding noise look alike, and an uncertain rank is never a
/// `singular` verdict (ConditionResult). The answer becomes a decline (Inaccurate, κ and σ_min
/// NaN) that says why and what to use.
inline void gram_undecided(ConditionResult<double>& res, const std::string& why) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::ostringstream s;
  s << "cannot tell a singular J from one with kappa above about " << res.sigma_max / res.rank_tol
    << ": its smallest singular values lie at its resolution " << res.rank_tol << " (" << why
    << "); use method qr or dense";
  res.info = Info::Inaccurate;
  res.kappa = res.sigma_min = res.kappa_plus = res.sigma_min_plus = nan;
  res.rank = -1;
  res.rank_certain = false;
  res.note = s.str();
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
  if (res.info == Info::Singular && res.rank > 0 && !res.rank_certain)
    gram_undecided(res, "a singular value lies within the rank certificate's margin of it");
  return res;
}

/// Fills accuracy = ε κ^2 for the squared methods, and flags a meaningless answer.
inline void squared_accuracy(ConditionResult<double>& res, const JacobianKappaOptions& jo) {
  if (res.info == Info::InvalidInput) return;
  const double eps = ScalarTraits<double>::eps();
  std::ostringstream s;
  if (res.info == Info::Singular) {
    // ConditionResult's contract: a singular answer's sigma_min is rounding noise, so its
    // accuracy is +inf. What is known is kappa_plus, to about eps kappa_plus^2.
    res.accuracy = ScalarTraits<double>::inf();
    s << "squares J: singular at its resolution sqrt(n eps) sigma_1, so sigma_min is only known "
         "to lie below the rank tolerance";
    if (std::isfinite(res.kappa_plus))
      s << "; kappa_plus has relative error about eps*kappa_plus^2 = "
        << eps * res.kappa_plus * res.kappa_plus;
    res.note = res.note.empty() ? s.str() : s.str() + "; " + res.note;
    return;
  }
  const double k = res.kappa;
  res.accuracy = std::isfinite(k) ? eps * k * k : ScalarTraits<double>::inf();
  s << "squares J: sigma_min has relative error about eps*kappa^2 = " << res.accuracy;
  if (res.accuracy >= 1) {
    if (res.info == Info::Success) res.info = Info::Inaccurate;
    s << " >= 1, so sigma_min and kappa are meaningless here; use method qr";
  } else if (res.accuracy > jo.tol) {
    s << ", above the requested tol " << jo.tol << "; method qr is accurate to eps*kappa";
  }
  res.note = res.note.empty() ? s.str() : s.str() + "; " + res.note;
}

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

/// Inputs so large that Q, K, V, the logits c Q K^T or the query-key blocks of J (products
/// c X K V and c X Q V, MATH.md §3) overflow double would put NaN or Inf into J: refused before
/// any method runs (Info::InvalidInput, with the reason), never a result of NaN arithmetic.
inline std::optional<ConditionResult<double>> overflowing(const KJInputs& in, const char* method) {
  Mat<double> Q = in.X * in.WQ, K = in.X * in.WK, V = in.X * in.WV;
  if (in.opts.bias_q.size() > 0) Q.rowwise() += in.opts.bias_q.transpose();
  if (in.opts.bias_k.size() > 0) K.rowwise() += in.opts.bias_k.transpose();
  if (in.opts.bias_v.size() > 0) V.rowwise() += in.opts.bias_v.transpose();
  const char* what = nullptr;
  if (!(Q.allFinite() && K.allFinite() && V.allFinite())) {
    what = "X W_Q, X W_K or X W_V overflows double";
  } else {
    const double c = std::abs(in.opts.resolved_scale(in.WQ.cols()));
    const double n = static_cast<double>(in.X.rows());
    const double mx = in.X.cwiseAbs().maxCoeff(), mq = Q.cwiseAbs().maxCoeff(),
                 mk = K.cwiseAbs().maxCoeff(), mv = V.cwiseAbs().maxCoeff();
    if (!Mat<double>(c * (Q * K.transpose())).allFinite())
      what = "the logits c Q K^T overflow double";
    else if (!std::isfinite(4 * c * n * mx * mv * std::max(mq, mk)))
      what = "the query-key blocks of J (products c X K V and c X Q V) overflow double";
  }
  if (what == nullptr) return std::nullopt;
  ConditionResult<double> bad = invalid_condition<double>(what);
  bad.method = method;
  bad.note = std::string(what) + ": NaN or Inf would enter J (are the inputs very large?)";
  return bad;
}

/// The single-method entry points do not reparametrise (only kappa_jacobian does).
inline void refuse_include_biases(const char* fn, const JacobianKappaOptions& jo) {
  if (jo.include_biases)
    fail(fn,
         "include_biases is applied by kappa_jacobian; pass with_bias_parameters' inputs "
         "to a single method");
}

/// The checks every kappa_jacobian* entry point starts with: throws for bad options or shapes;
/// an InvalidInput result (with `method`) for NaN or Inf input, else empty.
template <typename Scalar>
std::optional<ConditionResult<double>> check_kj_inputs(
    const char* fn, const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
    const CRef<Scalar>& WV, const AttentionOptions<Scalar>& opts, const JacobianKappaOptions& jo,
    const char* method) {
  jo.check(fn);
  refuse_include_biases(fn, jo);
  check_attention_inputs<Scalar>(fn, X, WQ, WK, WV);
  opts.check(fn, X.rows());
  opts.check_projections(fn, WQ.cols(), WK.cols(), WV.cols(), WQ.cols());
  if (!(X.allFinite() && WQ.allFinite() && WK.allFinite() && WV.allFinite())) {
    auto bad = invalid_condition<double>("X or a weight contains NaN or Inf");
    bad.method = method;
    return bad;
  }
  return zero_jacobian<Scalar>(X, WQ, WV, jo, method);
}

/// A lower bound on σ_max(J) by `iterations` steps of the power method on J J^T (one JVP and one
/// VJP each, matrix-free) from a seeded start: ||J^T x|| for a unit x never exceeds σ_max.
template <typename = void>
inline double sigma_max_lower_bound(const KJInputs& in, Index iterations, std::uint64_t seed) {
  const JacobianProducts<double> J(in.X, in.WQ, in.WK, in.WV, in.opts, JacobianBlock::All,
                                   "sigma_max_lower_bound");
  Rng rng(seed);
  Vec<double> x(J.rows()), y(J.cols());
  for (Index i = 0; i < x.size(); ++i) x(i) = rng.normal();
  double best = 0;
  for (Index it = 0; it < iterations; ++it) {
    const double nx = x.norm();
    if (!(nx > 0) || !std::isfinite(nx)) break;
    x /= nx;
    J.apply_transpose(x.data(), y.data());
    best = std::max(best, y.norm());
    J.apply(y.data(), x.data());
  }
  return best;
}

// The products backend of the methods that iterate with J itself (lobpcg, matfree; MATH.md §12):
// any class P whose objects offer
//   Index rows() const;                                       m = N d_v
//   Index cols() const;                                       n = D (2 d_k + d_v)
//   void apply(const double* x, double* y) const;             y = J x    (x: n, y: m)
//   void apply_transpose(const double* x, double* y) const;   y = J^T x  (x: m, y: n)
// JacobianProducts<double> (operators.hpp, one JVP or VJP on the CPU) is the host's;
// cuda::detail::DeviceProducts (cuda/backends.cuh) computes the same products on a GPU, so that
// the drivers (LobpcgRun, lobpcg_sigma_min, matfree_condition) run unchanged on either.

/// y = J J^T x by one VJP then one JVP through an existing products backend (the operator of
/// GramOp without a second forward pass), for Lanczos.
template <typename Products>
struct ProductsGram {
  using Scalar = double;
  explicit ProductsGram(const Products& J) : J_(J), t_(J.cols()) {}
  Index rows() const { return J_.rows(); }
  Index cols() const { return J_.rows(); }
  void perform_op(const double* x, double* y) const {
    J_.apply_transpose(x, t_.data());
    J_.apply(t_.data(), y);
  }

 private:
  const Products& J_;
  mutable Vec<double> t_;
};

/// What the methods that run LOBPCG on J J^T (lobpcg, matfree) share: the declines, σ_max by
/// Lanczos, and the answer once σ_min is found.
struct LobpcgRun {
  ConditionResult<double> res;
  const JacobianKappaOptions& jo;
  KappaOptions<double> ko;

  LobpcgRun(const char* method, const JacobianKappaOptions& o) : jo(o), ko(kappa_opts(o)) {
    res.method = method;
  }

  /// No answer: σ_min, κ and the accuracy NaN, the rank unknown (-1), `why` in the note. For
  /// Info::Singular κ is +inf (MATH.md §4: a singular J is +inf, never NaN), σ_min the value
  /// found at or below the rank tolerance (`sigma_min`, an upper bound; 0 where it is exact) and
  /// the accuracy +inf; κ₊ and the rank still need qr or dense.
  ConditionResult<double> decline(Info info, const std::string& why,
                                  double sigma_min = std::numeric_limits<double>::quiet_NaN()) {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    res.info = info;
    res.sigma_min = res.kappa = res.sigma_min_plus = res.kappa_plus = res.accuracy = nan;
    if (info == Info::Singular) {
      res.kappa = std::numeric_limits<double>::infinity();
      res.sigma_min = sigma_min;
      res.accuracy = sigma_min == 0 ? 0.0 : std::numeric_limits<double>::infinity();
    }
    res.rank = -1;
    res.note = why;
    if (jo.progress) jo.progress(1.0);
    return res;
  }

  /// A tall J: κ = +inf by the gauge directions, which LOBPCG on J J^T cannot show. σ_max is
  /// not computed (NaN).
  ConditionResult<double> decline_tall() {
    res.sigma_max = std::numeric_limits<double>::quiet_NaN();
    return decline(Info::Singular,
                   "J is tall: the gauge directions (W_Q E, -W_K E^T, 0) lie in its null space "
                   "(MATH.md 4), so kappa = +inf exactly; the rank and kappa_plus need method qr",
                   0.0);
  }

  /// σ_max by Lanczos on J J^T (tolerance at most 1e-13; squaring does not hurt the largest) and
  /// the rank tolerance. False when Lanczos did not converge. J: a products backend (above).
  template <typename Products>
  bool find_sigma_max(const Products& J, Index rows, Index cols) {
    ProductsGram<Products> op(J);
    LanczosOptions lo = jo.lanczos;
    lo.tol = std::min(lo.tol, 1e-13);
    const LanczosOutcome big = lanczos_largest(op, lo);
    res.iterations += big.iterations;
    res.residual = big.residual;
    res.sigma_max = big.converged ? std::sqrt(std::max(0.0, big.lambda))
                                  : std::numeric_limits<double>::quiet_NaN();
    res.rank_tol = ko.resolved_rtol(rows, cols) * res.sigma_max;
    return res.sigma_max > 0 && std::isfinite(res.sigma_max);
  }

  /// The decline when the Ritz value `sigma`, an upper bound on σ_min converged or not, is at or
  /// below the rank tolerance: J is numerically singular.
  std::optional<ConditionResult<double>> decline_if_rank_level(double sigma,
                                                               const std::string& note) {
    if (sigma > res.rank_tol) return std::nullopt;
    return decline(Info::Singular,
                   note + ": sigma_min <= " + std::to_string(sigma) +
                       " is not above the rank tolerance, so kappa = +inf; the rank and "
                       "kappa_plus need method qr or dense",
                   std::max(sigma, 0.0));
  }

  /// The answer σ_min: κ = κ₊, full rank with its certificate.
  ConditionResult<double> answer(double sigma_min, double accuracy, Index rows, Index cols,
                                 const std::string& note) {
    res.sigma_min = res.sigma_min_plus = sigma_min;
    res.kappa = res.kappa_plus = res.sigma_max / sigma_min;
    res.rank = std::min(rows, cols);
    certify_rank(res, sigma_min, 0.0, ko.rank_margin);
    res.accuracy = accuracy;
    res.info = Info::Success;
    res.note = note;
    if (jo.progress) jo.progress(1.0);
    return res;
  }
};

/// The largest order of J J^T (or J^T J) at which an iterative answer's σ_min is certified as
/// the smallest by a factorisation: 3000, a 72 MB matrix and about 1e10 flops.
inline constexpr Index certify_max_order = 3000;

/// An iterative method's residual bound says that an eigenvalue of J J^T lies near σ_min^2, not
/// that none lies below it: Lanczos can converge to a neighbour of the smallest (MATH.md §12).
/// Where J J^T (J^T J when J is tall) has order <= certify_max_order this forms it (structured,
/// jacobian/gram.hpp) and certifies that no eigenvalue lies below θ = (σ_min (1 - a))^2 - δ, a
/// the stated accuracy and δ = 16 (m + n) ε σ_1^2 the rounding of the formed matrix (J m x n)
/// and of its factorisation: a Cholesky
/// factorisation of G - θ I succeeds exactly when G - θ I is positive definite (an inertia count
/// of zero). Returns the reason to decline when it fails; otherwise adds what was certified, or
/// the assumption left unchecked (order above the limit, or σ_min^2 below δ), to the note.
/// A template only so that a translation unit that does not call it does not compile it (it
/// instantiates the structured Gram matrices and a Cholesky factorisation).
template <typename = void>
std::string certify_smallest(const KJInputs& in, ConditionResult<double>& res) {
  const Index g = std::min(in.rows, in.cols);
  const double eps = ScalarTraits<double>::eps();
  const double a = std::min(res.accuracy, 0.5);
  const double delta =
      16 * static_cast<double>(in.rows + in.cols) * eps * res.sigma_max * res.sigma_max;
  const double theta = res.sigma_min * (1 - a) * res.sigma_min * (1 - a) - delta;
  std::ostringstream s;
  auto assumed = [&](const std::string& why) {
    s << "sigma_min assumed the smallest (an iteration's residual bounds the distance to an "
         "eigenvalue, not which one; "
      << why << ")";
    res.note = res.note.empty() ? s.str() : res.note + "; " + s.str();
    return std::string();
  };
  if (g > certify_max_order)
    return assumed("a certificate is made up to order " + std::to_string(certify_max_order) +
                   ", this J J^T has order " + std::to_string(g));
  if (!(theta > 0))
    return assumed(
        "sigma_min^2 lies within the rounding of J J^T, below what a factorisation "
        "of it can certify");
  Mat<double> G = in.wide() ? attention_gram(in.X, in.WQ, in.WK, in.WV, in.opts)
                            : attention_normal(in.X, in.WQ, in.WK, in.WV, in.opts);
  G.diagonal().array() -= theta;
  const Eigen::LLT<Mat<double>> llt(G);
  if (llt.info() != Eigen::Success) {
    s << "an eigenvalue of " << (in.wide() ? "J J^T" : "J^T J") << " lies below (sigma_min (1 - "
      << "accuracy))^2 = " << theta + delta << " (its Cholesky factorisation shifted by that "
      << "fails): the method converged to a singular value that is not the smallest";
    return s.str();
  }
  s << "certified the smallest: " << (in.wide() ? "J J^T" : "J^T J")
    << " - theta I with theta = " << theta << " is positive definite (Cholesky)";
  res.note = res.note.empty() ? s.str() : res.note + "; " + s.str();
  return {};
}

/// Every κ(J) result is checked before it leaves the library (MATH.md §12): a success must have
/// σ_max >= σ_min >= 0, finite, κ >= 1 (up to its stated accuracy), and a σ_max that is not
/// below the matrix-free power-method bound on σ_max(J) (by more than rounding). A result that
/// fails is declined: Info::Inaccurate with NaN numbers and a note that says which check failed.
template <typename = void>
inline ConditionResult<double> validated(const KJInputs& in, ConditionResult<double> res,
                                         const JacobianKappaOptions& jo) {
  // Only answers are checked: a success, or "singular" with kappa = +inf. A declined result
  // (NaN kappa) has nothing to check.
  if (!(res.info == Info::Success || (res.info == Info::Singular && std::isinf(res.kappa))))
    return res;
  // A singular verdict without σ_max (a tall J, found singular by its structure) has no number
  // to check.
  if (res.info == Info::Singular && std::isnan(res.sigma_max)) return res;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::ostringstream why;
  const double eps = ScalarTraits<double>::eps();
  if (!(std::isfinite(res.sigma_max) && res.sigma_max >= 0))
    why << "sigma_max = " << res.sigma_max << " is not a finite nonnegative number";
  else if (res.info == Info::Success &&
           !(std::isfinite(res.sigma_min) && res.sigma_min > 0 && res.sigma_min <= res.sigma_max))
    why << "sigma_min = " << res.sigma_min << " is not in (0, sigma_max = " << res.sigma_max << "]";
  else if (res.info == Info::Success && !(res.kappa >= 1))
    why << "kappa = " << res.kappa << " < 1";
  if (why.str().empty()) {
    const double lower = sigma_max_lower_bound(in, 8, jo.lanczos.seed + 7);
    const double slack = 64 * eps * static_cast<double>(std::max(in.rows, in.cols));
    if (res.sigma_max < lower * (1 - slack))
      why << "sigma_max = " << res.sigma_max << " is below the power-method bound " << lower
          << " on sigma_max(J)";
  }
  // Iterative answers (iterations > 0): nothing below σ_min, or declined.
  if (why.str().empty() && res.info == Info::Success && res.iterations > 0)
    why << certify_smallest(in, res);
  if (why.str().empty()) return res;
  ConditionResult<double> bad = res;
  bad.sigma_max = bad.sigma_min = bad.kappa = bad.sigma_min_plus = bad.kappa_plus = nan;
  bad.accuracy = nan;
  bad.rank = -1;
  bad.info = Info::Inaccurate;
  bad.note = "declined: the result failed validation (" + why.str() + "); " + res.note;
  return bad;
}

}  // namespace detail
}  // namespace spectral_cond
