// spectral_cond: what the attention pattern says about a κ(J) (MATH.md §11), and the bound on
// κ(J) that needs no hypothesis (MATH.md §5):
//
//   attention_pattern      row maxima m_i = max_j P_ij, row entropies, saturated rows
//                          (m_i > 1 - 1e-6) and whether they sit on the diagonal;
//   jacobian_block_norms   ‖J_Q‖₂, ‖J_K‖₂, ‖J_QK‖₂ (J_QK = [J_Q | J_K]) matrix-free, and
//                          ‖J_V‖₂ = σ_1(P X) exactly (J_V = I_{d_v} ⊗ P X, §3);
//   attention_diagnostics  both, and whether attention has collapsed to the identity;
//   hypothesis_free_bound  κ(J) <= σ_max(J) / σ_N(P X) for N <= D and P X of full row rank.
//
// Everything is computed in double from the inputs as given; nothing forms J.
#pragma once

#include "spectral_cond/conditioning/kappa.hpp"
#include "spectral_cond/jacobian/operators.hpp"
#include "spectral_cond/linalg/lanczos.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace spectral_cond {

/// A row of P counts as saturated when its maximum exceeds 1 - this (MATH.md §11).
inline constexpr double saturation_threshold = 1e-6;

/// Statistics of the attention matrix P (N x N, rows sum to one), MATH.md §11.
struct AttentionPattern {
  Index rows = 0;
  double row_max_min = std::numeric_limits<double>::quiet_NaN();   ///< min_i m_i
  double row_max_mean = std::numeric_limits<double>::quiet_NaN();  ///< mean_i m_i
  /// mean_i H_i, H_i = -Σ_j P_ij log P_ij (natural log; 0 log 0 = 0); log N for uniform rows
  double entropy_mean = std::numeric_limits<double>::quiet_NaN();
  /// Rows whose mask leaves a single key (row 0 of a causal mask): one-hot by construction, so
  /// not counted as saturated; their maxima and entropies (1 and 0) are in the means.
  Index forced = 0;
  Index forced_diagonal = 0;      ///< of those, rows whose one key is their own token
  Index saturated = 0;            ///< other rows with m_i > 1 - saturation_threshold
  Index saturated_diagonal = 0;   ///< of those, rows whose maximum is P_ii
  double saturated_fraction = 0;  ///< saturated / (rows - forced); 0 when every row is forced
  /// Every row is one-hot on its own token: P = I to within saturation_threshold.
  bool identity() const { return rows > 0 && saturated_diagonal + forced_diagonal == rows; }
};

/// Spectral norms of the blocks of J (MATH.md §11). sigma_max_JV is σ_1(P X) from a dense SVD;
/// the others come from a power iteration that alternates J and J^T (it never squares J, so
/// blocks far below J_V in size, as on a saturated softmax, keep their order of magnitude). Each
/// iterated value is ‖J v‖ for a unit v, a lower bound on the norm, converged to a relative
/// change below `tol` unless `converged` is false.
struct JacobianBlockNorms {
  double sigma_max_JQ = std::numeric_limits<double>::quiet_NaN();
  double sigma_max_JK = std::numeric_limits<double>::quiet_NaN();
  double sigma_max_JQK = std::numeric_limits<double>::quiet_NaN();  ///< of [J_Q | J_K]
  double sigma_max_JV = std::numeric_limits<double>::quiet_NaN();   ///< = σ_1(P X)
  /// ‖J_QK‖₂ / ‖J_V‖₂ (spectral norms); NaN when ‖J_V‖₂ = 0
  double ratio_QK_V = std::numeric_limits<double>::quiet_NaN();
  Index iterations = 0;  ///< power steps, all blocks together
  bool converged = false;
};

/// The attention pattern and the block norms of one attention block, with a plain note.
struct AttentionDiagnostics {
  AttentionPattern pattern;
  JacobianBlockNorms norms;
  /// P = I to within the saturation threshold: J_Q and J_K vanish and J = [0 | 0 | I ⊗ X]
  /// (MATH.md §11); for N <= D, κ(J) = κ(X).
  bool collapsed = false;
  std::string note;  ///< one or two plain sentences (empty when nothing stands out)
};

