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

#include "spectral_cond/compressed.hpp"
#include "spectral_cond/kappa.hpp"

#include <Spectra/SymEigsSolver.h>
#include <Eigen/QR>

#include <cstdint>
#include <functional>
#include <optional>
#include <random>
#include <thread>
#include <vector>

// Functions on double alone are written `template <typename = void>`: they are then compiled
// only in the translation units that call them, not in every one that includes this header.
namespace spectral_cond {

/// Options of kappa_jacobian_qr and kappa_input_jacobian_qr.
struct QrKappaOptions {
  /// Columns of J~ per streamed block (rows of J~^T per update of R). 0 (default): about
  /// 128 MiB of doubles per block, clamped to [256, 4096].
  Index block_cols = 0;
  /// Householder panel width nb of the blocked update (default 64); the panel is BLAS-2, the
  /// trailing update two GEMMs of inner size nb and block_cols.
  Index panel = 64;
  /// Rank tolerance relative to σ_1: σ_i counts towards the rank when σ_i > rtol · σ_1.
  /// Negative (default): max(m, n) · ε with m x n the shape of the uncompressed J (MATH.md §4).
  double rtol = -1;
  /// Relative tolerance of the Lanczos iterations for σ_max and σ_min (default 1e-13).
  double tol = 1e-13;
  /// Lanczos restarts allowed (default 1000) and Krylov dimension (default 20).
  Index max_restarts = 1000;
  Index ncv = 20;
  /// R of order <= this gets a dense SVD (all singular values, hence the exact numerical rank)
  /// when J~ is tall or when the Lanczos σ_min is below the rank tolerance (default 2048).
  /// Below 64 the dense SVD is always used.
  Index dense_svd_max = 2048;
  /// Threads for the trailing updates; 0 (default): std::thread::hardware_concurrency().
  unsigned threads = 0;
  /// Seed of the Lanczos start vectors (default 20250).
  std::uint64_t seed = 20250;
  /// Called with the fraction of the work done, in [0, 1], after each streamed block and at the
  /// end (for progress reports; may be empty).
  std::function<void(double)> progress;

