// spectral_cond CUDA path: κ(J) of every head of a batch (MATH.md §3–4), in double, by the gram
// route (structured G, then syevd or Cholesky + Lanczos; accuracy ε κ^2) or the qr route
// (compressed J~ on the device, cuSOLVER geqrf, σ of R; accuracy ε κ). The numerical rules
// (rank tolerance, the sqrt(n ε) floor of squared methods, accuracy reports, notes) are the CPU
// path's own functions from jacobian_kappa.hpp and qr_kappa.hpp.
#pragma once

#include "spectral_cond/cuda/gram.cuh"
#include "spectral_cond/cuda/lanczos.cuh"
#include "spectral_cond/jacobian/compressed.hpp"

namespace spectral_cond {
namespace cuda {
namespace detail {

template <typename Scalar>
AttentionBatch<double> to_double_batch(const AttentionBatch<Scalar>& b) {
  AttentionBatch<double> d;
  for (const auto& m : b.X) d.X.push_back(m.template cast<double>());
  for (const auto& m : b.WQ) d.WQ.push_back(m.template cast<double>());
  for (const auto& m : b.WK) d.WK.push_back(m.template cast<double>());
  for (const auto& m : b.WV) d.WV.push_back(m.template cast<double>());
  d.opts.scale = static_cast<double>(b.opts.resolved_scale(b.WQ[0].cols()));
  d.opts.mask = b.opts.mask;
  if (b.opts.mask == MaskKind::Additive)
    d.opts.additive_mask = b.opts.additive_mask.template cast<double>();
  return d;
}

/// The gram route for item i (MATH.md §3): G = J J^T (wide J, structured) or J^T J (tall J,
/// from J assembled on the device), then every eigenvalue (syevd) or Lanczos + Cholesky.
inline ConditionResult<double> gram_route(DeviceContext& ctx, const DeviceBatch<double>& d, int i,
                                          const CudaKappaOptions& o) {
  const JacobianKappaOptions& jo = o.jacobian;
  const Index rows = jacobian_rows(d.N, d.dv);
  const Index cols = jacobian_cols(JacobianBlock::All, d.N, d.D, d.dk, d.dv);
  const bool wide = rows <= cols;
  const char* which = wide ? "J J^T" : "J^T J";
  const int n = to_int(wide ? rows : cols, "order of the Gram matrix");
  double* G = ctx.buffer<double>("G", static_cast<size_t>(n) * n);
  if (wide) {
    gram_lower(ctx, d, i, G);
  } else {
    double* J = ctx.buffer<double>("J", static_cast<size_t>(rows * cols));
    jacobian(ctx, d, i, J);
    blas::syrk_lower_t(ctx.blas(), n, to_int(rows, "rows of J"), 1.0, J, static_cast<int>(rows),
                       0.0, G, n);
  }
  int* info_d = ctx.buffer<int>("info", 1);
  int info = 0;
  const bool syevd = o.gram_solver == GramSolver::Syevd ||
                     (o.gram_solver == GramSolver::Auto && n <= jo.gram_eig_max);
  ConditionResult<double> res;
  if (syevd) {
    double* w = ctx.buffer<double>("eig", static_cast<size_t>(n));
    const int lw = blas::syevd_lwork(ctx.solver(), n, G, n, w);
    double* work = ctx.buffer<double>("solver_work", static_cast<size_t>(std::max(lw, 1)));
    blas::syevd(ctx.solver(), n, G, n, w, work, lw, info_d);
    Vec<double> lam(n);
    SC_CUDA_CHECK(cudaMemcpyAsync(lam.data(), w, sizeof(double) * static_cast<size_t>(n),
                                  cudaMemcpyDeviceToHost, ctx.stream()));
    SC_CUDA_CHECK(
        cudaMemcpyAsync(&info, info_d, sizeof(int), cudaMemcpyDeviceToHost, ctx.stream()));
    SC_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));
    res = spectral_cond::detail::condition_from_gram_eigenvalues(
        lam, rows, cols, jo, std::string("gram (eigenvalues of ") + which + ", cuSOLVER syevd)");
    if (info != 0) {
      res.info = Info::NotConverging;
      res.note = "cuSOLVER syevd returned info = " + std::to_string(info) +
                 (res.note.empty() ? "" : "; " + res.note);
    }
  } else {  // as the CPU: Lanczos for λ_max(G); Cholesky and Lanczos on G^{-1} for λ_min(G)
    res.method = std::string("gram (Lanczos and cuSOLVER Cholesky of ") + which + ")";
    DeviceOp op(ctx, G, n, OpKind::SymLower);
    const LanczosOutcome big = spectral_cond::detail::lanczos_largest(op, jo.lanczos);
    res.iterations += big.iterations;
    res.residual = big.residual;
    const double lmax = big.lambda;
    res.sigma_max = std::sqrt(std::max(0.0, lmax));
    const int lw = blas::potrf_lwork(ctx.solver(), n, G, n);
    double* work = ctx.buffer<double>("solver_work", static_cast<size_t>(std::max(lw, 1)));
    blas::potrf(ctx.solver(), n, G, n, work, lw, info_d);
    SC_CUDA_CHECK(
        cudaMemcpyAsync(&info, info_d, sizeof(int), cudaMemcpyDeviceToHost, ctx.stream()));
    SC_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));
    const double floor = std::sqrt(static_cast<double>(n) * ScalarTraits<double>::eps());
    if (info != 0) {
      res.sigma_min = 0;
      res.kappa = ScalarTraits<double>::inf();
      res.sigma_min_plus = res.kappa_plus = std::numeric_limits<double>::quiet_NaN();
      res.info = Info::Singular;
      res.note = std::string("Cholesky of ") + which +
                 " failed: singular at working precision (kappa_plus needs method qr or dense)";
    } else {
      DeviceOp inv(ctx, G, n, OpKind::CholInverse);
      const LanczosOutcome small = spectral_cond::detail::lanczos_largest(inv, jo.lanczos);
      res.iterations += small.iterations;
      res.residual = std::max(res.residual, small.residual);
      const double linv = small.lambda;
      res.sigma_min = 1.0 / std::sqrt(linv);
      res.kappa = res.sigma_max / res.sigma_min;
      res.rank = std::min(rows, cols);
      res.sigma_min_plus = res.sigma_min;
      res.kappa_plus = res.kappa;
      if (res.sigma_min < floor * res.sigma_max) {
        res.kappa = ScalarTraits<double>::inf();
        res.info = Info::Singular;
        res.note = "sigma_min below sqrt(n eps) sigma_1: indistinguishable from zero by gram";
      }
      if (!std::isfinite(lmax) || !std::isfinite(linv)) res.info = Info::NotConverging;
    }
  }
  spectral_cond::detail::squared_accuracy(res, jo);
  return res;
}