/// The bound of MATH.md §5 that needs no hypothesis: κ(J) <= σ_max(J) / σ_N(P X) for N <= D.
struct HypothesisFreeBound {
  /// N <= D, P X of full row rank (σ_N(P X) above its rank tolerance) and σ_max(J) converged
  bool applicable = false;
  double bound = std::numeric_limits<double>::infinity();         ///< +inf when not applicable
  double sigma_max_J = std::numeric_limits<double>::quiet_NaN();  ///< Ritz value, Lanczos on J J^T
  /// Relative residual of the Ritz pair; the bound uses σ_max(J) sqrt(1 + residual), an upper
  /// bound on σ_max(J) once the Ritz value has converged to the largest eigenvalue.
  double sigma_max_residual = std::numeric_limits<double>::quiet_NaN();
  Index lanczos_operations = 0;
  ConditionResult<double> PX;  ///< σ_1(P X) = ‖J_V‖₂, σ_N(P X) = its sigma_min when N <= D
  /// Estimated relative error of the bound from rounding: the SVD of P X (max(N, D) ε κ(P X))
  /// and forming P X (N ε ‖P‖_F ‖X‖_F / σ_N(P X)); the Lanczos part is covered by the residual.
  double accuracy = std::numeric_limits<double>::quiet_NaN();
  Info info = Info::Success;  ///< NotConverging when Lanczos did not converge
  std::string note;
};

/// Attention-pattern statistics of P (MATH.md §11). `allowed(i)`, when given, is the number of
/// keys row i's mask leaves (rows with one are `forced`, not saturated).
template <typename = void>
AttentionPattern attention_pattern(const CRef<double>& P,
                                   const std::function<Index(Index)>& allowed = {}) {
  if (P.rows() < 1 || P.rows() != P.cols())
    detail::fail("attention_pattern", "P must be square and non-empty (got " +
                                          detail::shape_str(P.rows(), P.cols()) + ")");
  AttentionPattern a;
  const Index N = P.rows();
  a.rows = N;
  double mmin = std::numeric_limits<double>::infinity(), msum = 0, hsum = 0;
  for (Index i = 0; i < N; ++i) {
    Index arg = 0;
    const double m = P.row(i).maxCoeff(&arg);
    double h = 0;
    for (Index j = 0; j < N; ++j) {
      const double p = P(i, j);
      if (p > 0) h -= p * std::log(p);
    }
    mmin = std::min(mmin, m);
    msum += m;
    hsum += h;
    const bool diagonal = arg == i || P(i, i) == m;
    if (allowed && allowed(i) == 1) {
      ++a.forced;
      if (diagonal) ++a.forced_diagonal;
    } else if (m > 1 - saturation_threshold) {
      ++a.saturated;
      if (diagonal) ++a.saturated_diagonal;
    }
  }
  a.row_max_min = mmin;
  a.row_max_mean = msum / static_cast<double>(N);
  a.entropy_mean = hsum / static_cast<double>(N);
  a.saturated_fraction = a.forced < N ? static_cast<double>(a.saturated) /
                                            static_cast<double>(N - a.forced)
                                      : 0.0;
  return a;
}

namespace detail {

/// The inputs of one attention block, by reference.
struct AttentionInputsRef {
  const CRef<double>& X;
  const CRef<double>& WQ;
  const CRef<double>& WK;
  const CRef<double>& WV;
  const AttentionOptions<double>& opts;
};

/// Largest singular value of [J_b1 | J_b2 | ...] (blocks of the same attention Jacobian) by a
/// power iteration alternating J and J^T from a seeded start: v <- J^T u / ‖J^T u‖,
/// u <- J v / ‖J v‖. Returns ‖J v‖ for the last unit v (nondecreasing, a lower bound on the
/// norm); 0 when J v = 0 for the random start (J_Q = J_K = 0 when P = I exactly).
template <typename = void>
double block_power_norm(const AttentionInputsRef& in, std::initializer_list<JacobianBlock> blocks,
                        double tol, Index max_steps, std::uint64_t seed, Index& steps,
                        bool& converged) {
  std::vector<JacobianOp<double>> J;
  std::vector<JacobianTransposeOp<double>> JT;
  J.reserve(blocks.size());
  JT.reserve(blocks.size());
  Index cols = 0;
  for (JacobianBlock b : blocks) {
    J.emplace_back(in.X, in.WQ, in.WK, in.WV, in.opts, b);
    JT.emplace_back(in.X, in.WQ, in.WK, in.WV, in.opts, b);
    cols += J.back().cols();
  }
  const Index rows = J.front().rows();
  Vec<double> v(cols), u(rows), t(rows), w(cols);
  Rng rng(seed);
  for (Index i = 0; i < cols; ++i) v(i) = rng.normal();
  v /= v.norm();
  double sigma = 0;
  converged = false;
  for (Index k = 0; k < max_steps; ++k) {
    u.setZero();
    Index off = 0;
    for (const auto& op : J) {
      op.perform_op(v.data() + off, t.data());
      u += t;
      off += op.cols();
    }
    ++steps;
    const double s = u.norm();
    if (!std::isfinite(s)) return std::numeric_limits<double>::quiet_NaN();
    if (s == 0) {
      converged = true;
      return 0;
    }
    if (k > 0 && std::abs(s - sigma) <= tol * s) {
      converged = true;
      return s;
    }
    sigma = s;
    u /= s;
    off = 0;
    for (const auto& op : JT) {
      op.perform_op(u.data(), w.data() + off);
      off += op.rows();
    }
    const double n = w.norm();
    if (!(n > 0)) return sigma;
    v = w / n;
  }
  return sigma;
}

}  // namespace detail

