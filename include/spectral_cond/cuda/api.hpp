// spectral_cond CUDA path: the host-callable API (docs/cuda.md). Plain C++17: this header
// includes no CUDA header, so host code compiled by g++/clang++ (the CLI's `--device cuda`)
// can call it. The definitions live in the spectral_cond::cuda library
// (cuda/spectral_cond_cuda.cu), built only with -DSPECTRAL_COND_ENABLE_CUDA=ON, which also defines
// SPECTRAL_COND_HAVE_CUDA. Never included by the umbrella header spectral_cond.hpp (STYLE.md habit
// 12).
//
// Every function compares with, and reuses the semantics of, the CPU path on the same inputs:
//   attention_*_batched     attention.hpp (MATH.md §2), per head
//   attention_gram_batched  gram.hpp, block All (MATH.md §3)
//   attention_jacobian      jacobian.hpp, block All (MATH.md §3)
//   kappa_jacobian_batched  methods/gram.hpp, qr.hpp, matfree.hpp: their own drivers with device
//                           backends (backends.cuh; MATH.md §3–4, §12)
//   kappa_batched           kappa.hpp (MATH.md §4)
//   exact_correction_batched corrections.hpp's report (MATH.md §6, Theorem 3.5)
// Errors of CUDA, cuBLAS and cuSOLVER calls throw spectral_cond::cuda::CudaError (a
// std::runtime_error naming the call and its status); bad shapes throw std::invalid_argument.
#pragma once