  void check(const char* fn) const {
    std::ostringstream s;
    if (block_cols < 0)
      s << "block_cols must be >= 0 (got " << block_cols << ")";
    else if (panel < 1)
      s << "panel must be >= 1 (got " << panel << ")";
    else if (!(std::isfinite(rtol) && rtol < 1))
      s << "rtol must be finite and < 1 (got " << rtol << ")";
    else if (!(tol > 0 && tol < 1))
      s << "tol must be in (0, 1) (got " << tol << ")";
    else if (max_restarts < 1)
      s << "max_restarts must be >= 1 (got " << max_restarts << ")";
    else if (ncv < 3)
      s << "ncv must be >= 3 (got " << ncv << ")";
    else if (dense_svd_max < 0)
      s << "dense_svd_max must be >= 0 (got " << dense_svd_max << ")";
    if (!s.str().empty()) detail::fail(fn, s.str());
  }
  unsigned resolved_threads() const {
    const unsigned hw = std::thread::hardware_concurrency();
    return threads > 0 ? threads : (hw > 0 ? hw : 1u);
  }
};

namespace detail {

/// Buffers of the structured update, sized once per factorisation.
struct TpqrtWork {
  Mat<double> T, W, W2;
  Vec<double> tau, tmp;
};

/// t = A^T v and A -= v t^T on a panel's columns (BLAS-2): BLAS's dgemv and dger where the build
/// has LAPACKE (and so a BLAS), Eigen's otherwise.
template <typename DA, typename DV, typename DT>
void panel_gemv(const Eigen::MatrixBase<DA>& A, const Eigen::MatrixBase<DV>& v,
                const Eigen::MatrixBase<DT>& t_out) {
  auto& t = const_cast<Eigen::MatrixBase<DT>&>(t_out);
#ifdef SPECTRAL_COND_HAVE_LAPACKE
  cblas_dgemv(CblasColMajor, CblasTrans, static_cast<int>(A.rows()), static_cast<int>(A.cols()),
              1.0, A.derived().data(), static_cast<int>(A.derived().outerStride()),
              v.derived().data(), 1, 0.0, t.derived().data(), 1);
#else
  t.noalias() = A.transpose() * v;
#endif
}
template <typename DA, typename DV, typename DT>
void panel_rank1(const Eigen::MatrixBase<DA>& A_out, const Eigen::MatrixBase<DV>& v,
                 const Eigen::MatrixBase<DT>& t) {
  auto& A = const_cast<Eigen::MatrixBase<DA>&>(A_out);
#ifdef SPECTRAL_COND_HAVE_LAPACKE
  cblas_dger(CblasColMajor, static_cast<int>(A.rows()), static_cast<int>(A.cols()), -1.0,
             v.derived().data(), 1, t.derived().data(), 1, A.derived().data(),
             static_cast<int>(A.derived().outerStride()));
#else
  A.noalias() -= v * t.transpose();
#endif
}

/// R <- the triangular factor of [R; B] (R n x n upper triangular, B m x n, overwritten): the
/// blocked structured Householder QR of LAPACK's tpqrt. Reflector j is [e_j; v_j], so only row j
/// of R and the m rows of B take part: 2 m n^2 flops, GEMM-bound in the trailing updates. With
/// LAPACKE (hence a BLAS) in the build, those GEMMs go to cblas_dgemm and BLAS's own threads;
/// otherwise to Eigen, the trailing columns split over `threads` threads.
template <typename = void>
inline void tpqrt_update(Ref<double> R, Ref<double> B, Index nb, unsigned threads, TpqrtWork& w) {
  const Index n = R.cols();
  ensure_size(w.T, nb, nb);
  ensure_size(w.W, nb, n);
  ensure_size(w.W2, nb, n);
  ensure_size(w.tmp, nb, 1);
  for (Index j0 = 0; j0 < n; j0 += nb) {
    const Index pw = std::min(nb, n - j0);
    for (Index i = 0; i < pw; ++i) {  // panel: reflectors one by one, and the T of their WY form
      const Index j = j0 + i;
      auto v = B.col(j);
      const double alpha = R(j, j), vnorm = v.norm();
      double tau = 0;
      if (vnorm > 0) {
        const double beta = -std::copysign(std::hypot(alpha, vnorm), alpha);
        tau = (beta - alpha) / beta;
        v /= (alpha - beta);
        R(j, j) = beta;
      }
      if (tau != 0 && i + 1 < pw) {
        const Index k = pw - i - 1;
        auto t = w.tmp.head(k);
        panel_gemv(B.middleCols(j + 1, k), v, t);
        t += R.row(j).segment(j + 1, k).transpose();
        t *= tau;
        R.row(j).segment(j + 1, k) -= t.transpose();
        panel_rank1(B.middleCols(j + 1, k), v, t);
      }
      w.T(i, i) = tau;
      if (i > 0) {  // T(0:i, i) = -tau T(0:i, 0:i) V(:, 0:i)^T v_i
        auto t = w.tmp.head(i);
        panel_gemv(B.middleCols(j0, i), v, t);
        w.T.col(i).head(i).noalias() = w.T.topLeftCorner(i, i).triangularView<Eigen::Upper>() * t;
        w.T.col(i).head(i) *= -tau;
      }
    }
    const Index c0 = j0 + pw, nc = n - c0;
    if (nc == 0) continue;
#ifdef SPECTRAL_COND_HAVE_LAPACKE
    // Trailing update [R_top; B_trail] -= [I; V] T^T ([I; V]^T [R_top; B_trail]); its two GEMMs of
    // the update by BLAS (OpenBLAS: its own threads and kernels for this CPU, several times Eigen's
    // portable rate), the whole trailing block in one call each.
    (void)threads;
    const Index m = B.rows();
    auto Wc = w.W.block(0, c0, pw, nc);
    auto W2c = w.W2.block(0, c0, pw, nc);
    cblas_dgemm(CblasColMajor, CblasTrans, CblasNoTrans, static_cast<int>(pw), static_cast<int>(nc),
                static_cast<int>(m), 1.0, B.col(j0).data(), static_cast<int>(B.outerStride()),
                B.col(c0).data(), static_cast<int>(B.outerStride()), 0.0, Wc.data(),
                static_cast<int>(w.W.outerStride()));
    Wc += R.block(j0, c0, pw, nc);
    W2c.noalias() = w.T.topLeftCorner(pw, pw).triangularView<Eigen::Upper>().transpose() * Wc;
    R.block(j0, c0, pw, nc) -= W2c;
    cblas_dgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m),
                static_cast<int>(nc), static_cast<int>(pw), -1.0, B.col(j0).data(),
                static_cast<int>(B.outerStride()), W2c.data(), static_cast<int>(w.W2.outerStride()),
                1.0, B.col(c0).data(), static_cast<int>(B.outerStride()));
#else
    // The same trailing update by Eigen's GEMMs, the columns split over `threads` threads.
    auto chunk = [&](Index a, Index len) {
      auto Wc = w.W.block(0, a, pw, len);
      auto W2c = w.W2.block(0, a, pw, len);
      Wc.noalias() = B.middleCols(j0, pw).transpose() * B.middleCols(a, len);
      Wc += R.block(j0, a, pw, len);
      W2c.noalias() = w.T.topLeftCorner(pw, pw).triangularView<Eigen::Upper>().transpose() * Wc;
      R.block(j0, a, pw, len) -= W2c;
      B.middleCols(a, len).noalias() -= B.middleCols(j0, pw) * W2c;
    };
    const Index nt = std::min<Index>(threads, std::max<Index>(1, nc / 256));
    std::vector<std::thread> pool;
    const Index per = (nc + nt - 1) / nt;
    for (Index t = 1; t < nt; ++t) {
      const Index a = c0 + t * per, len = std::min(per, n - a);
      if (len > 0) pool.emplace_back(chunk, a, len);
    }
    chunk(c0, std::min(per, nc));
    for (auto& th : pool) th.join();
#endif
  }
}