/// Spectral norms of J_Q, J_K, [J_Q | J_K] and J_V (see JacobianBlockNorms; MATH.md §11).
/// `P` is the attention matrix of the same inputs (attention_forward), `tol` the relative change
/// at which the power iteration stops (default 1e-8), `max_steps` per block (default 500).
template <typename = void>
JacobianBlockNorms jacobian_block_norms(const CRef<double>& X, const CRef<double>& WQ,
                                        const CRef<double>& WK, const CRef<double>& WV,
                                        const AttentionOptions<double>& opts, const CRef<double>& P,
                                        double tol = 1e-8, Index max_steps = 500,
                                        std::uint64_t seed = default_seed) {
  constexpr const char* fn = "jacobian_block_norms";
  detail::check_attention_inputs<double>(fn, X, WQ, WK, WV);
  opts.check(fn, X.rows());
  detail::require_shape(fn, "P", "N x N", X.rows(), X.rows(), P);
  const detail::AttentionInputsRef in{X, WQ, WK, WV, opts};
  JacobianBlockNorms r;
  bool cq = false, ck = false, cqk = false;
  r.sigma_max_JQ =
      detail::block_power_norm(in, {JacobianBlock::Q}, tol, max_steps, seed, r.iterations, cq);
  r.sigma_max_JK =
      detail::block_power_norm(in, {JacobianBlock::K}, tol, max_steps, seed, r.iterations, ck);
  r.sigma_max_JQK = detail::block_power_norm(in, {JacobianBlock::Q, JacobianBlock::K}, tol,
                                             max_steps, seed, r.iterations, cqk);
  const Mat<double> PX = P * X;
  const Vec<double> s = PX.jacobiSvd().singularValues();
  r.sigma_max_JV = s.size() > 0 ? s(0) : 0;
  r.ratio_QK_V = r.sigma_max_JV > 0 ? r.sigma_max_JQK / r.sigma_max_JV
                                    : std::numeric_limits<double>::quiet_NaN();
  r.converged = cq && ck && cqk;
  return r;
}

/// The attention pattern and the block norms of one block, and a plain note when attention has
/// collapsed to the identity (MATH.md §11). `P` as for jacobian_block_norms.
template <typename = void>
AttentionDiagnostics attention_diagnostics(const CRef<double>& X, const CRef<double>& WQ,
                                           const CRef<double>& WK, const CRef<double>& WV,
                                           const AttentionOptions<double>& opts,
                                           const CRef<double>& P) {
  AttentionDiagnostics d;
  std::function<Index(Index)> allowed;
  if (opts.mask == MaskKind::Causal) {
    allowed = [](Index i) { return i + 1; };
  } else if (opts.mask == MaskKind::Additive) {
    const Mat<double>& M = opts.additive_mask;
    allowed = [&M](Index i) {
      return static_cast<Index>((M.row(i).array() != -std::numeric_limits<double>::infinity())
                                    .count());
    };
  }
  d.pattern = attention_pattern(P, allowed);
  d.norms = jacobian_block_norms(X, WQ, WK, WV, opts, P);
  d.collapsed = d.pattern.identity();
  std::ostringstream n;
  n.precision(3);
  const Index N = X.rows(), D = X.cols();
  if (d.collapsed) {
    n << "attention has collapsed to the identity (every row of P is one-hot on its own token, "
         "min_i max_j P_ij = "
      << d.pattern.row_max_min << "); ||J_QK||_2/||J_V||_2 = " << d.norms.ratio_QK_V << "; ";
    if (N <= D)
      n << "kappa(J) = kappa(X): query/key gradients vanish";
    else
      n << "J = [0 | 0 | I (x) X] with X tall: query/key gradients vanish";
  } else if (d.pattern.saturated > 0) {
    n << d.pattern.saturated << " of " << N - d.pattern.forced
      << " rows of P are saturated (max_j P_ij > 1 - 1e-6), " << d.pattern.saturated_diagonal
      << " of them on the diagonal";
    if (d.pattern.forced > 0)
      n << " (" << d.pattern.forced << " more rows have a single key under the mask)";
  }
  if (!d.norms.converged) {
    if (n.tellp() > 0) n << "; ";
    n << "the power iteration for the block norms did not converge (lower bounds)";
  }
  d.note = n.str();
  return d;
}

