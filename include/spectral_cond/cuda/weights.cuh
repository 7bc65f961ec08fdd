// spectral_cond CUDA path: κ of many weight matrices at once (MATH.md §4) and the exact
// correction of Theorem 3.5 (MATH.md §6) for all of them, by cuSOLVER Jacobi SVDs:
// gesvdjBatched for matrices of at most 32 x 32 sharing one shape, otherwise gesvdj per matrix
// spread over the context's streams. Matrices with m < n are transposed first (same singular
// values; the correction of W^T is the transpose of that of W).
#pragma once

#include "spectral_cond/cuda/api.hpp"
#include "spectral_cond/cuda/context.cuh"

#include <algorithm>
#include <map>
#include <utility>

namespace spectral_cond {
namespace cuda {
namespace detail {

/// k matrices of one shape m x n (m >= n), contiguous on the device, and their SVDs.
template <typename Scalar>
struct SvdGroup {
  int m = 0, n = 0, k = 0;
  bool vectors = false, batched = false;
  Scalar *A = nullptr, *S = nullptr, *U = nullptr, *V = nullptr;
  long long sU = 0, sV = 0;
  int* info = nullptr;
  long long sA() const { return static_cast<long long>(m) * n; }
};

/// Sizes the group's device arrays (names prefixed by `tag`) and uploads the matrices
/// (transposed where `transpose`).
template <typename Scalar>
SvdGroup<Scalar> make_group(DeviceContext& ctx, const std::string& tag,
                            const std::vector<Mat<Scalar>>& host, bool vectors) {
  SvdGroup<Scalar> g;
  g.m = to_int(host[0].rows(), "rows");
  g.n = to_int(host[0].cols(), "cols");
  g.k = to_int(static_cast<Index>(host.size()), "matrices");
  g.vectors = vectors;
  g.batched = g.m <= 32 && g.n <= 32;
  g.sU = g.batched ? static_cast<long long>(g.m) * g.m : static_cast<long long>(g.m) * g.n;
  g.sV = static_cast<long long>(g.n) * g.n;
  const size_t k = static_cast<size_t>(g.k);
  g.A = ctx.buffer<Scalar>(tag + "A", k * static_cast<size_t>(g.sA()));
  g.S = ctx.buffer<Scalar>(tag + "S", k * static_cast<size_t>(g.n));
  g.U = ctx.buffer<Scalar>(tag + "U", k * static_cast<size_t>(g.sU));
  g.V = ctx.buffer<Scalar>(tag + "V", k * static_cast<size_t>(g.sV));
  g.info = ctx.buffer<int>(tag + "info", k);
  for (size_t j = 0; j < k; ++j)
    upload(host[j], g.A + j * static_cast<size_t>(g.sA()), ctx.stream());
  SC_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));
  return g;
}

/// Runs every SVD of the group (destroying A) and waits for them.
template <typename Scalar>
void run_svds(DeviceContext& ctx, const std::string& tag, SvdGroup<Scalar>& g) {
  if (g.batched) {
    Lane& l = ctx.lane(0);
    const int lw = blas::gesvdj_batched_lwork(l.solver, g.vectors, g.m, g.n, g.A, g.m, g.S, g.U,
                                              g.m, g.V, g.n, l.svdj, g.k);
    Scalar* work = ctx.buffer<Scalar>(tag + "work", static_cast<size_t>(std::max(lw, 1)));
    blas::gesvdj_batched(l.solver, g.vectors, g.m, g.n, g.A, g.m, g.S, g.U, g.m, g.V, g.n, work, lw,
                         g.info, l.svdj, g.k);
  } else {
    const int lanes = std::min(ctx.lanes(), g.k);
    const int lw = blas::gesvdj_lwork(ctx.lane(0).solver, g.vectors, g.m, g.n, g.A, g.m, g.S, g.U,
                                      g.m, g.V, g.n, ctx.lane(0).svdj);
    std::vector<Scalar*> work;
    for (int l = 0; l < lanes; ++l)
      work.push_back(ctx.buffer<Scalar>(tag + "work" + std::to_string(l),
                                        static_cast<size_t>(std::max(lw, 1))));
    SC_CUDA_CHECK(cudaDeviceSynchronize());  // the uploads (lane 0) precede every lane's work
    for (int j = 0; j < g.k; ++j) {
      Lane& l = ctx.lane(j % lanes);
      blas::gesvdj(l.solver, g.vectors, g.m, g.n, g.A + j * g.sA(), g.m, g.S + j * g.n,
                   g.U + j * g.sU, g.m, g.V + j * g.sV, g.n, work[static_cast<size_t>(j % lanes)],
                   lw, g.info + j, l.svdj);
    }
  }
  ctx.synchronize();
}

/// Singular values (decreasing) and gesvdj's info of every matrix of the group.
template <typename Scalar>
void fetch_values(DeviceContext& ctx, const SvdGroup<Scalar>& g, std::vector<Vec<Scalar>>& sv,
                  std::vector<int>& info) {
  Mat<Scalar> S = download(static_cast<const Scalar*>(g.S), g.n, g.k, ctx.stream());
  info.assign(static_cast<size_t>(g.k), 0);
  SC_CUDA_CHECK(cudaMemcpy(info.data(), g.info, sizeof(int) * info.size(), cudaMemcpyDeviceToHost));
  sv.clear();
  for (int j = 0; j < g.k; ++j) {
    Vec<Scalar> s = S.col(j);
    std::sort(s.data(), s.data() + s.size(), [](Scalar a, Scalar b) { return a > b; });
    sv.push_back(s);
  }
}

/// Indices of the finite matrices, grouped by their shape after transposing to m >= n.
template <typename Scalar>
std::map<std::pair<Index, Index>, std::vector<size_t>> group_by_shape(
    const std::vector<Mat<Scalar>>& w, std::vector<bool>& finite) {
  std::map<std::pair<Index, Index>, std::vector<size_t>> groups;
  finite.assign(w.size(), false);
  for (size_t i = 0; i < w.size(); ++i) {
    finite[i] = w[i].allFinite();
    if (!finite[i]) continue;
    const Index m = std::max(w[i].rows(), w[i].cols()), n = std::min(w[i].rows(), w[i].cols());
    groups[{m, n}].push_back(i);
  }
  return groups;
}

template <typename Scalar>
Mat<Scalar> tall(const Mat<Scalar>& w) {
  return w.rows() >= w.cols() ? w : Mat<Scalar>(w.transpose());
}

}  // namespace detail

