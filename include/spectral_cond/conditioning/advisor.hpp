// spectral_cond: choosing λ. For one head and a grid of λ and placements of λ I (MATH.md §7,
// "Placements"; §17, "Choosing λ"), κ of each corrected projection, κ(J) by an accurate method
// with its stated accuracy, κ₊(J), the bound that needs no hypothesis (§5), the attention
// diagnostics (§11), the predicted and the measured onset of saturation, and a recommendation:
// the grid point of least κ(J) among those whose attention neither saturates nor collapses.
#pragma once

#include "spectral_cond/conditioning/corrections.hpp"
#include "spectral_cond/conditioning/diagnostics.hpp"
#include "spectral_cond/conditioning/kappa.hpp"
#include "spectral_cond/conditioning/methods/kappa_jacobian.hpp"
#include "spectral_cond/core/attention.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace spectral_cond {

/// Where a head sits in its layer: its index, the layer's query heads and key/value heads
/// (grouped-query attention: kv_heads divides heads; 0 means kv_heads = heads).
struct HeadPosition {
  Index head = 0;
  Index heads = 1;
  Index kv_heads = 0;
  /// Packed layouts only: the column of this head's W_Q, W_K, W_V slice within the packed
  /// weight, where its order is not [W_Q | W_K | W_V] (GPT-NeoX interleaves q, k, v per head);
  /// -1: that standard order.
  std::array<Index, 3> packed_columns{-1, -1, -1};
  Index kv() const { return kv_heads > 0 ? kv_heads : heads; }
};

namespace detail {

/// The row of the first one in head `pos`'s slice of projection `which` (0 q, 1 k, 2 v) under
/// placement p: E(r0 + j, j) = 1 for the rows r0 + j < D. -1 when the projection is untouched.
inline Index identity_offset(const CorrectionPlacement& p, int which, const HeadPosition& pos,
                             Index d_k, Index d_v) {
  const Index group = pos.heads / pos.kv();
  const Index kvh = pos.head / group;
  const Index col = which == 0 ? pos.head * d_k : which == 1 ? kvh * d_k : kvh * d_v;
  switch (p.layout) {
    case Placement::PerHead:
      return (which == 0 ? p.q : which == 1 ? p.k : p.v) ? 0 : -1;
    case Placement::Fused:
      return (which == 0 ? p.q : which == 1 ? p.k : p.v) ? col : -1;
    case Placement::Packed:
      break;
  }
  if (pos.packed_columns[static_cast<std::size_t>(which)] >= 0)
    return pos.packed_columns[static_cast<std::size_t>(which)];
  // The packed weight's columns are [W_Q (heads d_k) | W_K (kv d_k) | W_V (kv d_v)].
  const Index before = which == 0 ? 0 : which == 1 ? pos.heads * d_k : (pos.heads + pos.kv()) * d_k;
  return before + col;
}

/// W + λ E with E(r0 + j, j) = 1 for r0 + j < rows (r0 < 0: W unchanged).
inline Mat<double> shifted_identity_add(const CRef<double>& W, Index r0, double lambda) {
  Mat<double> out = W;
  if (r0 < 0 || lambda == 0) return out;
  for (Index j = 0; j < W.cols() && r0 + j < W.rows(); ++j) out(r0 + j, j) += lambda;
  return out;
}

}  // namespace detail

/// Head `pos`'s W_Q, W_K, W_V slices after λ I under placement p (MATH.md §7, "Placements"):
/// each corrected slice gains λ at (r₀ + j, j) for its rows r₀ + j < D; untouched ones are copied.
inline std::array<Mat<double>, 3> corrected_head_weights(const CRef<double>& WQ,
                                                         const CRef<double>& WK,
                                                         const CRef<double>& WV,
                                                         const CorrectionPlacement& p,
                                                         const HeadPosition& pos, double lambda) {
  const std::array<const CRef<double>*, 3> w{&WQ, &WK, &WV};
  std::array<Mat<double>, 3> out;
  for (int i = 0; i < 3; ++i)
    out[static_cast<std::size_t>(i)] = detail::shifted_identity_add(
        *w[static_cast<std::size_t>(i)], detail::identity_offset(p, i, pos, WQ.cols(), WV.cols()),
        lambda);
  return out;
}