/// κ(J) <= σ_max(J) / σ_N(P X) for N <= D (MATH.md §5, proven): J J^T ⪰ I_{d_v} ⊗ (P X)(P X)^T.
/// σ_max(J) by Lanczos on J J^T applied matrix-free (GramOp), σ_N(P X) by a dense SVD of the
/// N x D matrix P X. +inf (not applicable) when N > D or P X is numerically rank-deficient
/// (σ_N(P X) at or below max(N, D) ε σ_1(P X)); `P` as for jacobian_block_norms.
template <typename = void>
HypothesisFreeBound hypothesis_free_bound(const CRef<double>& X, const CRef<double>& WQ,
                                          const CRef<double>& WK, const CRef<double>& WV,
                                          const AttentionOptions<double>& opts,
                                          const CRef<double>& P, const LanczosOptions& lo = {}) {
  constexpr const char* fn = "hypothesis_free_bound";
  detail::check_attention_inputs<double>(fn, X, WQ, WK, WV);
  opts.check(fn, X.rows());
  lo.check(fn);
  detail::require_shape(fn, "P", "N x N", X.rows(), X.rows(), P);
  const Index N = X.rows(), D = X.cols();
  HypothesisFreeBound b;
  const Mat<double> PX = P * X;
  b.PX = kappa(PX);
  GramOp<double> G(X, WQ, WK, WV, opts);
  const LanczosOutcome l = detail::lanczos_largest(G, lo);
  b.lanczos_operations = l.operations;
  b.sigma_max_residual = l.residual;
  if (l.converged) b.sigma_max_J = std::sqrt(std::max(l.lambda, 0.0));
  const double eps = ScalarTraits<double>::eps();
  std::ostringstream n;
  if (!l.converged) {
    b.info = Info::NotConverging;
    b.bound = std::numeric_limits<double>::quiet_NaN();
    n << "Lanczos on J J^T did not converge (" << l.iterations << " restarts): no bound";
  } else if (N > D) {
    n << "N = " << N << " > D = " << D << ": (P X)(P X)^T is singular, the bound is vacuous";
  } else if (b.PX.info != Info::Success || b.PX.rank < N) {
    n << "P X is numerically rank-deficient (rank " << b.PX.rank << " of " << N
      << "): the bound is vacuous";
  } else {
    b.applicable = true;
    const double sN = b.PX.sigma_min;
    b.bound = b.sigma_max_J * std::sqrt(1 + std::max(l.residual, 0.0)) / sN;
    b.accuracy = static_cast<double>(std::max(N, D)) * eps * b.PX.kappa +
                 static_cast<double>(N) * eps * P.norm() * X.norm() / sN;
    n << "kappa(J) <= sigma_max(J)/sigma_N(P X) = " << b.sigma_max_J << "/" << sN << " = "
      << b.bound;
  }
  b.note = n.str();
  return b;
}

/// Whether the bound holds within rounding (MATH.md §5). Its content is σ_min(J) >= σ_N(P X)
/// (σ_max(J) is a common factor of κ(J) and the bound), so this compares singular values, not
/// condition numbers, and does not depend on J's rank decision: it holds when
/// J.sigma_min + J.rank_tol >= σ_N(P X) (1 - 10 b.accuracy), with J.rank_tol (max(m, n) ε σ_1(J)
/// by default, the rounding floor of a backward-stable SVD of J; the sqrt(g ε) σ_1 floor for the
/// squared methods) as the absolute error of the computed σ_min(J). True when the bound does not
/// apply or J's σ_min was not computed.
inline bool free_bound_holds(const HypothesisFreeBound& b, const ConditionResult<double>& J) {
  if (!b.applicable || !std::isfinite(J.sigma_min)) return true;
  const double delta = std::isfinite(J.rank_tol) ? std::max(J.rank_tol, 0.0) : 0.0;
  return J.sigma_min + delta >= b.PX.sigma_min * (1 - 10 * b.accuracy);
}

}  // namespace spectral_cond
