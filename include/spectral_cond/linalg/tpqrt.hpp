// spectral_cond: the structured blocked Householder update R <- qr([R; B]).R of LAPACK's tpqrt,
// which the qr method streams the compressed Jacobian through (MATH.md §3, §12), and the
// operators y = R^T R x and y = (R^T R)^{-1} x of the triangular factor.
#pragma once

#include "spectral_cond/core/common.hpp"

#include <thread>
#include <vector>

#ifdef SPECTRAL_COND_HAVE_LAPACKE
#include <cblas.h>
#endif

namespace spectral_cond {

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

}  // namespace detail
}  // namespace spectral_cond