/// The advisor's grid and criteria (MATH.md §17).
struct AdviceOptions {
  std::vector<double> lambdas{0, 0.25, 0.5, 1, 2, 3, 5, 10};
  std::vector<CorrectionPlacement> placements{
      {Placement::Fused}, {Placement::PerHead}, {Placement::Packed}};
  /// A grid point is admissible while the fraction of saturated rows of P stays at or below this.
  double max_saturated_fraction = 0.01;
  /// ... and ‖J_QK‖/‖J_V‖ stays at or above this multiple of its value at λ = 0 (no collapse of
  /// the query/key gradients).
  double min_qk_ratio = 0.1;
  /// κ(J) of each point (the accurate `auto` by default; the method and accuracy are reported).
  JacobianKappaOptions jacobian;
  /// Called after each grid point with the fraction of the head's grid done.
  std::function<void(double)> progress;

  /// Throws std::invalid_argument naming the argument when the grid or a criterion is unusable.
  void check(const char* fn) const {
    auto bad = [&](const std::string& m) { detail::fail(fn, m); };
    if (lambdas.empty()) bad("lambdas: the grid of lambda is empty");
    for (const double l : lambdas)
      if (!(std::isfinite(l) && l >= 0)) {
        std::ostringstream s;
        s << "lambdas: every lambda must be finite and >= 0 (got " << l << ")";
        bad(s.str());
      }
    if (placements.empty()) bad("placements: the list of placements is empty");
    for (const CorrectionPlacement& p : placements)
      if (!(p.q || p.k || p.v)) bad("placements: a placement touches no projection");
    if (!(max_saturated_fraction >= 0 && max_saturated_fraction <= 1))
      bad("max_saturated_fraction must be in [0, 1]");
    if (!(min_qk_ratio >= 0 && std::isfinite(min_qk_ratio))) bad("min_qk_ratio must be >= 0");
    jacobian.check(fn);
  }
};

/// One grid point: the head's weights W + λ E under one placement.
struct AdvicePoint {
  double lambda = 0;
  std::string placement;                           ///< CorrectionPlacement::name()
  std::array<ConditionResult<double>, 3> kappa_W;  ///< of the corrected W_Q, W_K, W_V slices
  ConditionResult<double> J;  ///< κ(J), κ₊(J), rank, method, stated accuracy
  HypothesisFreeBound free_bound;
  AttentionDiagnostics diagnostics;
  /// The weights equal those of an earlier point (λ = 0 under every placement, or two placements
  /// that coincide for this head): its results, not computed again. -1: computed here.
  Index same_as = -1;
  bool admissible = false;
  std::string reason;  ///< why not admissible (empty when admissible)
  double seconds = 0;
};

/// A choice of λ and placement, or none, with the reason in words.
struct AdviceChoice {
  bool found = false;
  double lambda = std::numeric_limits<double>::quiet_NaN();
  std::string placement;
  double kappa_J = std::numeric_limits<double>::quiet_NaN();  ///< its κ(J) (median over heads)
  double baseline_kappa_J = std::numeric_limits<double>::quiet_NaN();  ///< at λ = 0
  std::string reason;
};

/// The advice for one head.
struct HeadAdvice {
  HeadPosition position;
  Index N = 0, D = 0, d_k = 0, d_v = 0;
  double scale = 0;  ///< the logit scale c used
  /// Points in grid order: placement-major, λ ascending. The λ = 0 baseline is always computed
  /// (index `baseline`); when the grid lacks λ = 0 it is extra, not a candidate.
  std::vector<AdvicePoint> points;
  Index baseline = 0;
  /// Weyl's threshold of each projection (W_Q, W_K, W_V slices): for λ beyond it λ I provably
  /// lowers κ(W) (MATH.md §7, lambda_min of LambdaCorrection).
  std::array<double, 3> weyl_threshold{};
  /// Per placement (in AdviceOptions order): the λ at which the closed form predicts saturation
  /// (NaN where the λ² law does not apply: Q or K untouched), and the smallest grid λ whose
  /// saturated fraction exceeds max_saturated_fraction (NaN: none on the grid).
  std::vector<double> predicted_onset, measured_onset;
  /// The mean square of the token coordinates the identity of each placement's Q slice reads
  /// (var(x) of the law; NaN where it does not apply).
  std::vector<double> token_variance;
  AdviceChoice best;
};

/// The λ at which λ I on both W_Q and W_K is predicted to saturate the rows of P (MATH.md §17):
/// a row's self-logit gains c λ² Σ_{t in T} x_t² ≈ c λ² |T| v over its other logits, and the row
/// saturates (max_j P_ij > 1 - τ) once (N - 1) e^{-gap} < τ, so λ* = sqrt(ln((N-1)/τ) / (c |T| v)).
/// NaN when N < 2 or the identity reaches no coordinate (|T| v = 0).
inline double predicted_saturation_onset(Index N, double scale, double sum_sq_per_token,
                                         double tau = saturation_threshold) {
  if (N < 2 || !(sum_sq_per_token > 0) || !(scale > 0))
    return std::numeric_limits<double>::quiet_NaN();
  return std::sqrt(std::log(static_cast<double>(N - 1) / tau) / (scale * sum_sq_per_token));
}