template <typename Scalar>
std::vector<ConditionResult<Scalar>> kappa_batched(Context& context,
                                                   const std::vector<Mat<Scalar>>& weights,
                                                   const KappaOptions<Scalar>& opts) {
  constexpr const char* fn = "cuda::kappa_batched";
  opts.check(fn);
  for (const auto& w : weights) spectral_cond::detail::check_nonempty<Scalar>(fn, w);
  DeviceContext& ctx = context.device();
  std::vector<ConditionResult<Scalar>> out(weights.size());
  std::vector<bool> finite;
  for (const auto& kv : detail::group_by_shape(weights, finite)) {
    std::vector<Mat<Scalar>> host;
    for (size_t i : kv.second) host.push_back(detail::tall(weights[i]));
    auto g = detail::make_group(ctx, "wk_", host, false);
    detail::run_svds(ctx, "wk_", g);
    std::vector<Vec<Scalar>> sv;
    std::vector<int> info;
    detail::fetch_values(ctx, g, sv, info);
    const char* method = g.batched ? "cusolver_gesvdj_batched" : "cusolver_gesvdj";
    for (size_t j = 0; j < kv.second.size(); ++j) {
      const Mat<Scalar>& w = weights[kv.second[j]];
      ConditionResult<Scalar> r =
          condition_from_singular_values<Scalar>(sv[j], w.rows(), w.cols(), opts, method);
      if (info[j] != 0) {
        r.info = Info::NotConverging;
        r.note = "cuSOLVER gesvdj returned info = " + std::to_string(info[j]) +
                 " (no convergence within its sweeps)" + (r.note.empty() ? "" : "; " + r.note);
      }
      out[kv.second[j]] = r;
    }
  }
  for (size_t i = 0; i < weights.size(); ++i)
    if (!finite[i]) {
      out[i] = spectral_cond::detail::invalid_condition<Scalar>("M contains NaN or Inf");
      out[i].method = "none";
    }
  return out;
}