/// The qr route for item i (MATH.md §3, "The compressed Jacobian"): L from the CPU's truncated
/// SVD of X (`L`, host), J~ (or J~^T when J~ is wide, so that the factored matrix is tall)
/// assembled on the device, cuSOLVER geqrf, then σ of R (host code for small R, else device
/// Lanczos), with the CPU's rules and notes.
inline ConditionResult<double> qr_route(DeviceContext& ctx, const DeviceBatch<double>& d, int i,
                                        const Mat<double>& L, const CudaKappaOptions& o) {
  const QrKappaOptions& q = o.qr;
  const int r = to_int(L.cols(), "rank of X");
  const Index mJ = jacobian_rows(d.N, d.dv);
  const Index nJ = jacobian_cols(JacobianBlock::All, d.N, d.D, d.dk, d.dv);
  const Index C = static_cast<Index>(r) * (2 * d.dk + d.dv);
  const bool tall = mJ > C;  // J~ tall: factor J~ itself; else J~^T
  const int m = to_int(tall ? mJ : C, "rows of the factored matrix");
  const int k = to_int(tall ? C : mJ, "order of R");
  std::ostringstream note;
  note << "J~ from rank(X) = " << r << "; ";
  if (k == 0) {  // X = 0: J~ has no columns
    Vec<double> sv = Vec<double>::Zero(std::min(mJ, nJ));
    KappaOptions<double> ko;
    ko.rtol = q.rtol;
    ConditionResult<double> res = condition_from_singular_values<double>(sv, mJ, nJ, ko, "qr");
    res.note = note.str() + "X has rank 0" + (res.note.empty() ? "" : "; " + res.note);
    return res;
  }
  double* Ld = ctx.buffer<double>("qrL", static_cast<size_t>(L.size()));
  upload(L, Ld, ctx.stream());
  double* M = ctx.buffer<double>("qrM", static_cast<size_t>(m) * static_cast<size_t>(k));
  compressed(ctx, d, i, Ld, r, !tall, M);
  double* tau = ctx.buffer<double>("qrTau", static_cast<size_t>(k));
  int* info_d = ctx.buffer<int>("info", 1);
  const int lw = blas::geqrf_lwork(ctx.solver(), m, k, M, m);
  double* work = ctx.buffer<double>("solver_work", static_cast<size_t>(std::max(lw, 1)));
  blas::geqrf(ctx.solver(), m, k, M, m, tau, work, lw, info_d);
  double* R = ctx.buffer<double>("qrR", static_cast<size_t>(k) * k);
  kernels::launch("extract_upper", static_cast<size_t>(k) * k, ctx.stream(),
                  kernels::extract_upper<double>, R, static_cast<const double*>(M), m, k);
  note << "qr: cuSOLVER geqrf of " << (tall ? "J~ (" : "J~^T (") << m << " x " << k
       << (tall ? ", tall)" : ")");
  const Index rJ = std::min(mJ, nJ);
  ConditionResult<double> res;
  if (k <= o.host_r_max || k < 64 || k < rJ || (tall && k <= q.dense_svd_max)) {
    const Mat<double> Rh = download(static_cast<const double*>(R), k, k, ctx.stream());
    note << "; R copied to the host";
    res = spectral_cond::detail::condition_of_r(Rh, mJ, nJ, tall, q, note);
  } else {
    res = device_condition_of_r(ctx, R, k, mJ, nJ, tall, q, note);
  }
  if (tall)
    note << "; J~ is tall: the gauge directions (W_Q E, -W_K E^T, 0) lie in the null space "
            "(MATH.md 4), kappa_plus is the informative number";
  if (!res.note.empty()) note << "; " << res.note;
  res.note = note.str();
  res.method = "qr";
  return res;
}

}  // namespace detail

