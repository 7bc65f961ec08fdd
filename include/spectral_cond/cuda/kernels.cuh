// spectral_cond CUDA path: the element-wise and row-wise kernels (MATH.md §2–3). Everything
// else is cuBLAS/cuSOLVER. Column-major storage: entry (i, j) of an m x n matrix at i + m j.
#pragma once

#include "spectral_cond/core/common.hpp"
#include "spectral_cond/cuda/error.cuh"

#include <algorithm>
#include <cstddef>

namespace spectral_cond {
namespace cuda {
namespace kernels {

constexpr int kThreads = 256;
constexpr int kRowThreads = 128;

/// Grid for a grid-stride loop over n elements.
inline unsigned grid_for(std::size_t n) {
  const std::size_t g = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::max<std::size_t>(1, std::min<std::size_t>(g, 1u << 20)));
}

#define SC_GRID_STRIDE(idx, n)                                                            \
  for (std::size_t idx = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; \
       idx < (n); idx += static_cast<std::size_t>(gridDim.x) * blockDim.x)

template <typename T>
__device__ T block_reduce(T v, T* shm, bool take_max) {
  shm[threadIdx.x] = v;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      const T o = shm[threadIdx.x + s];
      shm[threadIdx.x] =
          take_max ? (o > shm[threadIdx.x] ? o : shm[threadIdx.x]) : shm[threadIdx.x] + o;
    }
    __syncthreads();
  }
  const T r = shm[0];
  __syncthreads();
  return r;
}

/// In place, row i of item b (blockIdx.x = i, blockIdx.y = b): P <- softmax_row(P + M),
/// max-subtracted (MATH.md §2). mask: 0 none, 1 causal (M_ij = -inf for j > i), 2 additive
/// (M, N x N, shared by all items). P holds the scaled logits c Q K^T on entry.
template <typename T>
__global__ void softmax_rows(T* P, int N, long long stride, int mask, const T* M) {
  __shared__ T shm[kRowThreads];
  T* row = P + static_cast<long long>(blockIdx.y) * stride + blockIdx.x;
  const int i = static_cast<int>(blockIdx.x);
  const T ninf = -INFINITY;
  T mx = ninf;
  for (int j = threadIdx.x; j < N; j += blockDim.x) {
    T z = row[static_cast<long long>(j) * N];
    if (mask == 1 && j > i) z = ninf;
    if (mask == 2) z += M[i + static_cast<long long>(j) * N];
    row[static_cast<long long>(j) * N] = z;
    mx = z > mx ? z : mx;
  }
  mx = block_reduce<T>(mx, shm, true);
  T sum = 0;
  for (int j = threadIdx.x; j < N; j += blockDim.x) {
    const T z = row[static_cast<long long>(j) * N];
    const T e = z == ninf ? T(0) : exp(z - mx);
    row[static_cast<long long>(j) * N] = e;
    sum += e;
  }
  sum = block_reduce<T>(sum, shm, false);
  const T inv = T(1) / sum;
  for (int j = threadIdx.x; j < N; j += blockDim.x) row[static_cast<long long>(j) * N] *= inv;
}

/// In place, row by row: S <- s P ∘ (S - rowsum(P ∘ S) 1^T), the softmax derivative of
/// MATH.md §2 applied to a tangent (dZ) or a cotangent (dL/dP).
template <typename T>
__global__ void softmax_project(T* S, const T* P, int N, long long stride, T s) {
  __shared__ T shm[kRowThreads];
  const long long off = static_cast<long long>(blockIdx.y) * stride + blockIdx.x;
  T* srow = S + off;
  const T* prow = P + off;
  T acc = 0;
  for (int j = threadIdx.x; j < N; j += blockDim.x)
    acc += prow[static_cast<long long>(j) * N] * srow[static_cast<long long>(j) * N];
  acc = block_reduce<T>(acc, shm, false);
  for (int j = threadIdx.x; j < N; j += blockDim.x) {
    const long long q = static_cast<long long>(j) * N;
    srow[q] = s * prow[q] * (srow[q] - acc);
  }
}

