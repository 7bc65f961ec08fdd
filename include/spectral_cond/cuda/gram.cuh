// spectral_cond CUDA path: the structured pieces of MATH.md §3 on the device, and from them the
// Gram matrix G = J J^T (never forming J), the dense J of one head, and the compressed J~.
#pragma once

#include "spectral_cond/cuda/attention.cuh"

namespace spectral_cond {
namespace cuda {
namespace detail {

/// Pointers to item i of a batch.
template <typename Scalar>
struct Item {
  const Scalar *X, *Q, *K, *V, *P, *A;
  Item(const DeviceBatch<Scalar>& d, int i)
      : X(d.X + i * d.sX),
        Q(d.Q + i * d.sN(d.dk)),
        K(d.K + i * d.sN(d.dk)),
        V(d.V + i * d.sN(d.dv)),
        P(d.P + static_cast<long long>(i) * d.N * d.N),
        A(d.A + i * d.sN(d.dv)) {}
};

/// out ((N d_v) x m) with out.col(j) = vec(s (P (u_j ∘ V) - (P u_j) ∘ A)), u_j the columns of
/// U (N x m): MATH.md §3's 𝔅 (U = K), 𝔈 (U = X) and E~ (U = L). One N x N by N x (m d_v) GEMM.
template <typename Scalar>
void stacked_products(DeviceContext& ctx, const DeviceBatch<Scalar>& d, const Item<Scalar>& it,
                      const Scalar* U, int m, Scalar s, Scalar* out) {
  const int N = d.N, dv = d.dv;
  const size_t wide_n = static_cast<size_t>(N) * m * dv;
  Scalar* wide = ctx.buffer<Scalar>("wide", wide_n);
  Scalar* PU = ctx.buffer<Scalar>("PU", static_cast<size_t>(N) * m);
  kernels::launch("hadamard_wide", wide_n, ctx.stream(), kernels::hadamard_wide<Scalar>, wide, U,
                  it.V, N, m, dv);
  const int wcols = to_int(static_cast<Index>(m) * dv, "m d_v");
  blas::gemm(ctx.blas(), false, false, N, wcols, N, Scalar(1), it.P, N, wide, N, Scalar(0), out, N);
  blas::gemm(ctx.blas(), false, false, N, m, N, Scalar(1), it.P, N, U, N, Scalar(0), PU, N);
  kernels::launch("stacked_finish", wide_n, ctx.stream(), kernels::stacked_finish<Scalar>, out, PU,
                  it.A, N, m, dv, s);
}

/// 𝔅 = c [vec B_b] ((N d_v) x d_k), 𝔈 = c [vec E_a] ((N d_v) x D) and P X (N x D) of item i.
template <typename Scalar>
struct Parts {
  Scalar *B, *E, *PX;
};
template <typename Scalar>
Parts<Scalar> jacobian_parts(DeviceContext& ctx, const DeviceBatch<Scalar>& d, int i) {
  const Item<Scalar> it(d, i);
  const size_t R = static_cast<size_t>(d.N) * d.dv;
  Parts<Scalar> p;
  p.B = ctx.buffer<Scalar>("partB", R * static_cast<size_t>(d.dk));
  p.E = ctx.buffer<Scalar>("partE", R * static_cast<size_t>(d.D));
  p.PX = ctx.buffer<Scalar>("partPX", static_cast<size_t>(d.N) * d.D);
  stacked_products(ctx, d, it, it.K, d.dk, d.c, p.B);
  stacked_products(ctx, d, it, it.X, d.D, d.c, p.E);
  blas::gemm(ctx.blas(), false, false, d.N, d.D, d.N, Scalar(1), it.P, d.N, it.X, d.N, Scalar(0),
             p.PX, d.N);
  return p;
}

/// Lower triangle of G = J J^T of item i (MATH.md §3, the Gram matrix without J):
///   G = (1 1^T ⊗ X X^T) ∘ (𝔅 𝔅^T) + (1 1^T ⊗ Q Q^T) ∘ (𝔈 𝔈^T) + I_{d_v} ⊗ (P X X^T P^T)
/// (𝔅, 𝔈 carry c). Two SYRKs of (N d_v) rows, inner D and d_k, and two Hadamard passes.
/// `G` is (N d_v) x (N d_v) with leading dimension N d_v; the upper triangle is not written.
template <typename Scalar>
void gram_lower(DeviceContext& ctx, const DeviceBatch<Scalar>& d, int i, Scalar* G) {
  const Item<Scalar> it(d, i);
  const Parts<Scalar> p = jacobian_parts(ctx, d, i);
  const int N = d.N, R = to_int(static_cast<Index>(N) * d.dv, "N d_v");
  const size_t NN = static_cast<size_t>(N) * N, RR = static_cast<size_t>(R) * R;
  Scalar* XX = ctx.buffer<Scalar>("gramXX", NN);
  Scalar* QQ = ctx.buffer<Scalar>("gramQQ", NN);
  Scalar* PP = ctx.buffer<Scalar>("gramPP", NN);
  Scalar* T = ctx.buffer<Scalar>("gramT", RR);
  cublasHandle_t h = ctx.blas();
  blas::gemm(h, false, true, N, N, d.D, Scalar(1), it.X, N, it.X, N, Scalar(0), XX, N);
  blas::gemm(h, false, true, N, N, d.dk, Scalar(1), it.Q, N, it.Q, N, Scalar(0), QQ, N);
  blas::gemm(h, false, true, N, N, d.D, Scalar(1), p.PX, N, p.PX, N, Scalar(0), PP, N);
  blas::syrk_lower(h, R, d.D, Scalar(1), p.E, R, Scalar(0), G, R);
  kernels::launch("hadamard_tile_lower", RR, ctx.stream(), kernels::hadamard_tile_lower<Scalar>, G,
                  static_cast<const Scalar*>(QQ), N, R);
  blas::syrk_lower(h, R, d.dk, Scalar(1), p.B, R, Scalar(0), T, R);
  kernels::launch("gram_finish_lower", RR, ctx.stream(), kernels::gram_finish_lower<Scalar>, G,
                  static_cast<const Scalar*>(T), static_cast<const Scalar*>(XX),
                  static_cast<const Scalar*>(PP), N, R);
}

/// The dense J of item i into `J` ((N d_v) x (2 D d_k + D d_v), leading dimension N d_v).
template <typename Scalar>
void jacobian(DeviceContext& ctx, const DeviceBatch<Scalar>& d, int i, Scalar* J) {
  const Item<Scalar> it(d, i);
  const Parts<Scalar> p = jacobian_parts(ctx, d, i);
  const size_t n = static_cast<size_t>(d.N) * d.dv *
                   (2 * static_cast<size_t>(d.D) * d.dk + static_cast<size_t>(d.D) * d.dv);
  kernels::launch("assemble_jacobian", n, ctx.stream(), kernels::assemble_jacobian<Scalar>, J, it.X,
                  it.Q, static_cast<const Scalar*>(p.B), static_cast<const Scalar*>(p.E),
                  static_cast<const Scalar*>(p.PX), d.N, d.D, d.dk, d.dv);
}

/// The compressed J~ of item i (MATH.md §3) from L = U_X Σ_X (device, N x r): J~ itself
/// ((N d_v) x r (2 d_k + d_v)) or, when `transposed`, J~^T. Returns the number of columns of J~.
template <typename Scalar>
Index compressed(DeviceContext& ctx, const DeviceBatch<Scalar>& d, int i, const Scalar* L, int r,
                 bool transposed, Scalar* out) {
  const Item<Scalar> it(d, i);
  const size_t R = static_cast<size_t>(d.N) * d.dv;
  Scalar* B = ctx.buffer<Scalar>("partB", R * static_cast<size_t>(d.dk));
  Scalar* E = ctx.buffer<Scalar>("partE", R * static_cast<size_t>(r));
  Scalar* PL = ctx.buffer<Scalar>("partPL", static_cast<size_t>(d.N) * r);
  stacked_products(ctx, d, it, it.K, d.dk, Scalar(1), B);
  stacked_products(ctx, d, it, L, r, Scalar(1), E);
  blas::gemm(ctx.blas(), false, false, d.N, r, d.N, Scalar(1), it.P, d.N, L, d.N, Scalar(0), PL,
             d.N);
  const Index C = static_cast<Index>(r) * (2 * d.dk + d.dv);
  kernels::launch("assemble_compressed", R * static_cast<size_t>(C), ctx.stream(),
                  kernels::assemble_compressed<Scalar>, out, transposed, L, it.Q,
                  static_cast<const Scalar*>(B), static_cast<const Scalar*>(E),
                  static_cast<const Scalar*>(PL), d.N, r, d.dk, d.dv, d.c);
  return C;
}

}  // namespace detail

template <typename Scalar>
std::vector<Mat<Scalar>> attention_gram_batched(Context& context, const AttentionBatch<Scalar>& b) {
  b.check("cuda::attention_gram_batched");
  DeviceContext& ctx = context.device();
  detail::DeviceBatch<Scalar> d = detail::upload_batch(ctx, b);
  detail::forward(ctx, d);
  const Index R = static_cast<Index>(d.N) * d.dv;
  Scalar* G = ctx.buffer<Scalar>("G", static_cast<size_t>(R * R));
  std::vector<Mat<Scalar>> out;
  for (int i = 0; i < d.batch; ++i) {
    detail::gram_lower(ctx, d, i, G);
    kernels::launch("mirror_lower", static_cast<size_t>(R * R), ctx.stream(),
                    kernels::mirror_lower<Scalar>, G, static_cast<int>(R));
    out.push_back(download(static_cast<const Scalar*>(G), R, R, ctx.stream()));
  }
  return out;
}

template <typename Scalar>
Mat<Scalar> attention_jacobian(Context& context, const Mat<Scalar>& X, const Mat<Scalar>& WQ,
                               const Mat<Scalar>& WK, const Mat<Scalar>& WV,
                               const AttentionOptions<Scalar>& opts) {
  const auto b = AttentionBatch<Scalar>::single(X, WQ, WK, WV, opts, "cuda::attention_jacobian");
  DeviceContext& ctx = context.device();
  detail::DeviceBatch<Scalar> d = detail::upload_batch(ctx, b);
  detail::forward(ctx, d);
  const Index rows = jacobian_rows(d.N, d.dv);
  const Index cols = jacobian_cols(JacobianBlock::All, d.N, d.D, d.dk, d.dv);
  Scalar* J = ctx.buffer<Scalar>("J", static_cast<size_t>(rows * cols));
  detail::jacobian(ctx, d, 0, J);
  return download(static_cast<const Scalar*>(J), rows, cols, ctx.stream());
}

}  // namespace cuda
}  // namespace spectral_cond
