// spectral_cond: κ(J) from the eigenvalues of the structured Gram matrix J J^T (or J^T J when J is
// tall), never forming J (MATH.md §3, §12). It squares J: σ_min has a relative error of about
// ε κ(J)^2, and singular values below about sqrt(n ε) σ_1 cannot be told from zero.
#pragma once

#include "spectral_cond/conditioning/methods/common.hpp"
#include "spectral_cond/jacobian/gram.hpp"
#include "spectral_cond/linalg/cholesky.hpp"
#include "spectral_cond/linalg/eigen.hpp"
#include "spectral_cond/linalg/lanczos.hpp"

#include <Spectra/MatOp/DenseSymMatProd.h>
#include <Eigen/Eigenvalues>

namespace spectral_cond {

namespace detail {

// The Gram backend of the gram method (MATH.md §12): the symmetric positive semidefinite
// G = J J^T (wide J) or J^T J (tall J), of order n, already formed wherever it is held, seen
// through any class G whose objects offer
//   Index order() const;                           n
//   bool all_finite();                             no NaN or Inf entry
//   std::string eigenvalues(Vec<double>& asc, std::string& why);
//                                                  every eigenvalue, ascending; returns the
//                                                  solver's name, or "" (why says why) when none
//                                                  converged; may overwrite G
//   Op product();                                  Spectra operator y = G x
//   const char* cholesky_name() const;             how factor() factors, for the method's name
//   bool factor();                                 G = L L^T in place; false unless definite
//   Op inverse();                                  Spectra operator y = G^{-1} x, after factor()
// HostGram is the CPU's; cuda::detail::DeviceGram (cuda/backends.cuh) the GPU's, so that
// both paths read G by gram_condition_of.

/// The CPU's Gram backend: G in host memory, LAPACK or Eigen (linalg/eigen.hpp, cholesky.hpp).
struct HostGram {
  Mat<double> G;
  bool factored = false;  ///< factor() succeeded: G holds the Cholesky factor L

