// spectral-cond: the statistics of one projection W of a checkpoint, or of one head's block of it
// (MATH.md §4, §6, §7): κ of W, of W + λ E in both placements with the Weyl bound, and of the
// exact correction W + C.
#pragma once

#include "analysis_types.hpp"

#include <spectral_cond/conditioning/corrections.hpp>
#include <spectral_cond/conditioning/kappa.hpp>
#include <spectral_cond/core/scaling.hpp>
#include <spectral_cond/linalg/svd.hpp>

#include <array>
#include <cmath>
#include <map>
#include <optional>
#include <string>

namespace spectral_cond::engine {

/// One placement's addend E (MATH.md §7) and whether all its singular values are 1, which the
/// Weyl bound needs; kept per shape so that the check (a product E^T E) runs once per analysis,
/// not once per matrix.
struct Addend {
  Mat<double> E;
  bool unit_singular_values = false;
};

/// The addends of one analysis, by (rows, cols, heads, d, column offset, kind); kind 0 is the
/// identity of shape rows x cols, 1 the per-head stack, 2 a head's column slice of an identity.
class AddendCache {
 public:
  template <typename Make>
  const Addend& get(const std::array<Index, 6>& key, Make&& make) {
    auto it = cache_.find(key);
    if (it == cache_.end()) {
      Addend a;
      a.E = make();
      a.unit_singular_values = has_unit_singular_values<double>(a.E);
      it = cache_.emplace(key, std::move(a)).first;
    }
    return it->second;
  }

 private:
  std::map<std::array<Index, 6>, Addend> cache_;
};

inline CorrectedKappa corrected_kappa(const Mat<double>& W, const Addend& A, double lambda,
                                      double s) {
  const Mat<double>& E = A.E;
  const Mat<double> Wc = W + lambda * E;
  // W + λ E is usually well conditioned (λ = 10 against σ_1(W) of order 1): its Gram
  // eigenvalues then give κ at half the cost of an SVD and to ε κ^2 <= 1e-12; otherwise an SVD.
  const ConditionResult<double> c = kappa_via_gram_or_svd(Wc);
  CorrectedKappa r;
  r.sigma_max = c.sigma_max;
  r.sigma_min = c.sigma_min;
  r.kappa = c.kappa;
  r.weyl_applies = lambda > s && A.unit_singular_values;
  if (r.weyl_applies) r.weyl_bound = (lambda + s) / (lambda - s);
  return r;
}

/// The statistics of W (D x width) or of one head's block of it. `E_fused` and `E_per_head`
/// are the matching blocks of the two placements of MATH.md §7; `same_placements` skips the
/// second SVD when they are equal (one head, or head 0).
inline MatrixStats matrix_stats_unscaled(const std::string& role, const std::string& tensor,
                                         io::Dtype dtype, const Mat<double>& W,
                                         const Addend& E_fused, const Addend& E_per_head,
                                         bool same_placements, double lambda,
                                         const std::optional<double>& target) {
  MatrixStats m;
  m.role = role;
  m.tensor = tensor;
  m.dtype = dtype;
  const ThinSvd<double> svd = thin_svd(W);
  const std::string method = std::min(W.rows(), W.cols()) <= auto_jacobi_max_size ? "jacobi_svd"
                             : have_lapacke() && W.allFinite()                    ? "lapack_dgesdd"
                                                                                  : "bdc_svd";
  m.cond = condition_from_singular_values<double>(svd.S, W.rows(), W.cols(), {}, method);
  const ExactCorrection<double> ex = exact_correction_from_svd<double>(W, svd, target);
  m.exact_kappa = ex.kappa_after;
  m.exact_predicted = ex.kappa_predicted;
  m.exact_alpha = ex.alpha;
  m.fused = corrected_kappa(W, E_fused, lambda, m.cond.sigma_max);
  m.per_head = same_placements ? m.fused : corrected_kappa(W, E_per_head, lambda, m.cond.sigma_max);
  return m;
}

/// The statistics of W (see matrix_stats_unscaled), computed on W 2^k and λ 2^k with powers of
/// two that bring the entries into [1, 2): every κ (of W, of W + λ E, of W + C) and the Weyl
/// bound are unchanged by that scaling (MATH.md §4, §6, §7) and the scaling is exact, so weights
/// near the overflow or underflow threshold of double give the same κ as moderate ones; the
/// singular values and α are scaled back.
inline MatrixStats matrix_stats(const std::string& role, const std::string& tensor, io::Dtype dtype,
                                const Mat<double>& W, const Addend& E_fused,
                                const Addend& E_per_head, bool same_placements, double lambda,
                                const std::optional<double>& target) {
  // Each quantity is computed on W 2^k, exactly (core/scaling.hpp; the factor itself may be
  // out of range, so it is applied entry by entry): κ(W) and W + C with k from max |W_ij|, the
  // placements W + λ E with k from max(max |W_ij|, λ), so that neither W nor λ leaves the range.
  const int k = balancing_exponent<double>(W);
  const int kc = balancing_exponent_of(
      std::max(W.allFinite() ? W.cwiseAbs().maxCoeff() : 0.0, std::abs(lambda)));
  auto scaled = [&W](int e) { return e == 0 ? W : times_pow2<double>(W, e); };
  MatrixStats m = matrix_stats_unscaled(role, tensor, dtype, scaled(k), E_fused, E_per_head,
                                        same_placements, std::ldexp(lambda, k), target);
  for (double* x : {&m.cond.sigma_max, &m.cond.sigma_min, &m.cond.sigma_min_plus, &m.cond.rank_tol,
                    &m.exact_alpha})
    *x = std::ldexp(*x, -k);
  int kp = k;  // the exponent the placements were computed at
  if (kc != k) {
    const Mat<double> Wc = scaled(kc);
    const double lc = std::ldexp(lambda, kc), sc = std::ldexp(m.cond.sigma_max, kc);
    m.fused = corrected_kappa(Wc, E_fused, lc, sc);
    m.per_head = same_placements ? m.fused : corrected_kappa(Wc, E_per_head, lc, sc);
    kp = kc;
  }
  for (double* x :
       {&m.fused.sigma_max, &m.fused.sigma_min, &m.per_head.sigma_max, &m.per_head.sigma_min})
    *x = std::ldexp(*x, -kp);
  return m;
}

}  // namespace spectral_cond::engine