#include "spectral_cond/conditioning/corrections.hpp"
#include "spectral_cond/conditioning/kappa.hpp"
#include "spectral_cond/conditioning/methods/kappa_jacobian.hpp"
#include "spectral_cond/conditioning/methods/qr.hpp"
#include "spectral_cond/core/attention.hpp"
#include "spectral_cond/core/multihead.hpp"

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace spectral_cond {
namespace cuda {

/// Number of CUDA devices; 0 when there is none or no usable driver. Never throws.
int device_count() noexcept;
/// True when device_count() > 0.
inline bool available() noexcept {
  return device_count() > 0;
}
/// The device's name (cudaGetDeviceProperties), e.g. "NVIDIA H200". Throws CudaError.
std::string device_name(int device = 0);

class DeviceContext;  // context.cuh

/// Owns a DeviceContext (handles, streams, workspace reused across calls). Create one and pass
/// it to every call; not thread-safe. Throws CudaError when the device cannot be used.
class Context {
 public:
  explicit Context(int device = 0, int lanes = 4);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  Context(Context&&) noexcept;
  Context& operator=(Context&&) noexcept;
  const std::string& device_name() const;
  /// Bytes of device workspace held (buffers are kept for the next call of the same shape).
  std::size_t workspace_bytes() const;
  void release_workspace();
  DeviceContext& device();

 private:
  std::unique_ptr<DeviceContext> impl_;
};

/// A batch of single-head attention problems of one shape: item i is (X_i, W_Q,i, W_K,i, W_V,i).
/// `X` holds one matrix per item, or a single one shared by every item (the heads of a layer).
template <typename Scalar>
struct AttentionBatch {
  std::vector<Mat<Scalar>> X;           ///< N x D each; size 1 (shared) or size()
  std::vector<Mat<Scalar>> WQ, WK, WV;  ///< D x d_k, D x d_k, D x d_v, one per item
  AttentionOptions<Scalar> opts;  ///< scale c and mask, shared by every item (no biases, RoPE)

  /// The batch of one problem (X, W_Q, W_K, W_V), checked: throws naming `fn` as check() does.
  static AttentionBatch single(const Mat<Scalar>& X, const Mat<Scalar>& WQ, const Mat<Scalar>& WK,
                               const Mat<Scalar>& WV, const AttentionOptions<Scalar>& opts,
                               const char* fn) {
    AttentionBatch b;
    b.X = {X};
    b.WQ = {WQ};
    b.WK = {WK};
    b.WV = {WV};
    b.opts = opts;
    b.check(fn);
    return b;
  }

  Index size() const { return static_cast<Index>(WQ.size()); }
  const Mat<Scalar>& x(Index i) const { return X.size() == 1 ? X[0] : X[static_cast<size_t>(i)]; }
  /// Throws std::invalid_argument naming `fn` unless every item has the shape of item 0.
  void check(const char* fn) const {
    if (WQ.empty()) spectral_cond::detail::fail(fn, "the batch is empty");
    if (WK.size() != WQ.size() || WV.size() != WQ.size() ||
        !(X.size() == 1 || X.size() == WQ.size()))
      spectral_cond::detail::fail(
          fn, "X (1 or one per item), W_Q, W_K and W_V must have matching counts");
    const Mat<Scalar>& X0 = x(0);
    for (Index i = 0; i < size(); ++i) {
      const size_t u = static_cast<size_t>(i);
      spectral_cond::detail::check_attention_inputs<Scalar>(fn, x(i), WQ[u], WK[u], WV[u]);
      if (x(i).rows() != X0.rows() || x(i).cols() != X0.cols() || WQ[u].cols() != WQ[0].cols() ||
          WV[u].cols() != WV[0].cols())
        spectral_cond::detail::fail(fn, "every item must have the shape of item 0 (item " +
                                            std::to_string(i) + " differs)");
    }
    opts.check(fn, X0.rows());
    if (opts.extended())
      spectral_cond::detail::fail(fn,
                                  "the CUDA path models neither biases nor RoPE (MATH.md §10); "
                                  "the CPU routines do");
  }
};

/// The heads of a fused multi-head layer as a batch (MATH.md §8): head j gets columns
/// [j d_k, (j+1) d_k) of W_Q and those of its key/value head g = j / (h / h_kv) of W_K, W_V.
template <typename Scalar>
AttentionBatch<Scalar> heads_of_layer(const Mat<Scalar>& X, const Mat<Scalar>& WQ,
                                      const Mat<Scalar>& WK, const Mat<Scalar>& WV,
                                      const MultiHeadOptions<Scalar>& opts) {
  const MultiHeadShape s = opts.check("heads_of_layer", X, WQ, WK, WV);
  AttentionBatch<Scalar> b;
  b.X.push_back(X);
  b.opts = static_cast<const AttentionOptions<Scalar>&>(opts);
  b.opts.scale = opts.resolved_scale(s.d_k);
  for (Index j = 0; j < s.heads; ++j) {
    const Index g = s.kv_of(j);
    b.WQ.push_back(WQ.middleCols(j * s.d_k, s.d_k));
    b.WK.push_back(WK.middleCols(g * s.d_k, s.d_k));
    b.WV.push_back(WV.middleCols(g * s.d_v, s.d_v));
  }
  return b;
}

/// Forward pass of every item (MATH.md §2): Q, K, V, P, A and scale, as attention_forward.
template <typename Scalar>
std::vector<AttentionCache<Scalar>> attention_forward_batched(Context& ctx,
                                                              const AttentionBatch<Scalar>& b);

/// JVP of every item (MATH.md §2) for tangents t[i] (empty members are zero): dA_i (N x d_v).
template <typename Scalar>
std::vector<Mat<Scalar>> attention_jvp_batched(Context& ctx, const AttentionBatch<Scalar>& b,
                                               const std::vector<AttentionTangents<Scalar>>& t);

/// VJP of every item (MATH.md §2) for cotangents G[i] = dL/dA_i: all four gradients.
template <typename Scalar>
std::vector<AttentionGradients<Scalar>> attention_vjp_batched(Context& ctx,
                                                              const AttentionBatch<Scalar>& b,
                                                              const std::vector<Mat<Scalar>>& G);

/// G_i = J_i J_i^T (N d_v x N d_v) of every item from the structured formula of MATH.md §3,
/// never forming J (as attention_gram with JacobianBlock::All).
template <typename Scalar>
std::vector<Mat<Scalar>> attention_gram_batched(Context& ctx, const AttentionBatch<Scalar>& b);

/// The dense J = [J_Q | J_K | J_V] of one head, assembled on the device (MATH.md §3).
template <typename Scalar>
Mat<Scalar> attention_jacobian(Context& ctx, const Mat<Scalar>& X, const Mat<Scalar>& WQ,
                               const Mat<Scalar>& WK, const Mat<Scalar>& WV,
                               const AttentionOptions<Scalar>& opts = {});

/// How the gram route gets σ_max and σ_min from G (docs/cuda.md).
enum class GramSolver {
  Auto,      ///< Syevd when the order of G is <= gram_eig_max, else Cholesky (as the CPU path)
  Syevd,     ///< every eigenvalue by cuSOLVER syevd (the CPU's SelfAdjointEigenSolver)
  Cholesky,  ///< Lanczos on G for λ_max; potrf and Lanczos on G^{-1} for λ_min
};

/// Options of kappa_jacobian_batched. `jacobian` is the CPU path's own options struct: method
/// (Gram, Qr, Matfree or Auto; Dense, Iterative and Lobpcg are CPU-only), tol, rtol,
/// gram_eig_max, lanczos, matfree (the LOBPCG options of the matfree route), progress. `qr`
/// configures the qr route as on the CPU (rtol, lanczos, dense_svd_max).
struct CudaKappaOptions {
  JacobianKappaOptions jacobian;
  QrKappaOptions qr;
  GramSolver gram_solver = GramSolver::Auto;
  /// qr route: R of order <= this is copied to the host and finished by the CPU's code
  /// (dense SVD or Lanczos, qr_kappa.hpp); larger R stays on the device (Lanczos with cuBLAS
  /// triangular products and solves). Default 2048; 0 keeps every R >= 64 on the device.
  Index host_r_max = 2048;
};

/// κ(J) of every item's parameter Jacobian (MATH.md §3–4), in double whatever Scalar is.
///   Gram: J J^T (J wide) or J^T J (J tall, from J assembled on the device) in double, then
///         syevd or Cholesky + Lanczos; accuracy ε κ^2, reported as on the CPU.
///   Qr:   J~ (rank of X from the CPU's truncated SVD) assembled on the device, cuSOLVER geqrf of
///         J~^T (or of J~ when tall), σ of R; accuracy ε κ.
///   Matfree: the CPU's matrix-free driver (kappa_jacobian_matfree, MATH.md §12) with every
///         product J x, J^T x by the device's JVP and VJP, the preconditioner built on the host;
///         wide J only, nothing of order (N d_v)^2 formed; accuracy ε κ + η, as on the CPU.
///   Auto: Gram, then Qr unless the CPU's rule keeps Gram (its ε κ^2 within jacobian.tol).
template <typename Scalar>
std::vector<ConditionResult<double>> kappa_jacobian_batched(Context& ctx,
                                                            const AttentionBatch<Scalar>& b,
                                                            const CudaKappaOptions& o = {});

/// κ of every matrix (MATH.md §4) by cuSOLVER Jacobi SVDs: gesvdjBatched when all matrices
/// share one shape of at most 32 x 32, otherwise gesvdj per matrix on the context's streams.
/// Semantics of condition_from_singular_values (rank, kappa_plus, +inf when singular).
template <typename Scalar>
std::vector<ConditionResult<Scalar>> kappa_batched(Context& ctx,
                                                   const std::vector<Mat<Scalar>>& weights,
                                                   const KappaOptions<Scalar>& opts = {});

/// The exact correction (MATH.md §6, Theorem 3.5) of every matrix, as exact_correction: the SVDs
/// of W and of W + C on the device (gesvdj), C = α U V^T by cuBLAS.
template <typename Scalar>
std::vector<ExactCorrection<Scalar>> exact_correction_batched(
    Context& ctx, const std::vector<Mat<Scalar>>& weights, std::optional<Scalar> target = {});

}  // namespace cuda
}  // namespace spectral_cond
