// spectral_cond: kappa(J) of the attention Jacobian by QR of the compressed Jacobian (MATH.md §3,
// "Squaring is not affordable" and "The compressed Jacobian"; kappa semantics of §4).
//
// J and J~ (compressed.hpp) share their nonzero singular values. When J~ ((N d_v) x n~) is wide,
// the triangular factor R ((N d_v) x (N d_v)) of J~^T = Q R has them too (J~ J~^T = R^T R); it is
// built by streaming column blocks of J~, as row blocks B of J~^T, into R <- qr([R; B]).R with
// the structured blocked Householder update of LAPACK's tpqrt: peak memory R plus one block,
// never J~ whole, never J. J~_V^T = I_{d_v} ⊗ (P L)^T is not streamed: its triangular factor is
// I_{d_v} ⊗ R_1 with R_1 from the QR of the r x N matrix (P L)^T, which is where R starts. When
// J~ is tall it is factored directly. Then σ_max and σ_min of R by Lanczos (Spectra) on R^T R
// and on (R^T R)^{-1} (two triangular solves per step), or a dense SVD of R when it is small.
//
// Accuracy: Householder QR and triangular solves are backward stable, so σ_min carries a
// relative error of about ε κ(J) (times a modest polynomial in the sizes, omitted), not the
// ε κ(J)^2 of anything that forms J J^T or runs Lanczos on J^T J. The factorisation always runs
// in double, even for float inputs (which double represents exactly): the result is κ of the
// float data, to double accuracy.
#pragma once

#include "spectral_cond/conditioning/methods/common.hpp"
#include "spectral_cond/jacobian/compressed.hpp"
#include "spectral_cond/linalg/lanczos.hpp"
#include "spectral_cond/linalg/tpqrt.hpp"

#include <Eigen/QR>

#include <optional>