template <typename Scalar>
std::vector<ExactCorrection<Scalar>> exact_correction_batched(
    Context& context, const std::vector<Mat<Scalar>>& weights, std::optional<Scalar> target) {
  constexpr const char* fn = "cuda::exact_correction_batched";
  spectral_cond::detail::check_target<Scalar>(fn, target);
  for (const auto& w : weights) spectral_cond::detail::check_nonempty<Scalar>(fn, w);
  DeviceContext& ctx = context.device();
  std::vector<ExactCorrection<Scalar>> out(weights.size());
  std::vector<bool> finite;
  for (const auto& kv : detail::group_by_shape(weights, finite)) {
    std::vector<Mat<Scalar>> host;
    for (size_t i : kv.second) host.push_back(detail::tall(weights[i]));
    // 1. SVD of every W (with vectors), keeping a copy of W.
    auto g = detail::make_group(ctx, "ec_", host, true);
    const size_t total = static_cast<size_t>(g.k) * static_cast<size_t>(g.sA());
    Scalar* W = ctx.buffer<Scalar>("ec_W", total);
    Scalar* C = ctx.buffer<Scalar>("ec_C", total);
    Scalar* Wc = ctx.buffer<Scalar>("ec_Wc", total);
    SC_CUDA_CHECK(
        cudaMemcpyAsync(W, g.A, total * sizeof(Scalar), cudaMemcpyDeviceToDevice, ctx.stream()));
    SC_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));
    detail::run_svds(ctx, "ec_", g);
    std::vector<Vec<Scalar>> sv, sv2;
    std::vector<int> info, info2;
    detail::fetch_values(ctx, g, sv, info);
    // 2. C = α U V^T (α of MATH.md §6) and W + C; 3. the SVD of W + C, for the report.
    std::vector<Scalar> alpha;
    cublasHandle_t h = ctx.blas();
    for (int j = 0; j < g.k; ++j) {
      const Vec<Scalar>& s = sv[static_cast<size_t>(j)];
      alpha.push_back(spectral_cond::detail::exact_alpha<Scalar>(s(0), s(s.size() - 1), target));
      const long long o = j * g.sA();
      blas::gemm(h, false, true, g.m, g.n, g.n, alpha.back(), g.U + j * g.sU, g.m, g.V + j * g.sV,
                 g.n, Scalar(0), C + o, g.m);
      blas::geam(h, false, false, g.m, g.n, Scalar(1), W + o, g.m, Scalar(1), C + o, g.m, Wc + o,
                 g.m);
    }
    SC_CUDA_CHECK(
        cudaMemcpyAsync(g.A, Wc, total * sizeof(Scalar), cudaMemcpyDeviceToDevice, ctx.stream()));
    SC_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));
    g.vectors = false;
    detail::run_svds(ctx, "ec2_", g);
    detail::fetch_values(ctx, g, sv2, info2);
    const Mat<Scalar> Ch =
        download(static_cast<const Scalar*>(C), g.m, static_cast<Index>(g.n) * g.k, ctx.stream());
    const Mat<Scalar> Wch =
        download(static_cast<const Scalar*>(Wc), g.m, static_cast<Index>(g.n) * g.k, ctx.stream());
    // 4. The report, by the CPU's own rules (detail::exact_correction_report).
    for (size_t j = 0; j < kv.second.size(); ++j) {
      const Mat<Scalar>& w = weights[kv.second[j]];
      const Index m = w.rows(), n = w.cols();
      ExactCorrection<Scalar> res = spectral_cond::detail::exact_correction_report<Scalar>(
          sv[j], m, n, target, condition_from_singular_values<Scalar>(sv2[j], m, n));
      const Index off = static_cast<Index>(j) * g.n;
      res.C = Ch.middleCols(off, g.n);
      res.W_corrected = Wch.middleCols(off, g.n);
      if (w.rows() < w.cols()) {  // transposed on the way in
        res.C.transposeInPlace();
        res.W_corrected.transposeInPlace();
      }
      if (info[j] != 0 || info2[j] != 0) {
        res.info = Info::NotConverging;
        res.note += std::string(res.note.empty() ? "" : "; ") +
                    "cuSOLVER gesvdj did not converge (info = " + std::to_string(info[j]) + ", " +
                    std::to_string(info2[j]) + ")";
      }
      out[kv.second[j]] = res;
    }
  }
  for (size_t i = 0; i < weights.size(); ++i)
    if (!finite[i]) out[i] = spectral_cond::exact_correction(weights[i], target);
  return out;
}

}  // namespace cuda
}  // namespace spectral_cond
