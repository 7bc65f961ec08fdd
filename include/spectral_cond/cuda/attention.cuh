// spectral_cond CUDA path: batched attention forward, JVP and VJP (MATH.md §1–2), by
// strided-batched GEMMs and the row kernels of kernels.cuh. Item i of a batch is one head:
// (X_i, W_Q,i, W_K,i, W_V,i); X may be shared by all items (stride 0).
#pragma once

#include "spectral_cond/cuda/api.hpp"
#include "spectral_cond/cuda/context.cuh"
#include "spectral_cond/cuda/kernels.cuh"

namespace spectral_cond {
namespace cuda {
namespace detail {

/// Device views of a batch (all items of one shape) and of its forward pass.
template <typename Scalar>
struct DeviceBatch {
  int N = 0, D = 0, dk = 0, dv = 0, batch = 0;
  Scalar c = 0;
  int mask = 0;               ///< 0 none, 1 causal, 2 additive (M)
  const Scalar* M = nullptr;  ///< N x N additive mask
  Scalar* X = nullptr;
  long long sX = 0;  ///< 0 when X is shared
  Scalar *WQ = nullptr, *WK = nullptr, *WV = nullptr;
  Scalar *Q = nullptr, *K = nullptr, *V = nullptr, *P = nullptr, *A = nullptr;
  long long sW(int d) const { return static_cast<long long>(D) * d; }
  long long sN(int d) const { return static_cast<long long>(N) * d; }
};

/// Copies matrices of one shape into one contiguous device array.
template <typename Scalar>
void upload_packed(const std::vector<const Mat<Scalar>*>& ms, Scalar* dst, cudaStream_t s) {
  size_t off = 0;
  for (const Mat<Scalar>* m : ms) {
    upload(*m, dst + off, s);
    off += static_cast<size_t>(m->size());
  }
}

template <typename Scalar>
std::vector<const Mat<Scalar>*> pointers(const std::vector<Mat<Scalar>>& v) {
  std::vector<const Mat<Scalar>*> p;
  for (const auto& m : v) p.push_back(&m);
  return p;
}

/// Uploads the batch into the context's workspace and sizes the forward buffers.
template <typename Scalar>
DeviceBatch<Scalar> upload_batch(DeviceContext& ctx, const AttentionBatch<Scalar>& b) {
  DeviceBatch<Scalar> d;
  const Mat<Scalar>& X0 = b.x(0);
  d.N = to_int(X0.rows(), "N");
  d.D = to_int(X0.cols(), "D");
  d.dk = to_int(b.WQ[0].cols(), "d_k");
  d.dv = to_int(b.WV[0].cols(), "d_v");
  d.batch = to_int(b.size(), "batch size");
  d.c = b.opts.resolved_scale(b.WQ[0].cols());
  d.mask = b.opts.mask == MaskKind::Causal ? 1 : b.opts.mask == MaskKind::Additive ? 2 : 0;
  const size_t n = static_cast<size_t>(d.batch), N = static_cast<size_t>(d.N);
  cudaStream_t s = ctx.stream();
  const size_t nx = b.X.size();
  d.sX = nx == 1 ? 0 : static_cast<long long>(N) * d.D;
  d.X = ctx.buffer<Scalar>("X", nx * N * static_cast<size_t>(d.D));
  upload_packed(pointers(b.X), d.X, s);
  d.WQ = ctx.buffer<Scalar>("WQ", n * static_cast<size_t>(d.sW(d.dk)));
  d.WK = ctx.buffer<Scalar>("WK", n * static_cast<size_t>(d.sW(d.dk)));
  d.WV = ctx.buffer<Scalar>("WV", n * static_cast<size_t>(d.sW(d.dv)));
  upload_packed(pointers(b.WQ), d.WQ, s);
  upload_packed(pointers(b.WK), d.WK, s);
  upload_packed(pointers(b.WV), d.WV, s);
  if (d.mask == 2) {
    Scalar* M = ctx.buffer<Scalar>("mask", N * N);
    upload(b.opts.additive_mask, M, s);
    d.M = M;
  }
  d.Q = ctx.buffer<Scalar>("Q", n * static_cast<size_t>(d.sN(d.dk)));
  d.K = ctx.buffer<Scalar>("K", n * static_cast<size_t>(d.sN(d.dk)));
  d.V = ctx.buffer<Scalar>("V", n * static_cast<size_t>(d.sN(d.dv)));
  d.P = ctx.buffer<Scalar>("P", n * N * N);
  d.A = ctx.buffer<Scalar>("A", n * static_cast<size_t>(d.sN(d.dv)));
  return d;
}

/// out_i = X_i W_i for every item (N x d).
template <typename Scalar>
void project(DeviceContext& ctx, const DeviceBatch<Scalar>& d, const Scalar* X, long long sX,
             const Scalar* W, int dcols, Scalar beta, Scalar* out) {
  blas::gemm_batched(ctx.blas(), false, false, d.N, dcols, d.D, Scalar(1), X, d.N, sX, W, d.D,
                     d.sW(dcols), beta, out, d.N, d.sN(dcols), d.batch);
}

/// Forward pass of every item (MATH.md §2) into d.Q, d.K, d.V, d.P, d.A.
template <typename Scalar>
void forward(DeviceContext& ctx, DeviceBatch<Scalar>& d) {
  project(ctx, d, d.X, d.sX, d.WQ, d.dk, Scalar(0), d.Q);
  project(ctx, d, d.X, d.sX, d.WK, d.dk, Scalar(0), d.K);
  project(ctx, d, d.X, d.sX, d.WV, d.dv, Scalar(0), d.V);
  const long long sP = static_cast<long long>(d.N) * d.N;
  blas::gemm_batched(ctx.blas(), false, true, d.N, d.N, d.dk, d.c, d.Q, d.N, d.sN(d.dk), d.K, d.N,
                     d.sN(d.dk), Scalar(0), d.P, d.N, sP, d.batch);
  kernels::softmax_rows<Scalar>
      <<<dim3(static_cast<unsigned>(d.N), static_cast<unsigned>(d.batch)), kernels::kRowThreads, 0,
         ctx.stream()>>>(d.P, d.N, sP, d.mask, d.M);
  SC_CUDA_CHECK_LAUNCH("softmax_rows");
  blas::gemm_batched(ctx.blas(), false, false, d.N, d.dv, d.N, Scalar(1), d.P, d.N, sP, d.V, d.N,
                     d.sN(d.dv), Scalar(0), d.A, d.N, d.sN(d.dv), d.batch);
}

/// Uploads item-wise matrices of one shape (empty ones as zeros) and returns the device array,
/// or nullptr when every item's matrix is empty.
template <typename Scalar>
Scalar* upload_optional(DeviceContext& ctx, const char* name,
                        const std::vector<const Mat<Scalar>*>& ms, Index rows, Index cols,
                        const char* fn, const char* what) {
  bool any = false;
  for (const Mat<Scalar>* m : ms) any = any || m->size() > 0;
  if (!any) return nullptr;
  const size_t per = static_cast<size_t>(rows * cols);
  Scalar* dst = ctx.buffer<Scalar>(name, per * ms.size());
  const Mat<Scalar> zero = Mat<Scalar>::Zero(rows, cols);
  for (size_t i = 0; i < ms.size(); ++i) {
    const Mat<Scalar>& m = ms[i]->size() > 0 ? *ms[i] : zero;
    spectral_cond::detail::require_shape(fn, what, "the shape of its weight or X", rows, cols, m);
    upload(m, dst + i * per, ctx.stream());
  }
  SC_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));  // `zero` dies at return
  return dst;
}

/// JVP of every item after forward(d) (MATH.md §2): dA_i (N x d_v, stride N d_v) for the device
/// tangents dW_Q, dW_K, dW_V (stride D d), dX (stride N D); nullptr stands for a zero tangent.
template <typename Scalar>
void jvp(DeviceContext& ctx, const DeviceBatch<Scalar>& d, const Scalar* dWQ, const Scalar* dWK,
         const Scalar* dWV, const Scalar* dX, Scalar* dA) {
  const size_t n = static_cast<size_t>(d.batch);
  const long long sXt = d.sN(d.D), sP = static_cast<long long>(d.N) * d.N;
  auto tangent = [&](const char* name, const Scalar* dW, const Scalar* W, int cols) -> Scalar* {
    if (dW == nullptr && dX == nullptr) return nullptr;
    Scalar* out = ctx.buffer<Scalar>(name, n * static_cast<size_t>(d.sN(cols)));
    Scalar beta = 0;
    if (dW != nullptr) {
      detail::project(ctx, d, d.X, d.sX, dW, cols, Scalar(0), out);
      beta = 1;
    }
    if (dX != nullptr) detail::project(ctx, d, dX, sXt, W, cols, beta, out);
    return out;
  };
  Scalar* dQ = tangent("dQ", dWQ, d.WQ, d.dk);
  Scalar* dK = tangent("dK", dWK, d.WK, d.dk);
  Scalar* dV = tangent("dV", dWV, d.WV, d.dv);
  Scalar beta = 0;
  if (dQ != nullptr || dK != nullptr) {  // dZ / c = dQ K^T + Q dK^T, then the softmax derivative
    Scalar* S = ctx.buffer<Scalar>("S", n * static_cast<size_t>(sP));
    Scalar b2 = 0;
    if (dQ != nullptr) {
      blas::gemm_batched(ctx.blas(), false, true, d.N, d.N, d.dk, Scalar(1), dQ, d.N, d.sN(d.dk),
                         d.K, d.N, d.sN(d.dk), Scalar(0), S, d.N, sP, d.batch);
      b2 = 1;
    }
    if (dK != nullptr)
      blas::gemm_batched(ctx.blas(), false, true, d.N, d.N, d.dk, Scalar(1), d.Q, d.N, d.sN(d.dk),
                         dK, d.N, d.sN(d.dk), b2, S, d.N, sP, d.batch);
    kernels::softmax_project<Scalar>
        <<<dim3(static_cast<unsigned>(d.N), static_cast<unsigned>(d.batch)), kernels::kRowThreads,
           0, ctx.stream()>>>(S, d.P, d.N, sP, d.c);
    SC_CUDA_CHECK_LAUNCH("softmax_project");
    blas::gemm_batched(ctx.blas(), false, false, d.N, d.dv, d.N, Scalar(1), S, d.N, sP, d.V, d.N,
                       d.sN(d.dv), Scalar(0), dA, d.N, d.sN(d.dv), d.batch);
    beta = 1;
  }
  if (dV != nullptr)
    blas::gemm_batched(ctx.blas(), false, false, d.N, d.dv, d.N, Scalar(1), d.P, d.N, sP, dV, d.N,
                       d.sN(d.dv), beta, dA, d.N, d.sN(d.dv), d.batch);
  else if (beta == Scalar(0))
    SC_CUDA_CHECK(
        cudaMemsetAsync(dA, 0, n * static_cast<size_t>(d.sN(d.dv)) * sizeof(Scalar), ctx.stream()));
}

/// VJP of every item after forward(d) (MATH.md §2) for the device cotangents dG (N x d_v, stride
/// N d_v): the gradients with respect to W_Q, W_K, W_V (stride D d each) and, unless gX is
/// nullptr, X (stride N D).
template <typename Scalar>
void vjp(DeviceContext& ctx, const DeviceBatch<Scalar>& d, const Scalar* dG, Scalar* gWQ,
         Scalar* gWK, Scalar* gWV, Scalar* gX) {
  cublasHandle_t h = ctx.blas();
  const size_t n = static_cast<size_t>(d.batch);
  const long long sP = static_cast<long long>(d.N) * d.N;
  Scalar* gQ = ctx.buffer<Scalar>("dQ", n * static_cast<size_t>(d.sN(d.dk)));
  Scalar* gK = ctx.buffer<Scalar>("dK", n * static_cast<size_t>(d.sN(d.dk)));
  Scalar* gV = ctx.buffer<Scalar>("dV", n * static_cast<size_t>(d.sN(d.dv)));
  Scalar* S = ctx.buffer<Scalar>("S", n * static_cast<size_t>(sP));
  // dL/dV = P^T G;  dL/dP = G V^T;  dL/dZ = P ∘ (dL/dP - rowsum(P ∘ dL/dP) 1^T)
  blas::gemm_batched(h, true, false, d.N, d.dv, d.N, Scalar(1), d.P, d.N, sP, dG, d.N, d.sN(d.dv),
                     Scalar(0), gV, d.N, d.sN(d.dv), d.batch);
  blas::gemm_batched(h, false, true, d.N, d.N, d.dv, Scalar(1), dG, d.N, d.sN(d.dv), d.V, d.N,
                     d.sN(d.dv), Scalar(0), S, d.N, sP, d.batch);
  kernels::softmax_project<Scalar>
      <<<dim3(static_cast<unsigned>(d.N), static_cast<unsigned>(d.batch)), kernels::kRowThreads, 0,
         ctx.stream()>>>(S, d.P, d.N, sP, Scalar(1));
  SC_CUDA_CHECK_LAUNCH("softmax_project");
  // dL/dQ = c dL/dZ K;  dL/dK = c (dL/dZ)^T Q
  blas::gemm_batched(h, false, false, d.N, d.dk, d.N, d.c, S, d.N, sP, d.K, d.N, d.sN(d.dk),
                     Scalar(0), gQ, d.N, d.sN(d.dk), d.batch);
  blas::gemm_batched(h, true, false, d.N, d.dk, d.N, d.c, S, d.N, sP, d.Q, d.N, d.sN(d.dk),
                     Scalar(0), gK, d.N, d.sN(d.dk), d.batch);
  // dL/dW_• = X^T dL/d•;  dL/dX = Σ dL/d• W_•^T
  auto wgrad = [&](const Scalar* g, int cols, Scalar* out) {
    blas::gemm_batched(h, true, false, d.D, cols, d.N, Scalar(1), d.X, d.N, d.sX, g, d.N,
                       d.sN(cols), Scalar(0), out, d.D, d.sW(cols), d.batch);
  };
  wgrad(gQ, d.dk, gWQ);
  wgrad(gK, d.dk, gWK);
  wgrad(gV, d.dv, gWV);
  if (gX == nullptr) return;
  auto xgrad = [&](const Scalar* g, const Scalar* W, int cols, Scalar beta) {
    blas::gemm_batched(h, false, true, d.N, d.D, cols, Scalar(1), g, d.N, d.sN(cols), W, d.D,
                       d.sW(cols), beta, gX, d.N, d.sN(d.D), d.batch);
  };
  xgrad(gQ, d.WQ, d.dk, Scalar(0));
  xgrad(gK, d.WK, d.dk, Scalar(1));
  xgrad(gV, d.WV, d.dv, Scalar(1));
}

}  // namespace detail