/// wide(i, j d_v + e) = U(i, j) V(i, e): the N x (m d_v) right-hand side of MATH.md §3's
/// stacked products (U N x m, V N x d_v).
template <typename T>
__global__ void hadamard_wide(T* wide, const T* U, const T* V, int N, int m, int dv) {
  const std::size_t n = static_cast<std::size_t>(N) * m * dv;
  SC_GRID_STRIDE(idx, n) {
    const std::size_t i = idx % N, col = idx / N, j = col / dv, e = col % dv;
    wide[idx] = U[i + j * N] * V[i + e * N];
  }
}

/// out(i + N e, j) = s (out(i + N e, j) - PU(i, j) A(i, e)): completes
/// out.col(j) = vec(s (P (u_j ∘ V) - (P u_j) ∘ A)) after out = P wide (MATH.md §3).
template <typename T>
__global__ void stacked_finish(T* out, const T* PU, const T* A, int N, int m, int dv, T s) {
  const std::size_t R = static_cast<std::size_t>(N) * dv, n = R * m;
  SC_GRID_STRIDE(idx, n) {
    const std::size_t rho = idx % R, j = idx / R, i = rho % N, e = rho / N;
    out[idx] = s * (out[idx] - PU[i + j * N] * A[i + e * N]);
  }
}

/// Lower triangle: G(i, j) *= S(i mod N, j mod N), the Hadamard product with 1 1^T ⊗ S.
template <typename T>
__global__ void hadamard_tile_lower(T* G, const T* S, int N, int R) {
  const std::size_t n = static_cast<std::size_t>(R) * R;
  SC_GRID_STRIDE(idx, n) {
    const std::size_t i = idx % R, j = idx / R;
    if (i >= j) G[idx] *= S[(i % N) + (j % N) * N];
  }
}

/// Lower triangle: G(i, j) += S(i mod N, j mod N) T(i, j) + [i/N == j/N] PP(i mod N, j mod N),
/// the remaining terms of MATH.md §3's Gram formula (PP = P X X^T P^T).
template <typename T>
__global__ void gram_finish_lower(T* G, const T* Tm, const T* S, const T* PP, int N, int R) {
  const std::size_t n = static_cast<std::size_t>(R) * R;
  SC_GRID_STRIDE(idx, n) {
    const std::size_t i = idx % R, j = idx / R;
    if (i < j) continue;
    const std::size_t t = (i % N) + (j % N) * N;
    T g = G[idx] + S[t] * Tm[idx];
    if (i / N == j / N) g += PP[t];
    G[idx] = g;
  }
}

/// Upper triangle <- lower triangle.
template <typename T>
__global__ void mirror_lower(T* G, int R) {
  const std::size_t n = static_cast<std::size_t>(R) * R;
  SC_GRID_STRIDE(idx, n) {
    const std::size_t i = idx % R, j = idx / R;
    if (i < j) G[idx] = G[j + i * static_cast<std::size_t>(R)];
  }
}

/// *flag = 1 when an entry of the lower triangle of G (R x R) is NaN or Inf (the caller zeroes
/// *flag first).
template <typename T>
__global__ void flag_nonfinite_lower(const T* G, int R, int* flag) {
  const std::size_t n = static_cast<std::size_t>(R) * R;
  SC_GRID_STRIDE(idx, n) {
    const std::size_t i = idx % R, j = idx / R;
    if (i >= j && !isfinite(G[idx])) *flag = 1;
  }
}

