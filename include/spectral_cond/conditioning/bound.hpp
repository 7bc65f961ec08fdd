// spectral_cond: the paper's Theorem 3.4 evaluated term by term (MATH.md §5), never assumed:
//
//   kappa(J) <= kappa(X)^3 · kappa(𝚲) · kappa(W_V) · (kappa(W_Q) + kappa(W_K)) + kappa(X) ·
//   kappa(P)
//
// Every factor, the bound and the true kappa(J) are computed and compared. Since 𝚲 is always
// singular (Λ(p) 1 = 0, MATH.md §4), the bound with plain kappa is +inf and holds vacuously; the
// informative reading uses kappa_plus of every factor against kappa_plus(J). Both are reported,
// with the per-block condition numbers of J_Q, J_K, J_V that the proof's lemmas use.
#pragma once

#include "spectral_cond/detail/instances.hpp"

#include "spectral_cond/conditioning/diagnostics.hpp"
#include "spectral_cond/conditioning/methods/kappa_jacobian.hpp"

#include "spectral_cond/linalg/eigen.hpp"

#include <algorithm>
#include <limits>
#include <string>

// Functions on double alone are written `template <typename = void>`: they are then compiled
// only in the translation units that call them, not in every one that includes this header.
namespace spectral_cond {

/// Condition numbers of the block-diagonal softmax Jacobian 𝚲 = Σ_i Λ(p_i) ⊗ e_i e_i^T
/// (N^2 x N^2, MATH.md §3) from the eigenvalues of its N blocks Λ(p_i) = Diag(p_i) - p_i p_i^T
/// (each symmetric PSD, so its singular values are its eigenvalues), never forming 𝚲.
/// kappa is +inf (𝚲 is singular); kappa_plus uses the default rank tolerance N^2 ε σ_1.
template <typename Scalar>
ConditionResult<double> softmax_jacobian_condition(const CRef<Scalar>& P, double rtol = -1) {
  constexpr const char* fn = "softmax_jacobian_condition";
  if (P.rows() < 1 || P.rows() != P.cols())
    detail::fail(
        fn, "P must be square and non-empty (got " + detail::shape_str(P.rows(), P.cols()) + ")");
  const Index N = P.rows();
  Vec<double> all(N * N), lambda;
  Mat<double> L(N, N);
  std::string why;
  for (Index i = 0; i < N; ++i) {
    const Vec<double> p = P.row(i).transpose().template cast<double>();
    L = -p * p.transpose();
    L.diagonal() += p;
    if (detail::symmetric_eigenvalues(L, /*psd=*/true, lambda, why).empty()) {
      auto bad = detail::invalid_condition<double>("");
      bad.info = Info::NotConverging;
      bad.method = "eigenvalues of the blocks";
      bad.note = "no eigensolver converged on Lambda(p_" + std::to_string(i) + "): " + why;
      return bad;
    }
    all.segment(i * N, N) = lambda.cwiseMax(0.0);  // PSD: clamp rounding below 0
  }
  std::sort(all.data(), all.data() + all.size(), std::greater<double>());
  KappaOptions<double> ko;
  ko.rtol = rtol;
  ConditionResult<double> res =
      condition_from_singular_values<double>(all, N * N, N * N, ko, "eigenvalues of the blocks");
  res.note = "𝚲 is singular by construction (Λ(p) 1 = 0): kappa = +inf; kappa_plus over rank " +
             std::to_string(res.rank) + " of " + std::to_string(N * N);
  if (res.info == Info::Singular) res.info = Info::Success;  // expected, not a finding
  return res;
}

/// Options of theorem34.
struct BoundOptions {
  JacobianKappaOptions jacobian;  ///< how κ(J) is computed (default auto)
  bool blocks = true;             ///< also κ(J_Q), κ(J_K), κ(J_V)
  double rtol = -1;               ///< rank tolerance for every kappa_plus (< 0: default)
  /// Also the attention diagnostics (MATH.md §11) and the bound that needs no hypothesis
  /// (σ_max(J) / σ_N(P X), §5); a few matrix-free products with J.
  bool diagnostics = true;
};

/// Everything Theorem 3.4 mentions, and the verdicts.
struct Theorem34Report {
  ConditionResult<double> X, Lambda, WQ, WK, WV, P, J;
  bool have_blocks = false;
  ConditionResult<double> JQ, JK, JV;  ///< per-block, when have_blocks
  /// false with biases or RoPE (MATH.md §10): Theorem 3.4 is stated without them, so bound,
  /// bound_plus and the ratios are NaN, holds and holds_plus false, and the verdict says so; every
  /// κ term, κ(J) of the block as given, the diagnostics and the hypothesis-free bound (which
  /// holds with them: J_V = I ⊗ P X still) are computed
  bool bound_applies = true;
  double bound = 0;         ///< with kappa of every factor (+inf whenever 𝚲 enters: always)
  double bound_plus = 0;    ///< with kappa_plus of every factor
  double ratio = 0;         ///< bound / kappa(J) (NaN when both are +inf)
  double ratio_plus = 0;    ///< bound_plus / kappa_plus(J)
  bool holds = false;       ///< kappa(J) <= bound
  bool holds_plus = false;  ///< kappa_plus(J) <= bound_plus, within κ(J)'s stated accuracy
  bool vacuous = false;     ///< bound is +inf
  std::string verdict;      ///< one plain sentence
  bool have_diagnostics = false;     ///< diagnostics and free_bound computed
  AttentionDiagnostics diagnostics;  ///< the attention pattern and block norms (MATH.md §11)
  HypothesisFreeBound free_bound;    ///< κ(J) <= σ_max(J) / σ_N(P X) for N <= D (§5, proven)
  /// the bound holds within rounding: σ_min(J) >= σ_N(P X) (free_bound_holds; true when it does
  /// not apply)
  bool free_bound_holds = true;
};

namespace detail {

inline double bound_value(double kx, double kl, double kv, double kq, double kk, double kp) {
  return kx * kx * kx * kl * kv * (kq + kk) + kx * kp;
}

/// Per-block κ: dense SVD while the block is small, else the eigenvalues of its smaller Gram.
template <typename = void>
inline ConditionResult<double> block_condition(const KJInputs& in, JacobianBlock b,
                                               const JacobianKappaOptions& jo) {
  const Index rows = in.rows;
  const Index cols = jacobian_cols(b, in.X.rows(), in.X.cols(), in.WQ.cols(), in.WV.cols());
  if (rows * cols <= jo.dense_max_entries) {
    const Mat<double> Jb = attention_jacobian(in.X, in.WQ, in.WK, in.WV, in.opts, b);
    ConditionResult<double> r = kappa(Jb, kappa_opts(jo));
    r.method = "dense (" + r.method + ")";
    return r;
  }
  const bool wide = rows <= cols;
  const Mat<double> G = wide ? attention_gram(in.X, in.WQ, in.WK, in.WV, in.opts, b)
                             : attention_normal(in.X, in.WQ, in.WK, in.WV, in.opts, b);
  Vec<double> lambda;
  std::string why;
  const std::string solver = symmetric_eigenvalues(G, /*psd=*/true, lambda, why);
  if (solver.empty()) {
    ConditionResult<double> bad = invalid_condition<double>("");
    bad.info = Info::NotConverging;
    bad.method = "gram (eigenvalues)";
    bad.note = "no symmetric eigensolver converged on the block's Gram matrix: " + why;
    return bad;
  }
  ConditionResult<double> r =
      condition_from_gram_eigenvalues(lambda, rows, cols, jo, "gram (eigenvalues, " + solver + ")");
  squared_accuracy(r, jo);
  return r;
}

}  // namespace detail

namespace detail {

/// theorem34 with κ(J) computed here (`given` null) or given by the caller.
template <typename Scalar>
Theorem34Report theorem34_report(const CRef<Scalar>& X, const CRef<Scalar>& WQ,
                                 const CRef<Scalar>& WK, const CRef<Scalar>& WV,
                                 const AttentionOptions<Scalar>& opts, const BoundOptions& bo,
                                 const ConditionResult<double>* given) {
  constexpr const char* fn = "theorem34";
  bo.jacobian.check(fn);
  detail::check_attention_inputs<Scalar>(fn, X, WQ, WK, WV);
  opts.check(fn, X.rows());
  const detail::KJInputs in = detail::kj_inputs<Scalar>(X, WQ, WK, WV, opts);
  KappaOptions<double> ko;
  ko.rtol = bo.rtol;
  JacobianKappaOptions jo = bo.jacobian;
  jo.rtol = bo.rtol;

  Theorem34Report r;
  r.X = kappa(in.X, ko);
  r.WQ = kappa(in.WQ, ko);
  r.WK = kappa(in.WK, ko);
  r.WV = kappa(in.WV, ko);
  const AttentionCache<double> cache = attention_forward(in.X, in.WQ, in.WK, in.WV, in.opts);
  r.P = kappa(cache.P, ko);
  r.Lambda = softmax_jacobian_condition<double>(cache.P, bo.rtol);
  r.J = given != nullptr ? *given : kappa_jacobian<double>(in.X, in.WQ, in.WK, in.WV, in.opts, jo);
  if (bo.blocks) {
    r.have_blocks = true;
    r.JQ = detail::block_condition(in, JacobianBlock::Q, jo);
    r.JK = detail::block_condition(in, JacobianBlock::K, jo);
    r.JV = detail::block_condition(in, JacobianBlock::V, jo);
  }
  if (bo.diagnostics) {
    r.have_diagnostics = true;
    r.diagnostics = attention_diagnostics(in.X, in.WQ, in.WK, in.WV, in.opts, cache.P);
    r.free_bound = hypothesis_free_bound(in.X, in.WQ, in.WK, in.WV, in.opts, cache.P);
    r.free_bound_holds = free_bound_holds(r.free_bound, r.J);
  }
  if (in.opts.extended()) {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    r.bound_applies = false;
    r.bound = r.bound_plus = r.ratio = r.ratio_plus = nan;
    r.verdict = std::string(r.J.info == Info::InvalidInput ? "invalid input: " : "") +
                "not applicable: Theorem 3.4 is stated for the block without biases or RoPE "
                "(MATH.md §10); kappa(J) is that of the block with them";
    return r;
  }
  r.bound =
      detail::bound_value(r.X.kappa, r.Lambda.kappa, r.WV.kappa, r.WQ.kappa, r.WK.kappa, r.P.kappa);
  r.bound_plus = detail::bound_value(r.X.kappa_plus, r.Lambda.kappa_plus, r.WV.kappa_plus,
                                     r.WQ.kappa_plus, r.WK.kappa_plus, r.P.kappa_plus);
  r.vacuous = !std::isfinite(r.bound);
  r.ratio = r.bound / r.J.kappa;
  r.ratio_plus = r.bound_plus / r.J.kappa_plus;
  r.holds = r.J.kappa <= r.bound;
  // A violation must exceed κ(J)'s own stated error to count.
  const double acc = std::isfinite(r.J.accuracy) ? std::min(r.J.accuracy, 1.0) : 1.0;
  r.holds_plus = r.J.kappa_plus * (1 - acc) <= r.bound_plus;
  std::ostringstream v;
  if (r.J.info == Info::InvalidInput) {
    v << "invalid input: no verdict";
    r.holds_plus = false;
  } else if (std::isnan(r.J.kappa_plus) || std::isnan(r.bound_plus)) {
    // NaN on either side decides nothing: neither held nor violated.
    v << "no verdict with kappa_plus: "
      << (std::isnan(r.J.kappa_plus) ? "kappa_plus(J)" : "the bound") << " is undefined (NaN)";
    r.holds_plus = false;
  } else if (r.holds_plus) {
    v << "holds with kappa_plus: kappa_plus(J) = " << r.J.kappa_plus << " <= bound " << r.bound_plus
      << " (ratio " << r.ratio_plus << ")";
  } else {
    v << "VIOLATED with kappa_plus: kappa_plus(J) = " << r.J.kappa_plus << " > bound "
      << r.bound_plus << " (ratio " << r.ratio_plus << ")";
  }
  v << "; with plain kappa the bound is "
    << (r.vacuous ? "+inf (𝚲 is singular), vacuous" : "finite");
  r.verdict = v.str();
  return r;
}

}  // namespace detail

/// Theorem 3.4 for one attention block (MATH.md §5), every term computed, κ(J) by
/// kappa_jacobian with bo.jacobian. With biases or RoPE in `opts` the terms, κ(J) of that block
/// and the diagnostics are computed, and the bound is reported as not applicable
/// (Theorem34Report::bound_applies; MATH.md §10).
template <typename Scalar>
Theorem34Report theorem34(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                          const CRef<Scalar>& WV, const AttentionOptions<Scalar>& opts,
                          const BoundOptions& bo = {}) {
  return detail::theorem34_report<Scalar>(X, WQ, WK, WV, opts, bo, nullptr);
}

/// Theorem 3.4 with κ(J) as an input: `jacobian` is κ(J) of these inputs computed by the caller
/// (on a GPU by cuda::kappa_jacobian_batched, or kept from an earlier call), used as is.
template <typename Scalar>
Theorem34Report theorem34(const CRef<Scalar>& X, const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                          const CRef<Scalar>& WV, const AttentionOptions<Scalar>& opts,
                          const BoundOptions& bo, const ConditionResult<double>& jacobian) {
  return detail::theorem34_report<Scalar>(X, WQ, WK, WV, opts, bo, &jacobian);
}

/// By-value convenience form.
template <typename DX, typename DQ, typename DK, typename DV>
Theorem34Report theorem34(const Eigen::MatrixBase<DX>& X, const Eigen::MatrixBase<DQ>& WQ,
                          const Eigen::MatrixBase<DK>& WK, const Eigen::MatrixBase<DV>& WV,
                          const AttentionOptions<typename DX::Scalar>& opts = {},
                          const BoundOptions& bo = {}) {
  return theorem34<typename DX::Scalar>(X, WQ, WK, WV, opts, bo);
}

}  // namespace spectral_cond
SPECTRAL_COND_DECLARE_EXTERN(theorem34)