namespace detail {

inline std::string number(double x) {
  std::ostringstream s;
  s.precision(3);
  s << x;
  return s.str();
}

/// Admissibility of point p against the baseline's ‖J_QK‖/‖J_V‖ (MATH.md §17).
inline void judge(AdvicePoint& p, const AdvicePoint& base, const AdviceOptions& o) {
  std::ostringstream why;
  const AttentionPattern& pat = p.diagnostics.pattern;
  const double ratio = p.diagnostics.norms.ratio_QK_V,
               base_ratio = base.diagnostics.norms.ratio_QK_V;
  if (!(p.J.info == Info::Success || p.J.info == Info::Singular))
    why << "kappa(J) declined (" << to_string(p.J.info) << ")";
  else if (pat.saturated_fraction > o.max_saturated_fraction)
    why << "saturated: " << number(100 * pat.saturated_fraction) << "% of rows (limit "
        << number(100 * o.max_saturated_fraction) << "%)";
  else if (p.diagnostics.collapsed)
    why << "collapsed: P = I";
  else if (std::isfinite(base_ratio) && base_ratio > 0 && !(ratio >= o.min_qk_ratio * base_ratio))
    why << "query/key gradients collapse: ||J_QK||/||J_V|| = " << number(ratio) << " < "
        << number(o.min_qk_ratio) << " x " << number(base_ratio) << " (lambda = 0)";
  p.reason = why.str();
  p.admissible = p.reason.empty();
}

}  // namespace detail

/// The recommendation over one or more heads advised on the same grid (MATH.md §17): the grid
/// point (λ, placement) admissible in every head whose median κ(J) over the heads is least
/// (ties: the smaller λ, then κ₊), or none with the reason. Heads on different grids: throws.
inline AdviceChoice recommend(const std::vector<const HeadAdvice*>& heads) {
  AdviceChoice c;
  if (heads.empty()) {
    c.reason = "no heads were advised";
    return c;
  }
  const std::size_t n = heads.front()->points.size();
  for (const HeadAdvice* h : heads) {
    bool same = h->points.size() == n;
    for (std::size_t i = 0; same && i < n; ++i)
      same = h->points[i].lambda == heads.front()->points[i].lambda &&
             h->points[i].placement == heads.front()->points[i].placement;
    if (!same) detail::fail("recommend", "the heads were advised on different grids");
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end(), [](double a, double b) {
      return std::isnan(b) ? !std::isnan(a) : (!std::isnan(a) && a < b);
    });
    const std::size_t m = v.size();
    if (m == 0) return std::numeric_limits<double>::quiet_NaN();
    return m % 2 ? v[m / 2]
                 : (v[m / 2 - 1] == v[m / 2] ? v[m / 2] : 0.5 * (v[m / 2 - 1] + v[m / 2]));
  };
  std::vector<double> base;
  for (const HeadAdvice* h : heads)
    base.push_back(h->points[static_cast<std::size_t>(h->baseline)].J.kappa);
  c.baseline_kappa_J = median(base);
  Index best = -1, admissible = 0, candidates = 0;
  double best_k = 0, best_kp = 0;
  std::string first_reason;
  for (std::size_t i = 0; i < n; ++i) {
    const AdvicePoint& p0 = heads.front()->points[i];
    if (p0.placement == "none") continue;  // the λ = 0 reference off the grid
    ++candidates;
    std::vector<double> ks, kps;
    std::string why;
    for (const HeadAdvice* h : heads) {
      const AdvicePoint& p = h->points[i];
      if (!p.admissible && why.empty())
        why =
            (heads.size() > 1 ? "head " + std::to_string(h->position.head) + ": " : "") + p.reason;
      ks.push_back(p.J.kappa);
      kps.push_back(p.J.kappa_plus);
    }
    if (!why.empty()) {
      if (first_reason.empty() && p0.lambda > 0)
        first_reason = "lambda = " + detail::number(p0.lambda) + " " + p0.placement + ": " + why;
      continue;
    }
    ++admissible;
    const double k = median(ks), kp = median(kps);
    const bool better =
        best < 0 || (std::isnan(best_k) && !std::isnan(k)) || k < best_k ||
        (k == best_k && (p0.lambda < c.lambda || (p0.lambda == c.lambda && kp < best_kp)));
    if (better) {
      best = static_cast<Index>(i);
      best_k = k;
      best_kp = kp;
      c.lambda = p0.lambda;
      c.placement = p0.placement;
    }
  }
  std::ostringstream r;
  const std::string med = heads.size() > 1 ? "median " : "";
  if (best < 0) {
    r << "none: no point of the grid is admissible (" << candidates << " tried";
    if (!first_reason.empty())
      r << "; e.g. " << first_reason;
    else if (candidates > 0)
      r << "; " << heads.front()->points.back().reason;
    r << ")";
    c.reason = r.str();
    return c;
  }
  c.found = true;
  c.kappa_J = best_k;
  if (c.lambda == 0) {
    r << "lambda = 0 (no correction): no admissible lambda > 0 on the grid lowers the " << med
      << "kappa(J) below its uncorrected " << detail::number(c.baseline_kappa_J);
  } else {
    r << "lambda = " << detail::number(c.lambda) << " (" << c.placement << ") gives the least "
      << med << "kappa(J), " << detail::number(best_k) << " against "
      << detail::number(c.baseline_kappa_J) << " at lambda = 0";
  }
  r << ", among " << admissible << " of " << candidates
    << " grid points whose attention is neither saturated nor collapsed";
  if (std::isinf(best_k)) r << " (every admissible kappa(J) is +inf: ordered by kappa_plus)";
  if (!first_reason.empty()) r << "; first excluded: " << first_reason;
  c.reason = r.str();
  return c;
}