/// y = R^T R x (for σ_max) or y = R^{-1} R^{-T} x (for σ_min), R upper triangular: Spectra's
/// operator interface.
class TriangularGramOp {
 public:
  using Scalar = double;
  TriangularGramOp(const Mat<double>& R, bool inverse) : R_(R), inverse_(inverse), t_(R.rows()) {}
  Index rows() const { return R_.rows(); }
  Index cols() const { return R_.cols(); }
  void perform_op(const double* x, double* y) const {
    Eigen::Map<const Vec<double>> xv(x, R_.rows());
    Eigen::Map<Vec<double>> yv(y, R_.rows());
    const auto U = R_.triangularView<Eigen::Upper>();
    if (inverse_) {
      yv = xv;
      U.transpose().solveInPlace(yv);
      U.solveInPlace(yv);
    } else {
      t_.noalias() = U * xv;
      yv.noalias() = U.transpose() * t_;
    }
  }

 private:
  const Mat<double>& R_;
  bool inverse_;
  mutable Vec<double> t_;
};

struct LanczosOutcome {
  double lambda = 0, residual = 0;
  Index operations = 0;
  bool converged = false;
};

/// The largest eigenvalue of the operator by Spectra's Lanczos, with the relative residual
/// ||op(v) - λ v|| / λ of the returned vector.
template <typename = void>
inline LanczosOutcome largest_eigenvalue(TriangularGramOp& op, const QrKappaOptions& q,
                                         std::uint64_t seed) {
  const Index n = op.rows();
  Spectra::SymEigsSolver<TriangularGramOp> eigs(op, 1, std::min(q.ncv, n));
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist;
  Vec<double> v0(n);
  for (Index i = 0; i < n; ++i) v0(i) = dist(rng);
  eigs.init(v0.data());
  eigs.compute(Spectra::SortRule::LargestAlge, q.max_restarts, q.tol);
  LanczosOutcome out;
  out.operations = eigs.num_operations();
  out.converged = eigs.info() == Spectra::CompInfo::Successful;
  if (!out.converged) return out;
  out.lambda = eigs.eigenvalues()(0);
  const Vec<double> v = eigs.eigenvectors().col(0);
  Vec<double> y(n);
  op.perform_op(v.data(), y.data());
  out.residual = (y - out.lambda * v).norm() / (out.lambda * v.norm());
  return out;
}

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