template <typename Scalar>
std::vector<ConditionResult<double>> kappa_jacobian_batched(Context& context,
                                                            const AttentionBatch<Scalar>& b,
                                                            const CudaKappaOptions& o) {
  constexpr const char* fn = "cuda::kappa_jacobian_batched";
  o.jacobian.check(fn);
  o.qr.check(fn);
  b.check(fn);
  const JacobianKappaMethod method = o.jacobian.method;
  if (method == JacobianKappaMethod::Dense || method == JacobianKappaMethod::Iterative ||
      method == JacobianKappaMethod::Lobpcg || method == JacobianKappaMethod::Matfree)
    spectral_cond::detail::fail(
        fn, std::string("method ") + to_string(method) + " is CPU-only (use gram, qr or auto)");
  const AttentionBatch<double> bd = detail::to_double_batch(b);
  DeviceContext& ctx = context.device();
  detail::DeviceBatch<double> d = detail::upload_batch(ctx, bd);
  detail::forward(ctx, d);
  std::vector<ConditionResult<double>> out;
  Mat<double> L, VX;
  const Mat<double>* L_of = nullptr;  // X's L, computed once when X is shared
  for (int i = 0; i < d.batch; ++i) {
    const size_t u = static_cast<size_t>(i);
    if (!(bd.x(i).allFinite() && bd.WQ[u].allFinite() && bd.WK[u].allFinite() &&
          bd.WV[u].allFinite())) {
      auto bad =
          spectral_cond::detail::invalid_condition<double>("X or a weight contains NaN or Inf");
      bad.method = to_string(method);
      out.push_back(bad);
      continue;
    }
    auto qr = [&] {
      if (L_of != &bd.x(i)) {
        if (!spectral_cond::detail::truncated_svd<double>(bd.x(i), L, VX)) {
          auto bad =
              spectral_cond::detail::invalid_condition<double>("the SVD of X did not converge");
          bad.info = Info::NotConverging;
          bad.method = to_string(method);
          L_of = nullptr;
          return bad;
        }
        L_of = &bd.x(i);
      }
      return detail::qr_route(ctx, d, i, L, o);
    };
    ConditionResult<double> res;
    if (method == JacobianKappaMethod::Gram) {
      res = detail::gram_route(ctx, d, i, o);
    } else if (method == JacobianKappaMethod::Qr) {
      res = qr();
    } else {  // Auto: gram when its own error estimate is below tol, else qr
      res = detail::gram_route(ctx, d, i, o);
      std::ostringstream why;
      if (res.info != Info::InvalidInput && res.accuracy <= o.jacobian.tol) {
        why << "auto chose gram: its error estimate eps*kappa^2 = " << res.accuracy
            << " is below tol = " << o.jacobian.tol;
      } else {
        why << "auto chose qr: gram's error estimate eps*kappa^2 = " << res.accuracy
            << " exceeds tol = " << o.jacobian.tol;
        res = qr();
      }
      res.note = res.note.empty() ? why.str() : why.str() + "; " + res.note;
    }
    out.push_back(res);
    if (o.jacobian.progress) o.jacobian.progress(double(i + 1) / double(d.batch));
  }
  return out;
}

}  // namespace cuda
}  // namespace spectral_cond