/// The advice for one head (X: N x D tokens; WQ, WK, WV: the head's D x d_k, D x d_k, D x d_v
/// slices; `pos`: where the head sits, for the fused and packed identities). Every point's κ(J)
/// is kappa_jacobian's with o.jacobian; points whose weights equal an earlier point's reuse its
/// results (same_as). Cost: one κ(J) per distinct point, plus the diagnostics' power iterations.
/// (A template only so that a translation unit that does not call it does not compile it.)
template <typename = void>
HeadAdvice advise_head(const CRef<double>& X, const CRef<double>& WQ, const CRef<double>& WK,
                       const CRef<double>& WV, const AttentionOptions<double>& opts,
                       const HeadPosition& pos, const AdviceOptions& o = {}) {
  constexpr const char* fn = "advise_head";
  o.check(fn);
  detail::check_attention_inputs<double>(fn, X, WQ, WK, WV);
  opts.check(fn, X.rows());
  if (pos.heads < 1 || pos.kv() < 1 || pos.heads % pos.kv() != 0 || pos.head < 0 ||
      pos.head >= pos.heads)
    detail::fail(fn, "position: need 0 <= head < heads and kv_heads dividing heads (got head " +
                         std::to_string(pos.head) + ", heads " + std::to_string(pos.heads) +
                         ", kv_heads " + std::to_string(pos.kv()) + ")");
  HeadAdvice a;
  a.position = pos;
  a.N = X.rows();
  a.D = X.cols();
  a.d_k = WQ.cols();
  a.d_v = WV.cols();
  a.scale = opts.resolved_scale(a.d_k);
  const std::array<Mat<double>, 3> W0{Mat<double>(WQ), Mat<double>(WK), Mat<double>(WV)};
  for (int w = 0; w < 3; ++w) {
    const ConditionResult<double> c = kappa(W0[static_cast<std::size_t>(w)]);
    const double k = c.kappa;
    a.weyl_threshold[static_cast<std::size_t>(w)] = k == 1 ? std::numeric_limits<double>::infinity()
                                                    : std::isinf(k)
                                                        ? c.sigma_max
                                                        : c.sigma_max * (k + 1) / (k - 1);
  }
  std::vector<double> lambdas = o.lambdas;
  std::sort(lambdas.begin(), lambdas.end());
  lambdas.erase(std::unique(lambdas.begin(), lambdas.end()), lambdas.end());
  const bool grid_has_zero = lambdas.front() == 0;

  // The distinct weight triples and the points that use them.
  std::vector<std::array<Mat<double>, 3>> weights;
  auto point_weights = [&](const CorrectionPlacement& p, double l) {
    return corrected_head_weights(WQ, WK, WV, p, pos, l);
  };
  struct Item {
    double lambda;
    std::string placement;
    std::array<Mat<double>, 3> w;
    std::size_t sweep;  // the placement's λ sweep it belongs to (its warm start)
  };
  std::vector<Item> items;
  if (!grid_has_zero) items.push_back({0.0, "none", W0, 0});
  for (std::size_t pi = 0; pi < o.placements.size(); ++pi)
    for (const double l : lambdas)
      items.push_back({l, o.placements[pi].name(), point_weights(o.placements[pi], l), pi});
  // Each placement's sweep warm-starts every LOBPCG solve (lobpcg, matfree) from the final block
  // of the one before it, at the neighbouring λ (LobpcgOptions::warm); its own block, so that
  // concurrent heads never share one.
  JacobianKappaOptions jo = o.jacobian;
  std::vector<std::shared_ptr<Mat<double>>> warm(o.placements.size());
  for (auto& w : warm) w = std::make_shared<Mat<double>>();

  const std::size_t total = items.size();
  std::size_t done = 0;
  for (std::size_t i = 0; i < items.size(); ++i) {
    AdvicePoint pt;
    pt.lambda = items[i].lambda;
    pt.placement = items[i].placement;
    for (std::size_t j = 0; j < i; ++j)
      if (items[j].w[0] == items[i].w[0] && items[j].w[1] == items[i].w[1] &&
          items[j].w[2] == items[i].w[2]) {
        pt.same_as = static_cast<Index>(j);
        break;
      }
    if (pt.same_as >= 0) {
      const AdvicePoint& src = a.points[static_cast<std::size_t>(pt.same_as)];
      pt.kappa_W = src.kappa_W;
      pt.J = src.J;
      pt.free_bound = src.free_bound;
      pt.diagnostics = src.diagnostics;
    } else {
      const auto t0 = std::chrono::steady_clock::now();
      const auto& w = items[i].w;
      for (std::size_t j = 0; j < 3; ++j) pt.kappa_W[j] = kappa(w[j]);
      const AttentionCache<double> cache = attention_forward(X, w[0], w[1], w[2], opts);
      pt.diagnostics = attention_diagnostics(X, w[0], w[1], w[2], opts, cache.P);
      pt.free_bound = hypothesis_free_bound(X, w[0], w[1], w[2], opts, cache.P);
      jo.lobpcg.warm = jo.matfree.warm = warm[items[i].sweep];
      pt.J = kappa_jacobian<double>(X, w[0], w[1], w[2], opts, jo);
      pt.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    a.points.push_back(std::move(pt));
    if (o.progress) o.progress(static_cast<double>(++done) / static_cast<double>(total));
  }
  // The baseline: the first λ = 0 point.
  for (std::size_t i = 0; i < a.points.size(); ++i)
    if (a.points[i].lambda == 0) {
      a.baseline = static_cast<Index>(i);
      break;
    }
  const AdvicePoint& base = a.points[static_cast<std::size_t>(a.baseline)];
  for (AdvicePoint& p : a.points) detail::judge(p, base, o);
  if (!grid_has_zero) {
    a.points.front().admissible = false;
    a.points.front().reason = "the lambda = 0 reference, not on the grid";
  }

  // Onsets: predicted by the closed form, measured on the grid.
  const std::size_t first = grid_has_zero ? 0 : 1;
  for (std::size_t pi = 0; pi < o.placements.size(); ++pi) {
    const CorrectionPlacement& p = o.placements[pi];
    const Index rq = detail::identity_offset(p, 0, pos, a.d_k, a.d_v);
    const Index rk = detail::identity_offset(p, 1, pos, a.d_k, a.d_v);
    double predicted = std::numeric_limits<double>::quiet_NaN(), var = predicted;
    // The λ² law needs the same coordinates under Q's and K's identities.
    if (rq >= 0 && rq == rk && rq < a.D) {
      const Index width = std::min(a.d_k, a.D - rq);
      const double sum_sq = X.middleCols(rq, width).squaredNorm() / static_cast<double>(a.N);
      var = sum_sq / static_cast<double>(width);
      predicted = predicted_saturation_onset(a.N, a.scale, sum_sq);
    }
    a.predicted_onset.push_back(predicted);
    a.token_variance.push_back(var);
    double measured = std::numeric_limits<double>::quiet_NaN();
    for (std::size_t li = 0; li < lambdas.size(); ++li) {
      const AdvicePoint& pt = a.points[first + pi * lambdas.size() + li];
      if (pt.diagnostics.pattern.saturated_fraction > o.max_saturated_fraction) {
        measured = pt.lambda;
        break;
      }
    }
    a.measured_onset.push_back(measured);
  }
  a.best = recommend({&a});
  return a;
}

}  // namespace spectral_cond