namespace spectral_cond {

namespace detail {

/// Streams columns [j_begin, j_end) of `src` (rows() x cols(), columns(j0, m, out)) as rows of
/// its transpose into R. Progress goes from `p0` to `p1`.
template <typename Source>
void stream_into_r(const Source& src, Index j_begin, Index j_end, Mat<double>& R,
                   const QrKappaOptions& q, double p0, double p1) {
  const Index n = R.rows(), total = j_end - j_begin;
  const Index auto_m = std::clamp<Index>((Index(1) << 24) / std::max<Index>(n, 1), 256, 4096);
  const Index m = std::min(total, q.block_cols > 0 ? q.block_cols : auto_m);
  if (m == 0) return;
  Mat<double> cols(n, m), B(m, n);
  TpqrtWork w;
  for (Index j0 = j_begin; j0 < j_end; j0 += m) {
    const Index mb = std::min(m, j_end - j0);
    src.columns(j0, mb, cols.leftCols(mb));
    B.topRows(mb) = cols.leftCols(mb).transpose();
    tpqrt_update(R, B.topRows(mb), std::min(q.panel, n), q.resolved_threads(), w);
    if (q.progress) q.progress(p0 + (p1 - p0) * double(j0 + mb - j_begin) / double(total));
  }
}

/// κ from the Lanczos outcomes on R^T R (`big`) and (R^T R)^{-1} (`small`, unused when R has a
/// zero on its diagonal) for R of order k (MATH.md §3); shared by the CPU and GPU qr routes.
/// Empty when σ_min is below the rank tolerance and k <= dense_svd_max: the caller then takes
/// the singular values of R by a dense SVD for the rank and kappa_plus.
template <typename = void>
inline std::optional<ConditionResult<double>> condition_from_lanczos(
    const LanczosOutcome& big, const LanczosOutcome& small, bool singular_diag, Index k, Index mJ,
    Index nJ, const QrKappaOptions& q, std::ostringstream& note) {
  KappaOptions<double> ko;
  ko.rtol = q.rtol;
  ConditionResult<double> res;
  res.method = "qr";
  res.sigma_max = std::sqrt(big.lambda);
  res.sigma_min = singular_diag ? 0.0 : 1.0 / std::sqrt(small.lambda);
  res.rank_tol = ko.resolved_rtol(mJ, nJ) * res.sigma_max;
  res.iterations = small.operations;
  res.residual = small.residual;
  if (!big.converged || (!singular_diag && !small.converged)) {
    res.info = Info::NotConverging;
    res.sigma_min = res.sigma_min_plus = res.kappa = res.kappa_plus = res.accuracy =
        std::numeric_limits<double>::quiet_NaN();
    note << "; Lanczos did not converge (raise lanczos.max_iterations or lanczos.ncv)";
    return res;
  }
  if (res.sigma_min > res.rank_tol) {
    res.rank = k;
    res.sigma_min_plus = res.sigma_min;
    res.kappa = res.kappa_plus = res.sigma_max / res.sigma_min;
    res.accuracy = ScalarTraits<double>::eps() * res.kappa + q.lanczos.tol;
    detail::certify_rank(res, res.sigma_min, 0.0, ko.rank_margin);
    return res;
  }
  if (k <= q.dense_svd_max) return std::nullopt;
  res.info = Info::Singular;
  res.kappa = res.accuracy = ScalarTraits<double>::inf();
  res.sigma_min_plus = res.kappa_plus = std::numeric_limits<double>::quiet_NaN();
  res.rank = -1;
  note << "; numerically singular, but R (order " << k << ") exceeds dense_svd_max, so the rank "
       << "and kappa_plus were not computed (rank = -1)";
  return res;
}

// The triangular backend of the qr method (MATH.md §12): the upper triangular R (k x k) whose
// singular values are J's nonzero ones, wherever it is held, seen through any class T whose
// objects offer
//   Index order() const;            k
//   Vec<double> diagonal() const;   R's diagonal
//   M matrix() const;               R on the host (Mat<double> or a reference to one), for a
//                                   dense SVD
//   Op gram() const;                Spectra operator y = R^T R x
//   Op inverse_gram() const;        Spectra operator y = (R^T R)^{-1} x (two triangular solves)
//   const char* library() const;    who computes the products, for the note ("" or "cuBLAS ")
// HostTriangular is the CPU's; cuda::detail::DeviceTriangular (cuda/backends.cuh) the GPU's, so
// that both paths read R by condition_of_triangular.

/// The CPU's triangular backend: R in host memory (TriangularGramOp, Eigen's solves).
struct HostTriangular {
  const Mat<double>& R;
  Index order() const { return R.rows(); }
  Vec<double> diagonal() const { return R.diagonal(); }
  const Mat<double>& matrix() const { return R; }
  TriangularGramOp gram() const { return TriangularGramOp(R, false); }
  TriangularGramOp inverse_gram() const { return TriangularGramOp(R, true); }
  const char* library() const { return ""; }
};

/// κ of the m_J x n_J matrix whose nonzero singular values are those of R (k x k, k <= min(m_J,
/// n_J); the other min(m_J, n_J) - k are exactly zero), R a triangular backend (above): dense
/// SVD or Lanczos, see the header (MATH.md §12, qr). Shared by the CPU and GPU qr routes.
template <typename Triangular>
ConditionResult<double> condition_of_triangular(const Triangular& R, Index mJ, Index nJ, bool tall,
                                                const QrKappaOptions& q, std::ostringstream& note) {
  const Index k = R.order(), rJ = std::min(mJ, nJ);
  KappaOptions<double> ko;
  ko.rtol = q.rtol;
  auto dense = [&](const char* why) {
    Vec<double> sv = Vec<double>::Zero(rJ);
    note << "; singular values of R by a dense SVD (" << why << ")";
    if (k > 0) {
      const Mat<double> Rm = R.matrix();
      const Eigen::BDCSVD<Mat<double>> svd(Rm);
      if (!Rm.allFinite() || svd.info() != Eigen::Success) {  // never unset values as σ
        ConditionResult<double> bad = invalid_condition<double>("");
        bad.info = Rm.allFinite() ? Info::NotConverging : Info::InvalidInput;
        bad.method = "qr";
        bad.note = Rm.allFinite() ? "the SVD of R did not converge"
                                  : "R has NaN or Inf entries (the inputs overflow double)";
        return bad;
      }
      sv.head(k) = svd.singularValues();
    }
    return condition_from_singular_values<double>(sv, mJ, nJ, ko, "qr");
  };
  if (k < 64 || k < rJ || (tall && k <= q.dense_svd_max))
    return dense(k < rJ ? "structural zeros" : "R is small or J~ tall");
  const bool singular_diag = (R.diagonal().array() == 0.0).any();
  auto gram = R.gram();
  auto inverse_gram = R.inverse_gram();
  auto run = [&](Index ncv, LanczosOutcome& big, LanczosOutcome& small) {
    LanczosOptions lo = q.lanczos;
    lo.ncv = ncv;
    big = lanczos_largest(gram, lo);
    lo.seed = q.lanczos.seed + 1;
    small = singular_diag ? LanczosOutcome{} : lanczos_largest(inverse_gram, lo);
    return big.converged && (singular_diag || small.converged);
  };
  LanczosOutcome big, small;
  if (!run(q.lanczos.ncv, big, small)) {
    // Clustered extreme singular values slow the residual's convergence, which then depends on
    // rounding (and so on the BLAS thread count): R's own SVD answers where it fits, else a
    // wider Krylov space is tried once.
    if (k <= q.dense_svd_max)
      return dense("Lanczos on R did not converge: clustered extreme singular values");
    run(std::min(k, 4 * q.lanczos.ncv), big, small);
  }
  note << "; sigma_max by Lanczos on R^T R (" << big.operations << " " << R.library()
       << "products), sigma_min by Lanczos on (R^T R)^{-1} (" << small.operations << " pairs of "
       << R.library() << "triangular solves, relative residual " << small.residual << ")";
  std::optional<ConditionResult<double>> res =
      condition_from_lanczos(big, small, singular_diag, k, mJ, nJ, q, note);
  return res ? *res : dense("sigma_min is below the rank tolerance");
}

/// condition_of_triangular for R in host memory.
template <typename = void>
inline ConditionResult<double> condition_of_r(const Mat<double>& R, Index mJ, Index nJ, bool tall,
                                              const QrKappaOptions& q, std::ostringstream& note) {
  return condition_of_triangular(HostTriangular{R}, mJ, nJ, tall, q, note);
}

/// What the qr note says of J~'s shape (MATH.md §4): `rows` x `cols` the factored J~ (reduced or
/// not), `cj_rows` x `cj_cols` the unreduced J~. Shared by the CPU and GPU qr routes.
inline void qr_structure_note(Index rows, Index cols, Index cj_rows, Index cj_cols,
                              std::ostringstream& note) {
  if (cj_rows > cj_cols)
    note << "; J~ is tall: the gauge directions (W_Q E, -W_K E^T, 0) lie in the null space "
            "(MATH.md §4), kappa_plus is the informative number";
  else if (rows > cols)
    note << "; the reduced J~ has fewer columns than rows, so rank(J) < N d_v: J is "
            "singular by its structure, kappa_plus is the informative number";
}

/// The qr method on any compressed Jacobian `src` of an m_J x n_J Jacobian; `r1_cols` > 0
/// means that columns [cols - r1_cols, cols) of src are I_{d_v} ⊗ P L (seeded from PL).
template <typename Source>
ConditionResult<double> qr_condition(const Source& src, Index mJ, Index nJ, const Mat<double>* PL,
                                     const QrKappaOptions& q, std::ostringstream& note) {
  const Index rows = src.rows(), cols = src.cols();
  Mat<double> R;
  const bool tall = rows > cols;
  if (!tall) {  // R of J~^T: (N d_v) x (N d_v)
    R = Mat<double>::Zero(rows, rows);
    Index streamed = cols;
    if (PL != nullptr && PL->cols() > 0) {  // start from I_{d_v} ⊗ R_1, R_1 of (P L)^T
      const Index N = PL->rows(), r = PL->cols();
      Eigen::HouseholderQR<Mat<double>> qr1(PL->transpose());
      Mat<double> R1 = Mat<double>::Zero(N, N);
      R1.topRows(r) = qr1.matrixQR().topRows(r).triangularView<Eigen::Upper>();
      for (Index b = 0; b < rows / N; ++b) R.block(b * N, b * N, N, N) = R1;
      streamed = cols - r * (rows / N);
    }
    note << "qr: R of J~^T (" << cols << " x " << rows << "), " << streamed
         << " rows streamed into I_{d_v} (x) R_1";
    stream_into_r(src, 0, streamed, R, q, 0.0, 0.95);
  } else {  // J~ tall: factor it whole (it is smaller than (N d_v)^2)
    Mat<double> B(rows, cols);
    src.columns(0, cols, B);
    R = Mat<double>::Zero(cols, cols);
    TpqrtWork w;
    tpqrt_update(R, B, std::min(q.panel, std::max<Index>(cols, 1)), q.resolved_threads(), w);
    note << "qr: R of J~ (" << rows << " x " << cols << ", tall)";
    if (q.progress) q.progress(0.95);
  }
  ConditionResult<double> res = condition_of_r(R, mJ, nJ, tall, q, note);
  if (q.progress) q.progress(1.0);
  return res;
}

template <typename Scalar, typename Compressed, typename Finish>
ConditionResult<double> kappa_qr_driver(const char* fn, const CRef<Scalar>& X,
                                        const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                                        const CRef<Scalar>& WV,
                                        const AttentionOptions<Scalar>& opts,
                                        const QrKappaOptions& q, Finish&& finish) {
  q.check(fn);
  check_attention_inputs<Scalar>(fn, X, WQ, WK, WV);
  opts.check(fn, X.rows());
  if (!(X.allFinite() && WQ.allFinite() && WK.allFinite() && WV.allFinite())) {
    auto bad = invalid_condition<double>("X or W contains NaN or Inf");
    bad.method = "qr";
    return bad;
  }
  const Mat<double> Xd = X.template cast<double>(), WQd = WQ.template cast<double>(),
                    WKd = WK.template cast<double>(), WVd = WV.template cast<double>();
  const Compressed src(Xd, WQd, WKd, WVd, to_double(opts));
  std::ostringstream note;
  ConditionResult<double> res = finish(src, note);
  if (!res.note.empty()) note << "; " << res.note;
  res.note = note.str();
  res.method = "qr";
  return res;
}

}  // namespace detail

/// kappa(J) and kappa_plus(J) of the parameter Jacobian J = d vec A / d [vec W_Q; vec W_K;
/// vec W_V] (MATH.md §1, §3, §4) by the qr method: backward-stable QR of the compressed J~,
/// σ_min to a relative accuracy of about ε κ(J) (field `accuracy`), never through J J^T.
/// Rank and kappa_plus follow ConditionResult's rules with the rank tolerance of J's shape.
/// When J~ is tall (N d_v > r (2 d_k + d_v)) the gauge directions (W_Q E, -W_K E^T, 0) are in
/// J's null space (MATH.md §4): kappa = +inf, and kappa_plus with the rank is the answer.
/// J~'s query-key part is first reduced from 2 r d_k to r^2 - max(0, r - d_k)^2 columns with
/// the same Gram matrix (ReducedCompressedJacobian, compressed.hpp); with biases or RoPE
/// (MATH.md §10) the reduction does not apply and J~ itself is factored.
/// Cost (wide J~): 2 (r^2 - max(0, r - d_k)^2) (N d_v)^2 flops and (N d_v)^2 doubles of
/// memory, plus one block.
/// Throws std::invalid_argument for bad shapes or options; NaN or Inf input gives InvalidInput.
template <typename Scalar>
ConditionResult<double> kappa_jacobian_qr(const CRef<Scalar>& X, const CRef<Scalar>& WQ,
                                          const CRef<Scalar>& WK, const CRef<Scalar>& WV,
                                          const AttentionOptions<Scalar>& opts,
                                          const QrKappaOptions& qopts = {}) {
  const Index mJ = X.rows() * WV.cols(), nJ = X.cols() * (2 * WQ.cols() + WV.cols());
  ConditionResult<double> res;
  if (opts.extended()) {
    // With biases or RoPE, Q and K are not X W_Q and X W_K, and the reduction of the query-key
    // part (ReducedCompressedJacobian) does not apply: J~ itself is factored.
    res = detail::kappa_qr_driver<Scalar, CompressedJacobian<double>>(
        "kappa_jacobian_qr", X, WQ, WK, WV, opts, qopts,
        [&](const CompressedJacobian<double>& cj, std::ostringstream& note) {
          note << "J~ from rank(X) = " << cj.rank() << ", " << cj.cols()
               << " columns (with biases or RoPE its query-key part is not reduced); ";
          auto r = detail::qr_condition(cj, mJ, nJ, &cj.PL(), qopts, note);
          detail::qr_structure_note(cj.rows(), cj.cols(), cj.rows(), cj.cols(), note);
          return r;
        });
  } else {
    res = detail::kappa_qr_driver<Scalar, ReducedCompressedJacobian<double>>(
        "kappa_jacobian_qr", X, WQ, WK, WV, opts, qopts,
        [&](const ReducedCompressedJacobian<double>& rj, std::ostringstream& note) {
          const CompressedJacobian<double>& cj = rj.compressed();
          note << "J~ from rank(X) = " << cj.rank() << ", its query-key part reduced from "
               << cj.cols() - rj.cols() + rj.reduced_cols() << " to " << rj.reduced_cols()
               << " columns; ";
          auto r = detail::qr_condition(rj, mJ, nJ, &rj.PL(), qopts, note);
          detail::qr_structure_note(rj.rows(), rj.cols(), cj.rows(), cj.cols(), note);
          return r;
        });
  }
  if (res.info != Info::Success && res.info != Info::Singular) return res;
  JacobianKappaOptions jo;
  jo.lanczos.seed = qopts.lanczos.seed;
  return detail::validated(detail::kj_inputs<Scalar>(X, WQ, WK, WV, opts), std::move(res), jo);
}

/// kappa(J_X) and kappa_plus(J_X) of the input Jacobian J_X = d vec A / d vec X ((N d_v) x
/// (N D)) by the same qr method on its compressed form M ((N d_v) x N rank[W_Q W_K W_V]).
template <typename Scalar>
ConditionResult<double> kappa_input_jacobian_qr(const CRef<Scalar>& X, const CRef<Scalar>& WQ,
                                                const CRef<Scalar>& WK, const CRef<Scalar>& WV,
                                                const AttentionOptions<Scalar>& opts,
                                                const QrKappaOptions& qopts = {}) {
  const Index mJ = X.rows() * WV.cols(), nJ = X.rows() * X.cols();
  return detail::kappa_qr_driver<Scalar, CompressedInputJacobian<double>>(
      "kappa_input_jacobian_qr", X, WQ, WK, WV, opts, qopts,
      [&](const CompressedInputJacobian<double>& cm, std::ostringstream& note) {
        note << "M from rank(W_cat) = " << cm.rank() << "; ";
        return detail::qr_condition(cm, mJ, nJ, static_cast<const Mat<double>*>(nullptr), qopts,
                                    note);
      });
}

}  // namespace spectral_cond