template <typename Scalar>
std::vector<AttentionCache<Scalar>> attention_forward_batched(Context& context,
                                                              const AttentionBatch<Scalar>& b) {
  b.check("cuda::attention_forward_batched");
  DeviceContext& ctx = context.device();
  detail::DeviceBatch<Scalar> d = detail::upload_batch(ctx, b);
  detail::forward(ctx, d);
  std::vector<AttentionCache<Scalar>> out(static_cast<size_t>(d.batch));
  for (int i = 0; i < d.batch; ++i) {
    AttentionCache<Scalar>& c = out[static_cast<size_t>(i)];
    c.Q = download(d.Q + i * d.sN(d.dk), d.N, d.dk, ctx.stream());
    c.K = download(d.K + i * d.sN(d.dk), d.N, d.dk, ctx.stream());
    c.V = download(d.V + i * d.sN(d.dv), d.N, d.dv, ctx.stream());
    c.P = download(d.P + static_cast<long long>(i) * d.N * d.N, d.N, d.N, ctx.stream());
    c.A = download(d.A + i * d.sN(d.dv), d.N, d.dv, ctx.stream());
    c.scale = d.c;
  }
  return out;
}

template <typename Scalar>
std::vector<Mat<Scalar>> attention_jvp_batched(Context& context, const AttentionBatch<Scalar>& b,
                                               const std::vector<AttentionTangents<Scalar>>& t) {
  constexpr const char* fn = "cuda::attention_jvp_batched";
  b.check(fn);
  if (static_cast<Index>(t.size()) != b.size())
    spectral_cond::detail::fail(fn, "one tangent per item");
  DeviceContext& ctx = context.device();
  detail::DeviceBatch<Scalar> d = detail::upload_batch(ctx, b);
  detail::forward(ctx, d);
  std::vector<const Mat<Scalar>*> q, k, v, x;
  for (const auto& ti : t) {
    q.push_back(&ti.dWQ);
    k.push_back(&ti.dWK);
    v.push_back(&ti.dWV);
    x.push_back(&ti.dX);
  }
  Scalar* dWQ = detail::upload_optional(ctx, "tWQ", q, d.D, d.dk, fn, "dW_Q");
  Scalar* dWK = detail::upload_optional(ctx, "tWK", k, d.D, d.dk, fn, "dW_K");
  Scalar* dWV = detail::upload_optional(ctx, "tWV", v, d.D, d.dv, fn, "dW_V");
  Scalar* dX = detail::upload_optional(ctx, "tX", x, d.N, d.D, fn, "dX");
  Scalar* dA =
      ctx.buffer<Scalar>("dA", static_cast<size_t>(d.batch) * static_cast<size_t>(d.sN(d.dv)));
  detail::jvp(ctx, d, dWQ, dWK, dWV, dX, dA);
  std::vector<Mat<Scalar>> out;
  for (int i = 0; i < d.batch; ++i)
    out.push_back(download(dA + i * d.sN(d.dv), d.N, d.dv, ctx.stream()));
  return out;
}