  Index order() const { return G.rows(); }
  bool all_finite() const { return G.allFinite(); }
  template <typename = void>  // compiled only where called (the eigensolvers)
  std::string eigenvalues(Vec<double>& ascending, std::string& why) const {
    return symmetric_eigenvalues(G, /*psd=*/true, ascending, why);
  }
  Spectra::DenseSymMatProd<double> product() const { return Spectra::DenseSymMatProd<double>(G); }
  const char* cholesky_name() const { return "Cholesky"; }
  bool factor() { return factored = cholesky_in_place(G); }
  CholeskyInverseOp inverse() const { return CholeskyInverseOp{&G}; }
};

/// κ(J) from the Gram matrix of the m x n Jacobian J (MATH.md §3, §12), on the CPU or the GPU
/// (`G` a Gram backend, above): every eigenvalue when `every_eigenvalue`, else Lanczos for
/// λ_max(G), then G factored in place (peak memory one G) and Lanczos on G^{-1} for λ_min(G).
/// Accuracy ε κ^2, and singular values below sqrt(n ε) σ_1 read as zero (squared_accuracy).
template <typename Gram>
ConditionResult<double> gram_condition_of(Gram& G, Index rows, Index cols, bool every_eigenvalue,
                                          const JacobianKappaOptions& jo) {
  const char* which = rows <= cols ? "J J^T" : "J^T J";
  const Index n = G.order();
  ConditionResult<double> res;
  // Finite inputs can still overflow (huge logits): NaN in G must not read as a zero matrix.
  if (!G.all_finite()) {
    const std::string why =
        std::string(which) + " has NaN or Inf entries (the inputs overflow double)";
    res = invalid_condition<double>(why.c_str());
    res.method = std::string("gram (") + which + ")";
    return res;
  }
  if (every_eigenvalue) {
    Vec<double> lambda;
    std::string why;
    const std::string solver = G.eigenvalues(lambda, why);
    if (solver.empty()) {
      res = invalid_condition<double>("");
      res.info = Info::NotConverging;
      res.method = std::string("gram (eigenvalues of ") + which + ")";
      res.note = "no symmetric eigensolver converged on " + std::string(which) + ": " + why +
                 "; use method qr or lobpcg";
      if (jo.progress) jo.progress(1.0);
      return res;
    }
    res = condition_from_gram_eigenvalues(
        lambda, rows, cols, jo, std::string("gram (eigenvalues of ") + which + ", " + solver + ")");
    if (!why.empty()) res.note = res.note.empty() ? why : why + "; " + res.note;
  } else {
    double lmax = 0;
    {
      auto op = G.product();
      const LanczosOutcome big = lanczos_largest(op, jo.lanczos);
      lmax = big.lambda;
      res.iterations += big.iterations;
      res.residual = big.residual;
    }
    res.method = std::string("gram (Lanczos and ") + G.cholesky_name() + " of " + which + ")";
    res.sigma_max = std::sqrt(std::max(0.0, lmax));
    if (jo.progress) jo.progress(0.5);
    const bool pd = G.factor();
    if (jo.progress) jo.progress(0.8);
    const double floor = std::sqrt(static_cast<double>(n) * ScalarTraits<double>::eps());
    if (!pd && rows > cols) {
      // A tall J is singular by structure (its gauge directions, MATH.md §4): certain.
      res.sigma_min = 0;
      res.kappa = ScalarTraits<double>::inf();
      res.sigma_min_plus = res.kappa_plus = std::numeric_limits<double>::quiet_NaN();
      res.info = Info::Singular;
      res.note = std::string("Cholesky of ") + which +
                 " failed: J is tall, so its gauge directions make it singular (kappa_plus needs "
                 "method qr or dense)";
    } else if (!pd) {
      res.rank_tol = floor * res.sigma_max;
      gram_undecided(res, std::string("the Cholesky factorisation of ") + which + " failed");
    } else {
      auto inv = G.inverse();
      const LanczosOutcome small = lanczos_largest(inv, jo.lanczos);
      const double linv = small.lambda;
      res.iterations += small.iterations;
      res.residual = std::max(res.residual, small.residual);
      res.sigma_min = 1.0 / std::sqrt(linv);
      res.kappa = res.sigma_max / res.sigma_min;
      res.rank = std::min(rows, cols);
      res.sigma_min_plus = res.sigma_min;
      res.kappa_plus = res.kappa;
      if (res.sigma_min < floor * res.sigma_max) {
        res.rank_tol = floor * res.sigma_max;
        std::ostringstream why;
        why << "sigma_min = " << res.sigma_min << " lies below it";
        gram_undecided(res, why.str());
      }
      if (!std::isfinite(lmax) || !std::isfinite(linv)) res.info = Info::NotConverging;
    }
  }
  if (jo.progress) jo.progress(1.0);
  squared_accuracy(res, jo);
  return res;
}

/// kappa_jacobian_gram on inputs in double: G formed on the host (structured, gram.hpp), read by
/// gram_condition_of. When `factor` is given and the Cholesky route ran and succeeded, the
/// Cholesky factor of J J^T is moved there (for lobpcg, which then need not form and factor J J^T
/// again).
template <typename = void>
inline ConditionResult<double> gram_condition(const KJInputs& in, const JacobianKappaOptions& jo,
                                              Mat<double>* factor) {
  HostGram G{in.wide() ? attention_gram(in.X, in.WQ, in.WK, in.WV, in.opts)
                       : attention_normal(in.X, in.WQ, in.WK, in.WV, in.opts)};
  if (jo.progress) jo.progress(0.3);
  ConditionResult<double> res =
      gram_condition_of(G, in.rows, in.cols, G.order() <= jo.gram_eig_max, jo);
  if (factor != nullptr && in.wide() && G.factored) *factor = std::move(G.G);
  return res;
}

}  // namespace detail

/// κ(J) from the structured Gram matrix (MATH.md §3), without forming J. Accuracy ε κ^2.
template <typename Scalar>
ConditionResult<double> kappa_jacobian_gram(const CRef<Scalar>& X, const CRef<Scalar>& WQ,
                                            const CRef<Scalar>& WK, const CRef<Scalar>& WV,
                                            const AttentionOptions<Scalar>& opts,
                                            const JacobianKappaOptions& jo = {}) {
  if (auto bad =
          detail::check_kj_inputs<Scalar>("kappa_jacobian_gram", X, WQ, WK, WV, opts, jo, "gram"))
    return *bad;
  const detail::KJInputs in = detail::kj_inputs<Scalar>(X, WQ, WK, WV, opts);
  return detail::validated(in, detail::gram_condition(in, jo, nullptr), jo);
}

}  // namespace spectral_cond
