// spectral_cond CUDA path: float/double overloads of the cuBLAS and cuSOLVER calls it uses,
// each checked (error.cuh). Column-major throughout, like Eigen (MATH.md §1).
#pragma once

#include "spectral_cond/cuda/error.cuh"

namespace spectral_cond {
namespace cuda {
namespace blas {

inline cublasOperation_t op(bool trans) {
  return trans ? CUBLAS_OP_T : CUBLAS_OP_N;
}

// ---- cuBLAS -------------------------------------------------------------------------------

inline void gemm(cublasHandle_t h, bool ta, bool tb, int m, int n, int k, double alpha,
                 const double* A, int lda, const double* B, int ldb, double beta, double* C,
                 int ldc) {
  SC_CUBLAS_CHECK(cublasDgemm(h, op(ta), op(tb), m, n, k, &alpha, A, lda, B, ldb, &beta, C, ldc));
}
inline void gemm(cublasHandle_t h, bool ta, bool tb, int m, int n, int k, float alpha,
                 const float* A, int lda, const float* B, int ldb, float beta, float* C, int ldc) {
  SC_CUBLAS_CHECK(cublasSgemm(h, op(ta), op(tb), m, n, k, &alpha, A, lda, B, ldb, &beta, C, ldc));
}

/// C_i = alpha op(A_i) op(B_i) + beta C_i for i < batch; a stride of 0 shares one matrix.
inline void gemm_batched(cublasHandle_t h, bool ta, bool tb, int m, int n, int k, double alpha,
                         const double* A, int lda, long long sA, const double* B, int ldb,
                         long long sB, double beta, double* C, int ldc, long long sC, int batch) {
  SC_CUBLAS_CHECK(cublasDgemmStridedBatched(h, op(ta), op(tb), m, n, k, &alpha, A, lda, sA, B, ldb,
                                            sB, &beta, C, ldc, sC, batch));
}
inline void gemm_batched(cublasHandle_t h, bool ta, bool tb, int m, int n, int k, float alpha,
                         const float* A, int lda, long long sA, const float* B, int ldb,
                         long long sB, float beta, float* C, int ldc, long long sC, int batch) {
  SC_CUBLAS_CHECK(cublasSgemmStridedBatched(h, op(ta), op(tb), m, n, k, &alpha, A, lda, sA, B, ldb,
                                            sB, &beta, C, ldc, sC, batch));
}

/// Lower triangle of C = alpha A A^T + beta C (A n x k).
inline void syrk_lower(cublasHandle_t h, int n, int k, double alpha, const double* A, int lda,
                       double beta, double* C, int ldc) {
  SC_CUBLAS_CHECK(
      cublasDsyrk(h, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, n, k, &alpha, A, lda, &beta, C, ldc));
}
inline void syrk_lower(cublasHandle_t h, int n, int k, float alpha, const float* A, int lda,
                       float beta, float* C, int ldc) {
  SC_CUBLAS_CHECK(
      cublasSsyrk(h, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, n, k, &alpha, A, lda, &beta, C, ldc));
}
/// Lower triangle of C = alpha A^T A + beta C (A k x n).
inline void syrk_lower_t(cublasHandle_t h, int n, int k, double alpha, const double* A, int lda,
                         double beta, double* C, int ldc) {
  SC_CUBLAS_CHECK(
      cublasDsyrk(h, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_T, n, k, &alpha, A, lda, &beta, C, ldc));
}

/// C = alpha op(A) + beta op(B) (also a transpose when beta = 0 and B = C is not read).
inline void geam(cublasHandle_t h, bool ta, bool tb, int m, int n, double alpha, const double* A,
                 int lda, double beta, const double* B, int ldb, double* C, int ldc) {
  SC_CUBLAS_CHECK(cublasDgeam(h, op(ta), op(tb), m, n, &alpha, A, lda, &beta, B, ldb, C, ldc));
}
inline void geam(cublasHandle_t h, bool ta, bool tb, int m, int n, float alpha, const float* A,
                 int lda, float beta, const float* B, int ldb, float* C, int ldc) {
  SC_CUBLAS_CHECK(cublasSgeam(h, op(ta), op(tb), m, n, &alpha, A, lda, &beta, B, ldb, C, ldc));
}

/// y = A x for A symmetric, lower triangle stored.
inline void symv_lower(cublasHandle_t h, int n, const double* A, int lda, const double* x,
                       double* y) {
  const double one = 1, zero = 0;
  SC_CUBLAS_CHECK(cublasDsymv(h, CUBLAS_FILL_MODE_LOWER, n, &one, A, lda, x, 1, &zero, y, 1));
}
/// x <- op(T) x for T triangular (upper or lower, non-unit).
inline void trmv(cublasHandle_t h, bool upper, bool trans, int n, const double* T, int ldt,
                 double* x) {
  SC_CUBLAS_CHECK(cublasDtrmv(h, upper ? CUBLAS_FILL_MODE_UPPER : CUBLAS_FILL_MODE_LOWER, op(trans),
                              CUBLAS_DIAG_NON_UNIT, n, T, ldt, x, 1));
}
/// x <- op(T)^{-1} x.
inline void trsv(cublasHandle_t h, bool upper, bool trans, int n, const double* T, int ldt,
                 double* x) {
  SC_CUBLAS_CHECK(cublasDtrsv(h, upper ? CUBLAS_FILL_MODE_UPPER : CUBLAS_FILL_MODE_LOWER, op(trans),
                              CUBLAS_DIAG_NON_UNIT, n, T, ldt, x, 1));
}

// ---- cuSOLVER -----------------------------------------------------------------------------

inline int syevd_lwork(cusolverDnHandle_t h, int n, const double* A, int lda, const double* w) {
  int lw = 0;
  SC_CUSOLVER_CHECK(cusolverDnDsyevd_bufferSize(h, CUSOLVER_EIG_MODE_NOVECTOR,
                                                CUBLAS_FILL_MODE_LOWER, n, A, lda, w, &lw));
  return lw;
}
/// Eigenvalues (ascending) of the symmetric A (lower triangle; destroyed).
inline void syevd(cusolverDnHandle_t h, int n, double* A, int lda, double* w, double* work,
                  int lwork, int* info) {
  SC_CUSOLVER_CHECK(cusolverDnDsyevd(h, CUSOLVER_EIG_MODE_NOVECTOR, CUBLAS_FILL_MODE_LOWER, n, A,
                                     lda, w, work, lwork, info));
}

inline int potrf_lwork(cusolverDnHandle_t h, int n, double* A, int lda) {
  int lw = 0;
  SC_CUSOLVER_CHECK(cusolverDnDpotrf_bufferSize(h, CUBLAS_FILL_MODE_LOWER, n, A, lda, &lw));
  return lw;
}
/// A = L L^T in place (lower); *info > 0: not positive definite.
inline void potrf(cusolverDnHandle_t h, int n, double* A, int lda, double* work, int lwork,
                  int* info) {
  SC_CUSOLVER_CHECK(cusolverDnDpotrf(h, CUBLAS_FILL_MODE_LOWER, n, A, lda, work, lwork, info));
}

inline int geqrf_lwork(cusolverDnHandle_t h, int m, int n, double* A, int lda) {
  int lw = 0;
  SC_CUSOLVER_CHECK(cusolverDnDgeqrf_bufferSize(h, m, n, A, lda, &lw));
  return lw;
}
/// Householder QR in place: R in the upper triangle of A's first n rows.
inline void geqrf(cusolverDnHandle_t h, int m, int n, double* A, int lda, double* tau, double* work,
                  int lwork, int* info) {
  SC_CUSOLVER_CHECK(cusolverDnDgeqrf(h, m, n, A, lda, tau, work, lwork, info));
}

inline int gesvdj_lwork(cusolverDnHandle_t h, bool vectors, int m, int n, const double* A, int lda,
                        const double* S, const double* U, int ldu, const double* V, int ldv,
                        gesvdjInfo_t p) {
  int lw = 0;
  SC_CUSOLVER_CHECK(cusolverDnDgesvdj_bufferSize(
      h, vectors ? CUSOLVER_EIG_MODE_VECTOR : CUSOLVER_EIG_MODE_NOVECTOR, 1, m, n, A, lda, S, U,
      ldu, V, ldv, &lw, p));
  return lw;
}
inline int gesvdj_lwork(cusolverDnHandle_t h, bool vectors, int m, int n, const float* A, int lda,
                        const float* S, const float* U, int ldu, const float* V, int ldv,
                        gesvdjInfo_t p) {
  int lw = 0;
  SC_CUSOLVER_CHECK(cusolverDnSgesvdj_bufferSize(
      h, vectors ? CUSOLVER_EIG_MODE_VECTOR : CUSOLVER_EIG_MODE_NOVECTOR, 1, m, n, A, lda, S, U,
      ldu, V, ldv, &lw, p));
  return lw;
}
/// Thin (econ) SVD by one-sided Jacobi; A is destroyed.
inline void gesvdj(cusolverDnHandle_t h, bool vectors, int m, int n, double* A, int lda, double* S,
                   double* U, int ldu, double* V, int ldv, double* work, int lwork, int* info,
                   gesvdjInfo_t p) {
  SC_CUSOLVER_CHECK(
      cusolverDnDgesvdj(h, vectors ? CUSOLVER_EIG_MODE_VECTOR : CUSOLVER_EIG_MODE_NOVECTOR, 1, m, n,
                        A, lda, S, U, ldu, V, ldv, work, lwork, info, p));
}
inline void gesvdj(cusolverDnHandle_t h, bool vectors, int m, int n, float* A, int lda, float* S,
                   float* U, int ldu, float* V, int ldv, float* work, int lwork, int* info,
                   gesvdjInfo_t p) {
  SC_CUSOLVER_CHECK(
      cusolverDnSgesvdj(h, vectors ? CUSOLVER_EIG_MODE_VECTOR : CUSOLVER_EIG_MODE_NOVECTOR, 1, m, n,
                        A, lda, S, U, ldu, V, ldv, work, lwork, info, p));
}

inline int gesvdj_batched_lwork(cusolverDnHandle_t h, bool vectors, int m, int n, const double* A,
                                int lda, const double* S, const double* U, int ldu, const double* V,
                                int ldv, gesvdjInfo_t p, int batch) {
  int lw = 0;
  SC_CUSOLVER_CHECK(cusolverDnDgesvdjBatched_bufferSize(
      h, vectors ? CUSOLVER_EIG_MODE_VECTOR : CUSOLVER_EIG_MODE_NOVECTOR, m, n, A, lda, S, U, ldu,
      V, ldv, &lw, p, batch));
  return lw;
}
inline int gesvdj_batched_lwork(cusolverDnHandle_t h, bool vectors, int m, int n, const float* A,
                                int lda, const float* S, const float* U, int ldu, const float* V,
                                int ldv, gesvdjInfo_t p, int batch) {
  int lw = 0;
  SC_CUSOLVER_CHECK(cusolverDnSgesvdjBatched_bufferSize(
      h, vectors ? CUSOLVER_EIG_MODE_VECTOR : CUSOLVER_EIG_MODE_NOVECTOR, m, n, A, lda, S, U, ldu,
      V, ldv, &lw, p, batch));
  return lw;
}
/// SVDs of `batch` matrices of at most 32 x 32, stored one after the other (stride lda n).
inline void gesvdj_batched(cusolverDnHandle_t h, bool vectors, int m, int n, double* A, int lda,
                           double* S, double* U, int ldu, double* V, int ldv, double* work,
                           int lwork, int* info, gesvdjInfo_t p, int batch) {
  SC_CUSOLVER_CHECK(
      cusolverDnDgesvdjBatched(h, vectors ? CUSOLVER_EIG_MODE_VECTOR : CUSOLVER_EIG_MODE_NOVECTOR,
                               m, n, A, lda, S, U, ldu, V, ldv, work, lwork, info, p, batch));
}
inline void gesvdj_batched(cusolverDnHandle_t h, bool vectors, int m, int n, float* A, int lda,
                           float* S, float* U, int ldu, float* V, int ldv, float* work, int lwork,
                           int* info, gesvdjInfo_t p, int batch) {
  SC_CUSOLVER_CHECK(
      cusolverDnSgesvdjBatched(h, vectors ? CUSOLVER_EIG_MODE_VECTOR : CUSOLVER_EIG_MODE_NOVECTOR,
                               m, n, A, lda, S, U, ldu, V, ldv, work, lwork, info, p, batch));
}

}  // namespace blas
}  // namespace cuda
}  // namespace spectral_cond