template <typename Scalar>
std::vector<AttentionGradients<Scalar>> attention_vjp_batched(Context& context,
                                                              const AttentionBatch<Scalar>& b,
                                                              const std::vector<Mat<Scalar>>& G) {
  constexpr const char* fn = "cuda::attention_vjp_batched";
  b.check(fn);
  if (static_cast<Index>(G.size()) != b.size()) spectral_cond::detail::fail(fn, "one G per item");
  for (const auto& g : G)
    spectral_cond::detail::require_shape(fn, "G", "N x d_v", b.x(0).rows(), b.WV[0].cols(), g);
  DeviceContext& ctx = context.device();
  detail::DeviceBatch<Scalar> d = detail::upload_batch(ctx, b);
  detail::forward(ctx, d);
  const size_t n = static_cast<size_t>(d.batch);
  Scalar* dG = ctx.buffer<Scalar>("cot", n * static_cast<size_t>(d.sN(d.dv)));
  detail::upload_packed(detail::pointers(G), dG, ctx.stream());
  Scalar* gWQ = ctx.buffer<Scalar>("gWQ", n * static_cast<size_t>(d.sW(d.dk)));
  Scalar* gWK = ctx.buffer<Scalar>("gWK", n * static_cast<size_t>(d.sW(d.dk)));
  Scalar* gWV = ctx.buffer<Scalar>("gWV", n * static_cast<size_t>(d.sW(d.dv)));
  Scalar* gX = ctx.buffer<Scalar>("gX", n * static_cast<size_t>(d.sN(d.D)));
  detail::vjp(ctx, d, static_cast<const Scalar*>(dG), gWQ, gWK, gWV, gX);
  std::vector<AttentionGradients<Scalar>> out(n);
  for (int i = 0; i < d.batch; ++i) {
    auto& o = out[static_cast<size_t>(i)];
    o.dWQ = download(gWQ + i * d.sW(d.dk), d.D, d.dk, ctx.stream());
    o.dWK = download(gWK + i * d.sW(d.dk), d.D, d.dk, ctx.stream());
    o.dWV = download(gWV + i * d.sW(d.dv), d.D, d.dv, ctx.stream());
    o.dX = download(gX + i * d.sN(d.D), d.N, d.D, ctx.stream());
  }
  return out;
}

}  // namespace cuda
}  // namespace spectral_cond