/// The dense J = [J_Q | J_K | J_V] of one head (MATH.md §3), (N d_v) x (2 D d_k + D d_v):
///   J_Q[:, a + D b] = vec(diag(x_a) 𝔅_b),  J_K[:, a + D b] = vec(diag(q_b) 𝔈_a),
///   J_V[:, a + D b] = e_b ⊗ (P x_a);   𝔅, 𝔈 carry the scale c.
template <typename T>
__global__ void assemble_jacobian(T* J, const T* X, const T* Q, const T* B, const T* E, const T* PX,
                                  int N, int D, int dk, int dv) {
  const std::size_t R = static_cast<std::size_t>(N) * dv, Dk = static_cast<std::size_t>(D) * dk;
  const std::size_t n = R * (2 * Dk + static_cast<std::size_t>(D) * dv);
  SC_GRID_STRIDE(idx, n) {
    const std::size_t rho = idx % R, col = idx / R, i = rho % N, e = rho / N;
    T v;
    if (col < Dk) {
      const std::size_t a = col % D, b = col / D;
      v = X[i + a * N] * B[rho + b * R];
    } else if (col < 2 * Dk) {
      const std::size_t a = (col - Dk) % D, b = (col - Dk) / D;
      v = Q[i + b * N] * E[rho + a * R];
    } else {
      const std::size_t a = (col - 2 * Dk) % D, b = (col - 2 * Dk) / D;
      v = b == e ? PX[i + a * N] : T(0);
    }
    J[idx] = v;
  }
}

/// The compressed J~ of MATH.md §3 ((N d_v) x r (2 d_k + d_v)), or its transpose when
/// `transposed` (the tall matrix that geqrf factors):
///   J~_Q[:, k + r b] = c vec(diag(l_k) B_b),  J~_K[:, k + r b] = c vec(diag(q_b) E~_k),
///   J~_V[:, k + r b] = e_b ⊗ (P l_k);   B, E~ without the scale c.
template <typename T>
__global__ void assemble_compressed(T* out, bool transposed, const T* L, const T* Q, const T* B,
                                    const T* E, const T* PL, int N, int r, int dk, int dv, T c) {
  const std::size_t R = static_cast<std::size_t>(N) * dv, rk = static_cast<std::size_t>(r) * dk;
  const std::size_t C = 2 * rk + static_cast<std::size_t>(r) * dv, n = R * C;
  SC_GRID_STRIDE(idx, n) {
    const std::size_t rho = transposed ? idx / C : idx % R, j = transposed ? idx % C : idx / R;
    const std::size_t i = rho % N, e = rho / N;
    T v;
    if (j < rk) {
      const std::size_t k = j % r, b = j / r;
      v = c * L[i + k * N] * B[rho + b * R];
    } else if (j < 2 * rk) {
      const std::size_t k = (j - rk) % r, b = (j - rk) / r;
      v = c * Q[i + b * N] * E[rho + k * R];
    } else {
      const std::size_t k = (j - 2 * rk) % r, b = (j - 2 * rk) / r;
      v = b == e ? PL[i + k * N] : T(0);
    }
    out[idx] = v;
  }
}

/// R (n x n) = upper triangle of the first n rows of A (lda), zeros below.
template <typename T>
__global__ void extract_upper(T* R, const T* A, int lda, int n) {
  const std::size_t total = static_cast<std::size_t>(n) * n;
  SC_GRID_STRIDE(idx, total) {
    const std::size_t i = idx % n, j = idx / n;
    R[idx] = i <= j ? A[i + j * static_cast<std::size_t>(lda)] : T(0);
  }
}

/// Launches `kernel` over n elements with a grid-stride grid on `stream`, and checks the launch.
template <typename Kernel, typename... Args>
void launch(const char* name, std::size_t n, cudaStream_t stream, Kernel kernel, Args... args) {
  if (n == 0) return;
  kernel<<<grid_for(n), kThreads, 0, stream>>>(args...);
  detail::check_cuda(cudaGetLastError(), name, __FILE__, __LINE__);
}

}  // namespace kernels
}  // namespace cuda
}  // namespace spectral_cond