template <typename Scalar>
ConditionResult<Scalar> cast_result(const ConditionResult<double>& d) {
  ConditionResult<Scalar> r;
  r.sigma_max = static_cast<Scalar>(d.sigma_max);
  r.sigma_min = static_cast<Scalar>(d.sigma_min);
  r.kappa = static_cast<Scalar>(d.kappa);
  r.sigma_min_plus = static_cast<Scalar>(d.sigma_min_plus);
  r.kappa_plus = static_cast<Scalar>(d.kappa_plus);
  r.rank = d.rank;
  r.rank_tol = static_cast<Scalar>(d.rank_tol);
  r.method = d.method;
  r.accuracy = static_cast<Scalar>(d.accuracy);
  r.iterations = d.iterations;
  r.residual = static_cast<Scalar>(d.residual);
  r.info = d.info;
  r.note = d.note;
  return r;
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
    note << "; Lanczos did not converge (raise max_restarts or ncv)";
    return res;
  }
  if (res.sigma_min > res.rank_tol) {
    res.rank = k;
    res.sigma_min_plus = res.sigma_min;
    res.kappa = res.kappa_plus = res.sigma_max / res.sigma_min;
    res.accuracy = ScalarTraits<double>::eps() * res.kappa + q.tol;
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

/// κ of the m_J x n_J matrix whose nonzero singular values are those of R (k x k, k <= min(m_J,
/// n_J); the other min(m_J, n_J) - k are exactly zero): dense SVD or Lanczos, see the header.
template <typename = void>
inline ConditionResult<double> condition_of_r(const Mat<double>& R, Index mJ, Index nJ, bool tall,
                                              const QrKappaOptions& q, std::ostringstream& note) {
  const Index k = R.rows(), rJ = std::min(mJ, nJ);
  KappaOptions<double> ko;
  ko.rtol = q.rtol;
  auto dense = [&](const char* why) {
    Vec<double> sv = Vec<double>::Zero(rJ);
    if (k > 0) sv.head(k) = Eigen::BDCSVD<Mat<double>>(R).singularValues();
    note << "; singular values of R by a dense SVD (" << why << ")";
    return condition_from_singular_values<double>(sv, mJ, nJ, ko, "qr");
  };
  if (k < 64 || k < rJ || (tall && k <= q.dense_svd_max))
    return dense(k < rJ ? "structural zeros" : "R is small or J~ tall");
  const bool singular_diag = (R.diagonal().array() == 0.0).any();
  TriangularGramOp gram(R, false), inverse_gram(R, true);
  const LanczosOutcome big = largest_eigenvalue(gram, q, q.seed);
  LanczosOutcome small;
  if (!singular_diag) small = largest_eigenvalue(inverse_gram, q, q.seed + 1);
  note << "; sigma_max by Lanczos on R^T R (" << big.operations << " products), sigma_min by "
       << "Lanczos on (R^T R)^{-1} (" << small.operations
       << " pairs of triangular solves, relative residual " << small.residual << ")";
  std::optional<ConditionResult<double>> res =
      condition_from_lanczos(big, small, singular_diag, k, mJ, nJ, q, note);
  return res ? *res : dense("sigma_min is below the rank tolerance");
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

inline AttentionOptions<double> to_double(const AttentionOptions<double>& o) {
  return o;
}
template <typename Scalar>
AttentionOptions<double> to_double(const AttentionOptions<Scalar>& o) {
  AttentionOptions<double> d;
  if (o.scale) d.scale = static_cast<double>(*o.scale);
  d.mask = o.mask;
  d.additive_mask = o.additive_mask.template cast<double>();
  return d;
}

template <typename Scalar, typename Compressed, typename Finish>
ConditionResult<Scalar> kappa_qr_driver(const char* fn, const CRef<Scalar>& X,
                                        const CRef<Scalar>& WQ, const CRef<Scalar>& WK,
                                        const CRef<Scalar>& WV,
                                        const AttentionOptions<Scalar>& opts,
                                        const QrKappaOptions& q, Finish&& finish) {
  q.check(fn);
  check_attention_inputs<Scalar>(fn, X, WQ, WK, WV);
  opts.check(fn, X.rows());
  if (!(X.allFinite() && WQ.allFinite() && WK.allFinite() && WV.allFinite())) {
    auto bad = invalid_condition<Scalar>("X or W contains NaN or Inf");
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
  return cast_result<Scalar>(res);
}

}  // namespace detail

/// kappa(J) and kappa_plus(J) of the parameter Jacobian J = d vec A / d [vec W_Q; vec W_K;
/// vec W_V] (MATH.md §1, §3, §4) by the qr method: backward-stable QR of the compressed J~,
/// σ_min to a relative accuracy of about ε κ(J) (field `accuracy`), never through J J^T.
/// Rank and kappa_plus follow ConditionResult's rules with the rank tolerance of J's shape.
/// When J~ is tall (N d_v > r (2 d_k + d_v)) the gauge directions (W_Q E, -W_K E^T, 0) are in
/// J's null space (MATH.md §4): kappa = +inf, and kappa_plus with the rank is the answer.
/// J~'s query-key part is first reduced from 2 r d_k to r^2 - max(0, r - d_k)^2 columns with
/// the same Gram matrix (ReducedCompressedJacobian, compressed.hpp).
/// Cost (wide J~): 2 (r^2 - max(0, r - d_k)^2) (N d_v)^2 flops and (N d_v)^2 doubles of
/// memory, plus one block.
/// Throws std::invalid_argument for bad shapes or options; NaN or Inf input gives InvalidInput.
template <typename Scalar>
ConditionResult<Scalar> kappa_jacobian_qr(const CRef<Scalar>& X, const CRef<Scalar>& WQ,
                                          const CRef<Scalar>& WK, const CRef<Scalar>& WV,
                                          const AttentionOptions<Scalar>& opts,
                                          const QrKappaOptions& qopts = {}) {
  const Index mJ = X.rows() * WV.cols(), nJ = X.cols() * (2 * WQ.cols() + WV.cols());
  return detail::kappa_qr_driver<Scalar, ReducedCompressedJacobian<double>>(
      "kappa_jacobian_qr", X, WQ, WK, WV, opts, qopts,
      [&](const ReducedCompressedJacobian<double>& rj, std::ostringstream& note) {
        const CompressedJacobian<double>& cj = rj.compressed();
        note << "J~ from rank(X) = " << cj.rank() << ", its query-key part reduced from "
             << cj.cols() - rj.cols() + rj.reduced_cols() << " to " << rj.reduced_cols()
             << " columns; ";
        auto res = detail::qr_condition(rj, mJ, nJ, &rj.PL(), qopts, note);
        if (cj.rows() > cj.cols())
          note << "; J~ is tall: the gauge directions (W_Q E, -W_K E^T, 0) lie in the null space "
                  "(MATH.md 4), kappa_plus is the informative number";
        else if (rj.rows() > rj.cols())
          note << "; the reduced J~ has fewer columns than rows, so rank(J) < N d_v: J is "
                  "singular by its structure, kappa_plus is the informative number";
        return res;
      });
}

/// kappa(J_X) and kappa_plus(J_X) of the input Jacobian J_X = d vec A / d vec X ((N d_v) x
/// (N D)) by the same qr method on its compressed form M ((N d_v) x N rank[W_Q W_K W_V]).
template <typename Scalar>
ConditionResult<Scalar> kappa_input_jacobian_qr(const CRef<Scalar>& X, const CRef<Scalar>& WQ,
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
