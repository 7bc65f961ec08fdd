// spectral_cond CUDA path: κ(J) of every head of a batch (MATH.md §3–4, §12), in double, by the
// CPU's own drivers with device backends (backends.cuh): the gram route (G formed on the device,
// read by detail::gram_condition_of: syevd or Cholesky + Lanczos; accuracy ε κ^2), the qr route
// (compressed J~ on the device, cuSOLVER geqrf, R read by detail::condition_of_triangular;
// accuracy ε κ) and the matfree route (detail::matfree_condition with J x and J^T x by the
// device's JVP and VJP; accuracy ε κ + η). auto takes the CPU's plan (plan.hpp) over the two
// accurate routes, matfree and qr: never gram.
#pragma once

#include "spectral_cond/conditioning/methods/matfree.hpp"
#include "spectral_cond/conditioning/methods/plan.hpp"
#include "spectral_cond/cuda/backends.cuh"
#include "spectral_cond/cuda/gram.cuh"
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
  d.opts = spectral_cond::detail::to_double(b.opts);  // as the CPU's kj_inputs
  d.opts.scale = static_cast<double>(b.opts.resolved_scale(b.WQ[0].cols()));
  return d;
}

/// The gram route for item i (MATH.md §3, §12): G = J J^T (wide J, structured) or J^T J (tall J,
/// from J assembled on the device), read by the CPU's driver gram_condition_of through
/// DeviceGram: every eigenvalue (syevd) or Lanczos + Cholesky, as o.gram_solver says.
inline ConditionResult<double> gram_route(DeviceContext& ctx, const DeviceBatch<double>& d, int i,
                                          const CudaKappaOptions& o,
                                          const JacobianKappaOptions& jo) {
  const Index rows = jacobian_rows(d.N, d.dv);
  const Index cols = jacobian_cols(JacobianBlock::All, d.N, d.D, d.dk, d.dv);
  const bool wide = rows <= cols;
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
  if (jo.progress) jo.progress(0.3);
  const bool every_eigenvalue = o.gram_solver == GramSolver::Syevd ||
                                (o.gram_solver == GramSolver::Auto && n <= jo.gram_eig_max);
  DeviceGram g(ctx, G, n);
  return spectral_cond::detail::gram_condition_of(g, rows, cols, every_eigenvalue, jo);
}

/// The qr route for item i (MATH.md §3, "The compressed Jacobian"): L from the CPU's truncated
/// SVD of X (`L`, host), J~ (or J~^T when J~ is wide, so that the factored matrix is tall)
/// assembled on the device, cuSOLVER geqrf, then σ of R by the CPU's condition_of_triangular:
/// R copied to the host when its order is at most o.host_r_max, else read on the device through
/// DeviceTriangular.
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
  ConditionResult<double> res;
  if (k <= o.host_r_max) {
    const Mat<double> Rh = download(static_cast<const double*>(R), k, k, ctx.stream());
    note << "; R copied to the host";
    res = spectral_cond::detail::condition_of_r(Rh, mJ, nJ, tall, q, note);
  } else {
    const DeviceTriangular Rd(ctx, R, k);
    res = spectral_cond::detail::condition_of_triangular(Rd, mJ, nJ, tall, q, note);
  }
  spectral_cond::detail::qr_structure_note(mJ, C, mJ, C, note);
  if (!res.note.empty()) note << "; " << res.note;
  res.note = note.str();
  res.method = "qr";
  return res;
}

/// The matfree route for item i (MATH.md §12, matfree): kappa_jacobian_matfree's own steps
/// (check_kj_inputs, matfree_condition, validated) with every product by J and J^T on the device
/// (DeviceProducts); the preconditioner, LOBPCG's small dense algebra and the checks on the host.
template <typename Scalar>
ConditionResult<double> matfree_route(DeviceContext& ctx, const AttentionBatch<Scalar>& b, Index i,
                                      const JacobianKappaOptions& jo) {
  namespace cpu = spectral_cond::detail;
  const size_t u = static_cast<size_t>(i);
  if (auto bad = cpu::check_kj_inputs<Scalar>("cuda::kappa_jacobian_batched", b.x(i), b.WQ[u],
                                              b.WK[u], b.WV[u], b.opts, jo, "matfree"))
    return *bad;
  const cpu::KJInputs in = cpu::kj_inputs<Scalar>(b.x(i), b.WQ[u], b.WK[u], b.WV[u], b.opts);
  return cpu::validated(in, cpu::matfree_condition(in, jo, DeviceProductsMaker{&ctx}), jo);
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
      method == JacobianKappaMethod::Lobpcg)
    spectral_cond::detail::fail(fn, std::string("method ") + to_string(method) +
                                        " is CPU-only (use gram, qr, matfree or auto)");
  DeviceContext& ctx = context.device();
  std::vector<ConditionResult<double>> out;
  // The options of item i: the drivers' progress, from 0 to 1, mapped into the batch's.
  auto item_options = [&o, &b](Index i) {
    JacobianKappaOptions jo = o.jacobian;
    if (jo.progress)
      jo.progress = [&o, &b, i](double f) {
        o.jacobian.progress((static_cast<double>(i) + f) / static_cast<double>(b.size()));
      };
    return jo;
  };
  if (method == JacobianKappaMethod::Matfree) {  // host inputs; J x and J^T x on the device
    for (Index i = 0; i < b.size(); ++i)
      out.push_back(detail::matfree_route(ctx, b, i, item_options(i)));
    return out;
  }
  const AttentionBatch<double> bd = detail::to_double_batch(b);
  detail::DeviceBatch<double> d = detail::upload_batch(ctx, bd);
  detail::forward(ctx, d);
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
    const JacobianKappaOptions jo = item_options(i);
    ConditionResult<double> res;
    if (method == JacobianKappaMethod::Gram) {
      res = detail::gram_route(ctx, d, i, o, jo);
    } else if (method == JacobianKappaMethod::Qr) {
      res = qr();
    } else {  // Auto: the CPU's plan (plan.hpp) over the GPU's accurate routes, matfree and qr
      KappaShape shape;
      shape.N = bd.x(i).rows();
      shape.D = bd.x(i).cols();
      shape.d_k = bd.WQ[u].cols();
      shape.d_v = bd.WV[u].cols();
      const KappaPlan plan =
          plan_kappa_jacobian(shape, jo, {JacobianKappaMethod::Matfree, JacobianKappaMethod::Qr});
      std::string why = plan.why;
      if (plan.order.empty()) {
        res = spectral_cond::detail::invalid_condition<double>("");
        res.info = Info::TooLarge;
        res.method = "auto";
      } else {
        for (std::size_t k = 0; k < plan.order.size(); ++k) {
          res = plan.order[k].method == JacobianKappaMethod::Matfree
                    ? detail::matfree_route(ctx, b, i, jo)
                    : qr();
          if (res.info == Info::Success || res.info == Info::Singular || k + 1 == plan.order.size())
            break;
          why += std::string("; ") + to_string(plan.order[k].method) + " did not answer (" +
                 to_string(res.info) + "), so " + to_string(plan.order[k + 1].method);
        }
      }
      res.note = res.note.empty() ? why : why + "; " + res.note;
    }
    out.push_back(res);
    if (o.jacobian.progress) o.jacobian.progress(double(i + 1) / double(d.batch));
  }
  return out;
}

}  // namespace cuda
}  // namespace spectral_cond
