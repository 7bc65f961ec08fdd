// spectral_cond: the paper's spectral corrections of a weight matrix W (MATH.md §6–7).
//
//   exact (Theorem 3.5):  W + C,  C = σ_1 U V^T  (or α U V^T for a target t)   kappa <= 2 (or t)
//   cheap (Theorem 3.8):  W + λ I_k,  I_k the rectangular identity of W's shape, λ fixed
//
// Every kappa reported here is computed from an SVD of the corrected matrix (kappa.hpp), never
// assumed from the theorem; the theorem's value is reported beside it.
#pragma once

#include "spectral_cond/conditioning/kappa.hpp"
#include "spectral_cond/linalg/svd.hpp"

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace spectral_cond {

/// Result of the exact correction (MATH.md §6, the paper's Theorem 3.5).
template <typename Scalar>
struct ExactCorrection {
  Mat<Scalar> C;                 ///< the correction α U V^T (m x n)
  Mat<Scalar> W_corrected;       ///< W + C
  Scalar alpha = 0;              ///< σ_1 (default), (σ_1 - t σ_r)/(t - 1) (target), or 0
  std::optional<Scalar> target;  ///< the target t, when one was asked for
  Scalar kappa_before = 0;       ///< kappa(W), computed from W's singular values
  Scalar kappa_after = 0;        ///< kappa(W + C), computed from a fresh SVD of W + C
  Scalar kappa_predicted = 0;    ///< 2 σ_1 / (σ_1 + σ_r), or t, or kappa(W) when α = 0
  bool corrected = false;        ///< α > 0
  Info info = Info::Success;     ///< of W + C: Success, Singular (W = 0), InvalidInput (NaN)
  std::string note;
};

namespace detail {
template <typename Scalar>
void check_target(const char* fn, const std::optional<Scalar>& target) {
  if (target && !(std::isfinite(*target) && *target > Scalar(1))) {
    std::ostringstream s;
    s << "target must be finite and > 1 (got " << *target << ")";
    fail(fn, s.str());
  }
}

/// α of MATH.md §6: σ_1 without a target; (σ_1 - t σ_r)/(t - 1) when σ_1 > t σ_r; else 0.
template <typename Scalar>
Scalar exact_alpha(Scalar s1, Scalar sr, const std::optional<Scalar>& target) {
  if (!target) return s1;
  return s1 > *target * sr ? (s1 - *target * sr) / (*target - Scalar(1)) : Scalar(0);
}

/// The report of the exact correction of an m x n W (MATH.md §6) from W's singular values `S`
/// (decreasing, min(m, n) of them, finite) and the κ of the corrected W + C, `after`, however
/// that was computed: α, κ before, the theorem's prediction, whether W was corrected, κ after,
/// Info and the note. C and W_corrected are left to the caller. Shared by exact_correction_from_svd
/// and the GPU's exact_correction_batched, so that both report by the same rules.
template <typename Scalar>
ExactCorrection<Scalar> exact_correction_report(const Vec<Scalar>& S, Index m, Index n,
                                                const std::optional<Scalar>& target,
                                                const ConditionResult<Scalar>& after) {
  ExactCorrection<Scalar> res;
  res.target = target;
  const Scalar s1 = S(0), sr = S(S.size() - 1);
  res.kappa_before = condition_from_singular_values<Scalar>(S, m, n).kappa;
  res.alpha = exact_alpha<Scalar>(s1, sr, target);
  std::ostringstream note;
  if (!target) {
    res.kappa_predicted = s1 > Scalar(0) ? Scalar(2) * s1 / (s1 + sr) : ScalarTraits<Scalar>::inf();
  } else if (res.alpha > Scalar(0)) {
    res.kappa_predicted = *target;
  } else {
    res.kappa_predicted = res.kappa_before;
    note << "no correction needed: sigma_1 <= t sigma_r (kappa(W) = " << res.kappa_before
         << " <= t = " << *target << "); alpha = 0";
  }
  res.corrected = res.alpha > Scalar(0);
  res.kappa_after = after.kappa;
  res.info = after.info;
  if (s1 == Scalar(0)) note << "W = 0: the correction is zero and W + C stays singular";
  res.note = note.str();
  return res;
}
}  // namespace detail

/// The exact correction from a precomputed thin SVD of W (for refreshes during training, where
/// the SVD may be reused). Default (no target): C = σ_1 U V^T, so W + C = U (Σ + σ_1 I) V^T and
/// kappa(W + C) = 2 σ_1 / (σ_1 + σ_r) <= 2, exactly 2 for a rank-deficient W. With a target
/// t > 1 and σ_1 > t σ_r: C = α U V^T, α = (σ_1 - t σ_r)/(t - 1), kappa(W + C) = t; when
/// σ_1 <= t σ_r, α = 0 (no correction needed, noted). Singular vectors are unchanged.
/// MATH.md §6. Throws for shapes that disagree or a target that is not finite and > 1.
template <typename Scalar>
ExactCorrection<Scalar> exact_correction_from_svd(const CRef<Scalar>& W, const ThinSvd<Scalar>& svd,
                                                  std::optional<Scalar> target = {}) {
  constexpr const char* fn = "exact_correction_from_svd";
  detail::check_nonempty<Scalar>(fn, W);
  detail::check_target<Scalar>(fn, target);
  const Index m = W.rows(), n = W.cols(), r = std::min(m, n);
  detail::require_shape(fn, "svd.U", "m x min(m, n)", m, r, svd.U);
  detail::require_shape(fn, "svd.V", "n x min(m, n)", n, r, svd.V);
  detail::require_shape(fn, "svd.S", "min(m, n) x 1", r, 1, svd.S);
  ExactCorrection<Scalar> res;
  res.target = target;
  const Scalar nan = std::numeric_limits<Scalar>::quiet_NaN();
  if (!W.allFinite() || !svd.S.allFinite() || !svd.U.allFinite() || !svd.V.allFinite()) {
    res.C = Mat<Scalar>::Constant(m, n, nan);
    res.W_corrected = res.C;
    res.alpha = res.kappa_before = res.kappa_after = res.kappa_predicted = nan;
    res.info = Info::InvalidInput;
    res.note = "W or its SVD contains NaN or Inf";
    return res;
  }
  const Scalar alpha = detail::exact_alpha<Scalar>(svd.S(0), svd.S(r - 1), target);
  Mat<Scalar> C = alpha * svd.U * svd.V.transpose();
  Mat<Scalar> W_corrected = W + C;
  // κ(W + C) is at most 2 when the correction is the plain one: in double, the Gram eigenvalues
  // give it to ε κ^2 <= 1e-12 at half the cost of the SVD that `kappa` falls back to.
  ConditionResult<Scalar> after;
  if constexpr (std::is_same<Scalar, double>::value)
    after = detail::kappa_via_gram_or_svd(W_corrected);
  else
    after = kappa(W_corrected);
  res = detail::exact_correction_report<Scalar>(svd.S, m, n, target, after);
  res.C = std::move(C);
  res.W_corrected = std::move(W_corrected);
  return res;
}

/// The exact correction of W (MATH.md §6), computing the thin SVD itself; see
/// exact_correction_from_svd. Cost: one dense SVD of W, and for the report κ(W + C) by its Gram
/// eigenvalues (double, when accurate to ε κ^2 <= 1e-12: kappa_via_gram) or a second SVD.
template <typename D>
ExactCorrection<typename D::Scalar> exact_correction(
    const Eigen::MatrixBase<D>& W, std::optional<typename D::Scalar> target = {}) {
  using Scalar = typename D::Scalar;
  const CRef<Scalar> w(W);
  detail::check_nonempty<Scalar>("exact_correction", w);
  detail::check_target<Scalar>("exact_correction", target);
  ThinSvd<Scalar> svd;
  if (w.allFinite())
    svd = thin_svd(w);
  else {  // let the SVD-taking form report InvalidInput without running an SVD on NaN
    const Index r = std::min(w.rows(), w.cols());
    svd.U = Mat<Scalar>::Zero(w.rows(), r);
    svd.V = Mat<Scalar>::Zero(w.cols(), r);
    svd.S = Vec<Scalar>::Zero(r);
  }
  return exact_correction_from_svd<Scalar>(w, svd, target);
}

/// The rectangular identity I_k of shape rows x cols: ones on the main diagonal (MATH.md §7).
/// All its min(rows, cols) singular values are 1. Throws unless rows, cols >= 1.
template <typename Scalar = double>
Mat<Scalar> rectangular_identity(Index rows, Index cols) {
  if (rows < 1 || cols < 1)
    detail::fail("rectangular_identity",
                 "rows and cols must be >= 1 (got " + detail::shape_str(rows, cols) + ")");
  return Mat<Scalar>::Identity(rows, cols);
}

/// Where λ I goes in a multi-head layer: the shape the rectangular identity is taken from
/// (MATH.md §7, "Placements").
enum class Placement {
  Fused,    ///< I of each fused D x (heads d) projection: head j gets its d-slice of it
  PerHead,  ///< each head's D x d block gets its own top rectangular identity I(D, d)
  /// I of the packed D x [W_Q | W_K | W_V] weight (timm's qkv, PyTorch's in_proj_weight): the
  /// projection whose columns start at o in it receives E(o + j, j) for o + j < D; with
  /// D = heads d_k, the Q block alone.
  Packed,
};

inline const char* to_string(Placement p) {
  switch (p) {
    case Placement::Fused:
      return "fused";
    case Placement::PerHead:
      return "per_head";
    case Placement::Packed:
      return "packed";
  }
  return "unknown";
}

/// The D x (heads d_head) matrix E whose multiple λ E is added to a fused projection
/// (MATH.md §7). Fused: E = I(D, heads d_head), so head j receives columns [j d, (j+1) d) of it,
/// which equal rows [j d, (j+1) d) of I when (j+1) d <= D, and are partly or wholly zero beyond
/// D. PerHead: E = [I(D, d) | … | I(D, d)]. Packed: E(packed_offset + j, j) = 1 for rows below
/// D, packed_offset being the projection's first column in the packed weight (Fused is Packed
/// with offset 0).
template <typename Scalar = double>
Mat<Scalar> lambda_identity(Index D, Index heads, Index d_head, Placement placement,
                            Index packed_offset = 0) {
  if (D < 1 || heads < 1 || d_head < 1 || packed_offset < 0) {
    std::ostringstream s;
    s << "D, heads and d_head must be >= 1 and packed_offset >= 0 (got " << D << ", " << heads
      << ", " << d_head << ", " << packed_offset << ")";
    detail::fail("lambda_identity", s.str());
  }
  Mat<Scalar> E = Mat<Scalar>::Zero(D, heads * d_head);
  if (placement == Placement::PerHead) {
    for (Index j = 0; j < heads; ++j) E.middleCols(j * d_head, d_head).setIdentity();
    return E;
  }
  const Index r0 = placement == Placement::Packed ? packed_offset : 0;
  for (Index j = 0; j < E.cols() && r0 + j < D; ++j) E(r0 + j, j) = Scalar(1);
  return E;
}

/// Where λ I goes: a layout and the projections that receive it (any non-empty subset of q, k,
/// v). Packed is the identity of the packed weight as a whole: which projections it reaches
/// follows from the widths (with D = heads d_k, the Q block alone).
struct CorrectionPlacement {
  Placement layout = Placement::Fused;
  bool q = true, k = true, v = true;

  /// "fused", "per_head", "packed"; a subset is appended: "fused:qk", "per_head:v".
  std::string name() const {
    std::string s = to_string(layout);
    if (layout != Placement::Packed && !(q && k && v)) {
      s += ':';
      if (q) s += 'q';
      if (k) s += 'k';
      if (v) s += 'v';
    }
    return s;
  }
  /// Whether projection `which` (0 q, 1 k, 2 v) is in the subset.
  bool receives(int which) const { return which == 0 ? q : which == 1 ? k : v; }
  bool operator==(const CorrectionPlacement& o) const {
    return layout == o.layout && q == o.q && k == o.k && v == o.v;
  }
};

/// Parses a placement name ("fused", "per_head" or "per-head", "packed", with ":SUBSET" of q, k,
/// v for the first two). Throws std::invalid_argument naming `what` and the name.
inline CorrectionPlacement parse_placement(const std::string& text,
                                           const std::string& what = "placement") {
  const auto colon = text.find(':');
  const std::string base = text.substr(0, colon);
  CorrectionPlacement p;
  if (base == "fused") {
    p.layout = Placement::Fused;
  } else if (base == "per_head" || base == "per-head") {
    p.layout = Placement::PerHead;
  } else if (base == "packed") {
    p.layout = Placement::Packed;
  } else {
    throw std::invalid_argument(what + ": unknown placement '" + text +
                                "' (expected fused, per_head or packed, optionally with :q, :k, "
                                ":v or a combination such as fused:qk)");
  }
  if (colon == std::string::npos) return p;
  const std::string subset = text.substr(colon + 1);
  if (p.layout == Placement::Packed)
    throw std::invalid_argument(what + ": '" + text +
                                "': packed is the identity of the whole packed weight and takes "
                                "no subset of projections");
  p.q = p.k = p.v = false;
  for (const char c : subset) {
    bool* flag = c == 'q' ? &p.q : c == 'k' ? &p.k : c == 'v' ? &p.v : nullptr;
    if (!flag || *flag)
      throw std::invalid_argument(what + ": '" + text +
                                  "': the subset must be distinct letters among q, k and v");
    *flag = true;
  }
  if (!(p.q || p.k || p.v))
    throw std::invalid_argument(what + ": '" + text + "': the subset of projections is empty");
  return p;
}

/// Result of the λ I_k correction (MATH.md §7, the paper's Theorem 3.8), with the Weyl bound.
template <typename Scalar>
struct LambdaCorrection {
  Mat<Scalar> W_corrected;  ///< W + λ E (E = I_k for lambda_correction)
  Scalar lambda = 0;        ///< λ
  Scalar s = 0;             ///< σ_1(W)
  Scalar kappa_before = 0;  ///< kappa(W)
  Scalar kappa_after = 0;   ///< kappa(W + λ E), from an SVD of W + λ E
  /// The added matrix is λ times a matrix whose min(m, n) singular values are all 1 (orthonormal
  /// columns or rows), the hypothesis under which Weyl gives |σ_i(W + λ E) - λ| <= s.
  bool isometric_addend = false;
  /// isometric_addend and λ > s: then kappa_after <= weyl_bound is a theorem.
  bool weyl_applies = false;
  Scalar weyl_bound = 0;  ///< (λ + s)/(λ - s) when weyl_applies, else +inf
  /// s (κ + 1)/(κ - 1), κ = kappa(W): the smallest λ beyond which Weyl guarantees
  /// kappa_after < kappa_before. +inf when κ = 1 (no λ can improve it); s when κ = +inf.
  Scalar lambda_min = 0;
  bool improvement_guaranteed = false;  ///< weyl_applies and λ > lambda_min
  Info info = Info::Success;            ///< of W + λ E: Success, Singular, InvalidInput
  std::string note;
};

/// Whether all min(m, n) singular values of the m x n matrix E are 1 (E has orthonormal columns
/// or rows): E^T E = I when n <= m, else E E^T = I, entry by entry to 4 (m + n) ε. That is the
/// hypothesis under which Weyl's inequality bounds κ(W + λ E) by (λ + s)/(λ - s), s = σ_1(W)
/// (MATH.md §7); a head's slice of a fused λ I_k may fail it (§7, "Multi-head placement").
template <typename Scalar>
bool has_unit_singular_values(const CRef<Scalar>& E) {
  const Mat<Scalar> G =
      E.cols() <= E.rows() ? Mat<Scalar>(E.transpose() * E) : Mat<Scalar>(E * E.transpose());
  const Scalar tol =
      Scalar(4) * static_cast<Scalar>(E.rows() + E.cols()) * ScalarTraits<Scalar>::eps();
  return (G - Mat<Scalar>::Identity(G.rows(), G.cols())).cwiseAbs().maxCoeff() <= tol;
}

namespace detail {

using spectral_cond::has_unit_singular_values;  // lambda_report's name for it

/// The report of W + λ E for a given unit-scale addend E (MATH.md §7).
template <typename Scalar>
LambdaCorrection<Scalar> lambda_report(const char* fn, const CRef<Scalar>& W, const CRef<Scalar>& E,
                                       Scalar lambda) {
  if (!(std::isfinite(lambda) && lambda >= Scalar(0))) {
    std::ostringstream s;
    s << "lambda must be finite and >= 0 (got " << lambda << ")";
    fail(fn, s.str());
  }
  const Scalar inf = ScalarTraits<Scalar>::inf();
  LambdaCorrection<Scalar> res;
  res.lambda = lambda;
  res.W_corrected = W + lambda * E;
  const ConditionResult<Scalar> before = kappa(W), after = kappa(res.W_corrected);
  res.s = before.sigma_max;
  res.kappa_before = before.kappa;
  res.kappa_after = after.kappa;
  res.info = before.info == Info::InvalidInput ? before.info : after.info;
  if (res.info == Info::InvalidInput) {
    res.weyl_bound = res.lambda_min = std::numeric_limits<Scalar>::quiet_NaN();
    res.note = "W contains NaN or Inf";
    return res;
  }
  const Scalar k = res.kappa_before;
  res.lambda_min = k == Scalar(1) ? inf : k == inf ? res.s : res.s * (k + 1) / (k - 1);
  res.isometric_addend = has_unit_singular_values<Scalar>(E);
  res.weyl_applies = res.isometric_addend && lambda > res.s;
  res.weyl_bound = res.weyl_applies ? (lambda + res.s) / (lambda - res.s) : inf;
  res.improvement_guaranteed = res.weyl_applies && lambda > res.lambda_min;
  std::ostringstream note;
  if (!res.isometric_addend)
    note << "the added matrix is not lambda times an isometry: no Weyl bound is claimed";
  else if (!res.weyl_applies)
    note << "lambda <= sigma_1(W) = " << res.s << ": the Weyl bound does not apply";
  else if (!res.improvement_guaranteed)
    note << "lambda <= lambda_min = " << res.lambda_min << ": improvement is not guaranteed";
  res.note = note.str();
  return res;
}

}  // namespace detail

/// W + λ I_k with I_k the rectangular identity of W's shape (MATH.md §7), its kappa before and
/// after, and the Weyl bound kappa(W + λ I_k) <= (λ + s)/(λ - s), s = σ_1(W), valid for λ > s.
/// λ must be finite and >= 0. Cost: two dense SVDs.
template <typename D>
LambdaCorrection<typename D::Scalar> lambda_correction(const Eigen::MatrixBase<D>& W,
                                                       typename D::Scalar lambda) {
  using Scalar = typename D::Scalar;
  const CRef<Scalar> w(W);
  detail::check_nonempty<Scalar>("lambda_correction", w);
  const Mat<Scalar> E = Mat<Scalar>::Identity(w.rows(), w.cols());
  return detail::lambda_report<Scalar>("lambda_correction", w, E, lambda);
}

/// Per-head reports of W_fused + λ lambda_identity(D, heads, d, placement) (MATH.md §7–8):
/// entry j is head j's D x d block, d = cols / heads, before and after. Each kappa is computed
/// from an SVD. The Weyl bound is claimed only where its hypothesis holds: the head's slice of
/// the added matrix must be λ times a matrix with orthonormal columns (or rows). For PerHead it
/// always is; for Fused it is when (j+1) d <= D (the slice is rows [j d, (j+1) d) of I, a
/// permuted identity block), and not for heads whose slice runs past D (partly zero); likewise
/// for Packed, whose slices start at row packed_offset + j d.
template <typename D>
std::vector<LambdaCorrection<typename D::Scalar>> multihead_lambda_report(
    const Eigen::MatrixBase<D>& W_fused, Index heads, typename D::Scalar lambda,
    Placement placement, Index packed_offset = 0) {
  using Scalar = typename D::Scalar;
  constexpr const char* fn = "multihead_lambda_report";
  const CRef<Scalar> w(W_fused);
  detail::check_nonempty<Scalar>(fn, w);
  if (heads < 1 || w.cols() % heads != 0) {
    std::ostringstream s;
    s << "heads must be >= 1 and divide the " << w.cols() << " columns of W_fused (got " << heads
      << ")";
    detail::fail(fn, s.str());
  }
  const Index d = w.cols() / heads;
  const Mat<Scalar> E = lambda_identity<Scalar>(w.rows(), heads, d, placement, packed_offset);
  std::vector<LambdaCorrection<Scalar>> out;
  out.reserve(static_cast<size_t>(heads));
  for (Index j = 0; j < heads; ++j)
    out.push_back(
        detail::lambda_report<Scalar>(fn, w.middleCols(j * d, d), E.middleCols(j * d, d), lambda));
  return out;
}

}  // namespace spectral_cond
